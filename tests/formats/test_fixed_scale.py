"""Fixed decode scales (fp4-fa4 v509's E4M3(4 x) and E5M2(4 dO), decoded by 0.25): every
code, every midpoint, torch's float8 casts as the oracle, the constant `scales` the trace's
counts read, NaN and inf element by element, and the fields a fixed scale rejects."""

import dataclasses
import math

import pytest
import torch

import fp4lab.formats as F
from fp4lab.formats import fake_quantize, quantize, quantize_blocks

from .helpers import assert_same_bits

FIXED = {"fp8_e4m3_x4": torch.float8_e4m3fn, "fp8_e5m2_x4": torch.float8_e5m2}


def codes_midpoints_and_random(fmt, seed=0):
    """Every finite value of fmt, the midpoints between neighbours and a hair either side,
    and log-uniform values over the whole range (both signs), all divided by 4."""
    v = fmt.values[torch.isfinite(fmt.values)]
    mids = (v[1:] + v[:-1]) / 2
    hair = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    gen = torch.Generator().manual_seed(seed)
    lo, hi = math.log2(fmt.min_subnormal) - 4, math.log2(fmt.max) + 2
    mag = torch.exp2(lo + (hi - lo) * torch.rand(100_000, generator=gen, dtype=torch.float64))
    sign = torch.where(torch.rand(100_000, generator=gen) < 0.5, -1.0, 1.0).double()
    return (torch.cat([v.double(), mids.double(), hair.double(), mag * sign]) / 4).float()


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_scale_is_a_quarter_of_the_fp8_cast_of_4x(name):
    """x^ = 0.25 * FP8_RN_sat(4 x): torch's cast (nearest even) of the clamped 4 x."""
    spec = F.get(name)
    x = codes_midpoints_and_random(spec.element)
    m = spec.element.max
    want = torch.clamp(4 * x, -m, m).to(FIXED[name]).float() * 0.25
    assert_same_bits(fake_quantize(x, name), want, x, name)
    on_grid = spec.element.values[torch.isfinite(spec.element.values)] / 4
    assert torch.equal(fake_quantize(on_grid, name), on_grid)  # every code survives exactly


@pytest.mark.parametrize("name", list(FIXED))
def test_scales_are_the_constant_so_clipped_counts_work(name):
    """quantize_blocks gives scales of 0.25 and decode None: the trace's ideal scale
    amax / (M_e * d) and its clipped count |scaled| > M_e read as for any format."""
    spec = F.get(name)
    x = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(1)) * spec.element.max / 8
    b = quantize_blocks(x, name, batch_dims=1)
    assert b.decode is None and torch.equal(b.scales, torch.full((3, 1), 0.25))
    clipped = int((b.scaled.abs() > spec.element.max).sum())
    assert clipped == int((x.abs() > 0.25 * spec.element.max).sum()) > 0
    q = quantize(x, name)
    assert q.scales.shape == () and q.scales.item() == 0.25 and q.tensor_scale is None
    assert spec.bits_per_element == 8.0


@pytest.mark.parametrize("name", list(FIXED))
def test_nan_inf_zero_and_subnormal_elements(name):
    """One scale for the tensor, so specials stay element by element: NaN stays NaN, inf
    saturates to 0.25 M_e, zeros and float32 subnormals round to zero, others untouched."""
    spec = F.get(name)
    x = torch.tensor([1.0, math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, 3.0])
    d = fake_quantize(x, name)
    m = 0.25 * spec.element.max
    assert math.isnan(d[1]) and d[2].item() == m and d[3].item() == -m
    assert d[[0, 4, 6, 7]].tolist() == [1.0, 0.0, 0.0, 3.0] and math.copysign(1, d[5]) == -1


def test_block_shape_and_batch_dims_change_nothing():
    x = torch.randn(2, 48, 96, generator=torch.Generator().manual_seed(2)) * 50
    tiles = dataclasses.replace(F.get("fp8_e4m3_x4"), name="t", block=(16, 32))
    want = fake_quantize(x, "fp8_e4m3_x4")
    assert torch.equal(fake_quantize(x, tiles), want)
    assert torch.equal(fake_quantize(x, "fp8_e4m3_x4", batch_dims=1), want)
    assert tiles.bits_per_element == 8.0


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(fixed_scale=-0.25), "fixed_scale must be a positive finite float"),
        (dict(fixed_scale=math.inf), "fixed_scale must be a positive finite float"),
        (dict(fixed_scale=0.1), "fixed_scale must be a float32 number"),
        (dict(fixed_scale=0.25, tensor_scale=True), "tensor_scale must be False"),
        (dict(fixed_scale=0.25, scale_floor=1.0), "no scale_floor"),
    ],
)
def test_bad_fixed_scales_name_the_field(fields, message):
    base = dict(name="bad", element=F.FP8_E4M3FN, scale=F.FP32, block=None, scale_rule="nearest")
    with pytest.raises(ValueError, match=message):
        F.QuantSpec(**{**base, **fields})
