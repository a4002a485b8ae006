"""attention(): exactness against SDPA, operands equal fake_quantize, each preset's behaviour,
masks, NaN, bad input, patch_sdpa.

The oracles: torch's own scaled_dot_product_attention in float64 for the exact recipe, and
`dense_attention` / `dense_backward` below, the recipe's formula written densely with
fp4lab.formats.fake_quantize, for quantized recipes on one query tile and one key tile (where
online softmax and per-tile scales coincide with the dense formula).
"""

import dataclasses
import importlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fp4lab.analysis import attention, patch_sdpa
from fp4lab.analysis.context import CallConfig, Pass
from fp4lab.analysis.p_quant import _direct_p, quantize_p
from fp4lab.analysis.quantizers import quantize_operand
from fp4lab.analysis.tiling import Tiling
from fp4lab.formats import (
    BF16,
    BLOCK_FORMATS,
    FP4_E2M1,
    FloatFormat,
    fake_quantize,
    get,
    round_to_format,
)
from fp4lab.recipes import (
    PRESETS,
    AttentionRecipe,
    BackwardP,
    DeltaSource,
    DsP,
    PQuant,
    RowSum,
    TensorScope,
    Trace,
    resolve_recipe,
)

F64 = torch.float64
tiling_module = importlib.import_module("fp4lab.analysis.tiling")


def rand(*shape, dtype=F64, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype)


def qkv(b=1, h=2, hk=None, sq=37, sk=29, d=32, dv=None, dtype=F64, seed=0):
    hk = hk or h
    return (
        rand(b, h, sq, d, dtype=dtype, seed=seed),
        rand(b, hk, sk, d, dtype=dtype, seed=seed + 1),
        rand(b, hk, sk, dv or d, dtype=dtype, seed=seed + 2),
    )


def grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


def close(a, b, tol):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol, (
        f"max abs error {err:.3e} > {tol:.1e} at {torch.argmax((a - b).abs()).item()}"
    )


# -- dense oracles for one query tile x one key tile -----------------------------------------------
def fq(x, spec, axis, prescale=1.0):
    """fake_quantize(x * c, spec, axis) / c; an element cast for a FloatFormat; x for None."""
    if spec is None:
        return x
    xs = x * prescale
    if isinstance(spec, FloatFormat):
        return round_to_format(xs, spec) / prescale
    if spec.block is not None and len(spec.block) == 2:
        axis = -1
    return fake_quantize(xs, spec, axis=axis) / prescale


def fq_tiles(x, spec, axis, prescale=1.0):
    """fq of each (batch, head) matrix on its own: in-kernel operands scale per tile."""
    out = torch.empty_like(x)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            out[b, h] = fq(x[b, h], spec, axis, prescale)
    return out


def fq_whole(x, spec, axis, recipe, groups=1):
    """fq of a whole tensor (B, H, S, E) as the recipe's tensor_scope takes its tensor scale:
    over all of it, or per (batch, KV head) with `groups` query heads a KV head."""
    if recipe.tensor_scope is TensorScope.TENSOR:
        return fq(x, spec, axis)
    assert recipe.tensor_scope is TensorScope.HEAD
    view = x.reshape(x.shape[0], x.shape[1] // groups, groups, *x.shape[2:])
    out = torch.stack(
        [
            torch.stack([fq(view[b, h], spec, axis) for h in range(view.shape[1])])
            for b in range(view.shape[0])
        ]
    )
    return out.reshape(x.shape)


def one_tile_pass(recipe, counts=False):
    """A deterministic forward pass over one tile pair, for calling the quantizers directly."""
    cfg = CallConfig(recipe, False, 1.0, 128, 128, None, None, None)
    return Pass(cfg, Tiling(1, 1, 1, 128, 128, 128, 128, False), None, None, counts)


def expand(x, heads):
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def causal_mask(sq, sk):
    return torch.ones(sq, sk, dtype=torch.bool).tril()


def dense_attention(q, k, v, recipe, causal=False):
    """O and lse of a PQuant.SPEC recipe, densely (one tile)."""
    h, scale = q.shape[1], 1 / math.sqrt(q.shape[-1])
    g = h // k.shape[1]
    qh = fq_whole(q, recipe.q, -1, recipe, g)
    kh, vh = (
        expand(fq_whole(k, recipe.k, -1, recipe), h),
        expand(fq_whole(v, recipe.v, -2, recipe), h),
    )
    s = scale * qh @ kh.transpose(-1, -2)
    if causal:
        s = s.masked_fill(~causal_mask(*s.shape[-2:]), -math.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(s - m)
    p_hat = fq_tiles(p, recipe.p, -1, recipe.p_lift)
    denom = (p_hat if recipe.row_sum is RowSum.QUANTIZED_P else p).sum(-1, keepdim=True)
    return p_hat @ vh / denom, m + torch.log(denom)


def dense_backward(q, k, v, do, o, lse, recipe, causal=False):
    """dQ, dK, dV of a BackwardMode.FLASH recipe, densely (one tile)."""
    h, hk, scale = q.shape[1], k.shape[1], 1 / math.sqrt(q.shape[-1])
    quantized = recipe.backward_p is BackwardP.QUANTIZED_QK
    qs, ks = (fq(q, recipe.q, -1), fq(k, recipe.k, -1)) if quantized else (q, k)
    s = scale * qs @ expand(ks, h).transpose(-1, -2)
    if causal:
        s = s.masked_fill(~causal_mask(*s.shape[-2:]), -math.inf)
    p = torch.exp(s - lse)
    do_dp = fq(do, recipe.dp_do, -1)
    delta = ((do_dp if recipe.delta is DeltaSource.QUANTIZED_DO else do) * o).sum(-1, keepdim=True)
    p_dv = fq_tiles(p, recipe.dv_p, -2, recipe.dv_p_lift)
    dv = p_dv.transpose(-1, -2) @ fq(do, recipe.dv_do, -2)
    dp = do_dp @ expand(fq(v, recipe.dp_v, -1), h).transpose(-1, -2)
    ds = (p_dv if recipe.ds_p is DsP.DV_OPERAND else p) * (dp - delta)
    dq = scale * fq_tiles(ds, recipe.dq_ds, -1, recipe.ds_lift) @ expand(fq(k, recipe.dq_k, -2), h)
    dk = (
        scale
        * fq_tiles(ds, recipe.dk_ds, -2, recipe.ds_lift).transpose(-1, -2)
        @ fq(q, recipe.dk_q, -2)
    )
    group = lambda x: x.reshape(x.shape[0], hk, h // hk, *x.shape[2:]).sum(2)  # noqa: E731
    return dq, group(dk), group(dv)


# -- exact: SDPA to 1e-10 in float64, FlashAttention's budget in float32 ---------------------------
def sdpa(q, k, v, causal=False, mask=None):
    if causal and mask is not None:
        mask, causal = mask & causal_mask(q.shape[-2], k.shape[-2]), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True
    )


@pytest.mark.parametrize(
    "shape",
    [
        (1, 2, 2, 37, 29, 32, 32),
        (2, 4, 2, 40, 100, 64, 48),
        (1, 3, 1, 70, 30, 32, 32),
        (1, 1, 1, 1, 1, 256, 256),
    ],
    ids=["uneven", "gqa-dv", "mqa-sq>sk", "one-token-d256"],
)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_exact_float64_matches_sdpa(shape, causal):
    b, h, hk, sq, sk, d, dv = shape
    q, k, v = (x.requires_grad_() for x in qkv(b, h, hk, sq, sk, d, dv))
    do = rand(b, h, sq, dv, seed=9)
    out = attention(q, k, v, causal=causal, block_m=16, block_n=32)
    ref = sdpa(q, k, v, causal)
    close(out, ref, 1e-10)
    for g, g_ref in zip(grads(out, (q, k, v), do), grads(ref, (q, k, v), do), strict=True):
        close(g, g_ref, 1e-10)


@given(
    b=st.integers(1, 2),
    hk=st.integers(1, 2),
    group=st.integers(1, 3),
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    d=st.sampled_from([32, 48]),
    causal=st.booleans(),
    masked=st.booleans(),
    bm=st.sampled_from([8, 16, 32]),
    bn=st.sampled_from([8, 16, 32]),
    seed=st.integers(0, 2**16),
)
def test_exact_matches_sdpa_over_shapes_masks_and_gqa(
    b, hk, group, sq, sk, d, causal, masked, bm, bn, seed
):
    q, k, v = (x.requires_grad_() for x in qkv(b, hk * group, hk, sq, sk, d, seed=seed))
    mask = None
    if masked:  # random keep-mask, some rows fully masked
        g = torch.Generator().manual_seed(seed)
        mask = torch.rand(b, 1, sq, sk, generator=g) < 0.6
    do = rand(b, hk * group, sq, d, seed=seed + 7)
    out = attention(q, k, v, causal=causal, block_m=bm, block_n=bn, attn_mask=mask)
    ref = sdpa(q, k, v, causal, mask)
    close(out, ref, 1e-10)
    for g_out, g_ref in zip(grads(out, (q, k, v), do), grads(ref, (q, k, v), do), strict=True):
        close(g_out, g_ref, 1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_exact_float32_within_flash_attention_budget(causal):
    # flash-attention's test rule: error against float64 at most twice plain float32 torch's.
    q64, k64, v64 = (x.requires_grad_() for x in qkv(2, 4, 2, 300, 260, 64, seed=3))
    do64 = rand(2, 4, 300, 64, seed=4)
    q, k, v = (x.detach().float().requires_grad_() for x in (q64, k64, v64))
    ref = sdpa(q64, k64, v64, causal)
    ref_grads = grads(ref, (q64, k64, v64), do64)

    def plain(q, k, v):
        s = q @ expand(k, 4).transpose(-1, -2) / 8.0
        if causal:
            s = s.masked_fill(~causal_mask(300, 260), -math.inf)
        return s.softmax(-1) @ expand(v, 4)

    for fn in (plain, lambda q, k, v: attention(q, k, v, causal=causal, block_m=64, block_n=64)):
        out = fn(q, k, v)
        errs = [(out.double() - ref).abs().max()] + [
            (g.double() - r).abs().max()
            for g, r in zip(grads(out, (q, k, v), do64.float()), ref_grads, strict=True)
        ]
        if fn is plain:
            budget = [2 * e for e in errs]
    assert all(e <= b for e, b in zip(errs, budget, strict=True)), (errs, budget)


def test_causal_mask_is_top_left_like_sdpa():
    q, k, v = qkv(1, 1, 1, 6, 3, 32)
    out = attention(q, k, v, causal=True, block_m=2, block_n=2)
    close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), 1e-12)
    close(out[0, 0, 0], v[0, 0, 0], 1e-12)  # query 0 sees key 0 only


def test_fully_masked_rows_give_zero_output_and_gradients_as_sdpa():
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 5, 7, 32))
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False
    do = rand(1, 2, 5, 32, seed=5)
    out = attention(q, k, v, "nvfp4", attn_mask=mask, block_m=16, block_n=16)
    assert torch.equal(out[:, :, 2], torch.zeros_like(out[:, :, 2]))
    dq, dk, dv = grads(out, (q, k, v), do)
    assert torch.equal(dq[:, :, 2], torch.zeros_like(dq[:, :, 2])) and torch.isfinite(dk).all()
    exact = attention(q, k, v, attn_mask=mask)
    close(exact, sdpa(q, k, v, mask=mask), 1e-12)


def test_empty_keys_give_zeros_as_sdpa():
    q, k, v = qkv(1, 1, 1, 4, 0, 32)
    assert torch.equal(attention(q, k, v), torch.zeros(1, 1, 4, 32, dtype=F64))


def test_additive_float_mask_as_sdpa():
    q, k, v = qkv(1, 2, 1, 9, 11, 32)
    bias = rand(1, 2, 9, 11, seed=8)
    close(attention(q, k, v, attn_mask=bias, block_m=4, block_n=4), sdpa(q, k, v, mask=bias), 1e-12)


def test_tile_sizes_and_chunking_do_not_change_exact_results(monkeypatch):
    q, k, v = qkv(1, 2, 2, 70, 90, 32)
    base = attention(q, k, v, causal=True, block_m=16, block_n=16)
    close(attention(q, k, v, causal=True, block_m=32, block_n=8), base, 1e-12)
    monkeypatch.setattr(tiling_module, "BLOCK_ELEMENTS", 600)
    close(attention(q, k, v, causal=True, block_m=16, block_n=16), base, 1e-14)


@pytest.mark.parametrize("recipe", ["nvfp4", "fa4fp4_causal", "sageattn3"])
def test_chunking_of_query_tiles_does_not_change_quantized_results(monkeypatch, recipe):
    # Query tiles are independent; only matmul batching (last-bit rounding) may differ.
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 1, 70, 90, 32))
    do = rand(1, 2, 70, 32, seed=3)
    out = attention(q, k, v, recipe, causal=True, block_m=16, block_n=32)
    g = grads(out, (q, k, v), do)
    monkeypatch.setattr(tiling_module, "BLOCK_ELEMENTS", 16 * 32)
    out2 = attention(q, k, v, recipe, causal=True, block_m=16, block_n=32)
    close(out, out2, 1e-13)
    for a, b in zip(g, grads(out2, (q, k, v), do), strict=True):
        close(a, b, 1e-12)


@pytest.mark.parametrize("budget", [16 * 32, 2 * 16 * 32, 3 * 16 * 32, 5 * 16 * 32])
@pytest.mark.parametrize("causal", [False, True])
def test_key_tile_groups_give_the_online_softmax_values(monkeypatch, budget, causal):
    # A block takes several key tiles at once through a cumulative row maximum; the P tiles
    # quantization sees are exp(S - m_j) with the loop's m_j, so every block size quantizes
    # the same values (nvfp4's per-tile scales would show any difference), and the trace's
    # per-tile statistics agree too.
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 1, 70, 150, 32, seed=5))
    do = rand(1, 2, 70, 32, seed=6)
    runs = []
    for elements in (None, budget):
        if elements is not None:
            monkeypatch.setattr(tiling_module, "BLOCK_ELEMENTS", elements)
        trace = Trace(reference_dtype=F64)
        out = attention(q, k, v, "nvfp4", causal=causal, block_m=16, block_n=32, trace=trace)
        runs.append((out, grads(out, (q, k, v), do), trace.to_frame()))
    (out, g, frame), (out2, g2, frame2) = runs
    close(out, out2, 1e-13)
    for a, b in zip(g, g2, strict=True):
        close(a, b, 1e-12)
    assert frame[["product", "q_tile", "k_tile"]].equals(frame2[["product", "q_tile", "k_tile"]])
    stats = frame.select_dtypes("number").to_numpy()
    assert np.allclose(
        stats, frame2.select_dtypes("number").to_numpy(), rtol=1e-9, atol=1e-9, equal_nan=True
    )


# -- every operand is fake_quantize of that operand ------------------------------------------------
# deterministic ones: stochastic rounding is checked with its draws in test_stochastic_*
SPECS = [
    s.name
    for s in BLOCK_FORMATS
    if s.rounding.value != "stochastic" and (s.hadamard or 1) <= 32 and s.correction.value == "none"
]


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("axis", [-1, -2])
def test_quantize_operand_is_fake_quantize_bit_for_bit(name, axis):
    spec = get(name)
    x = rand(2, 3, 48, 64, dtype=torch.float32, seed=11, scale=3.0)
    x[0, 1, 5, 7] = 0.0
    want = fake_quantize(x, spec, axis=-1 if spec.block and len(spec.block) == 2 else axis)
    assert torch.equal(quantize_operand(x, spec, axis=axis).values, want)


@pytest.mark.parametrize("name", SPECS)
def test_per_tile_quantization_is_fake_quantize_of_each_tile(name):
    spec = get(name)
    tiles = (
        rand(2, 3, 32, 64, dtype=torch.float32, seed=12)
        * rand(2, 3, 1, 1, dtype=torch.float32, seed=13).exp()
    )
    got = quantize_operand(tiles, spec, axis=-1, per_tile=True).values
    for b in range(2):
        for h in range(3):
            per_tensor = spec.block is None
            one = spec if not per_tensor else dataclasses.replace(spec, block=(32, 64))
            assert torch.equal(got[b, h], fake_quantize(tiles[b, h], one, axis=-1)), (b, h)


def test_stochastic_rounding_draws_as_fake_quantize_does():
    x = rand(2, 2, 16, 64, dtype=torch.float32, seed=14)
    spec = get("nvfp4_sr")
    got = quantize_operand(x, spec, axis=-1, generator=torch.Generator().manual_seed(5)).values
    assert torch.equal(got, fake_quantize(x, spec, axis=-1, generator=5))


SINGLE_TILE_RECIPES = [
    "exact",
    "bf16",
    "fp8_per_tensor",
    "fa4fp4_causal",
    "nvfp4",
    "mxfp4",
    "nvfp4_2d",
    "fa3_fp8_noincoherent",
    "fwd_only_quantized_qk",
]


def single_tile_recipe(name):
    if name == "fa3_fp8_noincoherent":
        return dataclasses.replace(
            resolve_recipe("fa3_fp8"), name=name, incoherent_processing=False
        )
    if name == "fwd_only_quantized_qk":  # backward rebuilds P from Q^, K^ but multiplies exactly
        return AttentionRecipe(name=name, q="nvfp4", k="mxfp4", backward_p=BackwardP.QUANTIZED_QK)
    return resolve_recipe(name)


@pytest.mark.parametrize("name", SINGLE_TILE_RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_tile_equals_the_dense_fake_quantized_formula(name, causal):
    """Each of the twelve operands is fake_quantize of that operand along its product's
    reduction axis (P and dS per tile, prescaled where the recipe says)."""
    recipe = single_tile_recipe(name)
    q, k, v = (x.requires_grad_() for x in qkv(2, 4, 2, 37, 45, 32, seed=21))
    do = rand(2, 4, 37, 32, seed=22)
    out = attention(q, k, v, recipe, causal=causal, block_m=64, block_n=64)
    o_ref, lse = dense_attention(q.detach(), k.detach(), v.detach(), recipe, causal)
    close(out, o_ref, 1e-12)
    got = grads(out, (q, k, v), do)
    want = dense_backward(q.detach(), k.detach(), v.detach(), do, out.detach(), lse, recipe, causal)
    for g, w in zip(got, want, strict=True):
        close(g, w, 1e-11)


def test_per_tile_p_scale_does_not_couple_batch_entries():
    # A fused kernel never sees another batch entry: P's tensor scale is per tile (whereas
    # a whole-tensor operand such as K shares one tensor scale across the batch).
    q, k, v = qkv(2, 1, 1, 16, 32, 32, seed=30)
    k2 = k.clone()
    k2[1] *= 10.0
    for recipe, coupled in ((AttentionRecipe(name="p_only", p="nvfp4"), False), ("nvfp4", True)):
        a = attention(q, k, v, recipe, block_m=16, block_n=32)
        b = attention(q, k2, v, recipe, block_m=16, block_n=32)
        assert torch.equal(a[0], b[0]) != coupled and not torch.equal(a[1], b[1])


# -- each preset's defining behaviour --------------------------------------------------------------
def test_fa3_incoherent_processing_cancels_and_spreads_outliers():
    q, k, v = qkv(1, 2, 2, 128, 128, 64, seed=40)
    unquantized = dataclasses.replace(
        resolve_recipe("fa3_fp8_paper"), name="rot", q=None, k=None, v=None, p=None
    )
    close(attention(q, k, v, unquantized), attention(q, k, v), 1e-12)
    # FlashAttention-3's outlier inputs: N(0,1) + N(0,100) * Bernoulli(0.001)
    g = torch.Generator().manual_seed(41)
    heavy = lambda: (
        torch.randn(1, 2, 256, 64, generator=g, dtype=F64)
        + 10
        * torch.randn(1, 2, 256, 64, generator=g, dtype=F64)
        * (torch.rand(1, 2, 256, 64, generator=g) < 1e-3)
    )  # noqa: E731
    q, k, v = heavy(), heavy(), heavy()
    exact = attention(q, k, v)
    err = lambda r: ((attention(q, k, v, r) - exact).norm() / exact.norm()).item()  # noqa: E731
    plain = dataclasses.replace(
        resolve_recipe("fa3_fp8_paper"), name="no_rot", incoherent_processing=False
    )
    assert err("fa3_fp8_paper") < err(plain)


def test_fa3_needs_a_power_of_two_head_dim():
    q, k, v = qkv(1, 1, 1, 8, 8, 48)
    with pytest.raises(ValueError, match="head_dim=48"):
        attention(q, k, v, "fa3_fp8_paper")


def test_sageattn3_smoothing_leaves_the_unquantized_output_unchanged():
    smooth = dataclasses.replace(
        resolve_recipe("sageattn3"),
        name="smooth_only",
        q=None,
        k=None,
        p=None,
        v=None,
        p_quant=PQuant.SPEC,
    )
    q, k, v = (x.requires_grad_() for x in qkv(2, 2, 1, 50, 70, 64, seed=42))
    k_shifted = (
        (k + 5.0).detach().requires_grad_()
    )  # a large common offset, which smoothing removes
    do = rand(2, 2, 50, 64, seed=43)
    for causal in (False, True):
        out = attention(q, k_shifted, v, smooth, causal=causal, block_m=16, block_n=32)
        ref = attention(q, k_shifted, v, causal=causal)
        close(out, ref, 1e-12)
        for g, r in zip(
            grads(out, (q, k_shifted, v), do), grads(ref, (q, k_shifted, v), do), strict=True
        ):
            close(g, r, 1e-11)
    # quantized, the smoothing removes what the offset costs FP4
    q, k, v = qkv(1, 2, 2, 64, 64, 64, seed=44)
    exact = attention(q, k + 5.0, v)
    err = lambda r: ((attention(q, k + 5.0, v, r) - exact).norm() / exact.norm()).item()  # noqa: E731
    assert err("sageattn3") < err(
        dataclasses.replace(resolve_recipe("sageattn3"), name="unsmoothed", smooth_k="none")
    )


def test_sageattn3_paper_two_level_p_maps_each_row_max_to_448_times_6():
    recipe = resolve_recipe("sageattn3_paper")
    s = rand(1, 1, 1, 16, 64, seed=45, scale=3.0)
    m = s.amax(-1)
    p = torch.exp(s - m.unsqueeze(-1)) * 0.37  # a tile whose rows do not reach 1
    p_hat = quantize_p(p, s, m, one_tile_pass(recipe), (0, 0)).values
    close(p_hat.amax(-1), p.amax(-1), 1e-15)  # 448 * 6 is E4M3 448 x E2M1 6: exact
    r = 448 * 6 / p.amax(-1, keepdim=True)
    close(p_hat, fq(p * r, get("nvfp4_1level"), -1) / r, 1e-15)


def dense_attn_qat(q, k, v, do, recipe):
    """Attn-QAT as FastVideo's training kernel computes it, densely (one tile): O = P^ V^ /
    sum P with P = exp(S^ - m) quantized along the keys; dV from the normalized P
    re-quantized; dS = bf16(P (dP - D)), D = rowsum(dO * O'), O' = P V^ / sum P; dQ, dK on
    K^, Q^ (straight through to Q, K, V)."""
    scale = 1 / math.sqrt(q.shape[-1])
    q_hat, k_hat = fake_quantize(q, recipe.q), fake_quantize(k, recipe.k)
    v_hat = fake_quantize(v, recipe.v, axis=-1)  # V along head_dim
    s = scale * q_hat @ k_hat.transpose(-1, -2)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    out = fake_quantize(p, recipe.p) @ v_hat / p.sum(-1, keepdim=True)
    p_norm = s.softmax(-1)
    dv = fake_quantize(p_norm, recipe.p).transpose(-1, -2) @ do
    dp = do @ v_hat.transpose(-1, -2)
    delta = (do * (p_norm @ v_hat)).sum(-1, keepdim=True)
    ds = round_to_format(p_norm * (dp - delta), BF16)
    return out, (scale * ds @ k_hat, scale * ds.transpose(-1, -2) @ q_hat, dv)


def test_attn_qat_backward_is_straight_through_its_forward():
    recipe = resolve_recipe("attn_qat")
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 40, 48, 32, seed=46))
    do = rand(1, 2, 40, 32, seed=47)
    out = attention(q, k, v, recipe, block_m=64, block_n=64)
    ref, want = dense_attn_qat(q.detach(), k.detach(), v.detach(), do, recipe)
    close(out, ref, 1e-12)
    for g, r in zip(grads(out, (q, k, v), do), want, strict=True):
        close(g, r, 1e-10)


def test_attn_qat_dropin_backward_recomputes_p_from_unquantized_qk():
    recipe = resolve_recipe("attn_qat_dropin")
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 40, 48, 32, seed=48))
    do = rand(1, 2, 40, 32, seed=49)
    out = attention(q, k, v, recipe, block_m=64, block_n=64)
    s_q = (
        fake_quantize(q.detach(), recipe.q)
        @ fake_quantize(k.detach(), recipe.k).transpose(-1, -2)
        / math.sqrt(32)
    )
    lse = torch.logsumexp(s_q, -1, keepdim=True)  # the forward's lse: unquantized P of S^
    want = dense_backward(
        q.detach(),
        k.detach(),
        v.detach(),
        do,
        out.detach(),
        lse,
        dataclasses.replace(recipe, p=None, q=None, k=None, v=None, p_quant=PQuant.SPEC),
        False,
    )
    got = grads(out, (q, k, v), do)
    for g, w in zip(got, want, strict=True):
        close(g, w, 1e-11)
    qat = grads(attention(q, k, v, "attn_qat", block_m=64, block_n=64), (q, k, v), do)
    assert all(not torch.allclose(a, b) for a, b in zip(got, qat, strict=True))


@pytest.mark.parametrize("name", ["fa4fp4_directp", "fa4fp4_causal_mxfp4pv", "croissattn"])
def test_row_correction_makes_outputs_convex_combinations_of_v(name):
    q, k, _ = qkv(1, 2, 2, 70, 90, 64, seed=50)
    ones = torch.ones(1, 2, 90, 64, dtype=F64)  # MXFP4 and NVFP4 hold 1 exactly
    out = attention(
        q, k, ones, name, causal=name != "fa4fp4_directp", block_m=32, block_n=32, generator=0
    )
    close(out, torch.ones_like(out), 1e-12)
    without = attention(q, k, ones, "attn_qat", block_m=32, block_n=32)  # l sums unquantized P
    assert (without - 1).abs().max() > 1e-3


def test_direct_p_denominator_is_the_sum_of_the_p_that_pv_consumes():
    recipe = resolve_recipe("fa4fp4_directp")
    q, k, v = qkv(1, 1, 1, 32, 64, 64, seed=51)
    v = v.abs() + 0.5
    e1 = torch.zeros(64, dtype=F64)
    e1[0] = 1.0
    # with V = (v_j, 1, 1, ...) columns, O[:, 1] = sum(P^) / l: exactly 1 when l sums P^
    v_aug = torch.cat([v[..., :1], torch.ones_like(v[..., 1:])], dim=-1)
    out = attention(q, k, v_aug, recipe, block_m=32, block_n=64)
    close(out[..., 1:], torch.ones_like(out[..., 1:]), 1e-12)


def test_direct_p_affine_code_map():
    recipe = resolve_recipe("fa4fp4_directp")  # A = 1.50, B = 1.20 on blocks 1..3 of a key tile
    # one row, two blocks of 32, each: log2 P = 0, -1, -2, -3, then very small
    log2p = torch.tensor(([0.0, -1.0, -2.0, -3.0] + [-40.0] * 28) * 2, dtype=F64)
    s = (log2p / math.log2(math.e)).view(1, 1, 1, 1, 1, 64)
    p_hat = _direct_p(
        s, torch.zeros(1, 1, 1, 1, 1, dtype=F64), recipe, counts=False
    ).values.flatten()
    # block 0, exact exp2: 6 P = 6, 3, 1.5 are E2M1 values; 0.75 ties between 0.5 and 1 -> 1
    assert p_hat[:4].tolist() == [1.0, 0.5, 0.25, 1 / 6]
    # block 1, affine: x = log2 P + log2 6; u = 1.5 x + 1.2 -> 5.08, 3.58, 2.08, 0.58
    # -> E2M1 6, 4, 2, 0.5
    assert p_hat[32:36].tolist() == [1.0, 4 / 6, 2 / 6, 0.5 / 6]
    assert p_hat[4:32].eq(0).all() and p_hat[36:].eq(0).all()
    everywhere = dataclasses.replace(recipe, name="affine_all", direct_p_affine_groups=None)
    p_all = _direct_p(
        s, torch.zeros(1, 1, 1, 1, 1, dtype=F64), everywhere, counts=False
    ).values.flatten()
    assert p_all[:4].tolist() == p_all[32:36].tolist() == [1.0, 4 / 6, 2 / 6, 0.5 / 6]


def test_direct_p_values_are_power_of_two_times_e2m1_over_6():
    q, k, v = qkv(1, 1, 1, 16, 64, 32, seed=52)
    s = (q @ k.transpose(-1, -2) / math.sqrt(32)).view(1, 1, 1, 1, 16, 64)
    m = s.amax(-1)
    p_hat = _direct_p(s, m, resolve_recipe("fa4fp4_causal_mxfp4pv"), counts=False).values
    blocks = p_hat.view(16, 2, 32)
    alpha = torch.exp2(
        torch.ceil(
            torch.log2(torch.exp(s - m.unsqueeze(-1)).view(16, 2, 32).amax(-1, keepdim=True))
        )
    )
    codes = blocks * 6 / alpha
    assert torch.isin(codes, FP4_E2M1.values.to(F64)).all()


def test_fa4fp4_causal_e5m2_do_flushes_less_than_e4m3():
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 64, 64, 64, seed=53))
    g = torch.Generator().manual_seed(54)
    do = torch.randn(1, 2, 64, 64, generator=g, dtype=F64) * torch.exp2(
        -20 * torch.rand(1, 2, 64, 64, generator=g, dtype=F64)
    )
    recipe = resolve_recipe("fa4fp4_causal")
    e4m3 = dataclasses.replace(recipe, name="e4m3_do", dv_do=get("fp8_e4m3_tensor"))
    flushed = {}
    for r in (recipe, e4m3):
        trace = Trace()
        out = attention(q, k, v, r, causal=True, trace=trace, block_m=32, block_n=32)
        out.backward(do)
        frame = trace.to_frame()
        flushed[r.name] = frame[frame["product"] == "dv"]["b_flushed"].mean()
    assert flushed["fa4fp4_causal"] < flushed["e4m3_do"]


def test_fa4fp4_backward_rebuilds_p_from_the_quantized_qk():
    recipe = dataclasses.replace(
        resolve_recipe("fa4fp4_causal"),
        name="nvfp4qk_exact_rest",
        p=None,
        v=None,
        **{f: None for f in ("dv_p", "dv_do", "dp_do", "dp_v", "dq_ds", "dq_k", "dk_ds", "dk_q")},
    )
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 48, 48, 64, seed=55))
    do = rand(1, 2, 48, 64, seed=56)
    out = attention(q, k, v, recipe, causal=True, block_m=16, block_n=16)
    # softmax(S^) V with S^ from the quantized Q, K; dQ = dS K and dK = dS^T Q multiply the
    # unquantized operands (the backward fields are None), as an autograd graph:
    s = q @ k.transpose(-1, -2) / 8.0
    s_hat = (
        fake_quantize(q.detach(), "nvfp4_1level")
        @ fake_quantize(k.detach(), "nvfp4_1level").transpose(-1, -2)
        / 8.0
    )
    s = (s + (s_hat - s).detach()).masked_fill(~causal_mask(48, 48), -math.inf)
    ref = s.softmax(-1) @ v
    close(out, ref, 1e-12)
    for g, r in zip(grads(out, (q, k, v), do), grads(ref, (q, k, v), do), strict=True):
        close(g, r, 1e-11)


def test_croissattn_rounds_the_backward_stochastically_and_reproducibly():
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 32, 32, 32, seed=57))
    do = rand(1, 2, 32, 32, seed=58)
    runs = {}
    for seed in (1, 1, 2):
        out = attention(q, k, v, "croissattn", generator=seed, block_m=32, block_n=32)
        runs.setdefault(seed, []).append((out, grads(out, (q, k, v), do)))
    (o1, g1), (o1b, g1b) = runs[1]
    o2, g2 = runs[2][0]
    assert torch.equal(o1, o2)  # the forward rounds to nearest
    assert all(torch.equal(a, b) for a, b in zip(g1, g1b, strict=True))  # same seed, same bits
    assert all(not torch.equal(a, b) for a, b in zip(g1, g2, strict=True))
    with pytest.raises(ValueError, match="generator"):
        attention(q, k, v, "croissattn")


@given(
    # (croissattn_eden's Hadamard transforms of 128 need tiles and head_dim of 128: tested apart)
    name=st.sampled_from(
        [r.name for r in PRESETS if r.name != "croissattn_eden"] + ["nvfp4", "mxfp4", "nvfp4_2d"]
    ),
    hk=st.integers(1, 2),
    group=st.integers(1, 2),
    sq=st.integers(1, 70),
    sk=st.integers(1, 70),
    d=st.sampled_from([32, 64]),
    causal=st.booleans(),
    bm=st.sampled_from([32, 64]),
    bn=st.sampled_from([32, 64]),
    seed=st.integers(0, 2**16),
)
def test_every_recipe_runs_finite_and_reproducibly(
    name, hk, group, sq, sk, d, causal, bm, bn, seed
):
    q, k, v = (
        x.requires_grad_()
        for x in qkv(1, hk * group, hk, sq, sk, d, dtype=torch.float32, seed=seed)
    )
    do = rand(1, hk * group, sq, d, dtype=torch.float32, seed=seed + 3)
    results = []
    for _ in range(2):
        out = attention(q, k, v, name, causal=causal, block_m=bm, block_n=bn, generator=seed)
        results.append((out, grads(out, (q, k, v), do)))
    (out, g), (out2, g2) = results
    assert out.shape == (1, hk * group, sq, d) and out.dtype == torch.float32
    assert torch.isfinite(out).all() and all(torch.isfinite(x).all() for x in g)
    assert torch.equal(out, out2) and all(torch.equal(a, b) for a, b in zip(g, g2, strict=True))


# -- NaN and bad input -----------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["exact", "mxfp4"])
def test_nan_in_q_reaches_only_its_row(recipe):
    q, k, v = qkv(1, 1, 1, 40, 40, 32, seed=60)
    q[0, 0, 7, 3] = math.nan
    out = attention(q, k, v, recipe, block_m=32, block_n=32)
    assert torch.isnan(out[0, 0, 7]).all()
    rest = torch.cat([out[0, 0, :7], out[0, 0, 8:]])
    assert torch.isfinite(rest).all()
    ref = sdpa(q, k, v)
    assert torch.equal(torch.isnan(ref), torch.isnan(out)) or recipe != "exact"


def test_nan_in_k_reaches_the_rows_that_attend_to_it():
    q, k, v = qkv(1, 1, 1, 40, 40, 32, seed=61)
    k[0, 0, 20, 0] = math.nan
    full = attention(q, k, v, block_m=16, block_n=16)
    causal = attention(q, k, v, causal=True, block_m=16, block_n=16)
    assert torch.isnan(full).all()
    assert torch.isfinite(causal[0, 0, :20]).all() and torch.isnan(causal[0, 0, 20:]).all()
    assert torch.equal(torch.isnan(causal), torch.isnan(sdpa(q, k, v, causal=True)))


@pytest.mark.parametrize("elements", [None, 64 * 64])  # chunks of all query tiles, or one tile pair
def test_nan_in_v_or_do_reaches_the_query_tiles_that_see_its_key(monkeypatch, elements):
    # Causal, 64 x 64 tiles: key 300 lies in key tile 4, which query tiles 4..7 see; a kernel
    # never visits it for query tiles 0..3, so their rows stay finite whatever the blocking.
    if elements is not None:
        monkeypatch.setattr(tiling_module, "BLOCK_ELEMENTS", elements)
    q, k, v = (x.requires_grad_() for x in qkv(1, 1, 1, 512, 512, 32, seed=62))
    with torch.no_grad():
        v[0, 0, 300, 0] = math.nan
    out = attention(q, k, v, causal=True, block_m=64, block_n=64)
    rows = torch.isnan(out[0, 0]).any(-1)
    assert not rows[:256].any() and rows[256:].all()
    q, k, v = (x.detach().clone().requires_grad_() for x in qkv(1, 1, 1, 512, 512, 32, seed=62))
    do = rand(1, 1, 512, 32, seed=63)
    do[0, 0, 10, 0] = math.nan  # query tile 0 sees key tile 0 only
    attention(q, k, v, causal=True, block_m=64, block_n=64).backward(do)
    nan_keys = torch.isnan(v.grad[0, 0]).any(-1)
    assert nan_keys[:64].any() and not nan_keys[64:].any()


def test_no_keys_with_a_trace_and_an_output_modified_in_place():
    q, k, v = qkv(1, 1, 1, 4, 0, 32)
    trace = Trace()
    assert torch.equal(attention(q, k, v, trace=trace), torch.zeros(1, 1, 4, 32, dtype=F64))
    assert (trace.to_frame()["product"] == "out").all()
    q, k, v = (x.requires_grad_() for x in qkv(1, 1, 1, 8, 8, 32))
    out = attention(q, k, v, "attn_qat")
    out.mul_(2.0)  # the output is the caller's to modify, as SDPA's is
    out.sum().backward()
    assert torch.isfinite(q.grad).all()


def test_bad_input_names_the_argument_and_the_rule():
    q, k, v = qkv(1, 2, 2, 8, 8, 32)
    with pytest.raises(ValueError, match="k and v must agree"):
        attention(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="head_dim"):
        attention(q, k[..., :16], v)
    with pytest.raises(TypeError, match="share one dtype"):
        attention(q, k.float(), v)
    with pytest.raises(ValueError, match="one device"):
        attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="multiple of k's heads"):
        attention(q, *qkv(1, 3, 3, 8, 8, 32)[1:])
    with pytest.raises(ValueError, match="4-D"):
        attention(q[0], k, v)
    with pytest.raises(TypeError, match="floating-point"):
        attention(q.long(), k, v)
    with pytest.raises(ValueError, match="recipe: unknown name"):
        attention(q, k, v, "no_such_recipe")
    q40, k40, v40 = qkv(1, 1, 1, 8, 8, 40)
    with pytest.raises(ValueError, match="head_dim=40 is not a multiple of 16.*'q'.*sageattn3"):
        attention(q40, k40, v40, "sageattn3")
    with pytest.raises(ValueError, match="block_n=48 is not a multiple of 32.*'p'"):
        attention(q, k, v, "mxfp4", block_n=48)
    with pytest.raises(ValueError, match="block_m must be a positive int"):
        attention(q, k, v, block_m=0)
    with pytest.raises(ValueError, match="attn_mask"):
        attention(q, k, v, attn_mask=torch.ones(3, 8, dtype=torch.bool))


def test_patch_sdpa_routes_a_model_through_the_recipe():
    trace, original = Trace(), F.scaled_dot_product_attention
    mha = torch.nn.MultiheadAttention(32, 2, batch_first=True, dtype=F64)
    x = rand(2, 12, 32, seed=70)
    with torch.no_grad():
        plain, _ = mha(x, x, x, need_weights=False)
        with patch_sdpa("nvfp4", trace=trace, block_m=16, block_n=16):
            routed, _ = mha(x, x, x, need_weights=False)
            q, k, v = qkv(1, 2, 2, 9, 9, 32, seed=71)
            direct = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            assert torch.equal(
                direct, attention(q, k, v, "nvfp4", causal=True, block_m=16, block_n=16)
            )
            with pytest.raises(ValueError, match="dropout"):
                F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    assert F.scaled_dot_product_attention is original
    assert len(trace.calls) == 2 and trace.calls[0].recipe == "nvfp4"
    assert 0 < (routed - plain).abs().max() < 0.5
