"""Dropout in the simulation path: SDPA's semantics with a seeded, position-keyed mask."""

import math

import pytest
import torch
import torch.nn.functional as F

import fp4lab
from fp4lab.analysis import attention, patch_sdpa

F64 = torch.float64
P = 0.3


def qkv(seed, s=40, d=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, s, d, generator=g, dtype=F64) for _ in range(3)]


def weights(q, k, **options):
    """The attention weights as the output of V = I (one row per key)."""
    eye = torch.eye(k.shape[2], dtype=F64).expand(1, k.shape[1], -1, -1)
    return attention(q, k, eye, "exact", causal=True, block_m=16, block_n=16, **options)


def test_dropout_drops_weights_and_scales_the_rest():
    q, k, _ = qkv(0)
    kept, full = weights(q, k, dropout_p=P, generator=7), weights(q, k)
    visible = full > 0
    dropped = visible & (kept == 0)
    fraction = dropped.sum().item() / visible.sum().item()
    n = visible.sum().item()
    assert abs(fraction - P) < 5 * math.sqrt(P * (1 - P) / n), fraction  # 5 binomial sd
    assert torch.allclose(kept[visible & ~dropped], full[visible & ~dropped] / (1 - P))


def test_dropout_gradients_are_those_of_the_dense_formula_with_its_mask():
    q, k, v = qkv(1)
    keep = (weights(q, k, dropout_p=P, generator=7) != 0).to(F64) / (1 - P)
    do = torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(2), dtype=F64)
    a = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*a, "exact", causal=True, dropout_p=P, generator=7, block_m=16, block_n=16)
    out.backward(do)
    b = [x.clone().requires_grad_() for x in (q, k, v)]
    s = (b[0] @ b[1].transpose(-1, -2) / 4).masked_fill(
        ~torch.ones(40, 40).tril().bool(), -math.inf
    )
    ref = (s.softmax(-1) * keep) @ b[2]
    ref.backward(do)
    assert torch.allclose(out, ref, atol=1e-13, rtol=0)
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x.grad, y.grad, atol=1e-12, rtol=0)


def test_the_seed_decides_the_mask_and_the_trace_records_p():
    q, k, v = qkv(3)
    runs = [
        attention(q, k, v, "nvfp4", dropout_p=P, generator=s, block_m=16, block_n=16)
        for s in (1, 1, 2)
    ]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    trace = fp4lab.Trace()
    attention(q, k, v, "nvfp4", dropout_p=P, generator=1, trace=trace, block_m=16, block_n=16)
    assert trace.calls[0].meta["dropout_p"] == P and trace.calls[0].meta["seed"] == 1


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, "0.1", True])
def test_dropout_p_outside_zero_one_is_an_error(bad):
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match="dropout_p must be a number in"):
        attention(q, k, v, dropout_p=bad, generator=0)


def test_dropout_needs_a_generator():
    q, k, v = qkv(5)
    with pytest.raises(ValueError, match="generator: dropout_p=0.3 draws a dropout mask"):
        attention(q, k, v, dropout_p=P)


def test_patch_sdpa_runs_dropout_with_its_generator():
    q, k, v = qkv(6)
    with patch_sdpa("exact", generator=9, block_m=16, block_n=16):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=P, is_causal=True)
    want = attention(
        q,
        k,
        v,
        "exact",
        causal=True,
        dropout_p=P,
        generator=torch.Generator().manual_seed(9),
        block_m=16,
        block_n=16,
    )
    assert torch.equal(out, want)
