"""The format zoo: exact number formats (element and scale), rounding, block formats.

Vocabulary: a number format is a `FloatFormat` (E2M1, E4M3FN, E8M0, ...); a block format is a
`QuantSpec` (an element format, a scale format, a block shape and the scale arithmetic:
MXFP4, NVFP4, ...). The named ones are module constants (`named`, `block_formats`) and are
registered by name. This package imports nothing else of fp4lab; everything else stands on it.
"""

from fp4lab.formats.block_formats import (
    BLOCK_FORMATS,
    FP8_E4M3_TENSOR,
    FP8_E4M3_TILE128,
    FP8_E4M3_X4,
    FP8_E5M2_TENSOR,
    FP8_E5M2_X4,
    MXFP4,
    MXFP4_ALPHA_CEIL,
    MXFP4_ALPHA_HALF,
    MXFP4_ALPHA_MSE,
    MXFP4_ALPHA_RTE_2D,
    MXFP4_CEIL,
    MXFP4_EVEN,
    MXFP4_RCEIL,
    MXFP6_E2M3,
    MXFP6_E3M2,
    MXFP8_E4M3,
    MXFP8_E4M3_ALPHA_CEIL,
    MXFP8_E5M2,
    MXINT8,
    NVFP4,
    NVFP4_1LEVEL,
    NVFP4_2D,
    NVFP4_DIVIDE_UNROUNDED,
    NVFP4_MS_EDEN,
    NVFP4_RECIPROCAL,
    NVFP4_RECIPROCAL_2LEVEL,
    NVFP4_SR,
    NVFP4_UE5M3,
    TORCHAO_NVFP4,
    TORCHAO_NVFP4_1LEVEL,
)
from fp4lab.formats.float_format import FloatFormat, Specials
from fp4lab.formats.interop import (
    ml_dtype,
    pack_codes,
    to_ml_dtypes,
    to_torch,
    torch_dtype,
    unpack_codes,
)
from fp4lab.formats.named import (
    BF16,
    FORMATS,
    FP4_E2M1,
    FP6_E2M3,
    FP6_E3M2,
    FP8_E4M3FN,
    FP8_E4M3FNUZ,
    FP8_E5M2,
    FP8_E5M2FNUZ,
    FP16,
    FP32,
    INT4,
    INT8,
    UE4M3,
    UE5M3,
    UE5M3_IEEE,
    UE8M0,
)
from fp4lab.formats.quantize import (
    BlockQuantized,
    QuantizedTensor,
    fake_quantize,
    hadamard_matrix,
    quantize,
    quantize_blocks,
    resolve_spec,
)
from fp4lab.formats.registry import get, names, parse_enum, register, unregister
from fp4lab.formats.rounding import Rounding, as_generator, round_to_format
from fp4lab.formats.spec import Correction, QuantSpec, ScaleArithmetic, ScaleRule

__all__ = [
    "FloatFormat", "Specials", "Rounding", "round_to_format", "as_generator", "QuantSpec",
    "ScaleRule", "ScaleArithmetic", "Correction", "QuantizedTensor", "BlockQuantized", "quantize",
    "quantize_blocks", "fake_quantize", "resolve_spec", "hadamard_matrix", "get", "names",
    "parse_enum", "register", "unregister", "pack_codes", "unpack_codes", "torch_dtype",
    "ml_dtype", "to_torch", "to_ml_dtypes",
    # number formats
    "FORMATS", "FP4_E2M1", "FP6_E3M2", "FP6_E2M3", "FP8_E4M3FN", "FP8_E5M2", "FP8_E4M3FNUZ",
    "FP8_E5M2FNUZ", "INT8", "INT4", "UE8M0", "UE4M3", "UE5M3", "UE5M3_IEEE", "BF16", "FP16",
    "FP32",
    # block formats
    "BLOCK_FORMATS", "MXFP4", "MXFP4_CEIL", "MXFP4_EVEN", "MXFP4_RCEIL", "MXFP6_E3M2",
    "MXFP6_E2M3", "MXFP8_E4M3", "MXFP8_E5M2", "MXINT8", "NVFP4", "NVFP4_2D", "NVFP4_1LEVEL",
    "NVFP4_SR", "NVFP4_UE5M3", "FP8_E4M3_TENSOR", "FP8_E5M2_TENSOR", "FP8_E4M3_TILE128",
    "TORCHAO_NVFP4", "TORCHAO_NVFP4_1LEVEL", "MXFP4_ALPHA_CEIL", "MXFP4_ALPHA_MSE",
    "MXFP4_ALPHA_HALF", "MXFP4_ALPHA_RTE_2D", "MXFP8_E4M3_ALPHA_CEIL", "NVFP4_RECIPROCAL",
    "NVFP4_RECIPROCAL_2LEVEL", "NVFP4_DIVIDE_UNROUNDED", "FP8_E4M3_X4", "FP8_E5M2_X4",
    "NVFP4_MS_EDEN",
]
