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

import enum
import math
from dataclasses import dataclass

from fp4lab.formats import (
    FP4_E2M1,
    FloatFormat,
    QuantSpec,
    Rounding,
    get,
    parse_enum,
)
from fp4lab.recipes.operands import OPERAND_FIELDS, Product

__all__ = [
    "PQuant", "RowSum", "BackwardMode", "BackwardP", "DeltaSource", "AttentionRecipe",
    "OperandSpec", "resolve_recipe",
]

OperandSpec = QuantSpec | FloatFormat | None
_BACKWARD_FIELDS = tuple(f for p in Product if p.backward for f in p.fields)


class PQuant(enum.Enum):
    """How the forward turns a probability tile P = exp(S - m) into the P that P V consumes.

    m is the running row maximum of the online softmax, so a tile's values depend on the
    tiles before it, as in a real kernel.
    """

    SPEC = "spec"
    """P^ = q(c P) / c: the recipe's `p` applied along the keys after multiplying by the
    power of two c = `p_lift` (1 for most recipes; 2^8 where a kernel stores 256 P in
    E4M3, as FA4-FP4's backward does)."""

    ROW_SCALED = "row_scaled"
    """Two-level P (SageAttention3, arXiv 2505.11594, Sec. 3.2): each row of the tile is
    scaled by r_i = (M_e * M_s) / max_j P_ij, so that its maximum maps to the largest value
    the `p` spec can represent (448 * 6 for E4M3-scaled E2M1), quantized by `p`, and
    divided back: P^ = q(r P) / r, with r_i in float32 (not rounded)."""

    DIRECT = "direct"
    """Direct-P ("Hardware-Aware FP4 FlashAttention-4", fp4-fa4 repository, Sec. 4, Eq.
    represented-probability and affine-code-map): for each block B of n keys of a row
    (n = the `p` spec's block, E2M1 elements), a_B = max_j P_ij, e_B = ceil(log2 a_B)
    (assumed: the smallest power of two not below a_B, so no code overflows; clamped to the
    E8M0 range), x = (z - m) log2(e) - e_B + log2(6), and the code is
    q = Q_E2M1(2^x) (ideal path, `direct_p_affine=None`) or q = Q_E2M1(max(0, A x + B))
    (the affine classifier, `direct_p_affine=(A, B)`). The represented probability is
    P^ = 2^e_B q / 6."""


class RowSum(enum.Enum):
    """What the softmax denominator l accumulates."""

    UNQUANTIZED_P = "unquantized_p"
    """l = sum_j P_ij (FlashAttention, Attn-QAT): the output rows' weights P^ / l need not
    sum to one once P is quantized."""

    QUANTIZED_P = "quantized_p"
    """l = sum_j P^_ij, the very values P V consumes (softmax row correction; Direct-P's
    represented denominator): every output row is a convex combination of the rows of V^."""


class BackwardMode(enum.Enum):
    """How the backward's operands are formed."""

    FLASH = "flash"
    """A FlashAttention-2 backward whose eight operands are quantized by the recipe's
    backward fields (`dv_p`, `dv_do`, `dp_do`, `dp_v`, `dq_ds`, `dq_k`, `dk_ds`, `dk_q`;
    None keeps one in the working precision), each along its product's reduction axis,
    starting again from the unquantized Q, K, V, dO and the rebuilt P."""

    STRAIGHT_THROUGH = "straight_through"
    """Attn-QAT's backward (arXiv 2603.00040), straight through the forward's quantizers:
    the forward's Q^, K^, V^ and P^ (the forward's quantization of the rebuilt P) are the
    operands, dV = P^^T dO, dP = dO V^^T, dQ = dS K^, dK = dS^T Q^, while the softmax's
    gradient treats P as unquantized, dS = P * (dP - D); dO and dS are not quantized. With
    `delta=UNQUANTIZED_P_OUTPUT`, D = sum_j P_ij dP_ij, so dS is exactly the gradient of
    softmax(S) V^. The backward fields must be None."""


class BackwardP(enum.Enum):
    """Which scores the backward rebuilds P = exp(S - lse) from (lse = the forward's row
    log-sum-exp, m + log l)."""

    QUANTIZED_QK = "quantized_qk"
    """S from the forward's quantized Q^, K^ (and its smoothing), so P is the forward's P
    (Attn-QAT; FA4-FP4 rebuilds it from the saved quantized Q/K bytes, scales and lse)."""

    UNQUANTIZED_QK = "unquantized_qk"
    """S from the unquantized Q, K, as a stock high-precision FlashAttention backward run
    after a quantized forward does (the drop-in baseline): P no longer matches lse."""


class DeltaSource(enum.Enum):
    """Where the backward's D_i = rowsum(dO_i * O_i) (FlashAttention-2, Alg. 2, line 4)
    takes O from."""

    OUTPUT = "output"
    """The output the forward returned."""

    UNQUANTIZED_P_OUTPUT = "unquantized_p_output"
    """O' = (sum_j P_ij V^_j) / (sum_j P_ij), a second output from the unquantized P and the
    quantized V (Attn-QAT). Then D_i = sum_j A_ij dP_ij with A = softmax(S) and
    dP = dO V^^T, the identity FlashAttention's D stands for, so every row of dS sums to
    zero; D from the quantized output breaks it."""


@dataclass(frozen=True, kw_only=True)
class AttentionRecipe:
    """Which format each operand of attention's six products uses, and the algorithm variant.

    Operand fields (see `Product`) take a `QuantSpec`, a `FloatFormat`, a registered name of
    either, or None (no quantization). String names are resolved through the registry when
    the recipe is built.

    Attributes:
        name: registry name.
        q, k: S = Q K^T operands (blocked along head_dim).
        p, v: O = P V operands (P along keys, V along the key sequence).
        dv_p, dv_do: dV = P^T dO operands (along the queries).
        dp_do, dp_v: dP = dO V^T operands (along head_dim).
        dq_ds, dq_k: dQ = dS K operands (along the keys).
        dk_ds, dk_q: dK = dS^T Q operands (along the queries).
        p_quant: how the forward quantizes P (`PQuant`).
        p_lift: power of two P is multiplied by before `PQuant.SPEC` quantization (and
            in the backward's `dv_p`), divided out afterwards.
        ds_lift: power of two dS is multiplied by before `dq_ds` / `dk_ds`.
        direct_p_affine: (A, B) of Direct-P's affine code map, or None for its ideal path.
        row_sum: what the softmax denominator accumulates (`RowSum`).
        smooth_k: subtract K's mean over the key sequence (per batch and KV head) before
            quantizing (SageAttention, arXiv 2410.02367, Sec. 4.2). Softmax is invariant to
            it: every score of a row shifts by the same q_i . mean(K).
        smooth_q: split Q into its mean over each query tile and the rest; S = Q~ K^T with
            Q~ = Q - mean quantized, plus mean * K^T added in the working precision
            (SageAttention2, arXiv 2411.10958, Sec. 3.2).
        incoherent_processing: multiply Q and K by diag(signs) H / sqrt(d) along head_dim
            before quantizing (FlashAttention-3, arXiv 2407.08608, Sec. 3.3); it cancels
            in Q K^T because the matrix is orthogonal. Needs a power-of-two head_dim.
        incoherent_seed: seed of its random signs (recorded with the recipe).
        backward: how the backward's operands are formed (`BackwardMode`).
        backward_p: which scores the backward rebuilds P from (`BackwardP`).
        delta: where D = rowsum(dO * O) takes O from (`DeltaSource`).
        doc: the recipe's description, source and assumptions (presets fill it from their
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
    ds_lift: float = 1.0
    direct_p_affine: tuple[float, float] | None = None
    row_sum: RowSum = RowSum.UNQUANTIZED_P
    smooth_k: bool = False
    smooth_q: bool = False
    incoherent_processing: bool = False
    incoherent_seed: int = 0
    backward: BackwardMode = BackwardMode.FLASH
    backward_p: BackwardP = BackwardP.QUANTIZED_QK
    delta: DeltaSource = DeltaSource.OUTPUT
    doc: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        for field in OPERAND_FIELDS:
            object.__setattr__(self, field, _resolve_operand(getattr(self, field), field))
        for field, kind in _ENUM_FIELDS.items():
            object.__setattr__(self, field, parse_enum(kind, getattr(self, field), field))
        for field in ("p_lift", "ds_lift"):
            _check_power_of_two(getattr(self, field), field)
        self._check_p_quant()
        self._check_backward()

    def _check_p_quant(self) -> None:
        if self.direct_p_affine is not None:
            if self.p_quant is not PQuant.DIRECT:
                raise ValueError("direct_p_affine is only used with p_quant=direct")
            if len(self.direct_p_affine) != 2 or not all(math.isfinite(c) for c in self.direct_p_affine):
                raise ValueError(f"direct_p_affine must be two finite numbers (A, B), got {self.direct_p_affine!r}")
        if self.p_quant is PQuant.SPEC:
            return
        if not isinstance(self.p, QuantSpec) or self.p.block is None or len(self.p.block) != 1:
            raise ValueError(
                f"p_quant={self.p_quant.value} needs p to be a QuantSpec with 1-D blocks, got {self.p!r}"
            )
        if self.p_quant is PQuant.ROW_SCALED and self.p.tensor_scale:
            raise ValueError(
                "p_quant=row_scaled replaces the tensor scale by a per-row one: p must have "
                f"tensor_scale=False, got spec {self.p.name!r}"
            )
        if self.p_quant is PQuant.DIRECT and self.p.element != FP4_E2M1:
            raise ValueError(
                f"p_quant=direct maps scores to E2M1 codes: p.element must be FP4_E2M1, got {self.p.element.name}"
            )

    def _check_backward(self) -> None:
        if self.backward is BackwardMode.STRAIGHT_THROUGH:
            set_fields = [f for f in _BACKWARD_FIELDS if getattr(self, f) is not None]
            if set_fields:
                raise ValueError(
                    "backward=straight_through reuses the forward's quantized operands; the "
                    f"backward fields must be None, got {', '.join(set_fields)}"
                )

    # -- queries --------------------------------------------------------------------------
    def operands(self, product: Product | str) -> tuple[OperandSpec, OperandSpec]:
        """The (a, b) operand specs of `product`."""
        product = parse_enum(Product, product, "product")
        return tuple(getattr(self, f) for f in product.fields)

    @property
    def stochastic(self) -> bool:
        """Whether any operand uses stochastic rounding (then attention needs a generator)."""
        return any(
            isinstance(s, QuantSpec) and s.rounding is Rounding.STOCHASTIC
            for s in (getattr(self, f) for f in OPERAND_FIELDS)
        )

    def __str__(self) -> str:
        return self.name

    @classmethod
    def uniform(cls, name: str, spec: QuantSpec | FloatFormat | str, **variants) -> AttentionRecipe:
        """A recipe that quantizes every operand of all six products with `spec`."""
        return cls(name=name, **{f: spec for f in OPERAND_FIELDS}, **variants)


_ENUM_FIELDS = {
    "p_quant": PQuant, "row_sum": RowSum, "backward": BackwardMode, "backward_p": BackwardP,
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
        f"{field} must be a QuantSpec, a FloatFormat, a registered name or None, got {type(value).__name__}"
    )


def _check_power_of_two(value, field: str) -> None:
    ok = isinstance(value, (int, float)) and value > 0 and math.isfinite(value)
    if not ok or math.frexp(value)[0] != 0.5:
        raise ValueError(f"{field} must be a positive power of two (scaling by it is exact), got {value!r}")


def resolve_recipe(recipe: AttentionRecipe | str) -> AttentionRecipe:
    """An AttentionRecipe from itself or a registered name.

    The name of a registered `QuantSpec` or `FloatFormat` stands for that format on every
    operand of all six products (`AttentionRecipe.uniform`): "nvfp4" is NVFP4 everywhere.
    """
    if isinstance(recipe, AttentionRecipe):
        return recipe
    if not isinstance(recipe, str):
        raise TypeError(f"recipe must be an AttentionRecipe or a registered name, got {type(recipe).__name__}")
    try:
        obj = get(recipe, (AttentionRecipe, QuantSpec, FloatFormat))
    except ValueError as err:
        raise ValueError(f"recipe: {err}") from None
    if isinstance(obj, AttentionRecipe):
        return obj
    return AttentionRecipe.uniform(recipe, obj, doc=f"{recipe} on every operand of all six products.")
