"""Element and scale number formats: one frozen literal per format, every other number derived.

A `FloatFormat` says how a code's bits map to a value: a sign bit (or none), `ebits` exponent
bits with a `bias`, `mbits` mantissa bits, whether the all-zero exponent field holds
subnormals, and which codes are special (`Specials`). `max`, `min_normal`, `min_subnormal`,
`emax`, `emin`, the number of codes and the sorted grid of values are derived from those
fields, never written down twice (the habit of Graphcore's gfloat and of ml_dtypes).

`decode` maps codes to values and `encode` maps values that lie on the grid back to codes,
both with plain integer and power-of-two arithmetic that is exact in float64. Rounding an
arbitrary value onto the grid is `fp4lab.formats.rounding.round_to_format`.

Integer block formats (MXINT8, MXINT4) are sign-magnitude fixed point. They are written as
E1M6 and E1M2 with bias 1: the subnormal binade and the single normal binade together give
the evenly spaced grid k * 2^-6 (k = 0..127) and k * 2^-2 (k = 0..7), which is the symmetric
MXINT grid of the OCP MX v1.0 specification (section 5.3).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch

__all__ = ["Specials", "FloatFormat"]


class Specials(enum.Enum):
    """Which codes of a format are infinities or NaN."""

    NONE = "none"
    """Every code is a finite number; there is no inf and no NaN (E2M1, E3M2, E2M3, INT)."""

    FN = "fn"
    """Finite with NaN: only the all-ones magnitude code is NaN; no infinities (E4M3FN,
    UE8M0, UE4M3, UE5M3). With no mantissa bits (E8M0) that code is a whole binade."""

    FNUZ = "fnuz"
    """Finite, NaN, unsigned zero: the negative-zero code (sign bit alone) is the only NaN,
    so there is no -0 and no inf (E4M3FNUZ, E5M2FNUZ). Needs a sign bit."""

    IEEE = "ieee"
    """IEEE 754 style: the all-ones exponent field is reserved, mantissa zero is +-inf and any
    other mantissa is NaN (E5M2, BF16, FP16, FP32)."""


@dataclass(frozen=True, kw_only=True)
class FloatFormat:
    """A binary floating-point (or fixed-point) number format, exact to the bit.

    Attributes:
        name: registry name, e.g. ``"fp8_e4m3fn"``.
        ebits: exponent field width (at least 1).
        mbits: mantissa (fraction) field width.
        bias: exponent bias; a normal code with exponent field E has exponent E - bias.
        signed: whether the code has a sign bit (the top bit).
        subnormals: True: the all-zero exponent field holds zero and the subnormals
            0.M * 2^emin. False: that field is an ordinary binade 1.M * 2^-bias, so the format
            has neither zero nor subnormals (as E8M0).
        specials: which codes are inf or NaN.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    signed: bool = True
    subnormals: bool = True
    specials: Specials = Specials.NONE

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.ebits, int) or self.ebits < 1:
            raise ValueError(f"ebits must be an integer >= 1, got {self.ebits!r}")
        if not isinstance(self.mbits, int) or self.mbits < 0:
            raise ValueError(f"mbits must be an integer >= 0, got {self.mbits!r}")
        if self.bits > 32:
            raise ValueError(f"a format has at most 32 bits, {self.name} has {self.bits}")
        if not isinstance(self.specials, Specials):
            raise TypeError(f"specials must be a Specials member, got {self.specials!r}")
        if self.specials is Specials.FNUZ and not self.signed:
            raise ValueError("specials=FNUZ needs signed=True: its NaN is the negative-zero code")
        if self.specials is Specials.IEEE and self.ebits < 2:
            raise ValueError("specials=IEEE needs ebits >= 2 to keep a finite binade")
        if not (-1022 + self.mbits < self.emin and self.emax < 1023):
            raise ValueError(f"{self.name}: exponents must stay inside float64's normal range")

    # -- bit layout -------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total width of a code in bits."""
        return int(self.signed) + self.ebits + self.mbits

    @property
    def num_codes(self) -> int:
        """Number of distinct bit patterns, 2^bits (special codes included)."""
        return 1 << self.bits

    @property
    def code_dtype(self) -> torch.dtype:
        """Smallest torch integer dtype that holds every code (uint8 up to 8 bits)."""
        if self.bits <= 8:
            return torch.uint8
        return torch.int16 if self.bits <= 15 else torch.int32 if self.bits <= 31 else torch.int64

    @property
    def _magnitude_mask(self) -> int:
        return (1 << (self.ebits + self.mbits)) - 1

    @property
    def sign_code(self) -> int:
        """The code of the sign bit alone (0 for unsigned formats)."""
        return (1 << (self.ebits + self.mbits)) if self.signed else 0

    @property
    def max_code(self) -> int:
        """Magnitude code of the largest finite value."""
        top = self._magnitude_mask
        if self.specials is Specials.FN:
            return top - 1
        if self.specials is Specials.IEEE:
            return (((1 << self.ebits) - 1) << self.mbits) - 1
        return top

    @property
    def nan_code(self) -> int | None:
        """The canonical NaN code (positive where a sign exists), or None if there is none."""
        if self.specials is Specials.FN:
            return self._magnitude_mask
        if self.specials is Specials.FNUZ:
            return self.sign_code
        if self.specials is Specials.IEEE:  # the quiet NaN: top mantissa bit set
            return (((1 << self.ebits) - 1) << self.mbits) | (1 << max(self.mbits - 1, 0))
        return None

    @property
    def inf_code(self) -> int | None:
        """The +inf code, or None if the format has no infinities."""
        if self.specials is Specials.IEEE:
            return ((1 << self.ebits) - 1) << self.mbits
        return None

    @property
    def has_nan(self) -> bool:
        return self.nan_code is not None

    @property
    def has_inf(self) -> bool:
        return self.inf_code is not None

    @property
    def has_zero(self) -> bool:
        return self.subnormals

    # -- derived numbers --------------------------------------------------------------------
    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias if self.subnormals else -self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite value."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def max(self) -> float:
        """Largest finite value."""
        return self._decode_magnitude(self.max_code)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, 2^emin."""
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value: 2^(emin - mbits) with subnormals, else min_normal."""
        if self.subnormals and self.mbits > 0:
            return 2.0 ** (self.emin - self.mbits)
        return self.min_normal

    @functools.cached_property
    def values(self) -> torch.Tensor:
        """All finite values of the format, sorted ascending, each once (float64)."""
        if self.bits > 16:
            raise ValueError(f"{self.name} has 2^{self.bits} codes: too many to list")
        v = self.decode(torch.arange(self.num_codes, dtype=torch.int64), dtype=torch.float64)
        return torch.unique(v[torch.isfinite(v)])

    # -- codes <-> values -------------------------------------------------------------------
    def _decode_magnitude(self, code: int) -> float:
        e_field, m_field = code >> self.mbits, code & ((1 << self.mbits) - 1)
        if e_field == 0 and self.subnormals:
            return m_field * 2.0 ** (self.emin - self.mbits)
        return ((1 << self.mbits) + m_field) * 2.0 ** (e_field - self.bias - self.mbits)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values of integer codes (any integer dtype, any shape), computed exactly in float64."""
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
        c = codes.to(torch.int64) & ((1 << self.bits) - 1)
        mag = c & self._magnitude_mask
        e_field = mag >> self.mbits
        m_field = (mag & ((1 << self.mbits) - 1)).to(torch.float64)
        normal = (m_field + (1 << self.mbits)) * _pow2(e_field - self.bias - self.mbits)
        if self.subnormals:
            sub = m_field * 2.0 ** (self.emin - self.mbits)
            value = torch.where(e_field == 0, sub, normal)
        else:
            value = normal
        if self.signed:
            value = torch.where((c & self.sign_code) != 0, -value, value)
        if self.inf_code is not None:
            value = torch.where(mag == self.inf_code, torch.inf * value.sign(), value)
            value = torch.where(mag > self.inf_code, torch.nan, value)
        elif self.specials is Specials.FN:
            value = torch.where(mag == self.nan_code, torch.nan, value)
        elif self.specials is Specials.FNUZ:
            value = torch.where(c == self.nan_code, torch.nan, value)
        return value.to(dtype)

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Codes of values that lie on the format's grid (the output of `round_to_format`).

        NaN maps to `nan_code` (0 for formats without NaN: a block quantizer marks such a
        block through its NaN scale instead), +-inf to the inf codes (the NaN code, or +-max,
        where the format has none). A value off the grid raises ValueError.
        """
        if not values.dtype.is_floating_point:
            raise TypeError(f"values must be a floating-point tensor, got {values.dtype}")
        v = values.to(torch.float64)
        a = v.abs()
        finite = torch.isfinite(v)
        mant, ex = torch.frexp(torch.where(finite, a, 0.0))  # a = mant * 2^ex, mant in [0.5, 1)
        exponent = torch.clamp(ex.to(torch.int64) - 1, min=self.emin)
        e_field = exponent - self.emin + (1 if self.subnormals else 0)
        significand = torch.where(finite, a, 0.0) * _pow2(self.mbits - exponent)
        is_sub = significand < (1 << self.mbits)
        if self.subnormals:
            e_field = torch.where(is_sub, 0, e_field)
        m_field = significand.to(torch.int64) - torch.where(is_sub, 0, 1 << self.mbits)
        off_grid = finite & ((significand != torch.floor(significand)) | (a > self.max))
        if not self.subnormals:
            off_grid = off_grid | (finite & is_sub)
        if bool(off_grid.any()):
            bad = v[off_grid][0].item()
            raise ValueError(f"values: {bad!r} is not a value of {self.name}; round it first")
        code = (e_field << self.mbits) | m_field
        if self.signed:
            negative = torch.signbit(v) & ~torch.isnan(v)
            if self.specials is Specials.FNUZ:
                negative = negative & (code != 0)
            code = torch.where(negative, code | self.sign_code, code)
        code = self._encode_specials(code, v)
        return code.to(self.code_dtype)

    def _encode_specials(self, code: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sign = torch.where(torch.signbit(v), self.sign_code, 0) if self.signed else 0
        if self.inf_code is not None:
            code = torch.where(torch.isinf(v), self.inf_code | sign, code)
        elif self.nan_code is not None:
            code = torch.where(torch.isinf(v), self.nan_code, code)
        else:
            code = torch.where(torch.isinf(v), self.max_code | sign, code)
        nan = self.nan_code or 0
        if self.specials in (Specials.FN, Specials.IEEE):
            nan = torch.where(torch.signbit(v), nan | self.sign_code, nan) if self.signed else nan
        return torch.where(torch.isnan(v), nan, code)

    def __str__(self) -> str:
        return self.name


def _pow2(k: torch.Tensor | int) -> torch.Tensor:
    """2^k in float64 built from its bit pattern: exact for integer k in [-1022, 1023]."""
    k = torch.as_tensor(k, dtype=torch.int64)
    return ((k + 1023) << 52).view(torch.float64)
