"""FlashAttention's forward in Triton with in-kernel quantization of P, driven by a recipe.

What. `attention(q, k, v, recipe)` runs the forward of the simulation path
(`fp4lab.analysis.flash`) as one fused kernel on the GPU: each program owns one query tile of
one (batch, head) and walks the key/value tiles it can see (first to last, or last to first
as the recipe's `kv_order` says), keeping the online softmax's m_i, l_i and acc in registers;
causal, the programs launched first take the last query tiles, the longest (`_query_tile`).
Q, K and V arrive already quantized as the recipe says (by `fp4lab.formats.fake_quantize`,
whole tensors, as the simulation quantizes them); P is quantized inside the kernel, tile by
tile, along the keys, with the recipe's `p` format and lift. With smooth_q (SageAttention3),
Q arrives as its quantized Q - M and each query tile's mean scores M_i K^T as one fp32 row
(`mean_scores`, from the host), added to the tile's scores before anything else reads them.

The algorithm per key tile j (in log2 units, z = scale log2(e) S):

    z = scale log2(e) (Q^_i K^_j^T)            # fp32 accumulate, times Q's and K's factors
      (+ scale log2(e) M_i K_j^T)              # smooth_q: Q^ is (Q - M)^, M the tile's mean
    -- update m_i --                           running max, lazy max (FA4) or none
    P = exp2(z - m_i)
    P^ = q(lift P) / lift                      # the recipe's p format, per block of keys
    -- update l_i and acc --
    l_i = alpha l_i + rowsum(P or P^)
    acc = alpha acc + P^ V^_j                  # bf16 operands (exact for FP4 and FP8 values)

How P^ stays exact in bf16. A dequantized FP4 value is an E2M1 code (2 significant bits)
times an E4M3 or E8M0 scale (4 or 1), at most 6 significant bits: exact in bf16's 8. The
kernel multiplies P^ V^ on bf16 tensor cores with fp32 accumulation, so the product of two
such operands is exact up to the accumulation order. Factors that would break exactness (a
per-tile FP32 tensor scale, the lift, the 1/M_e of an alpha-grid scale) are kept out of the
bf16 operand and applied to the tile's fp32 product instead.

Direct-P (`PQuantizer.direct`, fp4-fa4's MXFP4 P/V route) computes P's E2M1 codes from
z = log2 P itself, per block of keys, as `fp4lab.analysis.p_quant` does; with a fixed row
reference (fp4-fa4's anchor, read once from key tile 0 before the loop, or zero) nothing is
rescaled. Known edge: where a block's largest z is an integer (the anchor's own row at head
dim 64, whose margin is exactly 8 in log2 units), ALPHA_CEIL's e_B hangs on the last bit of
an fp32 subtraction that the two paths order differently.

For the backward (`fp4lab.kernels.flash_bwd`) the forward can also return its log-sum-exp in
log2 units (the kernel's own, so that P rebuilt from it is bit for bit exp2 of the same
difference), fill Attn-QAT's second output O' (the unquantized P's) and save the row
reference each key tile used (for a backward that replays the forward's own P^); none of
these changes O or the natural-units lse.

Stochastic rounding of P (a block format with rounding=stochastic; its scales round to
nearest, as the reference's). The random bits are the simulation's: Philox4x32-10 words of
P's stream (`fp4lab.formats.streams`: keyed by the forward's pass key and P's stream id)
at each element's (batch, query head, query, key) position, made in registers per tile
(`fp4lab.kernels.random.tile_words`, one counter for four keys) and compared with the
fraction of |x| / quantum exactly as the reference compares its uniform (`_round_stochastic`).
So a tile gives the simulation's P^ bit for bit from the same P; inside attention P itself
comes from fp32 sums in another order, and an element whose uniform lies within that
difference of its fraction rounds the other way, as an element next to a midpoint does under
rounding to nearest. The keys reach the kernel as a table, one per chunk of the batch
(`sr_key_table`), so samples stacked along the batch each draw as alone.

Instrumentation (TRACE, a compile-time flag, off by default). Compiled with it, each key tile
writes its statistics of P and P^ to small buffers (`TraceBuffers`: the sums and counts of
`FORWARD_STATS` per (batch x head, query tile, key tile), each row's flushed mass per key
tile, the softmax denominator's error per query tile), computed after P is quantized by a
helper of their own (`_trace_p_tile`), which recounts what the quantizer saw (`_p_counts`)
rather than changing it; `fp4lab.kernels.trace` turns them into the `Trace`. Without it the
branch is eliminated at compile time: the hot loop is the uninstrumented kernel's.

Direct-P's affine code map (fa4fp4_directp: E2M1(max(0, A x + B)) on the blocks its group
mask selects) rides in Direct-P's otherwise unused SCALE slot (`PQuantizer.direct`,
`_direct_values`), so no kernel signature grew for it.

Two-level P (SageAttention3's paper, Attn-QAT's kernel; PQuantizer mode 6) scales each
tile row of P so its maximum maps to M_e M_s (r = M_e M_s / max, the IEEE quotient), quantizes
r P as mode 2 does and divides the row's products and sum by r, where the reference divides
each element of q(r P) by r: the same values up to that rounding. Its row maximum lands on
the clip boundary to the last bit, so its trace's clipped count can differ by one per row.

Per-tile tensor scales (tensor_scope=tile, Attn-QAT's kernel; TILE_SCOPE, a compile-time
flag): the factors arrive one per tile, Q's read once per program (its query tile), K's and
V's per key tile, the tile's scores multiplied by K's and its P^ V^ by V's before acc adds
it; without the flag V's one factor per head multiplies the output once, at the end.

On an sm_90 GPU, `attention_forward` hands the calls `fp4lab.kernels.gluon_fwd.unsupported`
admits (block-format P rounded to nearest at 128 x 128 tiles, head_dim 128, one sequence length
a multiple of 128; no trace, O', smooth_q, leakage fix, lazy or fixed row reference or per-tile
factors) to that module's Gluon kernel, which runs
this kernel's arithmetic with its products overlapped and returns the same O and log-sum-exp
bit for bit (`FP4LAB_GLUON=0` keeps every call here).

What is not here yet (asking for it raises, never falls back): two-level P replayed in the
backward's dV (forward_exact), tensor_scope=tile with the flash backward, Direct-P's
stochastic codes, P blocked
along the queries, MS-EDEN's stochastic scales, sr_bits above 32 (the words have 32 bits), a
trace of a stochastic recipe, and attn_mask.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4lab.formats import (
    BF16,
    Correction,
    FloatFormat,
    QuantSpec,
    Rounding,
    ScaleArithmetic,
    ScaleRule,
)
from fp4lab.formats.philox import split_key
from fp4lab.kernels.launch import launch
from fp4lab.kernels.quantize import _bfloat16_round
from fp4lab.kernels.random import tile_words
from fp4lab.recipes.tile_stats import SLACK

__all__ = ["attention_forward", "PQuantizer", "TraceBuffers", "FORWARD_STATS", "OUT_STATS"]

LOG2E = math.log2(math.e)
MODE_BF16 = 5  # PQuantizer's mode of a cast to bf16 (forward and backward)
# Fused multiply-adds off in every attention kernel, as in the quantizers: on NVPTX the
# compiler otherwise contracts `tl.dot(q, k) * qk_scale - m_i` into one FMA, so the row's
# maximum gets z = -(the product's rounding error) rather than 0 and P = exp2(z) lands one ulp
# below 1. A power-of-two scale rule (OCP floor, the alpha grids) then halves that block's
# scale and clamps its largest element: on the H200 (triton 3.6) mxfp4 P came out 2e-2 to 7e-2
# from the simulation, whose S - m is exactly 0 there. The interpreter never fuses.
FP_FUSION = False  # (an explicit tl.fma still fuses: the accumulation's FOLD and Z_FMA's z)


def _hardware_e4m3(capability: tuple[int, int] | None = None) -> bool:
    """Whether compiled kernels cast an FP8 P^ that enters the FP8 tensor cores straight from
    fp32 by the GPU's own conversion, `cvt.rn.satfinite.e4m3x2.f32` (sm_89 and later: to
    nearest even, saturating at 448, NaN kept: the reference's rounding,
    `fp4lab.formats.round_to_format`), in place of `_round`'s arithmetic and an exact cast.
    Not under Triton's interpreter, whose conversion to fp8 rounds half away from zero and
    does not saturate, nor with FP4LAB_HW_E4M3=0.

    Only that one cast: `_round` never converts to fp8 and back. On the H200 (triton 3.6,
    2026-12-02) the round trip was the reference's on every E4M3 boundary in a 1-D kernel,
    but inside the traced forward, on P's tile as the score dot leaves it, P^'s statistics
    came out wrong (fa4fp4_causal's pv a_err 0.81 where the simulation's is 0.026, a sixteenth
    of a non-causal tile's P flushed); with `_round`'s arithmetic they were the simulation's,
    and the output that took the direct cast was as far from the simulation (1.6e-3) as with
    the arithmetic (benchmarks/RESULTS.md, "E4M3 by the GPU's conversion"). What went wrong
    was not found; a candidate, not verified: the round trip's cast and the dot's were the
    same expression (P LIFT to fp8), so the compiler may have made one fp8 tile and moved it
    between layouts for the other use."""
    if os.environ.get("FP4LAB_HW_E4M3", "1") == "0":
        return False
    if capability is None:  # this process's device (`capability`: a target compiled for)
        if os.environ.get("TRITON_INTERPRET", "0") == "1" or not torch.cuda.is_available():
            return False
        capability = torch.cuda.get_device_capability()
    return tuple(capability) >= (8, 9)


HW_E4M3 = tl.constexpr(_hardware_e4m3())


def _hardware_bf16() -> bool:
    """Whether compiled kernels round P onto bf16's grid by the GPU's own conversion
    (`cvt.rn.bf16x2.f32`: to nearest even, subnormals kept, NaN kept; the dot's operand cast
    itself) rather than on its bits (`_bfloat16_round`, six operations an element): not under
    Triton's interpreter, whose conversion to bf16 truncates and flushes subnormals
    (triton 3.9, checked 2026-12-02), nor with FP4LAB_HW_BF16=0."""
    if os.environ.get("FP4LAB_HW_BF16", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    if torch.cuda.is_available() and torch.version.hip is None:  # bf16 conversions: sm_80 on
        return torch.cuda.get_device_capability() >= (8, 0)
    return True  # a target compiled for without a GPU (benchmarks/compile_offline.py: sm_90)


HW_BF16 = tl.constexpr(_hardware_bf16())


def _hardware_rcp() -> bool:
    """Whether compiled kernels take a correctly rounded reciprocal in range (`_reciprocal`)
    as the GPU's own correctly rounded reciprocal takes it (ptxas's `rcp.rn.f32`: the
    hardware's approximate reciprocal and one fused Newton step, three instructions) rather
    than from `tl.div_rn(1, d)`, whose range checks and fallback call take about eleven
    issue slots: NVIDIA GPUs only (inline PTX), not under Triton's interpreter (no PTX), nor
    with FP4LAB_HW_RCP=0. The same bits either way: both are IEEE's correctly rounded 1 / d
    (tests/kernels/test_flash.py checks every significand at the range's ends on a GPU)."""
    if os.environ.get("FP4LAB_HW_RCP", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return not (torch.cuda.is_available() and torch.version.hip is not None)


HW_RCP = tl.constexpr(_hardware_rcp())
# `_reciprocal`'s range: d normal and below 2^126 (an exponent field of 1 to 252), where the
# hardware's approximate reciprocal and one Newton step are the correctly rounded 1 / d
RCP_LO, RCP_HI = tl.constexpr(2.0**-126), tl.constexpr(2.0**126)


# -- device functions: rounding onto a format's grid, and P's block scales -------------------------
@triton.jit
def _round(x, Q_LO: tl.constexpr, Q_HI: tl.constexpr, UNIT: tl.constexpr, MAXV: tl.constexpr):
    """x (fp32, >= 0: P, its scaled blocks and their scales) rounded to nearest even on a
    float format's grid, saturating at MAXV: the reference's float32 path
    (`fp4lab.formats.rounding._round_float32`). The quantum is x's binade 2^e (from its
    exponent bits) clamped to [Q_LO, Q_HI] = [2^emin, 2^(emax+1)] times UNIT = 2^-mbits; x /
    quantum and back are exact (powers of two). x / quantum < 2^(mbits + 1) unless x lies
    above the format's top binade, where any result of at least 2^22 quanta saturates: so
    _rint's magic number needs no range check. Where the format's largest quantum times
    1.5 2^23 stays finite (Q_HI UNIT <= 2^103), the division is folded into the magic number
    instead: (x + M) - M with M = 1.5 2^23 quantum, whose ulp is the quantum, rounds x to
    the nearest even multiple of it, the same value in three operations fewer; there x
    saturates first, which needs no upper clamp on the quantum (the comment below says why
    that is the same value). Saturation keeps NaN, as the reference's clamp does (compiled,
    a plain tl.minimum(NaN, MAXV) may give MAXV). No fp8 round trip (see
    `_hardware_e4m3`)."""
    if Q_HI * UNIT <= 1.0141204801825835e31:  # 2^103
        # saturating first is the same: MAXV lies on the grid and rounding is monotone, so
        # rounding min(x, MAXV) gives min(rounded x, MAXV); and min(x, MAXV)'s binade is
        # below Q_HI, so the quantum needs no upper clamp (one operation fewer)
        y = tl.minimum(x, MAXV, propagate_nan=tl.PropagateNan.ALL)
        binade = (y.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        # M = b 1.5 2^23 UNIT for b = max(binade, Q_LO), an exact product (a power of two
        # times 1.5 2^23 UNIT), so each fma rounds what (y + M) - M rounds: the same bits,
        # one operation fewer than forming M apart
        b = tl.maximum(binade, Q_LO)
        return tl.fma(b, -(UNIT * 12582912.0), tl.fma(b, UNIT * 12582912.0, y))
    quantum, inverse = _quantum(x, Q_LO, Q_HI, UNIT)
    return tl.minimum(_rint(x * inverse) * quantum, MAXV, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _bf16_grid(x):
    """x (fp32) rounded to nearest even onto bf16's grid, as fp32 (`_hardware_bf16`: the GPU's
    conversion and back, which a following cast to bf16 undoes for free)."""
    if HW_BF16:
        return x.to(tl.bfloat16).to(tl.float32)
    return _bfloat16_round(x)


@triton.jit
def _quantum(x, Q_LO: tl.constexpr, Q_HI: tl.constexpr, UNIT: tl.constexpr):
    """(quantum, 1 / quantum) of fp32 x >= 0 on a float format's grid: x's binade 2^e (from
    its exponent bits) clamped to [Q_LO, Q_HI] times UNIT, both powers of two."""
    binade = (x.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    quantum = tl.minimum(tl.maximum(binade, Q_LO), Q_HI) * UNIT
    inverse = (0x7F000000 - quantum.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)
    return quantum, inverse


@triton.jit
def _round_stochastic(
    x, words, Q_LO: tl.constexpr, Q_HI: tl.constexpr, UNIT: tl.constexpr, MAXV: tl.constexpr,
    SR_BITS: tl.constexpr,
):  # fmt: skip
    """x (fp32, >= 0) rounded stochastically on a float format's grid by the uint32 `words`
    (the uniforms u = words 2^-32 of `fp4lab.formats.streams`), saturating at MAXV: the
    reference's `_stochastic_magnitude`. y = x / quantum is exact and rounds up where
    u < frac(y), that is where words < ceil(frac 2^32) (frac 2^32 is exact in fp32 and at
    most 2^32 - 2^8); with SR_BITS = r > 0 random bits, where words >> (32 - r) <
    floor(frac 2^r), the reference's floor(u 2^r) < floor(frac 2^r)."""
    quantum, inverse = _quantum(x, Q_LO, Q_HI, UNIT)
    y = x * inverse
    low = tl.floor(y)
    frac = y - low  # exact
    if SR_BITS == 0:
        up = words < tl.ceil(frac * 4294967296.0).to(tl.uint32)
    else:
        up = (words >> (32 - SR_BITS)) < tl.floor(frac * (2.0**SR_BITS)).to(tl.uint32)
    return tl.minimum((low + up.to(tl.float32)) * quantum, MAXV, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _rint(y):
    """y (0 <= y < 2^22) rounded to the nearest integer, ties to even: adding and subtracting
    1.5 * 2^23 makes the fp32 adder round."""
    return (y + 12582912.0) - 12582912.0


@dataclass(frozen=True)
class PQuantizer:
    """P's format as the kernel's compile-time constants (from a recipe's `p` and lift).

    MODE: 0 none, 1 an element cast (a `FloatFormat`), 2 block scales along the keys, 3
    Direct-P (E2M1 codes from the scores, `direct`), 6 two-level P (`row_scaled`: mode 2
    on each row scaled so its maximum maps to M_e M_s, the products divided back by the row
    scale), 5 a cast to bf16 (rounded on its bits:
    its grid reaches below fp32's normal range, where `_round`'s quantum trick does not;
    4, the backward's per-tile FP32 scale, and 7, its MS-EDEN, are `fp4lab.kernels.flash_bwd`'s).
    ELEM: (Q_LO, Q_HI, UNIT, MAXV) of the element format; SCALE: the same of the scale
    format; BLOCK: keys per block; RULE: 0 amax / M_e rounded (NEAREST), 1 OCP's floor power
    of two, 2-5 the alpha rules CEIL, MSE, HALF, RTE, 6 RCEIL (E8M0), 7 CEIL; ARITH: 0 EXACT,
    1 TE_ENCODE, 2 RECIPROCAL, 3 DIVIDE_UNROUNDED; TENSOR: a per-tile tensor scale (TE_ENCODE's).
    SR: the elements round stochastically (block formats only; the scales stay nearest),
    with SR_BITS random bits (0: the whole 32-bit word, the reference's sr_bits=None).
    Direct-P's LIFT is 2^-S, its stored-scale shift (`direct`, `shift`).
    """

    MODE: int
    LIFT: float = 1.0
    ELEM: tuple = (1.0, 1.0, 1.0, 1.0)
    SCALE: tuple = (1.0, 1.0, 1.0, 1.0)
    SCALE_POW2: tuple = (-127, 127)  # the scale format's powers of two (E8M0 rules)
    BLOCK: int = 16
    RULE: int = 0
    ARITH: int = 0
    TENSOR: bool = False
    EMAX_E: int = 0  # the element format's largest exponent (OCP's floor rule)
    SR: bool = False
    SR_BITS: int = 0

    @property
    def constant_factor(self) -> bool:
        """Whether the tile factor `_quantize_p` (and the backward's `_quantize_tile`) returns
        is one constant for every tile: an element cast's or bf16's 1/LIFT, Direct-P's
        1/(M_e LIFT), block scales without a tensor scale (1/LIFT, an alpha grid's over M_e).
        Not a per-tile tensor scale, two-level P's row scales, the backward's per-tile FP32
        scale or MS-EDEN (modes 4 and 7). Where it is, a tile's products may sum inside the
        dot in units of it, applied once at the end (`_accumulate_in_dot`,
        `flash_bwd._sums_in_dot`)."""
        return self.MODE in (0, 1, 3, MODE_BF16) or (self.MODE == 2 and not self.TENSOR)

    @property
    def shift(self) -> int:
        """Direct-P's stored-scale shift S (its LIFT is 2^-S), 0 for every other mode."""
        return -round(math.log2(self.LIFT)) if self.MODE == 3 else 0

    @classmethod
    def of(cls, spec, lift: float, field: str = "p") -> PQuantizer:
        """The quantizer of a recipe's `p` (None, a FloatFormat or a 1-D QuantSpec), or of
        another operand quantized tile by tile in registers (`field`: the backward's P and dS,
        `fp4lab.kernels.flash_bwd`)."""
        check_p(spec, lift, field=field)
        if spec is None:
            return cls(MODE=0, LIFT=lift)
        if spec == BF16:
            return cls(MODE=MODE_BF16, LIFT=lift, ELEM=_grid(spec))
        if isinstance(spec, FloatFormat):
            return cls(MODE=1, LIFT=lift, ELEM=_grid(spec))
        return cls(
            MODE=2, LIFT=lift, ELEM=_grid(spec.element), SCALE=_grid(spec.scale),
            SCALE_POW2=(math.floor(math.log2(spec.scale.min_subnormal)),
                        math.floor(math.log2(spec.scale.max))),
            BLOCK=spec.block[0], RULE=_RULES[spec.scale_rule], ARITH=_ARITHMETICS[spec.arithmetic],
            TENSOR=spec.tensor_scale, EMAX_E=spec.element.emax,
            SR=spec.rounding is Rounding.STOCHASTIC, SR_BITS=spec.sr_bits or 0,
        )  # fmt: skip

    @classmethod
    def row_scaled(cls, spec, lift: float) -> PQuantizer:
        """Two-level P (`PQuant.ROW_SCALED`, SageAttention3's paper and Attn-QAT's kernel) in
        the block format `spec`: MODE 6, otherwise `of`'s mode 2."""
        pq = cls.of(spec, lift)
        if pq.MODE != 2 or lift != 1.0 or pq.TENSOR:
            raise NotImplementedError(
                f"p: two-level P in the Triton kernel takes a 1-D block format without a "
                f"tensor scale and no lift, got {spec!r} with lift {lift}"
            )
        return dataclasses.replace(pq, MODE=6)

    @classmethod
    def direct(cls, spec, p_min_exponent: int | None, affine=None,
               affine_groups: int | None = None, shift: int = 0) -> PQuantizer:
        """Direct-P with the alpha-grid block format `spec` (fp4-fa4's
        ``hao_direct_transform_pack_mxfp4_quarter_log2``, `fp4lab.analysis.p_quant`):
        SCALE_POW2 is e_B's range, its floor raised to `p_min_exponent`. Direct-P has no
        scale grid, so its SCALE slot carries the affine code map (the recipe's
        `direct_p_affine` (A, B) on the blocks `affine_groups` selects, bit g the g-th block
        of each key tile, None all): (1, A, B, the group mask; -1 all), (0, 0, 0, 0) without
        one (`_direct_values`). LIFT carries the stored-scale shift `shift` S as 2^-S (the
        recipe's `p_scale_shift`): the kernel's P V and row sum run on P^ 2^-S, and its
        log-sum-exp adds S back."""
        check_direct_p(spec)
        lo = math.floor(math.log2(spec.scale.min_subnormal))
        if p_min_exponent is not None:
            lo = max(lo, p_min_exponent)
        hi = math.floor(math.log2(spec.scale.max))
        scale = (0.0, 0.0, 0.0, 0)
        if affine is not None:
            a, b = affine
            scale = (1.0, float(a), float(b), -1 if affine_groups is None else int(affine_groups))
        return cls(
            MODE=3, LIFT=2.0**-shift, ELEM=_grid(spec.element), SCALE=scale,
            SCALE_POW2=(lo, hi),
            BLOCK=spec.block[0], RULE=_RULES[spec.scale_rule], EMAX_E=spec.element.emax,
        )  # fmt: skip


def check_direct_p(spec) -> None:
    """Raise for a Direct-P format the kernel does not run: 1-D blocks of 16 or 32 keys with an
    alpha-grid rule (the reference takes only those, too)."""
    if not isinstance(spec, QuantSpec) or not spec.scale_rule.alpha_grid:
        raise NotImplementedError(
            f"p: Direct-P in the Triton kernel takes an alpha-grid block format, got {spec!r}"
        )
    if spec.stochastic:
        raise NotImplementedError(
            f"p: Direct-P in the Triton kernel rounds its codes to nearest; {spec.name!r} "
            "rounds stochastically; use backend='reference'"
        )
    if spec.block is None or len(spec.block) != 1 or spec.block[0] not in (16, 32):
        raise NotImplementedError(
            f"p: Direct-P in the Triton kernel takes 1-D blocks of 16 or 32 keys, got "
            f"{spec.block}"
        )


def _grid(fmt: FloatFormat) -> tuple:
    """(Q_LO, Q_HI, UNIT, MAXV) of `_quantum`, each a float32. Q_HI is capped at 2^127, the
    largest binade a finite float32 has, so that a format reaching float32's range (bf16,
    E8M0) still compiles: the compiler widens a constant past float32 to float64, where the
    binade's bitcast fails. The cap changes no finite result."""
    return (
        2.0**fmt.emin, 2.0 ** min(fmt.emax + 1, 127), 2.0**-fmt.mbits, float(fmt.max)
    )


_RULES = {
    ScaleRule.NEAREST: 0, ScaleRule.OCP_FLOOR: 1, ScaleRule.ALPHA_CEIL: 2, ScaleRule.ALPHA_MSE: 3,
    ScaleRule.ALPHA_HALF: 4, ScaleRule.ALPHA_RTE: 5, ScaleRule.RCEIL: 6, ScaleRule.CEIL: 7,
}  # fmt: skip
_ARITHMETICS = {
    ScaleArithmetic.EXACT: 0, ScaleArithmetic.TE_ENCODE: 1, ScaleArithmetic.RECIPROCAL: 2,
    ScaleArithmetic.DIVIDE_UNROUNDED: 3,
}  # fmt: skip


# `_round` and `_rint` add and subtract 1.5 2^23 quanta, exact while x / quantum < 2^22, which
# holds for every x of a grid with at most 21 mantissa bits (x / quantum < 2^(mbits + 1))
_MAX_MBITS = 21


def check_p(spec, lift: float, *, field: str = "p") -> None:
    """Raise for a P format the kernel does not quantize (yet): no silent fallback. `field`:
    the recipe field named in the message (the backward's P and dS take the same rules)."""
    if spec is None:
        return
    if spec == BF16:
        return  # rounded on its bits (MODE 5)
    if isinstance(spec, FloatFormat):
        if spec.emin - spec.mbits < -126:
            raise NotImplementedError(
                f"{field}: the Triton kernel rounds onto grids in fp32's normal range; format "
                f"{spec.name!r} has quanta down to 2^{spec.emin - spec.mbits}; "
                "use backend='reference'"
            )
        if spec.mbits > _MAX_MBITS:
            raise NotImplementedError(
                f"{field}: the Triton kernel rounds onto grids of at most {_MAX_MBITS} mantissa "
                f"bits (`_round`'s 1.5 2^23 magic number); format {spec.name!r} has "
                f"{spec.mbits}; use backend='reference'"
            )
        return
    problems = []
    if spec.element.emin - spec.element.mbits < -126:
        problems.append(f"element format {spec.element.name} below fp32's normal range")
    for role, fmt in (("element", spec.element), ("scale", spec.scale)):
        if fmt.mbits > _MAX_MBITS:
            problems.append(f"{role} format {fmt.name} with {fmt.mbits} mantissa bits (the "
                            f"kernel rounds onto at most {_MAX_MBITS})")  # fmt: skip
    if spec.block is None or len(spec.block) != 1 or spec.block[0] not in (16, 32):
        along = "keys" if field == "p" else "elements along its blocks' axis"
        problems.append(f"blocks {spec.block} (the kernel takes 1-D blocks of 16 or 32 {along})")
    if spec.scale_rule not in _RULES:
        problems.append(f"scale rule {spec.scale_rule.value}")
    if spec.scale_rule is ScaleRule.RCEIL and spec.scale.mbits != 0:
        problems.append("rceil onto a scale format with mantissa bits (the kernel's is E8M0's)")
    if spec.scale_rule is ScaleRule.NEAREST and spec.scale.emin < -126:
        problems.append(f"nearest onto scale format {spec.scale.name} below fp32's normal range")
    if spec.arithmetic not in _ARITHMETICS:
        problems.append(f"arithmetic {spec.arithmetic.value}")
    if spec.tensor_scale and spec.arithmetic is not ScaleArithmetic.TE_ENCODE:
        problems.append("a tensor scale with an arithmetic other than te_encode")
    if spec.correction is not Correction.NONE:
        problems.append(f"correction={spec.correction.value} (MS-EDEN's stochastic scales)")
    if spec.sr_bits is not None and spec.sr_bits > 32:
        problems.append(f"sr_bits={spec.sr_bits} (the kernel's random words have 32 bits)")
    if spec.hadamard or spec.scale_floor or spec.fixed_scale is not None:
        problems.append("a Hadamard transform, a scale floor or a fixed scale")
    if problems:
        what = "P" if field == "p" else field
        raise NotImplementedError(
            f"{field}: the Triton kernel does not quantize {what} with block format "
            f"{spec.name!r} yet: "
            + "; ".join(problems)
            + "; use backend='reference'"
        )


@triton.jit
def _query_tile(CAUSAL: tl.constexpr):
    """The query tile of this program (axis 0 of a (query tiles, batch x heads) grid). Causal,
    the last tile first: its row sees every key tile before it, so the programs launched first
    are the longest and the short ones fill the last wave's gaps (the GPU starts programs in
    grid order, axis 0 fastest); FlashAttention-3's causal scheduler orders its tiles so too
    (`hopper/tile_scheduler.hpp`). Nothing a program computes depends on the order. At B4
    H16 S4096 on the H200 (2048 programs) it moved no kernel's time (RESULTS.md, session
    26); it is there for grids of few waves."""
    if CAUSAL:
        return tl.num_programs(0) - 1 - tl.program_id(0)
    return tl.program_id(0)


@triton.jit
def _like(x, value):
    """An fp32 tensor shaped as x (a scalar where x is one), every element `value`, with x's
    layout inside a Gluon kernel (`fp4lab.kernels.gluon_fwd` calls these helpers), where
    `tl.full` and `tl.zeros_like` would need one: the select of two equal constants folds to
    the constant, so compiled it is the fill `tl.full` is."""
    return tl.where(x == x, value, value)


@triton.jit
def _div(a, b):
    """a / b correctly rounded, for a scalar or tensor a and a tensor b."""
    return tl.div_rn(_like(b, a), b)


@triton.jit
def _reciprocal(d):
    """1 / d correctly rounded for fp32 d with RCP_LO <= |d| < RCP_HI (callers keep d there):
    with HW_RCP the fast path of ptxas's own `rcp.rn.f32` for such d, r = rcp.approx(d)
    then r + r (1 - d r) in one fma (its range check and fallback left out, since d is in
    range), else `tl.div_rn`."""
    if HW_RCP:  # in one asm block, so that the negation folds into the last fma
        return tl.inline_asm_elementwise(
            "{ .reg .f32 r, e; rcp.approx.ftz.f32 r, $1; fma.rn.f32 e, $1, r, 0fBF800000; "
            "neg.f32 e, e; fma.rn.f32 $0, r, e, r; }",
            "=r,r", [d], dtype=tl.float32, is_pure=True, pack=1,
        )  # fmt: skip
    return tl.div_rn(_like(d, 1.0), d)


@triton.jit
def _div_by_short(x, s):
    """x / s correctly rounded, for fp32 x and normal fp32 s of at most 4 significant bits (an
    E4M3 or UE5M3 scale), by one reciprocal per block and two fmas per element: q = x RN(1/s),
    r = fma(-q, s, x) (exact), x / s = fma(r, RN(1/s), q) (Markstein's correction). Equal to
    the IEEE quotient for every fp32 significand of x against every 4-bit significand of s
    (tests/kernels/test_flash.py checks all of them on a GPU, a sample under the interpreter);
    not so for longer s, where q can be off by more than the one ulp the correction needs.
    RN(1/s) by `_reciprocal` where s lies in its range (normal and below 2^126: callers pass
    such scales), else `tl.div_rn`."""
    y = _reciprocal(s)
    q = x * y
    return tl.fma(tl.fma(-q, s, x), y, q)


@triton.jit
def _floor_log2(a):
    """floor(log2 a) of a normal positive fp32 a, from its exponent bits (an int32)."""
    return ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127


@triton.jit
def _log2_parts(a):
    """(floor(log2 a), a / 2^floor(log2 a) in [1, 2)) of a positive finite fp32 a, subnormals
    included (scaled by 2^64 first, exactly); a = 0 gives (-191, 1), for the caller to
    replace."""
    tiny = a < 1.0842021724855044e-19  # 2^-63: a * 2^64 stays finite and becomes normal
    b = tl.where(tiny, a * 1.8446744073709552e19, a)
    bits = b.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127 - tl.where(tiny, 64, 0)
    r = ((bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    return e, r


@triton.jit
def _pow2(e):
    """2^e as fp32 for an int32 e in [-149, 127], built from its bits (exact, subnormals
    included; no exp2 approximation)."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << (tl.minimum(tl.maximum(e, -149), -127) + 149)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, sub)


@triton.jit
def _block_scales(
    amax,
    A,
    M_E: tl.constexpr,
    INV_ME: tl.constexpr,
    SCALE_Q_LO: tl.constexpr,
    SCALE_Q_HI: tl.constexpr,
    SCALE_UNIT: tl.constexpr,
    SCALE_MAX: tl.constexpr,
    E_LO: tl.constexpr,
    E_HI: tl.constexpr,
    RULE: tl.constexpr,
    ARITH: tl.constexpr,
    TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr,
):
    """(store, factor, divisor, decode) of blocks with amax `amax` in a tile of amax A, in the
    float32 order of `fp4lab.formats`' ScaleArithmetic / ScaleRule: the elements are
    x * factor or, where divisor > 0 (EXACT, DIVIDE_UNROUNDED), x / divisor correctly rounded
    (a zero divisor flushes); the dequantized value is code * store * decode / M_e^[alpha],
    with store bf16-exact (the block scale, or 2^E for an alpha-grid scale)."""
    decode = 1.0
    divisor = _like(amax, 0.0)
    if RULE == 0:  # NEAREST: t = a' / M_e rounded into the scale format
        if ARITH == 1:  # TE_ENCODE
            g = 1.0
            if TENSOR:
                g = tl.minimum(_div(SCALE_MAX * M_E, A), 3.4028234663852886e38)
                g = tl.where(g == 0.0, 1.0, g)
                decode = _div(1.0, g)
            t = tl.minimum(amax * (g * INV_ME), 3.4028234663852886e38)
        else:
            t = tl.div_rn(amax, _like(amax, M_E))
        store = _round(t, SCALE_Q_LO, SCALE_Q_HI, SCALE_UNIT, SCALE_MAX)
        # every nonzero scale in `_reciprocal`'s range: its smallest subnormal and its largest
        SHORT: tl.constexpr = SCALE_Q_LO * SCALE_UNIT >= RCP_LO and SCALE_MAX < RCP_HI
        if SHORT:
            factor = tl.where(store == 0.0, 0.0, _reciprocal(store))  # RECIPROCAL
        else:
            factor = tl.where(store == 0.0, 0.0, _div(1.0, store))
        if ARITH == 0:  # EXACT: x / s
            divisor = store
        elif ARITH == 1:
            d = store * decode
            if not SHORT:
                inverse = _div(1.0, d)
            elif TENSOR:  # the tile's decode scale (uniform): d in range unless it is extreme
                if decode * (SCALE_Q_LO * SCALE_UNIT) >= RCP_LO and decode * SCALE_MAX < RCP_HI:
                    # a zero d (a zero scale) gives NaN here where 1 / d is inf: the clamp
                    # below takes either to the float32 maximum (a compiled tl.minimum keeps
                    # the number of a NaN and a number, the interpreter's `_div` gives inf)
                    inverse = _reciprocal(d)
                else:
                    inverse = _div(1.0, d)
            else:
                inverse = _reciprocal(d)
            factor = tl.minimum(inverse, 3.4028234663852886e38)
            if not TENSOR:  # fp4-fa4's Q/K quantizer: a zero scale's multiplier is 0
                factor = tl.where(store == 0.0, 0.0, factor)
        elif ARITH == 3:  # DIVIDE_UNROUNDED: x / t
            divisor = t
    elif RULE == 1 or RULE == 6 or RULE == 7:  # powers of two from a' (or fl(a' / M_e))
        a = amax
        if RULE == 6:  # RCEIL: fl(a' / M_e) rounded up onto E8M0
            a = tl.div_rn(amax, _like(amax, M_E))
        e, r = _log2_parts(a)
        if RULE == 1:  # OCP's floor: 2^(floor(log2 a') - emax_e)
            e = e - EMAX_E
        elif RULE == 6:
            e = e + (r != 1.0).to(tl.int32)
        else:  # CEIL: 2^(ceil(log2 a') - emax_e)
            e = e + (r != 1.0).to(tl.int32) - EMAX_E
        e = tl.minimum(tl.maximum(tl.where(a > 0.0, e, E_LO), E_LO), E_HI)
        store = _pow2(e)
        factor = _pow2(-e)  # x / 2^e, exact as a product
    else:  # the alpha grid: s = 2^E / M_e, elements (x M_e) 2^-E
        e = _floor_log2(amax)
        r = amax * _pow2(-e)
        if RULE == 2:
            up = r > 1.0
        elif RULE == 3:
            up = r >= 1.203125
        elif RULE == 4:
            up = r >= 1.5
        else:
            up = (r > 1.5) | ((r == 1.5) & (((e + 127) % 2) == 1))
        e = tl.minimum(tl.maximum(e + up.to(tl.int32), E_LO), E_HI)
        flush = amax < 1.1754943508222875e-38
        store = tl.where(flush, 0.0, _pow2(e))
        factor = tl.where(flush, 0.0, M_E * _pow2(-e))
    return store, factor, divisor, decode


@triton.jit
def _scaled_blocks(blocks, factor, divisor, RULE: tl.constexpr, ARITH: tl.constexpr,
                   S_UNIT: tl.constexpr, SQ_LO: tl.constexpr, S_MAX: tl.constexpr):
    """The elements of (rows, n blocks, QBLOCK) blocks over their scales as `_quantize_p`
    rounds them (and `_p_counts` recounts them): divided by the rounded scale where the
    reference divides (EXACT or DIVIDE_UNROUNDED with the NEAREST rule; the IEEE quotient,
    `_div_by_short` where the scale is short enough), else times the block factor."""
    if (ARITH == 0 or ARITH == 3) and RULE == 0:
        den = tl.where(divisor == 0.0, 1.0, divisor)[:, :, None]
        if ARITH == 0 and S_UNIT >= 0.125 and SQ_LO * S_UNIT >= RCP_LO and S_MAX < RCP_HI:
            scaled = _div_by_short(blocks, den)
        else:
            scaled = tl.div_rn(blocks, den)
        return tl.where(divisor[:, :, None] == 0.0, 0.0, scaled)
    return blocks * factor[:, :, None]


@triton.jit
def _quantize_p(
    p,
    words,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MODE: tl.constexpr,
    LIFT: tl.constexpr,
    EQ_LO: tl.constexpr,
    EQ_HI: tl.constexpr,
    E_UNIT: tl.constexpr,
    E_MAX: tl.constexpr,
    SQ_LO: tl.constexpr,
    SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr,
    S_MAX: tl.constexpr,
    E_LO: tl.constexpr,
    E_HI: tl.constexpr,
    QBLOCK: tl.constexpr,
    RULE: tl.constexpr,
    ARITH: tl.constexpr,
    TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr,
    SR: tl.constexpr = False,
    SR_BITS: tl.constexpr = 0,
    UNITS: tl.constexpr = False,
):
    """P^ of a (BLOCK_M, BLOCK_N) tile as (values, tile factor): values are bf16-exact (codes
    times block scales, the lift kept), the tile factor (the tensor decode scale over the
    lift, and 1/M_e for an alpha grid) multiplies the tile's products. SR: the elements round
    stochastically by `words` (uint32, the tile's shape; `tile_words`), else `words` is
    unused. UNITS (block scales only): the tile factor's power of two 2^e moves into the
    block scales, so the values are codes times block scales times 2^e and the factor
    returned is its significand r in [1, 2) (NaN stays NaN): values times factor are the same
    numbers, and any sum of the values times r the same bits as without UNITS, while the
    block scales times 2^e stay normal floats (the tile's elements above 2^-120 or so, far
    below anything an output keeps: `_accumulate_in_dot`)."""
    x = p * LIFT
    if MODE == 0:
        return x, 1.0 / LIFT
    if MODE == 1:
        return _round(x, EQ_LO, EQ_HI, E_UNIT, E_MAX), 1.0 / LIFT
    if MODE == 5:  # bf16: saturating (first: the same value, see `_round`), to nearest even
        return _bf16_grid(tl.minimum(x, E_MAX, propagate_nan=tl.PropagateNan.ALL)), 1.0 / LIFT
    blocks = tl.reshape(x, (BLOCK_M, BLOCK_N // QBLOCK, QBLOCK))
    amax = tl.max(blocks, axis=2)
    A = tl.max(tl.max(amax, axis=1), axis=0)  # the tile's amax, from its blocks'
    store, factor, divisor, decode = _block_scales(
        amax,
        A,
        E_MAX,
        1.0 / E_MAX,
        SQ_LO,
        SQ_HI,
        S_UNIT,
        S_MAX,
        E_LO,
        E_HI,
        RULE,
        ARITH,
        TENSOR,
        EMAX_E,
    )
    scaled = _scaled_blocks(blocks, factor, divisor, RULE, ARITH, S_UNIT, SQ_LO, S_MAX)
    if SR:
        block_words = tl.reshape(words, (BLOCK_M, BLOCK_N // QBLOCK, QBLOCK))
        codes = _round_stochastic(scaled, block_words, EQ_LO, EQ_HI, E_UNIT, E_MAX, SR_BITS)
    else:
        codes = _round(scaled, EQ_LO, EQ_HI, E_UNIT, E_MAX)
    tile_factor = decode / LIFT
    if RULE >= 2 and RULE <= 5:  # an alpha grid
        tile_factor = tile_factor / E_MAX
    if UNITS:  # 2^e into the block scales (exact while they stay normal), r out
        e, r = _log2_parts(tile_factor)
        store = store * _pow2(tl.minimum(e, 127))
        tile_factor = tl.where(tile_factor == tile_factor, r, tile_factor)
    values = tl.reshape(codes * store[:, :, None], (BLOCK_M, BLOCK_N))
    return values, tile_factor


@triton.jit
def _direct_p(
    z,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    QBLOCK: tl.constexpr,
    RULE: tl.constexpr,
    E_LO: tl.constexpr,
    E_HI: tl.constexpr,
    EQ_LO: tl.constexpr,
    EQ_HI: tl.constexpr,
    E_UNIT: tl.constexpr,
    E_MAX: tl.constexpr,
    LOG2_ME: tl.constexpr,
    AFF: tl.constexpr = 0.0,
    AFF_A: tl.constexpr = 0.0,
    AFF_B: tl.constexpr = 0.0,
    AFF_MASK: tl.constexpr = 0,
    LIFT: tl.constexpr = 1.0,
):
    """Direct-P's values of a tile of z = log2 P: per block of QBLOCK keys, e_B from the
    block's largest z by the alpha rule (in the log domain, as `fp4lab.analysis.p_quant`),
    clamped to [E_LO, E_HI]; codes E2M1(2^(z - e_B + log2 M_e)) (or of the affine map,
    `_direct_values`); values codes 2^e_B LIFT (exact in bf16: LIFT = 2^-S, the stored-
    scale shift, with E_LO >= S - 126, applied to the codes first so that no product
    overflows), whose products the caller multiplies by 1 / M_e."""
    zb = tl.reshape(z, (BLOCK_M, BLOCK_N // QBLOCK, QBLOCK))
    e = _direct_exponent(tl.max(zb, axis=2), RULE, E_LO, E_HI)
    u = _direct_values(zb, e, BLOCK_N // QBLOCK, LOG2_ME, AFF, AFF_A, AFF_B, AFF_MASK)
    codes = _round(u, EQ_LO, EQ_HI, E_UNIT, E_MAX)
    if LIFT != 1.0:
        codes = codes * LIFT
    return tl.reshape(codes * _pow2(e.to(tl.int32))[:, :, None], (BLOCK_M, BLOCK_N))


@triton.jit
def _direct_values(zb, e, GROUPS: tl.constexpr, LOG2_ME: tl.constexpr, AFF: tl.constexpr,
                   AFF_A: tl.constexpr, AFF_B: tl.constexpr, AFF_MASK: tl.constexpr):
    """Direct-P's values before E2M1 rounding, of blocks zb (rows, GROUPS, keys) of z with
    exponents e: 2^x with x = z - e_B + log2 M_e, or, with the affine map (AFF, on the
    blocks whose bit of AFF_MASK is set, -1 all), max(0, AFF_A x + AFF_B), a product and a
    sum each rounded (fused multiply-adds are off) as the reference computes them."""
    x = zb - e[:, :, None] + LOG2_ME
    u = tl.exp2(x)
    if AFF != 0.0:
        affine = tl.maximum(x * AFF_A + AFF_B, 0.0)
        if AFF_MASK == -1:
            u = affine
        else:
            g = tl.arange(0, GROUPS)
            chosen = ((AFF_MASK >> g) & 1) == 1
            u = tl.where(chosen[None, :, None], affine, u)
    return u


@triton.jit
def _row_scales(p, TOP: tl.constexpr):
    """Two-level P's per-row scales r = TOP / max_j P_ij of a tile (the IEEE quotient, as the
    reference's float32 division), 1 where a row is all zero (`fp4lab.analysis.p_quant`)."""
    rowmax = tl.max(p, 1)
    seen = rowmax > 0.0
    return tl.where(seen, tl.div_rn(tl.zeros_like(rowmax) + TOP, tl.where(seen, rowmax, 1.0)),
                    1.0)


@triton.jit
def _direct_exponent(top, RULE: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr):
    """Direct-P's e_B (fp32) of blocks whose largest z = log2 P is `top`, by the alpha rule,
    clamped to [E_LO, E_HI] (a block of -inf, all masked, takes E_LO)."""
    if RULE == 2:  # ALPHA_CEIL: ceil(z)
        e = tl.ceil(top)
    elif RULE == 4:  # ALPHA_HALF: floor(z + 1 - log2 1.5)
        e = tl.floor((top + 1.0) - 0.5849625007211562)
    else:
        fl = tl.floor(top)
        r = tl.exp2(top - fl)
        if RULE == 3:  # ALPHA_MSE
            e = fl + (r >= 1.203125).to(tl.float32)
        else:  # ALPHA_RTE
            odd = ((tl.where(fl > -1000.0, fl, 0.0).to(tl.int32) + 127) & 1) == 1
            e = fl + ((r > 1.5) | ((r == 1.5) & odd)).to(tl.float32)
    return tl.minimum(tl.maximum(e, E_LO), E_HI)


# -- instrumentation (TRACE): per-tile statistics of P, after it is quantized ---------------------
@triton.jit
def _p_counts(
    p, z, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    LIFT: tl.constexpr, E_MAX: tl.constexpr, SQ_LO: tl.constexpr, SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr, S_MAX: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr,
    QBLOCK: tl.constexpr, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr, LOG2_ME: tl.constexpr, UNDER: tl.constexpr, OVER: tl.constexpr,
):  # fmt: skip
    """(clipped, blocks, scale underflows, scale overflows) of each row of a P tile as its
    quantizer (`_quantize_p`, `_direct_p`) saw it (fp32 vectors of BLOCK_M, for the caller
    to stack, `_stat_columns`), counted as `fp4lab.recipes.tile_stats.block_counts` does:
    elements whose scaled value exceeds E_MAX; blocks with a nonzero; those whose ideal
    scale amax / (E_MAX decode) lies below UNDER or above OVER (the scale format's range with
    block_counts' slack). The scaled elements are recomputed here in the quantizer's
    arithmetic, so that the quantizer itself is untouched."""
    zero = tl.sum(tl.zeros_like(p), 1)
    blocks, under, over = zero, zero, zero
    if MODE == 0:
        clipped = zero
    elif MODE == 1 or MODE == 5:
        clipped = tl.sum((p * LIFT > E_MAX).to(tl.float32), 1)
    elif MODE == 3:  # Direct-P: values past M_e (its SCALE slot: the affine map); e_B at its floor
        zb = tl.reshape(z, (BLOCK_M, BLOCK_N // QBLOCK, QBLOCK))
        top = tl.max(zb, axis=2)
        e = _direct_exponent(top, RULE, E_LO, E_HI)
        u = _direct_values(zb, e, BLOCK_N // QBLOCK, LOG2_ME, SQ_LO, SQ_HI, S_UNIT, S_MAX)
        clipped = tl.sum(tl.sum((u > E_MAX).to(tl.float32), 2), 1)
        seen = top > -float("inf")
        blocks = tl.sum(seen.to(tl.float32), 1)
        under = tl.sum((seen & (e == E_LO)).to(tl.float32), 1)
    else:  # block scales: the scaled elements as `_quantize_p` computes them
        x = p * LIFT
        xb = tl.reshape(x, (BLOCK_M, BLOCK_N // QBLOCK, QBLOCK))
        amax = tl.max(xb, axis=2)
        store, factor, divisor, decode = _block_scales(
            amax, tl.max(tl.max(amax, axis=1), axis=0), E_MAX, 1.0 / E_MAX, SQ_LO, SQ_HI, S_UNIT,
            S_MAX, E_LO, E_HI, RULE, ARITH, TENSOR, EMAX_E,
        )  # fmt: skip
        scaled = _scaled_blocks(xb, factor, divisor, RULE, ARITH, S_UNIT, SQ_LO, S_MAX)
        # clipped where the block stores a nonzero scale (a zero scale stores zeros: flushed)
        past = (scaled > E_MAX) & (store > 0.0)[:, :, None]
        clipped = tl.sum(tl.sum(past.to(tl.float32), 2), 1)
        ideal = tl.div_rn(amax, tl.zeros_like(amax) + E_MAX * decode)
        nonzero = amax > 0.0
        blocks = tl.sum(nonzero.to(tl.float32), 1)
        under = tl.sum((nonzero & (ideal < UNDER)).to(tl.float32), 1)
        over = tl.sum((ideal > OVER).to(tl.float32), 1)
    return clipped, blocks, under, over


@triton.jit
def _put(table, rows, K: tl.constexpr):
    """table (R, 16), a tile's stacked statistics (`_stat_columns`), with the per-row vector
    rows (R,) added into column K."""
    cols = tl.arange(0, 16)
    return table + tl.where(cols[None, :] == K, rows[:, None], 0.0)


@triton.jit
def _stat_columns(x, x_used):
    """The per-row parts of the statistics the forward's `FORWARD_STATS` and the backward's
    `BACKWARD_STATS` share, stacked as columns of an (R, 16) table whose column sums
    are the tile's statistics: 0 x's nonzeros, 1 x^'s nonzeros, 2 sum (x^ - x)^2, 3 sum x^2,
    8 x^'s NaNs (4-7, the quantizer's counts, are the caller's to `_put`). One cross-warp
    reduction of the table replaces one per statistic: each sum is still row sums first, then
    over the rows."""
    diff = x_used - x
    table = tl.zeros([x.shape[0], 16], dtype=tl.float32)
    table = _put(table, tl.sum((x != 0.0).to(tl.float32), 1), 0)
    table = _put(table, tl.sum((x_used != 0.0).to(tl.float32), 1), 1)
    table = _put(table, tl.sum(diff * diff, 1), 2)
    table = _put(table, tl.sum(x * x, 1), 3)
    return _put(table, tl.sum((x_used != x_used).to(tl.float32), 1), 8)


@triton.jit
def _put_counts(table, clipped, blocks, under, over):
    """table with the quantizer's per-row counts (`_p_counts`) in columns 4-7."""
    table = _put(table, clipped, 4)
    table = _put(table, blocks, 5)
    table = _put(table, under, 6)
    return _put(table, over, 7)


@triton.jit
def _store_stats(stats_ptr, table, N: tl.constexpr, more=None):
    """The tile's statistics, the column sums of its stacked table (plus those of `more`, a
    table over other rows, where given), into stats_ptr[0:N]."""
    cols = tl.arange(0, 16)
    sums = tl.sum(table, 0)
    if more is not None:
        sums = sums + tl.sum(more, 0)
    tl.store(stats_ptr + cols, sums, mask=cols < N)


@triton.jit
def _dot_16_bits(p, v, acc=None):
    """acc (or 0) plus p (fp32) times v with 16 bits of p: its high and low parts in v's
    dtype, the low part's product accumulated onto the high part's."""
    p_hi = p.to(v.dtype)
    p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
    return tl.dot(p_lo, v, tl.dot(p_hi, v, acc))


@triton.jit
def _trace_p_tile(
    p, p_seen, p_used, z, qk_nan, pv_nan, m_use, rows, stats_ptr, lost_ptrs,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr,
    LIFT: tl.constexpr, E_MAX: tl.constexpr, SQ_LO: tl.constexpr, SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr, S_MAX: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr,
    QBLOCK: tl.constexpr, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr, LOG2_ME: tl.constexpr, UNDER: tl.constexpr, OVER: tl.constexpr,
):  # fmt: skip
    """Write one (query tile, key tile)'s statistics, `FORWARD_STATS` in that order, to
    stats_ptr, and each row's flushed probability mass as log2(mass) + m (its row reference
    m_use) to lost_ptrs: P the tile's unquantized probabilities, p_seen what P's quantizer
    was given (P, or two-level P's row-scaled r P), p_used the P^ its P V consumed
    (dequantized, the leakage fix's diagonal blocks unquantized), z = log2 P, qk_nan and
    pv_nan the NaNs of each row of the masked scores and of the tile's P^ V^ (counted where
    those tiles are made, so that neither stays in registers for the statistics)."""
    flushed = (p_used == 0.0) & (p != 0.0)
    clipped, blocks, under, over = _p_counts(
        p_seen, z, BLOCK_M, BLOCK_N, MODE, LIFT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI,
        QBLOCK, RULE, ARITH, TENSOR, EMAX_E, LOG2_ME, UNDER, OVER,
    )  # fmt: skip
    table = _put_counts(_stat_columns(p, p_used), clipped, blocks, under, over)
    table = _put(table, pv_nan, 9)
    table = _put(table, qk_nan, 10)
    _store_stats(stats_ptr, table, 11)
    lost = tl.sum(tl.where(flushed, p, 0.0), 1)
    tl.store(lost_ptrs, tl.log2(lost) + m_use, mask=rows)


# -- the kernel ------------------------------------------------------------------------------------
# fmt: off
@triton.jit
def _fwd_inner(
    acc, l_i, m_i, acc_p, l_p, l_hat, l_pl, unit, q, k_base, v_base, vp_base, mref_base, ms_base,
    n_k, offs_m, rows, qk_scale, inv_vf, kf_base, vf_base, Sk, stride_kn, stride_kd, stride_vn,
    stride_vd, stride_pn, stride_pd, first, count, stats_base, lost_base, sr_k0, sr_k1, batch, head,
    MASKED: tl.constexpr, SAVE_M: tl.constexpr, LEAK: tl.constexpr, REVERSE: tl.constexpr,
    SMOOTH_Q: tl.constexpr, TILE_SCOPE: tl.constexpr,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, FIXED: tl.constexpr, LAZY: tl.constexpr, LAZY_LOG2: tl.constexpr,
    ROW_SUM_Q: tl.constexpr, PV_FP8: tl.constexpr, PRIME: tl.constexpr,
    MODE: tl.constexpr, LIFT: tl.constexpr, EQ_LO: tl.constexpr, EQ_HI: tl.constexpr,
    E_UNIT: tl.constexpr, E_MAX: tl.constexpr, SQ_LO: tl.constexpr, SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr, S_MAX: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr,
    QBLOCK: tl.constexpr, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr, LOG2_ME: tl.constexpr, SR: tl.constexpr, SR_BITS: tl.constexpr,
    TRACE: tl.constexpr, N_STATS: tl.constexpr, UNDER: tl.constexpr, OVER: tl.constexpr,
    P_SHIFT: tl.constexpr, LEAK_PARTS: tl.constexpr, ACC_DOT: tl.constexpr,
    Z_FMA: tl.constexpr, ACC_UNITS: tl.constexpr,
):
    """`count` key tiles of one query tile from key tile `first`, up (or down, REVERSE): the
    loop runs over a counter, since a loop's step must be positive on the GPU. MASKED
    tiles may hold keys past Sk, query rows past Sq or (causal) keys after a query; the others
    hold none, and skip the masks. LEAK > 0 (the leakage fix, causal, masked tiles only):
    where query and key share a block of LEAK positions, P and V enter unquantized (V from
    vp_base, its product divided by V's factor, which the output takes at the end), or with
    LEAK_PARTS 1 P alone (times V^). PRIME:
    also Attn-QAT's O' (acc_p, l_p): the unquantized P times V^, over the sum of that P.
    SAVE_M: each tile's row reference into mref_base (row-major, n_k tiles a row). SMOOTH_Q:
    the scores add the query tile's mean scores (ms_base, one fp32 per key, log2 units).
    TILE_SCOPE: K's and V's factors are per key tile (kf_base, vf_base, one fp32 a tile), the
    scores multiplied by K's, the tile's P^ V^ by V's (else V's applies once, at the end). SR: P
    rounds stochastically with the words of its stream (key sr_k0, sr_k1) at each element's
    (batch, query head, query, key) position. TRACE: each tile's statistics
    (`_trace_p_tile`) to stats_base (N_STATS a key tile) and lost_base (row-major, n_k tiles
    a row), and the sums of P^ and P (l_hat, l_pl) rescaled as l_i. P_SHIFT: Direct-P's
    stored-scale shift S (LIFT = 2^-S): the unquantized P that P V or the row sum takes (the
    leakage fix's diagonal, an unquantized row sum) enters as P 2^-S, from exp2(z - S) where
    P itself passes float32 (log2 P >= 128, which a fixed row reference permits). ACC_UNITS
    (with ACC_DOT, a per-tile tensor scale of P): acc is held in units of `unit`, the last
    tile factor's significand (`_quantize_p`'s UNITS), and moves into each tile's own before
    its dot."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, V_DIM)
    for t in range(0, count):
        if REVERSE:
            start_n = tl.multiple_of((first - t) * BLOCK_N, BLOCK_N)
        else:
            start_n = tl.multiple_of((first + t) * BLOCK_N, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
        if MASKED:
            inside = offs_n < Sk
            k = tl.load(k_ptrs, mask=inside[None, :], other=0.0)  # (HEAD_DIM, BLOCK_N)
        else:
            k = tl.load(k_ptrs)
        if Z_FMA:  # the unscaled products: z below is one fma of them (see Z_FMA)
            qk = tl.dot(q, k)
        elif TILE_SCOPE:  # K's factor of this key tile
            kf = tl.load(kf_base + start_n // BLOCK_N)
            qk = tl.dot(q, k) * (qk_scale * kf)  # (BLOCK_M, BLOCK_N), log2 units
        else:
            qk = tl.dot(q, k) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if SMOOTH_Q:  # + the tile mean's scores M_i K_j^T, fp32 from the host
            if MASKED:
                qk = qk + tl.load(ms_base + offs_n, mask=inside, other=0.0)[None, :]
            else:
                qk = qk + tl.load(ms_base + offs_n)[None, :]
        if MASKED:
            keep = inside[None, :] & rows[:, None]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            qk = tl.where(keep, qk, -float("inf"))
        # -- update m_i -- (a fixed reference keeps it, and nothing is rescaled)
        if FIXED:
            m_use = m_i
        else:
            if Z_FMA:  # qk_scale > 0 and rounding is monotone: max fl(x s) = fl(s max x)
                top = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            else:
                top = tl.maximum(m_i, tl.max(qk, 1))
            if LAZY:  # keep the old maximum while the tile raises it by at most LAZY_LOG2 bits
                m_new = tl.where(top - m_i > LAZY_LOG2, top, m_i)
            else:
                m_new = top
            if MASKED:  # a row with no key yet keeps m = -inf
                m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
            else:
                m_use = m_new
            alpha = tl.exp2(m_i - m_use)
        if SAVE_M:  # for a backward that replays this P^ (backward=forward_exact)
            tl.store(mref_base + offs_m * n_k + start_n // BLOCK_N, m_use, mask=rows)
        if Z_FMA:
            z = tl.fma(qk, qk_scale, -m_use[:, None])  # log2 P, one rounding
        else:
            z = qk - m_use[:, None]  # log2 P
        if TRACE:  # the scores' NaNs per row, so that the scores' tile dies here
            qk_nan = tl.sum((qk != qk).to(tl.float32), 1)
        # -- quantize P --
        if MODE == 3:  # Direct-P: codes from z itself
            p_hat = _direct_p(
                z, BLOCK_M, BLOCK_N, QBLOCK, RULE, E_LO, E_HI, EQ_LO, EQ_HI, E_UNIT, E_MAX,
                LOG2_ME, SQ_LO, SQ_HI, S_UNIT, S_MAX,  # Direct-P's SCALE slot: the affine map
                LIFT,  # Direct-P's LIFT slot: 2^-S, the stored-scale shift
            )
            factor = 1.0 / E_MAX
            if not ROW_SUM_Q or (MASKED and LEAK > 0) or PRIME or TRACE:
                p = tl.exp2(z)
            if P_SHIFT != 0 and (not ROW_SUM_Q or (MASKED and LEAK > 0)):
                # P in P^'s shifted units, as P V and l take it: P 2^-S (exact) where P is
                # finite, so the same bits as without the shift; exp2(z - S) past it
                p_low = tl.where(p < float("inf"), p * LIFT, tl.exp2(z - P_SHIFT))
        else:
            p = tl.exp2(z)
            words = 0
            if SR:  # stochastic rounding's words by position (`fp4lab.formats.streams`)
                words = tile_words(sr_k0, sr_k1, batch, head, offs_m, start_n, BLOCK_M, BLOCK_N)
            p_q = p
            if MODE == 6:  # two-level P: each row scaled so its maximum maps to M_e M_s
                r = _row_scales(p, E_MAX * S_MAX)
                p_q = p * r[:, None]
            p_hat, factor = _quantize_p(
                p_q, words, BLOCK_M, BLOCK_N, MODE, LIFT, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO,
                SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E, SR, SR_BITS,
                ACC_UNITS,
            )
        if MASKED and LEAK > 0:  # the leakage fix: the diagonal blocks' P leaves P^
            diagonal = (offs_m[:, None] // LEAK) == (offs_n[None, :] // LEAK)
            if MODE == 3 and P_SHIFT != 0:  # in P^'s shifted units, as P V and l take them
                p_exact = tl.where(diagonal, p_low, 0.0)
            else:
                p_exact = tl.where(diagonal, p, 0.0)
            p_hat = tl.where(diagonal, 0.0, p_hat)
        # -- update l_i and acc --
        if ROW_SUM_Q:
            row = tl.sum(p_hat, 1) * factor
            if MODE == 6:
                row = tl.div_rn(row, r)
            if MASKED and LEAK > 0:
                row = row + tl.sum(p_exact, 1)
        elif MODE == 3 and P_SHIFT != 0:  # P itself, in P^'s shifted units as P V takes it
            row = tl.sum(p_low, 1)
        else:
            row = tl.sum(p, 1)
        if FIXED:
            l_i = l_i + row
        else:
            l_i = l_i * alpha + row
        if PRIME:
            if FIXED:
                l_p = l_p + tl.sum(p, 1)
            else:
                l_p = l_p * alpha + tl.sum(p, 1)
        if ACC_DOT:  # acc (in units of the constant tile factor) accumulates in the dot
            if ACC_UNITS:  # from the last tile's units into this one's: r' / r in (1/2, 2)
                ratio = tl.div_rn(unit, factor)  # (a running reference: never FIXED)
                acc = acc * (alpha * ratio)[:, None]
                unit = factor
            elif not FIXED:
                acc = acc * alpha[:, None]
            pv = acc
        else:
            pv = tl.zeros([BLOCK_M, V_DIM], dtype=tl.float32)
        if PV_FP8:  # P and V hold E4M3 values: the FP8 tensor cores, V K-major
            vt_ptrs = v_base + offs_dv[:, None] * stride_vd + offs_n[None, :] * stride_vn
            if MASKED:
                vt = tl.load(vt_ptrs, mask=inside[None, :], other=0.0)  # (V_DIM, BLOCK_N)
            else:
                vt = tl.load(vt_ptrs)
            if (HW_E4M3 and MODE == 1 and EQ_LO == 0.015625 and EQ_HI == 512.0
                    and E_UNIT == 0.125 and E_MAX == 448.0 and not (MASKED and LEAK > 0)):
                p8 = (p_q * LIFT).to(vt.dtype)  # one hardware rounding (`_hardware_e4m3`)
            else:
                p8 = p_hat.to(vt.dtype)  # exact: P^ lies on E4M3's grid
            pv = tl.dot(p8, tl.trans(vt), pv)
            if PRIME:
                v = tl.trans(vt).to(tl.bfloat16)  # E4M3 values, exact in bf16
        else:
            v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
            if MASKED:
                v = tl.load(v_ptrs, mask=inside[:, None], other=0.0)  # (BLOCK_N, V_DIM)
            else:
                v = tl.load(v_ptrs)
            if MODE == 0:  # unquantized P: its bf16 high and low parts, 16 bits of it
                pv = _dot_16_bits(p_hat, v, pv)
            else:
                pv = tl.dot(p_hat.to(v.dtype), v, pv)
        # the tile factor and the running rescale in one explicit fma, acc alpha + pv factor
        # with pv factor unrounded, where nothing below takes the tile's product on its own:
        # the same value where the factor is a power of two (an element cast's 1/LIFT), else
        # one rounding fewer than the simulation's product then sum (nvfp4's per-tile decode,
        # an alpha grid's or Direct-P's 1/M_e): a rounding-order difference, as ACC_DOT's and
        # the tl.dot's own sums are; never in P's arithmetic, which FP_FUSION keeps unfused
        FOLD: tl.constexpr = not ACC_DOT and MODE != 6 and not (MASKED and LEAK > 0) and (
            not TILE_SCOPE and not TRACE)
        if ACC_DOT:
            acc = pv
        elif not FOLD:
            pv = pv * factor
        if MODE == 6:  # P^ = q(r P) / r: the rows' products divided by their scales
            pv = tl.div_rn(pv, r[:, None])
        if MASKED and LEAK > 0 and LEAK_PARTS == 1:  # P's half: the diagonal's P times V^
            pv = pv + _dot_16_bits(p_exact, v)
        if TILE_SCOPE:  # V's factor of this key tile (inv_vf is 1)
            vf = tl.load(vf_base + start_n // BLOCK_N)
            pv = pv * vf
        if MASKED and LEAK > 0 and LEAK_PARTS == 0:  # the diagonal's P times unquantized V
            vp_ptrs = vp_base + offs_n[:, None] * stride_pn + offs_dv[None, :] * stride_pd
            vp = tl.load(vp_ptrs, mask=inside[:, None], other=0.0)
            pv = pv + _dot_16_bits(p_exact, vp) * inv_vf
        if PRIME:  # unquantized P (16 bits of it) times V^
            pv_p = _dot_16_bits(p, v)
            if TILE_SCOPE:
                pv_p = pv_p * vf
            if FIXED:
                acc_p = acc_p + pv_p
            else:
                acc_p = acc_p * alpha[:, None] + pv_p
        if TRACE:  # the product's NaNs per row, so that its tile dies with the update below
            pv_nan = tl.sum((pv != pv).to(tl.float32), 1)
        if FOLD:
            if FIXED:
                acc = tl.fma(pv, factor, acc)
            else:
                acc = tl.fma(pv, factor, acc * alpha[:, None])
        elif not ACC_DOT:
            if FIXED:
                acc = acc + pv
            else:
                acc = acc * alpha[:, None] + pv
        if TRACE:  # the statistics of P^ as P V consumed it
            p_used = p_hat * factor
            if MODE == 3 and LIFT != 1.0:  # P^ itself, not its 2^-S shifted form
                p_used = p_used * (1.0 / LIFT)
            p_seen = p
            if MODE == 6:
                p_used = tl.div_rn(p_used, r[:, None])
                p_seen = p_q
            if MASKED and LEAK > 0:
                p_used = tl.where(diagonal, p, p_used)
            _trace_p_tile(
                p, p_seen, p_used, z, qk_nan, pv_nan, m_use, rows,
                stats_base + (start_n // BLOCK_N) * N_STATS,
                lost_base + offs_m * n_k + start_n // BLOCK_N, BLOCK_M, BLOCK_N,
                MODE, LIFT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH,
                TENSOR, EMAX_E, LOG2_ME, UNDER, OVER,
            )
            if FIXED:
                l_hat = l_hat + tl.sum(p_used, 1)
                l_pl = l_pl + tl.sum(p, 1)
            else:
                l_hat = l_hat * alpha + tl.sum(p_used, 1)
                l_pl = l_pl * alpha + tl.sum(p, 1)
        if not FIXED:
            m_i = m_new
    return acc, l_i, m_i, acc_p, l_p, l_hat, l_pl, unit


@triton.jit
def _attn_fwd(
    Q, K, V, VP, Out, OutP, LSE, MRef, MS, Stats, Lost, OutStats, QF, KF, VF, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_pb, stride_ph, stride_pn, stride_pd,
    stride_ob, stride_oh, stride_om,
    H, G, Sq, Sk, anchor_log2, SRKeys, sr_batch,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, REVERSE: tl.constexpr, LAZY: tl.constexpr, LAZY_LOG2: tl.constexpr,
    ROW_SUM_Q: tl.constexpr, PV_FP8: tl.constexpr,
    # P's quantizer (`PQuantizer`)
    MODE: tl.constexpr, LIFT: tl.constexpr, EQ_LO: tl.constexpr, EQ_HI: tl.constexpr,
    E_UNIT: tl.constexpr, E_MAX: tl.constexpr, SQ_LO: tl.constexpr, SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr, S_MAX: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr,
    QBLOCK: tl.constexpr, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr, LOG2_ME: tl.constexpr,
    # the row reference: 0 the running (or lazy) maximum, 1 fp4-fa4's anchor, 2 zero
    REF: tl.constexpr, FIXED: tl.constexpr, ANCHOR_KEYS: tl.constexpr, LEAK: tl.constexpr,
    LSE_LOG2: tl.constexpr, PRIME: tl.constexpr, SAVE_M: tl.constexpr,
    SR: tl.constexpr, SR_BITS: tl.constexpr, SMOOTH_Q: tl.constexpr, TILE_SCOPE: tl.constexpr,
    # instrumentation: per-tile statistics (`FORWARD_STATS`, `OUT_STATS`), off by default
    TRACE: tl.constexpr = False, N_STATS: tl.constexpr = 1, UNDER: tl.constexpr = 0.0,
    OVER: tl.constexpr = 0.0, P_SHIFT: tl.constexpr = 0,
    # the leakage fix's parts: 0 P and V unquantized on the diagonal blocks, 1 P alone
    LEAK_PARTS: tl.constexpr = 0,
    # P^ V^ accumulates inside the dot, acc in units of the constant tile factor ACC_FACTOR,
    # or (ACC_UNITS) of each tile's own factor's significand
    ACC_DOT: tl.constexpr = False, ACC_FACTOR: tl.constexpr = 1.0, ACC_UNITS: tl.constexpr = False,
    # z = S - m in one fma of the unscaled products (`_z_in_one_fma`)
    Z_FMA: tl.constexpr = False,
):
    """One query tile of one (batch, head): O and the log-sum-exp (natural units, or log2
    units with LSE_LOG2, as the backward reads it); with PRIME also Attn-QAT's O' into OutP
    (laid out as Out); with SAVE_M each key tile's row reference into MRef (B, H, Sq, n tiles);
    with SMOOTH_Q the scores add smooth_q's mean scores MS (B, H, n_q, Sk: fp32, log2 units,
    each query tile's mean against every key); with SR, P rounds stochastically by its
    stream's key words (`sr_key_table`: int32 pairs, one per sr_batch consecutive batch
    elements, which count their batch from 0).

    Its key tiles split in two ranges, in the recipe's order: the first n_free tiles hold only
    visible keys of full query rows (no masks), the rest (the diagonal band when causal, a
    partial last key tile, every tile of a partial last query tile) are masked.

    TRACE: Stats (B H, n_q, n_k, N_STATS) takes each tile's `FORWARD_STATS`, Lost
    (B, H, Sq, n_k) each row's flushed mass per key tile (log2, against its row reference),
    OutStats (B H, n_q, 2) the query tile's sum of l^ / l - 1 over its rows and their count."""
    start_m = _query_tile(CAUSAL)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    hk = h // G
    sr_k0, sr_k1, sr_b = _stream_words(SRKeys, b, sr_batch, 0, 1)
    # the operands' factors outside their bf16 values (tensor scales, alpha grids' 1/M_e):
    # one per (batch, head), or with TILE_SCOPE one per tile (Q's of this query tile here,
    # K's and V's of each key tile in the loop, from kf_base and vf_base)
    n_k = tl.cdiv(Sk, BLOCK_N)
    kf_base = KF + (b * (H // G) + hk).to(tl.int64) * n_k
    vf_base = VF + (b * (H // G) + hk).to(tl.int64) * n_k
    if TILE_SCOPE:
        qk_scale = qk_scale * tl.load(QF + bh.to(tl.int64) * tl.cdiv(Sq, BLOCK_M) + start_m)
        out_factor = tl.full([], 1.0, tl.float32)
    else:
        qk_scale = qk_scale * tl.load(QF + bh) * tl.load(KF + b * (H // G) + hk)
        out_factor = tl.load(VF + b * (H // G) + hk)
    inv_vf = 1.0 / out_factor
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, V_DIM)
    rows = offs_m < Sq
    q_ptrs = Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :]
    q = tl.load(q_ptrs, mask=rows[:, None], other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    vp_base = VP + b * stride_pb + hk * stride_ph
    ms_base = MS + (bh.to(tl.int64) * tl.cdiv(Sq, BLOCK_M) + start_m) * Sk
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    if REF == 1:  # each row's largest score over its first ANCHOR_KEYS keys, plus the margin
        offs_a = tl.arange(0, BLOCK_N)
        first = (offs_a < ANCHOR_KEYS) & (offs_a < Sk)
        a_ptrs = k_base + offs_a[None, :] * stride_kn + offs_d[:, None] * stride_kd
        a_scale = qk_scale
        if TILE_SCOPE:
            a_scale = qk_scale * tl.load(kf_base)
        qk = tl.dot(q, tl.load(a_ptrs, mask=first[None, :], other=0.0)) * a_scale
        if SMOOTH_Q:
            qk = qk + tl.load(ms_base + offs_a, mask=first, other=0.0)[None, :]
        keep = first[None, :] & rows[:, None]
        if CAUSAL:
            keep = keep & (offs_a[None, :] <= offs_m[:, None])
        top = tl.max(tl.where(keep, qk, -float("inf")), 1)
        m_i = tl.where(top == -float("inf"), 0.0, top + anchor_log2)  # none seen: 0
    elif REF == 2:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, V_DIM], dtype=tl.float32)
    if PRIME:
        acc_p = tl.zeros([BLOCK_M, V_DIM], dtype=tl.float32)
        l_p = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:  # unused
        acc_p = tl.zeros([1, 1], dtype=tl.float32)
        l_p = tl.zeros([1], dtype=tl.float32)
    n_tiles = n_k
    mref_base = MRef + bh.to(tl.int64) * Sq * n_k
    stats_base = Stats + (bh.to(tl.int64) * tl.cdiv(Sq, BLOCK_M) + start_m) * n_k * N_STATS
    lost_base = Lost + bh.to(tl.int64) * Sq * n_k
    if TRACE:
        l_hat = tl.zeros([BLOCK_M], dtype=tl.float32)
        l_pl = tl.zeros([BLOCK_M], dtype=tl.float32)
    else:  # unused
        l_hat = tl.zeros([1], dtype=tl.float32)
        l_pl = tl.zeros([1], dtype=tl.float32)
    unit = tl.full([], 1.0, tl.float32)  # ACC_UNITS' acc units (unused otherwise)
    n_free = Sk // BLOCK_N  # whole key tiles
    if CAUSAL:
        n_tiles = tl.minimum(n_tiles, tl.cdiv(tl.minimum(m0 + BLOCK_M, Sq), BLOCK_N))
        n_free = tl.minimum(n_free, (m0 + 1) // BLOCK_N)  # wholly at or before row m0
    if m0 + BLOCK_M > Sq:  # a partial query tile: every tile masked
        n_free = 0
    # the two ranges in visiting order (first tile, count): last to first, the masked first
    if REVERSE:
        first1, count1, first2, count2 = n_tiles - 1, n_tiles - n_free, n_free - 1, n_free
    else:
        first1, count1, first2, count2 = 0, n_free, n_free, n_tiles - n_free
    acc, l_i, m_i, acc_p, l_p, l_hat, l_pl, unit = _fwd_inner(
        acc, l_i, m_i, acc_p, l_p, l_hat, l_pl, unit, q, k_base, v_base, vp_base, mref_base,
        ms_base, n_k, offs_m, rows, qk_scale, inv_vf, kf_base, vf_base, Sk, stride_kn, stride_kd,
        stride_vn, stride_vd, stride_pn, stride_pd, first1, count1, stats_base, lost_base, sr_k0,
        sr_k1, sr_b, h,
        REVERSE, SAVE_M, LEAK, REVERSE, SMOOTH_Q, TILE_SCOPE, HEAD_DIM, V_DIM, BLOCK_M,
        BLOCK_N, CAUSAL, FIXED, LAZY, LAZY_LOG2, ROW_SUM_Q, PV_FP8, PRIME, MODE, LIFT, EQ_LO, EQ_HI,
        E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR,
        EMAX_E, LOG2_ME, SR, SR_BITS, TRACE, N_STATS, UNDER, OVER, P_SHIFT, LEAK_PARTS,
        ACC_DOT, Z_FMA, ACC_UNITS,
    )
    acc, l_i, m_i, acc_p, l_p, l_hat, l_pl, unit = _fwd_inner(
        acc, l_i, m_i, acc_p, l_p, l_hat, l_pl, unit, q, k_base, v_base, vp_base, mref_base,
        ms_base, n_k, offs_m, rows, qk_scale, inv_vf, kf_base, vf_base, Sk, stride_kn, stride_kd,
        stride_vn, stride_vd, stride_pn, stride_pd, first2, count2, stats_base, lost_base, sr_k0,
        sr_k1, sr_b, h,
        not REVERSE, SAVE_M, LEAK, REVERSE, SMOOTH_Q, TILE_SCOPE, HEAD_DIM, V_DIM, BLOCK_M,
        BLOCK_N, CAUSAL, FIXED, LAZY, LAZY_LOG2, ROW_SUM_Q, PV_FP8, PRIME, MODE, LIFT, EQ_LO, EQ_HI,
        E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR,
        EMAX_E, LOG2_ME, SR, SR_BITS, TRACE, N_STATS, UNDER, OVER, P_SHIFT, LEAK_PARTS,
        ACC_DOT, Z_FMA, ACC_UNITS,
    )
    empty = l_i == 0.0
    if ACC_UNITS:
        acc = acc * unit
    elif ACC_DOT:
        acc = acc * ACC_FACTOR
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None]) * out_factor
    if P_SHIFT != 0:  # Direct-P's sums ran on P^ 2^-S: the log-sum-exp of P^ itself, from
        # l 2^S where it is finite (as without the shift, bit for bit), else log2 l + S
        full = l_i * (1.0 / LIFT)
        back = full < float("inf")
        lse = m_i + tl.log2(tl.where(empty, 1.0, tl.where(back, full, l_i)))
        lse = tl.where(back, lse, lse + P_SHIFT)
    else:
        lse = m_i + tl.log2(tl.where(empty, 1.0, l_i))
    if not LSE_LOG2:
        lse = lse * 0.6931471805599453
    lse = tl.where(empty, float("inf"), lse)
    tl.store(LSE + bh * Sq + offs_m, lse, mask=rows)
    o_offs = b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :]
    tl.store(Out + o_offs, out.to(Out.dtype.element_ty), mask=rows[:, None])
    if TRACE:  # the softmax denominator's error, l^ / l - 1, over rows that see a key
        seen = rows & (lse == lse) & (lse < float("inf")) & (l_pl > 0.0)
        ratio = tl.where(seen, l_hat / tl.where(seen, l_pl, 1.0) - 1.0, 0.0)
        out_base = OutStats + (bh.to(tl.int64) * tl.cdiv(Sq, BLOCK_M) + start_m) * 2
        tl.store(out_base, tl.sum(ratio, 0))
        tl.store(out_base + 1, tl.sum(seen.to(tl.float32), 0))
    if PRIME:
        empty_p = l_p == 0.0
        out_p = tl.where(empty_p[:, None], 0.0, acc_p / tl.where(empty_p, 1.0, l_p)[:, None])
        tl.store(OutP + o_offs, (out_p * out_factor).to(OutP.dtype.element_ty), mask=rows[:, None])
# fmt: on


def _accumulate_in_dot(pq: PQuantizer, per_tile: bool, fp8: bool, fixed: bool = False) -> dict:
    """ACC_DOT and ACC_FACTOR: whether the tile's P^ V^ accumulates inside its `tl.dot` (as
    Triton's fused-attention tutorial does: acc = dot(P, V, alpha acc), no second fp32 tile
    in registers) with acc in units of the tile factor, applied once at the end, where that
    factor is one constant for the whole call. With a per-tile tensor scale (TENSOR: NVFP4's
    P) ACC_UNITS as well: each tile factor f = 2^e r splits, 2^e into P^'s block scales
    (exact) and acc held in units of r, moved from the last tile's r' by acc r' / r (a
    factor in (1/2, 2), so no tile's scale can overflow or underflow acc however far the
    tiles' maxima lie apart) before the dot adds the tile, times the last r at the end. Not
    with two-level P's row scales, or what needs each tile's own product (`per_tile`: O', the
    trace, per-tile operand factors, the leakage fix's diagonal terms). The result differs
    from the per-tile product's only by rounding order (the factor is a power of two or
    1/M_e, applied once rather than per tile; with ACC_UNITS one rounding of acc a tile, as
    the per-tile product's fma has, and the row sums the same bits). ACC_UNITS only with a
    running (or lazy) maximum as the row reference (not `fixed`): P^'s elements below about
    2^-120 (their block scales times 2^e past fp32's normal range) may lose bits, an
    absolute error below 1e-36 where the row's sum is at least its maximum's exp(0) = 1,
    but a fixed reference (an anchor, zero) can leave a whole row that small. Not where P^
    and V^ meet on the FP8 tensor
    cores (`fp8`): their accumulator keeps fewer bits than fp32 (DeepSeek-V3's report puts it
    near 14), so the running output inside the dot loses what an fp32 sum keeps. On the
    H200 (2026-12-02) it moved fa4fp4_causal's output from 5.9e-4 of the simulation's to
    1.6e-3 (benchmarks/RESULTS.md, "E4M3 by the GPU's conversion"); the recipes ask for fp32
    accumulation, so there each tile's product starts from zero and is added in fp32 (as
    DeepSeek-V3 promotes its FP8 partial sums). FlashAttention-3's FP8 kernel does
    accumulate O inside its wgmma (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp, zero_init
    false), which this kernel does not model."""
    if per_tile or fp8:
        return {}
    if not pq.constant_factor:
        units = pq.MODE == 2 and pq.TENSOR and not fixed
        return dict(ACC_DOT=True, ACC_UNITS=True) if units else {}
    if pq.MODE == 3:  # Direct-P's values are u / M_e, its factor 1 / E_MAX
        factor = 1.0 / pq.ELEM[3]
    else:
        factor = 1.0 / pq.LIFT
        if pq.MODE == 2 and 2 <= pq.RULE <= 5:  # an alpha grid's 1/M_e
            factor = factor / pq.ELEM[3]
    return dict(ACC_DOT=True, ACC_FACTOR=factor)


def _z_in_one_fma(pq: PQuantizer, scale: float, traced: bool, smooth_q: bool,
                  tile_scope: bool) -> dict:
    """Z_FMA: whether log2 P = S - m is one fma of the unscaled products, fl(x s - m), rather
    than fl(fl(x s) - m) (one multiply an element fewer). The row maximum is then
    fl(s max x), the same value as max fl(x s) since s > 0 and rounding is monotone. Only for
    P cast element by element (no quantization, a fixed-scale grid, bf16): where the
    maximum's own z must be exactly 0 (a block scale's power-of-two rule, Direct-P's codes
    from z, two-level P's row scales), the fused z of the maximum is the product's rounding
    error instead, which halved mxfp4's block scales on the H200 (see FP_FUSION). Elsewhere z
    moves by at most an ulp, where P was already not the simulation's bit for bit: the
    simulation takes exp(S - m) in natural units, the kernel exp2 of log2-unit scores. Not
    for block scales rounded to nearest either (NVFP4's): tried in session 23 (4% of nvfp4's
    forward loop), its forward checks held, but the backward, which rebuilds P from the
    forward's log-sum-exp, moved past its budgets under the interpreter (attn_qat's dQ
    1.08e-3 of the simulation's against 1e-3; croissattn_eden's rotated dV 3.3e-2 in 32
    rows), so it was taken back (benchmarks/RESULTS.md, "Session 23"). Not with the trace
    (its statistics keep the unfused order), smooth_q's added mean scores, per-tile K
    factors, or a scale that is not positive. Measured on the H200 (session 22): the FP8
    recipes' forward took 1% to 6% less time than without it, their checks against the
    simulation unchanged (benchmarks/RESULTS.md)."""
    if traced or smooth_q or tile_scope or not scale > 0 or pq.MODE not in (0, 1, MODE_BF16):
        return {}
    return dict(Z_FMA=True)


_REFERENCES = {"running": 0, "anchor": 1, "zero": 2}
# `LeakageParts` values the kernel runs: what the leakage fix leaves unquantized on the
# diagonal blocks (V alone, "v", runs on the simulation only)
_LEAK_PARTS = {"p_and_v": 0, "p": 1}


def _check_factors(factors, B: int, H: int, Hk: int, n_q: int, n_k: int) -> bool:
    """Whether the (qf, kf, vf) factors are per tile (else per head); raise ValueError for
    shapes that are neither."""
    per_head = ((B, H), (B, Hk), (B, Hk))
    per_tile = ((B, H, n_q), (B, Hk, n_k), (B, Hk, n_k))
    shapes = tuple(tuple(f.shape) for f in factors)
    if shapes not in (per_head, per_tile):
        raise ValueError(
            f"factors: (qf, kf, vf) must be shaped {per_head} (per head) or {per_tile} (per "
            f"tile: tensor_scope=tile), got {shapes}"
        )
    return shapes == per_tile

# What an instrumented forward (TRACE) writes per (batch x head, query tile, key tile), in this
# order (`_trace_p_tile`): P's nonzeros, P^'s nonzeros, sum (P^ - P)^2, sum P^2, P's clipped
# elements, its blocks with a nonzero and those whose scale under- or overflowed, NaNs of P^,
# of the tile's P^ V^ and of its masked scores; and per query tile (`OUT_STATS`).
FORWARD_STATS = (
    "nonzero", "kept", "diff2", "norm2", "clipped", "blocks", "underflow", "overflow", "nan",
    "pv_nan", "qk_nan",
)  # fmt: skip
OUT_STATS = ("row_sum_err_sum", "rows")


@dataclass
class TraceBuffers:
    """An instrumented forward's outputs, fp32: `stats` (B, H, n_q, n_k, len(FORWARD_STATS)),
    `lost` (B, H, Sq, n_k): each row's probability mass flushed in each key tile, as
    log2(mass) + the row reference the tile took (-inf where nothing was flushed or the row
    did not visit the tile), and `out` (B, H, n_q, len(OUT_STATS)). `lost` is per query row
    (Sq x n_k, block_n times smaller than the scores): the mass is a fraction of each row's
    final denominator, known only after the last key tile."""

    stats: torch.Tensor
    lost: torch.Tensor
    out: torch.Tensor

    @classmethod
    def empty(cls, B, H, Sq, Sk, block_m, block_n, device) -> TraceBuffers:
        n_q, n_k = triton.cdiv(Sq, block_m), triton.cdiv(Sk, block_n)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            stats=torch.zeros(B, H, n_q, n_k, len(FORWARD_STATS), **f32),
            lost=torch.full((B, H, Sq, n_k), -math.inf, **f32),
            out=torch.zeros(B, H, n_q, len(OUT_STATS), **f32),
        )


def _scale_bounds(pq: PQuantizer) -> tuple[float, float]:
    """(UNDER, OVER): the ideal block scales past which `_p_counts` counts an under- or
    overflow, as fp32 (the scale format's smallest positive value, Q_LO x UNIT, and its
    largest, widened by `fp4lab.recipes.tile_stats.SLACK`)."""
    lo, _, unit, top = pq.SCALE
    as_f32 = lambda x: torch.tensor(x, dtype=torch.float32).item()  # noqa: E731
    return as_f32(lo * unit * (1 - SLACK)), as_f32(top * (1 + SLACK))


def sr_key_words(key: int | None, stochastic: bool, name: str) -> tuple[int, int]:
    """A stream key (`fp4lab.formats.streams.stream_key`) as Philox's two key words, their
    bits as signed int32s; (0, 0) where nothing is stochastic."""
    if not stochastic:
        return 0, 0
    if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key < 1 << 64:
        raise ValueError(
            f"{name}: the operand rounds stochastically and needs its stream's 64-bit key "
            f"(fp4lab.formats.streams.stream_key), got {key!r}"
        )
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in split_key(key))


def sr_key_table(keys: tuple, stochastic: tuple, names: tuple, batch: int, device):
    """(table, batch per key) of the stream keys of m operands for a kernel: `keys[j]` is one
    64-bit key, or a sequence of n keys, one per consecutive batch / n batch elements (samples
    stacked along the batch, each drawing as its own call would), or None where operand j
    does not round stochastically (`stochastic[j]` False). The table is int32 (n, m, 2)."""
    if not any(stochastic) and keys.count(None) == len(keys):  # nothing drawn: one row of zeros
        return _key_table((((0, 0),) * len(keys),), torch.device(device)), batch
    n = max((len(k) for k in keys if isinstance(k, (tuple, list))), default=1)
    if batch % n:
        raise ValueError(f"sr keys: {n} keys per stream do not split a batch of {batch} evenly")
    rows = []
    for i in range(n):
        row = []
        for key, random, name in zip(keys, stochastic, names, strict=True):
            each = key if isinstance(key, (tuple, list)) else [key] * n
            if len(each) != n:
                raise ValueError(f"{name}: {len(each)} keys, where another stream has {n}")
            row.append(sr_key_words(each[i], random, name))
        rows.append(tuple(row))
    return _key_table(tuple(rows), torch.device(device)), batch // n


@functools.lru_cache(maxsize=64)
def _key_table(rows: tuple, device: torch.device) -> torch.Tensor:
    """`sr_key_table`'s int32 table on `device`, made once per distinct table: a table made
    from host values is a copy from pageable memory, which waits for the host, and the
    deterministic recipes' table (all zeros) is the same in every call. Kernels only read it."""
    return torch.tensor(rows, dtype=torch.int32, device=device)


@triton.jit
def _stream_words(SRKeys, b, sr_batch, j, M: tl.constexpr):
    """(k0, k1, batch) of stream j (of M) for batch element b: the key words (uint32) of its
    chunk of sr_batch elements in `sr_key_table`'s table, and its batch index in the chunk."""
    chunk = b // sr_batch
    k0 = tl.load(SRKeys + (chunk * M + j) * 2).to(tl.uint32)
    k1 = tl.load(SRKeys + (chunk * M + j) * 2 + 1).to(tl.uint32)
    return k0, k1, b % sr_batch


# -- the launcher ----------------------------------------------------------------------------------
_STAGES: dict = {}  # (kernel, its constants) -> the pipeline depth that fits in shared memory
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")  # launch options, not parameters


def launch_fitting(kernel, grid: tuple, args: tuple, constants: dict) -> None:
    """Launch `kernel` with `constants["num_stages"]`, or fewer where that pipeline does not
    fit the GPU's shared memory (the backward's 128 x 128 tiles at head_dim 128 need 329 KB at
    2 stages on the H200, which has 227 KB; the forward's, 229 KB at 3): the depth changes no
    number, only the overlap of loads and math, and the depth that fits is remembered per
    kernel and constants. At one stage that still does not fit, a ValueError names the
    tiles. `constants` is read by value once per object (`_split`): the forward hands the same
    object for every call of one configuration (`_forward_constants`)."""
    key, params, options = _split(kernel, constants)
    stages = _STAGES.get(key, constants["num_stages"])
    while True:
        options["num_stages"] = stages  # the params' sorted items as they are, the options anew
        static = (key[2][0], tuple(sorted(options.items())))  # launch.static_key's value
        try:
            launch(kernel, grid, args, params, options, static=static)
        except triton.runtime.errors.OutOfResources as error:
            if stages == 1:
                raise ValueError(
                    f"block_m={constants['BLOCK_M']}, block_n={constants['BLOCK_N']} at head_dim "
                    f"{constants['HEAD_DIM']}: {kernel.fn.__name__} does not fit this GPU's "
                    f"shared memory even at one pipeline stage ({error}); pass smaller tiles"
                ) from error
            stages -= 1
            continue
        _STAGES[key] = stages
        return


_SPLITS: dict = {}  # id(constants) -> (constants, (key, params, options)), `_split`'s
_MAX_SPLITS = 256


def _split(kernel, constants: dict) -> tuple:
    """(key, params, options) of `launch_fitting`'s `constants`: its key in `_STAGES` (the
    kernel's name, every constant by value, and `launch.static_key` of the parameters and
    options at the asked depth), the kernel's parameters and the launch options (a fresh
    dict, its num_stages set per attempt). Made once per constants object and kernel, kept
    while the object lives (the entry holds it, so its id is not reused)."""
    entry = _SPLITS.get(id(constants))
    if entry is not None and entry[0] is constants and entry[1] is kernel:
        key, params, options = entry[2]
        return key, params, dict(options)
    options = {name: constants[name] for name in _OPTIONS if name in constants}
    params = {name: value for name, value in constants.items() if name not in _OPTIONS}
    items = tuple(sorted(constants.items()))  # by name (names are unique): the params' order too
    params_items = tuple([item for item in items if item[0] not in _OPTIONS])
    key = (kernel.fn.__name__, items, (params_items, tuple(sorted(options.items()))))
    if len(_SPLITS) >= _MAX_SPLITS:
        _SPLITS.clear()
    _SPLITS[id(constants)] = (constants, kernel, (key, params, options))
    return key, params, dict(options)


@functools.lru_cache(maxsize=256, typed=True)
def _forward_constants(
    D: int, Dv: int, block_m: int, block_n: int, causal: bool, reverse: bool,
    lazy_log2: float | None, row_sum_quantized: bool, pv_fp8: bool, pq: PQuantizer,
    reference: str, anchor_keys: int, leakage_block: int, lse_log2: bool, prime: bool,
    save_m: bool, smooth_q: bool, tile_scope: bool, leakage_parts: str, traced: bool,
    accumulate: tuple, fused: tuple, num_warps: int, num_stages: int,
) -> dict:
    """`_attn_fwd`'s constants and launch options for one configuration of
    `attention_forward` (what it takes besides tensors, shapes and scalar arguments), made
    once and shared: one object per configuration, which `launch_fitting` reads once
    (`_split`). Nothing writes it. Typed, so that 1 and True are not one entry. `accumulate`
    and `fused`: the items of `_accumulate_in_dot`'s and `_z_in_one_fma`'s choices, which
    the caller makes each call (a benchmark or test that patches them is heard)."""
    instrument = {}
    if traced:  # without it the kernel is compiled with TRACE's defaults
        under, over = _scale_bounds(pq)
        instrument = dict(TRACE=True, N_STATS=len(FORWARD_STATS), UNDER=under, OVER=over)
    # fmt: off
    return dict(
        HEAD_DIM=D, V_DIM=Dv, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, REVERSE=reverse,
        LAZY=lazy_log2 is not None, LAZY_LOG2=lazy_log2 or 0.0, ROW_SUM_Q=row_sum_quantized,
        PV_FP8=pv_fp8,
        MODE=pq.MODE, LIFT=pq.LIFT, EQ_LO=pq.ELEM[0], EQ_HI=pq.ELEM[1], E_UNIT=pq.ELEM[2],
        E_MAX=pq.ELEM[3], SQ_LO=pq.SCALE[0], SQ_HI=pq.SCALE[1], S_UNIT=pq.SCALE[2],
        S_MAX=pq.SCALE[3], E_LO=pq.SCALE_POW2[0], E_HI=pq.SCALE_POW2[1], QBLOCK=pq.BLOCK,
        RULE=pq.RULE, ARITH=pq.ARITH, TENSOR=pq.TENSOR, EMAX_E=pq.EMAX_E,
        LOG2_ME=math.log2(pq.ELEM[3]), REF=_REFERENCES[reference], FIXED=reference != "running",
        ANCHOR_KEYS=anchor_keys, LEAK=leakage_block, LSE_LOG2=lse_log2, PRIME=prime,
        SAVE_M=save_m, SR=pq.SR, SR_BITS=pq.SR_BITS,
        SMOOTH_Q=smooth_q, TILE_SCOPE=tile_scope, P_SHIFT=pq.shift,
        LEAK_PARTS=_LEAK_PARTS[leakage_parts],
        **dict(accumulate),
        **dict(fused),
        **instrument,
        num_warps=num_warps,
        num_stages=num_stages,
        enable_fp_fusion=FP_FUSION,
    )
    # fmt: on


def attention_forward(
    q,
    k,
    v,
    factors,
    pq: PQuantizer,
    *,
    causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    reverse: bool = False,
    lazy_log2: float | None = None,
    row_sum_quantized: bool = False,
    reference: str = "running",
    anchor_keys: int = 0,
    anchor_margin: float = 0.0,
    leakage_block: int = 0,
    v_plain=None,
    leakage_parts: str = "p_and_v",
    lse_log2: bool = False,
    o_prime: torch.Tensor | None = None,
    m_ref: torch.Tensor | None = None,
    mean_scores: torch.Tensor | None = None,
    sr_key=None,
    trace: TraceBuffers | None = None,
    out_dtype: torch.dtype | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """O (B, H, Sq, Dv) and lse (B, H, Sq) fp32 of already quantized q, k, v (B, H|Hkv, S, D),
    bf16 or fp16, contiguous in their last dim, on the GPU (or under the interpreter); the
    values of q, k, v are multiplied by `factors` in the kernel's fp32 arithmetic: fp32
    tensors of (B, H), (B, Hkv), (B, Hkv) elements, one per head, or (tensor_scope=tile) of
    (B, H, cdiv(Sq, block_m)), (B, Hkv, n_k), (B, Hkv, n_k), one per query tile of Q and per
    key tile of K and V (n_k = cdiv(Sk, block_n)). `reference` is the row reference: "running"
    (with `lazy_log2`, the lazy maximum), "anchor" (each row's largest score over its first
    `anchor_keys` keys plus `anchor_margin` in score units, fixed) or "zero". `lse_log2`:
    return the log-sum-exp in log2 units (m + log2 l, the kernel's own, before its conversion
    to natural units), which the backward rebuilds P from: a row whose l is 1 then gets
    P = exp2(0) = 1 exactly again, as the simulation's exp(S - lse) does. `o_prime`: a tensor
    shaped and laid out as the output, filled with Attn-QAT's O' = (P V^) / rowsum(P) of the
    unquantized P (`DeltaSource.UNQUANTIZED_P_OUTPUT`), or None. `m_ref`: a contiguous fp32
    (B, H, Sq, cdiv(Sk, block_n)) tensor filled with the row reference each key tile's P took
    (log2 units; tiles a row does not visit are left as they were), or None. `mean_scores`:
    smooth_q's correction, a contiguous fp32 (B, H, cdiv(Sq, block_m), Sk) tensor holding
    scale log2(e) M_i . k_j of each query tile's mean M_i and every key (`q` then holds the
    quantized Q - M), added to the tile's scores; or None. `sr_key`: the
    64-bit key of P's random stream (`fp4lab.formats.streams.stream_key`), required when
    `pq` rounds stochastically: element (b, h, query, key) of P takes the stream's word at
    that position, as the simulation draws it; or a sequence of n keys, one per consecutive
    B / n batch elements, which then count their batch from 0 (`sr_key_table`). `trace`: the
    `TraceBuffers` an instrumented kernel (TRACE) fills, or None: the kernel compiled without
    instrumentation, the very one of an uninstrumented call. `out_dtype`: O's dtype (q's
    when None; the instrumented path asks for fp32, the output before its cast).
    `leakage_parts` (with `leakage_block`): what the leakage fix leaves unquantized on the
    diagonal blocks, "p_and_v" (MatX's fix) or "p" (P times V^), `fp4lab.recipes.LeakageParts`
    ("v" runs on the simulation only)."""
    if reference not in _REFERENCES:
        raise ValueError(f"reference must be one of {', '.join(_REFERENCES)}; got {reference!r}")
    if reference == "anchor" and not 0 < anchor_keys <= block_n:
        raise ValueError(
            f"anchor_keys must be in [1, block_n={block_n}] (the anchor is read from key tile "
            f"0), got {anchor_keys}"
        )
    if leakage_parts not in _LEAK_PARTS:
        raise ValueError(f"leakage_parts must be one of {', '.join(_LEAK_PARTS)}; got "
                         f"{leakage_parts!r}")
    if leakage_block and (v_plain is None or not causal or block_m % leakage_block):
        raise ValueError(
            f"leakage_block={leakage_block}: the leakage fix needs causal attention, v_plain "
            f"(the unquantized V) and block_m a multiple of it (got {block_m}), so that the "
            "diagonal blocks lie in the masked tiles only"
        )
    v_plain = v if v_plain is None else v_plain
    B, H, Sq, D = q.shape
    sr_table = sr_key_table((sr_key,), (pq.SR,), ("sr_key",), B, q.device)
    Hk, Sk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    o = torch.empty(B, H, Sq, Dv, dtype=out_dtype or q.dtype, device=q.device)  # bf16 (fp32
    # interpreted) unless out_dtype says otherwise
    lse = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    n_q, n_k = -(-Sq // block_m), -(-Sk // block_n)  # triton.cdiv's, without its calls
    grid = (n_q, B * H)
    qf, kf, vf = (f.to(torch.float32).contiguous() for f in factors)
    tile_scope = _check_factors((qf, kf, vf), B, H, Hk, n_q, n_k)
    from fp4lab.kernels import gluon_fwd  # (imports this module)

    gap = gluon_fwd.unsupported(q, k, v, pq, block_m=block_m, block_n=block_n,
                                num_warps=num_warps, out_dtype=out_dtype, scale=scale,
                                causal=bool(causal), extras=dict(
        trace=trace is not None, o_prime=o_prime is not None, m_ref=m_ref is not None,
        mean_scores=mean_scores is not None, leakage_block=leakage_block,
        lazy_log2=lazy_log2 is not None, row_sum_quantized=row_sum_quantized, reverse=reverse,
        reference=reference != "running", tile_scope=tile_scope, p_shift=pq.shift != 0,
    ))  # fmt: skip
    if gap is None:  # the same numbers, its products overlapped (`fp4lab.kernels.gluon_fwd`)
        return gluon_fwd.attention_forward(q, k, v, (qf, kf, vf), pq, causal=causal,
                                           scale=scale, lse_log2=lse_log2, o=o, lse=lse,
                                           lazy_log2=lazy_log2, reverse=reverse)
    if m_ref is not None and (m_ref.shape != (B, H, Sq, n_k) or not m_ref.is_contiguous()):
        raise ValueError(f"m_ref must be a contiguous {(B, H, Sq, n_k)} tensor, got "
                         f"{tuple(m_ref.shape)}")  # fmt: skip
    if o_prime is not None and (o_prime.shape != o.shape or o_prime.stride() != o.stride()):
        raise ValueError(
            f"o_prime must be shaped and laid out as the output {tuple(o.shape)}, got "
            f"{tuple(o_prime.shape)} with strides {o_prime.stride()}"
        )
    if mean_scores is not None and (
        mean_scores.shape != (B, H, n_q, Sk) or mean_scores.dtype != torch.float32
        or not mean_scores.is_contiguous()
    ):  # fmt: skip
        raise ValueError(
            f"mean_scores must be a contiguous float32 {(B, H, n_q, Sk)} tensor, got "
            f"{mean_scores.dtype} {tuple(mean_scores.shape)}"
        )
    if trace is not None and (
        trace.stats.shape != (B, H, n_q, n_k, len(FORWARD_STATS))
        or trace.lost.shape != (B, H, Sq, n_k) or trace.out.shape != (B, H, n_q, len(OUT_STATS))
        or not all(t.is_contiguous() for t in (trace.stats, trace.lost, trace.out))
    ):  # fmt: skip
        raise ValueError(
            "trace: buffers must be contiguous, shaped as TraceBuffers.empty"
            f"({B}, {H}, {Sq}, {Sk}, {block_m}, {block_n}) makes them"
        )
    spare = lse  # a pointer for the buffers an uninstrumented kernel never touches
    pv_fp8 = v.dtype == torch.float8_e4m3fn
    accumulate = _accumulate_in_dot(pq, o_prime is not None or trace is not None or tile_scope
                                    or leakage_block > 0, pv_fp8, reference != "running")
    fused = _z_in_one_fma(pq, scale, trace is not None, mean_scores is not None, tile_scope)
    constants = _forward_constants(
        D, Dv, block_m, block_n, bool(causal), bool(reverse), lazy_log2,
        bool(row_sum_quantized), pv_fp8, pq, reference, anchor_keys, leakage_block,
        bool(lse_log2), o_prime is not None, m_ref is not None, mean_scores is not None,
        tile_scope, leakage_parts, trace is not None, tuple(accumulate.items()),
        tuple(fused.items()), num_warps, num_stages,
    )  # fmt: skip
    # fmt: off
    launch_fitting(_attn_fwd, grid, (
        q, k, v, v_plain, o, o if o_prime is None else o_prime, lse,
        lse if m_ref is None else m_ref, lse if mean_scores is None else mean_scores,
        *((spare,) * 3 if trace is None else (trace.stats, trace.lost, trace.out)),
        qf, kf, vf, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        v.stride(0), v.stride(1), v.stride(2), v.stride(3), *v_plain.stride(),
        o.stride(0), o.stride(1), o.stride(2),
        H, H // Hk, Sq, Sk, anchor_margin * scale * LOG2E, *sr_table), constants)
    # fmt: on
    return o, lse
