"""The published attention recipes, one preset each, named as their methods.

Each preset follows the released code of its method and cites, in its docstring (kept as the
recipe's `doc`), the file each choice comes from and what could not be verified; where the
paper describes something else, a second preset named ``<name>_paper`` follows the paper.
"""

from __future__ import annotations

import dataclasses
import inspect

from fp4lab.formats import (
    BF16,
    FP8_E4M3_TENSOR,
    FP8_E4M3_TILE128,
    FP8_E4M3FN,
    FP8_E5M2_TENSOR,
    MXFP4,
    NVFP4,
    NVFP4_1LEVEL,
    NVFP4_SR,
    register,
)
from fp4lab.recipes.recipe import (
    AttentionRecipe,
    BackwardMode,
    BackwardP,
    DeltaSource,
    PQuant,
    RowSum,
    SmoothK,
)
from fp4lab.recipes.operands import Product

__all__ = [
    "PRESETS", "EXACT", "FLASH_BF16", "FP8_PER_TENSOR", "FA3_FP8", "SAGEATTN3",
    "ATTN_QAT_DROPIN", "ATTN_QAT", "FA4FP4_DIRECTP", "FA4FP4_CAUSAL", "FA4FP4_CAUSAL_MXFP4PV",
    "CROISSATTN",
]

_BACKWARD_FIELDS = tuple(f for p in Product if p.backward for f in p.fields)


def _preset(build) -> AttentionRecipe:
    """Build a preset, keep its function's docstring as the recipe's `doc`, register it."""
    return register(dataclasses.replace(build(), doc=inspect.cleandoc(build.__doc__)))


@_preset
def EXACT() -> AttentionRecipe:
    """No quantization: FlashAttention-2's tiled forward and backward (Dao 2023,
    arXiv 2307.08691, Algorithms 1 and 2) in the working precision, the reference every
    other recipe is measured against."""
    return AttentionRecipe(name="exact")


@_preset
def FLASH_BF16() -> AttentionRecipe:
    """BF16 operands with float32 accumulation: every operand of the six products is rounded
    to bfloat16 (round-to-nearest-even), as FlashAttention-2's bf16 kernels do, P and dS
    included (they are converted to bf16 before their matrix products).

    Assumption: accumulation happens in the working precision; run float32 inputs to model
    float32 accumulation (float64 inputs accumulate in float64)."""
    return AttentionRecipe.uniform("flash_bf16", BF16)


@_preset
def FP8_PER_TENSOR() -> AttentionRecipe:
    """FP8 with one scale per tensor, the "hybrid" FP8 training recipe (Micikevicius et al.
    2022, "FP8 Formats for Deep Learning", arXiv 2209.05433): activations and weights (Q, K,
    V, P) in E4M3, gradients (dO, dS) in E5M2, each with an amax-derived FP32 scale.

    Assumptions: Q, K, V, dO take their per-tensor scale over the whole tensor passed in;
    P is cast to E4M3 without a scale (its values lie in [0, 1], as FlashAttention-3 casts
    it); dS, which exists only inside the kernel, takes its per-tensor scale per tile."""
    return AttentionRecipe(
        name="fp8_per_tensor", q=FP8_E4M3_TENSOR, k=FP8_E4M3_TENSOR, p=FP8_E4M3FN, v=FP8_E4M3_TENSOR,
        dv_p=FP8_E4M3FN, dv_do=FP8_E5M2_TENSOR, dp_do=FP8_E5M2_TENSOR, dp_v=FP8_E4M3_TENSOR,
        dq_ds=FP8_E5M2_TENSOR, dq_k=FP8_E4M3_TENSOR, dk_ds=FP8_E5M2_TENSOR, dk_q=FP8_E4M3_TENSOR,
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
        p_quant=PQuant.ROW_SCALED, smooth_k=SmoothK.PER_HEAD, smooth_q=True,
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
        name="fa4fp4_directp", q=NVFP4, k=NVFP4, p=MXFP4, v=MXFP4,
        p_quant=PQuant.DIRECT, direct_p_affine=(1.50, 1.20), row_sum=RowSum.QUANTIZED_P,
    )


def _fa4fp4_causal(name: str, **forward_pv) -> AttentionRecipe:
    return AttentionRecipe(
        name=name, q=NVFP4, k=NVFP4, **forward_pv,
        dv_p=FP8_E4M3FN, dv_do=FP8_E5M2_TENSOR, dp_do=FP8_E5M2_TENSOR, dp_v=FP8_E4M3_TENSOR,
        dq_ds=FP8_E4M3FN, dq_k=FP8_E4M3_TENSOR, dk_ds=FP8_E4M3FN, dk_q=FP8_E4M3_TENSOR,
        p_lift=256.0, ds_lift=256.0, backward_p=BackwardP.QUANTIZED_QK,
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
    return _fa4fp4_causal("fa4fp4_causal", p=FP8_E4M3FN, v=FP8_E4M3_TENSOR)


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
        "fa4fp4_causal_mxfp4pv", p=MXFP4, v=MXFP4, p_quant=PQuant.DIRECT,
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
    EXACT, FLASH_BF16, FP8_PER_TENSOR, FA3_FP8, SAGEATTN3, ATTN_QAT_DROPIN, ATTN_QAT,
    FA4FP4_DIRECTP, FA4FP4_CAUSAL, FA4FP4_CAUSAL_MXFP4PV, CROISSATTN,
)
