"""fp4lab: a numerics lab for low-precision attention.

The format zoo (`fp4lab.formats`) defines every element and scale format and block-scaling
recipe exactly; the simulation path (`fp4lab.analysis`) runs attention with any operand
quantized and measures what quantization did; the kernels (`fp4lab.kernels`) run the same
recipes on the GPU. See the README for a tour.
"""

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

__version__ = "0.1.0"

__all__ = [
    "FloatFormat", "QuantSpec", "QuantizedTensor", "Rounding", "ScaleArithmetic", "ScaleRule",
    "Specials", "fake_quantize", "quantize", "round_to_format", "__version__",
]
