"""Attention recipes: which format each operand of attention's six products uses, and how.

An `AttentionRecipe` names the format of each of the twelve operands (`fp4lab.recipes.operands`):
a block format (`QuantSpec`), a number format (`FloatFormat`: an element-wise cast with no
scale, as a kernel casts P to E4M3) or None (kept in the working precision); plus the
algorithm variants that published low-precision attention kernels add around them (K
smoothing, incoherent processing, two-level P scaling, Direct-P, softmax row correction, how
the backward rebuilds P, where D = rowsum(dO * O) comes from). Both execution paths, the
simulation (`fp4lab.analysis`) and the kernels (`fp4lab.kernels`), read the same recipe.

A recipe is a frozen dataclass literal; the published ones are in `fp4lab.recipes.presets`,
each citing the released code it follows. Every preset, and every recipe a user registers
with `fp4lab.formats.register`, is found by name wherever a recipe is accepted.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass

from fp4lab.formats import (
    FP4_E2M1,
    FloatFormat,
    QuantSpec,
    get,
    parse_enum,
)
from fp4lab.recipes.operands import OPERAND_FIELDS, Product, operand

__all__ = [
    "PQuant",
    "RowReference",
    "RowSum",
    "KVOrder",
    "LeakageParts",
    "SmoothK",
    "TensorScope",
    "BackwardMode",
    "BackwardP",
    "BackwardV",
    "DsP",
    "DeltaSource",
    "AttentionRecipe",
    "OperandSpec",
    "resolve_recipe",
]

OperandSpec = QuantSpec | FloatFormat | None
DEFAULT_TILE = 128  # query and key tile of a recipe that names none
_BACKWARD_FIELDS = tuple(f for p in Product if p.backward for f in p.fields)


class PQuant(enum.Enum):
    """How the forward turns a probability tile P = exp(S - m) into the P^ that P V consumes
    (m is the row reference, `RowReference`)."""

    SPEC = "spec"
    """P^ = q(c P) / c: the recipe's `p` format along the keys after multiplying by the lift
    c = `p_lift` (FlashAttention-3 stores 2^8 P in E4M3, SageAttention3 448 * 6 P in NVFP4)."""

    ROW_SCALED = "row_scaled"
    """Two-level P (SageAttention3 paper, arXiv 2505.11594, Sec. 3.2; FastVideo's Attn-QAT
    kernel with ``two_level_quant_P``): each row of the tile is scaled by
    r_i = (M_e * M_s) / max_j P_ij, so that its maximum maps to the largest value the `p`
    format represents (448 * 6 for E4M3-scaled E2M1), quantized by `p`, and divided back:
    P^ = q(r P) / r, with r_i in float32 (not rounded)."""

    DIRECT = "direct"
    """Direct-P ("Hardware-Aware FP4 FlashAttention-4", MrHuff/fp4-fa4,
    `tk_fa4/fp4_fa4_fwd/hao_direct_fp4pv_softmax_reader.inc`,
    `hao_direct_transform_pack_mxfp4_quarter_log2`): for each block B of n keys of a row (n
    = the `p` format's block, E2M1 elements), the block exponent e_B is chosen from the
    block's largest P by the `p` format's alpha scale rule (ALPHA_CEIL: ceil(log2 max P),
    fp4-fa4's select 4; ALPHA_HALF: floor(log2 max P + 1 - log2 1.5), its select 1), clamped
    to [`p_min_exponent`, 127]; x = (z - m) log2(e) - e_B + log2(6) and the code is
    q = E2M1(2^x), or E2M1(max(0, A x + B)) (`direct_p_affine`, on the 32-key groups of each
    key tile that `direct_p_affine_groups` selects). The represented probability is
    P^ = 2^e_B q / 6."""


class RowReference(enum.Enum):
    """What the forward's P = exp(S - m) takes as its row reference m."""

    RUNNING_MAX = "running_max"
    """m = the running maximum of the row's scores over the key tiles visited so far, the
    current tile included (FlashAttention-2; FlashAttention-3 `hopper/softmax.h`;
    SageAttention3 `softmax_fused.h`): P <= 1."""

    LAZY_MAX = "lazy_max"
    """The running maximum updated lazily, as FlashAttention-4 and fp4-fa4's FP8 P/V route do
    (`hao_direct_softmax_reader.inc`: ``keep_old_max = correction_log2 >= -8``): when a tile
    raises the row's maximum by at most `lazy_rescale_log2` powers of two, the old maximum
    stays, so P can reach 2^lazy_rescale_log2."""

    ZERO = "zero"
    """m = 0: the shiftless softmax of fp4-fa4's Direct-P (`HAO_DIRECT_MX_SHIFTLESS_SOFTMAX`):
    P = exp(S) in absolute terms, each block's power-of-two scale carrying its magnitude."""

    ANCHOR = "anchor"
    """m = the maximum of the row's scores over its first `anchor_keys` keys (the first
    quarter of key tile 0, after the masks) plus `anchor_margin` * scale, fixed for every
    tile (fp4-fa4's `HAO_FP4PV_MX_GLOBAL_ANCHOR32`: ``row_max = quarter_max + BIAS`` in raw
    score units, BIAS = MARGIN_LOG2 * ln 2)."""


class RowSum(enum.Enum):
    """What the softmax denominator l accumulates."""

    UNQUANTIZED_P = "unquantized_p"
    """l = sum_j P_ij (FlashAttention, Attn-QAT): the output rows' weights P^ / l need not
    sum to one once P is quantized."""

    QUANTIZED_P = "quantized_p"
    """l = sum_j P^_ij, the very values P V consumes (softmax row correction; Direct-P's
    represented denominator): every output row is a convex combination of the rows of V^."""


class KVOrder(enum.Enum):
    """The order in which the forward visits the key/value tiles of a query tile."""

    FORWARD = "forward"
    """First to last (FlashAttention-2; fp4-fa4's forward; Model Optimizer's Triton kernel)."""

    REVERSE = "reverse"
    """Last to first (FlashAttention-3 `hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp`:
    ``n_block = n_block_max - 1 ... --n_block``; SageAttention3 `mainloop_tma_ws.h`). Under
    a causal mask the diagonal tile comes first, and an attention sink at key 0 last."""


class LeakageParts(enum.Enum):
    """Which of P and V the future-leakage fix (`AttentionRecipe.leakage_fix`) leaves
    unquantized on the diagonal blocks (each query with the keys of its own block of V along
    the sequence)."""

    P_AND_V = "p_and_v"
    """Both (MatX's fix, "using unquantized P and V when multiplying the i-th tile of P with
    the i-th block of V")."""

    P = "p"
    """P alone: the diagonal blocks' unquantized P times V^. V's block scale still spans later
    tokens, so the leak stays; what changes is P on each query's most recent keys (a
    diagnostic half of the fix, not a published method)."""

    V = "v"
    """V alone: the diagonal blocks' P^ times the unquantized V, which removes the leak (no
    later token sets a scale an earlier output reads) and keeps P quantized (a diagnostic
    half of the fix, not a published method)."""


class SmoothK(enum.Enum):
    """Subtracting a mean from K before quantizing it (softmax-invariant: every score of a
    row shifts by the same q_i . mean)."""

    NONE = "none"
    """K as given."""

    PER_HEAD = "per_head"
    """K minus its mean over the sequence, per batch and KV head (SageAttention,
    arXiv 2410.02367, Sec. 4.2; `sageattn3/api.py`, ``k -= k.mean(dim=-2, keepdim=True)``)."""

    GLOBAL = "global"
    """K minus one head_dim vector, its mean over batch, heads and sequence (FastVideo's
    Attn-QAT kernel, ``k.mean(dim=(0, 1, 2), keepdim=True)``)."""


class TensorScope(enum.Enum):
    """What a whole-tensor operand's (Q, K, V, dO) tensor scale is taken over, for formats
    with one (`QuantSpec.tensor_scale`, or ``block=None``). P and dS always take theirs per
    tile."""

    TENSOR = "tensor"
    """The whole tensor passed in, all batches and heads."""

    HEAD = "head"
    """Each (batch, head): FlashAttention-3's descales are (batch, kv-head)
    (`hopper/flash_api.cpp`), fp4-fa4's Q/K global scales (batch, head)."""

    TILE = "tile"
    """Each tile of block_m (query side) or block_n (key side) rows of one (batch, head):
    FastVideo's Attn-QAT kernel quantizes Q, K, V in tiles of 32 tokens with
    ``use_global_sf_QKV``."""


class BackwardMode(enum.Enum):
    """How the backward's operands are formed."""

    FLASH = "flash"
    """A FlashAttention-2 backward whose eight operands are quantized by the recipe's
    backward fields (`dv_p`, `dv_do`, `dp_do`, `dp_v`, `dq_ds`, `dq_k`, `dk_ds`, `dk_q`;
    None keeps one in the working precision), each along its product's reduction axis,
    starting again from the unquantized Q, K, V (or the forward's V^, `backward_v`), dO and
    the rebuilt P."""

    STRAIGHT_THROUGH = "straight_through"
    """Attn-QAT's backward (arXiv 2603.00040; FastVideo `triton_kernels/attn_qat_train.py`),
    straight through the forward's quantizers: the forward's Q^, K^, V^ are the operands of
    dP = dO V^^T, dQ = dS K^, dK = dS^T Q^, and dV = P^^T dO takes the forward's P quantizer
    applied to the rebuilt (normalized) P, while the softmax's gradient treats P as
    unquantized, dS = P * (dP - D). dO and dS are quantized by `dv_do`, `dp_do`, `dq_ds`,
    `dk_ds` (Attn-QAT: dS in bf16); `dv_p`, `dp_v`, `dq_k`, `dk_q` must be None."""

    FORWARD_EXACT = "forward_exact"
    """The exact gradient of the forward as it ran, straight through its quantizers: dV from
    the forward's own P^ tiles (replayed with the row references it used, normalized by its
    log-sum-exp), dS = P * (dP - D) with the rebuilt P, D = rowsum(dO * O) from the
    returned output, dP, dQ, dK on the forward's V^, K^, Q^, nothing quantized. The
    reference `gradient_bias(..., reference="forward")` measures a backward against; every
    backward field must be None."""


class BackwardP(enum.Enum):
    """Which scores the backward rebuilds P = exp(S - lse) from (lse = the forward's row
    log-sum-exp, m + log l)."""

    QUANTIZED_QK = "quantized_qk"
    """S from the forward's quantized Q^, K^ (and its smoothing), so P is the forward's P
    (Attn-QAT; fp4-fa4 rebuilds it from the saved NVFP4 Q/K bytes, scales and lse)."""

    UNQUANTIZED_QK = "unquantized_qk"
    """S from the unquantized Q, K, as a stock high-precision FlashAttention backward run
    after a quantized forward does (the drop-in baseline): P no longer matches lse."""


class DsP(enum.Enum):
    """Which P the backward's dS = P * (dP - D) multiplies by."""

    UNQUANTIZED = "unquantized"
    """The rebuilt P in the working precision (FlashAttention-2; Attn-QAT)."""

    DV_OPERAND = "dv_operand"
    """The P that dV = P^T dO consumes, as quantized (fp4-fa4's v509 backward:
    ``(dp + dstat) * P_e4m3``, "preserve ... exact rounded-E4M3 compact P words")."""


class BackwardV(enum.Enum):
    """Which V the backward's dP = dO V^T quantizes (with `dp_v`)."""

    INPUT = "input"
    """The unquantized V."""

    FORWARD = "forward"
    """The forward's quantized V^ (fp4-fa4's MXFP4 P/V route: "a separate represented E4M3
    V view", E4M3(4 V^) of the decoded MXFP4 V)."""


class DeltaSource(enum.Enum):
    """Where the backward's D_i = rowsum(dO_i * O_i) (FlashAttention-2, Alg. 2, line 4)
    takes dO and O from."""

    OUTPUT = "output"
    """The unquantized dO and the output the forward returned (in the inputs' dtype)."""

    UNQUANTIZED_P_OUTPUT = "unquantized_p_output"
    """O' = (sum_j P_ij V^_j) / (sum_j P_ij), a second output from the unquantized P and the
    quantized V, stored in the inputs' dtype (Attn-QAT, FastVideo ``use_high_prec_o``).
    Then D_i = sum_j A_ij dP_ij with A = softmax(S) and dP = dO V^^T, the identity
    FlashAttention's D stands for, so every row of dS sums to zero; D from the quantized
    output breaks it."""

    QUANTIZED_DO = "quantized_do"
    """dO^ as dP = dO V^T consumes it (the `dp_do` operand) times the returned output
    (fp4-fa4's v509: D from the decoded E5M2 dO bytes; "deriving dPsum from the
    pre-quantized BF16 fragment breaks softmax centering")."""


@dataclass(frozen=True, kw_only=True)
class AttentionRecipe:
    """Which format each operand of attention's six products uses, and the algorithm variant.

    Operand fields (see `fp4lab.recipes.operands`) take a `QuantSpec`, a `FloatFormat`, a
    registered name of either, or None (no quantization); names are resolved through the
    registry when the recipe is built.

    Attributes:
        name: registry name.
        q, k: S = Q K^T operands (blocked along head_dim).
        p, v: O = P V operands (P along keys, V along the key sequence).
        dv_p, dv_do: dV = P^T dO operands (along the queries).
        dp_do, dp_v: dP = dO V^T operands (along head_dim).
        dq_ds, dq_k: dQ = dS K operands (along the keys).
        dk_ds, dk_q: dK = dS^T Q operands (along the queries).
        p_quant: how the forward quantizes P (`PQuant`).
        p_lift: the constant P is multiplied by before `p` quantizes it (with `PQuant.SPEC`),
            divided out afterwards (exact for a power of two; otherwise the float32 multiply
            and divide round, as the kernel's do).
        dv_p_lift: the same for the backward's P before `dv_p`.
        ds_lift: the same for dS before `dq_ds` / `dk_ds`.
        block_axes: operands whose 1-D blocks run along another axis of their tensor than
            their product's reduction axis, as (field, axis) pairs (Attn-QAT fake-quantizes V
            along head_dim: (("v", -1),)).
        row_reference: what P = exp(S - m) takes as m (`RowReference`).
        lazy_rescale_log2: `RowReference.LAZY_MAX`'s threshold, in powers of two.
        anchor_keys, anchor_margin: `RowReference.ANCHOR`'s keys and margin (in units of the
            unscaled score q . k).
        direct_p_affine: (A, B) of Direct-P's affine code map, or None for exact exp2.
        direct_p_affine_groups: bit q set: the q-th group of 32 keys of every key tile uses
            the affine map, the others exact exp2 (None: all groups).
        p_min_exponent: the smallest exponent a Direct-P block scale takes (fp4-fa4 stores P
            scales STORED_SCALE_SHIFT steps low: SHIFT + 1 - 127), or None for E8M0's.
        p_scale_shift: Direct-P's stored-scale shift S (fp4-fa4's
            ``HAO_DIRECT_MX_STORED_SCALE_SHIFT_LOG2``): each block scale is stored S exponent
            steps low, so P V and the row sum run on P^ 2^-S, O = (P^ 2^-S V^) / (P^ 2^-S 1)
            is P^'s in exact arithmetic, and the saved log-sum-exp adds S log 2 back. It moves
            the range those sums overflow at by S powers of two. 0: none. Needs
            p_quant=direct and p_min_exponent >= S - 126 (the released working floor S + 1
            keeps every shifted scale a normal power of two).
        row_sum: what the softmax denominator accumulates (`RowSum`).
        kv_order: the order the forward visits key/value tiles in (`KVOrder`).
        smooth_k: a mean subtracted from K before quantizing (`SmoothK`).
        smooth_q: split Q into its mean over each query tile (the tile's sum over block_m,
            padding rows counting as zeros, as SageAttention3's ``triton_group_mean``) and
            the rest; S = Q~ K^T with Q~ = Q - mean quantized, plus mean * K^T added in the
            working precision (SageAttention2, arXiv 2411.10958, Sec. 3.2).
        incoherent_processing: multiply Q and K by diag(signs) H / sqrt(d) along head_dim
            before quantizing (FlashAttention-3 paper, arXiv 2407.08608, Sec. 3.3); it
            cancels in Q K^T because the matrix is orthogonal. Needs a power-of-two head_dim.
        incoherent_seed: seed of its random signs.
        tensor_scope: what a whole-tensor operand's tensor scale is taken over (`TensorScope`).
        leakage_fix: under a causal mask, compute the products of P's diagonal blocks with
            V's blocks from unquantized P and V (the blocks of V along the sequence), so
            that no later token moves an earlier output through a shared block scale
            (MatX, "Future leakage in block-quantized attention", 2026).
        leakage_fix_parts: which of P and V the fix leaves unquantized there
            (`LeakageParts`; both by default, as MatX's fix); another value needs
            `leakage_fix`.
        backward: how the backward's operands are formed (`BackwardMode`).
        backward_p: which scores the backward rebuilds P from (`BackwardP`).
        backward_v: which V the backward's dP quantizes (`BackwardV`).
        ds_p: which P dS = P * (dP - D) multiplies by (`DsP`).
        delta: where D = rowsum(dO * O) takes dO and O from (`DeltaSource`).
        block_m, block_n: the kernel's query and key tiles, used when a call gives none
            (None: 128).
        causal: the mask the recipe was made for: True (causal), False (non-causal) or None
            (either).
        source: the released code (or paper) the recipe follows, in a line.
        doc: the recipe's description, sources and assumptions (presets fill it from their
            docstrings).
    """

    name: str
    q: OperandSpec = None
    k: OperandSpec = None
    p: OperandSpec = None
    v: OperandSpec = None
    dv_p: OperandSpec = None
    dv_do: OperandSpec = None
    dp_do: OperandSpec = None
    dp_v: OperandSpec = None
    dq_ds: OperandSpec = None
    dq_k: OperandSpec = None
    dk_ds: OperandSpec = None
    dk_q: OperandSpec = None
    p_quant: PQuant = PQuant.SPEC
    p_lift: float = 1.0
    dv_p_lift: float = 1.0
    ds_lift: float = 1.0
    block_axes: tuple[tuple[str, int], ...] = ()
    row_reference: RowReference = RowReference.RUNNING_MAX
    lazy_rescale_log2: float = 8.0
    anchor_keys: int = 32
    anchor_margin: float = 0.0
    direct_p_affine: tuple[float, float] | None = None
    direct_p_affine_groups: int | None = None
    p_min_exponent: int | None = None
    p_scale_shift: int = 0
    row_sum: RowSum = RowSum.UNQUANTIZED_P
    kv_order: KVOrder = KVOrder.FORWARD
    smooth_k: SmoothK = SmoothK.NONE
    smooth_q: bool = False
    incoherent_processing: bool = False
    incoherent_seed: int = 0
    tensor_scope: TensorScope = TensorScope.TENSOR
    leakage_fix: bool = False
    leakage_fix_parts: LeakageParts = LeakageParts.P_AND_V
    backward: BackwardMode = BackwardMode.FLASH
    backward_p: BackwardP = BackwardP.QUANTIZED_QK
    backward_v: BackwardV = BackwardV.INPUT
    ds_p: DsP = DsP.UNQUANTIZED
    delta: DeltaSource = DeltaSource.OUTPUT
    block_m: int | None = None
    block_n: int | None = None
    causal: bool | None = None
    source: str = ""
    doc: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for field in OPERAND_FIELDS:
            object.__setattr__(self, field, _resolve_operand(getattr(self, field), field))
        for field, kind in _ENUM_FIELDS.items():
            object.__setattr__(self, field, parse_enum(kind, getattr(self, field), field))
        for field in ("p_lift", "dv_p_lift", "ds_lift"):
            _check_positive(getattr(self, field), field)
        object.__setattr__(self, "block_axes", _check_block_axes(self.block_axes))
        self._check_numbers()
        self._check_p_quant()
        self._check_backward()
        self._check_leakage_fix()

    def _check_numbers(self) -> None:
        for field in ("block_m", "block_n"):
            _check_int(getattr(self, field), field, low=1, optional=True)
        _check_int(self.anchor_keys, "anchor_keys", low=1)
        _check_int(self.direct_p_affine_groups, "direct_p_affine_groups", low=0, optional=True)
        _check_int(self.p_min_exponent, "p_min_exponent", low=-127, optional=True)
        _check_int(self.p_scale_shift, "p_scale_shift", low=0)
        if self.p_scale_shift > 127:
            raise ValueError(f"p_scale_shift must be at most 127, got {self.p_scale_shift}")
        for field in ("lazy_rescale_log2", "anchor_margin"):
            value = getattr(self, field)
            if (
                not isinstance(value, (int, float))
                or isinstance(value, bool)
                or not math.isfinite(value)
            ):
                raise ValueError(f"{field} must be a finite number, got {value!r}")
        if self.lazy_rescale_log2 < 0:
            raise ValueError(f"lazy_rescale_log2 must be >= 0, got {self.lazy_rescale_log2!r}")
        if self.causal not in (None, True, False):
            raise ValueError(f"causal must be True, False or None, got {self.causal!r}")
        for field in ("source", "doc"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"{field} must be a string, got {getattr(self, field)!r}")

    def _check_p_quant(self) -> None:
        if self.p_scale_shift:
            if self.p_quant is not PQuant.DIRECT:
                raise ValueError(
                    f"p_scale_shift={self.p_scale_shift} is Direct-P's stored-scale shift: it "
                    f"needs p_quant=direct, got {self.p_quant.value}"
                )
            floor = self.p_scale_shift - 126
            if self.p_min_exponent is None or self.p_min_exponent < floor:
                raise ValueError(
                    f"p_scale_shift={self.p_scale_shift} needs p_min_exponent >= {floor} (the "
                    "released working floor: every block scale 2^(e_B - S) a normal power of "
                    f"two), got {self.p_min_exponent}"
                )
        if self.direct_p_affine is not None:
            if self.p_quant is not PQuant.DIRECT:
                raise ValueError("direct_p_affine is only used with p_quant=direct")
            pair = tuple(self.direct_p_affine)
            if len(pair) != 2 or not all(
                isinstance(c, (int, float)) and math.isfinite(c) for c in pair
            ):
                raise ValueError(
                    "direct_p_affine must be two finite numbers (A, B), got "
                    f"{self.direct_p_affine!r}"
                )
            object.__setattr__(self, "direct_p_affine", tuple(float(c) for c in pair))
        if self.p_quant is PQuant.SPEC:
            return
        if not isinstance(self.p, QuantSpec) or self.p.block is None or len(self.p.block) != 1:
            raise ValueError(
                f"p_quant={self.p_quant.value} needs p to be a QuantSpec with 1-D blocks, got "
                f"{self.p!r}"
            )
        if self.p_quant is PQuant.ROW_SCALED and self.p.tensor_scale:
            raise ValueError(
                "p_quant=row_scaled replaces the tensor scale by a per-row one: p must have "
                f"tensor_scale=False, got block format {self.p.name!r}"
            )
        if self.p_quant is PQuant.DIRECT and self.p.element != FP4_E2M1:
            raise ValueError(
                "p_quant=direct maps scores to E2M1 codes: p.element must be FP4_E2M1, got "
                f"{self.p.element.name}"
            )
        if self.p_quant is PQuant.DIRECT and not self.p.scale_rule.alpha_grid:
            raise ValueError(
                "p_quant=direct places a block's largest code at a power of two: p needs an "
                f"alpha scale rule (alpha_ceil, alpha_half, ...), got {self.p.scale_rule.value}"
            )

    def _check_backward(self) -> None:
        fixed = {
            BackwardMode.STRAIGHT_THROUGH: ("dv_p", "dp_v", "dq_k", "dk_q"),
            BackwardMode.FORWARD_EXACT: _BACKWARD_FIELDS,
        }.get(self.backward, ())
        set_fields = [f for f in fixed if getattr(self, f) is not None]
        if set_fields:
            raise ValueError(
                f"backward={self.backward.value} takes these operands from the forward; "
                f"{', '.join(set_fields)} must be None"
            )
        if self.backward is BackwardMode.FORWARD_EXACT:
            wrong = [
                f"{name}={getattr(self, name).value}"
                for name, want in (
                    ("backward_p", BackwardP.QUANTIZED_QK),
                    ("delta", DeltaSource.OUTPUT),
                    ("ds_p", DsP.UNQUANTIZED),
                )
                if getattr(self, name) is not want
            ]
            if wrong:
                raise ValueError(
                    "backward=forward_exact is the exact gradient of the forward as it ran: it "
                    "needs "
                    "backward_p=quantized_qk, delta=output, ds_p=unquantized; got "
                    f"{', '.join(wrong)}"
                )
        if self.backward is not BackwardMode.FLASH and self.backward_v is BackwardV.FORWARD:
            raise ValueError(
                f"backward_v=forward is for backward=flash (backward={self.backward.value} "
                "uses the forward's V^ already)"
            )

    def _check_leakage_fix(self) -> None:
        if not self.leakage_fix:
            if self.leakage_fix_parts is not LeakageParts.P_AND_V:
                raise ValueError(
                    f"leakage_fix_parts={self.leakage_fix_parts.value!r} chooses what the "
                    "leakage fix leaves unquantized: it needs leakage_fix=True"
                )
            return
        v = self.v
        if not isinstance(v, QuantSpec) or v.block is None:
            raise ValueError(
                "leakage_fix computes the diagonal blocks of V (along the sequence) unquantized: "
                f"v must be a block format with blocks, got {v!r}"
            )

    def with_exact_backward(self) -> AttentionRecipe:
        """This recipe's forward with the exact gradient of it as the backward
        (`BackwardMode.FORWARD_EXACT`), named ``<name>_forward_exact``: the reference the
        backward's bias is measured against."""
        return dataclasses.replace(
            self,
            name=f"{self.name}_forward_exact",
            **{f: None for f in _BACKWARD_FIELDS},
            backward=BackwardMode.FORWARD_EXACT,
            backward_p=BackwardP.QUANTIZED_QK,
            backward_v=BackwardV.INPUT,
            ds_p=DsP.UNQUANTIZED,
            delta=DeltaSource.OUTPUT,
            doc=f"The exact (straight-through) gradient of {self.name}'s forward.",
        )

    def tiles(self, block_m: int | None = None, block_n: int | None = None) -> tuple[int, int]:
        """The (block_m, block_n) tiles a call runs with: those given, else the recipe's, else
        `DEFAULT_TILE`. Both backends take their tiles from here: the tiling is part of the
        numbers (where P's running maximum and per-tile scales are taken)."""
        return (
            block_m if block_m is not None else self.block_m or DEFAULT_TILE,
            block_n if block_n is not None else self.block_n or DEFAULT_TILE,
        )

    def block_axis(self, field: str) -> int:
        """The axis operand `field`'s 1-D blocks run along: its product's reduction axis
        (`fp4lab.recipes.operands`) unless `block_axes` says otherwise."""
        return dict(self.block_axes).get(field, operand(field).axis)

    @property
    def leakage_fix_p(self) -> bool:
        """Whether the leakage fix leaves P unquantized on the diagonal blocks."""
        return self.leakage_fix and self.leakage_fix_parts is not LeakageParts.V

    @property
    def leakage_fix_v(self) -> bool:
        """Whether the leakage fix leaves V unquantized on the diagonal blocks."""
        return self.leakage_fix and self.leakage_fix_parts is not LeakageParts.P

    @property
    def leakage_block(self) -> int:
        """The number of keys one of V's blocks spans along the sequence (for `leakage_fix`)."""
        return self.v.block[0]

    # -- queries --------------------------------------------------------------------------
    def operands(self, product: Product | str) -> tuple[OperandSpec, OperandSpec]:
        """The (a, b) operand specs of `product`."""
        product = parse_enum(Product, product, "product")
        return tuple(getattr(self, f) for f in product.fields)

    @functools.cached_property
    def stochastic(self) -> bool:
        """Whether any operand uses stochastic rounding (then attention needs a generator);
        computed once per recipe (the fields are frozen), since every call asks."""
        return any(
            isinstance(s, QuantSpec) and s.stochastic
            for s in (getattr(self, f) for f in OPERAND_FIELDS)
        )

    def __str__(self) -> str:
        return self.name

    @classmethod
    def uniform(cls, name: str, spec: QuantSpec | FloatFormat | str, **variants) -> AttentionRecipe:
        """A recipe that quantizes every operand of all six products with `spec`."""
        return cls(name=name, **{f: spec for f in OPERAND_FIELDS}, **variants)


_ENUM_FIELDS = {
    "p_quant": PQuant,
    "row_reference": RowReference,
    "row_sum": RowSum,
    "kv_order": KVOrder,
    "smooth_k": SmoothK,
    "tensor_scope": TensorScope,
    "leakage_fix_parts": LeakageParts,
    "backward": BackwardMode,
    "backward_p": BackwardP,
    "backward_v": BackwardV,
    "ds_p": DsP,
    "delta": DeltaSource,
}


def _resolve_operand(value, field: str) -> OperandSpec:
    if value is None or isinstance(value, (QuantSpec, FloatFormat)):
        return value
    if isinstance(value, str):
        try:
            return get(value, (QuantSpec, FloatFormat))
        except ValueError as err:
            raise ValueError(f"{field}: {err}") from None
    raise TypeError(
        f"{field} must be a QuantSpec, a FloatFormat, a registered name or None, got "
        f"{type(value).__name__}"
    )


def _check_block_axes(pairs) -> tuple[tuple[str, int], ...]:
    try:
        pairs = tuple((field, axis) for field, axis in pairs)
    except (TypeError, ValueError):
        raise ValueError(f"block_axes must be (field, axis) pairs, got {pairs!r}") from None
    for field, axis in pairs:
        if field not in OPERAND_FIELDS:
            raise ValueError(
                f"block_axes: {field!r} is not an operand field ({', '.join(OPERAND_FIELDS)})"
            )
        if axis not in (-1, -2):
            raise ValueError(f"block_axes: the axis of {field!r} must be -1 or -2, got {axis!r}")
    return pairs


def _check_int(value, field: str, *, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(
            f"{field} must be an int of at least {low}{' or None' if optional else ''}, got "
            f"{value!r}"
        )


def _check_positive(value, field: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field} must be a positive finite number, got {value!r}")


def resolve_recipe(recipe: AttentionRecipe | str) -> AttentionRecipe:
    """An AttentionRecipe from itself or a registered name.

    The name of a registered `QuantSpec` or `FloatFormat` stands for that format on every
    operand of all six products (`AttentionRecipe.uniform`): "nvfp4" is NVFP4 everywhere.
    """
    if isinstance(recipe, AttentionRecipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(
            f"recipe must be an AttentionRecipe or a registered name, got {type(recipe).__name__}"
        )
    try:
        obj = get(recipe, (AttentionRecipe, QuantSpec, FloatFormat))
    except ValueError as err:
        raise ValueError(f"recipe: {err}") from None
    if isinstance(obj, AttentionRecipe):
        return obj
    return AttentionRecipe.uniform(
        recipe, obj, doc=f"{recipe} on every operand of all six products."
    )
