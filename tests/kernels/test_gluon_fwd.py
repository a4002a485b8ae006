"""The Gluon forward (`fp4lab.kernels.gluon_fwd`) against the Triton one.

Which calls it takes is tested everywhere (`unsupported` checks the call before the device);
what it computes only on an sm_90 GPU with Triton's Gluon, where it must give the Triton
kernel's O and log-sum-exp bit for bit (the same arithmetic, only the products issued and
waited for in another order) and, through `fp4lab.attention`, the same gradients.
"""

import dataclasses

import pytest
import torch

import fp4lab
from fp4lab.recipes import resolve_recipe

pytest.importorskip("triton")

from fp4lab.kernels import backend, flash, gluon_fwd  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gluon_device() -> bool:
    return DEVICE == "cuda" and gluon_fwd._device_ready(torch.cuda.current_device()) is None


requires_gluon = pytest.mark.skipif(not _gluon_device(), reason="needs an sm_90 GPU and Gluon")


def _tensors(b=1, h=2, hk=2, s=256, d=128, device="cpu", dtype=torch.bfloat16):
    q = torch.zeros(b, h, s, d, dtype=dtype, device=device)
    kv = torch.zeros(b, hk, s, d, dtype=dtype, device=device)
    return q, kv, kv.clone()


def _gap(q, k, v, pq, block=(128, 128, 8), out_dtype=None, scale=1.0, causal=False, **extras):
    return gluon_fwd.unsupported(q, k, v, pq, block_m=block[0], block_n=block[1],
                                 num_warps=block[2], out_dtype=out_dtype, extras=extras,
                                 scale=scale, causal=causal)


NVFP4 = backend.p_quantizer(resolve_recipe("nvfp4"))
FP8 = backend.p_quantizer(resolve_recipe("fa4fp4_causal"))  # E4M3 P, no lift


def _fp8_tensors(b=1, h=2, hk=2, s=256, d=128):
    """q, k bf16 and V key-major E4M3, as `backend.prepare_forward` hands FP8 P V to the
    kernel on a GPU."""
    q, k, _ = _tensors(b, h, hk, s, d)
    v = torch.zeros(b, hk, d, s, dtype=torch.float8_e4m3fn).transpose(-1, -2)
    return q, k, v


def test_a_call_it_takes_reaches_the_device_check():
    assert _gap(*_tensors(), NVFP4) == "not on a GPU"
    assert _gap(*_tensors(h=4, hk=2), backend.p_quantizer(resolve_recipe("mxfp4"))) == (
        "not on a GPU")


@pytest.mark.parametrize("change, reason", [
    (dict(extras=dict(trace=True)), "arguments the Gluon forward does not take: trace"),
    (dict(extras=dict(reverse=True, lazy=True)), "does not take: lazy, reverse"),
    (dict(block=(64, 64, 4)), "tiles 64 x 64 at 4 warps"),
    (dict(out_dtype=torch.float32), "O in torch.float32"),
    (dict(tensors=dict(s=200)), "sequence lengths 200, 200"),
    (dict(tensors=dict(d=64)), "head dims 64"),
    (dict(tensors=dict(dtype=torch.float16)), "not bf16"),
    (dict(tensors=dict(h=3, hk=2)), "3 query heads over 2 key heads"),
    (dict(pq=FP8), "P is E4M3 but V is not key-major E4M3"),
    (dict(pq=dataclasses.replace(NVFP4, SR=True)), "not a block format rounded to nearest"),
    (dict(pq=dataclasses.replace(FP8, SR=True)), "not a block format rounded to nearest"),
    (dict(pq=backend.p_quantizer(resolve_recipe("exact"))), "nor E4M3 with E4M3 V"),
], ids=["trace", "flags", "tiles", "out_dtype", "seq", "head_dim", "dtype", "gqa", "fp8_p",
        "sr", "fp8_sr", "unquantized_p"])
def test_what_it_does_not_take_is_named(change, reason):
    q, k, v = _tensors(**change.get("tensors", {}))
    got = _gap(q, k, v, change.get("pq", NVFP4), change.get("block", (128, 128, 8)),
               change.get("out_dtype"), **change.get("extras", {}))
    assert got is not None and reason in got


@pytest.mark.parametrize("recipe", ["fa4fp4_causal", "fa3_fp8", "fp8_per_tensor"])
def test_an_fp8_call_with_its_lazy_maximum_or_reversed_keys_reaches_the_device_check(recipe):
    pq = backend.p_quantizer(resolve_recipe(recipe))
    assert _gap(*_fp8_tensors(h=4, hk=2), pq, lazy_log2=True, reverse=True) == "not on a GPU"
    # what the FP8 kind takes is only those two: the other flags stay named
    assert "does not take: trace" in _gap(*_fp8_tensors(), pq, reverse=True, trace=True)


def test_an_fp8_call_names_row_major_v_and_a_scale_that_is_not_positive():
    q, k, v = _fp8_tensors()
    assert "not key-major" in _gap(q, k, v.contiguous(), FP8)
    assert "scale 0.0" in _gap(q, k, v, FP8, scale=0.0)
    assert "causal with E4M3 P" in _gap(q, k, v, FP8, causal=True)
    assert "not bf16" in _gap(q.half(), k, v, FP8)


def test_non_contiguous_or_unaligned_operands_and_the_switch(monkeypatch):
    q, k, v = _tensors()
    assert "not contiguous" in _gap(q.transpose(1, 2).contiguous().transpose(1, 2), k, v,
                                    NVFP4)
    flat = torch.zeros(1 + 256 * 128 * 2, dtype=torch.bfloat16)
    unaligned = flat[1:].view(1, 2, 256, 128)  # contiguous, 2 bytes past 16
    assert "16 bytes" in _gap(unaligned, k, v, NVFP4)
    monkeypatch.setenv("FP4LAB_GLUON", "0")
    assert _gap(q, k, v, NVFP4) == "FP4LAB_GLUON=0"


def _inputs(b, h, hk, s, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda heads: torch.randn(b, heads, s, 128, generator=g, device="cuda").bfloat16()  # noqa: E731
    return make(h), make(hk), make(hk)


def _forward(ops, pq, causal, monkeypatch, gluon: bool, **options):
    """flash.attention_forward of prepared operands, with the recipe's `options`
    (`backend.forward_options`: the lazy maximum, the reversed key order)."""
    monkeypatch.setenv("FP4LAB_GLUON", "1" if gluon else "0")
    return flash.attention_forward(
        ops["q"], ops["k"], ops["v"], ops["factors"], pq, causal=causal, scale=128**-0.5,
        block_m=128, block_n=128, num_warps=8, num_stages=3, lse_log2=True, **options)


@requires_gluon
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4", "nvfp4_1level", "fa4fp4_causal",
                                    "fa3_fp8", "fp8_per_tensor"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("b, h, hk, s", [(2, 4, 2, 512), (1, 3, 3, 1024)], ids=["gqa", "mha"])
def test_the_gluon_forward_is_the_triton_forward_bit_for_bit(recipe, causal, b, h, hk, s,
                                                             monkeypatch):
    """Two calls of one signature, each on fresh inputs: the first through `triton.jit`, the
    second by the compiled kernel directly (`fp4lab.kernels.launch`)."""
    r = resolve_recipe(recipe)
    pq = backend.p_quantizer(r)
    if causal and gluon_fwd._fp8_p(pq):
        pytest.skip("causal E4M3 P runs the Triton kernel (`gluon_fwd.unsupported`)")
    taken = []
    real = gluon_fwd.attention_forward
    monkeypatch.setattr(gluon_fwd, "attention_forward",
                        lambda *a, **kw: taken.append(1) or real(*a, **kw))
    for call in range(2):
        q, k, v = _inputs(b, h, hk, s, seed=hash((recipe, causal, s, call)) % 2**31)
        ops = backend.prepare_forward(q, k, v, r, 128, 128)
        options = backend.forward_options(r, causal, ops["v"])
        o_g, lse_g = _forward(ops, pq, causal, monkeypatch, gluon=True, **options)
        assert len(taken) == call + 1, "the Gluon forward did not take the call"
        o_t, lse_t = _forward(ops, pq, causal, monkeypatch, gluon=False, **options)
        assert len(taken) == call + 1
        assert torch.isfinite(o_t.float()).all() and torch.isfinite(lse_t).all()
        assert torch.equal(o_g, o_t)
        assert torch.equal(lse_g, lse_t)


@requires_gluon
@pytest.mark.parametrize("recipe", ["nvfp4", "fa4fp4_causal", "fa3_fp8"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_attention_with_the_gluon_forward_has_the_same_gradients(recipe, causal, monkeypatch):
    if causal and recipe != "nvfp4":
        pytest.skip("causal E4M3 P runs the Triton kernel (`gluon_fwd.unsupported`)")
    q, k, v = (x.requires_grad_() for x in _inputs(1, 4, 2, 512, seed=7))
    do = torch.randn_like(q)
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FP4LAB_GLUON", flag)
        o = fp4lab.attention(q, k, v, recipe, backend="triton", causal=causal)
        grads = torch.autograd.grad(o, (q, k, v), do)
        results.append((o, *grads))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
