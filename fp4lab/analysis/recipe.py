"""Attention recipes: which number format each operand of attention's six products uses.

Attention is six matrix products. The forward computes S = Q K^T and O = P V; the backward
computes dV = P^T dO, dP = dO V^T, dQ = dS K and dK = dS^T Q (FlashAttention-2, Dao 2023,
Algorithm 2). Each product has two operands, and each operand can be quantized with its own
`QuantSpec` (block scaling, fp4lab.formats), a plain `FloatFormat` (an element-wise cast with
no scale, as a kernel casts P to E4M3) or nothing (None: kept in the working precision).
An `AttentionRecipe` names those twelve choices plus the algorithm variants that published
low-precision attention kernels add around them (K smoothing, incoherent processing,
two-level P scaling, Direct-P, softmax row correction, how the backward rebuilds P, where
D = rowsum(dO * O) comes from).

Blocks run along each product's reduction axis (the `Product` members say which), because
that is the axis a block-scaled matrix instruction shares a scale along. Two exceptions:
2-D tiles ((r, c) blocks) always lie on an operand's natural layout, r rows along the
sequence (queries for P and dS) and c columns along head_dim (keys for P and dS), so P and
P^T see the very same tiles; and operands with a per-tensor scale (`block=None` or
`tensor_scale=True`) that exist only inside the kernel (P and dS) take that scale per tile
(one batch, head, query tile and key tile), since a fused kernel never sees the whole tensor.

A recipe is a frozen dataclass literal; the presets below name published recipes and cite
their sources in their docstrings (also kept in the recipe's `doc` field). Every preset and
every recipe a user registers with `fp4lab.formats.register` is found by name wherever a
recipe is accepted: `get("sageattn3")`, `attention(..., recipe="sageattn3")`, the CLI.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
from dataclasses import dataclass

from fp4lab.formats import (
    BF16,
    FP4_E2M1,
    FP8_E4M3FN,
    FP32,
    FloatFormat,
    QuantSpec,
    Rounding,
    ScaleRule,
    get,
    parse_enum,
    register,
)

__all__ = [
    "Product", "PQuant", "RowSum", "BackwardMode", "BackwardP", "DeltaSource",
    "AttentionRecipe", "OperandSpec", "resolve_recipe", "PRESETS",
    "EXACT", "BF16_RECIPE", "FP8_PER_TENSOR", "FA3_FP8", "SAGEATTN3", "ATTN_QAT_DROPIN",
    "ATTN_QAT", "FA4FP4_DIRECTP", "FA4FP4_CAUSAL", "FA4FP4_CAUSAL_MXFP4PV", "CROISSATTN",
]

OperandSpec = QuantSpec | FloatFormat | None


class Product(enum.Enum):
    """One of attention's six matrix products, with its operands and reduction axis.

    Each member's docstring gives the product, its two operands (a, b) as recipe fields and
    the axis each operand's blocks run along (the product's reduction axis).
    """

    QK = "qk"
    """S = Q K^T (forward). a = `q`, b = `k`; both blocked along head_dim."""

    PV = "pv"
    """O = P V (forward). a = `p` blocked along the keys, b = `v` along the key sequence."""

    DV = "dv"
    """dV = P^T dO (backward). a = `dv_p` blocked along the queries, b = `dv_do` along the
    query sequence."""

    DP = "dp"
    """dP = dO V^T (backward). a = `dp_do`, b = `dp_v`; both blocked along head_dim."""

    DQ = "dq"
    """dQ = dS K (backward). a = `dq_ds` blocked along the keys, b = `dq_k` along the key
    sequence."""

    DK = "dk"
    """dK = dS^T Q (backward). a = `dk_ds` blocked along the queries, b = `dk_q` along the
    query sequence."""

    @property
    def fields(self) -> tuple[str, str]:
        """The recipe fields of operands (a, b)."""
        return _PRODUCT_FIELDS[self]

    @property
    def operand_names(self) -> tuple[str, str]:
        """Short names of operands (a, b), as the trace reports them."""
        return _OPERAND_NAMES[self]

    @property
    def backward(self) -> bool:
        return self in (Product.DV, Product.DP, Product.DQ, Product.DK)


_PRODUCT_FIELDS = {
    Product.QK: ("q", "k"), Product.PV: ("p", "v"), Product.DV: ("dv_p", "dv_do"),
    Product.DP: ("dp_do", "dp_v"), Product.DQ: ("dq_ds", "dq_k"), Product.DK: ("dk_ds", "dk_q"),
}
_OPERAND_NAMES = {
    Product.QK: ("q", "k"), Product.PV: ("p", "v"), Product.DV: ("p", "do"),
    Product.DP: ("do", "v"), Product.DQ: ("ds", "k"), Product.DK: ("ds", "q"),
}
_OPERAND_FIELDS = tuple(f for p in Product for f in p.fields)
_BACKWARD_FIELDS = tuple(f for p in Product if p.backward for f in p.fields)


class PQuant(enum.Enum):
    """How the forward turns a probability tile P = exp(S - m) into the P that P V consumes.

    m is the running row maximum of the online softmax, so a tile's values depend on the
    tiles before it, as in a real kernel.
    """

    SPEC = "spec"
    """P^ = q(c P) / c: the recipe's `p` applied along the keys after multiplying by the
    power of two c = `p_prescale` (1 for most recipes; 2^8 where a kernel stores 256 P in
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
        p_prescale: power of two P is multiplied by before `PQuant.SPEC` quantization (and
            in the backward's `dv_p`), divided out afterwards.
        ds_prescale: power of two dS is multiplied by before `dq_ds` / `dk_ds`.
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
    p_prescale: float = 1.0
    ds_prescale: float = 1.0
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
        for field in _OPERAND_FIELDS:
            object.__setattr__(self, field, _resolve_operand(getattr(self, field), field))
        for field, kind in _ENUM_FIELDS.items():
            object.__setattr__(self, field, parse_enum(kind, getattr(self, field), field))
        for field in ("p_prescale", "ds_prescale"):
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
    def quantized(self) -> bool:
        """Whether any operand is quantized or P is rebuilt by Direct-P."""
        return self.p_quant is PQuant.DIRECT or any(getattr(self, f) is not None for f in _OPERAND_FIELDS)

    @property
    def stochastic(self) -> bool:
        """Whether any operand uses stochastic rounding (then attention needs a generator)."""
        return any(
            isinstance(s, QuantSpec) and s.rounding is Rounding.STOCHASTIC
            for s in (getattr(self, f) for f in _OPERAND_FIELDS)
        )

    def __str__(self) -> str:
        return self.name

    @classmethod
    def uniform(cls, name: str, spec: QuantSpec | FloatFormat | str, **variants) -> AttentionRecipe:
        """A recipe that quantizes every operand of all six products with `spec`."""
        return cls(name=name, **{f: spec for f in _OPERAND_FIELDS}, **variants)


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
    operand of all six products (`AttentionRecipe.uniform`): "nvfp4" is NVFP4 everywhere,
    and "bf16" (a format's name in the shared registry) is the `bf16` preset.
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
    if recipe in _UNIFORM_PRESETS:
        return _UNIFORM_PRESETS[recipe]
    return AttentionRecipe.uniform(recipe, obj, doc=f"{recipe} on every operand of all six products.")


# -- quantization specs the presets need beyond fp4lab.formats' presets ------------------------
def _spec(spec: QuantSpec) -> QuantSpec:
    """Register a helper spec under its name (kept if the same literal is already there)."""
    register(spec)
    return spec


NVFP4 = get("nvfp4", QuantSpec)
# NVFP4 elements and E4M3 block scales of 16 without the FP32 second-level scale.
NVFP4_1LEVEL = _spec(dataclasses.replace(NVFP4, name="nvfp4_1level", tensor_scale=False))
# NVFP4 with stochastic rounding of the elements (the scales stay round-to-nearest).
NVFP4_SR = _spec(dataclasses.replace(NVFP4, name="nvfp4_sr", rounding=Rounding.STOCHASTIC))
# FlashAttention-3's block quantization: one FP32 scale per 128 rows x the whole head_dim
# (tiles of 128 x 256 cover any head_dim up to 256; zero padding leaves the amax unchanged).
FP8_E4M3_TILE128 = _spec(QuantSpec(
    name="fp8_e4m3_tile128", element=FP8_E4M3FN, scale=FP32, block=(128, 256),
    scale_rule=ScaleRule.NEAREST,
))


# -- presets ------------------------------------------------------------------------------------
_UNIFORM_PRESETS: dict[str, AttentionRecipe] = {}


def _preset(build) -> AttentionRecipe:
    """Build a preset, keep its function's docstring as the recipe's `doc`, register it.

    A preset whose name is already a format's (bf16) is not registered over it; the name
    reaches it through `resolve_recipe`, which reads a format name as a uniform recipe.
    """
    recipe = dataclasses.replace(build(), doc=inspect.cleandoc(build.__doc__))
    try:
        taken = get(recipe.name)
    except ValueError:
        taken = None
    if isinstance(taken, (QuantSpec, FloatFormat)):
        _UNIFORM_PRESETS[recipe.name] = recipe
    else:
        register(recipe)
    return recipe


@_preset
def EXACT() -> AttentionRecipe:
    """No quantization: FlashAttention-2's tiled forward and backward (Dao 2023,
    arXiv 2307.08691, Algorithms 1 and 2) in the working precision, the reference every
    other recipe is measured against."""
    return AttentionRecipe(name="exact")


@_preset
def BF16_RECIPE() -> AttentionRecipe:
    """BF16 operands with float32 accumulation: every operand of the six products is rounded
    to bfloat16 (round-to-nearest-even), as FlashAttention-2's bf16 kernels do, P and dS
    included (they are converted to bf16 before their matrix products).

    Assumption: accumulation happens in the working precision; run float32 inputs to model
    float32 accumulation (float64 inputs accumulate in float64)."""
    return AttentionRecipe.uniform("bf16", BF16)


@_preset
def FP8_PER_TENSOR() -> AttentionRecipe:
    """FP8 with one scale per tensor, the "hybrid" FP8 training recipe (Micikevicius et al.
    2022, "FP8 Formats for Deep Learning", arXiv 2209.05433): activations and weights (Q, K,
    V, P) in E4M3, gradients (dO, dS) in E5M2, each with an amax-derived FP32 scale.

    Assumptions: Q, K, V, dO take their per-tensor scale over the whole tensor passed in;
    P is cast to E4M3 without a scale (its values lie in [0, 1], as FlashAttention-3 casts
    it); dS, which exists only inside the kernel, takes its per-tensor scale per tile."""
    e4m3, e5m2 = get("fp8_e4m3_tensor"), get("fp8_e5m2_tensor")
    return AttentionRecipe(
        name="fp8_per_tensor", q=e4m3, k=e4m3, p=FP8_E4M3FN, v=e4m3,
        dv_p=FP8_E4M3FN, dv_do=e5m2, dp_do=e5m2, dp_v=e4m3,
        dq_ds=e5m2, dq_k=e4m3, dk_ds=e5m2, dk_q=e4m3,
    )


@_preset
def FA3_FP8() -> AttentionRecipe:
    """FlashAttention-3's FP8 forward (Shah et al. 2024, arXiv 2407.08608, Sec. 3.3): block
    quantization of Q, K, V in E4M3 with one FP32 scale per 128-row block (the whole head
    dimension), and incoherent processing: Q and K multiplied by a random-sign Hadamard
    matrix along head_dim, which cancels in Q K^T and spreads outliers. P is cast to E4M3
    for the P V product. FlashAttention-3's FP8 path is forward only, so the backward is a
    high-precision FlashAttention backward from the unquantized (rotated) Q, K.

    Assumptions: the scale is amax / 448 in FP32 (ScaleRule.NEAREST); V's 128-row blocks lie
    along the key sequence; the random signs come from `incoherent_seed=0`; P is cast
    without a scale."""
    return AttentionRecipe(
        name="fa3_fp8", q=FP8_E4M3_TILE128, k=FP8_E4M3_TILE128, v=FP8_E4M3_TILE128,
        p=FP8_E4M3FN, incoherent_processing=True, backward_p=BackwardP.UNQUANTIZED_QK,
    )


@_preset
def SAGEATTN3() -> AttentionRecipe:
    """SageAttention3 (Zhang et al. 2025, "SageAttention3: Microscaling FP4 Attention for
    Inference and an Exploration of 8-bit Training", arXiv 2505.11594): K smoothed by
    subtracting its mean over the sequence (softmax-invariant); Q split into its per-block
    mean, whose product with K^T is added back in high precision, and the rest; Q, K, V in
    NVFP4 (E2M1 with an E4M3 scale per 16 elements, V blocked along the sequence); P
    two-level: each row first scaled so that its maximum maps to 448 * 6, then NVFP4.

    Assumptions: no FP32 second-level scale on Q, K, V (the smoothing keeps them in range);
    Q's mean is taken over each query tile (block_m rows); the mean's correction term uses
    the unquantized, smoothed K; the row scale of P is exact float32. SageAttention3's FP4
    kernel is for inference, so the backward is a high-precision FlashAttention backward
    from the unquantized (smoothed) Q, K."""
    return AttentionRecipe(
        name="sageattn3", q=NVFP4_1LEVEL, k=NVFP4_1LEVEL, p=NVFP4_1LEVEL, v=NVFP4_1LEVEL,
        p_quant=PQuant.ROW_SCALED, smooth_k=True, smooth_q=True,
        backward_p=BackwardP.UNQUANTIZED_QK,
    )


def _attn_qat_forward(name: str, **backward) -> AttentionRecipe:
    return AttentionRecipe(
        name=name, q=NVFP4, k=NVFP4, v=NVFP4, p=NVFP4_1LEVEL, p_quant=PQuant.ROW_SCALED,
        **backward,
    )


@_preset
def ATTN_QAT_DROPIN() -> AttentionRecipe:
    """The unstable baseline of Attn-QAT (arXiv 2603.00040): an FP4 forward dropped in front
    of an ordinary high-precision FlashAttention backward. The backward recomputes S from
    the unquantized Q, K against the forward's log-sum-exp, so its P is not the forward's,
    and takes D = rowsum(dO * O) from the FP4 output.

    Assumptions (the FP4 forward): Q, K, V in NVFP4 with an FP32 tensor scale; P two-level
    as SageAttention3 (rows scaled to 448 * 6, then NVFP4 without tensor scale); the
    denominator sums the unquantized P."""
    return _attn_qat_forward("attn_qat_dropin", backward_p=BackwardP.UNQUANTIZED_QK)


@_preset
def ATTN_QAT() -> AttentionRecipe:
    """Attn-QAT (arXiv 2603.00040): the same FP4 forward as `attn_qat_dropin`, and a
    backward that matches it. P is recomputed from the same fake-quantized Q, K and the
    forward's log-sum-exp; dV uses the quantized P; D = rowsum(dO * O') from a second,
    high-precision output O' (unquantized P); the row sum l accumulates unquantized P;
    gradients pass straight through the quantizers.

    Assumptions: the forward as in `attn_qat_dropin`; "straight through" is read as
    BackwardMode.STRAIGHT_THROUGH: dV = P^^T dO with the forward's quantization of P, dP,
    dQ and dK from the forward's V^, K^, Q^, and dS = P * (dP - D) with the unquantized P
    and D = rowsum(dO * O'), O' = (P V^) / l: the gradient of softmax(S^) V^ for S^, Q^,
    K^. dO and dS stay unquantized."""
    return _attn_qat_forward(
        "attn_qat", backward=BackwardMode.STRAIGHT_THROUGH, backward_p=BackwardP.QUANTIZED_QK,
        delta=DeltaSource.UNQUANTIZED_P_OUTPUT,
    )


@_preset
def FA4FP4_DIRECTP() -> AttentionRecipe:
    """Direct-P for non-causal inference ("Hardware-Aware FP4 FlashAttention-4", fp4-fa4
    repository, technical report Sec. 4): NVFP4 Q/K; scores mapped straight to E2M1 codes by
    the affine map q = E2M1(max(0, 1.50 x + 1.20)) of x = (z - m) log2(e) - e_B + log2(6)
    (the generic "fast" fit); P/V in MXFP4 (E8M0 scales, blocks of 32); the softmax
    denominator summed from the same codes and scales that P V consumes.

    Assumptions: the row reference m is the online softmax's running maximum (the published
    fast policy is shiftless); e_B = ceil(log2 of the block's largest P); V uses OCP MX's
    floor scale rule; Q/K use plain 16-element NVFP4 blocks (not the offline-folded K64
    scales). Direct-P has no backward of its own: the backward here is a high-precision
    FlashAttention backward from the quantized Q/K and the Direct-P log-sum-exp."""
    return AttentionRecipe(
        name="fa4fp4_directp", q=NVFP4, k=NVFP4, p=get("mxfp4"), v=get("mxfp4"),
        p_quant=PQuant.DIRECT, direct_p_affine=(1.50, 1.20), row_sum=RowSum.QUANTIZED_P,
    )


def _fa4fp4_causal(name: str, **forward_pv) -> AttentionRecipe:
    e4m3, e5m2 = get("fp8_e4m3_tensor"), get("fp8_e5m2_tensor")
    return AttentionRecipe(
        name=name, q=NVFP4, k=NVFP4, **forward_pv,
        dv_p=FP8_E4M3FN, dv_do=e5m2, dp_do=e5m2, dp_v=e4m3,
        dq_ds=FP8_E4M3FN, dq_k=e4m3, dk_ds=FP8_E4M3FN, dk_q=e4m3,
        p_prescale=256.0, ds_prescale=256.0, backward_p=BackwardP.QUANTIZED_QK,
    )


@_preset
def FA4FP4_CAUSAL() -> AttentionRecipe:
    """The causal training path of "Hardware-Aware FP4 FlashAttention-4" (fp4-fa4
    repository, route causal_nvfp4_qk_fp8_pv_v509): NVFP4 Q/K for S = Q K^T; P and V in FP8
    E4M3 for the forward P V; the backward rebuilds P from the saved quantized Q/K, their
    scales and the row log-sum-exp, and runs its products on E4M3 Q, K, V, P, dS and E5M2 dO
    (E4M3 flushed about 97% of dO to zero, E5M2 about 14%), accumulating in FP32.

    Assumptions: P and dS are stored as 256 P and 256 dS in E4M3 without a further scale
    (the backward's lstat = 8 - lse log2(e) and its 1/256 gradient epilogue), the forward's
    P likewise; V, and the backward's Q, K, V and dO, carry one FP32 scale per tensor; Q/K
    NVFP4 uses 16-element row blocks with the FP32 tensor scale; the denominator sums the
    unquantized P and D comes from the returned output."""
    return _fa4fp4_causal("fa4fp4_causal", p=FP8_E4M3FN, v=get("fp8_e4m3_tensor"))


@_preset
def FA4FP4_CAUSAL_MXFP4PV() -> AttentionRecipe:
    """`fa4fp4_causal` with MXFP4 P/V in the forward (fp4-fa4, route "Causal MXFP4-P/V"):
    P published as E2M1 codes with E8M0 block-32 scales and the represented denominator,
    V in MXFP4; the same backward (with its E4M3 view of V). Every training run with this
    route diverged; the cause is unresolved.

    Assumptions: P follows Direct-P's ideal code path q = E2M1(2^x) (the released "safe"
    policy evaluates exponentials; its 32-row anchor is replaced by the running maximum);
    the denominator sums the represented P; V uses OCP MX's floor scale rule; the backward
    as in `fa4fp4_causal`."""
    return _fa4fp4_causal(
        "fa4fp4_causal_mxfp4pv", p=get("mxfp4"), v=get("mxfp4"), p_quant=PQuant.DIRECT,
        row_sum=RowSum.QUANTIZED_P,
    )


@_preset
def CROISSATTN() -> AttentionRecipe:
    """CroissAttn (conference talk; no public paper or code found): all six attention
    products in FP4 (NVFP4), stochastic rounding of the backward operands, and a softmax row
    correction that normalises by the row sum of the quantized P, claimed to make the
    gradient unbiased and to train models from 181M to 8B parameters.

    Assumptions (published detail is scarce): NVFP4 is 16-element E4M3 block scales with an
    FP32 second-level scale, taken over the whole tensor for Q, K, V, dO and per tile for P
    and dS; the forward rounds to nearest even and only the eight backward operands round
    stochastically (scales round to nearest); the backward rebuilds P from the quantized
    Q/K and the corrected log-sum-exp and takes D from the returned output."""
    return AttentionRecipe(
        name="croissattn", q=NVFP4, k=NVFP4, p=NVFP4, v=NVFP4,
        **{f: NVFP4_SR for f in _BACKWARD_FIELDS},
        row_sum=RowSum.QUANTIZED_P, backward_p=BackwardP.QUANTIZED_QK,
    )


PRESETS = (
    EXACT, BF16_RECIPE, FP8_PER_TENSOR, FA3_FP8, SAGEATTN3, ATTN_QAT_DROPIN, ATTN_QAT,
    FA4FP4_DIRECTP, FA4FP4_CAUSAL, FA4FP4_CAUSAL_MXFP4PV, CROISSATTN,
)
