"""The compiled element steps of a block quantizer (`fp4lab.formats.fused_rounding`) against
the eager steps, bit for bit, on float32 values of every kind; `quantize_blocks(fused=True)`
against the steps; where it does not apply; the eager fallback where it cannot be built."""

import sys

import pytest
import torch

from fp4lab.formats import (
    FP4_E2M1,
    FP6_E2M3,
    FP6_E3M2,
    FP8_E4M3FN,
    Rounding,
    fused_rounding,
    get,
    quantize_blocks,
    round_to_format,
)

ROUNDINGS = [Rounding.NEAREST_EVEN, Rounding.TOWARD_ZERO, Rounding.STOCHASTIC]


def every_kind(shape, seed: int) -> torch.Tensor:
    """Finite float32 values of `shape`: every binade from float32's subnormals up, grid
    points and midpoints of small formats, zeros of both signs, either sign."""
    g = torch.Generator().manual_seed(seed)
    n = torch.Size(shape).numel()
    exponent = torch.randint(-149, 128, (n,), generator=g).double()
    x = (1 + torch.rand(n, generator=g, dtype=torch.float64)) * 2.0**exponent
    x = torch.where(torch.rand(n, generator=g) < 0.3, torch.rand(n, generator=g) * 8, x.float())
    edges = torch.tensor([0.0, -0.0, 0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 6.0, 7.0, 2.0**-149])
    x[: edges.numel()] = edges
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (x.float() * sign).view(shape)


def eager_steps(blocks, factor, scales, decode, fmt, rounding, u, clip_at, dim):
    x = blocks * factor
    values = round_to_format(x, fmt, rounding=rounding, noise=u) * scales
    if decode is not None:
        values = values * decode
    return values, (x.abs() > clip_at).float().sum(dim)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def fused_or_skip(*args, **kwargs):
    out = fused_rounding.fused_block_values(*args, **kwargs)
    if out is None:
        pytest.skip("the compiled path cannot be built here (the eager steps run)")
    return out


@pytest.mark.parametrize("rounding", ROUNDINGS, ids=lambda r: r.value)
@pytest.mark.parametrize("fmt", [FP4_E2M1, FP6_E2M3, FP6_E3M2], ids=lambda f: f.name)
@pytest.mark.parametrize("columns", [False, True], ids=["rows", "columns"])
def test_fused_equals_the_eager_steps(fmt, rounding, columns):
    fused_rounding._state["failed"] = False
    shape, per_block = ((1024, 16, 8), (1024, 1, 8)) if columns else ((8192, 16), (8192, 1))
    g = torch.Generator().manual_seed(1)
    blocks = every_kind(shape, 0)
    factor = torch.where(torch.rand(per_block, generator=g) < 0.1, torch.finfo(torch.float32).max,
                         2.0 ** torch.randint(-20, 20, per_block, generator=g).float()
                         * (1 + torch.rand(per_block, generator=g)))
    scales = torch.rand(per_block, generator=g) * 448
    decode = torch.rand(per_block, generator=g) * 1e-3
    u = torch.rand(shape, generator=g) if rounding is Rounding.STOCHASTIC else None
    got = fused_or_skip(blocks, factor, scales, decode, fmt, rounding, u, clip_at=fmt.max)
    want = eager_steps(blocks, factor, scales, decode, fmt, rounding, u, fmt.max, 1)
    for g_, w in zip(got, want, strict=True):
        bad = (bits(g_) != bits(w)).nonzero()
        assert bad.numel() == 0, f"first mismatch at {bad[0].tolist()}: {g_[tuple(bad[0])]!r}"


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4_sr", "nvfp4_1level"])
@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("special", [None, "nan", "inf"])
def test_quantize_blocks_fused_equals_the_steps(spec, axis, special):
    spec = get(spec)
    fused_rounding._state["failed"] = False
    g = torch.Generator().manual_seed(2)
    x = torch.rand(2, 3, 128, 128, generator=g) ** 6 * 10
    x[0, 0, :16, :16] = 0
    if special is not None:
        x[1, 2, 5, 7] = float(special)
    noise = torch.rand(x.shape, generator=g) if spec.stochastic else None
    fused = quantize_blocks(x, spec, axis=axis, batch_dims=2, noise=noise, fused=True)
    steps = quantize_blocks(x, spec, axis=axis, batch_dims=2, noise=noise)
    want_clipped = steps.scaled.abs().gt(spec.element.max).float().sum(-1)
    got, want = fused.dequantize(torch.float32), steps.dequantize(torch.float32)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(fused.scales), bits(steps.scales))
    if fused.dequantized is None:  # NaN and inf take the steps
        assert special is not None or not fused_rounding.enabled()
    else:
        assert special is None and fused.scaled is None and fused.values is None
        assert torch.equal(fused.clipped, want_clipped)


@pytest.mark.parametrize("case", ["small", "float64", "e4m3", "sr without uniforms",
                                  "strided", "nearest away"])
def test_where_the_compiled_path_does_not_apply(case):
    blocks, one = torch.rand(8192, 16), torch.ones(8192, 1)
    fmt, rounding, u = FP4_E2M1, Rounding.NEAREST_EVEN, None
    if case == "small":
        blocks, one = blocks[:64], one[:64]
    elif case == "float64":
        blocks = blocks.double()
    elif case == "e4m3":
        fmt = FP8_E4M3FN  # 16 binades
    elif case == "sr without uniforms":
        rounding = Rounding.STOCHASTIC
    elif case == "strided":
        blocks = torch.rand(16, 8192).t()
    else:
        rounding = Rounding.NEAREST_AWAY
    assert fused_rounding.fused_block_values(blocks, one, one, None, fmt, rounding, u) is None


def test_a_failed_build_falls_back_to_the_eager_steps_for_the_process(monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(fused_rounding, "_kernel", lambda *args: broken)
    monkeypatch.setitem(fused_rounding._state, "failed", False)
    x = torch.rand(4, 128, 256)
    spec = get("nvfp4")
    got = quantize_blocks(x, spec, fused=True)
    assert not fused_rounding.enabled() and got.dequantized is None
    want = quantize_blocks(x, spec)
    assert torch.equal(got.dequantize(torch.float32), want.dequantize(torch.float32))
    assert quantize_blocks(x, spec, fused=True).dequantized is None  # stays off


@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("special", [None, "nan", "inf"])
def test_block_amax_fused_equals_the_eager_ways(axis, special, monkeypatch):
    quantize = sys.modules["fp4lab.formats.quantize"]
    spec = get("nvfp4")
    x = every_kind((4, 128, 256), 3)
    if special is not None:
        x[1, 17, 33] = float(special)
    layout = quantize._layout(spec, x.shape, axis % x.ndim)
    blocks = layout.to_blocks(x)
    monkeypatch.setitem(fused_rounding._state, "failed", False)
    if fused_rounding.block_amax(x.view(-1, 16)) is None and special is None:
        pytest.skip("the compiled path cannot be built here (the eager steps run)")
    got = quantize._block_amax(blocks, x, layout)
    monkeypatch.setitem(fused_rounding._state, "failed", True)
    want = quantize._block_amax(blocks, x, layout)
    assert got.shape == want.shape and torch.equal(bits(got), bits(want))
