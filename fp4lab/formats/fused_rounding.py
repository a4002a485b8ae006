"""A block quantizer's element steps in one compiled pass on the CPU, where one can be built.

What. `fused_block_values(blocks, factor, scales, decode, fmt, rounding, u, clip_at)` gives
what the eager steps of `fp4lab.formats.quantize` make of blocks of finite float32 elements
(..., blocks, block elements) under a multiplying scale arithmetic: the scaled elements
x = blocks * factor, rounded into the element format (`rounding._round_float32`), then
dequantized, (value * block scale) * decode, and, with `clip_at`, each block's count of
|x| > clip_at (the trace's clipped elements). The same bits as the eager steps; it returns
None where it does not apply (then the caller runs them).

Why. The eager steps are some twenty torch passes over the block's elements (a scaling,
about fifteen in the rounding, two in the dequantization, four for the count), each reading
and writing memory; an attention backward with stochastic rounding makes about fifty such
quantizations of 2^20 elements. Compiled, an element stays in registers through all of
them: one pass.

How. `torch.compile` (inductor's C++ backend) of the steps as plain torch float arithmetic,
each an exact or a correctly rounded IEEE operation in the eager order, so any fusion gives
the eager bits: x = blocks * factor (one rounding, as eager); the quantum 2^q of |x| by
comparisons with the powers of two of the format's binades, not by masking x's exponent
bits (inductor writes bit casts as scalar loops), and |x| / 2^q as |x| * 2^-q (exact, or
the same correctly rounded subnormal); the rounding of it to an integer r (even, toward
zero, or up where u < frac: the comparison's decision is the eager ceil(frac - u)'s,
`rounding._stochastic_magnitude`); min(r 2^q, max) with x's sign, exact; the two products
of the dequantization in their order. Inductor compiles with IEEE semantics kept (no
reassociation, reciprocals or contraction: ``-fno-unsafe-math-optimizations``,
``-ffp-contract=off``). NaN is kept out: the caller runs the eager steps where a block
holds NaN or inf (a NaN's payload could differ), and x's infinities from finite blocks
(a zero scale's clamped reciprocal) round as the eager steps round them.

When. CPU float32 contiguous blocks with at least `MIN_ELEMENTS` elements, a signed format
with zero, no FNUZ zero and at most `MAX_BINADES` binades above its subnormals
(E2M1 has 4), rounded to nearest even, toward zero, or stochastically with float32
uniforms and no `sr_bits`. The first call of a format and rounding compiles (seconds;
inductor caches it on disk). Where it cannot be built, the first failure turns it off for
the process and the eager steps run, to the same bits; ``FP4LAB_FUSED_ROUNDING=0`` turns
it off too.
"""

from __future__ import annotations

import os
import types

import torch

from fp4lab.formats.float_format import FloatFormat, Specials
from fp4lab.formats.fused_philox import _compiled, _require_compiler
from fp4lab.formats.rounding import Rounding

__all__ = ["MIN_ELEMENTS", "MAX_BINADES", "fused_block_values", "block_amax", "takes",
           "enabled"]

MIN_ELEMENTS = 1 << 16
"""The fewest elements a quantization takes the compiled path with."""

MAX_BINADES = 8
"""The most comparisons the quantum may take (binades from emin to emax + 1)."""

_ROUNDINGS = (Rounding.NEAREST_EVEN, Rounding.TOWARD_ZERO, Rounding.STOCHASTIC)
_state = {"kernels": {}, "failed": os.environ.get("FP4LAB_FUSED_ROUNDING", "1") == "0"}


def enabled() -> bool:
    """Whether the compiled path may run: not turned off, and not failed in this process."""
    return not _state["failed"]


def takes(fmt: FloatFormat, rounding: Rounding) -> bool:
    """Whether the compiled path takes this format and rounding (the module docstring,
    "When"; stochastic rounding also needs float32 uniforms and no `sr_bits`)."""
    return (
        enabled()
        and fmt.signed
        and fmt.has_zero
        and fmt.specials is not Specials.FNUZ
        and fmt.emax + 2 - fmt.emin <= MAX_BINADES
        and fmt.emin - fmt.mbits >= -126
        and fmt.emax + 1 - fmt.mbits <= 126
        and rounding in _ROUNDINGS
    )


def fused_block_values(blocks, factor, scales, decode, fmt: FloatFormat, rounding: Rounding,
                       u=None, clip_at: float | None = None):
    """(values, clipped) for blocks of finite float32 elements, (rows, size) with factor,
    scales and decode (rows, 1), or (P, size, C) (each block a column of size elements)
    with them (P, 1, C); decode may be None: values (round(blocks * factor) * scales) *
    decode in blocks' layout, clipped float32 counts of |blocks * factor| > clip_at per
    block, (rows,) or (P, C) (None without clip_at). None where the compiled path does not
    apply. `u`: the stochastic rounding's float32 uniforms of blocks' shape."""
    tensors = [t for t in (blocks, factor, scales, decode, u) if t is not None]
    if not (
        takes(fmt, rounding)
        and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                for t in tensors)
        and blocks.numel() >= MIN_ELEMENTS
        and (u is None or u.shape == blocks.shape)
        and (rounding is not Rounding.STOCHASTIC or u is not None)
    ):
        return None
    # detached: no views (torch.compile would guard on, and recompile for, their bases)
    args = [t.detach() if t is not None else None for t in (blocks, factor, scales, decode, u)]
    try:
        return _kernel(fmt, rounding, clip_at)(*args)
    except Exception:  # no compiler, an unsupported platform, ...: the eager steps from now on
        _state["failed"] = True
        return None


def block_amax(blocks: torch.Tensor) -> torch.Tensor | None:
    """max |x| over each block of float32 blocks, (rows, size) -> (rows,) or (P, size, C)
    -> (P, C), by one compiled pass (a maximum is exact in any order), or None where the
    compiled path does not apply or a block holds NaN (the caller's ways give NaN its
    canonical bits)."""
    if not (enabled() and blocks.device.type == "cpu" and blocks.dtype == torch.float32
            and blocks.is_contiguous() and blocks.numel() >= MIN_ELEMENTS):
        return None
    try:
        if "amax" not in _state["kernels"]:
            _require_compiler()
            _state["kernels"]["amax"] = _compiled(torch.compile(_amax, dynamic=True))
        amax = _state["kernels"]["amax"](blocks.detach())
    except Exception:  # no compiler, an unsupported platform, ...: the eager steps from now on
        _state["failed"] = True
        return None
    return None if bool(amax.max().isnan()) else amax  # NaN propagates through the max


def _amax(blocks):
    return blocks.abs().amax(1)


def _kernel(fmt: FloatFormat, rounding: Rounding, clip_at: float | None):
    """The compiled steps for a format, a rounding and a count, built at their first call."""
    key = (fmt.emin, fmt.emax, fmt.mbits, float(fmt.max), rounding, clip_at)
    if key not in _state["kernels"]:
        _require_compiler()
        steps = _own_code(_block_values(fmt, rounding, clip_at), len(_state["kernels"]))
        _state["kernels"][key] = _compiled(torch.compile(steps, dynamic=True))
    return _state["kernels"][key]


def _own_code(steps, n: int):
    """`steps` with a code object of its own: torch.compile keeps a function's compiled
    variants, up to a small limit, per code object, which every format's closure shares."""
    code = steps.__code__.replace(co_name=f"{steps.__name__}_{n}")
    return types.FunctionType(code, steps.__globals__, code.co_name, None, steps.__closure__)


def _block_values(fmt: FloatFormat, rounding: Rounding, clip_at: float | None):
    """The steps on blocks (rows, size) or (P, size, C) (`fused_block_values`), the
    format's numbers constants of the code (not arguments, which inductor would read from
    memory)."""
    # the quantum 2^q = 2^(max(e, emin) - mbits) of |x|'s binade e, clamped at emax + 1
    lowest = (2.0 ** (fmt.emin - fmt.mbits), 2.0 ** (fmt.mbits - fmt.emin))
    binades = [(2.0**e, 2.0 ** (e - fmt.mbits), 2.0 ** (fmt.mbits - e))
               for e in range(fmt.emin + 1, fmt.emax + 2)]  # (floor, 2^q, 2^-q)
    top = float(fmt.max)

    def steps(blocks, factor, scales, decode, u):
        x = blocks * factor
        a = x.abs()
        q, inverse = torch.full_like(a, lowest[0]), torch.full_like(a, lowest[1])
        for floor, quantum, inverse_quantum in binades:
            above = a >= floor
            q = torch.where(above, quantum, q)
            inverse = torch.where(above, inverse_quantum, inverse)
        y = a * inverse  # |x| / 2^q: the format's grid is the integers
        if rounding is Rounding.STOCHASTIC:
            low = torch.floor(y)
            r = low + (u < y - low).to(torch.float32)
        elif rounding is Rounding.NEAREST_EVEN:
            r = torch.round(y)
        else:
            r = torch.trunc(y)
        values = torch.copysign(torch.clamp(r * q, max=top), x) * scales
        if decode is not None:
            values = values * decode
        clipped = (a > clip_at).to(torch.float32).sum(1) if clip_at is not None else None
        return values, clipped

    return steps
