"""Seeds and random streams: what a researcher needs to reproduce a stochastic run."""

import dataclasses

import pandas as pd
import torch
import torch.nn.functional as F

import fp4lab.formats as formats
from fp4lab.analysis import attention, patch_sdpa
from fp4lab.recipes import AttentionRecipe, BackwardMode, DeltaSource, Trace


def qkv(seed=0, shape=(1, 2, 64, 32)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(4)]


def patched_grads(seed):
    """Two SDPA calls (two 'layers') under one patch_sdpa block; the gradients of each."""
    q, k, v, do = qkv()
    grads = []
    with patch_sdpa("croissattn", generator=seed, block_m=32, block_n=32):
        for _ in range(2):
            qq = q.clone().requires_grad_()
            F.scaled_dot_product_attention(qq, k, v).backward(do)
            grads.append(qq.grad)
    return grads


def test_patch_sdpa_draws_fresh_noise_per_call_from_one_seeded_stream():
    first, second = patched_grads(seed=7)
    assert not torch.equal(first, second), "two layers must not share their rounding noise"
    again = patched_grads(seed=7)
    assert torch.equal(again[0], first) and torch.equal(again[1], second)


def test_only_an_int_seed_is_recorded_as_the_seed():
    q, k, v, _ = qkv()
    trace = Trace()
    gen = torch.Generator().manual_seed(5)
    attention(q, k, v, "croissattn", trace=trace, generator=gen, block_m=32, block_n=32)
    attention(q, k, v, "croissattn", trace=trace, generator=5, block_m=32, block_n=32)
    first, second = (call.meta for call in trace.calls)
    assert first["seed"] is None and first["generator_initial_seed"] == 5
    assert second["seed"] == 5


def test_trace_of_a_straight_through_stochastic_recipe():
    """Its counts depend on scales only, so they equal the round-to-nearest recipe's."""
    sr = formats.get("nvfp4_sr")
    recipe = AttentionRecipe(
        name="st_sr",
        q=sr,
        k=sr,
        v=sr,
        backward=BackwardMode.STRAIGHT_THROUGH,
        delta=DeltaSource.UNQUANTIZED_P_OUTPUT,
    )
    nearest = dataclasses.replace(recipe, name="st_rn", q="nvfp4", k="nvfp4", v="nvfp4")
    frames = []
    for r in (recipe, nearest):
        q, k, v, do = qkv(1)
        q.requires_grad_()
        trace = Trace()
        attention(q, k, v, r, trace=trace, generator=3, block_m=32, block_n=32).backward(do)
        frames.append(trace.to_frame())
    columns = [
        c for c in frames[0].columns if c.endswith(("clipped", "scale_underflow", "scale_overflow"))
    ]
    assert columns
    backward = [
        f[f["product"].isin(["dp", "dq", "dk"])][columns].reset_index(drop=True) for f in frames
    ]
    pd.testing.assert_frame_equal(backward[0], backward[1])


def test_delta_comes_from_the_returned_bf16_output():
    """D = rowsum(dO * O) uses O as returned (bf16 here), as a kernel that stored O does:
    the dense float32 backward with D from the bf16 O gives the same dQ."""
    q, k, v, do = (t.bfloat16() for t in qkv(2, (1, 1, 32, 32)))
    qq = q.clone().requires_grad_()
    o = attention(qq, k, v, "exact", block_m=32, block_n=32)
    o.backward(do)
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    p = torch.softmax((qf @ kf.transpose(-1, -2)) / 32**0.5, dim=-1)
    delta = (dof * o.float()).sum(-1, keepdim=True)
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    dq = (ds @ kf) / 32**0.5
    assert torch.equal(qq.grad, dq.bfloat16())


# -- stochastic rounding's draws are keyed by position -------------------------------------------
MX_SR = dataclasses.replace(formats.get("mxfp4"), name="mxfp4_sr", rounding="stochastic")
# Every operand of every product rounds stochastically; MX blocks have no tensor scale, so a
# (batch, head)'s values do not depend on the other heads.
ALL_SR = AttentionRecipe(
    name="all_mxfp4_sr",
    **{
        f: MX_SR
        for f in (
            "q",
            "k",
            "v",
            "p",
            "dv_p",
            "dv_do",
            "dp_do",
            "dp_v",
            "dq_ds",
            "dq_k",
            "dk_ds",
            "dk_q",
        )
    },
)


def sr_run(q, k, v, do, seed=7, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, ALL_SR, generator=seed, block_m=32, block_n=32, **kw)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def test_draws_do_not_depend_on_how_the_work_is_chunked(monkeypatch):
    import sys

    q, k, v, do = qkv(3, (1, 2, 130, 32))
    base = sr_run(q, k, v, do, causal=True)
    for elements in (32 * 32 * 2, 32 * 32 * 2 * 3):  # one tile pair, three, per block
        monkeypatch.setattr(sys.modules["fp4lab.analysis.tiling"], "BLOCK_ELEMENTS", elements)
        for a, b in zip(base, sr_run(q, k, v, do, causal=True), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_a_batch_and_heads_draw_what_each_draws_alone():
    q, k, v, do = qkv(4, (2, 3, 40, 32))
    both = sr_run(q, k, v, do)
    first = sr_run(*(x[:1, :1] for x in (q, k, v, do)))  # batch 0, head 0 alone
    for a, b in zip(both, first, strict=True):
        torch.testing.assert_close(a[:1, :1], b, rtol=1e-6, atol=1e-6)


def test_the_seed_decides_the_draws():
    q, k, v, do = qkv(5, (1, 2, 40, 32))
    a, b, c = sr_run(q, k, v, do, seed=1), sr_run(q, k, v, do, seed=1), sr_run(q, k, v, do, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not any(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_draw_streams_use_all_64_bits_of_their_key():
    # torch's CPU generator keeps 32 bits of a seed; the streams must not collide there.
    import sys

    module = sys.modules["fp4lab.analysis.streams"]
    position = (torch.tensor(0), torch.tensor(0), torch.tensor(0), torch.arange(8))
    low = module.uniforms(5, *position)
    assert not torch.equal(low, module.uniforms(5 + (1 << 32), *position))
    assert torch.equal(low, module.uniforms(5, *position))


def test_a_uniform_is_its_positions_philox_word_times_two_to_minus_32():
    import sys

    from fp4lab.formats.philox import philox4x32, split_key

    module = sys.modules["fp4lab.analysis.streams"]
    key = 0x0123456789ABCDEF
    batch, head, row = torch.tensor(1), torch.tensor(2), torch.arange(3).view(3, 1)
    got = module.uniforms(key, batch, head, row, torch.arange(12).view(1, 12))
    k0, k1 = split_key(key)
    for r in range(3):
        for c in range(12):
            counter = (c // 4, r, 2, 1)  # (column // 4, row, head, batch)
            words = philox4x32(*(torch.tensor([x]) for x in counter), k0, k1)
            assert got[r, c].item() == words[c % 4].item() * 2.0**-32


def test_unaligned_columns_draw_what_the_aligned_ones_draw():
    import sys

    module = sys.modules["fp4lab.analysis.streams"]
    position = (torch.tensor(0), torch.tensor(3), torch.arange(5).view(5, 1))
    whole = module.uniforms(99, *position, torch.arange(16).view(1, 16))
    for columns in (torch.arange(3, 10), torch.arange(1, 5), torch.tensor([7, 2, 13])):
        part = module.uniforms(99, *position, columns.view(1, -1))
        assert torch.equal(part, whole[:, columns])


def test_a_whole_operand_draws_what_its_tiles_draw():
    import sys

    module = sys.modules["fp4lab.analysis.streams"]
    draws = module.Draws(torch.Generator().manual_seed(3), block_m=4, block_n=8)
    p = torch.zeros(2, 3, 12, 16)  # (B, heads, query rows, key columns)
    whole = draws.for_operand("p", p, None)
    # The same operand cut into tiles (B, Hkv=1, G=3, 3 query tiles, 2 key tiles, 4, 8) from
    # tile (0, 0); then its last two query tiles and last key tile alone, from tile (1, 1).
    tiles = p.view(2, 1, 3, 3, 4, 2, 8).permute(0, 1, 2, 3, 5, 4, 6)
    got = draws.for_operand("p", tiles, (0, 0))
    untiled = got.permute(0, 1, 2, 3, 5, 4, 6).reshape(2, 3, 12, 16)
    assert torch.equal(untiled, whole)
    later = draws.for_operand("p", tiles[:, :, :, 1:, 1:], (1, 1))
    assert torch.equal(later, got[:, :, :, 1:, 1:])
    assert not torch.equal(draws.for_operand("dq_ds", p, None), whole)


def toward_zero_float32(u: torch.Tensor) -> torch.Tensor:
    """float64 u rounded toward zero to float32, by nextafter (independent of the shipped bit
    masks)."""
    f = u.float()
    return torch.where(f.double() > u, torch.nextafter(f, torch.zeros_like(f)), f)


def test_float32_uniforms_are_the_float64_ones_rounded_toward_zero_and_decide_alike():
    """`dtype=torch.float32` gives each uniform u rounded toward zero to float32, u', aligned
    or not, whole tensors and stacked samples' keys too; and u' < f exactly where u < f for
    every float32 f near u (its float32 neighbours, u' itself, the next float32 up) and for
    random ones, and floor(2^r u') = floor(2^r u) for r <= 24."""
    from fp4lab.formats import streams

    position = (torch.tensor(1), torch.tensor(2), torch.arange(64).view(64, 1))
    for columns in (torch.arange(256).view(1, 256), torch.tensor([[3, 9, 10, 250]])):
        u64 = streams.uniforms(7, *position, columns)
        u32 = streams.uniforms(7, *position, columns, dtype=torch.float32)
        assert u32.dtype == torch.float32
        assert torch.equal(u32, toward_zero_float32(u64))
    for key in (11, (11, 12)):
        shape = (2, 3, 40, 36)
        u64 = streams.tensor_uniforms(key, shape, "cpu")
        u32 = streams.tensor_uniforms(key, shape, "cpu", dtype=torch.float32)
        assert torch.equal(u32, toward_zero_float32(u64))
    u64 = u64.flatten()
    u32 = toward_zero_float32(u64)
    up = torch.nextafter(u32, torch.ones_like(u32))
    down = torch.nextafter(u32, torch.zeros_like(u32))
    random = torch.rand(u32.shape, generator=torch.Generator().manual_seed(0))
    for f in (u32, up, down, random, u64.float()):
        assert torch.equal(u32 < f, u64 < f.double())
    for r in (1, 8, 24):
        assert torch.equal(torch.floor(u32 * 2.0**r).double(), torch.floor(u64 * 2.0**r))
