"""Each recipe mechanism's defining behaviour, on a custom recipe that has only it.

Row references (lazy maximum, shiftless, anchor), key/value order and its independence of
the blocking, K smoothing over everything, per-head and per-tile tensor scales, block axes,
the forward-exact backward, gradient_bias against it, dS from the dV operand, dP from the
forward's V^, D from the quantized dO, and a lift that is not a power of two. Oracles are
dense formulas (float64, tolerances at float64 rounding: 1e-12 on outputs, 1e-11 on
gradients) or autograd through straight-through quantizers; the row reference each tile
used is read by recording the forward's calls to its P quantizer.
"""

import dataclasses
import importlib
import math

import numpy as np
import pytest
import torch

from fp4lab.analysis import attention
from fp4lab.analysis.bias import gradient_bias
from fp4lab.formats import (
    FP8_E4M3FN,
    FP8_E5M2_TENSOR,
    NVFP4,
    NVFP4_1LEVEL,
    fake_quantize,
    round_to_format,
)
from fp4lab.recipes import (
    AttentionRecipe,
    BackwardMode,
    BackwardP,
    BackwardV,
    DeltaSource,
    DsP,
    KVOrder,
    RowReference,
    SmoothK,
    TensorScope,
    Trace,
)
from tests.analysis.test_flash import (
    causal_mask,
    close,
    dense_attention,
    expand,
    fq_tiles,
    fq_whole,
    grads,
    qkv,
    rand,
    sdpa,
)
from tests.recipes.test_presets import capture_p, max_diff

F64 = torch.float64
LOG2E = math.log2(math.e)
tiling_module = importlib.import_module("fp4lab.analysis.tiling")


def stepped_scores(bits, seq_q=32, bn=32, d=64, seed=0, noise=0.3):
    """q, k (float64, one head) whose key tile t scores `bits[t]` powers of two above tile 0
    for every query, plus small noise: Q's last 16 channels are 1/4, K's the constant c_t
    with 16 c_t / 4 / sqrt(d) = bits[t] ln 2 (one NVFP4 block of equal values); the other
    channels are N(0, noise^2)."""
    q, k, _ = qkv(1, 1, 1, seq_q, bn * len(bits), d, seed=seed)
    q, k = q * noise, k * noise
    q[..., -16:] = 0.25
    for t, b in enumerate(bits):
        k[..., t * bn : (t + 1) * bn, -16:] = b * math.log(2) * math.sqrt(d) / 4
    return q, k


def tile_rowmax(s, bn):
    """Each row's maximum over each key tile: (..., Sq, nK)."""
    return s.unflatten(-1, (-1, bn)).amax(-1)


def references(seen, nq, nk):
    """The row reference of every (query tile, key tile) from the recorded forward (one
    block per chunk holding every tile): (B, Hkv, G, nQ, bm, nK)."""
    ((_, m_row),) = seen  # (B, Hkv, G, n, g, bm)
    assert m_row.shape[3:5] == (nq, nk), m_row.shape
    return m_row.transpose(-1, -2)


# -- row references --------------------------------------------------------------------------------
def lazy_reference(rowmax, threshold_log2):
    """The docstring's lazy maximum, tile by tile (first to last): the old maximum stays
    unless a tile raises it by more than `threshold_log2` powers of two."""
    m = torch.full_like(rowmax[..., 0], -math.inf)
    out = torch.empty_like(rowmax)
    for t in range(rowmax.shape[-1]):
        top = torch.maximum(m, rowmax[..., t])
        m = torch.where((top - m) * LOG2E > threshold_log2, top, m)
        out[..., t] = m
    return out


@pytest.mark.parametrize(
    "threshold, updated",
    [(4.0, [True, True]), (8.0, [False, True]), (12.0, [False, False])],
    ids=["4-bits-both-update", "8-bits-second-updates", "12-bits-both-kept"],
)
def test_lazy_max_threshold_is_in_powers_of_two(monkeypatch, threshold, updated):
    # Key tiles 1 and 2 raise every row's maximum by about 5 bits each (3.5 nats). With a
    # threshold of 8 bits tile 1 keeps tile 0's maximum and tile 2 (10 bits above it)
    # replaces it; read in nats (8 nats = 11.5 bits) tile 2 would be kept as well.
    q, k = stepped_scores([0.0, 5.0, 10.0])
    v = rand(1, 1, 96, 64, seed=1)
    recipe = AttentionRecipe(
        name=f"lazy_{threshold:g}", row_reference=RowReference.LAZY_MAX, lazy_rescale_log2=threshold
    )
    seen = capture_p(monkeypatch)
    out = attention(q, k, v, recipe, block_m=32, block_n=32)
    rowmax = tile_rowmax(q @ k.transpose(-1, -2) / 8.0, 32)  # (1, 1, 32, 3)
    m = references(seen, 1, 3)[:, :, 0, 0]
    close(m, lazy_reference(rowmax, threshold), 1e-12)
    for t, up in zip((1, 2), updated, strict=True):
        want = rowmax[..., t] if up else rowmax[..., 0]
        close(m[..., t], want, 1e-12)
    close(out, sdpa(q, k, v), 1e-12)  # P unquantized: the reference cancels


def test_zero_row_reference_is_shiftless(monkeypatch):
    q, k, v = qkv(1, 2, 2, 96, 96, 32, seed=2)
    zero = AttentionRecipe(name="shiftless", row_reference=RowReference.ZERO)
    seen = capture_p(monkeypatch)
    out = attention(q, k, v, zero, causal=True, block_m=32, block_n=32)
    m = references(seen, 3, 3)
    assert torch.equal(m, torch.zeros_like(m))
    close(out, sdpa(q, k, v, causal=True), 1e-12)  # exp(S) / sum exp(S): exact for moderate S
    # quantized, the absolute level of P matters: E4M3 P differs from the running maximum's
    outputs = []
    for reference in (RowReference.ZERO, RowReference.RUNNING_MAX):
        e4m3 = AttentionRecipe(
            name=f"e4m3_p_{reference.value}", p=FP8_E4M3FN, row_reference=reference
        )
        outputs.append(attention(q, k, v, e4m3, causal=True, block_m=32, block_n=32))
    assert max_diff(*outputs) > 1e-4, "E4M3 P gives the same output with either reference"


def test_anchor_row_reference_is_fixed_from_the_first_keys(monkeypatch):
    # m_i = max of row i's (masked) scores over the first `anchor_keys` keys + margin * scale,
    # the same for every key tile
    q, k, v = qkv(1, 2, 2, 96, 96, 32, seed=3)
    recipe = AttentionRecipe(
        name="anchor16", row_reference=RowReference.ANCHOR, anchor_keys=16, anchor_margin=3.0
    )
    seen = capture_p(monkeypatch)
    out = attention(q, k, v, recipe, causal=True, block_m=32, block_n=32)
    s = (q @ k.transpose(-1, -2) / math.sqrt(32)).masked_fill(~causal_mask(96, 96), -math.inf)
    want = s[..., :16].amax(-1) + 3.0 / math.sqrt(32)  # (B, H, Sq)
    m = references(seen, 3, 3)  # (B, Hkv, G, nQ, bm, nK)
    for t in range(3):  # every key tile a query tile sees (query tile i sees key tiles <= i)
        got = m[:, :, 0, :, :, t].flatten(-2)
        seen_rows = torch.arange(96) >= 32 * t
        close(got[..., seen_rows], want[..., seen_rows], 1e-12)
    close(out, sdpa(q, k, v, causal=True), 1e-12)
    with pytest.raises(ValueError, match="first 64 keys, which must lie in the first key tile"):
        attention(q, k, v, dataclasses.replace(recipe, name="anchor64", anchor_keys=64), block_n=32)


def test_reverse_order_visits_the_last_key_tile_first(monkeypatch):
    # The reference of key tile t is the running maximum over tiles nK-1 .. t; with P
    # unquantized both orders are exact attention, with P quantized they differ.
    q, k, v = qkv(1, 2, 2, 64, 96, 32, seed=4)
    s = q @ k.transpose(-1, -2) / math.sqrt(32)
    rowmax = tile_rowmax(s, 32)  # (B, H, Sq, 3)
    for order, want in (
        (KVOrder.FORWARD, rowmax.cummax(-1).values),
        (KVOrder.REVERSE, rowmax.flip(-1).cummax(-1).values.flip(-1)),
    ):
        seen = capture_p(monkeypatch)
        recipe = AttentionRecipe(name=f"order_{order.value}", kv_order=order)
        out = attention(q, k, v, recipe, block_m=32, block_n=32)
        close(references(seen, 2, 3)[:, :, 0].flatten(2, 3), want, 1e-12)
        close(out, sdpa(q, k, v), 1e-12)
    outputs = []
    for order in KVOrder:
        nvfp4_p = AttentionRecipe(name=f"nvfp4_p_{order.value}", p=NVFP4, kv_order=order)
        outputs.append(attention(q, k, v, nvfp4_p, block_m=32, block_n=32))
    assert max_diff(*outputs) > 1e-4, "NVFP4 P gives the same output in either order"


BLOCKING_RECIPES = {
    "lazy": AttentionRecipe(
        name="nvfp4_lazy", p=NVFP4, row_reference=RowReference.LAZY_MAX, lazy_rescale_log2=2.0
    ),
    "reverse": AttentionRecipe(name="nvfp4_reverse", p=NVFP4, kv_order=KVOrder.REVERSE),
}


@pytest.mark.parametrize("name", BLOCKING_RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_one_tile_pair_per_block_gives_the_same_results(monkeypatch, name, causal):
    # As test_flash's running-maximum case: a block of several key tiles must give every tile
    # the reference the kernel's loop holds (the lazy decision depends on the path), so that
    # P tiles, their NVFP4 scales and the trace are the same as one tile pair at a time.
    recipe = BLOCKING_RECIPES[name]
    q, k = (
        x.requires_grad_()
        for x in stepped_scores([0.0, 1.5, 3.0, 4.5], seq_q=48, d=32, seed=5, noise=1.0)
    )
    v = rand(1, 1, 128, 32, seed=6).requires_grad_()
    do = rand(1, 1, 48, 32, seed=7)
    runs = []
    for elements in (None, 16 * 32):  # B * H * block_m * block_n: one tile pair
        if elements is not None:
            monkeypatch.setattr(tiling_module, "BLOCK_ELEMENTS", elements)
        trace = Trace()
        out = attention(q, k, v, recipe, causal=causal, block_m=16, block_n=32, trace=trace)
        runs.append((out, grads(out, (q, k, v), do), trace.to_frame()))
    (out, g, frame), (out2, g2, frame2) = runs
    close(out, out2, 1e-13)
    for a, b in zip(g, g2, strict=True):
        close(a, b, 1e-12)
    ids = ["product", "head", "q_tile", "k_tile"]
    assert frame[ids].equals(frame2[ids])
    stats, stats2 = (f.select_dtypes("number").to_numpy() for f in (frame, frame2))
    bad = ~np.isclose(stats, stats2, rtol=1e-9, atol=1e-9, equal_nan=True)
    assert not bad.any(), f"trace columns differ on the tiles\n{frame.loc[bad.any(1), ids]}"


# -- K smoothing, tensor scopes, block axes --------------------------------------------------------
def test_global_k_smoothing_subtracts_one_mean_over_batch_heads_and_sequence():
    q, k, v = (x.requires_grad_() for x in qkv(2, 2, 2, 40, 48, 32, seed=8))
    offsets = rand(2, 2, 1, 32, seed=9, scale=3.0)  # a different mean per (batch, head)
    k_off = (k + offsets).detach().requires_grad_()
    do = rand(2, 2, 40, 32, seed=10)
    smooth = AttentionRecipe(name="smooth_global", smooth_k=SmoothK.GLOBAL)
    out, ref = (
        attention(q, k_off, v, r, causal=True, block_m=16, block_n=16) for r in (smooth, "exact")
    )
    close(out, ref, 1e-12)
    for a, b in zip(grads(out, (q, k_off, v), do), grads(ref, (q, k_off, v), do), strict=True):
        close(a, b, 1e-11)
    # quantized: K^ = NVFP4(K - mean over (batch, heads, sequence)), not a per-head mean
    recipe = dataclasses.replace(smooth, name="nvfp4_k_smooth_global", k=NVFP4)
    got = attention(q, k_off, v, recipe, causal=True, block_m=16, block_n=16).detach()
    kd = k_off.detach()

    def dense(mean):
        s = q.detach() @ fake_quantize(kd - mean, NVFP4).transpose(-1, -2) / math.sqrt(32)
        return s.masked_fill(~causal_mask(40, 48), -math.inf).softmax(-1) @ v.detach()

    close(got, dense(kd.mean((0, 1, 2), keepdim=True)), 1e-12)
    assert max_diff(got, dense(kd.mean(-2, keepdim=True))) > 1e-3, "per-head mean gives the same"


def spread_heads(x, factors):
    """x with each head h scaled by factors[h] (heads of very different magnitudes)."""
    return x * torch.tensor(factors, dtype=x.dtype).view(1, -1, 1, 1)


def test_head_scope_takes_one_tensor_scale_per_batch_and_kv_head():
    # GQA, 4 query heads on 2 KV heads; P unquantized, so the output is softmax(S^) V^ with
    # Q^, K^, V^ NVFP4 whose tensor scale is per (batch, KV head), Q's 2 heads of a group
    # sharing theirs. Heads span 1e-3 .. 1e3: one scale for all, or one per query head,
    # rounds them differently.
    q, k, v = qkv(2, 4, 2, 40, 48, 32, seed=11)
    q, k, v = (
        spread_heads(q, [1e-3, 1.0, 1e3, 3.0]),
        spread_heads(k, [1e3, 1e-2]),
        spread_heads(v, [1e-3, 1e2]),
    )
    recipe = AttentionRecipe(
        name="nvfp4_per_head", q=NVFP4, k=NVFP4, v=NVFP4, tensor_scope=TensorScope.HEAD
    )
    out = attention(q, k, v, recipe, block_m=16, block_n=16)
    size = out.abs().max().item()  # outputs up to ~1e2: float64 rounding relative to it
    close(out, dense_attention(q, k, v, recipe)[0], 1e-14 * size)
    whole = dataclasses.replace(recipe, name="nvfp4_whole", tensor_scope=TensorScope.TENSOR)
    assert max_diff(out, dense_attention(q, k, v, whole)[0]) > 1e-3 * size
    per_query_head = softmax_attention(
        fq_whole(q, NVFP4, -1, recipe, 1),
        fq_whole(k, NVFP4, -1, recipe),
        fq_whole(v, NVFP4, -2, recipe),
    )
    assert max_diff(out, per_query_head) > 1e-6 * size


def softmax_attention(q_hat, k_hat, v_hat, causal=False):
    """softmax(Q^ K^^T / sqrt(D)) V^ densely, KV heads repeated for GQA."""
    h = q_hat.shape[1]
    s = q_hat @ expand(k_hat, h).transpose(-1, -2) / math.sqrt(q_hat.shape[-1])
    if causal:
        s = s.masked_fill(~causal_mask(*s.shape[-2:]), -math.inf)
    return s.softmax(-1) @ expand(v_hat, h)


def fq_row_tiles(x, spec, axis, rows):
    """fake_quantize of each tile of `rows` sequence rows of each (batch, head) on its own."""
    return torch.cat([fq_tiles(part, spec, axis) for part in x.split(rows, dim=-2)], dim=-2)


def test_tile_scope_takes_one_tensor_scale_per_tile_of_rows():
    # Q's tensor scale per block_m = 16 query rows, K's and V's per block_n = 32 key rows, of
    # each (batch, head); each tile's rows scaled by its own factor.
    q, k, v = qkv(1, 2, 2, 48, 64, 32, seed=12)
    q = q * torch.tensor([1e-2, 1.0, 1e2], dtype=F64).repeat_interleave(16).view(-1, 1)
    k = k * torch.tensor([1e2, 1e-1], dtype=F64).repeat_interleave(32).view(-1, 1)
    v = v * torch.tensor([1e-3, 1e1], dtype=F64).repeat_interleave(32).view(-1, 1)
    recipe = AttentionRecipe(
        name="nvfp4_per_tile", q=NVFP4, k=NVFP4, v=NVFP4, tensor_scope=TensorScope.TILE
    )
    out = attention(q, k, v, recipe, causal=True, block_m=16, block_n=32)
    want = softmax_attention(
        fq_row_tiles(q, NVFP4, -1, 16),
        fq_row_tiles(k, NVFP4, -1, 32),
        fq_row_tiles(v, NVFP4, -2, 32),
        causal=True,
    )
    close(out, want, 1e-12)
    whole = softmax_attention(
        fake_quantize(q, NVFP4),
        fake_quantize(k, NVFP4),
        fake_quantize(v, NVFP4, axis=-2),
        causal=True,
    )
    assert max_diff(out, whole) > 1e-3, "one tensor scale for all tiles gives the same output"


def test_block_axes_moves_v_blocks_to_head_dim():
    q, k, v = qkv(1, 2, 2, 40, 64, 32, seed=13)
    along_sequence = AttentionRecipe(name="nvfp4_v", v=NVFP4)
    along_head_dim = dataclasses.replace(
        along_sequence, name="nvfp4_v_head_dim", block_axes=(("v", -1),)
    )
    assert (along_sequence.block_axis("v"), along_head_dim.block_axis("v")) == (-2, -1)
    for recipe, axis in ((along_sequence, -2), (along_head_dim, -1)):
        out = attention(q, k, v, recipe, block_m=16, block_n=32)
        close(out, softmax_attention(q, k, fake_quantize(v, NVFP4, axis=axis)), 1e-12)
    moved = max_diff(attention(q, k, v, along_sequence), attention(q, k, v, along_head_dim))
    assert moved > 1e-3, f"V's blocks along either axis give the same output ({moved:.1e})"


# -- the forward-exact backward --------------------------------------------------------------------
EXACT_GRAD = AttentionRecipe(
    name="nvfp4_qkp_forward_exact", q=NVFP4, k=NVFP4, p=NVFP4, backward=BackwardMode.FORWARD_EXACT
)


def test_forward_exact_dv_is_the_forward_weights_transposed_times_do():
    # O = A V with A the forward's effective weights P^ / l (V unquantized), whatever its
    # tiles and running maxima did; A is read from the forward with V = I. dV = A^T dO.
    q, k, _ = qkv(1, 2, 2, 48, 64, 32, seed=14)
    v = rand(1, 2, 64, 64, seed=15).requires_grad_()
    do = rand(1, 2, 48, 64, seed=16)
    options = dict(causal=True, block_m=16, block_n=32)
    weights = attention(q, k, torch.eye(64, dtype=F64).expand(1, 2, 64, 64), EXACT_GRAD, **options)
    out = attention(q, k, v, EXACT_GRAD, **options)
    close(out, weights @ v.detach(), 1e-12)
    (dv,) = grads(out, (v,), do)
    close(dv, weights.transpose(-1, -2) @ do, 1e-12)
    flash = dataclasses.replace(EXACT_GRAD, name="nvfp4_qkp_flash", backward=BackwardMode.FLASH)
    (dv_flash,) = grads(attention(q, k, v, flash, **options), (v,), do)
    assert max_diff(dv_flash, dv) > 1e-3  # the rebuilt, unquantized P is not the forward's


def straight_through(x, x_hat):
    """x_hat in the forward, the identity in the backward."""
    return x + (x_hat - x).detach()


def test_forward_exact_is_the_autograd_gradient_of_the_quantized_forward():
    # One tile: O = q(P) V / sum P, P = exp(S^ - rowmax), S^ = Q^ K^^T / sqrt(D), each
    # quantizer straight through; autograd's gradient is dS = P / l (dP - D), D = rowsum(dO O)
    # with the quantized O, and dV = (q(P) / l)^T dO.
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 40, 48, 32, seed=17))
    do = rand(1, 2, 40, 32, seed=18)
    out = attention(q, k, v, EXACT_GRAD, causal=True, block_m=64, block_n=64)
    qs, ks = (
        straight_through(q, fake_quantize(q.detach(), NVFP4)),
        straight_through(k, fake_quantize(k.detach(), NVFP4)),
    )
    s = (qs @ ks.transpose(-1, -2) / math.sqrt(32)).masked_fill(~causal_mask(40, 48), -math.inf)
    p = torch.exp(s - s.detach().amax(-1, keepdim=True))
    ref = straight_through(p, fq_tiles(p.detach(), NVFP4, -1)) @ v / p.sum(-1, keepdim=True)
    close(out, ref, 1e-12)
    for name, a, b in zip("qkv", grads(out, (q, k, v), do), grads(ref, (q, k, v), do), strict=True):
        assert max_diff(a, b) <= 1e-11, (name, max_diff(a, b))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(backward_p=BackwardP.UNQUANTIZED_QK), "backward_p=quantized_qk"),
        (dict(delta=DeltaSource.QUANTIZED_DO), "delta=output"),
        (dict(ds_p=DsP.DV_OPERAND), "ds_p=unquantized"),
        (dict(dv_p=FP8_E4M3FN), "dv_p must be None"),
        (dict(backward_v=BackwardV.FORWARD), "backward_v=forward is for backward=flash"),
    ],
    ids=["backward_p", "delta", "ds_p", "dv_p", "backward_v"],
)
def test_forward_exact_rejects_what_would_not_be_its_own_gradient(fields, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(EXACT_GRAD, **fields)


# -- gradient_bias against the recipe's own forward ------------------------------------------------
def bias_inputs():
    q, k, v = qkv(1, 2, 2, 32, 32, 32, seed=19)
    return q, k, v, rand(1, 2, 32, 32, seed=20)


def test_gradient_bias_against_the_forward_is_zero_for_the_exact_backward():
    # EXACT_GRAD is its own with_exact_backward() (but for the name and doc): every sample's
    # gradient is its reference, bit for bit
    exact = EXACT_GRAD.with_exact_backward()
    assert dataclasses.replace(exact, name=EXACT_GRAD.name, doc=EXACT_GRAD.doc) == EXACT_GRAD
    result = gradient_bias(*bias_inputs(), EXACT_GRAD, reference="forward", block_m=16, block_n=16)
    assert result.reference == "forward" and result.samples == 1
    tensors = result.tensors.set_index("tensor")
    assert (tensors["rel_bias"] == 0).all() and (tensors["rel_err_mean"] == 0).all(), tensors
    # a FlashAttention backward of the same forward (dV from the rebuilt unquantized P) is not
    flash = dataclasses.replace(EXACT_GRAD, name="nvfp4_qkp_flash", backward=BackwardMode.FLASH)
    other = gradient_bias(*bias_inputs(), flash, reference="forward", block_m=16, block_n=16)
    assert abs(other.tensors.set_index("tensor").loc["dv", "rel_bias"]) > 1e-4


def test_gradient_bias_of_croissattn_says_what_it_is_measured_against():
    result = gradient_bias(
        *bias_inputs(), "croissattn", samples=4, seed=0, reference="forward", block_m=16, block_n=16
    )
    assert result.reference == "forward" and result.stochastic and result.samples == 4
    assert "own quantized forward" in result.note, result.note
    assert np.isfinite(
        result.tensors[["rel_bias", "se", "rel_err_mean", "rel_noise"]].to_numpy()
    ).all()


def test_gradient_bias_rejects_an_unknown_reference():
    with pytest.raises(
        ValueError, match="reference must be one of 'exact', 'forward', got 'dense'"
    ):
        gradient_bias(*bias_inputs(), EXACT_GRAD, reference="dense")


# -- backward variants -----------------------------------------------------------------------------
def test_ds_from_the_dv_operand_multiplies_by_the_quantized_p():
    # Exact forward; dV = E4M3(P)^T dO; dS = E4M3(P) * (dP - D) with DsP.DV_OPERAND, P * (dP
    # - D) otherwise. E4M3 is an element cast, so the dense formula holds for any tiling.
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 48, 64, 32, seed=21))
    do = rand(1, 2, 48, 32, seed=22)
    s = (q.detach() @ k.detach().transpose(-1, -2) / math.sqrt(32)).masked_fill(
        ~causal_mask(48, 64), -math.inf
    )
    p = s.softmax(-1)
    p_e4m3 = round_to_format(p, FP8_E4M3FN)
    dp, delta = do @ v.detach().transpose(-1, -2), (do * (p @ v.detach())).sum(-1, keepdim=True)
    for ds_p, p_ds in ((DsP.DV_OPERAND, p_e4m3), (DsP.UNQUANTIZED, p)):
        recipe = AttentionRecipe(name=f"e4m3_dv_p_ds_{ds_p.value}", dv_p=FP8_E4M3FN, ds_p=ds_p)
        dq, dk, dv = grads(
            attention(q, k, v, recipe, causal=True, block_m=16, block_n=32), (q, k, v), do
        )
        ds = p_ds * (dp - delta) / math.sqrt(32)
        close(dq, ds @ k.detach(), 1e-11)
        close(dk, ds.transpose(-1, -2) @ q.detach(), 1e-11)
        close(dv, p_e4m3.transpose(-1, -2) @ do, 1e-11)
    assert max_diff(p_e4m3 * (dp - delta), p * (dp - delta)) > 1e-3


def test_backward_v_forward_differentiates_the_forward_as_it_ran():
    # With V^ in the forward and P unquantized, dP = dO V^^T is the exact gradient of
    # softmax(S) V^ (V straight through); dP from the unquantized V is not.
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 48, 64, 32, seed=23))
    do = rand(1, 2, 48, 32, seed=24)
    ref = softmax_attention(
        q, k, straight_through(v, fake_quantize(v.detach(), NVFP4, axis=-2)), causal=True
    )
    want = grads(ref, (q, k, v), do)
    forward_v = AttentionRecipe(name="nvfp4_v_dp_forward", v=NVFP4, backward_v=BackwardV.FORWARD)
    got = grads(attention(q, k, v, forward_v, causal=True, block_m=16, block_n=32), (q, k, v), do)
    for a, b in zip(got, want, strict=True):
        close(a, b, 1e-11)
    input_v = dataclasses.replace(forward_v, name="nvfp4_v_dp_input", backward_v=BackwardV.INPUT)
    dq_input = grads(attention(q, k, v, input_v, causal=True, block_m=16, block_n=32), (q,), do)[0]
    assert max_diff(dq_input, want[0]) > 1e-4, "dP on the unquantized V gives the same dQ"


def test_delta_from_the_quantized_do_keeps_softmax_centering():
    # Adding one vector to every key leaves every row's softmax unchanged, so the gradient
    # sums to zero over the keys: sum_j dK_j = scale sum_i rowsum(dS_i) Q_i, and rowsum(dS_i)
    # = dO^_i . O_i - D_i vanishes exactly when D takes the dO^ that dP = dO^ V^T consumed.
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 48, 64, 32, seed=25))
    do = rand(1, 2, 48, 32, seed=26)
    centred = {}
    for delta in (DeltaSource.QUANTIZED_DO, DeltaSource.OUTPUT):
        recipe = AttentionRecipe(
            name=f"e5m2_do_delta_{delta.value}", dp_do=FP8_E5M2_TENSOR, delta=delta
        )
        (dk,) = grads(attention(q, k, v, recipe, causal=True, block_m=16, block_n=32), (k,), do)
        centred[delta] = (dk.sum(-2).norm() / dk.norm()).item()
    assert centred[DeltaSource.QUANTIZED_DO] < 1e-13, centred
    assert centred[DeltaSource.OUTPUT] > 1e-4, centred


def test_p_lift_that_is_not_a_power_of_two_moves_the_scales():
    # P^ = NVFP4_1level(2688 P) / 2688 (the float64 multiply and divide round): E4M3 block
    # scales of 2688 (block max) / 6 round at other places than those of P itself
    q, k, v = qkv(1, 2, 2, 40, 64, 32, seed=27)
    lifted = AttentionRecipe(name="nvfp4_1level_p_2688", p=NVFP4_1LEVEL, p_lift=2688.0)
    out = attention(q, k, v, lifted, block_m=64, block_n=64)
    assert torch.isfinite(out).all()
    close(out, dense_attention(q, k, v, lifted)[0], 1e-12)
    plain = dataclasses.replace(lifted, name="nvfp4_1level_p", p_lift=1.0)
    moved = max_diff(out, attention(q, k, v, plain, block_m=64, block_n=64))
    assert moved > 1e-4, f"the 2688 lift leaves the output where no lift puts it ({moved:.1e})"
