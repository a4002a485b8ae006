"""fp4lab: a numerics lab for low-precision attention.

The format zoo (`fp4lab.formats`) defines every element and scale format and block-scaling
recipe exactly; the simulation path (`fp4lab.analysis`) runs attention with any operand
quantized and measures what quantization did; the kernels (`fp4lab.kernels`) run the same
recipes on the GPU. `fp4lab.attention(..., backend="reference")` runs attention on an
explicitly chosen backend; `compare` and `gradient_bias` measure a recipe against exact
attention. See the README for a tour.
"""

from fp4lab.analysis import compare, patch_sdpa
from fp4lab.backends import attention, gradient_bias
from fp4lab.formats import (
    FloatFormat,
    QuantizedTensor,
    QuantSpec,
    Rounding,
    ScaleArithmetic,
    ScaleRule,
    Specials,
    fake_quantize,
    quantize,
    round_to_format,
)
from fp4lab.recipes import AttentionRecipe, Trace

__version__ = "0.1.0"

__all__ = [
    "FloatFormat",
    "QuantSpec",
    "QuantizedTensor",
    "Rounding",
    "ScaleArithmetic",
    "ScaleRule",
    "Specials",
    "fake_quantize",
    "quantize",
    "round_to_format",
    "attention",
    "patch_sdpa",
    "Trace",
    "AttentionRecipe",
    "compare",
    "gradient_bias",
    "__version__",
]
