"""The public face: fp4lab.attention picks its backend explicitly and never falls back."""

import pytest
import torch

import fp4lab
import fp4lab.analysis
import fp4lab.recipes


def test_public_names():
    for name in ("attention", "patch_sdpa", "Trace", "AttentionRecipe", "compare", "gradient_bias"):
        assert name in fp4lab.__all__ and hasattr(fp4lab, name)
    assert fp4lab.Trace is fp4lab.recipes.Trace
    assert fp4lab.compare is fp4lab.analysis.compare


def test_reference_backend_is_the_simulation_path():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=g) for _ in range(3))
    trace = fp4lab.Trace()
    got = fp4lab.attention(q, k, v, "nvfp4", causal=True, trace=trace, block_m=32, block_n=32)
    want = fp4lab.analysis.attention(q, k, v, "nvfp4", causal=True, block_m=32, block_n=32)
    assert torch.equal(got, want) and len(trace.calls) == 1
    assert torch.equal(fp4lab.attention(q, k, v), fp4lab.attention(q, k, v, backend="reference"))


def test_triton_is_refused_not_replaced():
    # a float32 CPU tensor is not something the kernels run: an error, not the reference
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="Triton backend runs bf16 or fp16"):
        fp4lab.attention(q, q, q, backend="triton")


@pytest.mark.parametrize("backend", ["cuda", "", None, "Reference"])
def test_unknown_backend_names_the_argument(backend):
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError, match="backend must be one of 'reference', 'triton'"):
        fp4lab.attention(q, q, q, backend=backend)
