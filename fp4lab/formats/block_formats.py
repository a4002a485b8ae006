"""The named block formats, one `QuantSpec` literal each, registered by name.

Sources: OCP Microscaling Formats (MX) v1.0 (the MX formats: blocks of 32 sharing an E8M0
scale, with torchao's three other ways of choosing it); NVIDIA's NVFP4 (E2M1 with a UE4M3
scale per 16 and an FP32 tensor scale) as Transformer Engine's reference quantizer computes
it, and as torchao's ``nvfp4_quantize`` does; UE5M3 scales ("UE5M3 FP4 Block Scaling for
Stable Language Model Pretraining", arXiv 2609.02846); per-tensor FP8 (Micikevicius et al.
2022, arXiv 2209.05433); FlashAttention-3's 128-row FP8 blocks (arXiv 2407.08608, Sec. 3.3).
The block formats of released attention kernels, each citing its file: the alpha-grid
E8M0 rules of MrHuff/fp4-fa4 and hao-ai-lab/flash-attention-fp4, the reciprocal multiply of
thu-ml/SageAttention and hao-ai-lab/FastVideo, SageAttention's division of P by its unrounded
scale, fp4-fa4's fixed-scale FP8 operands, and Quartet II's MS-EDEN (IST-DASLab/Quartet-II).
The attention recipes of `fp4lab.recipes` use these constants; `fp4lab formats` prints them.
"""

from __future__ import annotations

from fp4lab.formats.named import (
    FP4_E2M1,
    FP6_E2M3,
    FP6_E3M2,
    FP8_E4M3FN,
    FP8_E5M2,
    FP32,
    INT8,
    UE4M3,
    UE5M3,
    UE8M0,
)
from fp4lab.formats.registry import register
from fp4lab.formats.rounding import Rounding
from fp4lab.formats.spec import Correction, QuantSpec, ScaleArithmetic, ScaleRule

__all__ = [
    "MXFP4", "MXFP4_CEIL", "MXFP4_EVEN", "MXFP4_RCEIL", "MXFP6_E3M2", "MXFP6_E2M3",
    "MXFP8_E4M3", "MXFP8_E5M2", "MXINT8", "NVFP4", "NVFP4_2D", "NVFP4_1LEVEL", "NVFP4_SR",
    "NVFP4_UE5M3", "FP8_E4M3_TENSOR", "FP8_E5M2_TENSOR", "FP8_E4M3_TILE128", "TORCHAO_NVFP4",
    "TORCHAO_NVFP4_1LEVEL", "MXFP4_ALPHA_CEIL", "MXFP4_ALPHA_MSE", "MXFP4_ALPHA_HALF",
    "MXFP4_ALPHA_RTE_2D", "MXFP8_E4M3_ALPHA_CEIL", "NVFP4_RECIPROCAL", "NVFP4_RECIPROCAL_2LEVEL",
    "NVFP4_DIVIDE_UNROUNDED", "FP8_E4M3_X4", "FP8_E5M2_X4", "NVFP4_MS_EDEN", "BLOCK_FORMATS",
]


def _mx(name: str, element, rule: ScaleRule = ScaleRule.OCP_FLOOR) -> QuantSpec:
    """An OCP MX v1.0 format: blocks of 32 sharing an E8M0 scale."""
    return QuantSpec(name=name, element=element, scale=UE8M0, block=(32,), scale_rule=rule)


def _nvfp4(name: str, block: tuple[int, ...], **fields) -> QuantSpec:
    """NVFP4 with Transformer Engine's reference arithmetic (ScaleArithmetic.TE_ENCODE)."""
    fields.setdefault("tensor_scale", True)
    return QuantSpec(
        name=name, element=FP4_E2M1, scale=UE4M3, block=block, scale_rule=ScaleRule.NEAREST,
        arithmetic=ScaleArithmetic.TE_ENCODE, **fields,
    )


def _torchao_nvfp4(name: str, tensor_scale: bool) -> QuantSpec:
    """torchao's ``nvfp4_quantize``: two-level (its per_tensor_amax_to_scale) or single."""
    return QuantSpec(
        name=name, element=FP4_E2M1, scale=UE4M3, block=(16,), scale_rule=ScaleRule.NEAREST,
        tensor_scale=tensor_scale, arithmetic=ScaleArithmetic.TORCHAO_DECODE,
        scale_floor=UE4M3.min_normal,
    )


def _per_tensor(name: str, element) -> QuantSpec:
    """One float32 scale fl(A / M_e) for the whole tensor."""
    return QuantSpec(
        name=name, element=element, scale=FP32, block=None, scale_rule=ScaleRule.NEAREST
    )


# -- OCP MX ------------------------------------------------------------------------------------
MXFP4 = _mx("mxfp4", FP4_E2M1)
MXFP4_CEIL = _mx("mxfp4_ceil", FP4_E2M1, ScaleRule.CEIL)
MXFP4_EVEN = _mx("mxfp4_even", FP4_E2M1, ScaleRule.EVEN)
MXFP4_RCEIL = _mx("mxfp4_rceil", FP4_E2M1, ScaleRule.RCEIL)
MXFP6_E3M2 = _mx("mxfp6_e3m2", FP6_E3M2)
MXFP6_E2M3 = _mx("mxfp6_e2m3", FP6_E2M3)
MXFP8_E4M3 = _mx("mxfp8_e4m3", FP8_E4M3FN)
MXFP8_E5M2 = _mx("mxfp8_e5m2", FP8_E5M2)
MXINT8 = _mx("mxint8", INT8)

# -- NVFP4 -------------------------------------------------------------------------------------
NVFP4 = _nvfp4("nvfp4", (16,))
NVFP4_2D = _nvfp4("nvfp4_2d", (16, 16))  # Transformer Engine's weight tiles
# no FP32 tensor scale: MrHuff/fp4-fa4's Q/K quantizer (stage_codes_perblock_qk)
NVFP4_1LEVEL = _nvfp4("nvfp4_1level", (16,), tensor_scale=False)
NVFP4_SR = _nvfp4("nvfp4_sr", (16,), rounding=Rounding.STOCHASTIC)  # scales stay nearest
NVFP4_UE5M3 = QuantSpec(
    name="nvfp4_ue5m3", element=FP4_E2M1, scale=UE5M3, block=(16,), scale_rule=ScaleRule.NEAREST
)
TORCHAO_NVFP4 = _torchao_nvfp4("torchao_nvfp4", tensor_scale=True)
TORCHAO_NVFP4_1LEVEL = _torchao_nvfp4("torchao_nvfp4_1level", tensor_scale=False)

# -- FP8 with one float32 scale per tensor or per tile -----------------------------------------
FP8_E4M3_TENSOR = _per_tensor("fp8_e4m3_tensor", FP8_E4M3FN)
FP8_E5M2_TENSOR = _per_tensor("fp8_e5m2_tensor", FP8_E5M2)
# One FP32 scale per 128 rows x the whole head_dim (tiles of 128 x 256 cover any head_dim up to
# 256; zero padding leaves the amax unchanged): FlashAttention-3 paper's block quantization.
FP8_E4M3_TILE128 = QuantSpec(
    name="fp8_e4m3_tile128", element=FP8_E4M3FN, scale=FP32, block=(128, 256),
    scale_rule=ScaleRule.NEAREST,
)

# -- alpha grid: the block's largest code at 2^E (E8M0), decode scale 2^E / M_e --------------
# MrHuff/fp4-fa4, tk_fa4/lowp_fa4_bwd/projection_fp4_epilogue.cuh (see ScaleRule.alpha_grid)
MXFP4_ALPHA_CEIL = _mx("mxfp4_alpha_ceil", FP4_E2M1, ScaleRule.ALPHA_CEIL)  # P, "max-safe"
MXFP4_ALPHA_MSE = _mx("mxfp4_alpha_mse", FP4_E2M1, ScaleRule.ALPHA_MSE)  # V, 1 x 32 blocks
MXFP4_ALPHA_HALF = _mx("mxfp4_alpha_half", FP4_E2M1, ScaleRule.ALPHA_HALF)  # "shifted floor"
MXFP4_ALPHA_RTE_2D = QuantSpec(  # fp4-fa4's 32 x 32 tiles
    name="mxfp4_alpha_rte_2d", element=FP4_E2M1, scale=UE8M0, block=(32, 32),
    scale_rule=ScaleRule.ALPHA_RTE,
)
# hao-ai-lab/flash-attention-fp4's NVFP4+MXFP8 P/V mode: P = E4M3_RN_sat(448 P / 2^ceil(log2 max P))
MXFP8_E4M3_ALPHA_CEIL = _mx("mxfp8_e4m3_alpha_ceil", FP8_E4M3FN, ScaleRule.ALPHA_CEIL)

# -- E4M3 scales of 16 with a reciprocal multiply, or a division by the unrounded scale ---------
# thu-ml/SageAttention, sageattention3_blackwell/sageattn3/quantization/fp4_quantization_4d.cu
NVFP4_RECIPROCAL = QuantSpec(
    name="nvfp4_reciprocal", element=FP4_E2M1, scale=UE4M3, block=(16,),
    scale_rule=ScaleRule.NEAREST, arithmetic=ScaleArithmetic.RECIPROCAL,
)
# hao-ai-lab/FastVideo, fastvideo-kernel/python/fastvideo_kernel/triton_kernels/nvfp4_utils.py
NVFP4_RECIPROCAL_2LEVEL = QuantSpec(
    name="nvfp4_reciprocal_2level", element=FP4_E2M1, scale=UE4M3, block=(16,),
    scale_rule=ScaleRule.NEAREST, tensor_scale=True, arithmetic=ScaleArithmetic.RECIPROCAL,
)
# thu-ml/SageAttention, sageattention3_blackwell/sageattn3/blackwell/softmax_fused.h (P)
NVFP4_DIVIDE_UNROUNDED = QuantSpec(
    name="nvfp4_divide_unrounded", element=FP4_E2M1, scale=UE4M3, block=(16,),
    scale_rule=ScaleRule.NEAREST, arithmetic=ScaleArithmetic.DIVIDE_UNROUNDED,
)

# -- fixed scales: fp4-fa4 v509 stores E4M3(4 x) and E5M2(4 dO), decoded by 0.25 ----------------
# tk_fa4/lowp_fa4_bwd/native_tk_d128_nvfp4_score_e5m2_dout_backward.py (v_global_decode = 0.25f)
FP8_E4M3_X4 = QuantSpec(
    name="fp8_e4m3_x4", element=FP8_E4M3FN, scale=FP32, block=None,
    scale_rule=ScaleRule.NEAREST, fixed_scale=0.25,
)
FP8_E5M2_X4 = QuantSpec(
    name="fp8_e5m2_x4", element=FP8_E5M2, scale=FP32, block=None,
    scale_rule=ScaleRule.NEAREST, fixed_scale=0.25,
)

# -- Quartet II's MS-EDEN (IST-DASLab/Quartet-II, kernels/csrc/group_transform_and_eden.cu) -----
# backward scale_override = (17 / 16) * 0.93 (kernels/python/quartet2/linear.py): c = 6 / it
NVFP4_MS_EDEN = QuantSpec(
    name="nvfp4_ms_eden", element=FP4_E2M1, scale=UE4M3, block=(16,),
    scale_rule=ScaleRule.NEAREST, tensor_scale=True, hadamard=128,
    correction=Correction.EDEN, amax_target=6.0 / ((17 / 16) * 0.93),
)

BLOCK_FORMATS = (
    MXFP4, MXFP4_CEIL, MXFP4_EVEN, MXFP4_RCEIL, MXFP6_E3M2, MXFP6_E2M3, MXFP8_E4M3, MXFP8_E5M2,
    MXINT8, NVFP4, NVFP4_2D, NVFP4_1LEVEL, NVFP4_SR, NVFP4_UE5M3, FP8_E4M3_TENSOR,
    FP8_E5M2_TENSOR, FP8_E4M3_TILE128, TORCHAO_NVFP4, TORCHAO_NVFP4_1LEVEL, MXFP4_ALPHA_CEIL,
    MXFP4_ALPHA_MSE, MXFP4_ALPHA_HALF, MXFP4_ALPHA_RTE_2D, MXFP8_E4M3_ALPHA_CEIL,
    NVFP4_RECIPROCAL, NVFP4_RECIPROCAL_2LEVEL, NVFP4_DIVIDE_UNROUNDED, FP8_E4M3_X4, FP8_E5M2_X4,
    NVFP4_MS_EDEN,
)
for _spec in BLOCK_FORMATS:
    register(_spec)
