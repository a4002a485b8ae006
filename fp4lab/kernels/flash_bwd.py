"""FlashAttention's backward in Triton with in-kernel quantization of P and dS, driven by a recipe.

What. `attention_backward` runs the backward of the simulation path (`fp4lab.analysis.flash`,
its `_backward_step`) as three kernels on the GPU, FlashAttention-2's (Dao 2023, arXiv
2307.08691, Algorithm 2) in the Triton tutorial's structure: a preprocess computing
D = rowsum(dO * O) per query row, a dK/dV kernel per key tile that walks the query tiles
which see it (and, for grouped-query attention, the query heads of its group), and a dQ kernel
per query tile that walks the key tiles it sees. Q, K, V, dO arrive already quantized as the
recipe's backward fields say (`fp4lab.kernels.backend.backward_operands`, by the fused Triton
quantizer, whole tensors, as the simulation quantizes them); P and dS are quantized inside the
kernels, tile by tile, along the blocks' axis of the product that consumes them.

The algorithm per (query tile i, key tile j), in log2 units (z = scale log2(e) S):

    P = exp2(z - lse log2(e))                 rebuilt from the forward's log-sum-exp, S from
                                              Q^, K^ (backward_p=quantized_qk; with smooth_q
                                              plus the forward's M K^T) or Q, K
    P^ = q_dv_p(lift P) / lift                along the queries (straight-through: the
                                              forward's P quantizer, along the keys)
    dV_j += P^^T dO^_i                        dO^: dv_do
    dP = dO^_i V^_j^T                         dp_do, dp_v (V, or the forward's V^)
    dS = (P or P^) * (dP - D_i)               recipe.ds_p; D from recipe.delta
    dQ_i += scale q_dq_ds(dS) K^_j            dS along the keys, K^: dq_k
    dK_j += scale q_dk_ds(dS)^T Q^_i          dS along the queries, Q^: dk_q (the forward's
                                              Q^ with smooth_q: (Q - M)^ + M, the M part as
                                              rowsum(dS^T) M_i^T in fp32)

Why two kernels and not atomics. FlashAttention-2's own kernel accumulates dQ with fp32
atomic adds from the dK/dV programs; the Triton tutorial instead gives dQ its own pass (a
program per query tile) at the cost of computing S and dP twice (seven matrix products per
tile pair instead of five). fp4lab takes the tutorial's way: atomics make dQ's summation
order depend on scheduling, so two runs of one recipe would give different bits, which a
numerics lab measuring gradient bias cannot have; and each kernel recomputes its tiles of P
and dS from the same operands in the same arithmetic, so both quantize the same values.
Grouped-query heads are summed inside the dK/dV program (a loop over the group), again
without atomics.

Layout. The dK/dV kernel holds its tiles transposed, (keys, queries), as the tutorial does,
so that P^T and dS^T are the left operands of their products with no transpose, and both of
its in-register quantizers (P for dV, dS for dK: blocks along the queries) run along a tile's
last axis, as the forward's P does; the dQ kernel holds (queries, keys), where dS for dQ is
blocked along the keys, the last axis again. An operand blocked along the other axis (the
straight-through backward's P, along the keys, in the dK/dV kernel; P^ for dS = P^ (dP - D)
in the dQ kernel) is transposed in registers around its quantizer (`TRANS`).

Exactness. As in the forward (`fp4lab.kernels.flash`), quantized values are bf16-exact
(codes times block scales), factors bf16 cannot hold (tensor scales, lifts, an FP32 per-tile
scale, alpha grids' 1/M_e, whole-tensor operands' per-head factors) multiply each tile's fp32
product, and an operand that is not bf16-exact (unquantized P or dS, a format wider than
bf16's 8 significant bits) enters its product as two bf16 halves (`_dot`, 16 bits).

The exact gradient of the forward as it ran (backward=forward_exact, what
`gradient_bias(..., reference="forward")` measures a backward against) takes dV from the
forward's own P^ tiles, replayed in the dK/dV kernel from the row reference each key tile of
the forward used (the forward saves them: `attention_forward`'s m_ref) with the forward's P
quantizer, along the keys.

Two-level P (p_quant=row_scaled, Attn-QAT's kernel; mode 6). The straight-through backward
quantizes its normalized P as the forward's two-level P does, as the simulation's
`quantize_p` does: each row of a tile (a query's keys) scaled by r = M_e M_s / its maximum
(`fp4lab.kernels.flash._row_scales`), quantized as mode 2, and each element of q(r P)
divided back by its row's r. The forward divides its products by r instead (r runs along
its output rows); dV's products sum over the queries, so here the division is per element,
the same quotients as the reference's, and P^ enters dV as two bf16 halves.

Per-tile factors (tensor_scope=tile, Attn-QAT's kernel; TILE_SCOPE, a compile-time flag).
The whole-tensor operands' factors arrive one per tile, as the forward's do: Q's and dO's
per query tile, K's and V's per key tile (`fp4lab.kernels.backend._Scope`). Each kernel
reads its own tile's once and the other side's per tile of its loop; the scores of a tile
pair take (scale Q's) K's factor in the forward's order, dP V's times dO's, and dQ's product
K^'s per key tile (per head it multiplies dQ once, at the end). Without the flag the factors
are per head, read once per program, and no arithmetic changes.

Stochastic rounding. P for dV and dS for dQ and dK round stochastically as the forward's P
does (`fp4lab.kernels.flash`): each from its own stream (dv_p, dq_ds, dk_ds; the
straight-through P from the backward pass's P stream, the replayed P^ from the forward's),
the words made in registers at each element's (batch, query head, query, key) position and
transposed with the tile in the dK/dV kernel; the dQ kernel's P^ for dS = P^ (dP - D) takes
the very words the dK/dV kernel's does, so both quantize the same P^. dS rounds on its
magnitude, as the reference rounds |x| and restores the sign.

Hadamard transforms and MS-EDEN (Quartet II; `croissattn_eden`). Where a backward product's
operands carry a random Hadamard transform along its reduction axis, its whole-tensor operand
arrives rotated (`fp4lab.kernels.backend`) and P or dS is rotated in registers along the same
axis before its quantizer (`_rotate`: the tile times diag(signs) H / sqrt(n) in groups of n,
a tl.dot in fp32, the matrix `fp4lab.formats.hadamard_matrix` loaded once a program), so the
product of the two rotated, quantized operands is the simulation's product of the two
dequantized ones (H H^T = I) up to fp32 rounding; the tile factor multiplies it as before.
MS-EDEN (mode 7, `_eden_rows`) is `fp4lab.formats.eden`'s chain on the rotated tile: sigma
truncated to 4 mantissa bits, the elements rounded to nearest E2M1, each block's scale
corrected by <v, v> / <v, q> (float64 sums) and rounded to bf16, one tensor scale t = max / 256
per tile (as the simulation takes a per-tile operand's), the stored E4M3 scales rounded
stochastically by the top 16 bits of the stream's word at each block's first element (the
simulation's uniform there, floor(2^16 u)). The in-register quantizers that rotate share one
matrix (one size and seed); the tiles must hold whole groups along the rotated axis.

What is not here (each refused by `fp4lab.kernels.backend.check_backward` before anything
runs): 2-D blocks, Hadamard transforms that do not pair up across a product (or with dS
taken from the rotated P^, D from the rotated dO^, or the straight-through and forward-exact
backwards), a trace of rotated operands, fixed scales on P or dS, stochastic
rounding of a per-tile FP32 scale format, two-level P replayed (forward_exact), per-tile
factors with the flash backward (its own dO, V, K, Q quantized per tile), dropout, and a
trace of a stochastic recipe.

Instrumentation (TRACE, a compile-time flag, off by default). Compiled with it, the dK/dV
kernel writes each tile's statistics of P in dV and of dS in dK, the dQ kernel those of dS in
dQ (`BACKWARD_STATS`, into `trace_buffers`), computed after the operand is quantized by a
helper of their own (`_trace_tile`) that recounts what the quantizer saw; without it the
branches are eliminated at compile time. `fp4lab.kernels.trace` turns them into the trace's
dv, dp, dq and dk rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4lab.formats import BF16, FP32, QuantSpec, ScaleArithmetic, ScaleRule, hadamard_matrix
from fp4lab.formats.spec import Correction
from fp4lab.kernels.flash import (
    FP_FUSION,
    LOG2E,
    MODE_BF16,
    PQuantizer,
    _bf16_grid,
    _direct_p,
    _grid,
    _p_counts,
    _put,
    _put_counts,
    _quantize_p,
    _query_tile,
    _round,
    _row_scales,
    _scale_bounds,
    _stat_columns,
    _store_stats,
    _stream_words,
    check_p,
    launch_fitting,
    sr_key_table,
)
from fp4lab.kernels.quantize import _bfloat16_round
from fp4lab.kernels.random import tile_words

__all__ = [
    "attention_backward", "BackwardOperands", "TileQuantizer", "BACKWARD_STATS", "trace_buffers",
]  # fmt: skip

# modes beyond PQuantizer's 0 (none), 1 (cast), 2 (1-D blocks), 3 (Direct-P)
_MODE_TILE_SCALE = 4  # one FP32 scale per tile: amax / M_e (a per-tensor format on a tile)
_MODE_BF16 = MODE_BF16  # a cast to bf16 (its grid reaches below fp32's normal range)
_MODE_EDEN = 7  # Quartet II's MS-EDEN: corrected scales, rounded stochastically (`_eden_rows`)


# -- which formats, as compile-time constants --------------------------------------------------
@dataclass(frozen=True)
class TileQuantizer:
    """An operand the backward quantizes tile by tile in registers (P for dV, dS for dQ and for
    dK): its `PQuantizer` (modes 0-3 and 6, plus 4 one FP32 scale per tile, 5 a bf16 cast
    and 7 MS-EDEN), whether its 1-D blocks run along the keys (else along the queries), and
    its random Hadamard transform along them, (size, seed) or None."""

    pq: PQuantizer
    along_keys: bool
    hadamard: tuple[int, int] | None = None
    inv_c: float = 0.0  # MS-EDEN's fl(1 / fl(c)) (`fp4lab.formats.eden`, its step 1)

    @classmethod
    def of(cls, spec, lift: float, field: str, along_keys: bool):
        """The quantizer of recipe field `field` with format `spec` and lift."""
        if spec is None:
            return cls(PQuantizer(MODE=0), along_keys)
        if isinstance(spec, QuantSpec) and (spec.hadamard or spec.correction is Correction.EDEN):
            return cls._transformed(spec, lift, field, along_keys)
        if spec == BF16:
            return cls(PQuantizer(MODE=_MODE_BF16, LIFT=lift, ELEM=_grid(BF16)), along_keys)
        if isinstance(spec, QuantSpec) and spec.block is None:
            check_tile_scale(spec, field)
            return cls(PQuantizer(MODE=_MODE_TILE_SCALE, LIFT=lift, ELEM=_grid(spec.element)),
                       along_keys)  # fmt: skip
        check_p(spec, lift, field=field)
        return cls(PQuantizer.of(spec, lift, field), along_keys)

    @classmethod
    def _transformed(cls, spec: QuantSpec, lift: float, field: str, along_keys: bool):
        """A 1-D block format with a Hadamard transform (rotated in registers, `_rotate`),
        MS-EDEN (mode 7, `_eden_rows`), or both: the rest as `PQuantizer.of` takes it."""
        rotation = None if spec.hadamard is None else (spec.hadamard, spec.hadamard_seed)
        if spec.hadamard is not None and spec.hadamard % 16:
            raise NotImplementedError(
                f"{field}: the Triton backward rotates tiles by Hadamard matrices of a multiple "
                f"of 16 (a matrix product's), not {spec.hadamard}; use backend='reference'"
            )
        if spec.correction is not Correction.EDEN:
            plain = dataclasses.replace(spec, name=spec.name, hadamard=None)
            return cls(PQuantizer.of(plain, lift, field), along_keys, rotation)
        problems = []
        if spec.block is None or len(spec.block) != 1 or spec.block[0] not in (16, 32):
            problems.append(f"blocks {spec.block} (MS-EDEN in registers takes 1-D blocks of 16 "
                            "or 32)")  # fmt: skip
        if spec.scale.mbits != 3 or spec.scale.emin < -126:
            problems.append(f"scale format {spec.scale.name} (MS-EDEN's 16-bit scale rounding "
                            "in registers is E4M3's)")  # fmt: skip
        if spec.element.emin - spec.element.mbits < -126:
            problems.append(f"element format {spec.element.name} below fp32's normal range")
        if problems:
            raise NotImplementedError(
                f"{field}: the Triton backward does not quantize {field} with block format "
                f"{spec.name!r} yet: " + "; ".join(problems) + "; use backend='reference'"
            )
        pq = PQuantizer(MODE=_MODE_EDEN, LIFT=lift, ELEM=_grid(spec.element),
                        SCALE=_grid(spec.scale), BLOCK=spec.block[0], TENSOR=True, SR=True)
        inv_c = float(torch.ones(()) / torch.tensor(spec.amax_target, dtype=torch.float32))
        return cls(pq, along_keys, rotation, inv_c)

    @property
    def split(self) -> bool:
        """Whether its values can exceed bf16's 8 significant bits (then `_dot` splits them)."""
        pq = self.pq
        if pq.MODE == 0 or pq.MODE == 6:  # unquantized, or two-level P's q(r P) / r
            return True
        element_bits = round(-math.log2(pq.ELEM[2])) + 1
        if pq.MODE == 2 and pq.RULE == 0:  # scales rounded into a format with mantissa bits
            return element_bits + round(-math.log2(pq.SCALE[2])) + 1 > 8
        return element_bits > 8

    def constants(self, prefix: str, keys_last: bool) -> dict:
        """The kernel's constexpr arguments `<prefix>_*`; `keys_last`: the kernel's tiles hold
        the keys along their last axis (the dQ kernel) or the queries (the dK/dV kernel)."""
        pq = self.pq
        values = dict(
            MODE=pq.MODE, LIFT=pq.LIFT, EQ_LO=pq.ELEM[0], EQ_HI=pq.ELEM[1], E_UNIT=pq.ELEM[2],
            E_MAX=pq.ELEM[3], SQ_LO=pq.SCALE[0], SQ_HI=pq.SCALE[1], S_UNIT=pq.SCALE[2],
            S_MAX=pq.SCALE[3], E_LO=pq.SCALE_POW2[0], E_HI=pq.SCALE_POW2[1], QBLOCK=pq.BLOCK,
            RULE=pq.RULE, ARITH=pq.ARITH, TENSOR=pq.TENSOR, EMAX_E=pq.EMAX_E,
            LOG2_ME=math.log2(pq.ELEM[3]), TRANS=self.along_keys != keys_last, SPLIT=self.split,
            SR=pq.SR, SR_BITS=pq.SR_BITS, HAD=self.hadamard is not None, INV_C=self.inv_c,
        )  # fmt: skip
        return {f"{prefix}_{name}": value for name, value in values.items()}


def check_tile_scale(spec: QuantSpec, field: str) -> None:
    """Raise for a per-tensor format (block=None) on a per-tile operand that the kernel does
    not quantize: it takes one FP32 scale amax / M_e per tile, elements divided by it."""
    plain = (
        spec.scale == FP32 and spec.scale_rule is ScaleRule.NEAREST and not spec.tensor_scale
        and spec.arithmetic is ScaleArithmetic.EXACT and spec.fixed_scale is None
        and not spec.stochastic and spec.hadamard is None and spec.scale_floor is None
        and spec.correction.value == "none"
    )  # fmt: skip
    if not plain:
        raise NotImplementedError(
            f"{field}: the Triton backward quantizes a per-tensor format on a tile only as one "
            f"FP32 scale amax / M_e per tile; {spec.name!r} is another (a fixed scale, a tensor "
            "scale, stochastic rounding, ...); use backend='reference'"
        )
    if spec.element.emin - spec.element.mbits < -126:
        raise NotImplementedError(
            f"{field}: element format {spec.element.name} reaches below fp32's normal range; "
            "use backend='reference'"
        )


@dataclass
class BackwardOperands:
    """The backward's tensors as the kernels read them: each whole-tensor operand as (store,
    factor), store (B, H|Hkv, S, E) contiguous in the kernel's dtype with bf16-exact values,
    factor fp32 (B, H|Hkv), or (B, H|Hkv, n tiles) with tensor_scope=tile (the scores' Q's
    says which; a per-head factor among per-tile ones is repeated per tile)
    (`fp4lab.kernels.backend._operand`)."""

    q: tuple  # the scores' Q (the forward's Q^, or Q)
    k: tuple  # the scores' K
    do_dv: tuple  # dO in dV = P^T dO
    do_dp: tuple  # dO in dP = dO V^T
    v_dp: tuple  # V in dP
    k_dq: tuple  # K in dQ = dS K
    q_dk: tuple  # Q in dK = dS^T Q
    o: torch.Tensor  # the output D = rowsum(dO * O) is taken with (O, or Attn-QAT's O')
    do_delta: tuple  # the dO D is taken with (dO, or dp_do's)
    lse: torch.Tensor  # the forward's log-sum-exp, (B, H, Sq) fp32, in log2 units
    mean_scores: torch.Tensor | None = None  # smooth_q's M K^T added to S, (B, H, n_q, Sk) fp32
    q_dk_mean: torch.Tensor | None = None  # smooth_q's means M that dK's Q^ adds, (B, H, n_q, D)


# -- device functions --------------------------------------------------------------------------
@triton.jit
def _dot(a, b, SPLIT: tl.constexpr):
    """a (fp32 values) times b (a stored operand) with fp32 accumulation, a in b's dtype: whole
    where its values fit (quantized ones are bf16-exact), else as two halves (16 bits)."""
    head = a.to(b.dtype)
    if SPLIT:
        tail = (a - head.to(tl.float32)).to(b.dtype)
        return tl.dot(tail, b, tl.dot(head, b))
    return tl.dot(head, b)


@triton.jit
def _dot_into(a, b, acc, SPLIT: tl.constexpr):
    """acc + a b as `_dot` takes a, summed inside the dots (their fp32 accumulator: b's
    stored operands are bf16, never fp8, so no reduced-precision FP8 sums)."""
    head = a.to(b.dtype)
    if SPLIT:
        return tl.dot((a - head.to(tl.float32)).to(b.dtype), b, tl.dot(head, b, acc))
    return tl.dot(head, b, acc)


@triton.jit
def _hadamard_matrix(Had, HAD_N: tl.constexpr, USED: tl.constexpr):
    """The (HAD_N, HAD_N) fp32 matrix diag(signs) H / sqrt(n) at Had (row-major,
    `fp4lab.formats.hadamard_matrix`), loaded where a quantizer of the kernel rotates (USED);
    else 0, never read."""
    had = 0.0
    if USED:
        offs = tl.arange(0, HAD_N)
        had = tl.load(Had + offs[:, None] * HAD_N + offs[None, :])
    return had


@triton.jit
def _rotate(x, had, ROWS: tl.constexpr, COLS: tl.constexpr, HAD_N: tl.constexpr,
            TRANS: tl.constexpr):
    """x (ROWS, COLS) times the Hadamard matrix in groups of HAD_N along its last axis (TRANS:
    its first), as the reference rotates an operand along its blocks' axis (`_hadamard` of
    `fp4lab.formats.quantize`: x @ diag(signs) H / sqrt(n)), the products in fp32."""
    if TRANS:
        return tl.trans(_rotate(tl.trans(x), had, COLS, ROWS, HAD_N, False))
    groups = tl.reshape(x, [ROWS * COLS // HAD_N, HAD_N])  # (ROWS COLS / n, n)
    return tl.reshape(tl.dot(groups, had, input_precision="ieee"), [ROWS, COLS])


@triton.jit
def _eden_rows(
    x, words, ROWS: tl.constexpr, COLS: tl.constexpr, QBLOCK: tl.constexpr,
    EQ_LO: tl.constexpr, EQ_HI: tl.constexpr, E_UNIT: tl.constexpr, E_MAX: tl.constexpr,
    SQ_LO: tl.constexpr, SQ_HI: tl.constexpr, S_UNIT: tl.constexpr, S_MAX: tl.constexpr,
    INV_C: tl.constexpr,
):  # fmt: skip
    """Quartet II's MS-EDEN (`fp4lab.formats.eden`) on a (ROWS, COLS) tile of signed x,
    blocked along its last axis, one tensor scale for the tile: (|q| s, t) with q the
    elements rounded to nearest, s each block's corrected scale stochastically rounded into
    E4M3 by the top 16 bits of the word at its first element, t = max corrected / 256."""
    NB: tl.constexpr = COLS // QBLOCK
    blocks = tl.reshape(x, [ROWS, NB, QBLOCK])  # (ROWS, blocks, QBLOCK)
    a_bits = tl.max(blocks.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 2)
    finite = a_bits < 0x7F800000
    a = tl.where(finite, a_bits.to(tl.float32, bitcast=True), 0.0)
    # -- 1. sigma, its mantissa truncated to 4 bits; 2. v and q --
    sigma = ((a * INV_C).to(tl.int32, bitcast=True) & -524288).to(tl.float32, bitcast=True)
    sigma = tl.where(sigma >= 1.1754943508222875e-38, sigma, 0.0)
    inverse = tl.where(sigma > 0.0, tl.math.div_rn(tl.zeros_like(sigma) + 1.0,
                                                   tl.where(sigma > 0.0, sigma, 1.0)), 0.0)
    v = blocks * inverse[:, :, None]
    q = _round(tl.abs(v), EQ_LO, EQ_HI, E_UNIT, E_MAX)
    # -- 3. the correction <v, v> / <v, q> (float64 sums); 4. its BF16 rounding --
    v64 = v.to(tl.float64)
    v_v = tl.sum(v64 * v64, 2).to(tl.float32)
    v_q = tl.sum(tl.abs(v64) * q.to(tl.float64), 2).to(tl.float32)
    correction = tl.where(v_q == 0.0, 1.0, tl.math.div_rn(v_v, tl.where(v_q == 0.0, 1.0, v_q)))
    corrected = tl.where(finite, _bfloat16_round(sigma * correction), float("nan"))
    # -- 5. the tile's t; 6. each block's scale rounded stochastically --
    t = tl.zeros_like(corrected) + tl.max(tl.max(corrected, 1), 0) * 0.00390625  # 2^-8
    inv_t = tl.where(t != 0.0, tl.math.div_rn(tl.zeros_like(t) + 1.0,
                                              tl.where(t != 0.0, t, 1.0)), 0.0)
    pre = corrected * tl.minimum(inv_t, 3.4028234663852886e38)
    lane = tl.arange(0, QBLOCK)[None, None, :]
    first = tl.sum(tl.where(lane == 0, tl.reshape(words, [ROWS, NB, QBLOCK]), 0), 2)
    k = (first >> 16).to(tl.int32)  # floor(2^16 u): the uniform u = word 2^-32
    bits = pre.to(tl.int32, bitcast=True)
    up = (bits & 0xFFFFF) > (k << 4)  # the 20 bits below E4M3's mantissa against 16 k
    moved = tl.where(up, bits | 0xFFFFF, bits & -1048576).to(tl.float32, bitcast=True)
    moved = tl.where((pre <= S_MAX) & (pre >= SQ_LO), moved, pre)
    s = _round(moved, SQ_LO, SQ_HI, S_UNIT, S_MAX)
    values = tl.reshape(q * s[:, :, None], [ROWS, COLS])
    return values, tl.max(tl.max(t, 1), 0)


@triton.jit
def _quantize_tile(
    x, z, words, ROWS: tl.constexpr, COLS: tl.constexpr, SIGNED: tl.constexpr,
    MODE: tl.constexpr, LIFT: tl.constexpr, EQ_LO: tl.constexpr, EQ_HI: tl.constexpr,
    E_UNIT: tl.constexpr, E_MAX: tl.constexpr, SQ_LO: tl.constexpr, SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr, S_MAX: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr,
    QBLOCK: tl.constexpr, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr, LOG2_ME: tl.constexpr, TRANS: tl.constexpr,
    SR: tl.constexpr = False, SR_BITS: tl.constexpr = 0, had=0.0, HAD: tl.constexpr = False,
    HAD_N: tl.constexpr = 128, INV_C: tl.constexpr = 0.0,
):  # fmt: skip
    """(values, tile factor) of a (ROWS, COLS) tile x as `TileQuantizer` says, blocked along
    its last axis (TRANS: its first): values bf16-exact, the dequantized tile values * factor.
    SIGNED: x may be negative (dS; the magnitude is quantized, the sign kept, as rounding to
    nearest even is symmetric). z: log2 of x, read by Direct-P (MODE 3) only. SR: block
    elements round stochastically by `words` (uint32, x's layout: `_words`), on the magnitude,
    as the reference rounds |x| and gives it x's sign. HAD: x is first rotated along its
    blocks' axis by `had` in groups of HAD_N (`_rotate`), so the values are the rotated
    tile's. MODE 7: MS-EDEN (`_eden_rows`; INV_C its fl(1 / c)), the words its scales'."""
    if MODE == 0:
        return x, 1.0
    SIGNED_X: tl.constexpr = SIGNED or HAD  # a rotated tile holds both signs
    if HAD:
        x = _rotate(x, had, ROWS, COLS, HAD_N, TRANS)
    mag = x
    if SIGNED_X:
        mag = tl.abs(x)
    if MODE == 3:  # Direct-P: codes from z (LIFT: 2^-S, the stored-scale shift)
        if TRANS:
            values = tl.trans(_direct_p(tl.trans(z), COLS, ROWS, QBLOCK, RULE, E_LO, E_HI, EQ_LO,
                                        EQ_HI, E_UNIT, E_MAX, LOG2_ME, SQ_LO, SQ_HI, S_UNIT,
                                        S_MAX, LIFT))  # fmt: skip
        else:  # Direct-P's SCALE slot holds its affine map (`PQuantizer.direct`)
            values = _direct_p(z, ROWS, COLS, QBLOCK, RULE, E_LO, E_HI, EQ_LO, EQ_HI, E_UNIT,
                               E_MAX, LOG2_ME, SQ_LO, SQ_HI, S_UNIT, S_MAX, LIFT)  # fmt: skip
        factor = 1.0 / (E_MAX * LIFT)
    elif MODE == 4:  # one FP32 scale t = amax / M_e per tile, elements x / t
        a = mag * LIFT
        amax = tl.zeros_like(a) + tl.max(tl.max(a, 1), 0)
        t = tl.div_rn(amax, tl.zeros_like(a) + E_MAX)
        scaled = tl.where(t == 0.0, 0.0, tl.div_rn(a, tl.where(t == 0.0, 1.0, t)))
        values = _round(scaled, EQ_LO, EQ_HI, E_UNIT, E_MAX)
        factor = tl.max(tl.max(t, 1), 0) * (1.0 / LIFT)
    elif MODE == 5:  # bf16, saturating (first: the same value, see `_round`), to nearest even
        values = _bf16_grid(tl.minimum(mag * LIFT, E_MAX, propagate_nan=tl.PropagateNan.ALL))
        factor = 1.0 / LIFT
    elif MODE == 7:  # MS-EDEN on the signed (rotated) x; its magnitudes, the sign below
        if TRANS:
            values, t = _eden_rows(tl.trans(x * LIFT), tl.trans(words), COLS, ROWS, QBLOCK,
                                   EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX,
                                   INV_C)  # fmt: skip
            values = tl.trans(values)
        else:
            values, t = _eden_rows(x * LIFT, words, ROWS, COLS, QBLOCK, EQ_LO, EQ_HI, E_UNIT,
                                   E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, INV_C)  # fmt: skip
        factor = t * (1.0 / LIFT)
    elif TRANS:
        words_t = words
        if SR:
            words_t = tl.trans(words)
        mag_t = tl.trans(mag)
        if MODE == 6:  # two-level P: each row of P (along its blocks) scaled to M_e M_s
            r = _row_scales(mag_t, E_MAX * S_MAX)
            mag_t = mag_t * r[:, None]
        values, factor = _quantize_p(
            mag_t, words_t, COLS, ROWS, MODE, LIFT, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO,
            SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E, SR, SR_BITS,
        )  # fmt: skip
        if MODE == 6:  # q(r P) / r, each element, as the reference divides it
            values = tl.div_rn(values, r[:, None])
        values = tl.trans(values)
    else:
        if MODE == 6:
            r = _row_scales(mag, E_MAX * S_MAX)
            mag = mag * r[:, None]
        values, factor = _quantize_p(
            mag, words, ROWS, COLS, MODE, LIFT, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI,
            S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E, SR, SR_BITS,
        )  # fmt: skip
        if MODE == 6:
            values = tl.div_rn(values, r[:, None])
    if SIGNED_X:
        values = tl.where(x < 0.0, -values, values)
    return values, factor


@triton.jit
def _words(k0, k1, batch, head, offs_m, n0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           SR: tl.constexpr, KEYS_FIRST: tl.constexpr):  # fmt: skip
    """Stochastic rounding's words of a tile of P or dS (queries offs_m, keys from n0) from
    the stream keyed (k0, k1), held (queries, keys), or (keys, queries) with KEYS_FIRST (the
    dK/dV kernel's layout); 0 where the operand does not round stochastically."""
    words = 0
    if SR:
        words = tile_words(k0, k1, batch, head, offs_m, n0, BLOCK_M, BLOCK_N)
        if KEYS_FIRST:
            words = tl.trans(words)
    return words


# What an instrumented backward (TRACE) writes per (batch x head, query tile, key tile) for each
# of its in-register operands (P in dV, dS in dQ, dS in dK), in this order (`_trace_tile`): the
# operand's nonzeros, its quantized form's nonzeros, sum (x^ - x)^2, sum x^2, clipped elements,
# blocks with a nonzero and those whose scale under- or overflowed, NaNs of x^, and the sum of
# x over the elements flushed (P's lost probability mass; P is already normalized here).
BACKWARD_STATS = (
    "nonzero", "kept", "diff2", "norm2", "clipped", "blocks", "underflow", "overflow", "nan",
    "lost",
)  # fmt: skip


@triton.jit
def _trace_tile(
    x, x_used, x_q, z_q, stats_ptr, ROWS: tl.constexpr, COLS: tl.constexpr,
    SIGNED: tl.constexpr, MODE: tl.constexpr, LIFT: tl.constexpr, E_MAX: tl.constexpr,
    SQ_LO: tl.constexpr, SQ_HI: tl.constexpr, S_UNIT: tl.constexpr, S_MAX: tl.constexpr,
    E_LO: tl.constexpr, E_HI: tl.constexpr, QBLOCK: tl.constexpr, RULE: tl.constexpr,
    ARITH: tl.constexpr, TENSOR: tl.constexpr, EMAX_E: tl.constexpr, LOG2_ME: tl.constexpr,
    TRANS: tl.constexpr, UNDER: tl.constexpr, OVER: tl.constexpr,
):  # fmt: skip
    """Write one tile's `BACKWARD_STATS` to stats_ptr: x the operand (P or dS), x_used the
    dequantized x^ its product consumed, x_q (and z_q = log2 x_q, for Direct-P) what its
    quantizer (`_quantize_tile`) was given, whose clipped elements and block scales are
    recounted here as `fp4lab.recipes.tile_stats.block_counts` counts them."""
    flushed = (x_used == 0.0) & (x != 0.0)
    mag = x_q
    if SIGNED:
        mag = tl.abs(x_q)
    if MODE == 6:  # two-level P: its quantizer saw r P, each row of P scaled to M_e M_s
        if TRANS:
            mag = mag * _row_scales(tl.trans(mag), E_MAX * S_MAX)[None, :]
        else:
            mag = mag * _row_scales(mag, E_MAX * S_MAX)[:, None]
    table = _put(_stat_columns(x, x_used), tl.sum(tl.where(flushed, x, 0.0), 1), 9)
    counts = tl.zeros([1, 16], dtype=tl.float32)  # the quantizer's counts over its own rows
    if MODE == 4:  # one FP32 scale t = amax / M_e per tile: its ideal scale stays in range
        a = mag * LIFT
        top = tl.max(tl.max(a, 1), 0)
        amax = tl.zeros_like(a) + top
        t = tl.div_rn(amax, tl.zeros_like(a) + E_MAX)
        scaled = tl.where(t == 0.0, 0.0, tl.div_rn(a, tl.where(t == 0.0, 1.0, t)))
        table = _put(table, tl.sum((scaled > E_MAX).to(tl.float32), 1), 4)
        first = tl.arange(0, ROWS) == 0  # the tile's one block, counted once
        table = _put(table, tl.where(first, (top > 0.0).to(tl.float32), 0.0), 5)
    elif MODE == 5:  # a bf16 cast, saturating
        table = _put(table, tl.sum((mag * LIFT > E_MAX).to(tl.float32), 1), 4)
    elif TRANS:  # over the transposed tile: its rows are x's columns, a table of their own
        clipped, blocks, under, over = _p_counts(
            tl.trans(mag), tl.trans(z_q), COLS, ROWS, MODE, LIFT, E_MAX, SQ_LO, SQ_HI, S_UNIT,
            S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E, LOG2_ME, UNDER, OVER,
        )  # fmt: skip
        counts = _put_counts(tl.zeros([COLS, 16], dtype=tl.float32), clipped, blocks, under,
                             over)  # fmt: skip
    else:
        clipped, blocks, under, over = _p_counts(
            mag, z_q, ROWS, COLS, MODE, LIFT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI,
            QBLOCK, RULE, ARITH, TENSOR, EMAX_E, LOG2_ME, UNDER, OVER,
        )  # fmt: skip
        table = _put_counts(table, clipped, blocks, under, over)
    _store_stats(stats_ptr, table, 10, counts)


# -- the preprocess: D = rowsum(dO * O) -------------------------------------------------------
@triton.jit
def _bwd_preprocess(Out, DO, DOF, Delta, Sq, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                    TILE_SCOPE: tl.constexpr):
    """D of one query tile of one (batch, head): rowsum(dO * O) times dO's factor (its
    query tile's with TILE_SCOPE)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, V_DIM)
    rows = offs_m < Sq
    row0 = bh.to(tl.int64) * Sq
    ptrs = (row0 + offs_m[:, None]) * V_DIM + offs_dv[None, :]
    o = tl.load(Out + ptrs, mask=rows[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=rows[:, None], other=0.0).to(tl.float32)
    if TILE_SCOPE:
        f_do = tl.load(DOF + bh.to(tl.int64) * tl.cdiv(Sq, BLOCK_M) + start_m)
    else:
        f_do = tl.load(DOF + bh)
    delta = tl.sum(o * do, 1) * f_do
    tl.store(Delta + row0 + offs_m, delta, mask=rows)


# -- the dK/dV kernel --------------------------------------------------------------------------
# fmt: off
@triton.jit
def _dkdv_inner(
    dk, dv, fk, fv, k, v, q_base, qd_base, dov_base, dop_base, lse_base, delta_base, mref_base, n_k,
    key_tile, offs_n, cols, qk_scale, f_dov, f_dp, f_q, Sq, Sk, first, count,
    sr_dv0, sr_dv1, sr_dk0, sr_dk1, batch, head, dvs_base, dks_base, ms_base, qm_base,
    kf_j, vf_j, qf_base, dovf_base, dopf_base, qdf_base, had,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DS_FROM_DV: tl.constexpr,
    REPLAY: tl.constexpr, LEAK: tl.constexpr, SMOOTH_Q: tl.constexpr, MEAN_DK: tl.constexpr,
    TILE_SCOPE: tl.constexpr, HAD_N: tl.constexpr,
    DV_MODE: tl.constexpr, DV_LIFT: tl.constexpr, DV_EQ_LO: tl.constexpr, DV_EQ_HI: tl.constexpr,
    DV_E_UNIT: tl.constexpr, DV_E_MAX: tl.constexpr, DV_SQ_LO: tl.constexpr,
    DV_SQ_HI: tl.constexpr, DV_S_UNIT: tl.constexpr, DV_S_MAX: tl.constexpr,
    DV_E_LO: tl.constexpr, DV_E_HI: tl.constexpr, DV_QBLOCK: tl.constexpr, DV_RULE: tl.constexpr,
    DV_ARITH: tl.constexpr, DV_TENSOR: tl.constexpr, DV_EMAX_E: tl.constexpr,
    DV_LOG2_ME: tl.constexpr, DV_TRANS: tl.constexpr, DV_SPLIT: tl.constexpr,
    DV_SR: tl.constexpr, DV_SR_BITS: tl.constexpr,
    DV_HAD: tl.constexpr, DV_INV_C: tl.constexpr,
    DK_MODE: tl.constexpr, DK_LIFT: tl.constexpr, DK_EQ_LO: tl.constexpr, DK_EQ_HI: tl.constexpr,
    DK_E_UNIT: tl.constexpr, DK_E_MAX: tl.constexpr, DK_SQ_LO: tl.constexpr,
    DK_SQ_HI: tl.constexpr, DK_S_UNIT: tl.constexpr, DK_S_MAX: tl.constexpr,
    DK_E_LO: tl.constexpr, DK_E_HI: tl.constexpr, DK_QBLOCK: tl.constexpr, DK_RULE: tl.constexpr,
    DK_ARITH: tl.constexpr, DK_TENSOR: tl.constexpr, DK_EMAX_E: tl.constexpr,
    DK_LOG2_ME: tl.constexpr, DK_TRANS: tl.constexpr, DK_SPLIT: tl.constexpr,
    DK_SR: tl.constexpr, DK_SR_BITS: tl.constexpr,
    DK_HAD: tl.constexpr, DK_INV_C: tl.constexpr,
    TRACE: tl.constexpr, N_STATS: tl.constexpr, DV_UNDER: tl.constexpr, DV_OVER: tl.constexpr,
    DK_UNDER: tl.constexpr, DK_OVER: tl.constexpr, DV_IN_DOT: tl.constexpr,
    DK_IN_DOT: tl.constexpr,
):
    """`count` query tiles of one query head from query tile `first` against one key tile,
    tiles held (keys, queries). MASKED tiles may hold rows past Sq, keys past Sk or (causal)
    queries before a key; the others hold none, and skip the masks. REPLAY
    (backward=forward_exact): dV's P is the forward's own P^, rebuilt against the row
    reference the forward saved for this key tile (mref_base, n_k tiles a row), its diagonal
    blocks unquantized where the forward's leakage fix (LEAK) left them so, normalized by
    exp2(m_j - lse). DV_SR, DK_SR: P for dV and dS for dK round stochastically by the words of
    their streams (keys sr_dv*, sr_dk*) at each element's (batch, query head `head`, query,
    key) position. TRACE: each tile's `BACKWARD_STATS` of P (dV's) and dS (dK's) to dvs_base
    and dks_base (n_k key tiles a query tile, N_STATS each). SMOOTH_Q: the scores add
    smooth_q's mean scores (ms_base: Sk fp32 a query tile, log2 units); MEAN_DK: dK's Q^ is
    Q^ + M with M the query tile's mean (qm_base: HEAD_DIM fp32 a query tile), so dK adds
    the tile's rowsum(dS^T) M^T. TILE_SCOPE (tensor_scope=tile): the query side's factors
    are per query tile (qf_base, dovf_base, dopf_base, qdf_base: one fp32 a tile), each
    tile's taken with the key tile's kf_j (the scores' K) and vf_j (V's) in the per-head
    path's order; without it qk_scale, f_dov, f_dp and f_q are the head's, combined.
    DV_IN_DOT, DK_IN_DOT: where each tile's factor is the same (`_sums_in_dot`), dv and dk
    accumulate inside their dots, in units of that factor (fv, fk: the last tile's), which
    the caller applies once at the end."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, V_DIM)
    for t in range(0, count):
        start_m = tl.multiple_of((first + t) * BLOCK_M, BLOCK_M)
        s_t, f_dov_t, f_dp_t, f_q_t = qk_scale, f_dov, f_dp, f_q
        if TILE_SCOPE:  # this query tile's factors, in the forward's order
            s_t = qk_scale * tl.load(qf_base + first + t) * kf_j
            f_dov_t = tl.load(dovf_base + first + t)
            f_dp_t = vf_j * tl.load(dopf_base + first + t)
            f_q_t = tl.load(qdf_base + first + t)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qt_ptrs = q_base + offs_m[None, :] * HEAD_DIM + offs_d[:, None]
        dot_ptrs = dop_base + offs_m[None, :] * V_DIM + offs_dv[:, None]
        dov_ptrs = dov_base + offs_m[:, None] * V_DIM + offs_dv[None, :]
        qd_ptrs = qd_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            rows = offs_m < Sq
            qt = tl.load(qt_ptrs, mask=rows[None, :], other=0.0)  # (HEAD_DIM, BLOCK_M)
            lse = tl.load(lse_base + offs_m, mask=rows, other=0.0)
        else:
            qt = tl.load(qt_ptrs)
            lse = tl.load(lse_base + offs_m)
        # -- rebuild P^T from the forward's lse --
        st = tl.dot(k, qt) * s_t  # (BLOCK_N, BLOCK_M), log2 units
        if SMOOTH_Q:  # + the query tile mean's scores M_i K_j^T, one per key
            ms = tl.load(ms_base + (first + t) * Sk + offs_n, mask=cols, other=0.0)
            st = st + ms[:, None]
        zt = st - lse[None, :]
        if REPLAY:  # the row reference the forward's P of this tile took
            if MASKED:
                m_j = tl.load(mref_base + offs_m * n_k + key_tile, mask=rows, other=0.0)
            else:
                m_j = tl.load(mref_base + offs_m * n_k + key_tile)
            zf = st - m_j[None, :]
        if MASKED:
            keep = cols[:, None] & rows[None, :]
            if CAUSAL:
                keep = keep & (offs_m[None, :] >= offs_n[:, None])
            zt = tl.where(keep, zt, -float("inf"))
            if REPLAY:
                zf = tl.where(keep, zf, -float("inf"))
        pt = tl.exp2(zt)
        # -- dV += P^^T dO --
        words_dv = _words(sr_dv0, sr_dv1, batch, head, offs_m, key_tile * BLOCK_N, BLOCK_M,
                          BLOCK_N, DV_SR, True)  # fmt: skip
        if REPLAY:
            pf = tl.exp2(zf)
            p_hat, f_hat = _quantize_tile(
                pf, zf, words_dv, BLOCK_N, BLOCK_M, False, DV_MODE, DV_LIFT, DV_EQ_LO, DV_EQ_HI,
                DV_E_UNIT, DV_E_MAX, DV_SQ_LO, DV_SQ_HI, DV_S_UNIT, DV_S_MAX, DV_E_LO, DV_E_HI,
                DV_QBLOCK, DV_RULE, DV_ARITH, DV_TENSOR, DV_EMAX_E, DV_LOG2_ME, DV_TRANS, DV_SR,
                DV_SR_BITS, had, DV_HAD, HAD_N, DV_INV_C,
            )
            p_dv = p_hat * f_hat
            if LEAK > 0:
                diagonal = (offs_m[None, :] // LEAK) == (offs_n[:, None] // LEAK)
                p_dv = tl.where(diagonal, pf, p_dv)
            p_dv = p_dv * tl.exp2(m_j - lse)[None, :]
            if MASKED:  # rows that never saw this tile hold no reference
                p_dv = tl.where(keep, p_dv, 0.0)
            f_dv = 1.0
        else:
            p_dv, f_dv = _quantize_tile(
                pt, zt, words_dv, BLOCK_N, BLOCK_M, False, DV_MODE, DV_LIFT, DV_EQ_LO, DV_EQ_HI,
                DV_E_UNIT, DV_E_MAX, DV_SQ_LO, DV_SQ_HI, DV_S_UNIT, DV_S_MAX, DV_E_LO, DV_E_HI,
                DV_QBLOCK, DV_RULE, DV_ARITH, DV_TENSOR, DV_EMAX_E, DV_LOG2_ME, DV_TRANS, DV_SR,
                DV_SR_BITS, had, DV_HAD, HAD_N, DV_INV_C,
            )
        if MASKED:
            do_v = tl.load(dov_ptrs, mask=rows[:, None], other=0.0)  # (BLOCK_M, V_DIM)
            do_t = tl.load(dot_ptrs, mask=rows[None, :], other=0.0)  # (V_DIM, BLOCK_M)
            delta = tl.load(delta_base + offs_m, mask=rows, other=0.0)
        else:
            do_v = tl.load(dov_ptrs)
            do_t = tl.load(dot_ptrs)
            delta = tl.load(delta_base + offs_m)
        if DV_IN_DOT:
            dv = _dot_into(p_dv, do_v, dv, DV_SPLIT)
            fv = f_dv * f_dov_t
        else:
            dv += _dot(p_dv, do_v, DV_SPLIT) * (f_dv * f_dov_t)
        if TRACE:  # P as dV consumed it (the replay's P^ from the forward's own P)
            if REPLAY:
                p_q, z_q = pf, zf
            else:
                p_q, z_q = pt, zt
            _trace_tile(
                pt, p_dv * f_dv, p_q, z_q, dvs_base + (first + t) * n_k * N_STATS, BLOCK_N,
                BLOCK_M, False, DV_MODE, DV_LIFT, DV_E_MAX, DV_SQ_LO, DV_SQ_HI, DV_S_UNIT,
                DV_S_MAX, DV_E_LO, DV_E_HI, DV_QBLOCK, DV_RULE, DV_ARITH, DV_TENSOR, DV_EMAX_E,
                DV_LOG2_ME, DV_TRANS, DV_UNDER, DV_OVER,
            )
        # -- dS^T = P^T (dP^T - D) --
        dpt = tl.dot(v, do_t) * f_dp_t
        if DS_FROM_DV:  # the P dV consumed, as quantized
            dst = (dpt - delta[None, :]) * (p_dv * f_dv)
        else:
            dst = (dpt - delta[None, :]) * pt
        # -- dK += dS^^T Q --
        words_dk = _words(sr_dk0, sr_dk1, batch, head, offs_m, key_tile * BLOCK_N, BLOCK_M,
                          BLOCK_N, DK_SR, True)  # fmt: skip
        ds_k, f_k = _quantize_tile(
            dst, dst, words_dk, BLOCK_N, BLOCK_M, True, DK_MODE, DK_LIFT, DK_EQ_LO, DK_EQ_HI,
            DK_E_UNIT, DK_E_MAX, DK_SQ_LO, DK_SQ_HI, DK_S_UNIT, DK_S_MAX, DK_E_LO, DK_E_HI,
            DK_QBLOCK, DK_RULE, DK_ARITH, DK_TENSOR, DK_EMAX_E, DK_LOG2_ME, DK_TRANS, DK_SR,
            DK_SR_BITS, had, DK_HAD, HAD_N, DK_INV_C,
        )
        if MASKED:
            qd = tl.load(qd_ptrs, mask=rows[:, None], other=0.0)  # (BLOCK_M, HEAD_DIM)
        else:
            qd = tl.load(qd_ptrs)
        if DK_IN_DOT:
            dk = _dot_into(ds_k, qd, dk, DK_SPLIT)
            fk = f_k * f_q_t
        else:
            dk += _dot(ds_k, qd, DK_SPLIT) * (f_k * f_q_t)
        if MEAN_DK:  # dS^T (Q^ + M): M is one row for the whole query tile
            m_row = tl.load(qm_base + (first + t) * HEAD_DIM + offs_d)  # (HEAD_DIM,)
            dk += (tl.sum(ds_k, 1) * f_k)[:, None] * m_row[None, :]
        if TRACE:
            _trace_tile(
                dst, ds_k * f_k, dst, dst, dks_base + (first + t) * n_k * N_STATS, BLOCK_N,
                BLOCK_M, True, DK_MODE, DK_LIFT, DK_E_MAX, DK_SQ_LO, DK_SQ_HI, DK_S_UNIT,
                DK_S_MAX, DK_E_LO, DK_E_HI, DK_QBLOCK, DK_RULE, DK_ARITH, DK_TENSOR, DK_EMAX_E,
                DK_LOG2_ME, DK_TRANS, DK_UNDER, DK_OVER,
            )
    return dk, dv, fk, fv


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, QD, DOV, DOP, LSE, DELTA, MRef, DK, DV, QF, KF, DOVF, DOPF, VF, QDF, qk_scale,
    scale, H, G, Sq, Sk, SRKeys, sr_batch, DVStats, DKStats, MS, QM, Had,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DS_FROM_DV: tl.constexpr, REPLAY: tl.constexpr, LEAK: tl.constexpr,
    SMOOTH_Q: tl.constexpr, MEAN_DK: tl.constexpr, TILE_SCOPE: tl.constexpr, HAD_N: tl.constexpr,
    DV_MODE: tl.constexpr, DV_LIFT: tl.constexpr, DV_EQ_LO: tl.constexpr, DV_EQ_HI: tl.constexpr,
    DV_E_UNIT: tl.constexpr, DV_E_MAX: tl.constexpr, DV_SQ_LO: tl.constexpr,
    DV_SQ_HI: tl.constexpr, DV_S_UNIT: tl.constexpr, DV_S_MAX: tl.constexpr,
    DV_E_LO: tl.constexpr, DV_E_HI: tl.constexpr, DV_QBLOCK: tl.constexpr, DV_RULE: tl.constexpr,
    DV_ARITH: tl.constexpr, DV_TENSOR: tl.constexpr, DV_EMAX_E: tl.constexpr,
    DV_LOG2_ME: tl.constexpr, DV_TRANS: tl.constexpr, DV_SPLIT: tl.constexpr,
    DV_SR: tl.constexpr, DV_SR_BITS: tl.constexpr,
    DV_HAD: tl.constexpr, DV_INV_C: tl.constexpr,
    DK_MODE: tl.constexpr, DK_LIFT: tl.constexpr, DK_EQ_LO: tl.constexpr, DK_EQ_HI: tl.constexpr,
    DK_E_UNIT: tl.constexpr, DK_E_MAX: tl.constexpr, DK_SQ_LO: tl.constexpr,
    DK_SQ_HI: tl.constexpr, DK_S_UNIT: tl.constexpr, DK_S_MAX: tl.constexpr,
    DK_E_LO: tl.constexpr, DK_E_HI: tl.constexpr, DK_QBLOCK: tl.constexpr, DK_RULE: tl.constexpr,
    DK_ARITH: tl.constexpr, DK_TENSOR: tl.constexpr, DK_EMAX_E: tl.constexpr,
    DK_LOG2_ME: tl.constexpr, DK_TRANS: tl.constexpr, DK_SPLIT: tl.constexpr,
    DK_SR: tl.constexpr, DK_SR_BITS: tl.constexpr,
    DK_HAD: tl.constexpr, DK_INV_C: tl.constexpr,
    # instrumentation: per-tile statistics (`BACKWARD_STATS`), off by default
    TRACE: tl.constexpr = False, N_STATS: tl.constexpr = 1, DV_UNDER: tl.constexpr = 0.0,
    DV_OVER: tl.constexpr = 0.0, DK_UNDER: tl.constexpr = 0.0, DK_OVER: tl.constexpr = 0.0,
    # dv, dk summed inside their dots (`_sums_in_dot`)
    DV_IN_DOT: tl.constexpr = False, DK_IN_DOT: tl.constexpr = False,
):
    """dK and dV of one key tile of one (batch, KV head), summed over the G query heads of its
    group and the query tiles that see it. TRACE: DVStats and DKStats (B H, n_q, n_k,
    N_STATS) take each tile's statistics of P in dV and of dS in dK.

    Its query tiles split in three ranges: the causal band (queries before some of its keys)
    and every tile when the key tile is partial, masked; the whole tiles past the band,
    unmasked; a partial last query tile, masked. REPLAY: see `_dkdv_inner` (MRef: the row
    references, (B, H, Sq, n key tiles)); SMOOTH_Q, MEAN_DK too (MS: smooth_q's mean scores
    (B, H, n_q, Sk), QM: its tile means (B, H, n_q, HEAD_DIM)). TILE_SCOPE: the factors are
    per tile, (B, H, n_q) on the query side, (B, Hkv, n_k) on the key side (this key tile's
    read once)."""
    start_n = tl.program_id(0)
    bhk = tl.program_id(1)
    Hk = H // G
    b, hk = bhk // Hk, bhk % Hk
    sr_dv0, sr_dv1, sr_b = _stream_words(SRKeys, b, sr_batch, 0, 3)
    sr_dk0, sr_dk1, _ = _stream_words(SRKeys, b, sr_batch, 2, 3)
    n0 = start_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, V_DIM)
    cols = offs_n < Sk
    row0 = bhk.to(tl.int64) * Sk
    k = tl.load(K + (row0 + offs_n[:, None]) * HEAD_DIM + offs_d[None, :], mask=cols[:, None],
                other=0.0)  # (BLOCK_N, HEAD_DIM), the scores' K
    v = tl.load(V + (row0 + offs_n[:, None]) * V_DIM + offs_dv[None, :], mask=cols[:, None],
                other=0.0)  # (BLOCK_N, V_DIM), V in dP
    n_q = tl.cdiv(Sq, BLOCK_M)
    n_k = tl.cdiv(Sk, BLOCK_N)
    if TILE_SCOPE:  # this key tile's factors
        f_k = tl.load(KF + bhk.to(tl.int64) * n_k + start_n)
        f_v = tl.load(VF + bhk.to(tl.int64) * n_k + start_n)
    else:
        f_k, f_v = tl.load(KF + bhk), tl.load(VF + bhk)
    had = _hadamard_matrix(Had, HAD_N, DV_HAD or DK_HAD)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, V_DIM], dtype=tl.float32)
    fk = 1.0  # dk's and dv's units (DK_IN_DOT, DV_IN_DOT)
    fv = 1.0
    # the query tiles in three ranges: [lo, a) masked, [a, e) unmasked, [c, n_q) masked
    n_full = Sq // BLOCK_M
    lo = 0
    mid = 0
    if CAUSAL:  # the first tile with a row at or after n0; the first with all rows after the keys
        lo = n0 // BLOCK_M
        mid = tl.maximum(lo, tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M))
    if n0 + BLOCK_N > Sk:  # a partial key tile: every tile masked
        a = tl.maximum(n_q, lo)
        e = a
        c = a
    else:
        a = tl.minimum(mid, n_full)
        e = n_full
        c = tl.maximum(n_full, lo)
    for g in range(0, G):
        bh = b * H + hk * G + g
        q_row0 = bh.to(tl.int64) * Sq
        q_base, qd_base = Q + q_row0 * HEAD_DIM, QD + q_row0 * HEAD_DIM
        dov_base, dop_base = DOV + q_row0 * V_DIM, DOP + q_row0 * V_DIM
        if TILE_SCOPE:  # the query side's factors per query tile, in `_dkdv_inner`
            f_at = bh.to(tl.int64) * n_q
            s_h, f_dov, f_dp, f_q = qk_scale, f_v, f_v, f_v
        else:
            f_at = bh
            s_h = qk_scale * tl.load(QF + bh) * f_k  # the forward's order
            f_dov, f_dp, f_q = tl.load(DOVF + bh), f_v * tl.load(DOPF + bh), tl.load(QDF + bh)
        stats_at = (bh.to(tl.int64) * n_q * n_k + start_n) * N_STATS  # query tile 0
        for r in tl.static_range(3):
            if r == 0:
                first, count = lo, tl.maximum(a - lo, 0)
            elif r == 1:
                first, count = a, tl.maximum(e - a, 0)
            else:
                first, count = c, tl.maximum(n_q - c, 0)
            dk, dv, fk, fv = _dkdv_inner(
                dk, dv, fk, fv, k, v, q_base, qd_base, dov_base, dop_base, LSE + q_row0,
                DELTA + q_row0, MRef + q_row0 * n_k, n_k, start_n, offs_n, cols, s_h, f_dov,
                f_dp, f_q, Sq, Sk, first, count, sr_dv0, sr_dv1, sr_dk0, sr_dk1, sr_b, hk * G + g,
                DVStats + stats_at, DKStats + stats_at, MS + bh.to(tl.int64) * n_q * Sk,
                QM + bh.to(tl.int64) * n_q * HEAD_DIM, f_k, f_v, QF + f_at, DOVF + f_at,
                DOPF + f_at, QDF + f_at, had,
                r != 1, CAUSAL, HEAD_DIM, V_DIM, BLOCK_M, BLOCK_N, DS_FROM_DV, REPLAY, LEAK,
                SMOOTH_Q, MEAN_DK, TILE_SCOPE, HAD_N,
                DV_MODE, DV_LIFT, DV_EQ_LO, DV_EQ_HI, DV_E_UNIT, DV_E_MAX, DV_SQ_LO, DV_SQ_HI,
                DV_S_UNIT, DV_S_MAX, DV_E_LO, DV_E_HI, DV_QBLOCK, DV_RULE, DV_ARITH, DV_TENSOR,
                DV_EMAX_E, DV_LOG2_ME, DV_TRANS, DV_SPLIT, DV_SR, DV_SR_BITS,
                DV_HAD, DV_INV_C,
                DK_MODE, DK_LIFT, DK_EQ_LO, DK_EQ_HI, DK_E_UNIT, DK_E_MAX, DK_SQ_LO, DK_SQ_HI,
                DK_S_UNIT, DK_S_MAX, DK_E_LO, DK_E_HI, DK_QBLOCK, DK_RULE, DK_ARITH, DK_TENSOR,
                DK_EMAX_E, DK_LOG2_ME, DK_TRANS, DK_SPLIT, DK_SR, DK_SR_BITS,
                DK_HAD, DK_INV_C,
                TRACE, N_STATS, DV_UNDER, DV_OVER, DK_UNDER, DK_OVER, DV_IN_DOT, DK_IN_DOT,
            )
    if DV_IN_DOT:
        dv = dv * fv
    if DK_IN_DOT:
        dk = dk * fk
    dk = dk * scale
    tl.store(DK + (row0 + offs_n[:, None]) * HEAD_DIM + offs_d[None, :],
             dk.to(DK.dtype.element_ty), mask=cols[:, None])
    tl.store(DV + (row0 + offs_n[:, None]) * V_DIM + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=cols[:, None])


# -- the dQ kernel -----------------------------------------------------------------------------
@triton.jit
def _dq_inner(
    dq, fq, q, do_p, lse2, delta, k_base, v_base, kd_base, offs_m, rows, qk_scale, f_dp, Sk,
    first, count, sr_dv0, sr_dv1, sr_dq0, sr_dq1, batch, head, dqs_base, ms_base,
    kf_base, vf_base, kdf_base, had,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DS_FROM_DV: tl.constexpr,
    SMOOTH_Q: tl.constexpr, TILE_SCOPE: tl.constexpr, HAD_N: tl.constexpr,
    DV_MODE: tl.constexpr, DV_LIFT: tl.constexpr, DV_EQ_LO: tl.constexpr, DV_EQ_HI: tl.constexpr,
    DV_E_UNIT: tl.constexpr, DV_E_MAX: tl.constexpr, DV_SQ_LO: tl.constexpr,
    DV_SQ_HI: tl.constexpr, DV_S_UNIT: tl.constexpr, DV_S_MAX: tl.constexpr,
    DV_E_LO: tl.constexpr, DV_E_HI: tl.constexpr, DV_QBLOCK: tl.constexpr, DV_RULE: tl.constexpr,
    DV_ARITH: tl.constexpr, DV_TENSOR: tl.constexpr, DV_EMAX_E: tl.constexpr,
    DV_LOG2_ME: tl.constexpr, DV_TRANS: tl.constexpr, DV_SR: tl.constexpr,
    DV_SR_BITS: tl.constexpr,
    DV_HAD: tl.constexpr, DV_INV_C: tl.constexpr,
    DQ_MODE: tl.constexpr, DQ_LIFT: tl.constexpr, DQ_EQ_LO: tl.constexpr, DQ_EQ_HI: tl.constexpr,
    DQ_E_UNIT: tl.constexpr, DQ_E_MAX: tl.constexpr, DQ_SQ_LO: tl.constexpr,
    DQ_SQ_HI: tl.constexpr, DQ_S_UNIT: tl.constexpr, DQ_S_MAX: tl.constexpr,
    DQ_E_LO: tl.constexpr, DQ_E_HI: tl.constexpr, DQ_QBLOCK: tl.constexpr, DQ_RULE: tl.constexpr,
    DQ_ARITH: tl.constexpr, DQ_TENSOR: tl.constexpr, DQ_EMAX_E: tl.constexpr,
    DQ_LOG2_ME: tl.constexpr, DQ_TRANS: tl.constexpr, DQ_SPLIT: tl.constexpr,
    DQ_SR: tl.constexpr, DQ_SR_BITS: tl.constexpr,
    DQ_HAD: tl.constexpr, DQ_INV_C: tl.constexpr,
    TRACE: tl.constexpr, N_STATS: tl.constexpr, DQ_UNDER: tl.constexpr, DQ_OVER: tl.constexpr,
    DQ_IN_DOT: tl.constexpr,
):
    """`count` key tiles of one query tile from key tile `first`, tiles held (queries, keys);
    MASKED as in `_dkdv_inner`; DV_SR (P^ for dS = P^ (dP - D)), DQ_SR: stochastic rounding by
    the words of their streams (keys sr_dv*, sr_dq*), as in the dK/dV kernel. TRACE: each
    tile's `BACKWARD_STATS` of dS (dQ's) to dqs_base (N_STATS a key tile). SMOOTH_Q: the
    scores add smooth_q's mean scores of this query tile (ms_base, one fp32 per key).
    TILE_SCOPE: the key side's factors per key tile (kf_base, vf_base, kdf_base: one fp32 a
    tile), qk_scale and f_dp then this query tile's (the softmax scale times Q's factor, dO's
    factor), and each tile's dS^ K^ takes K^'s factor; without it they are the head's, and
    K^'s factor multiplies dQ once, at the end."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, V_DIM)
    for t in range(0, count):
        start_n = tl.multiple_of((first + t) * BLOCK_N, BLOCK_N)
        s_t, f_dp_t, f_kd_t = qk_scale, f_dp, f_dp
        if TILE_SCOPE:  # this key tile's factors, in the forward's order
            s_t = qk_scale * tl.load(kf_base + first + t)
            f_dp_t = tl.load(vf_base + first + t) * f_dp
            f_kd_t = tl.load(kdf_base + first + t)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt_ptrs = k_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None]
        vt_ptrs = v_base + offs_n[None, :] * V_DIM + offs_dv[:, None]
        kd_ptrs = kd_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        if MASKED:
            cols = offs_n < Sk
            kt = tl.load(kt_ptrs, mask=cols[None, :], other=0.0)  # (HEAD_DIM, BLOCK_N)
        else:
            kt = tl.load(kt_ptrs)
        # -- rebuild P from the forward's lse --
        z = tl.dot(q, kt) * s_t  # (BLOCK_M, BLOCK_N), log2 units
        if SMOOTH_Q:  # + the query tile mean's scores M_i K_j^T, one per key
            if MASKED:
                z = z + tl.load(ms_base + offs_n, mask=cols, other=0.0)[None, :]
            else:
                z = z + tl.load(ms_base + offs_n)[None, :]
        z = z - lse2[:, None]
        if MASKED:
            keep = cols[None, :] & rows[:, None]
            if CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            z = tl.where(keep, z, -float("inf"))
        p = tl.exp2(z)
        # -- dS = P (dP - D) --
        if MASKED:
            vt = tl.load(vt_ptrs, mask=cols[None, :], other=0.0)  # (V_DIM, BLOCK_N)
        else:
            vt = tl.load(vt_ptrs)
        dp = tl.dot(do_p, vt) * f_dp_t
        if DS_FROM_DV:  # the P dV consumes, as quantized (in the dK/dV kernel)
            words_dv = _words(sr_dv0, sr_dv1, batch, head, offs_m, start_n, BLOCK_M, BLOCK_N,
                              DV_SR, False)  # fmt: skip
            p_dv, f_dv = _quantize_tile(
                p, z, words_dv, BLOCK_M, BLOCK_N, False, DV_MODE, DV_LIFT, DV_EQ_LO, DV_EQ_HI,
                DV_E_UNIT, DV_E_MAX, DV_SQ_LO, DV_SQ_HI, DV_S_UNIT, DV_S_MAX, DV_E_LO, DV_E_HI,
                DV_QBLOCK, DV_RULE, DV_ARITH, DV_TENSOR, DV_EMAX_E, DV_LOG2_ME, DV_TRANS, DV_SR,
                DV_SR_BITS, had, DV_HAD, HAD_N, DV_INV_C,
            )
            ds = (dp - delta[:, None]) * (p_dv * f_dv)
        else:
            ds = (dp - delta[:, None]) * p
        # -- dQ += dS^ K --
        words_dq = _words(sr_dq0, sr_dq1, batch, head, offs_m, start_n, BLOCK_M, BLOCK_N,
                          DQ_SR, False)  # fmt: skip
        ds_q, f_q = _quantize_tile(
            ds, ds, words_dq, BLOCK_M, BLOCK_N, True, DQ_MODE, DQ_LIFT, DQ_EQ_LO, DQ_EQ_HI,
            DQ_E_UNIT, DQ_E_MAX, DQ_SQ_LO, DQ_SQ_HI, DQ_S_UNIT, DQ_S_MAX, DQ_E_LO, DQ_E_HI,
            DQ_QBLOCK, DQ_RULE, DQ_ARITH, DQ_TENSOR, DQ_EMAX_E, DQ_LOG2_ME, DQ_TRANS, DQ_SR,
            DQ_SR_BITS, had, DQ_HAD, HAD_N, DQ_INV_C,
        )
        if MASKED:
            kd = tl.load(kd_ptrs, mask=cols[:, None], other=0.0)  # (BLOCK_N, HEAD_DIM)
        else:
            kd = tl.load(kd_ptrs)
        if DQ_IN_DOT:  # (never with TILE_SCOPE)
            dq = _dot_into(ds_q, kd, dq, DQ_SPLIT)
            fq = f_q
        elif TILE_SCOPE:
            dq += _dot(ds_q, kd, DQ_SPLIT) * (f_q * f_kd_t)
        else:
            dq += _dot(ds_q, kd, DQ_SPLIT) * f_q
        if TRACE:
            _trace_tile(
                ds, ds_q * f_q, ds, ds, dqs_base + (first + t) * N_STATS, BLOCK_M, BLOCK_N,
                True, DQ_MODE, DQ_LIFT, DQ_E_MAX, DQ_SQ_LO, DQ_SQ_HI, DQ_S_UNIT, DQ_S_MAX,
                DQ_E_LO, DQ_E_HI, DQ_QBLOCK, DQ_RULE, DQ_ARITH, DQ_TENSOR, DQ_EMAX_E,
                DQ_LOG2_ME, DQ_TRANS, DQ_UNDER, DQ_OVER,
            )
    return dq, fq


@triton.jit
def _attn_bwd_dq(
    Q, K, V, KD, DOP, LSE, DELTA, DQ, QF, KF, DOPF, VF, KDF, qk_scale, scale, H, G, Sq, Sk,
    SRKeys, sr_batch, DQStats, MS, Had,
    HEAD_DIM: tl.constexpr, V_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, DS_FROM_DV: tl.constexpr, SMOOTH_Q: tl.constexpr,
    TILE_SCOPE: tl.constexpr, HAD_N: tl.constexpr,
    DV_MODE: tl.constexpr, DV_LIFT: tl.constexpr, DV_EQ_LO: tl.constexpr, DV_EQ_HI: tl.constexpr,
    DV_E_UNIT: tl.constexpr, DV_E_MAX: tl.constexpr, DV_SQ_LO: tl.constexpr,
    DV_SQ_HI: tl.constexpr, DV_S_UNIT: tl.constexpr, DV_S_MAX: tl.constexpr,
    DV_E_LO: tl.constexpr, DV_E_HI: tl.constexpr, DV_QBLOCK: tl.constexpr, DV_RULE: tl.constexpr,
    DV_ARITH: tl.constexpr, DV_TENSOR: tl.constexpr, DV_EMAX_E: tl.constexpr,
    DV_LOG2_ME: tl.constexpr, DV_TRANS: tl.constexpr, DV_SPLIT: tl.constexpr,
    DV_SR: tl.constexpr, DV_SR_BITS: tl.constexpr,
    DV_HAD: tl.constexpr, DV_INV_C: tl.constexpr,
    DQ_MODE: tl.constexpr, DQ_LIFT: tl.constexpr, DQ_EQ_LO: tl.constexpr, DQ_EQ_HI: tl.constexpr,
    DQ_E_UNIT: tl.constexpr, DQ_E_MAX: tl.constexpr, DQ_SQ_LO: tl.constexpr,
    DQ_SQ_HI: tl.constexpr, DQ_S_UNIT: tl.constexpr, DQ_S_MAX: tl.constexpr,
    DQ_E_LO: tl.constexpr, DQ_E_HI: tl.constexpr, DQ_QBLOCK: tl.constexpr, DQ_RULE: tl.constexpr,
    DQ_ARITH: tl.constexpr, DQ_TENSOR: tl.constexpr, DQ_EMAX_E: tl.constexpr,
    DQ_LOG2_ME: tl.constexpr, DQ_TRANS: tl.constexpr, DQ_SPLIT: tl.constexpr,
    DQ_SR: tl.constexpr, DQ_SR_BITS: tl.constexpr,
    DQ_HAD: tl.constexpr, DQ_INV_C: tl.constexpr,
    # instrumentation: per-tile statistics (`BACKWARD_STATS`), off by default
    TRACE: tl.constexpr = False, N_STATS: tl.constexpr = 1, DQ_UNDER: tl.constexpr = 0.0,
    DQ_OVER: tl.constexpr = 0.0,
    DQ_IN_DOT: tl.constexpr = False,  # dq summed inside its dots (`_sums_in_dot`)
):
    """dQ of one query tile of one (batch, head), over the key tiles it sees: first the whole
    tiles of visible keys (unmasked, as the forward splits them), then the rest (masked).
    TRACE: DQStats (B H, n_q, n_k, N_STATS) takes each tile's statistics of dS in dQ.
    SMOOTH_Q: the scores add smooth_q's mean scores MS (B, H, n_q, Sk). TILE_SCOPE: the
    factors per tile, (B, H, n_q) on the query side (this query tile's read once), (B, Hkv,
    n_k) on the key side (read per key tile in `_dq_inner`)."""
    start_m = _query_tile(CAUSAL)  # causal: the longest first, as the forward's
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    bhk = b * (H // G) + h // G
    sr_dv0, sr_dv1, sr_b = _stream_words(SRKeys, b, sr_batch, 0, 3)
    sr_dq0, sr_dq1, _ = _stream_words(SRKeys, b, sr_batch, 1, 3)
    m0 = start_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, V_DIM)
    rows = offs_m < Sq
    q_row0 = bh.to(tl.int64) * Sq
    k_row0 = bhk.to(tl.int64) * Sk
    q = tl.load(Q + (q_row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=rows[:, None],
                other=0.0)  # (BLOCK_M, HEAD_DIM), the scores' Q
    do_p = tl.load(DOP + (q_row0 + offs_m[:, None]) * V_DIM + offs_dv[None, :],
                   mask=rows[:, None], other=0.0)  # (BLOCK_M, V_DIM), dO in dP
    lse2 = tl.load(LSE + q_row0 + offs_m, mask=rows, other=0.0)
    delta = tl.load(DELTA + q_row0 + offs_m, mask=rows, other=0.0)
    if TILE_SCOPE:  # this query tile's factors; the key tiles' in `_dq_inner`
        f_at = bh.to(tl.int64) * tl.cdiv(Sq, BLOCK_M) + start_m
        s_scale = qk_scale * tl.load(QF + f_at)
        f_dp = tl.load(DOPF + f_at)
        kf_at = bhk.to(tl.int64) * tl.cdiv(Sk, BLOCK_N)
    else:
        s_scale = qk_scale * tl.load(QF + bh) * tl.load(KF + bhk)  # the forward's order
        f_dp = tl.load(VF + bhk) * tl.load(DOPF + bh)
        kf_at = bhk
    had = _hadamard_matrix(Had, HAD_N, DQ_HAD)  # (P^ for dS = P^ (dP - D) is never rotated)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    fq = 1.0  # dq's units (DQ_IN_DOT)
    dqs_base = DQStats + (bh.to(tl.int64) * tl.cdiv(Sq, BLOCK_M) + start_m) * tl.cdiv(
        Sk, BLOCK_N) * N_STATS
    n_tiles = tl.cdiv(Sk, BLOCK_N)
    n_free = Sk // BLOCK_N
    if CAUSAL:
        n_tiles = tl.minimum(n_tiles, tl.cdiv(tl.minimum(m0 + BLOCK_M, Sq), BLOCK_N))
        n_free = tl.minimum(n_free, (m0 + 1) // BLOCK_N)
    if m0 + BLOCK_M > Sq:
        n_free = 0
    for r in tl.static_range(2):
        if r == 0:
            first, count = 0, n_free
        else:
            first, count = n_free, tl.maximum(n_tiles - n_free, 0)
        dq, fq = _dq_inner(
            dq, fq, q, do_p, lse2, delta, K + k_row0 * HEAD_DIM, V + k_row0 * V_DIM,
            KD + k_row0 * HEAD_DIM, offs_m, rows, s_scale, f_dp, Sk, first, count,
            sr_dv0, sr_dv1, sr_dq0, sr_dq1, sr_b, h, dqs_base,
            MS + (bh.to(tl.int64) * tl.cdiv(Sq, BLOCK_M) + start_m) * Sk, KF + kf_at,
            VF + kf_at, KDF + kf_at, had,
            r == 1, CAUSAL, HEAD_DIM, V_DIM, BLOCK_M, BLOCK_N, DS_FROM_DV, SMOOTH_Q, TILE_SCOPE,
            HAD_N,
            DV_MODE, DV_LIFT, DV_EQ_LO, DV_EQ_HI, DV_E_UNIT, DV_E_MAX, DV_SQ_LO, DV_SQ_HI,
            DV_S_UNIT, DV_S_MAX, DV_E_LO, DV_E_HI, DV_QBLOCK, DV_RULE, DV_ARITH, DV_TENSOR,
            DV_EMAX_E, DV_LOG2_ME, DV_TRANS, DV_SR, DV_SR_BITS,
            DV_HAD, DV_INV_C,
            DQ_MODE, DQ_LIFT, DQ_EQ_LO, DQ_EQ_HI, DQ_E_UNIT, DQ_E_MAX, DQ_SQ_LO, DQ_SQ_HI,
            DQ_S_UNIT, DQ_S_MAX, DQ_E_LO, DQ_E_HI, DQ_QBLOCK, DQ_RULE, DQ_ARITH, DQ_TENSOR,
            DQ_EMAX_E, DQ_LOG2_ME, DQ_TRANS, DQ_SPLIT, DQ_SR, DQ_SR_BITS,
            DQ_HAD, DQ_INV_C,
            TRACE, N_STATS, DQ_UNDER, DQ_OVER, DQ_IN_DOT,
        )
    if DQ_IN_DOT:
        dq = dq * fq
    if TILE_SCOPE:  # K^'s factors went into each tile's product
        dq = dq * scale
    else:
        dq = dq * (scale * tl.load(KDF + bhk))
    tl.store(DQ + (q_row0 + offs_m[:, None]) * HEAD_DIM + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=rows[:, None])
# fmt: on


# -- the launcher ----------------------------------------------------------------------------------
def attention_backward(
    ops: BackwardOperands,
    dv_p: TileQuantizer,
    dq_ds: TileQuantizer,
    dk_ds: TileQuantizer,
    *,
    causal: bool,
    scale: float,
    block_m: int,
    block_n: int,
    ds_from_dv: bool = False,
    m_ref: torch.Tensor | None = None,
    leakage_block: int = 0,
    sr_keys: tuple = (None, None, None),
    trace: dict | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
):
    """(dQ, dK, dV) in the operands' store dtype, of the scores' q (B, H, Sq, D) and k
    (B, Hkv, Sk, D) and of V (B, Hkv, Sk, Dv). `dv_p`, `dq_ds`, `dk_ds`: the in-register
    quantizers of P in dV and of dS in dQ and dK; `ds_from_dv`: dS = P^ (dP - D) with the P^
    dV consumes (recipe.ds_p=dv_operand) instead of P. `m_ref` (backward=forward_exact): the
    row references the forward saved (`attention_forward`'s m_ref), from which dV replays the
    forward's own P^ with `dv_p` the forward's P quantizer; `leakage_block`: the forward's
    leakage fix, whose diagonal blocks of P that P^ leaves unquantized. `sr_keys`: the 64-bit
    stream keys (`fp4lab.formats.streams.stream_key`) of `dv_p`, `dq_ds` and `dk_ds`, each
    required where that quantizer rounds stochastically (dv_p's: the forward's P stream for
    the replay and the straight-through backward's P, as the simulation draws them); each a
    sequence of n keys for n samples stacked along the batch (`flash.sr_key_table`). `trace`:
    the buffers an instrumented backward (TRACE) fills (`trace_buffers`), or None: the
    kernels compiled without instrumentation, the very ones of an uninstrumented call.
    smooth_q's `ops.mean_scores` and `ops.q_dk_mean`, where given, are taken per query tile
    of `block_m`, the forward's."""
    q, qf = ops.q
    k, kf = ops.k
    B, H, Sq, D = q.shape
    Hk, Sk, Dv = k.shape[1], k.shape[2], ops.v_dp[0].shape[-1]
    check_tiles(block_m, block_n, dv_p=dv_p, dq_ds=dq_ds, dk_ds=dk_ds)
    n_q = triton.cdiv(Sq, block_m)
    for name, want in (("mean_scores", (B, H, n_q, Sk)), ("q_dk_mean", (B, H, n_q, D))):
        x = getattr(ops, name)
        if x is not None and (x.shape != want or x.dtype != torch.float32
                              or not x.is_contiguous()):  # fmt: skip
            raise ValueError(f"{name} must be a contiguous float32 {want} tensor, got "
                             f"{x.dtype} {tuple(x.shape)}")  # fmt: skip
    sr_table = sr_key_table(
        tuple(sr_keys), tuple(tq.pq.SR for tq in (dv_p, dq_ds, dk_ds)),
        ("sr_keys[0] (dv_p)", "sr_keys[1] (dq_ds)", "sr_keys[2] (dk_ds)"), B, q.device,
    )  # fmt: skip
    tile_scope = qf.dim() == 3  # tensor_scope=tile: factors per tile, (B, H|Hkv, n tiles)
    n_k = triton.cdiv(Sk, block_n)
    had, had_n = _rotation(q.device, trace, dv_p=dv_p, dq_ds=dq_ds, dk_ds=dk_ds)
    if ds_from_dv and dv_p.hadamard is not None:
        raise ValueError("ds_from_dv: dS = P^ (dP - D) would take the rotated P^ of dv_p")

    def f32(f: torch.Tensor, n: int) -> torch.Tensor:
        # a factor as the kernels read it: per head, or per tile (a per-head one repeated)
        if tile_scope and f.dim() == 2:
            f = f[..., None].expand(*f.shape, n)  # (B, H|Hkv, n tiles)
        if f.shape[2:] != ((n,) if tile_scope else ()):
            raise ValueError(f"factors: one per head or, with the scores' Q per tile, one per "
                             f"tile ({n} here) expected, got {tuple(f.shape)}")  # fmt: skip
        return f.to(torch.float32).contiguous()
    # -- D = rowsum(dO * O) --
    delta = torch.empty(B, H, Sq, dtype=torch.float32, device=q.device)
    do_d, do_df = ops.do_delta
    _bwd_preprocess[(triton.cdiv(Sq, block_m), B * H)](
        ops.o.contiguous(), do_d, f32(do_df, n_q), delta, Sq, V_DIM=Dv, BLOCK_M=block_m,
        TILE_SCOPE=tile_scope, enable_fp_fusion=FP_FUSION,
    )
    lse = ops.lse.contiguous()
    if had is not None:
        # a rotated backward starts at one stage: compiled for sm_90 (triton 3.6,
        # benchmarks/compile_offline.py, croissattn_eden at 128 x 128 and 8 warps) its dK/dV
        # kernel takes 459776 bytes of shared memory at two stages and 229376 at one, where
        # an H200 block has 232448; `launch_fitting` would get there only after a compile
        # (90 s here on 2 cores) that cannot load
        num_stages = 1
    common = dict(
        HEAD_DIM=D, V_DIM=Dv, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal,
        DS_FROM_DV=ds_from_dv, TILE_SCOPE=tile_scope, HAD_N=had_n, num_warps=num_warps,
        num_stages=num_stages, enable_fp_fusion=FP_FUSION,
    )  # fmt: skip
    spare = lse  # a pointer for the buffers an uninstrumented kernel never touches
    had = spare if had is None else had
    shift = spare if ops.mean_scores is None else ops.mean_scores
    smooth = dict(SMOOTH_Q=ops.mean_scores is not None)
    dkdv_trace, dq_trace = {}, {}
    if trace is not None:  # without it the kernels are compiled with TRACE's defaults
        on = dict(TRACE=True, N_STATS=len(BACKWARD_STATS))
        bounds = {name: _scale_bounds(tq.pq) for name, tq in (("DV", dv_p), ("DK", dk_ds),
                                                               ("DQ", dq_ds))}  # fmt: skip
        dkdv_trace = dict(**on, DV_UNDER=bounds["DV"][0], DV_OVER=bounds["DV"][1],
                          DK_UNDER=bounds["DK"][0], DK_OVER=bounds["DK"][1])  # fmt: skip
        dq_trace = dict(**on, DQ_UNDER=bounds["DQ"][0], DQ_OVER=bounds["DQ"][1])
    stats = trace or dict.fromkeys(("dv", "dk", "dq"), spare)
    # -- dK, dV --
    dk = torch.empty(B, Hk, Sk, D, dtype=q.dtype, device=q.device)
    dv = torch.empty(B, Hk, Sk, Dv, dtype=q.dtype, device=q.device)
    (do_v, f_dov), (do_p, f_dop), (v, f_v), (qd, f_qd) = ops.do_dv, ops.do_dp, ops.v_dp, ops.q_dk
    dv_constants = dv_p.constants("DV", keys_last=False)
    if m_ref is not None:  # the replayed P^, normalized, is no longer bf16-exact
        dv_constants["DV_SPLIT"] = True
    in_dot, dq_in_dot = _sums_in_dot(dv_p, dk_ds, dq_ds, grouped=H != Hk, tile_scope=tile_scope,
                                     replay=m_ref is not None, mean_dk=ops.q_dk_mean is not None)
    launch_fitting(
        _attn_bwd_dkdv, (triton.cdiv(Sk, block_n), B * Hk),
        (q, k, v, qd, do_v, do_p, lse, delta, lse if m_ref is None else m_ref, dk, dv,
         f32(qf, n_q), f32(kf, n_k), f32(f_dov, n_q), f32(f_dop, n_q), f32(f_v, n_k),
         f32(f_qd, n_q), scale * LOG2E, scale, H, H // Hk, Sq, Sk, *sr_table, stats["dv"],
         stats["dk"], shift,
         spare if ops.q_dk_mean is None else ops.q_dk_mean, had),
        dict(REPLAY=m_ref is not None, LEAK=leakage_block, MEAN_DK=ops.q_dk_mean is not None,
             **smooth, **common, **dv_constants,
             **dk_ds.constants("DK", keys_last=False), **dkdv_trace, **in_dot),
    )  # fmt: skip
    # -- dQ --
    dq = torch.empty(B, H, Sq, D, dtype=q.dtype, device=q.device)
    kd, f_kd = ops.k_dq
    launch_fitting(
        _attn_bwd_dq, (triton.cdiv(Sq, block_m), B * H),
        (q, k, v, kd, do_p, lse, delta, dq, f32(qf, n_q), f32(kf, n_k), f32(f_dop, n_q),
         f32(f_v, n_k), f32(f_kd, n_k), scale * LOG2E, scale, H, H // Hk, Sq, Sk, *sr_table,
         stats["dq"], shift, had),
        dict(**smooth, **common, **dv_p.constants("DV", keys_last=True),
             **dq_ds.constants("DQ", keys_last=True), **dq_trace, **dq_in_dot),
    )  # fmt: skip
    return dq, dk, dv


def _sums_in_dot(dv_p: TileQuantizer, dk_ds: TileQuantizer, dq_ds: TileQuantizer, *,
                 grouped: bool, tile_scope: bool, replay: bool, mean_dk: bool):
    """(the dK/dV kernel's, the dQ kernel's) IN_DOT constants: which of dV, dK and dQ sum
    inside their dots, in units of a tile factor that is the same for every tile
    (`PQuantizer.constant_factor`: the forward's ACC_DOT), applied once at the end. Not with
    per-tile factors (`tile_scope`), nor dV and dK over a GQA group (`grouped`: each query
    head brings its own factors into the one key tile's sums), nor dK with smooth_q's mean
    term (`mean_dk`, added beside the dot). The replayed P^ (`replay`) carries its factors in
    its values, so dV's factor is dO's alone. Rounding order aside, the same sums;
    fa4fp4_causal's dK/dV kernel at 64 x 64 and 4 warps spilled 126 registers with a product
    tile beside each accumulator, 20 without at 2 stages and 26 at 3, and its loop body went
    from 1580 instructions to 1170 (sm_90, triton 3.6, `benchmarks/compile_offline.py`;
    benchmarks/RESULTS.md, session 21)."""
    per_head = not grouped and not tile_scope
    return (
        dict(DV_IN_DOT=per_head and (replay or dv_p.pq.constant_factor),
             DK_IN_DOT=per_head and not mean_dk and dk_ds.pq.constant_factor),
        dict(DQ_IN_DOT=not tile_scope and dq_ds.pq.constant_factor),
    )  # fmt: skip


def _rotation(device, trace, **quantizers: TileQuantizer):
    """(matrix, size): the fp32 Hadamard matrix the in-register quantizers that rotate share
    (`fp4lab.formats.hadamard_matrix`, signs from its seed), or (None, 128) where none does;
    ValueError where two rotate by different matrices or a trace is asked of them."""
    rotations = {tq.hadamard for tq in quantizers.values() if tq.hadamard is not None}
    if not rotations:
        return None, 128
    transformed = [f for f, tq in quantizers.items() if tq.hadamard or tq.pq.MODE == _MODE_EDEN]
    if len(rotations) > 1:
        raise ValueError(
            f"{', '.join(transformed)}: the Triton backward rotates its in-register operands by "
            f"one Hadamard matrix, got (size, seed) {sorted(rotations)}"
        )
    if trace is not None:
        raise ValueError(f"trace: the instrumented backward does not count the rotated "
                         f"operands {', '.join(transformed)}")  # fmt: skip
    (n, seed), = rotations
    return hadamard_matrix(n, seed, torch.float32, device).contiguous(), n


def trace_buffers(B, H, Sq, Sk, block_m, block_n, device) -> dict:
    """An instrumented backward's outputs: for "dv" (P), "dk" and "dq" (dS) each an fp32
    (B, H, n_q, n_k, len(BACKWARD_STATS)) tensor of per-tile statistics (zeros where a tile
    is not visited)."""
    shape = (B, H, triton.cdiv(Sq, block_m), triton.cdiv(Sk, block_n), len(BACKWARD_STATS))
    return {name: torch.zeros(shape, dtype=torch.float32, device=device) for name in
            ("dv", "dk", "dq")}  # fmt: skip


def check_tiles(block_m: int, block_n: int, **quantizers: TileQuantizer) -> None:
    """Blocks along the keys must tile block_n, along the queries block_m; so must a Hadamard
    transform's groups (MS-EDEN's 128), which rotate each tile along that axis."""
    for field, tq in quantizers.items():
        size, name = (block_n, "block_n") if tq.along_keys else (block_m, "block_m")
        if tq.hadamard is not None and size % tq.hadamard[0]:
            raise ValueError(
                f"{name}={size} is not a multiple of {tq.hadamard[0]}, the Hadamard size of "
                f"operand {field!r} along the {'keys' if tq.along_keys else 'queries'}: the "
                "kernel rotates each tile in whole groups along its blocks' axis"
            )
        if tq.pq.MODE not in (2, 3, 6, _MODE_EDEN):
            continue
        if size % tq.pq.BLOCK:
            raise ValueError(
                f"{name}={size} is not a multiple of {tq.pq.BLOCK}, the block size of operand "
                f"{field!r} along the {'keys' if tq.along_keys else 'queries'}: its blocks "
                "cannot tile it"
            )
