"""The simulation path: attention with quantized operands, its recipes, its trace, and the
measurements built on them (compare, gradient_bias, quantization error, plots).

Note: `fp4lab.analysis.attention` and `fp4lab.analysis.compare` are the functions; their
modules are reached with ``from fp4lab.analysis.attention import ...``.
"""

from fp4lab.analysis.bias import GradientBias, gradient_bias
from fp4lab.analysis.compare import Comparison, compare, saturation
from fp4lab.analysis.flash import attention, patch_sdpa
from fp4lab.analysis.inputs import (
    AttentionInputs,
    SyntheticConfig,
    load_inputs,
    save_inputs,
    synthetic_inputs,
)
from fp4lab.analysis.quantizers import quantize_operand

__all__ = [
    "attention",
    "patch_sdpa",
    "quantize_operand",
    "Comparison",
    "compare",
    "saturation",
    "GradientBias",
    "gradient_bias",
    "AttentionInputs",
    "SyntheticConfig",
    "load_inputs",
    "save_inputs",
    "synthetic_inputs",
]
