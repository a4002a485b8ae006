"""The published attention recipes, one preset each, named as their methods.

Each preset follows the released code of its method and cites, in its docstring (kept as the
recipe's `doc`), the file each choice comes from and what could not be verified; where the
paper describes something else, a second preset named ``<name>_paper`` follows the paper.
Facts read from the code are marked as such; "Assumption" marks what could not be.

Released code read for these presets (repository, path):
- FlashAttention-3: Dao-AILab/flash-attention, ``hopper/softmax.h``, ``hopper/flash_api.cpp``,
  ``hopper/flash_fwd_kernel_sm90.h``, ``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp``,
  ``hopper/test_flash_attn.py``; its scales as pytorch/ao's ``torchao/attention/fp8_fa3``
  computes them.
- SageAttention3: thu-ml/SageAttention, ``sageattention3_blackwell/sageattn3/api.py``,
  ``.../blackwell/softmax_fused.h``, ``.../blackwell/mainloop_tma_ws.h``,
  ``.../quantization/fp4_quantization_4d.cu``.
- Attn-QAT: hao-ai-lab/FastVideo, ``fastvideo/attention/backends/attn_qat_train.py``,
  ``fastvideo-kernel/python/fastvideo_kernel/triton_kernels/attn_qat_train.py``,
  ``.../triton_kernels/nvfp4_utils.py``, ``fastvideo-kernel/tests/qat_forward_reference.py``.
- "Hardware-Aware FP4 FlashAttention-4": MrHuff/fp4-fa4, ``release/routes.json``,
  ``tk_fa4/lowp_fa4_bwd/native_tk_d128_nvfp4_score_e5m2_dout_backward.py``,
  ``tk_fa4/native_gqa_tk_bwd/v509_*_bshd.cuh``, ``tk_fa4/lowp_fa4_bwd/projection_fp4_epilogue.cuh``,
  ``tk_fa4/fp4_fa4_fwd/hao_direct_*.inc``, ``tk_fa4/fp4_fa4_fwd/Makefile.hao_direct_fp4pv``,
  the training records ``results/*/training/*.json``; hao-ai-lab/flash-attention-fp4,
  ``flash_attn/cute/README.md``, ``flash_attn/cute/debug/b300_fp4_pv_analysis.md``.
- Quartet II's MS-EDEN: IST-DASLab/Quartet-II (see `fp4lab.formats.block_formats`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math

from fp4lab.formats import (
    BF16,
    FP8_E4M3_TENSOR,
    FP8_E4M3_TILE128,
    FP8_E4M3_X4,
    FP8_E4M3FN,
    FP8_E5M2_TENSOR,
    FP8_E5M2_X4,
    MXFP4_ALPHA_CEIL,
    MXFP4_ALPHA_HALF,
    MXFP4_ALPHA_MSE,
    MXFP8_E4M3,
    MXFP8_E4M3_ALPHA_CEIL,
    NVFP4,
    NVFP4_1LEVEL,
    NVFP4_DIVIDE_UNROUNDED,
    NVFP4_MS_EDEN,
    NVFP4_RECIPROCAL,
    NVFP4_RECIPROCAL_2LEVEL,
    NVFP4_SR,
    register,
)
from fp4lab.recipes.operands import Product
from fp4lab.recipes.recipe import (
    AttentionRecipe,
    BackwardMode,
    BackwardP,
    BackwardV,
    DeltaSource,
    DsP,
    KVOrder,
    PQuant,
    RowReference,
    RowSum,
    SmoothK,
    TensorScope,
)

__all__ = [
    "PRESETS",
    "EXACT",
    "FLASH_BF16",
    "FP8_PER_TENSOR",
    "FA3_FP8",
    "FA3_FP8_PAPER",
    "SAGEATTN3",
    "SAGEATTN3_PAPER",
    "ATTN_QAT",
    "ATTN_QAT_KERNEL",
    "ATTN_QAT_DROPIN",
    "FA4FP4_CAUSAL",
    "FA4FP4_CAUSAL_MXFP4PV",
    "FA4FP4_CAUSAL_MXFP4PV_D64",
    "FA4FP4_CAUSAL_MXFP4PV_FIXED",
    "FA4FP4_CAUSAL_MXFP8PV",
    "FA4FP4_DIRECTP",
    "CROISSATTN",
    "CROISSATTN_EDEN",
]

_BACKWARD_FIELDS = tuple(f for p in Product if p.backward for f in p.fields)


def _preset(build) -> AttentionRecipe:
    """Build a preset, keep its function's docstring as the recipe's `doc`, register it."""
    return register(dataclasses.replace(build(), doc=inspect.cleandoc(build.__doc__)))


# -- references ------------------------------------------------------------------------------
@_preset
def EXACT() -> AttentionRecipe:
    """No quantization: FlashAttention-2 in the working precision, the reference.

    No quantization: FlashAttention-2's tiled forward and backward (Dao 2023,
    arXiv 2307.08691, Algorithms 1 and 2) in the working precision, the reference every
    other recipe is measured against."""
    return AttentionRecipe(name="exact", source="FlashAttention-2 paper, Algorithms 1 and 2")


@_preset
def FLASH_BF16() -> AttentionRecipe:
    """BF16 operands with float32 accumulation, as FlashAttention-2's bf16 kernels.

    BF16 operands with float32 accumulation: every operand of the six products is rounded
    to bfloat16 (round-to-nearest-even), as FlashAttention-2's bf16 kernels do (Dao 2023,
    arXiv 2307.08691), P and dS included (they are converted to bf16 before their matrix
    products).

    Assumption: accumulation happens in the working precision; run float32 inputs to model
    float32 accumulation (float64 inputs accumulate in float64)."""
    return AttentionRecipe.uniform("flash_bf16", BF16, source="FlashAttention-2 bf16 kernels")


@_preset
def FP8_PER_TENSOR() -> AttentionRecipe:
    """FP8 with one scale per tensor (E4M3 forward, E5M2 gradients), a paper recipe.

    FP8 with one scale per tensor, the "hybrid" FP8 training recipe (Micikevicius et al.
    2022, "FP8 Formats for Deep Learning", arXiv 2209.05433): activations and weights (Q, K,
    V, P) in E4M3, gradients (dO, dS) in E5M2, each with an amax-derived FP32 scale.

    No released attention kernel: a paper recipe. Assumptions: Q, K, V, dO take their
    per-tensor scale over the whole tensor passed in; P is cast to E4M3 without a scale (its
    values lie in [0, 1]); dS, which exists only inside the kernel, takes its per-tensor
    scale per tile."""
    return AttentionRecipe(
        name="fp8_per_tensor",
        q=FP8_E4M3_TENSOR,
        k=FP8_E4M3_TENSOR,
        p=FP8_E4M3FN,
        v=FP8_E4M3_TENSOR,
        dv_p=FP8_E4M3FN,
        dv_do=FP8_E5M2_TENSOR,
        dp_do=FP8_E5M2_TENSOR,
        dp_v=FP8_E4M3_TENSOR,
        dq_ds=FP8_E5M2_TENSOR,
        dq_k=FP8_E4M3_TENSOR,
        dk_ds=FP8_E5M2_TENSOR,
        dk_q=FP8_E4M3_TENSOR,
        source="arXiv 2209.05433 (paper)",
    )


# -- FlashAttention-3 --------------------------------------------------------------------------
@_preset
def FA3_FP8() -> AttentionRecipe:
    """FlashAttention-3's FP8 forward as released: per-head scales, 2^8 P, reverse order.

    FlashAttention-3's FP8 forward as released (Dao-AILab/flash-attention, ``hopper/``).

    From the code:
    - Q, K, V in E4M3 with one descale per (batch, kv-head), shared by a query group
      (``flash_api.cpp``: ``q_descale (b, h_k), not (b, h)``; ``flash_fwd_kernel_sm90.h``
      folds q_descale * k_descale into the softmax scale and applies v_descale to O).
    - P stored as 2^8 P in E4M3: the softmax subtracts a max offset of 8 in the log2 domain
      (``softmax.h``, ``Max_offset = 8`` for FP8, ``exp2f(x * scale - (max * scale - 8))``)
      against the running row maximum (the current tile included); the row sum adds the
      unquantized FP32 P (with its 2^8, which cancels in O = acc / sum).
    - Key/value tiles visited from the last to the first
      (``mainloop_fwd_sm90_tma_gmma_ws.hpp``: ``n_block = n_block_max - 1 ... --n_block``).
    - Forward only: the backward here is a high-precision FlashAttention backward from the
      unquantized Q, K against the FP8 forward's log-sum-exp.

    Assumptions: FlashAttention-3 computes no scales (its caller passes them; its own tests
    cast unscaled with random descales): the scales here are amax / 448 per (batch, kv-head)
    as pytorch/ao's ``torchao/attention/fp8_fa3/quantization.py`` computes them
    (``_quantize_per_head``; the amax / 448 rule inside ``_choose_scale_float8`` was not
    read); P's cast is round-to-nearest-even (cutlass's default converter, not opened); the
    kernel's tiles for FP8 were not verified (128 x 128 here); Hopper FP8 WGMMA's reduced
    internal accumulation precision is not modelled."""
    return AttentionRecipe(
        name="fa3_fp8",
        q=FP8_E4M3_TENSOR,
        k=FP8_E4M3_TENSOR,
        v=FP8_E4M3_TENSOR,
        p=FP8_E4M3FN,
        p_lift=256.0,
        kv_order=KVOrder.REVERSE,
        tensor_scope=TensorScope.HEAD,
        backward_p=BackwardP.UNQUANTIZED_QK,
        source="Dao-AILab/flash-attention hopper/ (softmax.h, flash_api.cpp, "
        "mainloop_fwd_sm90_tma_gmma_ws.hpp)",
    )


@_preset
def FA3_FP8_PAPER() -> AttentionRecipe:
    """FlashAttention-3's FP8 forward as its paper: 128-row blocks, incoherent processing.

    FlashAttention-3's FP8 forward as its paper describes it (Shah et al. 2024,
    arXiv 2407.08608, Sec. 3.3), where the released code differs: block quantization of Q,
    K, V in E4M3 with one FP32 scale per 128-row block (the whole head dimension), and
    incoherent processing, Q and K multiplied by a random-sign Hadamard matrix along head_dim
    (it cancels in Q K^T and spreads outliers). Neither is in the released code
    (flash-attention issue #1134; the maintainer in #1699: "per-tensor (more accurately
    per-head) quantization"). The paper's published RMSE with both is 9.1e-3 against 2.4e-2
    for plain per-tensor FP8, on N(0,1) + N(0,100) * Bernoulli(0.001) inputs.

    Assumptions: what the paper does not describe follows `fa3_fp8`'s code (P as 2^8 P in
    E4M3, key/value tiles last to first, a high-precision backward); the block scale is
    amax / 448 in FP32; V's 128-row blocks lie along the key sequence; the Hadamard signs
    come from `incoherent_seed=0`."""
    return AttentionRecipe(
        name="fa3_fp8_paper",
        q=FP8_E4M3_TILE128,
        k=FP8_E4M3_TILE128,
        v=FP8_E4M3_TILE128,
        p=FP8_E4M3FN,
        p_lift=256.0,
        kv_order=KVOrder.REVERSE,
        incoherent_processing=True,
        backward_p=BackwardP.UNQUANTIZED_QK,
        source="arXiv 2407.08608, Sec. 3.3 (paper)",
    )


# -- SageAttention3 ----------------------------------------------------------------------------
@_preset
def SAGEATTN3() -> AttentionRecipe:
    """SageAttention3's FP4 kernel as released: 2688 P against the running maximum.

    SageAttention3's FP4 inference kernel as released (thu-ml/SageAttention,
    ``sageattention3_blackwell/sageattn3/``).

    From the code:
    - K smoothed by its mean over the sequence per (batch, head) (``api.py``,
      ``k -= k.mean(dim=-2, keepdim=True)``); Q minus its mean over each 128-row group
      (``triton_group_mean``: the group's sum over 128, padding rows counting as zeros),
      the mean's product with the smoothed, unquantized K added to S (``delta_s``,
      ``add_delta_s`` initialises the score accumulator with it).
    - Q, K blocked along head_dim and V along the sequence, 16 elements sharing an E4M3
      scale amax / 6, elements multiplied by the reciprocal of the rounded scale, no tensor
      scale (``fp4_quantization_4d.cu``: ``SFValue = vecMax / 6.0f``, rounded to E4M3,
      ``x * SFValueInv``).
    - P = 448 * 6 * exp(S - m), m the running row maximum (the current tile included), E4M3
      block scale (max over 16 keys) / 6 and elements divided by that scale unrounded, the
      scale rounded to E4M3 only for the product (``softmax_fused.h``: ``fp8_scalexfp4_scale``,
      ``acc_conversion_flatten /= AbsMaxP``; ``mainloop_tma_ws.h`` rounds AbsMaxP to UE4M3).
      A tile far below the running maximum gets tiny, coarse scales; there is no per-row
      rescale to the tile's own maximum (that is the paper's, `sageattn3_paper`).
    - The row sum adds the unquantized FP32 P; key/value tiles from the last to the first;
      tiles 128 x 128 (``launch.h``).
    - Inference only (no log-sum-exp is returned): the backward here is a high-precision
      FlashAttention backward from the unquantized (smoothed) Q, K.

    Assumptions and simplifications: the kernel's exp2 is ``ex2.approx.ftz``, modelled as an
    exact exp; the smoothing and ``delta_s`` run in bf16 in the code and in the working
    precision here. Read in the code but not modelled (a GPU run would settle them): the
    causal path's first masking step appears not to add its tile's P V to O (``if
    (masking_step > 0)``), and the first tile reads AbsMaxP before filling it."""
    return AttentionRecipe(
        name="sageattn3",
        q=NVFP4_RECIPROCAL,
        k=NVFP4_RECIPROCAL,
        v=NVFP4_RECIPROCAL,
        p=NVFP4_DIVIDE_UNROUNDED,
        p_lift=448.0 * 6.0,
        smooth_k=SmoothK.PER_HEAD,
        smooth_q=True,
        kv_order=KVOrder.REVERSE,
        block_m=128,
        block_n=128,
        backward_p=BackwardP.UNQUANTIZED_QK,
        source="thu-ml/SageAttention sageattention3_blackwell/sageattn3 (api.py, softmax_fused.h, "
        "fp4_quantization_4d.cu)",
    )


@_preset
def SAGEATTN3_PAPER() -> AttentionRecipe:
    """SageAttention3 as its paper: two-level P, each tile row scaled to 448 * 6.

    SageAttention3 as its paper describes it (Zhang et al. 2025, arXiv 2505.11594,
    Sec. 3.2), where the released kernel differs: two-level P, each row of a tile first
    scaled so that its own maximum maps to 448 * 6, then NVFP4 (E4M3 scale per 16); Q, K, V
    in NVFP4 with their scales rounded before the elements are divided. The released kernel
    (`sageattn3`) scales P against the running maximum instead, which gives a tile far below
    it coarser scales.

    Assumptions: what the paper does not describe follows `sageattn3`'s code (smoothing, V
    along the sequence, tiles, key/value order, the high-precision backward); the per-row
    factor is exact float32."""
    return AttentionRecipe(
        name="sageattn3_paper",
        q=NVFP4_1LEVEL,
        k=NVFP4_1LEVEL,
        p=NVFP4_1LEVEL,
        v=NVFP4_1LEVEL,
        p_quant=PQuant.ROW_SCALED,
        smooth_k=SmoothK.PER_HEAD,
        smooth_q=True,
        kv_order=KVOrder.REVERSE,
        block_m=128,
        block_n=128,
        backward_p=BackwardP.UNQUANTIZED_QK,
        source="arXiv 2505.11594, Sec. 3.2 (paper)",
    )


# -- Attn-QAT ------------------------------------------------------------------------------------
_ATTN_QAT_FORWARD = dict(
    q=NVFP4_RECIPROCAL,
    k=NVFP4_RECIPROCAL,
    v=NVFP4_RECIPROCAL,
    p=NVFP4_RECIPROCAL,
    block_axes=(("v", -1),),
    block_m=32,
    block_n=32,
)


@_preset
def ATTN_QAT() -> AttentionRecipe:
    """Attn-QAT as its training runs: NVFP4 everywhere, a straight-through backward.

    Attn-QAT (arXiv 2603.00040) as its training runs (hao-ai-lab/FastVideo).

    From the code: the training backend (``fastvideo/attention/backends/attn_qat_train.py``)
    sets ``use_qat_qkv_backward``, ``fake_quant_p_bwd`` and ``use_high_prec_o`` and turns off
    K smoothing, Q smoothing, two-level P and both global scales. So, in the kernel
    (``fastvideo-kernel/.../triton_kernels/attn_qat_train.py`` and ``nvfp4_utils.py``):
    - Q, K and V one-level NVFP4, all three blocked along head_dim in 16s (``fake_quantize_q``,
      ``fake_quantize_kv``): scale E4M3(amax / 6), elements times the reciprocal of the
      rounded scale, E2M1 round-to-nearest-even saturating at 6.
    - P = exp(S - m) against the running maximum (the current tile included), one-level
      NVFP4 along the keys; the row sum l and the second output O' = P V^ / l from the
      unquantized P; tiles 32 x 32 forward and backward.
    - Backward: P rebuilt from the fake-quantized Q, K and the log-sum-exp; dV from that
      normalized P re-quantized along the keys (the "legacy re-quantized-P dV"; its forward
      and backward P^ differ, which the trace's ``p_fwd_mismatch`` shows); dP = dO V^^T;
      dS = P * (dP - D) with the unquantized P, D = rowsum(dO * O'), dS cast to bf16;
      dQ = dS K^, dK = dS^T Q^; dO unquantized; straight-through gradients to Q, K, V.

    Assumptions and simplifications: the kernel sums bf16-rounded P into l and O' (modelled
    unrounded); Triton's fp32 division may be approximate (``div.full.f32``), fp4lab divides
    correctly rounded; the GB10 (SM121) dV path and the separately distributed
    ``qat_attn`` package that patches the backward were not modelled (not public)."""
    return AttentionRecipe(
        name="attn_qat",
        **_ATTN_QAT_FORWARD,
        dq_ds=BF16,
        dk_ds=BF16,
        backward=BackwardMode.STRAIGHT_THROUGH,
        delta=DeltaSource.UNQUANTIZED_P_OUTPUT,
        source="hao-ai-lab/FastVideo fastvideo/attention/backends/attn_qat_train.py, "
        "fastvideo-kernel triton_kernels/attn_qat_train.py",
    )


@_preset
def ATTN_QAT_KERNEL() -> AttentionRecipe:
    """Attn-QAT's kernel defaults: K smoothing, two-level P, per-tile global scales.

    FastVideo's Attn-QAT training kernel with its own defaults
    (``fastvideo-kernel/.../triton_kernels/attn_qat_train.py``, ``_attention.forward``:
    ``smooth_k=True, two_level_quant_P=True, use_global_sf_P=True, use_global_sf_QKV=True,
    use_high_prec_o=False``), which the training backend overrides (`attn_qat`).

    From the code: K minus one head_dim vector, its mean over batch, heads and sequence;
    Q, K, V NVFP4 along head_dim with a global scale (6 * 448) / amax per 32-token tile of
    each (batch, head); P two-level, each row of a tile scaled so that its maximum maps to
    448 * 6; D from the quantized output; otherwise as `attn_qat`.

    Assumptions: the two-level P scale multiplies P by 2688 / rowmax before the block amax
    (the kernel scales the block amax / 6 by it), a float32-rounding-level difference."""
    return AttentionRecipe(
        name="attn_qat_kernel",
        **{
            **_ATTN_QAT_FORWARD,
            "q": NVFP4_RECIPROCAL_2LEVEL,
            "k": NVFP4_RECIPROCAL_2LEVEL,
            "v": NVFP4_RECIPROCAL_2LEVEL,
        },
        p_quant=PQuant.ROW_SCALED,
        smooth_k=SmoothK.GLOBAL,
        tensor_scope=TensorScope.TILE,
        dq_ds=BF16,
        dk_ds=BF16,
        backward=BackwardMode.STRAIGHT_THROUGH,
        source="hao-ai-lab/FastVideo fastvideo-kernel triton_kernels/attn_qat_train.py (defaults)",
    )


@_preset
def ATTN_QAT_DROPIN() -> AttentionRecipe:
    """Attn-QAT's unstable baseline: its FP4 forward, a stock high-precision backward.

    The unstable baseline of Attn-QAT (arXiv 2603.00040): `attn_qat`'s FP4 forward dropped
    in front of an ordinary high-precision FlashAttention backward, which recomputes S from
    the unquantized Q, K against the forward's log-sum-exp (so its P is not the forward's)
    and takes D = rowsum(dO * O) from the FP4 output.

    Assumption: the paper's baseline forward is the released training forward (`attn_qat`);
    its code was not found as such."""
    return AttentionRecipe(
        name="attn_qat_dropin",
        **_ATTN_QAT_FORWARD,
        backward_p=BackwardP.UNQUANTIZED_QK,
        source="arXiv 2603.00040 (baseline) with hao-ai-lab/FastVideo's forward",
    )


# -- "Hardware-Aware FP4 FlashAttention-4" (MrHuff/fp4-fa4) ---------------------------------------
_V509_BACKWARD = dict(
    dv_p=FP8_E4M3FN,
    dv_p_lift=256.0,
    dv_do=FP8_E5M2_X4,
    dp_do=FP8_E5M2_X4,
    dp_v=FP8_E4M3_X4,
    dq_ds=FP8_E4M3FN,
    dk_ds=FP8_E4M3FN,
    ds_lift=256.0,
    dq_k=FP8_E4M3_X4,
    dk_q=FP8_E4M3_X4,
    backward_p=BackwardP.QUANTIZED_QK,
    ds_p=DsP.DV_OPERAND,
    delta=DeltaSource.QUANTIZED_DO,
)


def _fa4_qk() -> dict:
    return dict(q=NVFP4_1LEVEL, k=NVFP4_1LEVEL, block_m=128, block_n=128, causal=True)


@_preset
def FA4FP4_CAUSAL() -> AttentionRecipe:
    """FP4 FlashAttention-4's causal training route v509: NVFP4 Q/K, FP8 P/V.

    The causal training route of "Hardware-Aware FP4 FlashAttention-4" with FP8 P/V,
    route v509 (MrHuff/fp4-fa4, ``release/routes.json``: ``causal_nvfp4_qk_fp8_pv_v509``).

    From the code:
    - Q/K NVFP4: 16 head_dim elements share E4M3(amax * (1/6)), elements times the
      reciprocal of the rounded scale, E2M1 round-to-nearest-even; the per-(batch, head)
      global scale is written as 1.0 (``projection_fp4_epilogue.cuh``,
      ``stage_codes_perblock_qk``, ``publish_forward_qk_perblock_scales``).
    - Forward V as E4M3(4 V), decoded by 0.25 (``v_global_decode = 0.25f``).
    - Forward P = exp2(S - m) cast to E4M3 with no lift, m a lazily updated running maximum
      kept while a tile raises it by at most 2^8 (``hao_direct_softmax_reader.inc``:
      ``keep_old_max = correction_log2 >= -8.0f``), so P can reach 256; the row sum adds the
      unquantized FP32 P; key/value tiles first to last; tiles of 128.
    - Backward (v509, ``native_tk_d128_nvfp4_score_e5m2_dout_backward.py``,
      ``v509_*_bshd.cuh``): P rebuilt from the saved NVFP4 Q/K bytes, scales and the row
      log-sum-exp as E4M3(256 P) (``lstat = 8 - LSE log2(e)``); Q, K, V as E4M3(4 x) from
      the projection's accumulator (``gradient_qkv "float8_e4m3fn_represented_x4"``,
      ``qk_backward_source "projection_accumulator_e4m3"``), dO as E5M2(4 dO)
      (``encode_e5m2_pair_x4``): fixed scales, no amax, so E4M3 would flush most of a small
      dO (the paper's 97%) where E5M2 keeps it; D from the decoded E5M2 dO and the output;
      dS = P_e4m3 * (dP - D) with the rounded E4M3 P, stored as E4M3(256 dS); dV = P^T dO,
      dQ = dS K, dK = dS^T Q on those operands, FP32 accumulation.

    Assumptions: the harness's q/k_quant_scale (2.25 / 2.0) was not found applied on the
    per-block path used here; the kernel's partly emulated exp2 (EX2_EMU_MASK) is modelled
    as exact; the backward's key-tile-major order changes only summation order."""
    return AttentionRecipe(
        name="fa4fp4_causal",
        **_fa4_qk(),
        p=FP8_E4M3FN,
        v=FP8_E4M3_X4,
        row_reference=RowReference.LAZY_MAX,
        lazy_rescale_log2=8.0,
        **_V509_BACKWARD,
        source="MrHuff/fp4-fa4 route causal_nvfp4_qk_fp8_pv_v509 (release/routes.json)",
    )


def _fa4_mxfp4pv(name: str, **policy) -> AttentionRecipe:
    fields = dict(
        p=MXFP4_ALPHA_CEIL,
        v=MXFP4_ALPHA_MSE,
        p_quant=PQuant.DIRECT,
        row_sum=RowSum.QUANTIZED_P,
        backward_v=BackwardV.FORWARD,
        source="MrHuff/fp4-fa4 route causal_nvfp4_qk_safe_mxfp4_pv_v509 (release/routes.json)",
    )
    return AttentionRecipe(name=name, **_fa4_qk(), **_V509_BACKWARD, **{**fields, **policy})


# fp4-fa4's anchor margin: BIAS = MARGIN_LOG2 * ln 2 in raw score units, MARGIN_LOG2 = 64
_ANCHOR_MARGIN = 64 * math.log(2)


@_preset
def FA4FP4_CAUSAL_MXFP4PV() -> AttentionRecipe:
    """FP4 FlashAttention-4's MXFP4 P/V route (D128, the 8B runs): every run diverged.

    The causal training route with MXFP4 P/V of "Hardware-Aware FP4 FlashAttention-4",
    the D128 route the 8B runs used (MrHuff/fp4-fa4, ``release/routes.json``:
    ``causal_nvfp4_qk_safe_mxfp4_pv_v509``, "selector 4, anchor32, margin-log2 64,
    stored-scale shift 32, represented-denominator saved LSE"). Every 8B run with it
    diverged (``results/fp4_fa4_technical_report_v2_20260819/receipts/``).

    From the code (``Makefile.hao_direct_fp4pv``, ``hao_direct_fp4pv_softmax_reader.inc``):
    - Q/K as in `fa4fp4_causal`.
    - P as Direct-P codes: the row reference is an anchor, the row's largest score over the
      first 32 keys of key tile 0 plus a margin of 64 ln 2 in raw score units
      (``row_max = quarter_max + HAO_DIRECT_MX_GLOBAL_ANCHOR_BIAS``, 44.36: about 5.7 bits at
      head_dim 128), fixed for every tile; per 32 keys the exponent e_B = ceil(log2 max P)
      (``MX_SCALE_SELECT`` 4, the "max-safe ceiling"), no lower than -94 (stored-scale shift
      32: the working E8M0 is at least 33), codes E2M1(6 P / 2^e_B): the block's largest
      code sits at 2^e_B, not OCP's floor rule.
    - Each P block scale stored 32 exponent steps low (``stored_e8m0 = e8m0 - SHIFT`` in
      ``tk_fa4/fp4_fa4_fwd/hao_direct_fp4pv_kernel.inc``): P V and the denominator run on
      P^ 2^-32 and share it, so O is unchanged and the saved log-sum-exp adds it back
      (``upstream_mx_lse_log2_correction``); it keeps those sums 32 powers of two from
      float32's top (`p_scale_shift`).
    - The denominator summed from the represented P (``QUANTIZED_DENOM``).
    - V in MXFP4 along the sequence, 1 x 32 blocks, elements E2M1(6 x / alpha) with the
      E8M0 alpha rounded up exactly when amax / 2^floor(log2 amax) >= 1.203125
      (``bf16_amax_to_e8m0_1d_mse``, ``v_mxfp4_scale_2d False``).
    - The backward as `fa4fp4_causal`'s, its V the E4M3(4 V^) of the decoded MXFP4 V ("a
      separate represented E4M3 V view", ``PUBLISH_REPRESENTED_V_FP8``), its P from the
      represented-denominator log-sum-exp.

    Assumptions and simplifications: the kernel evaluates 2^x with a piecewise mix of native
    exp2 and a cubic (``PWL_EXP2`` mode 23), modelled as exact exp2; the pair-scale reuse and
    Q1 self-max details were not traced; its first-tile row stabilisation
    (``stabilize_initial_causal_row``) applies without an anchor and is not modelled."""
    return _fa4_mxfp4pv(
        "fa4fp4_causal_mxfp4pv",
        row_reference=RowReference.ANCHOR,
        anchor_keys=32,
        anchor_margin=_ANCHOR_MARGIN,
        p_min_exponent=33 - 127,
        p_scale_shift=32,
    )


@_preset
def FA4FP4_CAUSAL_MXFP4PV_D64() -> AttentionRecipe:
    """The MXFP4 P/V route as the published 1.2B, head_dim 64 records ran it.

    `fa4fp4_causal_mxfp4pv` with the topology the published 1.2B, head_dim 64 training
    records used (MrHuff/fp4-fa4 ``results/causal_isolated_matrix_20260820/training/*.json``,
    ``mx_forward_topology``): shiftless softmax with no anchor (the row reference is 0), the
    exponent by ``MX_SCALE_SELECT`` 1, e_B = floor(log2 max P + 1 - log2 1.5) (rounded up
    only when max P / 2^floor >= 1.5, so a block maximum can clip by up to a third), stored-
    scale shift 16 (exponents down to -110; P V and the denominator on P^ 2^-16,
    `p_scale_shift`); otherwise as `fa4fp4_causal_mxfp4pv`.

    Assumptions: the records' ``causal_interleaved_kv`` order changes summation order only;
    ``stabilize_initial_causal_row`` (rows of query tile 0 whose first-quarter exponent is at
    most the shift are rebased to their exact first-quarter maximum) is not modelled."""
    return _fa4_mxfp4pv(
        "fa4fp4_causal_mxfp4pv_d64",
        p=MXFP4_ALPHA_HALF,
        row_reference=RowReference.ZERO,
        p_min_exponent=17 - 127,
        p_scale_shift=16,
    )


@_preset
def FA4FP4_CAUSAL_MXFP4PV_FIXED() -> AttentionRecipe:
    """The MXFP4 P/V route with MatX's future-leakage fix on the diagonal blocks.

    `fa4fp4_causal_mxfp4pv` with the future-leakage fix of "Future leakage in
    block-quantized attention" (MatX research, matx.com/research/leaky_quantization,
    January 2026): V's 32-token blocks along the sequence let a later token's magnitude set
    the scale an earlier output's value rows are rounded with; the post's fix computes the
    product of each diagonal block of P with the matching block of V from unquantized P and
    V ("using unquantized P and V when multiplying the i-th tile of P with the i-th block of
    V, while using block quantized matrix multiplications everywhere else").

    Assumptions: the post names only V in P V (P is safe: the causal mask zeroes its future
    entries) and says nothing of the backward, which stays `fa4fp4_causal_mxfp4pv`'s (the
    route of MrHuff/fp4-fa4's ``release/routes.json``). The post was read in a third-party
    copy (sdrshn-nmbr/tpu-cake, ``matx/text/pages/future-leakage.md``). No released code
    composes the fix with this route's stored-scale shift: fp4lab's diagonal blocks enter P V
    and the row sum as P 2^-S, in the shifted units the quantized blocks take (P 2^-S where P
    is finite, exp(z - S ln 2) past it), so the fix's own float32 overflow sits at log2 P
    128 + S against the anchor, where the route's P^ saturates instead."""
    return _fa4_mxfp4pv(
        "fa4fp4_causal_mxfp4pv_fixed",
        row_reference=RowReference.ANCHOR,
        anchor_keys=32,
        anchor_margin=_ANCHOR_MARGIN,
        p_min_exponent=33 - 127,
        p_scale_shift=32,
        leakage_fix=True,
        source="MrHuff/fp4-fa4's MXFP4 P/V route with MatX's future-leakage fix",
    )


@_preset
def FA4FP4_CAUSAL_MXFP8PV() -> AttentionRecipe:
    """NVFP4 Q/K with MXFP8 P/V (HAO's mode), with the v509 backward.

    NVFP4 Q/K with MXFP8 P/V, hao-ai-lab/flash-attention-fp4's "NVFP4+MXFP8" mode
    (``flash_attn/cute/README.md``: "E4M3 P/V, E8M0 SFs per 32"), with fp4-fa4's v509
    backward.

    From the code's analysis (``flash_attn/cute/debug/b300_fp4_pv_analysis.md``, "MXFP8
    PV", and mlc-ai/TIRx-kernels' port): P against the current running maximum (no lazy
    rescaling when P/V are quantized), per 32 keys b = ceil(log2 max P), P elements
    E4M3(448 P / 2^b) (the group's largest at most 448); the row sum from the unrounded FP32
    exponentials; V quantized along the keys in 32s by flashinfer's ``mxfp8_quantize``.

    Assumptions: HAO's current source was not in the index (its analysis document and a
    third-party port were read); flashinfer's E8M0 rule for V was not read (OCP's floor rule
    here); the mode is a forward: the backward is `fa4fp4_causal`'s."""
    return AttentionRecipe(
        name="fa4fp4_causal_mxfp8pv",
        **_fa4_qk(),
        p=MXFP8_E4M3_ALPHA_CEIL,
        v=MXFP8_E4M3,
        **_V509_BACKWARD,
        source="hao-ai-lab/flash-attention-fp4 NVFP4+MXFP8 P/V mode; MrHuff/fp4-fa4 v509 backward",
    )


@_preset
def FA4FP4_DIRECTP() -> AttentionRecipe:
    """Direct-P for non-causal inference: E2M1 codes from the scores, MXFP4 P/V.

    Direct-P for non-causal inference, "Hardware-Aware FP4 FlashAttention-4"'s "fast"
    policy (MrHuff/fp4-fa4
    ``reproduction/snapshots/forward_cfc06dad/.../Makefile.hao_direct_fp4pv``,
    ``HAO_FP4PV_MX_POLICY=fast``).

    From the code: NVFP4 Q/K; a shiftless softmax (row reference 0); per 32 keys the
    exponent by ``MX_SCALE_SELECT`` 1 (rounded up when max P / 2^floor >= 1.5), no lower
    than -110 (stored-scale shift 16); codes q = E2M1(max(0, 1.5 x + 1.2)) with
    x = (z - m) log2(e) - e_B + log2(6) on the second to fourth 32-key groups of each key
    tile (stage affine mask 0b1110) and q = E2M1(2^x) on the first; P^ = 2^e_B q / 6, P V
    and the denominator on P^ 2^-16 (`p_scale_shift`); V in MXFP4 with the 1.203125 rule;
    the denominator from the represented P.

    Assumptions and simplifications: the folded K64 Q/K scales are modelled as plain 16-wide
    NVFP4 blocks; native exp2 as exact; Direct-P has no backward of its own: the backward
    here is a high-precision FlashAttention backward from the quantized Q/K and the Direct-P
    log-sum-exp."""
    return AttentionRecipe(
        name="fa4fp4_directp",
        q=NVFP4_1LEVEL,
        k=NVFP4_1LEVEL,
        p=MXFP4_ALPHA_HALF,
        v=MXFP4_ALPHA_MSE,
        p_quant=PQuant.DIRECT,
        row_reference=RowReference.ZERO,
        direct_p_affine=(1.50, 1.20),
        direct_p_affine_groups=0b1110,
        p_min_exponent=17 - 127,
        p_scale_shift=16,
        row_sum=RowSum.QUANTIZED_P,
        block_m=128,
        block_n=128,
        causal=False,
        source="MrHuff/fp4-fa4 Direct-P fast policy (Makefile.hao_direct_fp4pv)",
    )


# -- CroissAttn ------------------------------------------------------------------------------------
@_preset
def CROISSATTN() -> AttentionRecipe:
    """CroissAttn as far as known: six NVFP4 products, a stochastic backward.

    CroissAttn (conference talk; no public paper or code found): all six attention
    products in FP4 (NVFP4), stochastic rounding of the backward operands, and a softmax row
    correction that normalises by the row sum of the quantized P, claimed to make the
    gradient unbiased and to train models from 181M to 8B parameters.

    Assumptions (published detail is scarce; nothing public is known beyond the talk):
    NVFP4 is 16-element E4M3 block scales with an FP32 second-level scale, taken over the
    whole tensor for Q, K, V, dO and per tile for P and dS; the forward rounds to nearest
    even and only the eight backward operands round stochastically (scales round to
    nearest); the backward rebuilds P from the quantized Q/K and the corrected
    log-sum-exp and takes D from the returned output."""
    return AttentionRecipe(
        name="croissattn",
        q=NVFP4,
        k=NVFP4,
        p=NVFP4,
        v=NVFP4,
        **{f: NVFP4_SR for f in _BACKWARD_FIELDS},
        row_sum=RowSum.QUANTIZED_P,
        backward_p=BackwardP.QUANTIZED_QK,
        source="CroissAttn talk (no public code)",
    )


@_preset
def CROISSATTN_EDEN() -> AttentionRecipe:
    """CroissAttn with Quartet II's MS-EDEN on the backward operands.

    `croissattn` with Quartet II's MS-EDEN (arXiv 2601.22813, IST-DASLab/Quartet-II) on
    the eight backward operands instead of element-wise stochastic rounding: a random
    Hadamard transform, round-to-nearest, and a per-block correction folded into a
    stochastically rounded E4M3 scale, unbiased at lower variance (`fp4lab.formats`'
    ``nvfp4_ms_eden`` gives its arithmetic and sources).

    Assumptions: as `croissattn`'s; MS-EDEN's transform runs along each backward product's
    reduction axis in groups of 128, so the tiles and head_dim must be multiples of 128."""
    return AttentionRecipe(
        name="croissattn_eden",
        q=NVFP4,
        k=NVFP4,
        p=NVFP4,
        v=NVFP4,
        **{f: NVFP4_MS_EDEN for f in _BACKWARD_FIELDS},
        row_sum=RowSum.QUANTIZED_P,
        backward_p=BackwardP.QUANTIZED_QK,
        source="CroissAttn talk with IST-DASLab/Quartet-II MS-EDEN",
    )


PRESETS = (
    EXACT,
    FLASH_BF16,
    FP8_PER_TENSOR,
    FA3_FP8,
    FA3_FP8_PAPER,
    SAGEATTN3,
    SAGEATTN3_PAPER,
    ATTN_QAT,
    ATTN_QAT_KERNEL,
    ATTN_QAT_DROPIN,
    FA4FP4_CAUSAL,
    FA4FP4_CAUSAL_MXFP4PV,
    FA4FP4_CAUSAL_MXFP4PV_D64,
    FA4FP4_CAUSAL_MXFP4PV_FIXED,
    FA4FP4_CAUSAL_MXFP8PV,
    FA4FP4_DIRECTP,
    CROISSATTN,
    CROISSATTN_EDEN,
)
