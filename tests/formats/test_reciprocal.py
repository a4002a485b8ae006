"""E4M3 block scales of 16 in the released kernels' float32 orders: SageAttention's and
FastVideo's reciprocal multiply (`ScaleArithmetic.RECIPROCAL`), SageAttention's division by
the unrounded P scale (`DIVIDE_UNROUNDED`), and fp4-fa4's Q/K quantizer (`nvfp4_1level`),
each against a restatement of its source; zero scales, NaN and inf."""

import dataclasses
import math

import pytest
import torch

import fp4lab.formats as F
from fp4lab.formats import fake_quantize, quantize, quantize_blocks

from .helpers import assert_same_bits, e4m3_satfinite, te_fp4_codes


def kernel_input(seed, rows=64, cols=256, dtype=torch.bfloat16):
    """Gaussian rows over 2^[-24, 12), one all-zero block, one block whose E4M3 scale
    underflows to 0 (amax / 6 below 2^-10) and one where it saturates (amax > 2688)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x = x * torch.exp2(torch.randint(-24, 12, (rows, 1), generator=gen).float())
    x[0, :16] = 0.0
    x[1, 16:32] *= 1e-6 / x[1, 16:32].abs().max()
    x[2, 32:48] *= 5000.0 / x[2, 32:48].abs().max()
    return x.to(dtype)


def sage_fp4_quantization_4d(x):
    """scaled_fp4_quant_kernel (fp4_quantization_4d.cu): SFValue = vecMax / 6.0f rounded by
    __nv_fp8_e4m3, SFValueInv = (SFValue == 0) ? 0 : 1 / SFValue, cvt.rn.satfinite.e2m1."""
    blocks = x.float().reshape(x.shape[0], -1, 16)
    sf = e4m3_satfinite(blocks.abs().amax(-1) / 6.0)
    inv = torch.where(sf == 0, 0.0, 1.0 / sf)
    return te_fp4_codes(blocks * inv.unsqueeze(-1)).reshape(x.shape), sf


def fastvideo_compute_quant_and_scale(x):
    """_compute_quant_and_scale (nvfp4_utils.py) with the global scale over the whole tensor:
    s_enc = 6 * 448 / max(amax, 1e-8), s_dec = 1 / s_enc, E4M3(max_val / 6 * s_enc),
    quant = x * 1 / where(block_decode > 0, block_decode, 1)."""
    f32 = x.float()
    global_max = torch.maximum(f32.abs().amax(), torch.tensor(1e-8))
    s_enc = torch.tensor(6 * 448, dtype=torch.float32) / global_max
    s_dec = 1 / s_enc
    blocks = f32.reshape(x.shape[0], -1, 16)
    scale = e4m3_satfinite(blocks.abs().amax(-1) / 6 * s_enc)
    block_decode = scale * s_dec
    s_enc_b = 1 / torch.where(block_decode > 0.0, block_decode, 1.0)
    return te_fp4_codes(blocks * s_enc_b.unsqueeze(-1)).reshape(x.shape), scale, s_dec


def fp4_fa4_stage_codes_perblock_qk(x):
    """stage_codes_perblock_qk (projection_fp4_epilogue.cuh): row_scale = E4M3(amax * (1/6)),
    multiplier = rounded scale > 0 ? 1 / rounded scale : 0, quantize_pair(x, multiplier)."""
    blocks = x.float().reshape(x.shape[0], -1, 16)
    scale = e4m3_satfinite(blocks.abs().amax(-1) * torch.tensor(1.0 / 6.0, dtype=torch.float32))
    multiplier = torch.where(scale > 0.0, 1.0 / scale, 0.0)
    return te_fp4_codes(blocks * multiplier.unsqueeze(-1)).reshape(x.shape), scale


def same_e2m1(q, codes) -> bool:
    """Equal element values: the codes up to the sign of zero (the restated table gives -0.0,
    and x * 0 of a negative x, the code of +0.0)."""
    return torch.equal(q.element_values(), F.FP4_E2M1.decode(codes))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_nvfp4_reciprocal_is_sageattention_fp4_quantization_4d(dtype):
    x = kernel_input(1, dtype=dtype)
    codes, sf = sage_fp4_quantization_4d(x)
    q = quantize(x, "nvfp4_reciprocal")
    assert same_e2m1(q, codes)
    assert torch.equal(q.scales, sf)
    assert q.scales[1, 1].item() == 0.0  # multiplier 0: the block's codes are (signed) zeros
    assert torch.equal(q.codes[1, 16:32] & 7, torch.zeros(16, dtype=torch.uint8))


def test_nvfp4_reciprocal_2level_is_fastvideo_compute_quant_and_scale():
    x = kernel_input(2)
    codes, scale, s_dec = fastvideo_compute_quant_and_scale(x)
    q = quantize(x, "nvfp4_reciprocal_2level")
    assert same_e2m1(q, codes)
    assert torch.equal(q.scales, scale)
    assert q.tensor_scale.item() == s_dec.item()


def test_fastvideo_zero_scale_keeps_its_codes_and_dequantizes_to_zero():
    """A block whose E4M3 scale underflows: FastVideo's guard multiplies by 1, so its codes
    are rnd(x), and code * 0 * s_dec = 0. SageAttention's multiplier 0 zeroes the codes."""
    x = torch.zeros(1, 32)
    x[0, 0] = 1e6  # s_enc = 2688 / 1e6: block 1's scale 0.3 / 6 * s_enc < 2^-10 underflows
    x[0, 16] = 0.3
    q = quantize(x, "nvfp4_reciprocal_2level")
    assert q.scales[0, 1].item() == 0.0
    assert q.element_values()[0, 16].item() == 0.5  # rnd(0.3 * 1)
    assert q.dequantize()[0, 16].item() == 0.0
    one_level = quantize(torch.tensor([[1e-4] + [0.0] * 15]), "nvfp4_reciprocal")
    assert one_level.scales.item() == 0.0 and one_level.codes.sum().item() == 0


def test_reciprocal_nan_and_inf_follow_the_arithmetic():
    """One level: NaN makes its block NaN; inf rounds its scale to 448 and saturates to
    6 * 448, the rest of its block flushing. Two levels: either reaches every block, NaN."""
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
    x[0, 3] = math.nan
    x[1, 20] = math.inf
    d = fake_quantize(x, "nvfp4_reciprocal")
    assert torch.isnan(d[0, :16]).all() and torch.isfinite(d[0, 16:]).all()
    assert d[1, 20].item() == 6.0 * 448.0 and torch.equal(d[1, 16:20], torch.zeros(4))
    assert torch.isfinite(d[2]).all()
    assert torch.isnan(fake_quantize(x, "nvfp4_reciprocal_2level")).all()


def test_reciprocal_differs_from_exact_division_in_the_last_bit():
    """x * fl(1/s) and x / s differ where the reciprocal's rounding moves a tie: amax 2.8125
    gives s = 15/32 exactly; 1.25 s and 2.5 s divide to the ties 1.25 and 2.5 (to the even
    codes 1 and 2), while fl(1/s) is a hair large and sends them up to 1.5 and 3."""
    x = torch.tensor([[2.8125, 0.5859375, 1.171875] + [0.0] * 13])
    exact = dataclasses.replace(F.get("nvfp4_reciprocal"), name="t", arithmetic="exact")
    assert quantize(x, "nvfp4_reciprocal").scales.item() == 0.46875
    assert quantize(x, exact).element_values()[0, :3].tolist() == [6.0, 1.0, 2.0]
    assert quantize(x, "nvfp4_reciprocal").element_values()[0, :3].tolist() == [6.0, 1.5, 3.0]


# -- DIVIDE_UNROUNDED: SageAttention's P --------------------------------------------------------
def test_divide_unrounded_hand_picked_block():
    """amax 2.5: t = fl(2.5 / 6), s = E4M3(t) = 0.40625 < t. 1.03 / t = 2.47 rounds to 2,
    where division by the rounded s gives 1.03 / s = 2.54 and rounds to 3."""
    x = torch.tensor([[2.5, 1.03, -1.0, 0.1] + [0.0] * 12])
    q = quantize(x, "nvfp4_divide_unrounded")
    exact = dataclasses.replace(F.get("nvfp4_divide_unrounded"), name="t", arithmetic="exact")
    assert q.scales.item() == 0.40625
    assert q.element_values()[0, :4].tolist() == [6.0, 2.0, -2.0, 0.0]
    assert quantize(x, exact).element_values()[0, :4].tolist() == [6.0, 3.0, -2.0, 0.0]
    assert q.dequantize()[0, :4].tolist() == [2.4375, 0.8125, -0.8125, 0.0]


def test_divide_unrounded_maps_every_block_maximum_to_the_element_max():
    """a / fl(a / 6) lies within one float32 step of 6, so its code is always 6: checked
    for every float32 mantissa of a in [1, 2), and through quantize on random blocks."""
    a = torch.arange(1 << 23, dtype=torch.int32).add_(127 << 23).view(torch.float32)
    v = a / (a / torch.tensor(6.0))
    assert torch.all((v - 6.0).abs() <= 2.0**-21)
    gen = torch.Generator().manual_seed(4)
    binades = torch.randint(-20, 20, (4096, 1), generator=gen).float()
    x = torch.randn(4096, 16, generator=gen) * torch.exp2(binades)
    q = quantize(x, "nvfp4_divide_unrounded")
    at_max = q.element_values().abs().gather(1, x.abs().argmax(1, keepdim=True))
    assert torch.all(at_max == 6.0)


def test_divide_unrounded_with_a_tensor_scale_divides_by_t_times_d():
    spec = dataclasses.replace(F.get("nvfp4_divide_unrounded"), name="t", tensor_scale=True)
    x = kernel_input(5, dtype=torch.float32)
    b = quantize_blocks(x, spec)
    d = x.abs().amax() / torch.tensor(448.0 * 6.0)
    t = (b.amax / d) / torch.tensor(6.0)
    want = x.reshape(64, 16, 16) / torch.where(t * d == 0, torch.inf, t * d).unsqueeze(-1)
    assert_same_bits(b.scaled, want, x, "x / fl(t * d)")
    assert torch.equal(b.scales, F.round_to_format(t, F.UE4M3))


def test_divide_unrounded_zero_blocks_flush_and_nan_gives_nan():
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(6))
    x[0] = 0.0
    x[1, 5] = math.nan
    x[2, 30] = math.inf
    q = quantize(x, "nvfp4_divide_unrounded")
    assert torch.equal(q.dequantize()[0], torch.zeros(32))
    assert torch.isnan(q.scales[1, 0]) and torch.isnan(q.scales[2, 1])
    assert torch.isfinite(q.scales[1, 1]) and torch.isfinite(q.scales[2, 0])


# -- TE_ENCODE without a tensor scale is fp4-fa4's Q/K quantizer --------------------------------
def test_nvfp4_1level_is_fp4_fa4_stage_codes_perblock_qk():
    """MrHuff/fp4-fa4 tk_fa4/lowp_fa4_bwd/projection_fp4_epilogue.cuh, stage_codes_perblock_qk:
    the same codes and scales, also where a scale underflows to 0 (multiplier 0: the block's
    codes are 0, never 0 * inf = NaN)."""
    x = kernel_input(7)
    codes, scale = fp4_fa4_stage_codes_perblock_qk(x)
    q = quantize(x, "nvfp4_1level")
    assert same_e2m1(q, codes)
    assert torch.equal(q.scales, scale)
    assert q.scales[1, 1].item() == 0.0
    assert torch.equal(q.codes[1, 16:32] & 7, torch.zeros(16, dtype=torch.uint8))
    assert not torch.isnan(q.dequantize()).any()
