"""The simulation path: attention with quantized operands, its recipes and its trace."""

from fp4lab.analysis.recipe import (
    AttentionRecipe, BackwardMode, BackwardP, DeltaSource, PQuant, Product, RowSum,
    resolve_recipe,
)
from fp4lab.analysis.trace import Trace
from fp4lab.analysis.attention import attention, patch_sdpa, quantize_operand

__all__ = [
    "AttentionRecipe", "BackwardMode", "BackwardP", "DeltaSource", "PQuant", "Product",
    "RowSum", "resolve_recipe", "Trace", "attention", "patch_sdpa", "quantize_operand",
]
from fp4lab.analysis.bias import GradientBias, gradient_bias
from fp4lab.analysis.compare import Comparison, compare, saturation
from fp4lab.analysis.inputs import AttentionInputs, SyntheticConfig, load_inputs, save_inputs, synthetic_inputs

__all__ += [
    "Comparison", "compare", "saturation", "GradientBias", "gradient_bias", "AttentionInputs",
    "SyntheticConfig", "load_inputs", "save_inputs", "synthetic_inputs",
]
