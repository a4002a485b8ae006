"""round_to_format: oracles (ml_dtypes, numpy float16, a brute-force grid search), every
rounding mode, overflow policies, stochastic rounding statistics, and properties."""

import math

import ml_dtypes  # noqa: F401  (the oracle; imported so a missing install fails loudly here)
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fp4lab.formats as F
from fp4lab.formats import Rounding, Specials, round_to_format
from fp4lab.formats.interop import ml_dtype

from .helpers import assert_same_bits

ML_FORMATS = [f for f in F.FORMATS if ml_dtype(f) is not None]
GRID_FORMATS = [f for f in F.FORMATS if f.bits <= 8 and f.signed]
SPECIALS = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan])


def codes_midpoints_and_random(fmt, n_random: int, seed: int = 0) -> torch.Tensor:
    """Every value, every midpoint between neighbours (and a hair either side of it), and
    n_random log-uniform values over the whole range, subnormals included, both signs."""
    v = fmt.values if fmt.bits <= 16 else torch.tensor([fmt.max])
    mids = (v[1:] + v[:-1]) / 2
    hair = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    gen = torch.Generator().manual_seed(seed)
    lo, hi = math.log2(fmt.min_subnormal) - 4, math.log2(fmt.max) + 2
    mag = torch.exp2(lo + (hi - lo) * torch.rand(n_random, generator=gen, dtype=torch.float64))
    sign = torch.where(torch.rand(n_random, generator=gen) < 0.5, -1.0, 1.0).double()
    return torch.cat([v, mids, hair, mag * sign, SPECIALS.double()]).float()


def ml_dtypes_agrees(fmt, x: torch.Tensor) -> torch.Tensor:
    """Where ml_dtypes is the oracle. It differs from fp4lab, by design, in two places:
    NaN in a format without a NaN code (ml_dtypes gives a zero code, fp4lab keeps NaN), and
    E8M0's lowest binade, where ml_dtypes rounds (2^-127, 1.5 * 2^-127) up to 2^-126 although
    2^-127 is nearer (fp4lab rounds to nearest; see test_ue8m0_lowest_binade_rounds_to_nearest)."""
    keep = torch.ones_like(x, dtype=torch.bool)
    if fmt.specials is Specials.NONE:
        keep &= ~torch.isnan(x)
    if fmt is F.UE8M0:
        keep &= ~((x > 2.0**-127) & (x < 1.5 * 2.0**-127))
    return keep


@pytest.mark.parametrize("fmt", ML_FORMATS, ids=str)
def test_bit_exact_with_ml_dtypes(fmt):
    """Non-saturating casts equal ml_dtypes' on codes, midpoints and a million values."""
    x = codes_midpoints_and_random(fmt, 1_000_000)
    ref = torch.from_numpy(x.numpy().astype(ml_dtype(fmt)).astype(np.float32))
    ours = round_to_format(x, fmt, saturate=False)
    keep = ml_dtypes_agrees(fmt, x)
    assert torch.isnan(ours[torch.isnan(x)]).all()
    assert_same_bits(ours[keep], ref[keep], x[keep], f"round_to_format(x, {fmt.name}) vs ml_dtypes")


@pytest.mark.parametrize("fmt", ML_FORMATS, ids=str)
def test_codes_equal_ml_dtypes_bytes(fmt):
    x = codes_midpoints_and_random(fmt, 100_000, seed=1)
    x = x[ml_dtypes_agrees(fmt, x)]
    ours = fmt.encode(round_to_format(x, fmt, saturate=False)).to(torch.int64)
    container = np.uint8 if fmt.bits <= 8 else np.uint16
    ref = torch.from_numpy(x.numpy().astype(ml_dtype(fmt)).view(container).astype(np.int64))
    bad = (ours != ref).nonzero().flatten()
    if bad.numel():
        i = bad[0]
        raise AssertionError(
            f"first mismatch: x={x[i].item()!r} ours={int(ours[i]):#x} ref={int(ref[i]):#x}"
        )


def test_ue8m0_lowest_binade_rounds_to_nearest():
    x = torch.tensor([1.2, 1.4, 1.5, 1.6]) * 2.0**-127
    assert (round_to_format(x, F.UE8M0) / 2.0**-127).tolist() == [1.0, 1.0, 2.0, 2.0]


def test_ue4m3_equals_e4m3fn_on_non_negative_values():
    x = codes_midpoints_and_random(F.FP8_E4M3FN, 200_000).abs()
    x = x[~torch.isnan(x)]
    assert_same_bits(
        round_to_format(x, F.UE4M3, saturate=False),
        round_to_format(x, F.FP8_E4M3FN, saturate=False), x, "ue4m3 vs e4m3fn",
    )


def test_fp16_and_bf16_equal_torch_casts():
    x = torch.randn(200_000) * torch.exp2(torch.randint(-30, 30, (200_000,)).float())
    assert_same_bits(round_to_format(x, F.FP16, saturate=False), x.half().float(), x, "fp16")
    assert_same_bits(round_to_format(x, F.BF16, saturate=False), x.bfloat16().float(), x, "bf16")


def grid_oracle(x: torch.Tensor, fmt, rounding: Rounding) -> torch.Tensor:
    """Brute force on the sorted grid of magnitudes: pick lo or hi by the mode's rule."""
    grid = fmt.values[fmt.values >= 0].abs()  # the grid holds one zero, maybe -0
    a = x.double().abs()
    i = torch.clamp(torch.searchsorted(grid, a, right=True) - 1, 0, len(grid) - 1)
    lo, hi = grid[i], grid[torch.clamp(i + 1, max=len(grid) - 1)]
    on_grid = lo == a
    if rounding is Rounding.TOWARD_ZERO:
        pick_hi = torch.zeros_like(on_grid)
    elif rounding is Rounding.AWAY_FROM_ZERO:
        pick_hi = ~on_grid
    else:
        d_lo, d_hi = a - lo, hi - a
        tie_hi = (i % 2 == 1) if rounding is Rounding.NEAREST_EVEN else torch.ones_like(on_grid)
        pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & tie_hi)
        pick_hi &= ~on_grid
    out = torch.where(pick_hi, hi, lo)
    out = torch.where(a > fmt.max, fmt.max, out)
    out = torch.where(torch.signbit(x), -out, out)
    if fmt.specials is Specials.FNUZ:
        out = out + 0.0
    return out


DETERMINISTIC = [r for r in Rounding if r is not Rounding.STOCHASTIC]


@pytest.mark.parametrize("rounding", DETERMINISTIC, ids=lambda r: r.value)
@pytest.mark.parametrize("fmt", GRID_FORMATS, ids=str)
def test_every_mode_against_the_grid_oracle(fmt, rounding):
    x = codes_midpoints_and_random(fmt, 50_000, seed=2)
    x = x[torch.isfinite(x)]
    for dtype in (torch.float32, torch.float64):
        ours = round_to_format(x.to(dtype), fmt, rounding=rounding).double()
        what = f"{fmt.name} {rounding.value} {dtype}"
        assert_same_bits(ours, grid_oracle(x, fmt, rounding), x, what)


@pytest.mark.parametrize("fmt", F.FORMATS, ids=str)
@pytest.mark.parametrize("rounding", ["nearest_even", "toward_zero"])
def test_float32_fast_path_equals_float64_path(fmt, rounding):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(100_000, generator=gen) * torch.exp2(
        torch.randint(-140, 128, (100_000,), generator=gen).float()
    )
    x = torch.cat([x, SPECIALS, torch.tensor([1e-45, -1e-45, 3.4e38])])
    fast = round_to_format(x, fmt, rounding=rounding)
    slow = round_to_format(x.double(), fmt, rounding=rounding).float()
    assert_same_bits(fast, slow, x, f"{fmt.name} float32 vs float64")
    for dtype in (torch.bfloat16, torch.float16):
        xs = x.to(dtype)
        got = round_to_format(xs, fmt, rounding=rounding)
        assert got.dtype == dtype
        want = round_to_format(xs.double(), fmt, rounding=rounding).to(dtype)
        assert_same_bits(got.float(), want.float(), xs.float(), f"{fmt.name} {dtype}")


@pytest.mark.parametrize(
    "fmt, saturating, own",
    [
        (F.FP8_E4M3FN, 448.0, math.nan),
        (F.FP8_E5M2, 57344.0, math.inf),
        (F.FP8_E4M3FNUZ, 240.0, math.nan),
        (F.FP4_E2M1, 6.0, 6.0),
        (F.UE8M0, 2.0**127, math.nan),
    ],
    ids=str,
)
def test_overflow_policies(fmt, saturating, own):
    x = torch.tensor([3e38, math.inf], dtype=torch.float32)  # 3e38 is beyond every max here
    assert round_to_format(x, fmt).tolist() == [saturating, saturating]
    got = round_to_format(x, fmt, saturate=False)
    assert torch.equal(torch.isnan(got), torch.tensor([math.isnan(own)] * 2))
    if not math.isnan(own):
        assert got.tolist() == [own, own]


def test_nan_signed_zero_and_unsigned_negatives():
    x = torch.tensor([math.nan, -0.0, -1.0, 0.0])
    e2m1 = round_to_format(x, F.FP4_E2M1)
    assert math.isnan(e2m1[0]) and torch.signbit(e2m1[1]) and e2m1[2] == -1.0
    fnuz = round_to_format(x, F.FP8_E4M3FNUZ)
    assert not torch.signbit(fnuz[1])  # FNUZ has no -0
    ue = round_to_format(x, F.UE4M3)
    assert math.isnan(ue[2]) and ue[1] == 0 and not torch.signbit(ue[1])
    e8 = round_to_format(x, F.UE8M0, saturate=False)
    assert math.isnan(e8[3]), "zero is not an E8M0 value; like ml_dtypes, it becomes NaN"
    assert round_to_format(x, F.UE8M0)[3] == 2.0**-127, "saturating: the smallest value"


# -- stochastic rounding -------------------------------------------------------------------
def test_stochastic_rounding_is_unbiased():
    """Each value's sample mean is within 5 standard errors of the value itself
    (tolerance from the Bernoulli variance and the sample count; a false failure has
    probability below 1e-6 per value)."""
    n = 20_000
    values = torch.tensor([0.3, 0.26, 1.1, 2.2, 5.0, 0.01, -3.3, 4.4])  # E2M1 gaps 0.5 .. 2
    x = values.repeat(n, 1)
    r = round_to_format(x, F.FP4_E2M1, rounding="stochastic", generator=1234)
    lo = round_to_format(values, F.FP4_E2M1, rounding="toward_zero")
    hi = round_to_format(values, F.FP4_E2M1, rounding="away_from_zero")
    p = ((values - lo) / (hi - lo)).abs()
    se = (hi - lo).abs() * torch.sqrt(p * (1 - p) / n)
    err = (r.double().mean(0) - values.double()).abs()
    assert torch.all(err <= 5 * se.double() + 1e-12), (err, se)
    assert set(torch.unique(r[:, 0]).tolist()) == {0.0, 0.5}


def test_stochastic_rounding_same_seed_same_bits():
    x = torch.randn(10_000)
    a = round_to_format(x, F.FP4_E2M1, rounding="stochastic", generator=7)
    seven = torch.Generator().manual_seed(7)
    b = round_to_format(x, F.FP4_E2M1, rounding="stochastic", generator=seven)
    c = round_to_format(x, F.FP4_E2M1, rounding="stochastic", generator=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_stochastic_rounding_needs_a_generator():
    with pytest.raises(ValueError, match="generator is required"):
        round_to_format(torch.ones(3), F.FP4_E2M1, rounding="stochastic")


def test_stochastic_rounding_with_given_noise_and_few_bits():
    x = torch.full((4,), 0.15)  # 0.3 of the way from 0 to 0.5 ... in E2M1: lo 0, hi 0.5
    noise = torch.tensor([0.0, 0.2, 0.29, 0.31], dtype=torch.float64)
    exact = round_to_format(x, F.FP4_E2M1, rounding="stochastic", noise=noise)
    assert exact.tolist() == [0.5, 0.5, 0.5, 0.0]
    # With 2 random bits the hardware model rounds up with probability floor(4 * 0.3) / 4.
    two = round_to_format(x, F.FP4_E2M1, rounding="stochastic", sr_bits=2, noise=noise)
    assert two.tolist() == [0.5, 0.5, 0.0, 0.0]  # up iff floor(4u) < floor(4 * 0.3) = 1
    u = torch.arange(4, dtype=torch.float64) / 4
    rounded = round_to_format(
        torch.full((4,), 0.15), F.FP4_E2M1, rounding="stochastic", sr_bits=2, noise=u
    )
    p_up = (rounded > 0).double().mean()
    assert p_up.item() == 0.25


# -- properties -----------------------------------------------------------------------------
finite_floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@given(st.lists(finite_floats, min_size=1, max_size=64), st.sampled_from(GRID_FORMATS))
def test_idempotent_bounded_and_on_grid(xs, fmt):
    x = torch.tensor(xs, dtype=torch.float32)
    r = round_to_format(x, fmt)
    assert torch.equal(round_to_format(r, fmt), r)
    assert torch.all(r.abs() <= fmt.max)
    fmt.encode(r)  # raises if any value is off the grid


@given(finite_floats, finite_floats, st.sampled_from(GRID_FORMATS), st.sampled_from(DETERMINISTIC))
def test_monotone(a, b, fmt, rounding):
    lo, hi = sorted([a, b])
    r = round_to_format(torch.tensor([lo, hi]), fmt, rounding=rounding)
    assert r[0] <= r[1]


@given(
    st.lists(finite_floats, min_size=1, max_size=64),
    st.sampled_from(GRID_FORMATS),
    st.sampled_from(DETERMINISTIC),
)
def test_sign_symmetric(xs, fmt, rounding):
    x = torch.tensor(xs)
    # torch.equal compares values, so FNUZ's +0 for -x matches -(+0).
    negated = round_to_format(-x, fmt, rounding=rounding)
    assert torch.equal(negated, -round_to_format(x, fmt, rounding=rounding))


@given(st.lists(st.floats(min_value=-6, max_value=6, width=32), min_size=1, max_size=64))
def test_nearest_error_is_at_most_half_a_gap(xs):
    x = torch.tensor(xs)
    r = round_to_format(x, F.FP4_E2M1)
    gap = torch.where(x.abs() < 2, 0.5, torch.where(x.abs() < 4, 1.0, 2.0))
    assert torch.all((r - x).abs() <= gap / 2)


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "x", [torch.ones(3, dtype=torch.int32), torch.ones(3, dtype=torch.complex64)]
)
def test_rejects_non_float_tensors(x):
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        round_to_format(x, F.FP4_E2M1)


def test_rejects_unknown_rounding_and_bad_sr_bits():
    with pytest.raises(ValueError, match="rounding must be one of"):
        round_to_format(torch.ones(2), F.FP4_E2M1, rounding="banker")
    with pytest.raises(ValueError, match="sr_bits"):
        round_to_format(torch.ones(2), F.FP4_E2M1, rounding="stochastic", sr_bits=0, generator=0)


def test_empty_tensor():
    assert round_to_format(torch.empty(0, 3), F.FP4_E2M1).shape == (0, 3)


@pytest.mark.parametrize("fmt", F.FORMATS, ids=str)
@pytest.mark.parametrize("sr_bits", [None, 3, 12])
def test_float32_fast_path_rounds_stochastically_as_the_float64_path(fmt, sr_bits):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(50_000, generator=gen) * torch.exp2(
        torch.randint(-140, 128, (50_000,), generator=gen).float()
    )
    x = torch.cat([x, SPECIALS, torch.tensor([1e-45, -1e-45, 3.4e38])])
    u = torch.rand(x.shape, generator=gen, dtype=torch.float64)
    edges = [0.0, 0.5, 1 - 2**-53, 2**-53, 0.25, 0.75, 0.999, 0.001]
    u[:8] = torch.tensor(edges, dtype=torch.float64)
    fast = round_to_format(x, fmt, rounding="stochastic", noise=u, sr_bits=sr_bits)
    slow = round_to_format(x.double(), fmt, rounding="stochastic", noise=u, sr_bits=sr_bits)
    slow = slow.float()
    assert_same_bits(fast, slow, x, f"{fmt.name} stochastic float32 vs float64")
    # a generator draws the same uniforms on both paths
    a = round_to_format(x, fmt, rounding="stochastic", generator=9, sr_bits=sr_bits)
    b = round_to_format(x.double(), fmt, rounding="stochastic", generator=9, sr_bits=sr_bits)
    b = b.float()
    assert_same_bits(a, b, x, f"{fmt.name} stochastic generator")


@pytest.mark.parametrize("fmt", [F.FP4_E2M1, F.FP8_E4M3FN, F.FP6_E3M2, F.UE5M3], ids=str)
@pytest.mark.parametrize("sr_bits", [None, 3, 24])
def test_float32_noise_rounds_as_the_same_uniforms_in_float64(fmt, sr_bits):
    """Float32 noise is compared in float32 (the fast path's ceil(frac - u)), exact: the same
    bits as the same uniforms in float64, on both paths, with uniforms at 0, just below 1, at
    1 and beyond, negative, inf and NaN, and inputs that are inf or NaN."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(40_000, generator=gen) * torch.exp2(
        torch.randint(-30, 20, (40_000,), generator=gen).float()
    )
    x = torch.cat([x, SPECIALS, torch.tensor([1e-45, -1e-45, 3.4e38])])
    u = torch.rand(x.shape, generator=gen)
    edges = [0.0, 1 - 2**-24, 1.0, 1.5, -0.25, math.inf, -math.inf, math.nan]
    u[:8] = torch.tensor(edges)
    u[-9:-1] = torch.tensor(edges)
    for xs in (x, x.double()):
        as32 = round_to_format(xs, fmt, rounding="stochastic", noise=u, sr_bits=sr_bits)
        as64 = round_to_format(xs, fmt, rounding="stochastic", noise=u.double(), sr_bits=sr_bits)
        assert_same_bits(as32, as64, x, f"{fmt.name} float32 noise on {xs.dtype}")


@pytest.mark.parametrize("layout", ["contiguous", "transposed-noise"])
@pytest.mark.parametrize("sr_bits", [None, 5])
def test_large_stochastic_rounding_rounds_as_the_float64_path(layout, sr_bits):
    """Over 2^17 elements, in a size that is no power of two, with contiguous uniforms and
    with uniforms that are a transposed view: the same bits as the float64 path."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 2 * (1 << 16) // 3 + 411, generator=gen) * 5).T  # (43xxx, 3) view
    x = x.contiguous()
    u = torch.rand(x.shape[::-1], generator=gen, dtype=torch.float64).T
    if layout == "contiguous":
        u = u.contiguous()
    fast = round_to_format(x, F.FP4_E2M1, rounding="stochastic", noise=u, sr_bits=sr_bits)
    slow = round_to_format(x.double(), F.FP4_E2M1, rounding="stochastic", noise=u,
                           sr_bits=sr_bits).float()
    assert_same_bits(fast, slow, x, f"E2M1 stochastic, {layout}")
