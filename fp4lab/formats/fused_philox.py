"""Philox4x32-10's float32 uniforms in one compiled pass on the CPU, where one can be built.

What. `fused_uniforms(c0, c1, c2, c3, k0, k1)` gives what `fp4lab.formats.streams` makes of
a grid of counters with float32 uniforms: Philox4x32-10 (`fp4lab.formats.philox`) of each
counter, each of its four words w rounded toward zero to 24 significant bits and scaled by
2^-32, the four side by side along the last dim. The same bits as the eager path
(`philox4x32`, then `streams`' float32 conversion); it returns None where it does not apply
(then the caller runs the eager path).

Why. The eager rounds are torch passes over int64 buffers, ten a round and about eighty a
counter, each reading and writing memory; stochastic rounding of one attention backward
draws tens of millions of uniforms that way. Compiled, a counter's words stay in registers
through the ten rounds: one pass (the figures: benchmarks/RESULTS.md, session 24).

How. `torch.compile` (inductor's C++ backend) of plain torch integer arithmetic. Integer
arithmetic has one answer whatever order or fusion a compiler picks, so the compiled code
gives the eager words. Two cautions keep it so: no int64 operation may overflow, which is
undefined behaviour in the C++ inductor writes, so each 32 x 32-bit product m c is taken as
c m' with m' = m - 2^31 (below 2^63: both Philox multipliers exceed 2^31) and its c 2^31 part
as shifts (`_mul_hi_lo`); and no float arithmetic may decide a bit, since inductor compiles
with fast-math flags that may rewrite it, so the rounding toward zero to 24 bits clears the
word's low bits as an integer (`_toward_zero_24`). The only float operations left are the
conversion of an integer of at most 24 significant bits to float32 and the scaling by 2^-32,
both exact. All of it vectorises (one multiply a product; no bit casts, which inductor
writes as scalar loops).

When. CPU counters on a grid (`_grid`): c0 varying at most along the leading dims and the
last, c1 along the leading dims and the second-to-last, c2 and c3 along the leading dims
only (the streams' positions: the column's counter, the row, the head and the batch), int
keys, and at least `MIN_COUNTERS` counters (smaller draws would spend more on the call than
they save; sizes of one are left to the eager path, since the compiler specialises them).
The first call compiles (seconds; inductor caches the result on disk, keyed by the code),
and so may a call whose sizes fall into a new pattern. Where it cannot be built (no C++
compiler, a Python or platform torch.compile does not support, any error while compiling
or running it), the first failure turns it off for the process and the eager path runs,
to the same bits. The environment variable ``FP4LAB_FUSED_PHILOX=0`` turns it off too.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from fp4lab.formats import native_philox
from fp4lab.formats.philox import (
    PHILOX_W32_0,
    PHILOX_W32_1,
    PHILOX_M4x32_0,
    PHILOX_M4x32_1,
    _check_arguments,
)

__all__ = ["MIN_COUNTERS", "fused_uniforms", "enabled"]

MIN_COUNTERS = 1 << 16
"""The fewest counters (a quarter of the uniforms) a draw takes the compiled path with."""

_WORD_MASK = 0xFFFFFFFF
_ROUNDS = 10
_state = {"kernel": None, "failed": os.environ.get("FP4LAB_FUSED_PHILOX", "1") == "0"}


def enabled() -> bool:
    """Whether the compiled path may run: not turned off, and not failed in this process."""
    return not _state["failed"]


def fused_uniforms(c0, c1, c2, c3, k0, k1) -> torch.Tensor | None:
    """The float32 uniforms of the counters (c0, c1, c2, c3) under the int key words
    (k0, k1), (..., 4 n) for the counters' broadcast shape (..., n), or None where the
    compiled path does not apply (the module docstring, "When")."""
    grid = _grid(c0, c1, c2, c3, k0, k1)
    if grid is None:
        return None
    _check_arguments(c0, c1, c2, c3, k0, k1, _ROUNDS)
    shape, counters = grid
    u = native_philox.grid_uniforms(*counters, k0, k1)  # the C function, where it builds
    if u is not None:
        return u.view(*shape[:-1], 4 * shape[-1])
    try:
        u = _kernel()(*counters, torch.tensor(k0), torch.tensor(k1))
    except Exception:  # no compiler, an unsupported platform, ...: the eager path from now on
        _state["failed"] = True
        return None
    return u.view(*shape[:-1], 4 * shape[-1])


def _grid(c0, c1, c2, c3, k0, k1):
    """(broadcast shape, counters as (P, 1, n), (P, r, 1), (P, 1, 1), (P, 1, 1)) where the
    compiled path applies, else None. P counts the leading dims' elements, r and n are the
    last two dims."""
    words = (c0, c1, c2, c3)
    if not enabled() or not all(isinstance(k, int) for k in (k0, k1)):
        return None
    if not all(isinstance(c, torch.Tensor) and c.device.type == "cpu" for c in words):
        return None
    shape = torch.broadcast_shapes(*(c.shape for c in words))
    if len(shape) < 2 or math.prod(shape) < MIN_COUNTERS:
        return None
    lead, (r, n) = shape[:-2], shape[-2:]
    if min(math.prod(lead), r, n) < 2:
        return None
    # which of the last two dims each word may vary along: c0 the last, c1 the one before
    own = ((False, True), (True, False), (False, False), (False, False))
    out = []
    for c, (along_rows, along_columns) in zip(words, own, strict=True):
        c = c.reshape((1,) * (len(shape) - c.ndim) + tuple(c.shape))
        if (c.shape[-2] != 1 and not along_rows) or (c.shape[-1] != 1 and not along_columns):
            return None
        tail = (r if along_rows else 1, n if along_columns else 1)
        out.append(c.expand(*lead, *tail).reshape(-1, *tail).contiguous())
    return shape, out


def _kernel():
    """The compiled `_uniforms`, built at the first call."""
    if _state["kernel"] is None:
        _require_compiler()
        _state["kernel"] = _compiled(torch.compile(_uniforms, dynamic=True))
    return _state["kernel"]


def _require_compiler() -> None:
    """Raise where inductor finds no working C++ compiler: at once, where compiling would
    fail only after seconds of tracing."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # a torch without this check: the compile itself tells
        return
    get_cpp_compiler()


def _compiled(kernel):
    """`kernel` called without duck sizing: equal sizes at the first call (P == r, say)
    would otherwise be assumed equal forever, and every other shape would recompile."""
    try:
        from torch.fx.experimental import _config as fx_config

        patch = lambda: fx_config.patch(use_duck_shape=False)  # noqa: E731
    except (ImportError, AttributeError):  # a torch without the setting: recompiles, no more
        patch = contextlib.nullcontext

    def call(*args):
        with patch():
            return kernel(*args)

    return call


def _uniforms(c0, c1, c2, c3, k0, k1) -> torch.Tensor:
    """Philox4x32-10 of the broadcast counters under the key words (0-dim int64 tensors),
    as float32 uniforms, the four words of a counter side by side (..., 4 n)."""
    for _ in range(_ROUNDS):
        hi0, lo0 = _mul_hi_lo(c0, PHILOX_M4x32_0)
        hi1, lo1 = _mul_hi_lo(c2, PHILOX_M4x32_1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_W32_0) & _WORD_MASK, (k1 + PHILOX_W32_1) & _WORD_MASK
    words = torch.broadcast_tensors(c0, c1, c2, c3)
    return torch.stack([_toward_zero_24(w) * 2.0**-32 for w in words], dim=-1).flatten(-2)


def _mul_hi_lo(c: torch.Tensor, m: int):
    """The high and low 32-bit words of m c for uint32 words c and m >= 2^31, with no int64
    past 2^63: m c = t + c 2^31 with t = c (m - 2^31), so the high word is
    floor((floor(t / 2) + c 2^30) / 2^31) and the low word is t's with bit 31 flipped where
    c is odd (t xor c 2^31, masked)."""
    t = c * (m - (1 << 31))
    return ((t >> 1) + (c << 30)) >> 31, (t ^ (c << 31)) & _WORD_MASK


def _toward_zero_24(w: torch.Tensor) -> torch.Tensor:
    """A uint32 word rounded toward zero to its 24 leading bits, as a float32 (exact): the
    word's bits below its 24 leading ones, max(0, bit length - 24) of them, are cleared by
    a mask smeared down from w >> 24 (s | s >> 1, ... covers its 8 bits), then the integer
    of at most 24 significant bits is converted, exactly. The eager path's values
    (`fp4lab.formats.streams` clears the same bits of the word's float64)."""
    s = w >> 24
    s = s | (s >> 1)
    s = s | (s >> 2)
    s = s | (s >> 4)
    return (w & ~s).to(torch.float32)
