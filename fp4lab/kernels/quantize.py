"""Fused Triton quantizers: `fake_quantize`, `quantize` and `quantize_packed` for every block
format, bit for bit the reference's (`fp4lab.formats.quantize`).

What. The reference quantizes in a dozen torch passes over block-shaped copies of x, on the GPU
far from the memory bandwidth. Here one kernel reads each element once, finds its
block's amax in registers, computes the block scale in the float32 order the spec's
`ScaleArithmetic` prescribes, rounds the element into the element format and writes the
fake-quantized value, the code, the packed code (two FP4 codes a byte) and the scale, as asked.
Formats with a tensor scale (NVFP4) need the tensor's amax first: a separate amax pass, so they
read x twice. Every field of the `QuantSpec` (element and scale formats, rule, arithmetic,
rounding) becomes a compile-time constant, so a user's own format gets its own kernel.

How x is seen. x is read in place through its strides as planes (G, R, C) (a copy only where
its strides cannot be merged so), and blocks are (BR, BC) tiles of a plane. 1-D blocks of n
along the last axis are (1, n) over (rows, last dim); along any other axis (n, 1) over (that
axis, the dims after it), so a block of keys along the sequence reads columns of a (B, H, S, D)
tensor in place; 2-D tiles (r, c) lie over the last two dims (transposed when `axis` is the
second last); a per-tensor spec has one block per plane. A program loads a tile as a (blocks of
rows, rows of a block, blocks of columns, columns of a block) tensor, padded to powers of two
and masked, so the amax and the scale of each block are reductions over axes 3 and 1, and a
partial block reads zeros, as the reference pads. Blocks too large for a tile (FlashAttention-3's
128 x 256 tiles, per-tensor scales) take their amax from a first pass into a buffer.

The arithmetic, and why it is the reference's bits. Each `ScaleRule` and `ScaleArithmetic` member
documents its float32 operations; the kernels do those operations in that order: every division
is `tl.math.div_rn` (Triton's `/` lowers to an approximate division on NVIDIA GPUs), a
multiplication by an exact power-of-two reciprocal stands in for a division only where the two
are the same number, and fused multiply-adds are off. Rounding onto a format works on float32 as
the reference's `_round_float32` does: the quantum 2^q comes from the exponent bits of |x|,
clamped to the format's binades, |x| / 2^q is exact and is rounded to an integer on its floor and
fraction, then scaled back, saturated, given its sign and, for `quantize`, encoded. Rounding to
nearest even, the common case, is float32's own: (|x| + 2^(q + 23)) - 2^(q + 23) rounds |x| to a
multiple of 2^q in two additions (libdevice's `rint` would need the division and the product
around it, and Triton's interpreter, where the tests run, has no libdevice). Stochastic rounding
compares the fraction with float64 uniforms, from the caller's `noise` (element i rounded with
noise[i], as the reference takes it) or drawn in the kernel from `fp4lab.kernels.random`'s
Philox4x32 keyed by `seed` and the element's row-major position (`philox_noise` gives the same
uniforms in torch, to hand to the reference). Float constants travel as their float32 bit
patterns, so no literal is rounded or widened to float64 on the way. bfloat16 is read by a shift
of its bits and written by the GPU's round-to-nearest-even conversion; under the interpreter,
whose own bfloat16 cast truncates, by the same rounding done on the bits.

What is not a kernel. The Hadamard transform (and so MS-EDEN's rotation) is the reference's own
torch matmul with `hadamard_matrix`, run before and after the kernels: a matrix product's float32
sums in a Triton `tl.dot` are ordered differently from cuBLAS's or MKL's, so an in-kernel
transform could not give the reference's bits, while the same torch call on the same device
does. MS-EDEN's correction sums <v, v> and <v, q> in float64, as the reference does, but in a
different order; all terms are non-negative, so both sums are within 15 ulp (float64) of the
exact value and round to the same float32 unless the exact sum lies that close to a float32
rounding boundary (about one block in 2^25), and even then the BF16 rounding of the corrected
scale almost always hides it.

Launches. A call's shapes, strides, spec and outputs fix everything but its tensors' data, so
the constants, tiles and strides are worked out once per such call signature (`_BlocksPlan`),
and after a kernel's first launch through `triton.jit` the compiled kernel is called directly:
Python's share of a call stays well under the GPU's time at large sizes. `LaunchConfig` sets
tiles and warps; the defaults are the configurations `benchmarks/bench_quantize_gpu.py` found
fastest on the H200.

What it does not do, each a clear error: float64 input (the reference's float64 path), CPU
tensors unless Triton's interpreter is on (TRITON_INTERPRET=1, read at call time), a
`torch.Generator` (its stream cannot be reproduced in a kernel: pass `noise` or `seed`), formats
outside float32's exponent range, empty tensors, packing of codes that are not 4 or 8 bits wide.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from fp4lab.formats import philox
from fp4lab.formats.float_format import FloatFormat, Specials
from fp4lab.formats.quantize import (
    QuantizedTensor,
    _hadamard,
    _normalize_axis,
    resolve_spec,
)
from fp4lab.formats.rounding import Rounding, round_to_format
from fp4lab.formats.spec import Correction, QuantSpec, ScaleArithmetic, ScaleRule
from fp4lab.kernels.launch import launch
from fp4lab.kernels.random import philox4x32, uniform53

__all__ = [
    "LaunchConfig", "FAKE_QUANTIZE_CONFIG", "CODES_CONFIG", "PackedQuantized", "fake_quantize",
    "fake_quantize_factored", "fake_quantize_stored", "StoredScale", "quantize",
    "quantize_packed", "philox_noise", "first_pass_elements",
]

# -- compile-time codes of the enums (the kernels branch on them) -------------------------------
OCP_FLOOR: tl.constexpr = tl.constexpr(0)
CEIL: tl.constexpr = tl.constexpr(1)
EVEN: tl.constexpr = tl.constexpr(2)
RCEIL: tl.constexpr = tl.constexpr(3)
NEAREST: tl.constexpr = tl.constexpr(4)
ALPHA_CEIL: tl.constexpr = tl.constexpr(5)
ALPHA_MSE: tl.constexpr = tl.constexpr(6)
ALPHA_HALF: tl.constexpr = tl.constexpr(7)
ALPHA_RTE: tl.constexpr = tl.constexpr(8)
_RULES = {
    ScaleRule.OCP_FLOOR: 0, ScaleRule.CEIL: 1, ScaleRule.EVEN: 2, ScaleRule.RCEIL: 3,
    ScaleRule.NEAREST: 4, ScaleRule.ALPHA_CEIL: 5, ScaleRule.ALPHA_MSE: 6,
    ScaleRule.ALPHA_HALF: 7, ScaleRule.ALPHA_RTE: 8,
}

EXACT: tl.constexpr = tl.constexpr(0)
TE_ENCODE: tl.constexpr = tl.constexpr(1)
TORCHAO_DECODE: tl.constexpr = tl.constexpr(2)
RECIPROCAL: tl.constexpr = tl.constexpr(3)
DIVIDE_UNROUNDED: tl.constexpr = tl.constexpr(4)
_ARITHMETICS = {
    ScaleArithmetic.EXACT: 0, ScaleArithmetic.TE_ENCODE: 1, ScaleArithmetic.TORCHAO_DECODE: 2,
    ScaleArithmetic.RECIPROCAL: 3, ScaleArithmetic.DIVIDE_UNROUNDED: 4,
}

NEAREST_EVEN: tl.constexpr = tl.constexpr(0)
NEAREST_AWAY: tl.constexpr = tl.constexpr(1)
TOWARD_ZERO: tl.constexpr = tl.constexpr(2)
AWAY_FROM_ZERO: tl.constexpr = tl.constexpr(3)
STOCHASTIC: tl.constexpr = tl.constexpr(4)
_ROUNDINGS = {
    Rounding.NEAREST_EVEN: 0, Rounding.NEAREST_AWAY: 1, Rounding.TOWARD_ZERO: 2,
    Rounding.AWAY_FROM_ZERO: 3, Rounding.STOCHASTIC: 4,
}

NOISE_NONE: tl.constexpr = tl.constexpr(0)
NOISE_TENSOR: tl.constexpr = tl.constexpr(1)
NOISE_PHILOX: tl.constexpr = tl.constexpr(2)

FLOAT32: tl.constexpr = tl.constexpr(0)  # how x is read and the output written
BFLOAT16: tl.constexpr = tl.constexpr(1)  # read as int16 bits; written by the GPU's own cast
FLOAT16: tl.constexpr = tl.constexpr(2)
NO_OUTPUT: tl.constexpr = tl.constexpr(3)
BFLOAT16_BITS: tl.constexpr = tl.constexpr(4)  # written as int16 bits (the interpreter's way)
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

STORED_BLOCK: tl.constexpr = tl.constexpr(0)  # what the values are multiplied by: s (and d)
STORED_ONE: tl.constexpr = tl.constexpr(1)  # nothing: the element values (StoredScale.ONE)
STORED_POWER: tl.constexpr = tl.constexpr(2)  # 2^E of an alpha grid's s (StoredScale.POWER)

TINY: tl.constexpr = tl.constexpr(2.0**-126)  # float32's smallest normal
TWO_64: tl.constexpr = tl.constexpr(2.0**64)
FLT_MAX: tl.constexpr = tl.constexpr(torch.finfo(torch.float32).max)
EDEN_NOISE_BITS: tl.constexpr = tl.constexpr(16)  # fp4lab.formats.eden's _NOISE_BITS
EDEN_MANTISSA_4: tl.constexpr = tl.constexpr(-(1 << 19))  # 0xFFF80000: sign, exponent, 4 bits

_MAX_BLOCK_ELEMENTS = 4096  # padded blocks larger than this take their amax from a first pass


@dataclass(frozen=True)
class LaunchConfig:
    """Tile shape and warps of the kernels (the numbers do not change any result).

    Attributes:
        tile_elements: elements a program of the quantize kernel handles (a power of two).
        tile_columns: the most columns (along the planes' last dim) a tile spans.
        num_warps: warps per program of the quantize kernel.
        amax_tile_elements: elements a program of the tensor-amax pass reads.
    """

    tile_elements: int = 4096
    tile_columns: int = 256
    num_warps: int = 4
    amax_tile_elements: int = 16384

    def __post_init__(self) -> None:
        for field, value in self.__dict__.items():
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{field} must be a power of two, got {value!r}")


CODES_CONFIG = LaunchConfig()
"""The default of `quantize` and `quantize_packed`."""
FAKE_QUANTIZE_CONFIG = LaunchConfig(tile_elements=8192, num_warps=8)
"""The default of `fake_quantize`: of the configurations `benchmarks/bench_quantize_gpu.py`
times, the one that reached 80% of the bandwidth bound for both nvfp4 and mxfp4 on the H200,
with the least time over the two (`benchmarks/RESULTS.md`); `CODES_CONFIG` was the fastest
for `quantize_packed`."""


# -- float32 bits and powers of two -------------------------------------------------------------
@triton.jit
def _f32(BITS: tl.constexpr):
    """The float32 with bit pattern BITS (a float constant travels as its bits)."""
    return tl.full([], BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _pow2(k):
    """2^k in float32 for an int32 tensor k: subnormal from 2^-149, 0 below, inf from 2^128."""
    k = tl.minimum(tl.maximum(k, -150), 128)
    normal = (k + 127) << 23
    subnormal = tl.where(k >= -149, 1 << tl.minimum(tl.maximum(k + 149, 0), 22), 0)
    return tl.where(k >= -126, normal, subnormal).to(tl.float32, bitcast=True)


@triton.jit
def _frexp(a):
    """(e, r) with a = r * 2^e, r in [1, 2), for finite a > 0, subnormals included."""
    sub = a < TINY
    b = tl.where(sub, a * TWO_64, a).to(tl.int32, bitcast=True)
    e = ((b >> 23) & 0xFF) - tl.where(sub, 127 + 64, 127)
    r = ((b & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    return e, r


@triton.jit
def _block_max(t):
    """max over each block's axes 3 and 1 of a 4-D tile, keeping the dims."""
    t = tl.reduce(t, 3, _elementwise_max, keep_dims=True)
    return tl.reduce(t, 1, _elementwise_max, keep_dims=True)


@triton.jit
def _block_sum(t):
    """sum over each block's axes 3 and 1 of a 4-D tile, keeping the dims."""
    t = tl.reduce(t, 3, _sum_combine, keep_dims=True)
    return tl.reduce(t, 1, _sum_combine, keep_dims=True)


# Triton's own combine functions: the interpreter runs them as one numpy reduction.
_elementwise_max = tl.standard._elementwise_max
_sum_combine = tl.standard._sum_combine


# -- loading and storing ------------------------------------------------------------------------
@triton.jit
def _load(ptrs, mask, other):
    """tl.load, zero-padded where a mask is given (None: every element is valid)."""
    if mask is None:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _load_float32(ptrs, mask, KIND: tl.constexpr):
    """x's elements as float32; bfloat16 arrives as its int16 bits."""
    if KIND == BFLOAT16 or KIND == BFLOAT16_BITS:
        bits = _load(ptrs, mask, 0).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return _load(ptrs, mask, 0.0).to(tl.float32)


@triton.jit
def _store_float32(ptrs, v, mask, KIND: tl.constexpr):
    """v in the output dtype, rounded to nearest even: by the GPU's conversion, or for
    BFLOAT16_BITS on v's bits (the interpreter's own bfloat16 cast truncates); NaN stays NaN."""
    if KIND == BFLOAT16_BITS:
        bits = v.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(v != v, 0x7FC0, rounded)
        tl.store(ptrs, rounded.to(tl.int16), mask=mask)
    elif KIND == BFLOAT16:
        tl.store(ptrs, v.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)
    elif KIND == FLOAT16:
        tl.store(ptrs, v.to(tl.float16, fp_downcast_rounding="rtne"), mask=mask)
    else:
        tl.store(ptrs, v, mask=mask)


@triton.jit
def _bfloat16_round(v):
    """fl_bf16(v) as float32: the mantissa rounded to 7 bits, to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
    return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _tile(TILE_BR: tl.constexpr, ROW_STEP: tl.constexpr, BRP: tl.constexpr,
          TILE_BC: tl.constexpr, COL_STEP: tl.constexpr, BCP: tl.constexpr):
    """This program's plane g (grid axis 2), tile (tr, tc) (axes 1 and 0) and the
    (TILE_BR, BRP, TILE_BC, BCP) rows r and columns c of its tile: row nbr * ROW_STEP + jr,
    column nbc * COL_STEP + jc."""
    tc = tl.program_id(0)
    tr = tl.program_id(1)
    g = tl.program_id(2)
    r = tr * (TILE_BR * ROW_STEP) + tl.arange(0, TILE_BR)[:, None, None, None] * ROW_STEP
    r = r + tl.arange(0, BRP)[None, :, None, None]
    c = tc * (TILE_BC * COL_STEP) + tl.arange(0, TILE_BC)[None, None, :, None] * COL_STEP
    c = c + tl.arange(0, BCP)[None, None, None, :]
    return g, tr, tc, r, c


@triton.jit
def _tile_mask(r, c, R, C, BRP: tl.constexpr, ROW_VALID: tl.constexpr, BCP: tl.constexpr,
               COL_VALID: tl.constexpr):
    """The tile's elements inside the plane and inside their (padded) block."""
    inside = (r < R) & (c < C)
    if ROW_VALID < BRP:  # the padding of a block to a power of two
        inside = inside & (tl.arange(0, BRP)[None, :, None, None] < ROW_VALID)
    if COL_VALID < BCP:
        inside = inside & (tl.arange(0, BCP)[None, None, None, :] < COL_VALID)
    return inside


@triton.jit
def _uniforms(noise_ptr, offsets, mask, flat, seed_lo, seed_hi, stream, NOISE: tl.constexpr):
    """float64 uniforms: noise[i] (NOISE_TENSOR), or Philox4x32-10 keyed by the seed at the
    counter (flat index low word, high word, stream, 0), made a 53-bit uniform (NOISE_PHILOX)."""
    if NOISE == NOISE_TENSOR:
        u = _load(noise_ptr + offsets, mask, 0.0).to(tl.float64)
    elif NOISE == NOISE_PHILOX:
        c0 = (flat & 0xFFFFFFFF).to(tl.uint32)
        c1 = (flat >> 32).to(tl.uint32)
        c2 = (c0 * 0) + stream.to(tl.uint32)
        w0, w1, _, _ = philox4x32(c0, c1, c2, c0 * 0, seed_lo.to(tl.uint32),
                                  seed_hi.to(tl.uint32), 10)
        u = uniform53(w0, w1)
    else:
        u = (flat * 0).to(tl.float64)
    return u


# -- rounding onto a format, and its codes ------------------------------------------------------
@triton.jit
def _round_integer(y, u, ROUNDING: tl.constexpr, SR_BITS: tl.constexpr):
    """y >= 0 (or inf, NaN) rounded to an integer as `Rounding` says, on floor and fraction;
    u: the float64 uniforms of stochastic rounding (SR_BITS = 0: exact comparison)."""
    low = tl.floor(y)
    frac = y - low  # exact
    if ROUNDING == NEAREST_EVEN:
        odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
        up = (frac > 0.5) | ((frac == 0.5) & odd)
    elif ROUNDING == NEAREST_AWAY:
        up = frac >= 0.5
    elif ROUNDING == AWAY_FROM_ZERO:
        up = frac > 0.0
    elif ROUNDING == STOCHASTIC:
        if SR_BITS == 0:
            up = u < frac.to(tl.float64)
        else:
            scale: tl.constexpr = 2.0**SR_BITS
            up = tl.floor(u * scale) < tl.floor(frac * scale).to(tl.float64)  # both exact
    else:  # TOWARD_ZERO
        up = frac != frac
    return tl.where(up, low + 1.0, low)


@triton.jit
def _round_to_format(v, u, MBITS: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr,
                     MAX_BITS: tl.constexpr, SIGNED: tl.constexpr, SUBNORMALS: tl.constexpr,
                     FNUZ: tl.constexpr, HAS_NAN: tl.constexpr, ROUNDING: tl.constexpr,
                     SR_BITS: tl.constexpr):
    """`round_to_format(v, fmt, rounding, saturate=True)` on float32 v: the quantum 2^q with
    q = clamp(floor(log2 |v|), emin, emax + 1) - mbits from v's exponent bits, |v| / 2^q exact,
    rounded to an integer, scaled back, saturated at max (and raised to min_normal in a format
    without zero), the sign applied (NaN, or 0, for negatives of an unsigned format).

    To nearest even, where mbits <= 22 and 2^(q + 23) is a float32 for every q, the rounding is
    (|v| + 2^(q + 23)) - 2^(q + 23): the sum lies in [2^(q + 23), 2^(q + 24)), whose spacing is
    2^q, so float32's own round-half-even does it (beyond the top binade the sum only needs to
    stay above max, and does)."""
    E_TOP: tl.constexpr = EMAX + 1 if EMAX < 127 else 127  # the same for finite v
    bits = v.to(tl.int32, bitcast=True)
    a = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    if ROUNDING == NEAREST_EVEN and MBITS <= 22 and E_TOP - MBITS + 23 <= 127:
        field = tl.minimum(tl.maximum(bits & 0x7F800000, (EMIN + 127) << 23), (E_TOP + 127) << 23)
        big = (field + ((23 - MBITS) << 23)).to(tl.float32, bitcast=True)  # 2^(q + 23)
        out = (a + big) - big
    else:
        e = ((bits >> 23) & 0xFF) - 127  # floor(log2 |v|) for normal v; below emin otherwise
        q = tl.minimum(tl.maximum(e, EMIN), E_TOP) - MBITS
        if EMIN - MBITS >= -127:
            y = a * _pow2(-q)  # 2^-q is a float32: one exact product
        else:
            y = tl.math.div_rn(a, _pow2(q))
        out = _round_integer(y, u, ROUNDING, SR_BITS) * _pow2(q)
    out = tl.where(out > _f32(MAX_BITS), _f32(MAX_BITS), out)
    if not SUBNORMALS:  # no zero: up to the smallest normal
        min_normal = _pow2(tl.full([], EMIN, tl.int32))
        out = tl.where(out < min_normal, min_normal, out)
    if SIGNED:
        sign = bits & -0x80000000
        if FNUZ:  # no negative zero
            sign = tl.where(out != 0.0, sign, 0)
        out = (out.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    elif HAS_NAN:
        out = tl.where((bits < 0) & (v == v) & (a != 0.0), float("nan"), out)
    else:
        out = tl.where((bits < 0) & (v == v) & (a != 0.0), 0.0, out)
    return out


@triton.jit
def _encode(v, MBITS: tl.constexpr, EMIN: tl.constexpr, SUBNORMALS: tl.constexpr,
            SIGNED: tl.constexpr, FNUZ: tl.constexpr, SIGN_CODE: tl.constexpr,
            NAN_CODE: tl.constexpr, NAN_SIGNED: tl.constexpr):
    """`FloatFormat.encode` of values on the grid (finite or NaN), as int32 codes. With
    subnormals, v 2^(-126 - emin) maps the format's smallest normal 2^emin onto float32's: the
    product is exact (a float32 subnormal below it) and its exponent field and top mbits of
    mantissa are the code's. Without, the exponent field is rebiased from float32's."""
    bits = v.to(tl.int32, bitcast=True)
    if SUBNORMALS:  # _check_codes: -126 - emin >= -149, so the factor is a float32
        K: tl.constexpr = -126 - EMIN
        FACTOR_BITS: tl.constexpr = (K + 127) << 23 if K >= -126 else 1 << (K + 149)
        code = ((v * _f32(FACTOR_BITS)).to(tl.int32, bitcast=True) & 0x7FFFFFFF) >> (23 - MBITS)
    else:  # E8M0's 2^-127 is a float32 subnormal whose bits give its code 0 all the same
        code = ((bits & 0x7FFFFFFF) - ((EMIN + 127) << 23)) >> (23 - MBITS)
    isnan = v != v
    if SIGNED and FNUZ:  # no negative zero
        code = tl.where((bits < 0) & (code != 0), code | SIGN_CODE, code)
    elif SIGNED:  # the sign bit moved down to the code's: SIGN_CODE is a power of two
        SHIFT: tl.constexpr = 31 - (SIGN_CODE.bit_length() - 1)
        code = code | ((bits >> SHIFT) & SIGN_CODE)
    if NAN_SIGNED:  # FN and IEEE formats keep the NaN's sign
        nan = tl.where(bits < 0, NAN_CODE | SIGN_CODE, NAN_CODE)
    else:
        nan = NAN_CODE
    return tl.where(isnan, nan, code)


@triton.jit
def _round_encode_nearest(v, MBITS: tl.constexpr, EMIN: tl.constexpr, MAX_BITS: tl.constexpr,
                          SIGN_CODE: tl.constexpr, NAN_CODE: tl.constexpr,
                          NAN_SIGNED: tl.constexpr):
    """`_encode(_round_to_format(v))` to nearest even for a signed format with subnormals and
    a signed zero (the kernel's DIRECT), from the rounding's own sum: |v| saturated at max first
    (max is on the grid and rounding is monotone, so this is the rounded value's saturation),
    then with 2^(q + 23) of its binade (q clamped below at emin - mbits), the sum
    |v| + 2^(q + 23) = 2^(q + 23) + n 2^q holds the quanta n in its low mantissa bits and
    stays in that binade (n <= 2^(mbits + 1)). The code is (e - emin) 2^mbits + n for the
    binade e = max(floor(log2 |v|), emin): n >= 2^mbits is the normal's implicit bit, a
    subnormal has e = emin and n < 2^mbits, and n = 2^(mbits + 1) carries into the next
    binade's code. No rounded value is formed and encoded again (torchao_nvfp4_1level's
    quantize_packed tile: 1168 to 1048 SASS instructions for sm_90)."""
    bits = v.to(tl.int32, bitcast=True)
    # whatever min gives for NaN, NaN's code is chosen at the end
    a = tl.minimum((bits & 0x7FFFFFFF).to(tl.float32, bitcast=True), _f32(MAX_BITS))
    field = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, (EMIN + 127) << 23)
    big = (field + ((23 - MBITS) << 23)).to(tl.float32, bitcast=True)  # 2^(q + 23)
    n = (a + big).to(tl.int32, bitcast=True) & 0x7FFFFF
    code = ((field - ((EMIN + 127) << 23)) >> (23 - MBITS)) + n
    SHIFT: tl.constexpr = 31 - (SIGN_CODE.bit_length() - 1)
    code = code | ((bits >> SHIFT) & SIGN_CODE)
    if NAN_SIGNED:
        nan = tl.where(bits < 0, NAN_CODE | SIGN_CODE, NAN_CODE)
    else:
        nan = NAN_CODE
    return tl.where(v != v, nan, code)


# -- block scales -------------------------------------------------------------------------------
@triton.jit
def _tensor_scales(amax_bits, ARITH: tl.constexpr, BIG_BITS: tl.constexpr,
                   EPS_BITS: tl.constexpr):
    """(decode d, encode g) from the tensor amax A, as `_tensor_scales` of the reference."""
    a = amax_bits.to(tl.float32, bitcast=True)
    if ARITH == TE_ENCODE:
        g = tl.minimum(tl.math.div_rn(_f32(BIG_BITS), a), FLT_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        g = tl.where(g == 0.0, 1.0, g)
        d = tl.math.div_rn(1.0, g)
    elif ARITH == RECIPROCAL:  # FastVideo's max(A, 1e-8)
        g = tl.math.div_rn(_f32(BIG_BITS), tl.maximum(a, _f32(EPS_BITS),
                                                      propagate_nan=tl.PropagateNan.ALL))
        d = tl.math.div_rn(1.0, g)
    else:
        d = tl.math.div_rn(a, _f32(BIG_BITS))
        g = tl.math.div_rn(1.0, d)
    return d, g


@triton.jit
def _power_of_two_exponent(a, RULE: tl.constexpr, EL_MBITS: tl.constexpr,
                           EL_EMAX: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr):
    """log2 of the OCP_FLOOR / CEIL / EVEN scale of a' = a (>= 0, finite), clamped to [LO, HI]:
    floor(log2 a), up one for CEIL off a power of two and for EVEN when the mantissa rounds up
    into the next binade, minus the element's emax; LO for a = 0."""
    e, r = _frexp(tl.where(a > 0.0, a, 1.0))
    if RULE == CEIL:
        e = e + (r != 1.0).to(tl.int32)
    elif RULE == EVEN:
        e = e + (r >= 2.0 - 2.0 ** -(EL_MBITS + 1)).to(tl.int32)
    e = tl.where(a == 0.0, LO, e - EL_EMAX)
    return tl.minimum(tl.maximum(e, LO), HI)


@triton.jit
def _block_scale(a, d, g, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR_SCALE: tl.constexpr,
                 FLOOR: tl.constexpr, FLOOR_BITS: tl.constexpr, M_E_BITS: tl.constexpr,
                 INV_M_E_BITS: tl.constexpr, EL_MBITS: tl.constexpr, EL_EMAX: tl.constexpr,
                 LO: tl.constexpr, HI: tl.constexpr, SC_MBITS: tl.constexpr,
                 SC_EMIN: tl.constexpr, SC_EMAX: tl.constexpr, SC_MAX_BITS: tl.constexpr,
                 SC_SIGNED: tl.constexpr, SC_SUBNORMALS: tl.constexpr, SC_FNUZ: tl.constexpr,
                 SC_HAS_NAN: tl.constexpr):
    """(s, t): the block scale rounded into the scale format and its unrounded t = a' / M_e, in
    the arithmetic's order (`_scale_input` and `_round_scale` of the reference). With a floor,
    FLOOR_BITS is fl32(floor) for the rules that clamp t, and the floor already rounded into the
    scale format for the power-of-two rules (max(2^e, floor) rounded is max(2^e, rnd(floor)))."""
    # -- the scale's input: a' (power-of-two rules) and t = a' / M_e --
    if ARITH == TE_ENCODE:
        t = tl.minimum(a * (g * _f32(INV_M_E_BITS)), FLT_MAX, propagate_nan=tl.PropagateNan.ALL)
        scaled_amax = a * g
    elif ARITH == RECIPROCAL:
        scaled_amax = a * g
        t = tl.math.div_rn(a, _f32(M_E_BITS)) * g
    else:
        scaled_amax = tl.math.div_rn(a, d) if TENSOR_SCALE else a
        if ARITH == TORCHAO_DECODE and TENSOR_SCALE:
            t = tl.math.div_rn(tl.math.div_rn(a, _f32(M_E_BITS)), d)
        else:
            t = tl.math.div_rn(scaled_amax, _f32(M_E_BITS))
    # -- rounded into the scale format --
    if RULE == OCP_FLOOR or RULE == CEIL or RULE == EVEN:
        finite = scaled_amax < float("inf")
        e = _power_of_two_exponent(tl.where(finite, scaled_amax, 1.0), RULE, EL_MBITS, EL_EMAX,
                                   LO, HI)
        s = _pow2(e)
        if FLOOR:
            s = tl.maximum(s, _f32(FLOOR_BITS))
        s = tl.where(finite, s, float("nan"))
    else:
        raw = t
        if FLOOR:
            raw = tl.maximum(raw, _f32(FLOOR_BITS), propagate_nan=tl.PropagateNan.ALL)
        MODE: tl.constexpr = AWAY_FROM_ZERO if RULE == RCEIL else NEAREST_EVEN
        s = _round_to_format(raw, None, SC_MBITS, SC_EMIN, SC_EMAX, SC_MAX_BITS, SC_SIGNED,
                             SC_SUBNORMALS, SC_FNUZ, SC_HAS_NAN, MODE, 0)
        if ARITH == EXACT or ARITH == DIVIDE_UNROUNDED:
            s = tl.where(t < float("inf"), s, float("nan"))
    return s, t


@triton.jit
def _scaled_elements(x, s, t, d, ARITH: tl.constexpr, TENSOR_SCALE: tl.constexpr,
                     EXACT_RECIPROCAL: tl.constexpr):
    """x divided by (or multiplied by the reciprocal of) its block's scale, as the arithmetic
    says (`_scaled_elements` of the reference). EXACT_RECIPROCAL: the divisor is a power of two
    whose reciprocal is a float32, so x * fl(1 / divisor) is the correctly rounded quotient."""
    if ARITH == EXACT or ARITH == DIVIDE_UNROUNDED:
        denom = (s if ARITH == EXACT else t) * d
        denom = tl.where(denom == 0.0, float("inf"), denom)  # a zero scale flushes its block
        if EXACT_RECIPROCAL:
            return x * tl.math.div_rn(1.0, denom)
        else:
            return tl.math.div_rn(x, denom)
    if ARITH == TE_ENCODE:
        factor = tl.minimum(tl.math.div_rn(1.0, s * d), FLT_MAX,
                            propagate_nan=tl.PropagateNan.ALL)
        if not TENSOR_SCALE:  # fp4-fa4's Q/K quantizer: a zero scale's multiplier is 0
            factor = tl.where(s == 0.0, 0.0, factor)
    elif ARITH == RECIPROCAL and TENSOR_SCALE:
        b = s * d
        factor = tl.math.div_rn(1.0, tl.where(b > 0.0, b, 1.0))  # FastVideo
    elif ARITH == RECIPROCAL:
        factor = tl.where(s == 0.0, 0.0, tl.math.div_rn(1.0, s))  # SageAttention
    elif TENSOR_SCALE:  # TORCHAO_DECODE
        factor = tl.math.div_rn(tl.math.div_rn(1.0, d), s)
    else:
        factor = tl.math.div_rn(1.0, s)
    return x * factor


@triton.jit
def _alpha_scale(x, a, RULE: tl.constexpr, M_E_BITS: tl.constexpr, LO: tl.constexpr,
                 HI: tl.constexpr):
    """(s, scaled, 2^E) of the alpha-grid rules: E from a's binade and mantissa r as the rule
    says, s = fl(2^E / M_e), elements fl(x * M_e) * 2^-E; zero and subnormal amax flush, NaN
    and inf give a NaN scale (`_alpha_scale` of the reference)."""
    readable = (a < float("inf")) & (a > 0.0)
    e, r = _frexp(tl.where(readable, a, 1.0))
    if RULE == ALPHA_CEIL:
        up = r > 1.0
    elif RULE == ALPHA_MSE:
        up = r >= 1.203125
    elif RULE == ALPHA_HALF:
        up = r >= 1.5
    else:  # ALPHA_RTE: ties to an even biased exponent field
        up = (r > 1.5) | ((r == 1.5) & (((e + 127) & 1) == 1))
    e = tl.minimum(tl.maximum(e + up.to(tl.int32), LO), HI)
    finite = a < float("inf")
    flush = (a < TINY) & finite
    power = _pow2(e)
    s = tl.math.div_rn(power, _f32(M_E_BITS))
    s = tl.where(flush, 0.0, tl.where(finite, s, float("nan")))
    step = tl.where(flush, 0.0, _pow2(-e))
    return s, (x * _f32(M_E_BITS)) * step, power


@triton.jit
def _eden_stored_scale(pre, k, SC_MBITS: tl.constexpr, SC_EMIN: tl.constexpr,
                       SC_EMAX: tl.constexpr, SC_MAX_BITS: tl.constexpr, SC_SIGNED: tl.constexpr,
                       SC_SUBNORMALS: tl.constexpr, SC_FNUZ: tl.constexpr,
                       SC_HAS_NAN: tl.constexpr):
    """Quartet II's 16-bit stochastic rounding of pre into the scale format with the random
    bits k (`_kernel_stochastic_rounding` of `fp4lab.formats.eden`): the bits below the scale's
    mantissa set (up) iff they exceed k at the top of that field, else cleared, then rounded to
    nearest; values outside [min_normal, max] are only rounded to nearest."""
    DROPPED: tl.constexpr = 23 - SC_MBITS
    MASK: tl.constexpr = (1 << DROPPED) - 1
    bits = pre.to(tl.int32, bitcast=True)
    up = (bits & MASK) > (k << (DROPPED - EDEN_NOISE_BITS))
    moved = tl.where(up, bits | MASK, bits & ~MASK).to(tl.float32, bitcast=True)
    magnitude = tl.abs(pre)
    in_range = (magnitude <= _f32(SC_MAX_BITS)) & (magnitude >= _pow2(tl.full([], SC_EMIN,
                                                                              tl.int32)))
    moved = tl.where(in_range, moved, pre)
    return _round_to_format(moved, None, SC_MBITS, SC_EMIN, SC_EMAX, SC_MAX_BITS, SC_SIGNED,
                            SC_SUBNORMALS, SC_FNUZ, SC_HAS_NAN, NEAREST_EVEN, 0)


@triton.jit
def _store_packed(packed_ptr, codes, g64, r, tc, R, C, sp_g, sp_r, TILE_BR: tl.constexpr,
                  BRP: tl.constexpr, ROW_VALID: tl.constexpr, TILE_BC: tl.constexpr,
                  COL_STEP: tl.constexpr, BCP: tl.constexpr, COL_VALID: tl.constexpr,
                  MASKED: tl.constexpr):
    """Two 4-bit codes a byte, the even row-major index in the low nibble (`pack_codes`): the
    pairs lie along the tile's last axis, and a row's bytes start at sp_r = (row length) / 2."""
    lo, hi = tl.split(tl.reshape(codes, [TILE_BR, BRP, TILE_BC, BCP // 2, 2]))
    byte = lo | (hi << 4)  # codes of 4 bits
    jr = tl.arange(0, BRP)[None, :, None, None]
    nbc = tl.arange(0, TILE_BC)[None, None, :, None]
    jh = tl.arange(0, BCP // 2)[None, None, None, :]
    c_half = tc * (TILE_BC * COL_STEP // 2) + nbc * (COL_STEP // 2) + jh  # column / 2
    offsets = g64 * sp_g + (r * sp_r + c_half)
    if MASKED:
        inside = (r < R) & (c_half < C // 2)
        if ROW_VALID < BRP:
            inside = inside & (jr < ROW_VALID)
        if COL_VALID < BCP:
            inside = inside & (2 * jh < COL_VALID)
        tl.store(packed_ptr + offsets, byte.to(tl.uint8), mask=inside)
    else:
        tl.store(packed_ptr + offsets, byte.to(tl.uint8))


# -- the kernels --------------------------------------------------------------------------------
@triton.jit
def _amax_kernel(
    x_ptr, block_amax_ptr, tensor_amax_ptr,
    R, C, planes_per_batch, block_r, block_c, sx_g, sx_r, sx_c, sa_g, sa_r, sa_c,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, MASKED: tl.constexpr, IN_KIND: tl.constexpr,
    BLOCK_AMAX: tl.constexpr, TENSOR_AMAX: tl.constexpr,
):
    """The first pass: the amax of a (TILE_R, TILE_C) tile of a plane, as the float32 bits of
    |x| (their integer order is the float order; NaN's bits lie above inf's, so NaN wins, as in
    torch.amax), folded by atomic max into its block's entry (the tile lies in one block) and
    into its batch's tensor amax. The buffers start at 0."""
    g, tr, tc, r, c = _tile(TILE_R, 1, 1, 1, TILE_C, TILE_C)
    if MASKED:
        inside = _tile_mask(r, c, R, C, 1, 1, TILE_C, TILE_C)
    else:
        inside = None
    g64 = g.to(tl.int64)
    x = _load_float32(x_ptr + (g64 * sx_g + (r * sx_r + c * sx_c)), inside, IN_KIND)
    amax = tl.reduce(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, None, _elementwise_max)
    if BLOCK_AMAX:
        block = g64 * sa_g + (tr * TILE_R // block_r) * sa_r + (tc * TILE_C // block_c) * sa_c
        tl.atomic_max(block_amax_ptr + block, amax, sem="relaxed")
    if TENSOR_AMAX:
        tl.atomic_max(tensor_amax_ptr + g // planes_per_batch, amax, sem="relaxed")


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "stream"])
def _quantize_kernel(
    x_ptr, noise_ptr, block_amax_ptr, tensor_amax_ptr,  # inputs; the amax as float32 bits
    out_ptr, codes_ptr, packed_ptr, scales_ptr, decode_ptr,  # outputs
    R, C, planes_per_batch, block_r, block_c,  # planes and blocks (block_*: AMAX_IN_BUFFER)
    sx_g, sx_r, sx_c, sn_g, sn_r, sn_c, so_g, so_r, so_c, ss_g, ss_r, ss_c, sa_g, sa_r, sa_c,
    seed_lo, seed_hi, stream,
    # -- the tile (see _tile) and where the block amax comes from --
    TILE_BR: tl.constexpr, ROW_STEP: tl.constexpr, BRP: tl.constexpr, ROW_VALID: tl.constexpr,
    TILE_BC: tl.constexpr, COL_STEP: tl.constexpr, BCP: tl.constexpr, COL_VALID: tl.constexpr,
    MASKED: tl.constexpr, AMAX_IN_BUFFER: tl.constexpr,
    # -- the block format's scale arithmetic --
    RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR_SCALE: tl.constexpr, FIXED: tl.constexpr,
    FIXED_BITS: tl.constexpr, EXACT_RECIPROCAL: tl.constexpr, FLOOR: tl.constexpr,
    FLOOR_BITS: tl.constexpr, M_E_BITS: tl.constexpr, INV_M_E_BITS: tl.constexpr,
    BIG_BITS: tl.constexpr, EPS_BITS: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr,
    # -- the element format --
    EL_MBITS: tl.constexpr, EL_EMIN: tl.constexpr, EL_EMAX: tl.constexpr,
    EL_MAX_BITS: tl.constexpr, EL_SIGNED: tl.constexpr, EL_SUBNORMALS: tl.constexpr,
    EL_FNUZ: tl.constexpr, EL_HAS_NAN: tl.constexpr, EL_SIGN_CODE: tl.constexpr,
    EL_NAN_CODE: tl.constexpr, EL_NAN_SIGNED: tl.constexpr,
    # -- the scale format --
    SC_MBITS: tl.constexpr, SC_EMIN: tl.constexpr, SC_EMAX: tl.constexpr,
    SC_MAX_BITS: tl.constexpr, SC_SIGNED: tl.constexpr, SC_SUBNORMALS: tl.constexpr,
    SC_FNUZ: tl.constexpr, SC_HAS_NAN: tl.constexpr,
    # -- rounding, dtypes and what to write --
    ROUNDING: tl.constexpr, SR_BITS: tl.constexpr, NOISE: tl.constexpr, IN_KIND: tl.constexpr,
    OUT_KIND: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_PACKED: tl.constexpr,
    WRITE_SCALES: tl.constexpr, FACTORED: tl.constexpr, STORED: tl.constexpr,
):
    """One tile of blocks: amax, block scale, scaled and rounded elements; writes the
    fake-quantized values (value * s * d, or value * s and the decode d apart with FACTORED;
    with STORED the decoded values alone, or times 2^E of an alpha grid: `StoredScale`),
    codes, packed codes and scales as asked."""
    g, tr, tc, r, c = _tile(TILE_BR, ROW_STEP, BRP, TILE_BC, COL_STEP, BCP)
    if MASKED:
        inside = _tile_mask(r, c, R, C, BRP, ROW_VALID, BCP, COL_VALID)
    else:
        inside = None
    g64 = g.to(tl.int64)
    x = _load_float32(x_ptr + (g64 * sx_g + (r * sx_r + c * sx_c)), inside, IN_KIND)
    flat = g64 * so_g + (r * so_r + c * so_c)  # the row-major index in x's shape
    # -- the block amax a and the tensor scales (decode d, encode e) --
    if AMAX_IN_BUFFER:  # the tile lies inside one block (`_tiling`): the block of its origin
        r0, c0 = tr * TILE_BR, tc * COL_STEP  # (ROW_STEP = BRP = TILE_BC = 1 here)
        block = g64 * sa_g + ((r0 // block_r) * sa_r + (c0 // block_c) * sa_c)
    if not FIXED:
        if AMAX_IN_BUFFER:  # one amax, so one scale, for the whole tile: scalars
            a_bits = tl.load(block_amax_ptr + block)
        else:
            a_bits = _block_max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
        a = a_bits.to(tl.float32, bitcast=True)
    batch = g // planes_per_batch
    d = 1.0
    e = 1.0
    if TENSOR_SCALE:
        d, e = _tensor_scales(tl.load(tensor_amax_ptr + batch), ARITH, BIG_BITS, EPS_BITS)
    # -- the block scale s and the scaled elements --
    if FIXED:
        s = _f32(FIXED_BITS)
        if EXACT_RECIPROCAL:
            scaled = x * tl.math.div_rn(1.0, s)
        else:
            scaled = tl.math.div_rn(x, s)
    elif RULE >= ALPHA_CEIL:
        s, scaled, power = _alpha_scale(x, a, RULE, M_E_BITS, LO, HI)
    else:
        s, t = _block_scale(a, d, e, RULE, ARITH, TENSOR_SCALE, FLOOR, FLOOR_BITS, M_E_BITS,
                            INV_M_E_BITS, EL_MBITS, EL_EMAX, LO, HI, SC_MBITS, SC_EMIN,
                            SC_EMAX, SC_MAX_BITS, SC_SIGNED, SC_SUBNORMALS, SC_FNUZ,
                            SC_HAS_NAN)
        scaled = _scaled_elements(x, s, t, d, ARITH, TENSOR_SCALE, EXACT_RECIPROCAL)
    # -- the elements rounded into the element format --
    u = _uniforms(noise_ptr, g64 * sn_g + (r * sn_r + c * sn_c), inside, flat, seed_lo, seed_hi,
                  stream, NOISE)
    # codes alone, to nearest even, in a signed format with subnormals: straight from the
    # rounding's sum (_round_encode_nearest), with the same codes
    DIRECT: tl.constexpr = (OUT_KIND == NO_OUTPUT and ROUNDING == NEAREST_EVEN and EL_SIGNED
                            and EL_SUBNORMALS and not EL_FNUZ and EL_MBITS <= 22
                            and EL_EMIN >= -126 and EL_EMAX - EL_MBITS + 23 <= 127
                            and EL_EMIN - EL_MBITS + 23 >= -126)  # 2^(q + 23) is normal
    if not DIRECT:
        v = _round_to_format(scaled, u, EL_MBITS, EL_EMIN, EL_EMAX, EL_MAX_BITS, EL_SIGNED,
                             EL_SUBNORMALS, EL_FNUZ, EL_HAS_NAN, ROUNDING, SR_BITS)
    # -- outputs --
    if OUT_KIND != NO_OUTPUT:
        if STORED == STORED_BLOCK:
            out = v * s
            if TENSOR_SCALE and not FACTORED:
                out = out * d
        else:  # decode(encode(v)): v, but NaN is the NaN code's (+NaN), or +0 without one
            if EL_HAS_NAN:
                out = tl.where(v == v, v, float("nan"))
            else:
                out = tl.where(v == v, v, 0.0)
            if STORED == STORED_POWER:  # 2^E where s > 0, else 0 (`StoredScale.POWER`)
                out = out * tl.where(s > 0.0, power, 0.0)
        _store_float32(out_ptr + flat, out, inside, OUT_KIND)
    if WRITE_CODES or WRITE_PACKED:
        if DIRECT:
            codes = _round_encode_nearest(scaled, EL_MBITS, EL_EMIN, EL_MAX_BITS, EL_SIGN_CODE,
                                          EL_NAN_CODE, EL_NAN_SIGNED)
        else:
            codes = _encode(v, EL_MBITS, EL_EMIN, EL_SUBNORMALS, EL_SIGNED, EL_FNUZ,
                            EL_SIGN_CODE, EL_NAN_CODE, EL_NAN_SIGNED)
        if WRITE_CODES:
            tl.store(codes_ptr + flat, codes, mask=inside)
        if WRITE_PACKED:
            _store_packed(packed_ptr, codes, g64, r, tc, R, C, so_g // 2, so_r // 2, TILE_BR,
                          BRP, ROW_VALID, TILE_BC, COL_STEP, BCP, COL_VALID, MASKED)
    if WRITE_SCALES:
        if AMAX_IN_BUFFER:  # the tile holding its block's origin (at its own) writes the scale
            origin = (r0 % block_r == 0) & (c0 % block_c == 0)
            scale = g64 * ss_g + ((r0 // block_r) * ss_r + (c0 // block_c) * ss_c)
            tl.store(scales_ptr + scale, s, mask=origin)
        else:
            br = tr * TILE_BR + tl.arange(0, TILE_BR)[:, None, None, None]
            bc = tc * TILE_BC + tl.arange(0, TILE_BC)[None, None, :, None]
            valid = (br * ROW_STEP < R) & (bc * COL_STEP < C)
            tl.store(scales_ptr + (g64 * ss_g + (br * ss_r + bc * ss_c)), s, mask=valid)
    if TENSOR_SCALE and (WRITE_SCALES or FACTORED):
        first = (g % planes_per_batch == 0) & (tr == 0) & (tc == 0)
        tl.store(decode_ptr + batch, d, mask=first)


@triton.jit
def _eden_elements_kernel(
    x_ptr, corrected_ptr, tensor_amax_ptr, values_ptr, codes_ptr,
    R, C, planes_per_batch, sx_g, sx_r, sx_c, so_g, so_r, so_c, sb_g, sb_r, sb_c,
    TILE_BR: tl.constexpr, BR: tl.constexpr, BRP: tl.constexpr,
    TILE_BC: tl.constexpr, BC: tl.constexpr, BCP: tl.constexpr, INV_C_BITS: tl.constexpr,
    EL_MBITS: tl.constexpr, EL_EMIN: tl.constexpr, EL_EMAX: tl.constexpr,
    EL_MAX_BITS: tl.constexpr, EL_SIGNED: tl.constexpr, EL_SUBNORMALS: tl.constexpr,
    EL_FNUZ: tl.constexpr, EL_HAS_NAN: tl.constexpr, EL_SIGN_CODE: tl.constexpr,
    EL_NAN_CODE: tl.constexpr, EL_NAN_SIGNED: tl.constexpr,
    WRITE_VALUES: tl.constexpr, WRITE_CODES: tl.constexpr,
):
    """MS-EDEN's steps 1-4 (`fp4lab.formats.eden.corrected_scales`) on a tile of blocks of the
    rotated x: sigma = RTZ_4(a / c), v = x / sigma, q = E2M1_RN(v), the corrected scale
    bf16(sigma <v, v> / <v, q>) per block (NaN for a block holding NaN or inf), folded into
    the batch's maximum; q as values and codes."""
    g, tr, tc, r, c = _tile(TILE_BR, BR, BRP, TILE_BC, BC, BCP)
    inside = _tile_mask(r, c, R, C, BRP, BR, BCP, BC)
    g64 = g.to(tl.int64)
    x = _load_float32(x_ptr + (g64 * sx_g + (r * sx_r + c * sx_c)), inside, FLOAT32)
    a_bits = _block_max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    finite = a_bits < 0x7F800000
    a = tl.where(finite, a_bits.to(tl.float32, bitcast=True), 0.0)
    # -- 1. sigma, the mantissa truncated to 4 bits; 2. v and q --
    sigma = ((a * _f32(INV_C_BITS)).to(tl.int32, bitcast=True) & EDEN_MANTISSA_4)
    sigma = sigma.to(tl.float32, bitcast=True)
    sigma = tl.where(sigma >= TINY, sigma, 0.0)
    v = x * tl.where(sigma > 0.0, tl.math.div_rn(1.0, sigma), 0.0)
    q = _round_to_format(v, None, EL_MBITS, EL_EMIN, EL_EMAX, EL_MAX_BITS, EL_SIGNED,
                         EL_SUBNORMALS, EL_FNUZ, EL_HAS_NAN, NEAREST_EVEN, 0)
    # -- 3. the correction <v, v> / <v, q> (float64 sums); 4. its BF16 rounding --
    v64 = v.to(tl.float64)
    v_v = _block_sum(v64 * v64).to(tl.float32)
    v_q = _block_sum(v64 * q.to(tl.float64)).to(tl.float32)
    correction = tl.where(v_q == 0.0, 1.0, tl.math.div_rn(v_v, v_q))
    corrected = tl.where(finite, _bfloat16_round(sigma * correction), float("nan"))
    br = tr * TILE_BR + tl.arange(0, TILE_BR)[:, None, None, None]
    bc = tc * TILE_BC + tl.arange(0, TILE_BC)[None, None, :, None]
    valid = (br * BR < R) & (bc * BC < C)
    tl.store(corrected_ptr + (g64 * sb_g + (br * sb_r + bc * sb_c)), corrected, mask=valid)
    top = tl.where(valid, corrected.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
    tl.atomic_max(tensor_amax_ptr + g // planes_per_batch, tl.reduce(top, None, _elementwise_max),
                  sem="relaxed")
    flat = g64 * so_g + (r * so_r + c * so_c)
    if WRITE_VALUES:
        tl.store(values_ptr + flat, q, mask=inside)
    if WRITE_CODES:
        codes = _encode(q, EL_MBITS, EL_EMIN, EL_SUBNORMALS, EL_SIGNED, EL_FNUZ, EL_SIGN_CODE,
                        EL_NAN_CODE, EL_NAN_SIGNED)
        tl.store(codes_ptr + flat, codes, mask=inside)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "stream"])
def _eden_scales_kernel(
    corrected_ptr, tensor_amax_ptr, noise_ptr, values_ptr, scales_ptr, decode_ptr,
    R, C, planes_per_batch, sn_g, sn_r, sn_c, so_g, so_r, so_c, sb_g, sb_r, sb_c,
    ss_g, ss_r, ss_c, seed_lo, seed_hi, stream,
    TILE_BR: tl.constexpr, BR: tl.constexpr, BRP: tl.constexpr,
    TILE_BC: tl.constexpr, BC: tl.constexpr, BCP: tl.constexpr,
    SC_MBITS: tl.constexpr, SC_EMIN: tl.constexpr, SC_EMAX: tl.constexpr,
    SC_MAX_BITS: tl.constexpr, SC_SIGNED: tl.constexpr, SC_SUBNORMALS: tl.constexpr,
    SC_FNUZ: tl.constexpr, SC_HAS_NAN: tl.constexpr,
    NOISE: tl.constexpr, WRITE_VALUES: tl.constexpr, WRITE_SCALES: tl.constexpr,
):
    """MS-EDEN's steps 5-6 (`fp4lab.formats.eden.stored_scales`): t = max_b sigma~_b * 2^-8,
    each block's stored scale SR(fl(sigma~ * fl(1 / t))) with the uniform at its first element;
    the values q become q * s * t in place."""
    g, tr, tc, r, c = _tile(TILE_BR, BR, BRP, TILE_BC, BC, BCP)
    inside = _tile_mask(r, c, R, C, BRP, BR, BCP, BC)
    g64 = g.to(tl.int64)
    batch = g // planes_per_batch
    br = tr * TILE_BR + tl.arange(0, TILE_BR)[:, None, None, None]
    bc = tc * TILE_BC + tl.arange(0, TILE_BC)[None, None, :, None]
    valid = (br * BR < R) & (bc * BC < C)
    corrected = tl.load(corrected_ptr + (g64 * sb_g + (br * sb_r + bc * sb_c)), mask=valid,
                        other=0.0)
    t = tl.load(tensor_amax_ptr + batch).to(tl.float32, bitcast=True) * 0.00390625  # 2^-8
    inverse = tl.minimum(tl.where(t != 0.0, tl.math.div_rn(1.0, t), 0.0), FLT_MAX,
                         propagate_nan=tl.PropagateNan.ALL)
    first = g64 * so_g + (br * BR * so_r + bc * BC * so_c)  # each block's first element
    u = _uniforms(noise_ptr, g64 * sn_g + (br * BR * sn_r + bc * BC * sn_c), valid, first,
                  seed_lo, seed_hi, stream, NOISE)
    k = tl.floor(u * 65536.0).to(tl.int32)  # 2^16 u: the kernel's 16 random bits
    s = _eden_stored_scale(corrected * inverse, k, SC_MBITS, SC_EMIN, SC_EMAX, SC_MAX_BITS,
                           SC_SIGNED, SC_SUBNORMALS, SC_FNUZ, SC_HAS_NAN)
    if WRITE_SCALES:
        tl.store(scales_ptr + (g64 * ss_g + (br * ss_r + bc * ss_c)), s, mask=valid)
        is_first = (g % planes_per_batch == 0) & (tr == 0) & (tc == 0)
        tl.store(decode_ptr + batch, t, mask=is_first)
    if WRITE_VALUES:
        flat = g64 * so_g + (r * so_r + c * so_c)
        q = tl.load(values_ptr + flat, mask=inside, other=0.0)
        tl.store(values_ptr + flat, (q * s) * t, mask=inside)


@triton.jit
def _pack_kernel(codes_ptr, packed_ptr, n, BLOCK: tl.constexpr):
    """`pack_codes` for 4-bit codes: bytes (code 2i) | (code 2i + 1) << 4 of contiguous codes."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.load(codes_ptr + 2 * i, mask=2 * i < n, other=0).to(tl.int32)
    hi = tl.load(codes_ptr + 2 * i + 1, mask=2 * i + 1 < n, other=0).to(tl.int32)
    tl.store(packed_ptr + i, ((lo & 0xF) | ((hi & 0xF) << 4)).to(tl.uint8), mask=2 * i < n)


# -- how x is seen: planes (G, R, C) of blocks (BR, BC) -----------------------------------------
@dataclass(frozen=True)
class _Planes:
    """x as G planes of R x C elements and blocks of BR x BC (a per-tensor spec: the plane).

    Attributes:
        groups: x's dims merged into G, R and C, in order (each a tuple of dims).
        sizes: (G, R, C).
        block: (BR, BC).
        per_tensor: one block per plane.
        planes_per_batch: consecutive planes that share a tensor amax (batch_dims).
        batches: the number of tensors of the batch, prod(x.shape[:batch_dims]).
        scales_shape: the reference's scales shape in block order (transposed 2-D tiles
            transpose it back).
        scale_groups: the scales' dims merged into G, block rows and block columns.
        transposed: 2-D tiles with axis = ndim - 2 (rows of the tile run along dim -1).
    """

    groups: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    sizes: tuple[int, int, int]
    block: tuple[int, int]
    per_tensor: bool
    planes_per_batch: int
    batches: int
    scales_shape: tuple[int, ...]
    scale_groups: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
    transposed: bool

    @property
    def block_counts(self) -> tuple[int, int]:
        """Blocks along R and along C."""
        (_, rows, cols), (br, bc) = self.sizes, self.block
        return -(-rows // br), -(-cols // bc)


@functools.lru_cache(maxsize=256)
def _planes(shape: tuple[int, ...], spec: QuantSpec, axis: int, batch_dims: int) -> _Planes:
    """The planes of x for spec's blocks along `axis` (already normalized)."""
    nd, bd = len(shape), batch_dims
    span = lambda lo, hi: tuple(range(lo, hi))  # noqa: E731
    batches = math.prod(shape[:bd])
    if spec.block is None:  # one block per tensor of the batch
        rest = span(bd, nd)
        groups, block, ppb = (span(0, bd), rest[:-1], rest[-1:]), None, 1
        scales_shape = tuple(shape[:bd])
        scale_groups = (span(0, bd), (), ())
    elif len(spec.block) == 1 and axis == nd - 1:
        groups, block, ppb = (span(0, bd), span(bd, nd - 1), (nd - 1,)), (1, spec.block[0]), 1
        scales_shape = (*shape[:-1], -(-shape[-1] // spec.block[0]))
        scale_groups = groups
    elif len(spec.block) == 1:
        groups, block = (span(0, axis), (axis,), span(axis + 1, nd)), (spec.block[0], 1)
        ppb = math.prod(shape[bd:axis])
        scales_shape = (*shape[:axis], -(-shape[axis] // spec.block[0]), *shape[axis + 1:])
        scale_groups = groups
    else:  # tiles over the last two dims; with axis = ndim - 2 their rows run along dim -1
        rows, cols = (nd - 1, nd - 2) if axis == nd - 2 else (nd - 2, nd - 1)
        groups, block = (span(0, nd - 2), (rows,), (cols,)), spec.block
        ppb = math.prod(shape[bd:nd - 2])
        scales_shape = (*shape[:-2], -(-shape[rows] // block[0]), -(-shape[cols] // block[1]))
        scale_groups = (span(0, nd - 2), (nd - 2,), (nd - 1,))
    sizes = tuple(math.prod(shape[i] for i in group) for group in groups)
    return _Planes(
        groups=groups, sizes=sizes, block=block or sizes[1:], per_tensor=block is None,
        planes_per_batch=ppb, batches=batches, scales_shape=scales_shape,
        scale_groups=scale_groups,
        transposed=spec.block is not None and len(spec.block) == 2 and axis == nd - 2,
    )


def _merged_strides(shape, strides, groups) -> tuple[int, int, int] | None:
    """The strides of the dims merged group by group, or None where a group's dims do not form
    one stride (size-1 dims are left out; an empty group has stride 0)."""
    merged = []
    for group in groups:
        dims = [i for i in group if shape[i] != 1]
        for outer, inner in zip(dims, dims[1:], strict=False):
            if strides[outer] != strides[inner] * shape[inner]:
                return None
        merged.append(strides[dims[-1]] if dims else 0)
    return tuple(merged)


def _strided(t: torch.Tensor, groups) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """t and its merged strides, read in place where its strides allow, else from a copy. The
    kernels index a plane in int32: its elements must lie within 2^31 of its first."""
    strides = _merged_strides(t.shape, t.stride(), groups)
    if strides is None:
        t = t.contiguous()
        strides = _merged_strides(t.shape, t.stride(), groups)
    sizes = [math.prod(t.shape[i] for i in group) for group in groups]
    if (sizes[1] - 1) * abs(strides[1]) + (sizes[2] - 1) * abs(strides[2]) >= 1 << 31:
        raise ValueError(f"x: a plane of {sizes[1]} x {sizes[2]} elements spans 2^31 elements "
                         f"or more, beyond the kernels' int32 indexing")
    return t, strides


def _flat_strides(shape, groups) -> tuple[int, int, int]:
    """The merged strides of a contiguous tensor of this shape: the row-major (flat) index."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return _merged_strides(shape, strides, groups)


# -- the spec as compile-time constants ---------------------------------------------------------
def _bits(value: float) -> int:
    """The float32 bit pattern of a float32 number."""
    t = torch.tensor(value, dtype=torch.float32)
    if float(t) != value:
        raise ValueError(f"{value!r} is not a float32 number")
    return int(t.view(torch.int32))


def _check_format(fmt: FloatFormat, field: str) -> None:
    """The float32 rounding of the kernels holds for formats inside float32's range."""
    ok = (-127 <= fmt.emin <= fmt.mbits and fmt.emin - fmt.mbits >= -149 and fmt.mbits <= 23
          and fmt.emax <= 127)
    if not ok:
        raise ValueError(
            f"spec.{field} = {fmt.name} (emin {fmt.emin}, emax {fmt.emax}, mbits {fmt.mbits}) is "
            f"outside the kernels' float32 rounding: they need -127 <= emin <= mbits, "
            f"emin - mbits >= -149, mbits <= 23 and emax <= 127"
        )


def _format_constants(fmt: FloatFormat, prefix: str) -> dict:
    """The rounding constants of a format, named PREFIX_FIELD."""
    return {
        f"{prefix}_MBITS": fmt.mbits, f"{prefix}_EMIN": fmt.emin, f"{prefix}_EMAX": fmt.emax,
        f"{prefix}_MAX_BITS": _bits(fmt.max), f"{prefix}_SIGNED": fmt.signed,
        f"{prefix}_SUBNORMALS": fmt.subnormals,
        f"{prefix}_FNUZ": fmt.specials is Specials.FNUZ, f"{prefix}_HAS_NAN": fmt.has_nan,
    }


def _code_constants(fmt: FloatFormat) -> dict:
    """The encoding constants of the element format (`FloatFormat.encode`'s NaN codes)."""
    return {
        "EL_SIGN_CODE": fmt.sign_code, "EL_NAN_CODE": fmt.nan_code or 0,
        "EL_NAN_SIGNED": fmt.signed and fmt.specials in (Specials.FN, Specials.IEEE),
    }


def _scale_exponent_bounds(fmt: FloatFormat) -> tuple[int, int]:
    """The powers of two of a scale format, as the reference computes them (in float32)."""
    lo = int(torch.tensor(fmt.min_subnormal).log2().floor())
    hi = int(torch.tensor(fmt.max).log2().floor())
    return lo, hi


def _floor_bits(spec: QuantSpec) -> int:
    """The scale floor: fl32(floor) where t is clamped; rounded into the scale format where a
    power-of-two rule's 2^e is (max and rounding commute)."""
    if spec.scale_floor is None:
        return 0
    if spec.scale_rule.power_of_two:
        floor = torch.tensor(spec.scale_floor, dtype=torch.float64)
        return _bits(float(round_to_format(floor, spec.scale, rounding=Rounding.NEAREST_EVEN)))
    return _bits(float(torch.tensor(spec.scale_floor, dtype=torch.float32)))


def _exact_reciprocal(spec: QuantSpec, lo: int, hi: int) -> bool:
    """Whether every divisor of the elements is a power of two with a float32 reciprocal, so a
    product with fl(1 / divisor) is the correctly rounded quotient."""
    if spec.fixed_scale is not None:
        mantissa, exponent = math.frexp(spec.fixed_scale)
        return mantissa == 0.5 and -149 <= 1 - exponent <= 127  # 1 / d = 2^(1 - exponent)
    return (spec.arithmetic is ScaleArithmetic.EXACT and spec.scale_rule.power_of_two
            and not spec.tensor_scale and spec.scale_floor is None and lo >= -127 and hi <= 149)


@functools.lru_cache(maxsize=256)
def _spec_constants(spec: QuantSpec, rounding: Rounding) -> dict:
    """Every constant of the block format the quantize kernel compiles in."""
    element, scale = spec.element, spec.scale
    _check_format(element, "element")
    if spec.fixed_scale is None:
        _check_format(scale, "scale")
    lo, hi = _scale_exponent_bounds(scale)
    m_e = element.max
    return dict(
        RULE=_RULES[spec.scale_rule], ARITH=_ARITHMETICS[spec.arithmetic],
        TENSOR_SCALE=spec.tensor_scale, FIXED=spec.fixed_scale is not None,
        FIXED_BITS=_bits(spec.fixed_scale or 1.0), EXACT_RECIPROCAL=_exact_reciprocal(spec, lo, hi),
        FLOOR=spec.scale_floor is not None, FLOOR_BITS=_floor_bits(spec), M_E_BITS=_bits(m_e),
        INV_M_E_BITS=_bits(float(1.0 / torch.tensor(m_e))),
        BIG_BITS=_bits(float(torch.tensor(scale.max * m_e, dtype=torch.float32))),
        EPS_BITS=_bits(float(torch.tensor(1e-8, dtype=torch.float32))), LO=lo, HI=hi,
        **_format_constants(element, "EL"), **_code_constants(element),
        **_format_constants(scale, "SC"),
        ROUNDING=_ROUNDINGS[rounding], SR_BITS=spec.sr_bits or 0,
    )


# -- tiles and launches -------------------------------------------------------------------------
def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _clamp(n: int, lo: int, hi: int) -> int:
    return max(lo, min(n, hi))


@dataclass(frozen=True)
class _Tiling:
    """The quantize kernel's tile (its constants and grid) and the first pass's tile.

    Blocks that fit a tile (padded to powers of two, at most `_MAX_BLOCK_ELEMENTS`) are reduced
    in registers; larger ones, and per-tensor blocks, read their amax from the first pass's
    buffer (`in_buffer`), the tile then being (rows, 1, 1, columns) of single elements."""

    constants: dict
    grid: tuple[int, int, int]
    in_buffer: bool
    amax_tile: tuple[int, int]
    amax_grid: tuple[int, int, int]
    amax_masked: bool


@functools.lru_cache(maxsize=256)
def _tiling(planes: _Planes, config: LaunchConfig) -> _Tiling:
    g, rows, cols = planes.sizes
    br, bc = planes.block
    brp, bcp = _next_pow2(br), _next_pow2(bc)
    in_buffer = planes.per_tensor or brp * bcp > _MAX_BLOCK_ELEMENTS
    if not in_buffer:
        nbr, nbc = planes.block_counts
        tile_bc = _clamp(config.tile_columns // bcp, 1, _next_pow2(nbc))
        tile_br = _clamp(config.tile_elements // (brp * bcp * tile_bc), 1, _next_pow2(nbr))
        constants = dict(TILE_BR=tile_br, ROW_STEP=br, BRP=brp, ROW_VALID=br, TILE_BC=tile_bc,
                         COL_STEP=bc, BCP=bcp, COL_VALID=bc)
        grid = (-(-cols // (tile_bc * bc)), -(-rows // (tile_br * br)), g)
        masked = rows % (tile_br * br) or cols % (tile_bc * bc) or brp != br or bcp != bc
        tc = min(config.tile_columns, _next_pow2(cols))
        amax_tile = (min(config.amax_tile_elements // tc, _next_pow2(rows)), tc)
    else:  # a tile lies inside one block: its extents divide the block's
        tc = min(config.tile_columns, _next_pow2(cols))
        tr = min(max(config.tile_elements // tc, 1), _next_pow2(rows))
        if not planes.per_tensor:
            tc, tr = min(tc, bc & -bc), min(tr, br & -br)
        constants = dict(TILE_BR=tr, ROW_STEP=1, BRP=1, ROW_VALID=1, TILE_BC=1, COL_STEP=tc,
                         BCP=tc, COL_VALID=tc)
        grid = (-(-cols // tc), -(-rows // tr), g)
        masked = rows % tr or cols % tc
        amax_tile = (tr, tc)
    amax_grid = (-(-cols // amax_tile[1]), -(-rows // amax_tile[0]), g)
    for extent in (grid[1], grid[2], amax_grid[1]):
        if extent > 65535:
            raise ValueError(f"x: {g} planes of {rows} x {cols} need a grid of {grid}, beyond "
                             f"CUDA's 65535 programs along its second and third axes")
    amax_masked = bool(rows % amax_tile[0] or cols % amax_tile[1])
    return _Tiling({**constants, "MASKED": bool(masked), "AMAX_IN_BUFFER": in_buffer}, grid,
                   in_buffer, amax_tile, amax_grid, amax_masked)


def _interpreting() -> bool:
    """Whether Triton's interpreter is asked for (TRITON_INTERPRET, read at call time)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _kernel_device(x: torch.Tensor) -> bool:
    """Whether the kernels take x where it is: on a CUDA device, or anywhere under the
    interpreter (benchmarks/compile_offline.py, which compiles without launching, says
    anywhere)."""
    return x.device.type == "cuda" or _interpreting()


@contextlib.contextmanager
def _interpreted_helpers():
    """This module's device functions (and Philox's) as interpreted functions while an
    interpreted kernel runs: a kernel's calls resolve through the module's globals, and
    `triton.jit` chose compiled functions when the module was imported."""
    names = [
        name for name, value in globals().items()
        if isinstance(value, JITFunction)
        and value.fn.__module__ in (__name__, "fp4lab.kernels.random")
    ]
    saved = {name: globals()[name] for name in names}
    globals().update({name: InterpretedFunction(value.fn) for name, value in saved.items()})
    try:
        yield
    finally:
        globals().update(saved)


def _run(kernel, grid: tuple, args: tuple, num_warps: int, constants: dict) -> None:
    """Launch a kernel on the GPU, or under Triton's interpreter where it is on. Fused
    multiply-adds stay off: each product is rounded, as in torch."""
    if _interpreting():
        with _interpreted_helpers():
            InterpretedFunction(kernel.fn)[grid](*args, **constants)
    else:
        kernel[grid](*args, num_warps=num_warps, enable_fp_fusion=False, **constants)


def _run_planned(kernel, grid: tuple, args: tuple, num_warps: int, constants: dict,
                 interpreting: bool) -> None:
    """`_run` for a plan's launch, whose constants and runtime ints stay fixed with the plan:
    after the first launch of a specialization the compiled kernel is called directly
    (`fp4lab.kernels.launch`, its constants keyed by identity), skipping the binder's work
    on ~80 arguments. `interpreting`: the call's `_interpreting()` (`_Request`)."""
    if interpreting:
        _run(kernel, grid, args, num_warps, constants)
        return
    launch(kernel, grid, args, constants, dict(num_warps=num_warps, enable_fp_fusion=False),
           fixed=True)


def _signed_word(word: int) -> int:
    """A uint32 word as the int32 with its bits (the kernels take it back as uint32)."""
    return word - (1 << 32) if word >= 1 << 31 else word


# -- the request, checked -----------------------------------------------------------------------
@dataclass(frozen=True)
class _Request:
    """A checked call: the spec, the normalized axis, the element rounding, the uniforms."""

    spec: QuantSpec
    axis: int
    batch_dims: int
    rounding: Rounding
    noise: torch.Tensor | None
    seed: int | None
    stream: int
    config: LaunchConfig
    interpreting: bool  # `_interpreting()`, read once per call
    amax: torch.Tensor | None = None  # the first pass's zeroed int32 buffer, or None: made

    @property
    def noise_kind(self) -> int:
        """NOISE_NONE, NOISE_TENSOR or NOISE_PHILOX: where stochastic rounding's uniforms
        come from (none for a format that draws nothing)."""
        if not (self.rounding is Rounding.STOCHASTIC or self.spec.correction is Correction.EDEN):
            return NOISE_NONE.value
        return NOISE_TENSOR.value if self.noise is not None else NOISE_PHILOX.value


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _KINDS:
        raise TypeError(f"x must be float32, bfloat16 or float16 for the Triton kernels, got "
                        f"{x.dtype} (float64 runs on fp4lab.formats' reference path)")
    if not _kernel_device(x):
        raise ValueError(f"x is on {x.device}: the Triton kernels need a CUDA tensor (or "
                         f"Triton's interpreter, TRITON_INTERPRET=1, for CPU tensors)")
    if x.ndim == 0 or x.numel() == 0:
        raise ValueError(f"x must have at least one dim and one element, got shape "
                         f"{tuple(x.shape)}")


def _check_noise(noise, seed, stream, x: torch.Tensor, stochastic: bool) -> None:
    if noise is not None:
        if not isinstance(noise, torch.Tensor) or noise.shape != x.shape:
            got = tuple(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
            raise ValueError(f"noise must be a tensor of x's shape {tuple(x.shape)}, got {got}")
        if not noise.dtype.is_floating_point:
            raise TypeError(f"noise must hold floating-point uniforms, got {noise.dtype}")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)
                                 and 0 <= seed < 1 << 64):
        raise ValueError(f"seed must be an int in [0, 2**64) or None, got {seed!r}")
    if not (isinstance(stream, int) and not isinstance(stream, bool) and 0 <= stream < 1 << 32):
        raise ValueError(f"stream must be an int in [0, 2**32), got {stream!r}")
    if stochastic and (noise is None) == (seed is None):
        raise ValueError("this format rounds stochastically: give exactly one of noise "
                         "(uniforms of x's shape) and seed (Philox draws by position)")


def _request(x, spec, axis, rounding, batch_dims, noise, seed, stream, generator,
             config, amax=None) -> _Request:
    """Every argument checked, as the reference checks it where it takes the same one."""
    _check_x(x)
    spec = resolve_spec(spec)
    axis = _normalize_axis(axis, x.ndim, spec, batch_dims)
    if generator is not None:
        raise TypeError("generator: a torch.Generator's stream cannot be reproduced in a "
                        "kernel; pass noise= (uniforms of x's shape) or seed= (Philox draws)")
    rounding = spec.rounding if rounding is None else Rounding.parse(rounding)
    if spec.correction is Correction.EDEN and rounding is not Rounding.NEAREST_EVEN:
        raise ValueError(f"rounding must be nearest_even for correction=eden (spec "
                         f"{spec.name}), got {rounding.value}")
    stochastic = rounding is Rounding.STOCHASTIC or spec.correction is Correction.EDEN
    _check_noise(noise, seed, stream, x, stochastic)
    if not isinstance(config, LaunchConfig):
        raise TypeError(f"config must be a LaunchConfig or None, got {type(config).__name__}")
    if noise is not None:
        noise = noise.to(device=x.device, dtype=torch.float64)
    if amax is not None and not (isinstance(amax, torch.Tensor) and amax.dtype == torch.int32
                                 and amax.ndim == 1 and amax.device == x.device):
        raise ValueError("amax must be a 1-D int32 tensor on x's device (a zeroed buffer of "
                         "first_pass_elements(...) elements) or None")
    return _Request(spec, axis, batch_dims, rounding, noise, seed, stream, config,
                    _interpreting(), amax)


# -- the passes ---------------------------------------------------------------------------------
@dataclass
class _Outputs:
    """What a call writes: the fake-quantized values (float32 before an inverse Hadamard
    transform), codes, packed codes, scales and the tensor scale; None where not asked."""

    out: torch.Tensor | None = None
    codes: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    decode: torch.Tensor | None = None


def _allocate(x: torch.Tensor, planes: _Planes, req: _Request, out_dtype, *, fake: bool,
              codes: bool, packed: bool, scales: bool, factored: bool = False) -> _Outputs:
    spec, device = req.spec, x.device
    bits = spec.element.bits
    n_packed = -(-x.numel() * bits // 8)
    return _Outputs(
        out=torch.empty(x.shape, dtype=out_dtype, device=device) if fake else None,
        codes=torch.empty(x.shape, dtype=spec.element.code_dtype, device=device)
        if codes else None,
        packed=torch.empty(n_packed, dtype=torch.uint8, device=device) if packed else None,
        scales=torch.empty(planes.scales_shape, dtype=torch.float32, device=device)
        if scales else None,
        decode=torch.empty(planes.batches, dtype=torch.float32, device=device)
        if (scales or factored) and (spec.tensor_scale or spec.correction is Correction.EDEN)
        else None,
    )


def _scale_strides(planes: _Planes, scales: torch.Tensor | None) -> tuple[int, int, int]:
    """The scales' strides by (plane, block row, block column)."""
    if scales is None:
        return 0, 0, 0
    return _merged_strides(scales.shape, scales.stride(), planes.scale_groups)


def _seed_words(req: _Request) -> tuple[int, int, int]:
    return _key_words(req.seed or 0, req.stream)


@functools.lru_cache(maxsize=256)
def _key_words(seed: int, stream: int) -> tuple[int, int, int]:
    """The kernels' (seed_lo, seed_hi, stream) words of a Philox seed and stream, as int32s."""
    lo, hi = philox.split_key(seed)
    return _signed_word(lo), _signed_word(hi), _signed_word(stream)


def _bits_view(t: torch.Tensor | None) -> torch.Tensor | None:
    """bfloat16 tensors travel as their int16 bits (always read so; written so where the
    interpreter runs, whose own bfloat16 cast truncates)."""
    return t.view(torch.int16) if t is not None and t.dtype == torch.bfloat16 else t


def _fused_packing(planes: _Planes, flat: tuple[int, int, int], tiling: _Tiling,
                   spec: QuantSpec) -> bool:
    """Whether the quantize kernel packs the FP4 codes itself: the pairs of row-major indices
    (2i, 2i + 1) lie next to each other along the tile's last axis."""
    cols = planes.sizes[2]
    return (spec.element.bits == 4 and flat[2] == 1 and cols % 2 == 0
            and tiling.constants["COL_STEP"] % 2 == 0 and tiling.constants["COL_VALID"] % 2 == 0)


@dataclass(frozen=True)
class _BlocksPlan:
    """What a call of the first pass and the quantize kernel does not take from its tensors'
    data: built once for a spec, x's shape, strides and dtype, the noise's strides and the
    outputs asked for, then reused, so a call costs little more than its launches.

    Attributes:
        spec, config: the objects it was built for (its cache key holds their ids).
        planes: how x is seen; copy_x / copy_noise: whether their strides need a copy first.
        strides: x's, the noise's, the flat index's and the scales' merged strides.
        block_amax_shape: the first pass's block buffer, or None.
        fused_pack: the kernel packs the FP4 codes itself.
        amax_grid, amax_constants: the first pass, or None where the format needs none.
        amax_layout: its buffer as (block amax elements, the tensor amax's offset, all
            elements): one int32 buffer for both (`first_pass_elements`).
        grid, constants: the quantize kernel.
    """

    spec: QuantSpec
    config: LaunchConfig
    planes: _Planes
    copy_x: bool
    copy_noise: bool
    strides: tuple[int, ...]
    block_amax_shape: tuple[int, int, int] | None
    fused_pack: bool
    amax_grid: tuple[int, int, int]
    amax_constants: dict | None
    amax_layout: tuple[int, int, int]
    grid: tuple[int, int, int]
    constants: dict


_PLANS: dict = {}


def _blocks_plan(x: torch.Tensor, req: _Request, out_dtype, wants: tuple) -> _BlocksPlan:
    """The cached plan for this call (see `_BlocksPlan`); wants: (fake, codes, packed,
    scales, factored, stored), the outputs asked for."""
    noise = req.noise
    key = (id(req.spec), id(req.config), req.rounding, req.axis, req.batch_dims, x.dtype,
           tuple(x.shape), x.stride(), None if noise is None else noise.stride(),
           req.noise_kind, out_dtype, wants, req.interpreting)
    plan = _PLANS.get(key)
    if plan is None or plan.spec is not req.spec or plan.config is not req.config:
        if len(_PLANS) > 1024:
            _PLANS.clear()
        plan = _PLANS[key] = _make_blocks_plan(x, req, out_dtype, *wants)
    return plan


def _make_blocks_plan(x: torch.Tensor, req: _Request, out_dtype, fake: bool, codes: bool,
                      packed: bool, scales: bool, factored: bool = False,
                      stored: int = 0) -> _BlocksPlan:
    spec = req.spec
    planes = _planes(tuple(x.shape), spec, req.axis, req.batch_dims)
    tiling = _tiling(planes, req.config)
    sx = _merged_strides(x.shape, x.stride(), planes.groups)
    copy_x = sx is None
    xk, sx = _strided(x, planes.groups)
    copy_noise, sn = False, (0, 0, 0)
    if req.noise is not None:
        copy_noise = _merged_strides(x.shape, req.noise.stride(), planes.groups) is None
        sn = _strided(req.noise, planes.groups)[1]
    flat = _flat_strides(x.shape, planes.groups)
    nbr, nbc = planes.block_counts
    needs_block_amax = tiling.in_buffer and spec.fixed_scale is None
    kind = _KINDS[x.dtype]
    amax_constants = None
    if needs_block_amax or spec.tensor_scale:
        amax_constants = dict(TILE_R=tiling.amax_tile[0], TILE_C=tiling.amax_tile[1],
                              MASKED=tiling.amax_masked, IN_KIND=kind,
                              BLOCK_AMAX=needs_block_amax, TENSOR_AMAX=spec.tensor_scale)
    fused = packed and _fused_packing(planes, flat, tiling, spec)
    out_kind = NO_OUTPUT.value
    if fake:
        out_kind = _KINDS[out_dtype]
        if out_dtype == torch.bfloat16 and req.interpreting:
            out_kind = BFLOAT16_BITS.value
    constants = dict(**tiling.constants, **_spec_constants(spec, req.rounding),
                     NOISE=req.noise_kind, IN_KIND=kind, OUT_KIND=out_kind,
                     WRITE_CODES=codes or (packed and not fused), WRITE_PACKED=fused,
                     WRITE_SCALES=scales, FACTORED=factored, STORED=stored)
    ss = _flat_strides(planes.scales_shape, planes.scale_groups) if scales else (0, 0, 0)
    strides = (*sx, *sn, *flat, *ss, nbr * nbc, nbc, 1)
    n_block = planes.sizes[0] * nbr * nbc if needs_block_amax else 0
    offset = _aligned(n_block)
    layout = (n_block, offset, offset + planes.batches if spec.tensor_scale else n_block)
    return _BlocksPlan(
        spec=spec, config=req.config, planes=planes, copy_x=copy_x, copy_noise=copy_noise,
        strides=strides, block_amax_shape=(planes.sizes[0], nbr, nbc) if needs_block_amax
        else None, fused_pack=fused, amax_grid=tiling.amax_grid, amax_constants=amax_constants,
        amax_layout=layout, grid=tiling.grid, constants=constants,
    )


_ALIGN = 32  # int32 elements (128 bytes) between the starts of buffers cut from one


def _aligned(n: int) -> int:
    """n rounded up to whole `_ALIGN`s: a buffer starting there keeps its pointer 16-byte
    aligned (Triton's pointer specialization) when cut from a larger one."""
    return -(-n // _ALIGN) * _ALIGN


def first_pass_elements(shape, spec: QuantSpec | str, *, axis: int = -1, batch_dims: int = 0,
                        config: LaunchConfig | None = None) -> int:
    """The int32 elements the first pass accumulates into (block amaxes, then the tensor
    amaxes, each batch of tensors' `_aligned`) for x of `shape` quantized as `fake_quantize`,
    `fake_quantize_factored` and `fake_quantize_stored` take it with these arguments; 0
    where the format needs no first pass. A caller quantizing several tensors can make one
    zeroed buffer for all of them and hand each its slice (`amax=`), whose start it keeps at
    a multiple of 32 elements (`_aligned`) so that every slice stays 16-byte aligned."""
    spec = resolve_spec(spec)
    shape = tuple(shape)
    axis = _normalize_axis(axis, len(shape), spec, batch_dims)
    if spec.correction is Correction.EDEN:
        return 0  # MS-EDEN's passes make their own (`_run_eden`)
    planes = _planes(shape, spec, axis, batch_dims)
    tiling = _tiling(planes, FAKE_QUANTIZE_CONFIG if config is None else config)
    nbr, nbc = planes.block_counts
    n_block = planes.sizes[0] * nbr * nbc if tiling.in_buffer and spec.fixed_scale is None else 0
    return _aligned(n_block) + planes.batches if spec.tensor_scale else n_block


def _run_blocks(x: torch.Tensor, plan: _BlocksPlan, req: _Request, outputs: _Outputs) -> None:
    """The first pass where the format needs one (a tensor scale, blocks larger than a tile),
    then the quantize kernel, then the packing of the codes where the kernel could not."""
    spec, planes, device = req.spec, plan.planes, x.device
    xk = _bits_view(x.contiguous() if plan.copy_x else x)
    noise = req.noise
    if noise is not None and plan.copy_noise:
        noise = noise.contiguous()
    block_amax = tensor_amax = None
    n_block, offset, total = plan.amax_layout
    amax = req.amax
    if total and amax is None:  # one buffer for both, zeroed
        amax = torch.zeros(total, dtype=torch.int32, device=device)
    elif total and amax.numel() < total:
        raise ValueError(f"amax: {amax.numel()} elements, the first pass needs {total} "
                         "(first_pass_elements)")
    if plan.block_amax_shape is not None:
        block_amax = amax[:n_block].view(plan.block_amax_shape)
    if spec.tensor_scale:
        tensor_amax = amax[offset:total]
    (_, rows, cols), ppb = planes.sizes, planes.planes_per_batch
    if plan.amax_constants is not None:
        _run_planned(_amax_kernel, plan.amax_grid,
             (xk, block_amax, tensor_amax, rows, cols, ppb, *planes.block, *plan.strides[:3],
              *plan.strides[-3:]), 8, plan.amax_constants, req.interpreting)
    if outputs.packed is not None and not plan.fused_pack and outputs.codes is None:
        outputs.codes = torch.empty(x.shape, dtype=spec.element.code_dtype, device=device)
    out = outputs.out
    if plan.constants["OUT_KIND"] == BFLOAT16_BITS.value:
        out = _bits_view(out)
    _run_planned(_quantize_kernel, plan.grid,
         (xk, noise, block_amax, tensor_amax, out, outputs.codes,
          outputs.packed if plan.fused_pack else None, outputs.scales, outputs.decode,
          rows, cols, ppb, *planes.block, *plan.strides, *_seed_words(req)),
         req.config.num_warps, plan.constants, req.interpreting)
    if outputs.packed is not None and not plan.fused_pack:
        _pack(outputs.codes, outputs.packed, spec.element.bits)


def _pack(codes: torch.Tensor, packed: torch.Tensor, bits: int) -> None:
    """`pack_codes` of the codes into `packed`: 4-bit codes by a kernel, 8-bit ones copied."""
    if bits == 8:
        packed.copy_(codes.reshape(-1).view(torch.uint8))
        return
    block = 1024
    _run(_pack_kernel, (-(-packed.numel() // block),), (codes, packed, codes.numel()), 4,
         dict(BLOCK=block))


def _run_eden(x: torch.Tensor, planes: _Planes, req: _Request, outputs: _Outputs) -> None:
    """MS-EDEN: the elements and corrected scales, then the tensor scale and the stored
    scales (`Correction.EDEN`), on the rotated x."""
    spec, config, device = req.spec, req.config, x.device
    tiling = _tiling(planes, config)
    if tiling.in_buffer:
        raise ValueError(f"spec {spec.name}: correction=eden needs blocks of at most "
                         f"{_MAX_BLOCK_ELEMENTS} elements in the Triton kernels")
    _check_format(spec.element, "element")
    _check_format(spec.scale, "scale")
    xk, sx = _strided(x, planes.groups)
    flat = _flat_strides(x.shape, planes.groups)
    g, rows, cols = planes.sizes
    nbr, nbc = planes.block_counts
    corrected = torch.empty(g, nbr, nbc, dtype=torch.float32, device=device)
    tensor_amax = torch.zeros(planes.batches, dtype=torch.int32, device=device)
    tile = {name: tiling.constants[name] for name in ("TILE_BR", "BRP", "TILE_BC", "BCP")}
    tile.update(BR=planes.block[0], BC=planes.block[1])
    inverse_c = float(torch.ones(()) / torch.tensor(spec.amax_target, dtype=torch.float32))
    if outputs.packed is not None and outputs.codes is None:
        outputs.codes = torch.empty(x.shape, dtype=spec.element.code_dtype, device=device)
    element = {**_format_constants(spec.element, "EL"), **_code_constants(spec.element)}
    _run(_eden_elements_kernel, tiling.grid,
         (xk, corrected, tensor_amax, outputs.out, outputs.codes, rows, cols,
          planes.planes_per_batch, *sx, *flat, nbr * nbc, nbc, 1),
         config.num_warps,
         dict(**tile, INV_C_BITS=_bits(inverse_c), **element,
              WRITE_VALUES=outputs.out is not None, WRITE_CODES=outputs.codes is not None))
    noise, sn = (None, (0, 0, 0)) if req.noise is None else _strided(req.noise, planes.groups)
    _run(_eden_scales_kernel, tiling.grid,
         (corrected, tensor_amax, noise, outputs.out, outputs.scales, outputs.decode, rows, cols,
          planes.planes_per_batch, *sn, *flat, nbr * nbc, nbc, 1,
          *_scale_strides(planes, outputs.scales), *_seed_words(req)),
         config.num_warps,
         dict(**tile, **_format_constants(spec.scale, "SC"), NOISE=req.noise_kind,
              WRITE_VALUES=outputs.out is not None, WRITE_SCALES=outputs.scales is not None))
    if outputs.packed is not None:
        _pack(outputs.codes, outputs.packed, spec.element.bits)


def _compute(x: torch.Tensor, req: _Request, *, fake: bool = False, codes: bool = False,
             packed: bool = False, scales: bool = False, factored: bool = False,
             stored: int = 0, out_dtype: torch.dtype | None = None) -> tuple[_Outputs, _Planes]:
    """The kernels' outputs for x: the Hadamard transform first where the spec has one (the
    reference's torch matmul), then the passes; the fake-quantized values are finished (inverse
    transform, x's dtype or `out_dtype`) and the scales put in the reference's layout."""
    spec = req.spec
    if packed and spec.element.bits not in (4, 8):
        raise ValueError(f"spec {spec.name}: packing takes 4- or 8-bit codes, the element "
                         f"format {spec.element.name} has {spec.element.bits}")
    if codes or packed:
        _check_codes(spec)
    xw = x.detach()
    if spec.hadamard is not None:
        xw = _hadamard(xw.float(), spec, req.axis, inverse=False)
    eden = spec.correction is Correction.EDEN
    target = x.dtype if out_dtype is None else out_dtype
    out_dtype = torch.float32 if spec.hadamard is not None or eden else target
    if eden:
        planes = _planes(tuple(x.shape), spec, req.axis, req.batch_dims)
    else:
        plan = _blocks_plan(xw, req, out_dtype, (fake, codes, packed, scales, factored, stored))
        planes = plan.planes
    outputs = _allocate(x, planes, req, out_dtype, fake=fake, codes=codes, packed=packed,
                        scales=scales, factored=factored)
    elsewhere = x.is_cuda and x.device.index != torch.cuda.current_device()
    with torch.cuda.device(x.device) if elsewhere else contextlib.nullcontext():
        if eden:
            _run_eden(xw, planes, req, outputs)
        else:
            _run_blocks(xw, plan, req, outputs)
    if fake and (spec.hadamard is not None or outputs.out.dtype != target):
        out = outputs.out
        if spec.hadamard is not None:
            out = _hadamard(out, spec, req.axis, inverse=True)
        outputs.out = out.to(target)
    if outputs.scales is not None and planes.transposed:
        outputs.scales = outputs.scales.transpose(-1, -2)
    if outputs.decode is not None:
        outputs.decode = _tensor_scale_out(outputs.decode, tuple(x.shape), req.batch_dims)
    return outputs, planes


def encodes(fmt: FloatFormat) -> bool:
    """Whether the kernels encode element format `fmt`: at most 16 bits, and its smallest
    normal maps onto float32's by a float32 power of two (`_encode`)."""
    ok = fmt.emin <= 23 if fmt.subnormals else fmt.emin >= -126 or fmt.mbits == 0
    return fmt.bits <= 16 and ok


def _check_codes(spec: QuantSpec) -> None:
    """`encodes` of the element format, or a ValueError naming it."""
    fmt = spec.element
    if not encodes(fmt):
        raise ValueError(f"spec {spec.name}: the kernels do not encode {fmt.name} (they take "
                         f"at most 16 bits, and emin <= 23 where the format has subnormals)")


def _tensor_scale_out(decode: torch.Tensor, shape: tuple[int, ...], batch_dims: int):
    """The decode scale as a 0-dim tensor, or batch shape + size-1 dims (x's rank)."""
    if batch_dims == 0:
        return decode.reshape(())
    return decode.reshape(*shape[:batch_dims], *[1] * (len(shape) - batch_dims))


# -- the public entries -------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedQuantized:
    """`quantize_packed`'s result: the codes packed densely in x's row-major order as
    `fp4lab.formats.pack_codes` packs them (two FP4 codes a byte, the first in the low bits;
    8-bit codes one a byte), with the float32 scales and tensor scale of `QuantizedTensor`."""

    packed: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    shape: torch.Size
    spec: QuantSpec
    axis: int
    batch_dims: int = 0

    def unpack(self) -> QuantizedTensor:
        """The same as a `QuantizedTensor` (codes unpacked, one a code)."""
        return QuantizedTensor.from_packed(
            self.packed, shape=self.shape, scales=self.scales, tensor_scale=self.tensor_scale,
            spec=self.spec, axis=self.axis, batch_dims=self.batch_dims,
        )


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, req):
        outputs, _ = _compute(x, req, fake=True)
        return outputs.out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def fake_quantize(
    x: torch.Tensor,
    spec: QuantSpec | str,
    *,
    axis: int = -1,
    rounding: Rounding | str | None = None,
    batch_dims: int = 0,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
    stream: int = 0,
    generator: None = None,
    config: LaunchConfig | None = None,
    amax: torch.Tensor | None = None,
) -> torch.Tensor:
    """quantize then dequantize to x's dtype on the GPU: the bits of the reference's
    `fp4lab.formats.fake_quantize` (arguments as there); the gradient passes straight through.

    Stochastic rounding (and MS-EDEN's scales) takes its uniforms from `noise` (x's shape,
    element i rounded with noise[i]) or draws them in the kernel from Philox4x32 keyed by
    `seed` at each element's row-major position and `stream` (`philox_noise` gives the same
    uniforms as a tensor). `generator` is refused: its stream cannot be reproduced in a kernel.
    `config` sets tiles and warps (never the result; None: `FAKE_QUANTIZE_CONFIG`). `amax`: a
    zeroed int32 buffer of at least `first_pass_elements` elements for the first pass (a
    slice of one made for several calls), or None: one is made."""
    config = FAKE_QUANTIZE_CONFIG if config is None else config
    req = _request(x, spec, axis, rounding, batch_dims, noise, seed, stream, generator, config,
                   amax)
    if x.requires_grad and torch.is_grad_enabled():
        return _FakeQuantize.apply(x, req)
    return _compute(x, req, fake=True)[0].out


def fake_quantize_factored(
    x: torch.Tensor, spec: QuantSpec | str, *, axis: int = -1, batch_dims: int = 0,
    noise: torch.Tensor | None = None, config: LaunchConfig | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, decode) in one fused pass after the tensor amax: values the elements times
    their block scales in x's dtype, without the tensor scale, and decode that tensor scale
    (shaped as `QuantizedTensor.tensor_scale`), so values * decode is `fake_quantize`'s
    result up to its final rounding. For a block format with a tensor scale, no Hadamard
    transform, MS-EDEN or alpha grid: what the attention kernels read (E2M1 times an E4M3
    scale is exact in bf16; the tensor scale is not, and stays a factor). A stochastic
    format rounds with `noise` (uniforms of x's shape, as `fake_quantize` takes them), `amax`
    as `fake_quantize` takes it. Not differentiable."""
    req = _request(x, spec, axis, None, batch_dims, noise, None, 0, None,
                   FAKE_QUANTIZE_CONFIG if config is None else config, amax)
    spec = req.spec
    if not spec.tensor_scale or spec.hadamard is not None or (
        spec.correction is Correction.EDEN or spec.scale_rule.alpha_grid
    ):
        raise ValueError(f"spec {spec.name}: fake_quantize_factored takes a block format with "
                         "a tensor scale, no Hadamard transform, MS-EDEN or alpha grid")
    outputs, _ = _compute(x, req, fake=True, factored=True)
    return outputs.out, outputs.decode


class StoredScale(enum.Enum):
    """What `fake_quantize_stored` multiplies each element's value v (the decoded code, as
    `QuantizedTensor.element_values`: NaN as the format's NaN code decodes, +0 where it has
    none) by, in float32, before the one rounding into the output dtype."""

    ONE = "one"
    """1: the element values alone, the block scales (FP32 ones per tensor) kept apart."""
    POWER = "power"
    """2^E of an alpha grid's scale s = fl(2^E / M_e) where s > 0, else 0: the value times
    M_e, the 1/M_e kept apart."""


_STORED = {StoredScale.ONE: STORED_ONE.value, StoredScale.POWER: STORED_POWER.value}


def fake_quantize_stored(
    x: torch.Tensor, spec: QuantSpec | str, stored: StoredScale, *, axis: int = -1,
    batch_dims: int = 0, noise: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32, config: LaunchConfig | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, scales) in one fused pass (after the first pass where the format needs one):
    values each element's value times `stored`'s multiplier (`StoredScale`) rounded once into
    `out_dtype` (float32, or bfloat16 to nearest even: on the GPU by the conversion torch's
    own CUDA cast uses, NaN included), and with StoredScale.ONE the float32 block scales as
    `quantize` writes them (None with POWER). For a block format without a tensor scale,
    Hadamard transform or MS-EDEN (POWER: with an alpha grid); a stochastic format rounds
    with `noise`, `amax` as `fake_quantize` takes it. What the attention kernels read where a
    scale cannot be folded into bf16 values. Not differentiable."""
    if not isinstance(stored, StoredScale):
        raise TypeError(f"stored must be a StoredScale, got {type(stored).__name__}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
    req = _request(x, spec, axis, None, batch_dims, noise, None, 0, None,
                   FAKE_QUANTIZE_CONFIG if config is None else config, amax)
    spec = req.spec
    power = stored is StoredScale.POWER
    if spec.tensor_scale or spec.hadamard is not None or (
        spec.correction is Correction.EDEN or spec.scale_rule.alpha_grid != power
    ):
        raise ValueError(f"spec {spec.name}: fake_quantize_stored takes a block format without "
                         "a tensor scale, Hadamard transform or MS-EDEN, with an alpha grid for "
                         "StoredScale.POWER and without one for StoredScale.ONE")
    _check_codes(spec)  # the values are the codes' (`quantize` refuses what it cannot encode)
    outputs, _ = _compute(x, req, fake=True, scales=not power, stored=_STORED[stored],
                          out_dtype=out_dtype)
    return outputs.out, outputs.scales


def quantize(
    x: torch.Tensor,
    spec: QuantSpec | str,
    *,
    axis: int = -1,
    rounding: Rounding | str | None = None,
    batch_dims: int = 0,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
    stream: int = 0,
    generator: None = None,
    config: LaunchConfig | None = None,
) -> QuantizedTensor:
    """Codes and scales on the GPU: the reference `fp4lab.formats.quantize`'s
    `QuantizedTensor`, bit for bit (codes in x's shape, float32 scales, the tensor scale).
    Arguments as `fake_quantize` (config None: `CODES_CONFIG`)."""
    config = CODES_CONFIG if config is None else config
    req = _request(x, spec, axis, rounding, batch_dims, noise, seed, stream, generator, config)
    outputs, _ = _compute(x, req, codes=True, scales=True)
    return QuantizedTensor(outputs.codes, outputs.scales, outputs.decode, req.spec, req.axis,
                           batch_dims)


def quantize_packed(
    x: torch.Tensor,
    spec: QuantSpec | str,
    *,
    axis: int = -1,
    rounding: Rounding | str | None = None,
    batch_dims: int = 0,
    noise: torch.Tensor | None = None,
    seed: int | None = None,
    stream: int = 0,
    generator: None = None,
    config: LaunchConfig | None = None,
) -> PackedQuantized:
    """Packed codes and scales on the GPU (`QuantizedTensor.packed()` and its scales, without
    writing one byte a code where the kernel packs itself: FP4 codes whose pairs lie along x's
    contiguous last dim). Arguments as `fake_quantize` (config None: `CODES_CONFIG`)."""
    config = CODES_CONFIG if config is None else config
    req = _request(x, spec, axis, rounding, batch_dims, noise, seed, stream, generator, config)
    outputs, _ = _compute(x, req, packed=True, scales=True)
    return PackedQuantized(outputs.packed, outputs.scales, outputs.decode, x.shape, req.spec,
                           req.axis, batch_dims)


def philox_noise(shape, seed: int, *, stream: int = 0, device: torch.device | str = "cpu"):
    """The float64 uniforms the kernels draw for `seed` and `stream`: element i (row-major) gets
    uniform53 of the first two words of Philox4x32-10 at the counter (i mod 2^32, i div 2^32,
    stream, 0) under the key `split_key(seed)`. Hand them to the reference as `noise` to
    compare the two paths bit for bit."""
    n = math.prod(shape)
    index = torch.arange(n, dtype=torch.int64, device=device)
    k0, k1 = philox.split_key(seed)
    w0, w1, _, _ = philox.philox4x32(
        index & 0xFFFFFFFF, index >> 32, torch.full_like(index, stream), torch.zeros_like(index),
        k0, k1,
    )
    return philox.uniform53(w0, w1).reshape(shape)
