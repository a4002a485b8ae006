"""The named element and scale formats, one literal each, registered by name.

Sources: OCP Microscaling Formats (MX) v1.0 (E2M1, E3M2, E2M3, E8M0, MXINT8); OCP 8-bit
Floating Point v1.0 (E4M3FN, E5M2); the FNUZ variants as in ml_dtypes and AMD's MI300;
NVFP4's UE4M3 block scale (NVIDIA Blackwell, PTX ISA); UE5M3 as the PTX ISA defines it and
the IEEE-style variant of "UE5M3 FP4 Block Scaling for Stable Language Model Pretraining"
(arXiv 2609.02846). Check any number here with `fp4lab formats`.
"""

from fp4lab.formats.float_format import FloatFormat, Specials
from fp4lab.formats.registry import register

__all__ = [
    "FP4_E2M1", "FP6_E3M2", "FP6_E2M3", "FP8_E4M3FN", "FP8_E5M2", "FP8_E4M3FNUZ",
    "FP8_E5M2FNUZ", "UE8M0", "UE4M3", "UE5M3", "UE5M3_IEEE", "INT8", "INT4", "BF16", "FP16",
    "FP32", "FORMATS",
]

# -- element formats ---------------------------------------------------------------------------
FP4_E2M1 = FloatFormat(name="fp4_e2m1", ebits=2, mbits=1, bias=1)  # max 6, no inf/NaN
FP6_E3M2 = FloatFormat(name="fp6_e3m2", ebits=3, mbits=2, bias=3)  # max 28
FP6_E2M3 = FloatFormat(name="fp6_e2m3", ebits=2, mbits=3, bias=1)  # max 7.5
FP8_E4M3FN = FloatFormat(name="fp8_e4m3fn", ebits=4, mbits=3, bias=7, specials=Specials.FN)
FP8_E5M2 = FloatFormat(name="fp8_e5m2", ebits=5, mbits=2, bias=15, specials=Specials.IEEE)
FP8_E4M3FNUZ = FloatFormat(name="fp8_e4m3fnuz", ebits=4, mbits=3, bias=8, specials=Specials.FNUZ)
FP8_E5M2FNUZ = FloatFormat(name="fp8_e5m2fnuz", ebits=5, mbits=2, bias=16, specials=Specials.FNUZ)
# MXINT: sign-magnitude k * 2^-6 (k <= 127) and k * 2^-2 (k <= 7); see float_format's docstring.
INT8 = FloatFormat(name="int8", ebits=1, mbits=6, bias=1)
INT4 = FloatFormat(name="int4", ebits=1, mbits=2, bias=1)

# -- scale formats -----------------------------------------------------------------------------
# E8M0: 2^(E - 127), no zero, 0xFF is NaN.
UE8M0 = FloatFormat(
    name="ue8m0", ebits=8, mbits=0, bias=127, signed=False, subnormals=False, specials=Specials.FN
)
# Unsigned E4M3, the NVFP4 block scale: max 448, 0x7F is NaN.
UE4M3 = FloatFormat(name="ue4m3", ebits=4, mbits=3, bias=7, signed=False, specials=Specials.FN)
# UE5M3 as in the PTX ISA: only 0xFF is NaN, max 1.75 * 2^16 = 114688, smallest 2^-17.
UE5M3 = FloatFormat(name="ue5m3", ebits=5, mbits=3, bias=15, signed=False, specials=Specials.FN)
# UE5M3 with the top exponent reserved IEEE-style (inf and NaN): max 1.875 * 2^15 = 61440.
UE5M3_IEEE = FloatFormat(
    name="ue5m3_ieee", ebits=5, mbits=3, bias=15, signed=False, specials=Specials.IEEE
)

# -- wide formats, for accumulators and high-precision operands ---------------------------------
BF16 = FloatFormat(name="bf16", ebits=8, mbits=7, bias=127, specials=Specials.IEEE)
FP16 = FloatFormat(name="fp16", ebits=5, mbits=10, bias=15, specials=Specials.IEEE)
FP32 = FloatFormat(name="fp32", ebits=8, mbits=23, bias=127, specials=Specials.IEEE)

FORMATS = (
    FP4_E2M1, FP6_E3M2, FP6_E2M3, FP8_E4M3FN, FP8_E5M2, FP8_E4M3FNUZ, FP8_E5M2FNUZ, INT8, INT4,
    UE8M0, UE4M3, UE5M3, UE5M3_IEEE, BF16, FP16, FP32,
)
for _fmt in FORMATS:
    register(_fmt)
