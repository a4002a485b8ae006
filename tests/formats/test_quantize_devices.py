"""The reference quantizer off the CPU: the same bits on CUDA, and the block amax as a
reduction rather than a max-pool. Kept apart from test_quantize.py, whose torchao oracles the
GPU machine does not have installed, so that these run there."""

import dataclasses
import importlib
import math

import pytest
import torch

import fp4lab.formats as F
from fp4lab.formats import fake_quantize, quantize

from .helpers import assert_same_bits, spread

quantize_module = importlib.import_module("fp4lab.formats.quantize")  # the function shadows it
PRESETS = [p.name for p in F.BLOCK_FORMATS if not p.stochastic]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rounding", ["nearest_even", "stochastic"])
@pytest.mark.parametrize("preset", PRESETS + ["mxfp4_rht"])
def test_cuda_gives_the_cpu_bits(preset, rounding):
    """The reference runs on any device with the same bits (stochastic draws come from a CPU
    generator, so a seed means the same numbers everywhere)."""
    rht = dataclasses.replace(F.get("mxfp4"), name="mxfp4_rht", hadamard=32)
    spec = rht if preset == "mxfp4_rht" else preset
    x = spread((32, 256), seed=7, low=-8, high=8)
    cpu = quantize(x, spec, rounding=rounding, generator=3)
    gpu = quantize(x.cuda(), spec, rounding=rounding, generator=3)
    assert torch.equal(gpu.codes.cpu(), cpu.codes)
    assert torch.equal(gpu.scales.cpu().nan_to_num(-1.0), cpu.scales.nan_to_num(-1.0))
    on_gpu = fake_quantize(x.cuda(), spec, rounding=rounding, generator=3).cpu()
    assert_same_bits(on_gpu, cpu.dequantize(), x, preset)


def test_off_the_cpu_a_block_amax_is_a_reduction_not_a_max_pool(monkeypatch):
    """CUDA's max-pool reads each window on one thread, so a whole-tensor block (E4M3 with a
    tensor scale, V and dO of the v509 route) would be read serially; off the CPU the block
    amax is torch's amax (checked on the meta device, which every machine has)."""

    def no_pool(*args, **kwargs):
        raise AssertionError("max_pool1d called off the CPU")

    monkeypatch.setattr(torch.nn.functional, "max_pool1d", no_pool)
    x = torch.empty(16, 512, 256, device="meta")
    for spec in ("fp8_e4m3_tensor", "fp8_e4m3_x4", "nvfp4", "mxfp4"):
        assert fake_quantize(x, spec).shape == x.shape


@pytest.mark.parametrize("block", [16, 32, 1 << 14])
def test_the_cpus_max_pool_gives_the_amax_other_devices_take(block):
    """Both block amaxes are exact: the same bits on zeros of either sign, subnormals, inf
    and NaN (NaN propagates), so a block's scale does not depend on the device."""
    x = spread((64, 1 << 14), seed=3).view(-1, block)
    specials = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-140), math.inf, -math.inf, math.nan])
    x[1::5, : len(specials)] = specials
    x[2] = -0.0
    x[3, block // 2] = math.nan
    pooled = quantize_module._block_amax(x)
    reduced = x.abs().amax(dim=-1)
    torch.testing.assert_close(pooled, reduced, rtol=0, atol=0, equal_nan=True)
    assert not torch.signbit(pooled).any()


@pytest.mark.parametrize("axis", [0, 1])
def test_blocks_across_rows_take_their_amax_in_the_tensors_own_layout(axis):
    """1-D blocks along a dim other than the last reduce in x's own layout: the same bits as
    the amax over the block layout, on zeros of either sign, subnormals, inf and NaN (the
    quiet NaN 0x7FC00000, which torch's vector maximum over a middle dim does not give)."""
    x = spread((64, 48, 40), seed=5)
    specials = torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-140), math.inf, -math.inf, math.nan])
    x[1, :7, 3] = specials
    x[16:32, 5] = -0.0
    x[2, 40:, 7] = math.nan
    spec = quantize_module.resolve_spec("nvfp4")
    layout = quantize_module._layout(spec, x.shape, axis)
    blocks = layout.to_blocks(x)
    rows = quantize_module._block_amax(blocks, x, layout)
    reduced = blocks.abs().amax(dim=-1)
    assert torch.equal(rows.view(torch.int32), reduced.view(torch.int32))
    assert bool(rows.isnan().any())
