"""Alpha-grid E8M0 rules (fp4-fa4, hao-ai-lab/flash-attention-fp4): the exponent each rule
picks (every positive BF16 amax, against the kernel's bit formulas), the elements' multiplier
6 * 2^(127 - e), clipping at alpha, HAO's MXFP8 P, 2-D tiles, zeros, subnormals, NaN/inf."""

import math

import pytest
import torch

import fp4lab.formats as F
from fp4lab.formats import ScaleRule, fake_quantize, quantize

from .helpers import assert_same_bits, te_fp4_codes

RULES = [ScaleRule.ALPHA_CEIL, ScaleRule.ALPHA_MSE, ScaleRule.ALPHA_HALF, ScaleRule.ALPHA_RTE]
MX_ALPHA = {
    ScaleRule.ALPHA_CEIL: "mxfp4_alpha_ceil", ScaleRule.ALPHA_MSE: "mxfp4_alpha_mse",
    ScaleRule.ALPHA_HALF: "mxfp4_alpha_half", ScaleRule.ALPHA_RTE: "mxfp4_alpha_rte_2d",
}


def one_d(rule):
    """The rule as an MXFP4 format with blocks of 32 (the RTE constant uses 32 x 32 tiles)."""
    return F.QuantSpec(name="t", element=F.FP4_E2M1, scale=F.UE8M0, block=(32,), scale_rule=rule)


def kernel_e8m0(bits: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """The E8M0 code from a positive BF16 amax's bits, as projection_fp4_epilogue.cuh writes it:
    exponent field 0 gives 0; round up as the rule says, unless the field is 0xfe."""
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    up = {
        ScaleRule.ALPHA_CEIL: mantissa != 0,  # select 4, the max-safe ceiling
        ScaleRule.ALPHA_MSE: mantissa >= 0x1A,  # bf16_amax_to_e8m0_1d_mse
        ScaleRule.ALPHA_HALF: mantissa >= 0x40,  # select 1, the shifted floor
        ScaleRule.ALPHA_RTE: (mantissa > 0x40) | ((mantissa == 0x40) & (exponent % 2 == 1)),
    }[rule]
    code = torch.where(up & (exponent < 0xFE), exponent + 1, exponent)
    return torch.where(exponent == 0, 0, code)


def kernel_multiplier(code: torch.Tensor) -> torch.Tensor:
    """e8m0_encode_multiplier: 6 * bit_cast<float>((254 - e) << 23), 0 for e = 0."""
    pow2 = ((254 - code).to(torch.int32) << 23).view(torch.float32)
    return torch.where(code == 0, 0.0, 6.0 * pow2)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_every_positive_bf16_amax_gets_the_kernels_exponent(rule):
    """Exhaustive over the 32639 positive finite BF16 amax values: the scale is
    fl(2^(e - 127) / 6) for the kernel's E8M0 code e, and 0 where the kernel writes e = 0."""
    bits = torch.arange(1, 0x7F80, dtype=torch.int32)  # every positive finite BF16 pattern
    amax = (bits << 16).view(torch.float32)
    x = torch.zeros(bits.numel(), 32)
    x[:, 7] = -amax  # the sign does not matter; the rest of the block is zero
    s = quantize(x, one_d(rule)).scales[:, 0]
    code = kernel_e8m0(bits, rule)
    want = torch.where(code == 0, 0.0, F.get("ue8m0").decode(code.to(torch.uint8)) / 6.0)
    assert_same_bits(s, want, amax, f"{rule.value} scale")


@pytest.mark.parametrize(
    "amax, e_ceil, e_mse, e_half, e_rte",
    [
        (1.0, 0, 0, 0, 0),  # r = 1: every rule keeps floor(log2 a)
        (1.1953125, 1, 0, 0, 0),  # r = 1 + 25/128, one BF16 step below MSE's threshold
        (1.203125, 1, 1, 0, 0),  # r = 1 + 26/128: MSE's threshold (mantissa field 0x1a)
        (1.5, 1, 1, 1, 1),  # tie: biased exponent field 127 is odd, so RTE rounds up
        (3.0, 2, 2, 2, 1),  # tie: field 128 is even, so RTE stays
        (3.015625, 2, 2, 2, 2),  # just above the tie
        (6.0, 3, 3, 3, 3),  # tie at field 129 (odd): up
        (2.0**-126, -126, -126, -126, -126),  # the smallest normal amax
        (1.5 * 2.0**127, 127, 127, 127, 127),  # 128 clamps to E8M0's largest exponent
    ],
)
def test_hand_picked_exponents(amax, e_ceil, e_mse, e_half, e_rte):
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    for rule, e in zip(RULES, (e_ceil, e_mse, e_half, e_rte), strict=True):
        s = quantize(x, one_d(rule)).scales[0, 0]
        assert s.item() == (torch.tensor(2.0**e, dtype=torch.float32) / 6.0).item(), rule


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_codes_are_the_kernels_multiply_and_cvt(rule, dtype):
    """Random blocks over 60 binades: codes equal cvt.rn.satfinite.e2m1(x * multiplier) with
    the kernel's multiplier from its E8M0 code, BF16 amax bits read as the kernel reads them.
    (For float32 input the float32 amax is rounded to BF16 first: that is the kernel's input.)"""
    gen = torch.Generator().manual_seed(3)
    binades = torch.randint(-30, 30, (512, 1), generator=gen).float()
    x = torch.randn(512, 64, generator=gen) * torch.exp2(binades)
    x = x.to(torch.bfloat16).to(dtype)
    q = quantize(x, one_d(rule))
    blocks = x.float().reshape(512, 2, 32)
    amax_bits = blocks.abs().amax(-1).to(torch.bfloat16).view(torch.int16).to(torch.int32)
    multiplier = kernel_multiplier(kernel_e8m0(amax_bits, rule))
    want = te_fp4_codes(blocks * multiplier.unsqueeze(-1)).reshape(512, 64)
    assert torch.equal(q.codes, want)


def test_values_between_alpha_and_amax_clip_to_alpha():
    """MSE keeps E = 0 for amax 1.1 (r < 1.203125): alpha = 1, so 1.1 saturates to code 6 and
    dequantizes to 6 * fl(1/6) = 1 in float32; CEIL takes alpha = 2 and keeps it (0.75 is
    a tie between 0.5 and 1 and goes to the even code, 1)."""
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([1.1, -1.0, 0.25])
    mse, ceil = quantize(x, "mxfp4_alpha_mse"), quantize(x, "mxfp4_alpha_ceil")
    assert mse.element_values()[0, :3].tolist() == [6.0, -6.0, 1.5]
    assert mse.dequantize()[0, :3].tolist() == [1.0, -1.0, 0.25]
    assert ceil.element_values()[0, :3].tolist() == [3.0, -3.0, 1.0]


def test_dequantize_is_code_times_the_rounded_reciprocal():
    """code * fl(2^E / 6) in float32: one rounding of 1/6 in the scale, none in the product
    whenever code * 2^E / 6 needs no more bits (the kernel's code * 2^E / 36 differs there)."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(4))
    for name in ("mxfp4_alpha_ceil", "mxfp4_alpha_mse", "mxfp4_alpha_half", "mxfp4_alpha_rte_2d"):
        q = quantize(x, name)
        assert_same_bits(q.dequantize(), q.element_values() * q.expanded_scales(), x, name)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.value)
def test_zero_and_subnormal_blocks_flush_nan_and_inf_give_nan(rule):
    """Amax 0 or a float32 subnormal: zero scale and zero codes (the kernel's e8m0 = 0 and
    multiplier 0). NaN or inf: a NaN scale for that block only."""
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(5))
    x[0] = 0.0
    x[1] = x[1] * 1e-39  # every |x| below 2^-126
    x[2, 4] = math.nan
    x[3, 9] = -math.inf
    q = quantize(x, one_d(rule))
    assert q.scales[:2, 0].tolist() == [0.0, 0.0]
    assert torch.equal(q.dequantize()[:2], torch.zeros(2, 32))
    assert torch.isnan(q.scales[2:4, 0]).all() and torch.isnan(q.dequantize()[2:4]).all()
    assert torch.isfinite(q.scales[4]).all() and torch.isfinite(q.dequantize()[4]).all()


def test_mxfp8_alpha_ceil_is_hao_mxfp8_p():
    """HAO's NVFP4+MXFP8 P: E4M3_RN_sat(448 P / 2^b), b = ceil(log2 max P) per group of 32;
    torch's float8_e4m3fn cast is the oracle of the element rounding."""
    gen = torch.Generator().manual_seed(6)
    p = torch.softmax(torch.randn(64, 256, generator=gen) * 4, dim=-1)
    q = quantize(p, "mxfp8_e4m3_alpha_ceil")
    groups = p.reshape(64, 8, 32)
    b = torch.log2(groups.amax(-1).double()).ceil()
    want = (groups * 448.0 * torch.exp2(-b).float().unsqueeze(-1)).to(torch.float8_e4m3fn).float()
    assert_same_bits(q.element_values(), want.reshape(64, 256), p, "MXFP8 P codes")
    assert_same_bits(q.scales, torch.exp2(b).float() / 448.0, None, "MXFP8 P scales")


def test_rte_2d_tiles_take_the_tile_amax():
    """32 x 32 tiles: one scale per tile from the tile's amax, the same for x and x.T."""
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(7))
    q = quantize(x, "mxfp4_alpha_rte_2d")
    assert q.scales.shape == (2, 3)
    tile_amax = x.reshape(2, 32, 3, 32).abs().amax((1, 3))
    by_amax = quantize(tile_amax.reshape(6, 1), one_d(ScaleRule.ALPHA_RTE)).scales
    assert torch.equal(q.scales, by_amax.reshape(2, 3))
    name = "mxfp4_alpha_rte_2d"
    assert torch.equal(fake_quantize(x.T, name), fake_quantize(x, name).T)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(scale=F.UE4M3), "power-of-two format"),
        (dict(tensor_scale=True), "fixes its own arithmetic"),
        (dict(arithmetic="reciprocal"), "fixes its own arithmetic"),
        (dict(scale_floor=2.0**-10), "takes no scale_floor"),
    ],
)
def test_alpha_rules_reject_fields_they_do_not_read(fields, message):
    base = dict(name="bad", element=F.FP4_E2M1, scale=F.UE8M0, block=(32,), scale_rule="alpha_mse")
    with pytest.raises(ValueError, match=message):
        F.QuantSpec(**{**base, **fields})
