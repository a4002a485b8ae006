"""Rounding onto a format's grid: the element-wise cast emulation `round_to_format`.

How it works. For a value x, the exponent e = floor(log2 |x|) is read exactly from its bit
pattern (`torch.frexp`, subnormals included) and clamped below at the format's emin. The
quantum of the format at that magnitude is 2^q with q = max(e, emin) - mbits. Scaling by
2^-q is a power-of-two multiply, exact in float64 for every float32 and float64 input, so
y = |x| * 2^-q carries x's significand unchanged and the format's grid becomes the integers.
Rounding y to an integer (even, away, toward zero, up, or stochastically) and scaling back
is therefore a single rounding: there is no double rounding, whatever the input dtype.
Overflow, NaN and the sign are applied afterwards according to the format's `Specials`.

Stochastic rounding draws its randomness from an explicit `torch.Generator` (or an int
seed, or a tensor of uniforms in [0, 1)): never from torch's global state, so the same seed
gives the same bits.
"""

from __future__ import annotations

import enum

import torch

from fp4lab.formats.float_format import FloatFormat, Specials, _pow2
from fp4lab.formats.registry import parse_enum

__all__ = ["Rounding", "round_to_format", "as_generator"]


class Rounding(enum.Enum):
    """How a value between two neighbouring grid points lo < |x| < hi is rounded (on |x|)."""

    NEAREST_EVEN = "nearest_even"
    """To the nearer of lo, hi; a tie goes to the one whose last mantissa bit is 0
    (IEEE 754 roundTiesToEven; what every hardware cast to FP8/FP4 does)."""

    NEAREST_AWAY = "nearest_away"
    """To the nearer of lo, hi; a tie goes to hi, away from zero (roundTiesToAway)."""

    TOWARD_ZERO = "toward_zero"
    """To lo: truncation of the discarded bits (roundTowardZero)."""

    AWAY_FROM_ZERO = "away_from_zero"
    """To hi whenever |x| is not on the grid: the magnitude is rounded up. For positive
    values, such as block scales, this is rounding toward +inf (PTX ``cvt.rp``)."""

    STOCHASTIC = "stochastic"
    """To hi with probability (|x| - lo) / (hi - lo), else lo, so E[round(x)] = x.
    With ``sr_bits=None`` the comparison uses a 53-bit uniform and is exactly unbiased
    whenever x has at most 53 bits below the quantum (every float32 input within 2^29 of
    the format's smallest subnormal, and beyond); with ``sr_bits=r`` it models hardware
    stochastic rounding with r random bits added below the kept bits and then truncated:
    P(hi) = floor(2^r (|x| - lo) / (hi - lo)) / 2^r, biased toward zero by less than
    2^-r of a quantum."""

    @classmethod
    def parse(cls, value: Rounding | str) -> Rounding:
        """A member from itself or its name (``"nearest_even"``, ...)."""
        return parse_enum(cls, value, "rounding")


def as_generator(generator: torch.Generator | int | None) -> torch.Generator | None:
    """A torch.Generator from a generator or an int seed (None stays None). An int seed makes
    a CPU generator, so a seed gives the same random numbers on every device."""
    if generator is None or isinstance(generator, torch.Generator):
        return generator
    if isinstance(generator, int) and not isinstance(generator, bool):
        return torch.Generator().manual_seed(generator)
    raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {generator!r}")


def round_to_format(
    x: torch.Tensor,
    fmt: FloatFormat,
    *,
    rounding: Rounding | str = Rounding.NEAREST_EVEN,
    saturate: bool = True,
    generator: torch.Generator | int | None = None,
    sr_bits: int | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Round each element of x to the nearest value of `fmt` (cast emulation), in x's dtype.

    Args:
        x: a floating-point tensor (float16, bfloat16, float32, float64), any shape.
        fmt: the target format.
        rounding: a `Rounding` member or its name.
        saturate: True: values beyond +-max (and +-inf) become +-max, and for formats
            without zero (E8M0) values below the smallest become the smallest. False: the
            format's own behaviour, as ml_dtypes casts: inf for IEEE formats, NaN for FN and
            FNUZ formats, +-max for formats without specials; zero becomes NaN in a format
            without zero.
        generator: torch.Generator or int seed; required by stochastic rounding unless
            `noise` is given.
        sr_bits: number of random bits of stochastic rounding (None: exact, see `Rounding`).
        noise: uniforms in [0, 1) of x's shape to use instead of drawing from `generator`.

    NaN stays NaN (also for formats without a NaN code, so that it stays visible). Negative
    values in an unsigned format become NaN (or 0 where the format has no NaN). The result is
    exact in float64; it is returned in x's dtype, exact whenever the format's values are
    representable there (all formats here fit float32).
    """
    _check_tensor(x, "x")
    if not isinstance(fmt, FloatFormat):
        raise TypeError(f"fmt must be a FloatFormat, got {type(fmt).__name__}")
    rounding = Rounding.parse(rounding)
    if _fast_path_applies(x, fmt, rounding, saturate):
        u = _uniforms(x, generator, noise) if rounding is Rounding.STOCHASTIC else None
        return _round_float32(x.float(), fmt, rounding, u, sr_bits).to(x.dtype)
    w = x.to(torch.float64)
    a = w.abs()
    mant, ex = torch.frexp(torch.where(torch.isfinite(a), a, 0.0))  # a = mant * 2^ex
    # -- the quantum 2^q at |x|'s binade: q = max(e, emin) - mbits, e = floor(log2 |x|) --
    e = torch.clamp(ex.to(torch.int64) - 1, min=fmt.emin, max=fmt.emax + 1)
    q = e - fmt.mbits
    y = torch.where(torch.isfinite(a), a, 0.0) * _pow2(-q)  # exact; the grid is now Z
    r = _round_integer(y, rounding, generator, sr_bits, noise)
    out = r * _pow2(q)
    out = _apply_range(out, a, fmt, saturate)
    return _apply_sign(out, w, fmt).to(x.dtype)


def _fast_path_applies(x, fmt: FloatFormat, rounding: Rounding, saturate: bool) -> bool:
    """Whether `_round_float32` gives the same bits as the float64 path (it is tested to)."""
    return (
        x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and saturate
        and fmt.has_zero
        and rounding in (Rounding.NEAREST_EVEN, Rounding.TOWARD_ZERO, Rounding.STOCHASTIC)
        and fmt.emin - fmt.mbits >= -126
        and fmt.emax + 1 - fmt.mbits <= 126
        and fmt.mbits <= 22
        and fmt.emin <= fmt.mbits
    )


def _round_float32(
    x: torch.Tensor, fmt: FloatFormat, rounding: Rounding, u=None, sr_bits=None
) -> torch.Tensor:
    """The same rounding as the float64 path, on float32, for speed. Masking x's bits down to
    its exponent field gives 2^e as a float (0 for subnormals, inf for inf/NaN); clamping that
    to [2^emin, 2^(emax+1)] and scaling by 2^-mbits gives the quantum 2^q. Dividing by it,
    rounding (RNE and truncation are symmetric in the sign) and multiplying back are exact
    in float32; saturation is a clamp, which keeps NaN. Stochastic rounding splits |x| / 2^q
    into its integer part and fraction (both exact in float32) and compares the fraction
    with the uniforms u: float64 ones in float64, as the float64 path does, float32 ones in
    float32 (the same decisions: both compare exact numbers)."""
    quantum = (x.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2^e of |x|
    quantum.clamp_(2.0**fmt.emin, 2.0 ** (fmt.emax + 1)).mul_(2.0**-fmt.mbits)
    out = torch.div(x, quantum)  # in-place from here: fresh large tensors cost page faults
    if rounding is Rounding.STOCHASTIC:
        out = _stochastic_magnitude(out.abs_(), u, sr_bits).copysign_(x)
    elif rounding is Rounding.NEAREST_EVEN:
        out.round_()
    else:
        out.trunc_()
    out.mul_(quantum).clamp_(-fmt.max, fmt.max)
    if not fmt.signed:  # negative values have no code; -0 becomes +0 below
        out = torch.where(x < 0, torch.nan if fmt.has_nan else 0.0, out)
    if fmt.specials is Specials.FNUZ or not fmt.signed:
        out.add_(0.0)  # -0 + 0 = +0: no negative zero
    return out


def _stochastic_magnitude(y: torch.Tensor, u: torch.Tensor, sr_bits: int | None) -> torch.Tensor:
    """y >= 0 (float32, overwritten) rounded up with probability frac(y), by the uniforms u:
    the same comparisons as `_round_integer`'s, the fraction exact in float32 and compared in
    u's dtype. Float32 uniforms take no comparison (a bool tensor and its conversion cost
    four in-place float32 passes' time): the float32 difference frac - u has the sign of the
    exact one (zero only where they are equal), so ceil(frac - u) clamped to [0, 1] is 1
    exactly where u < frac and 0 (or -0) elsewhere, whatever u holds; NaN (y inf or NaN, or
    u NaN) becomes 0, as the comparison's False."""
    low = torch.floor(y)
    frac = y.sub_(low)
    if sr_bits is None and u.dtype == torch.float32:
        return low.add_(frac.sub_(u).ceil_().clamp_(0, 1).nan_to_num_(nan=0.0))
    if sr_bits is None:
        up = u < frac
    else:
        _check_sr_bits(sr_bits)
        scale = float(1 << sr_bits)
        up = torch.floor(u * scale) < frac.mul_(scale).floor_()  # frac * 2^r is exact
    return low.add_(up.view(torch.uint8))  # 0 or 1 (bool to float is the slow conversion)


def _check_sr_bits(sr_bits) -> None:
    if not isinstance(sr_bits, int) or isinstance(sr_bits, bool) or not 1 <= sr_bits <= 52:
        raise ValueError(f"sr_bits must be an integer in [1, 52] or None, got {sr_bits!r}")


def _round_integer(y, rounding, generator, sr_bits, noise) -> torch.Tensor:
    """y >= 0 rounded to an integer-valued float64 tensor."""
    if rounding is Rounding.NEAREST_EVEN:
        return torch.round(y)  # round-half-to-even
    if rounding is Rounding.NEAREST_AWAY:
        return torch.floor(y + 0.5)  # exact: y < 2^52
    if rounding is Rounding.TOWARD_ZERO:
        return torch.floor(y)
    if rounding is Rounding.AWAY_FROM_ZERO:
        return torch.ceil(y)
    low = torch.floor(y)
    frac = y - low  # exact
    u = _uniforms(y, generator, noise)
    if sr_bits is None:
        up = u < frac
    else:
        _check_sr_bits(sr_bits)
        scale = float(1 << sr_bits)
        up = torch.floor(u * scale) < torch.floor(frac * scale)
    return low + up.to(torch.float64)


def _uniforms(y, generator, noise) -> torch.Tensor:
    """Uniforms of y's shape: the caller's `noise` (float32 kept as it is: every comparison
    with it is exact in float32 as in float64; other dtypes in float64), or float64 draws
    from `generator`."""
    if noise is not None:
        if noise.shape != y.shape:
            raise ValueError(
                f"noise must have x's shape {tuple(y.shape)}, got {tuple(noise.shape)}"
            )
        dtype = torch.float32 if noise.dtype == torch.float32 else torch.float64
        return noise.to(device=y.device, dtype=dtype)
    gen = as_generator(generator)
    if gen is None:
        raise ValueError(
            "generator is required for stochastic rounding (a torch.Generator or an int seed); "
            "fp4lab never draws from torch's global random state"
        )
    return torch.rand(y.shape, generator=gen, dtype=torch.float64, device=gen.device).to(y.device)


def _apply_range(out: torch.Tensor, a: torch.Tensor, fmt: FloatFormat, saturate: bool):
    """Overflow, underflow (formats without zero) and NaN, on magnitudes."""
    big = (out > fmt.max) | torch.isinf(a)
    if saturate or fmt.specials is Specials.NONE:
        out = torch.where(big, fmt.max, out)
    else:
        out = torch.where(big, torch.inf if fmt.has_inf else torch.nan, out)
    if not fmt.has_zero:
        tiny = out < fmt.min_normal
        zero_to = fmt.min_normal if saturate or not fmt.has_nan else torch.nan
        out = torch.where(tiny & (a > 0), fmt.min_normal, out)
        out = torch.where(tiny & (a == 0), zero_to, out)
    return torch.where(torch.isnan(a), torch.nan, out)


def _apply_sign(out: torch.Tensor, w: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The input's sign onto the rounded magnitude (NaN keeps its sign, as ml_dtypes)."""
    negative = torch.signbit(w)
    if not fmt.signed:
        bad = torch.nan if fmt.has_nan else 0.0
        negative = negative & ~torch.isnan(w) & (w != 0)
        return torch.where(negative, bad, torch.where(w == 0, out.abs(), out))
    if fmt.specials is Specials.FNUZ:
        negative = negative & (out != 0)  # no negative zero
    return torch.where(negative, -out, out)


def _check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
