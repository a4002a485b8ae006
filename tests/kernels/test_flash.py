"""The Triton forward (`fp4lab.kernels.flash`) against the simulation path, under Triton's
interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) and
compiled on a GPU.

Both paths quantize Q, K, V the same way and P with the same arithmetic, tile by tile, so
they differ only by the order of their fp32 sums (tl.dot against torch's matmul, the
online softmax's rescaling against the simulation's weighted sums) and exp2 against exp:
about 1e-7 relative, which the bf16 output turns into an occasional one-ulp (2^-8)
difference, plus the rare P element that sits within that error of a rounding boundary of
its format and rounds the other way. The budget below (2e-4 relative L2) covers that and is
two to three orders of magnitude below each recipe's own error against exact attention.
Where the kernel multiplies P V on a GPU's FP8 tensor cores (P and V holding E4M3 values),
Hopper accumulates part of each product in reduced precision (as FlashAttention-3's FP8
path does), which the simulation does not model: measured 5e-4 on the H200, budget 2e-3.
"""

import dataclasses
import math
import zlib

import pytest
import torch

import fp4lab
from fp4lab.analysis import attention as reference_attention
from fp4lab.recipes import RowSum, resolve_recipe

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4lab.kernels import backend as triton_backend  # noqa: E402
from fp4lab.kernels import flash  # noqa: E402
from fp4lab.kernels.backend import _fp8_pv  # noqa: E402

# the interpreter evaluates masked-out lanes too (inf - inf there); the kernel discards them
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUDGET = 2e-4
FP8_PV_BUDGET = 2e-3  # FP8 tensor cores' reduced-precision accumulation (GPU only)
RECIPES = [
    "exact", "nvfp4", "nvfp4_1level", "mxfp4", "mxfp4_alpha_ceil", "nvfp4_ue5m3",
    "fa4fp4_causal", "fa3_fp8", "attn_qat", "fa4fp4_causal_mxfp8pv", "fp8_per_tensor",
    "fa4fp4_causal_mxfp4pv", "fa4fp4_causal_mxfp4pv_d64", "flash_bf16", "sageattn3",
    "fa4fp4_directp", "sageattn3_paper", "attn_qat_kernel", "fa3_fp8_paper",
]  # fmt: skip


def inputs(b, h, hk, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda heads, s: torch.randn(b, heads, s, d, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
    return make(h, sq), make(hk, sk), make(hk, sk)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _within_budget_of_the_simulation(q, k, v, recipe, causal, tiles):
    """Assert the kernel's output within BUDGET of the simulation's; the simulation's."""
    got = fp4lab.attention(q, k, v, recipe, causal=causal, backend="triton", **tiles)
    want = reference_attention(q, k, v, recipe, causal=causal, **tiles)
    exact = reference_attention(q.double(), k.double(), v.double(), causal=causal, **tiles)
    diff, own = rel(got, want), rel(want, exact)
    assert diff <= BUDGET, f"kernel vs simulation {diff:.2e} (recipe's error {own:.2e})"
    return want


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_kernel_is_the_simulation_up_to_summation_order(recipe, causal):
    q, k, v = inputs(1, 2, 1, 80, 96, 32, seed=zlib.crc32(recipe.encode()) % 1000)
    tiles = dict(block_m=32, block_n=32)
    got = fp4lab.attention(q, k, v, recipe, causal=causal, backend="triton", **tiles)
    want = reference_attention(q, k, v, recipe, causal=causal, **tiles)
    exact = reference_attention(q.double(), k.double(), v.double(), causal=causal, **tiles)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert torch.isfinite(got.float()).all()
    diff, own = rel(got, want), rel(want, exact)
    budget = FP8_PV_BUDGET if DEVICE == "cuda" and _fp8_pv(resolve_recipe(recipe)) else BUDGET
    assert diff <= budget, f"{recipe}: kernel vs simulation {diff:.2e} (recipe's error {own:.2e})"


@pytest.mark.parametrize("recipe", ["nvfp4", "fa4fp4_causal", "exact"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(80, 72), (40, 100), (64, 64)])
def test_masked_and_unmasked_key_tiles_meet_where_they_should(recipe, causal, sq, sk):
    # the kernel skips the masks on tiles of whole query rows and visible keys only: partial
    # key tiles, partial query tiles and the causal band each take the masked path
    q, k, v = inputs(1, 2, 2, sq, sk, 32, seed=sq + sk)
    tiles = dict(block_m=32, block_n=16)  # (P V on bf16 tensor cores: FP8's need 32 keys)
    got = fp4lab.attention(q, k, v, recipe, causal=causal, backend="triton", **tiles)
    want = reference_attention(q, k, v, recipe, causal=causal, **tiles)
    fp8 = _fp8_pv(resolve_recipe(recipe), tiles["block_n"])
    budget = FP8_PV_BUDGET if DEVICE == "cuda" and fp8 else BUDGET
    assert rel(got, want) <= budget


@pytest.mark.parametrize(
    "recipe",
    ["fa4fp4_causal_mxfp4pv", "fa4fp4_causal_mxfp4pv_d64", "fa4fp4_causal_mxfp4pv_fixed"],
)
@pytest.mark.parametrize("sq, sk", [(80, 72), (40, 100)])
def test_direct_p_with_a_fixed_reference_across_tiles(recipe, sq, sk):
    # Direct-P with the anchor (its keys inside key tile 0) or the zero reference, causal:
    # the anchor read once before the loop, nothing rescaled, ragged tiles on both sides.
    # head_dim 32, not 64: at 64 the anchor's margin, 64 ln 2 / sqrt(64) in log2 units, is
    # exactly 8, so a row whose maximum is its anchor has a block maximum at z = -8, on
    # ALPHA_CEIL's discontinuity, where the last bit of the fp32 subtraction picks e_B (the
    # two paths order it differently; so may the released kernel). The _fixed variant's
    # leakage fix multiplies P's diagonal 32-blocks by unquantized V inside the masked tiles.
    q, k, v = inputs(1, 2, 1, sq, sk, 32, seed=sq * sk)
    tiles = dict(block_m=32, block_n=32)
    got = fp4lab.attention(q, k, v, recipe, causal=True, backend="triton", **tiles)
    want = reference_attention(q, k, v, recipe, causal=True, **tiles)
    assert rel(got, want) <= BUDGET


def test_an_anchor_past_key_tile_0_is_refused():
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=6)
    # refused before the kernel, in the simulation's words (`fp4lab.recipes.checks`)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match="anchors each row on its first 32 keys"):
            fp4lab.attention(q, k, v, "fa4fp4_causal_mxfp4pv", backend=backend, block_n=16)


def test_the_leakage_fix_changes_only_the_diagonal_blocks():
    # against the route without the fix, the output moves (the fix acts), and the kernel
    # follows the simulation in both; a block_m that splits V's 32-blocks is refused
    q, k, v = inputs(1, 1, 1, 96, 96, 32, seed=8)
    tiles = dict(block_m=32, block_n=32)
    fixed = fp4lab.attention(q, k, v, "fa4fp4_causal_mxfp4pv_fixed", causal=True,
                             backend="triton", **tiles)  # fmt: skip
    plain = fp4lab.attention(q, k, v, "fa4fp4_causal_mxfp4pv", causal=True, backend="triton",
                             **tiles)  # fmt: skip
    assert rel(fixed, plain) > 10 * BUDGET
    with pytest.raises(ValueError, match="leakage_block"):
        fp4lab.attention(q, k, v, "fa4fp4_causal_mxfp4pv_fixed", causal=True, backend="triton",
                         block_m=16, block_n=32)  # fmt: skip


def test_padded_query_rows_do_not_move_a_tile_scale():
    # NVFP4 P takes a tensor scale per tile: rows past the sequence must not enter its amax
    q, k, v = inputs(1, 1, 1, 40, 64, 32, seed=3)
    got = fp4lab.attention(q, k, v, "nvfp4", backend="triton", block_m=32, block_n=32)
    want = reference_attention(q, k, v, "nvfp4", block_m=32, block_n=32)
    assert rel(got, want) <= BUDGET


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
def test_sageattn3_smooth_q_is_the_simulation(d, causal):
    # smooth_q: the kernel multiplies the quantized Q - M (M each query tile's mean, the
    # padding rows of the last, partial tile counting as zeros) by K^ and adds M K^T from the
    # host in fp32, where the simulation adds it in its working precision (fp32): the same
    # budget as every recipe's. GQA (2 query heads a KV head), 80 queries and 72 keys in
    # tiles of 32, and Q offset per channel, as SageAttention's Q is, so that M matters.
    q, k, v = inputs(1, 4, 2, 80, 72, d, seed=d + causal)
    q = (q.float() + 2.0 * torch.randn(d, generator=torch.Generator().manual_seed(d)).to(q.device))
    q = q.to(torch.bfloat16)
    tiles = dict(block_m=32, block_n=32)
    got = fp4lab.attention(q, k, v, "sageattn3", causal=causal, backend="triton", **tiles)
    want = reference_attention(q, k, v, "sageattn3", causal=causal, **tiles)
    exact = reference_attention(q.double(), k.double(), v.double(), causal=causal, **tiles)
    diff, own = rel(got, want), rel(want, exact)
    assert diff <= BUDGET, f"kernel vs simulation {diff:.2e} (recipe's error {own:.2e})"


def test_smooth_q_corrects_with_the_unquantized_k():
    # the mean's scores must be M K^T with the unquantized (smoothed) K, as the simulation and
    # SageAttention3's delta_s take it: on Q offset per channel, M K^T is most of S, so the
    # kernel run with M K^^T (K's quantized values) or without the correction lands far
    # outside the budget, and the backend's own call within it
    from fp4lab.kernels import backend

    recipe, d, scale = resolve_recipe("sageattn3"), 64, 64**-0.5
    q, k, v = inputs(1, 2, 1, 64, 64, d, seed=21)
    q = (q.float() + 3.0 * torch.randn(d, generator=torch.Generator().manual_seed(22)).to(q.device))
    q = q.to(torch.bfloat16)
    tiles = dict(block_m=32, block_n=32)
    want = reference_attention(q, k, v, recipe, **tiles)
    assert rel(fp4lab.attention(q, k, v, recipe, backend="triton", **tiles), want) <= BUDGET
    ks = backend.smooth_k(k, recipe)
    q_src, q_mean = backend.smooth_q(q, recipe, 32)
    qs, k_store, vs, factors = backend.quantize_operands(q_src, ks, v, recipe)
    k_hat = k_store.float() * factors[1][..., None, None]  # K^ as the scores' operand holds it
    run = dict(pq=backend.p_quantizer(recipe), causal=False, scale=scale, **tiles,
               **backend.forward_options(recipe, False, v))  # fmt: skip

    def kernel(shift):
        out = flash.attention_forward(qs, k_store, vs, factors, mean_scores=shift, **run)[0]
        return out.to(q.dtype)  # as the backend returns it

    assert rel(kernel(backend.mean_scores(q_mean, ks, scale)), want) <= BUDGET
    for wrong, shift in (("K^", backend.mean_scores(q_mean, k_hat, scale)), ("none", None)):
        assert rel(kernel(shift), want) > 10 * BUDGET, f"the correction from {wrong} passes"


@pytest.mark.parametrize("recipe", ["fa4fp4_causal_mxfp4pv", "nvfp4"])
def test_smooth_q_on_other_recipes(recipe):
    # smooth_q is a recipe field of its own: with fp4-fa4's anchor row reference (read from
    # key tile 0's scores, the mean's among them) and Direct-P, and with NVFP4 P's per-tile
    # tensor scale
    changed = dataclasses.replace(resolve_recipe(recipe), name=f"{recipe}_smooth_q", smooth_q=True)
    q, k, v = inputs(1, 2, 1, 80, 72, 32, seed=3)
    q = (q.float() + 2.0 * torch.randn(32, generator=torch.Generator().manual_seed(1)).to(q.device))
    q = q.to(torch.bfloat16)
    tiles = dict(block_m=32, block_n=32, causal=True)
    got = fp4lab.attention(q, k, v, changed, backend="triton", **tiles)
    assert rel(got, reference_attention(q, k, v, changed, **tiles)) <= BUDGET


def test_smooth_q_needs_a_q_format_the_kernel_reads_exactly():
    # Q - M is fp32: unquantized (or cast to fp16) it would be rounded to bf16 in the kernel
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=4)
    for fmt in (None, "fp16"):
        recipe = dataclasses.replace(resolve_recipe("sageattn3"), name="t", q=fmt)
        with pytest.raises(NotImplementedError, match="smooth_q with q="):
            fp4lab.attention(q, k, v, recipe, backend="triton")


def _tiles_apart(x, rows):
    """x (B, H, S, E) with each tile of `rows` rows scaled by its own magnitude (1, 2.5, 0.5,
    1.75 in turn), so that a per-tile tensor scale differs from tile to tile."""
    magnitude = torch.tensor([1.0, 2.5, 0.5, 1.75])[(torch.arange(x.shape[2]) // rows) % 4]
    return (x.float() * magnitude.to(x.device)[:, None]).to(x.dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(80, 72), (40, 100)])
def test_tile_scope_takes_each_tiles_tensor_scale(causal, sq, sk):
    # attn_qat_kernel (tensor_scope=tile): Q's tensor scale per query tile of each head, K's
    # and V's per key tile of each KV head, the last, partial tile's padding rows counting as
    # zeros; GQA (2 query heads a KV head), ragged tiles on both sides, query and key tiles
    # of different sizes, tiles scaled apart. The same budget as every recipe's: the kernel
    # multiplies each tile's product by its tile's factor where the simulation multiplies
    # the elements, a rounding apart. Run with one factor per head instead (each head's
    # first tile's, on the same stored values), the kernel lands far outside it.
    from fp4lab.kernels import backend

    recipe, tiles = resolve_recipe("attn_qat_kernel"), dict(block_m=32, block_n=16)
    q, k, v = (_tiles_apart(x, 16) for x in inputs(1, 4, 2, sq, sk, 32, seed=sq * sk))
    want = _within_budget_of_the_simulation(q, k, v, recipe, causal, tiles)
    qs, ks, vs, factors = backend.prepare(q, k, v, recipe, **tiles)
    assert [f.shape[-1] for f in factors] == [-(-sq // 32), -(-sk // 16), -(-sk // 16)]
    run = dict(pq=backend.p_quantizer(recipe), causal=causal, scale=32**-0.5, **tiles,
               **backend.forward_options(recipe, causal, v))  # fmt: skip
    for i, name in enumerate("qkv"):  # operand i's first tile's factor for all its tiles
        wrong = [f[..., :1].expand_as(f) if j == i else f for j, f in enumerate(factors)]
        out = flash.attention_forward(qs, ks, vs, wrong, **run)[0].to(q.dtype)
        assert rel(out, want) > 10 * BUDGET, f"{name}: one factor per head passes"


@pytest.mark.parametrize("recipe", ["sageattn3", "nvfp4", "fa4fp4_causal"])
def test_the_kernel_alone_on_prepared_operands_is_the_whole_call(recipe):
    # `backend.prepare_forward` hands the forward kernel what the whole call does (smooth_q's
    # Q - M and mean scores for sageattn3, K smoothed, V key-major E4M3 where P V runs in FP8),
    # so the kernel alone (the benchmarks' rows) gives the whole call's output bit for bit;
    # `prepare` refuses smooth_q, whose mean scores it does not return
    r = resolve_recipe(recipe)
    q, k, v = inputs(1, 4, 2, 80, 96, 32, seed=5)
    tiles = dict(block_m=32, block_n=32)
    ops = triton_backend.prepare_forward(q, k, v, r, **tiles)
    assert (ops["mean_scores"] is not None) == r.smooth_q
    got = flash.attention_forward(
        ops["q"], ops["k"], ops["v"], ops["factors"], triton_backend.p_quantizer(r),
        mean_scores=ops["mean_scores"], causal=True, scale=32**-0.5, **tiles,
        **triton_backend.forward_options(r, True, v),
    )[0].to(q.dtype)  # fmt: skip
    want = fp4lab.attention(q, k, v, r, backend="triton", causal=True, **tiles)
    assert torch.equal(got, want)
    if r.smooth_q:
        with pytest.raises(NotImplementedError, match="prepare_forward"):
            triton_backend.prepare(q, k, v, r, **tiles)


@pytest.mark.parametrize("recipe", ["nvfp4", "croissattn"])
def test_tile_scope_on_other_recipes(recipe):
    # tensor_scope is a recipe field of its own: NVFP4 with Transformer Engine's arithmetic
    # (the general quantizer path), and stochastic rounding (croissattn: the uniforms cut into
    # tiles with the operand, padding rows and all, as the simulation cuts them)
    changed = dataclasses.replace(
        resolve_recipe(recipe), name=f"{recipe}_per_tile", tensor_scope="tile"
    )
    q, k, v = (_tiles_apart(x, 32) for x in inputs(1, 4, 2, 80, 72, 32, seed=3))
    tiles = dict(block_m=32, block_n=32, causal=True, generator=7)
    got = fp4lab.attention(q, k, v, changed, backend="triton", **tiles)
    assert rel(got, reference_attention(q, k, v, changed, **tiles)) <= BUDGET


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d, block", [(32, 32), (64, 64)], ids=["d32-tiles32", "d64-tiles64"])
def test_fa3_fp8_paper_rotates_and_scales_each_tile(causal, d, block):
    # FlashAttention-3's paper recipe: Q and K rotated by the simulation's own Hadamard, then
    # FP8 E4M3 with one FP32 scale per 128-row tile of each head (whole head_dim), which is
    # a per-tile factor of kernel tiles of 32 or 64 rows (several kernel tiles a 2-D tile);
    # GQA (2 query heads a KV head), ragged last tiles, 128-row tiles scaled apart. The same
    # budget as every recipe's. Dropping the Hadamard on one side (Q or K stored unrotated)
    # or taking one scale per head instead (each head's first tile's) lands far outside it.
    from fp4lab.kernels import backend

    recipe, tiles = resolve_recipe("fa3_fp8_paper"), dict(block_m=block, block_n=block)
    plain = dataclasses.replace(recipe, name="unrotated", incoherent_processing=False)
    q, k, v = (_tiles_apart(x, 128) for x in inputs(1, 4, 2, 200, 300, d, seed=d + causal))
    want = _within_budget_of_the_simulation(q, k, v, recipe, causal, tiles)
    qs, ks, vs, factors = backend.prepare(q, k, v, recipe, **tiles)
    qu, ku, _, (qfu, kfu, _) = backend.prepare(q, k, v, plain, **tiles)
    n_q, n_k = -(-200 // block), -(-300 // block)
    assert [f.shape[-1] for f in factors] == [n_q, n_k, n_k]
    run = dict(pq=backend.p_quantizer(recipe), causal=causal, scale=d**-0.5, **tiles,
               **backend.forward_options(recipe, causal, v))  # fmt: skip
    (qf, kf, vf) = factors
    broken = {
        "q unrotated": ((qu, ks, vs), (qfu, kf, vf)),
        "k unrotated": ((qs, ku, vs), (qf, kfu, vf)),
        **{f"{name} per head": ((qs, ks, vs), [f[..., :1].expand_as(f) if j == i else f
                                               for j, f in enumerate(factors)])
           for i, name in enumerate("qkv")},
    }  # fmt: skip
    for what, (operands, fs) in broken.items():
        out = flash.attention_forward(*operands, fs, **run)[0].to(q.dtype)
        assert rel(out, want) > 10 * BUDGET, f"{what} passes"


@pytest.mark.parametrize(
    "tiles, spec_block, what",
    [(dict(block_m=256, block_n=128), None, "whole number of kernel tiles"),
     (dict(block_m=32, block_n=32), (128, 16), "span the whole head_dim")],
    ids=["query-tiles-past-a-2d-tile", "2d-tile-narrower-than-head-dim"],
)  # fmt: skip
def test_fa3_fp8_paper_tiles_that_do_not_line_up_are_refused(tiles, spec_block, what):
    recipe = resolve_recipe("fa3_fp8_paper")
    if spec_block is not None:
        narrow = dataclasses.replace(recipe.k, name="fp8_e4m3_tile128x16", block=spec_block)
        recipe = dataclasses.replace(recipe, name="narrow", k=narrow)
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=4)
    with pytest.raises(NotImplementedError, match=what):
        fp4lab.attention(q, k, v, recipe, backend="triton", **tiles)


@pytest.mark.parametrize(
    "recipe, grad, what",
    [("sageattn3_paper", True, "does not replay two-level P")],
    ids=["replayed-two-level-p"],
)  # fmt: skip
def test_what_the_kernels_do_not_run_is_refused_by_name(recipe, grad, what):
    # the backward refuses before the forward runs (sageattn3_paper's exact gradient of its
    # forward would replay two-level P in dV)
    if grad:
        recipe = resolve_recipe(recipe).with_exact_backward()
    q, k, v = (x.requires_grad_(grad) for x in inputs(1, 1, 1, 32, 32, 32, seed=4))
    with pytest.raises(NotImplementedError, match=what):
        fp4lab.attention(q, k, v, recipe, backend="triton")


def test_a_p_grid_too_fine_for_the_magic_number_is_refused():
    # `_round` adds and subtracts 1.5 2^23 quanta: exact for grids of up to 21 mantissa bits;
    # a custom format with 22 would round wrong, so it is refused by name, before any launch
    fine = fp4lab.formats.FloatFormat(name="e5m22_custom", ebits=5, mbits=22, bias=15)
    recipe = dataclasses.replace(resolve_recipe("fa4fp4_causal"), name="fine", p=fine)
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=4)
    with pytest.raises(NotImplementedError, match="at most 21 mantissa bits.*e5m22_custom"):
        fp4lab.attention(q, k, v, recipe, backend="triton")
    flash.check_p(fp4lab.formats.FloatFormat(name="e5m21", ebits=5, mbits=21, bias=15), 1.0)


def test_p_blocked_along_the_queries_is_refused():
    # the kernel blocks P along the keys only; block_axes moving it would be run wrongly
    recipe = dataclasses.replace(resolve_recipe("nvfp4"), name="t", block_axes=(("p", -2),))
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=4)
    with pytest.raises(NotImplementedError, match="p blocked along the queries"):
        fp4lab.attention(q, k, v, recipe, backend="triton")


def test_the_leakage_fix_with_p_alone_is_the_simulations():
    # P alone unquantized on the diagonal blocks, times V^: the kernel follows the
    # simulation, differs from the whole fix and from no fix, and keeps the leak (a later V
    # moves an earlier output through V's shared block scale)
    fixed = resolve_recipe("fa4fp4_causal_mxfp4pv_fixed")
    recipe = dataclasses.replace(fixed, name="half_p", leakage_fix_parts="p")
    q, k, v = inputs(1, 2, 2, 96, 96, 128, seed=8)  # the route's own head_dim (see the
    tiles = dict(block_m=32, block_n=32, causal=True)  # studies' note on its anchor at 64)
    got = fp4lab.attention(q, k, v, recipe, backend="triton", **tiles)
    assert rel(got, reference_attention(q, k, v, recipe, **tiles)) <= BUDGET
    for other in ("fa4fp4_causal_mxfp4pv_fixed", "fa4fp4_causal_mxfp4pv"):
        assert rel(got, fp4lab.attention(q, k, v, other, backend="triton", **tiles)) > 10 * BUDGET
    v2 = v.clone()
    v2[:, :, 50] *= 40.0  # shares V's block 32..63 with query 40
    moved = fp4lab.attention(q, k, v2, recipe, backend="triton", **tiles)
    assert not torch.equal(moved[..., 40, :], got[..., 40, :])


def test_half_of_the_leakage_fix_is_refused_where_the_kernels_do_not_run_it():
    # V's half runs on the simulation only; P's half on Direct-P only, and not in the exact
    # gradient's replay
    fixed = resolve_recipe("fa4fp4_causal_mxfp4pv_fixed")
    q, k, v = inputs(1, 1, 1, 64, 64, 32, seed=4)
    v_half = dataclasses.replace(fixed, name="half_v", leakage_fix_parts="v")
    with pytest.raises(NotImplementedError, match="leakage_fix_parts='v'"):
        fp4lab.attention(q, k, v, v_half, backend="triton", causal=True)
    plain_p = dataclasses.replace(resolve_recipe("mxfp4"), name="mx_half", leakage_fix=True,
                                  leakage_fix_parts="p")
    with pytest.raises(NotImplementedError, match="leakage_fix_parts='p' with p_quant=spec"):
        fp4lab.attention(q, k, v, plain_p, backend="triton", causal=True)
    replay = dataclasses.replace(fixed, name="half", leakage_fix_parts="p").with_exact_backward()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="in the exact gradient of the forward"):
        fp4lab.attention(q, k, v, replay, backend="triton", causal=True)


@pytest.mark.parametrize(
    "recipe, tiles, words",
    [("mxfp4", dict(block_m=16, block_n=16), "block_n=16 is not a multiple of 32"),
     ("nvfp4", dict(block_m=0, block_n=32), "block_m must be a positive int"),
     ("fa4fp4_causal_mxfp4pv", dict(block_m=32, block_n=16), "block_n=16")],
    ids=["p-block-wider-than-tile", "zero-tile", "anchor-or-p-block"],
)
def test_tiles_the_simulation_refuses_the_kernels_refuse_in_the_same_words(recipe, tiles, words):
    # was an interpreter shape error (P's block wider than the key tile) on the Triton path
    q, k, v = inputs(1, 1, 1, 64, 64, 32, seed=6)
    for backend in ("reference", "triton"):
        with pytest.raises(ValueError, match=words):
            fp4lab.attention(q, k, v, recipe, backend=backend, **tiles)


@pytest.mark.parametrize("row_sum", [RowSum.QUANTIZED_P, RowSum.UNQUANTIZED_P])
@pytest.mark.parametrize("recipe", ["fa4fp4_causal_mxfp4pv", "fa4fp4_causal_mxfp4pv_d64",
                                    "fa4fp4_causal_mxfp4pv_fixed"])
def test_the_stored_scale_shift_changes_no_bit_in_range_and_keeps_big_rows_finite(
    recipe, row_sum
):
    # the kernel's P V and row sum on codes 2^(e_B - S): O and the lse the same bits as
    # without the shift on ordinary inputs (the lse from l 2^S); a row whose later keys all
    # reach log2 P 140 over the row reference: finite with the shift, as the simulation's
    # each route at its own head_dim: the D128 route's anchor margin, 64 ln 2 in raw score
    # units, is exactly 8 log2 units at head_dim 64, where its ceil rule makes the anchor
    # block's e_B hang on the last bit of the anchor's score (the kernel's and the
    # simulation's differ there by 6%, with or without the shift; studies/README.md)
    d = 64 if recipe == "fa4fp4_causal_mxfp4pv_d64" else 128
    route = dataclasses.replace(resolve_recipe(recipe), row_sum=row_sum)
    bare = dataclasses.replace(route, name=f"{recipe}_unshifted", p_scale_shift=0)
    q, k, v = inputs(1, 2, 2, 128, 128, d, seed=9)
    run = dict(causal=True, scale=d**-0.5, block_m=64, block_n=64, lse_log2=True)
    got = {}
    for r in (route, bare):
        qs, ks, vs, factors = triton_backend.quantize_operands(q, k, v, r, None, (64, 64))
        got[r.name] = flash.attention_forward(
            qs, ks, vs, factors, triton_backend.p_quantizer(r), out_dtype=torch.float32,
            **run, **triton_backend.forward_options(r, True, v))
    for a, b in zip(got[route.name], got[bare.name], strict=True):
        assert torch.equal(a, b)
    sim = reference_attention(q.float(), k.float(), v.float(), route, causal=True,
                              block_m=64, block_n=64)
    assert rel(got[route.name][0], sim) <= BUDGET  # the shifted kernel is the simulation
    q, k = torch.zeros(2, 1, 1, 128, 64, device=DEVICE)
    q[..., 0] = 8.0
    margin = route.anchor_margin / 8 if route.row_reference.value == "anchor" else 0.0
    k[..., 32:, 0] = 140 / math.log2(math.e) + margin
    q, k, v = q.bfloat16(), k.bfloat16(), torch.full_like(q, 0.5).bfloat16()
    # P itself passes float32 there (2^140): the unquantized P that an unquantized row sum
    # or the leakage fix's diagonal takes enters as P 2^-S, from exp2(z - S)
    big = {backend_name: fp4lab.attention(q, k, v, route, causal=True, block_m=64, block_n=64,
                                          backend=backend_name).float()
           for backend_name in ("reference", "triton")}
    for backend_name, out in big.items():
        assert out.isfinite().all(), backend_name
        if row_sum is RowSum.QUANTIZED_P:  # V is 0.5 and l is P V's own sum: O is 0.5
            torch.testing.assert_close(out, torch.full_like(out, 0.5), rtol=2**-8, atol=0)
        # (else O is 0.5 sum P^ / sum P, near 0 where P^ saturates at E8M0's 2^127 and P
        # does not: the two backends' agreement below is the check)
    assert rel(big["triton"], big["reference"]) <= BUDGET


def test_mask_and_dtype_are_refused_not_replaced():
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=5)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        mask = torch.ones(32, 32, dtype=torch.bool, device=DEVICE)
        fp4lab.attention(q, k, v, backend="triton", attn_mask=mask)
    with pytest.raises(ValueError, match="q: the Triton backend runs bf16 or fp16"):
        fp4lab.attention(q.float(), k, v, backend="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_operand_in_its_own_format_is_cast_by_a_clamp(dtype):
    # every bit pattern of the dtype: the backend's one-pass cast against the reference's
    # saturating rounding (inf to max, NaN kept, -0 kept), and a format other than the
    # input's own still rounds through the reference
    from fp4lab.formats import BF16, FP16, round_to_format
    from fp4lab.kernels.backend import cast_to_format

    fmt = BF16 if dtype == torch.bfloat16 else FP16
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    got, want = cast_to_format(x, fmt), round_to_format(x.float(), fmt).to(dtype)
    assert got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert got[x == float("inf")].item() == fmt.max  # the clamp did saturate
    other = FP16 if fmt is BF16 else BF16
    y = torch.randn(4096, generator=torch.Generator().manual_seed(7)).to(dtype) * 1e3
    assert torch.equal(cast_to_format(y, other), round_to_format(y.float(), other))


@triton.jit
def _divide_kernel(X, S, Out, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(X + offs, mask=inside, other=1.0)
    s = tl.load(S + offs, mask=inside, other=1.0)
    tl.store(Out + offs, flash._div_by_short(x, s), mask=inside)


def test_division_by_a_short_scale_is_the_ieee_quotient():
    # every 4-bit significand of s against every fp32 significand of x on a GPU (2^26 pairs);
    # under the interpreter a sample, dense around the E2M1 grid's ties (x / s = 0.25, 0.75,
    # ..., 5 give or take a few ulps), where a quotient one ulp off would round P the other way
    g = torch.Generator().manual_seed(11)
    significands = 1.0 + torch.arange(8, dtype=torch.float32) / 8
    if DEVICE == "cuda":
        mantissa = torch.arange(1 << 23, dtype=torch.int32)
        x = ((127 << 23) | mantissa).view(torch.float32)
    else:
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
        near = (ties[:, None] * significands).flatten().view(torch.int32)
        near = (near[:, None] + torch.arange(-3, 4, dtype=torch.int32)).flatten()
        near = near.view(torch.float32)
        x = torch.cat([near, torch.rand(1 << 14, generator=g) * 8])
    x, s = (t.flatten() for t in torch.broadcast_tensors(x[:, None], significands[None, :]))
    x, s = x.contiguous().to(DEVICE), (s * 2.0**-7).contiguous().to(DEVICE)  # an E4M3 binade
    out = torch.empty_like(x)
    _divide_kernel[(triton.cdiv(x.numel(), 1024),)](x, s, out, x.numel(), BLOCK=1024)
    want = (x.double() / s.double()).float()  # the exact quotient, rounded once
    bad = (out.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert bad.numel() == 0, f"x={x[bad[0]].item()!r} s={s[bad[0]].item()!r}: {out[bad[0]]}"


@triton.jit
def _reciprocal_kernel(X, Out, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(X + offs, mask=inside, other=1.0)
    tl.store(Out + offs, flash._reciprocal(x), mask=inside)


def test_the_reciprocal_in_range_is_the_ieee_one():
    # `_reciprocal` (HW_RCP on a GPU: the hardware's approximate reciprocal and one Newton
    # step) against the correctly rounded 1 / d: on a GPU every significand at the range's
    # two ends (exponent fields 1 and 252), at 1 and at E4M3's binades, and 2^22 random d
    # over the whole range; under the interpreter (tl.div_rn) a sample. Both signs.
    g = torch.Generator().manual_seed(12)
    if DEVICE == "cuda":
        mantissa = torch.arange(1 << 23, dtype=torch.int32)
        fields = torch.tensor([1, 2, 118, 127, 128, 135, 251, 252], dtype=torch.int32)
        spread = 1 << 22
    else:
        mantissa = torch.randint(0, 1 << 23, (1 << 10,), generator=g, dtype=torch.int32)
        fields = torch.tensor([1, 127, 252], dtype=torch.int32)
        spread = 1 << 12
    grid = ((fields[:, None] << 23) | mantissa[None, :]).flatten()
    spread_bits = torch.randint(1 << 23, 253 << 23, (spread,), generator=g, dtype=torch.int32)
    bits = torch.cat([grid, spread_bits])
    d = torch.cat([bits, bits | torch.tensor(-(1 << 31), dtype=torch.int32)]).view(torch.float32)
    d = d.to(DEVICE)
    out = torch.empty_like(d)
    _reciprocal_kernel[(triton.cdiv(d.numel(), 1024),)](d, out, d.numel(), BLOCK=1024)
    want = (1.0 / d.double()).float()  # the exact reciprocal, rounded once
    bad = (out.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert bad.numel() == 0, f"d={d[bad[0]].item()!r}: {out[bad[0]].item()!r}"


@triton.jit
def _round_kernel(X, Out, N, Q_LO: tl.constexpr, Q_HI: tl.constexpr, UNIT: tl.constexpr,
                  MAXV: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(X + offs, mask=inside, other=0.0)
    tl.store(Out + offs, flash._round(x, Q_LO, Q_HI, UNIT, MAXV), mask=inside)


@pytest.mark.parametrize("name", ["fp8_e4m3fn", "fp4_e2m1", "fp8_e5m2"])
def test_rounding_onto_a_grid_in_registers_is_the_reference_bit_for_bit(name):
    # `_round`'s magic-number arithmetic (on every grid, compiled or not). Every value of the
    # format and every midpoint (where a tie rounds to even) with its 64 fp32 neighbours on
    # each side, subnormals of both formats, values past the maximum, inf (saturating) and
    # NaN (kept), and on a GPU every 7th fp32 bit pattern up to 512 (a sample of 2^16 under
    # the interpreter)
    fmt = fp4lab.formats.get(name)
    grid = _nonnegative_values(fmt)
    top = fmt.max
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2,
                        torch.tensor([top * 1.03, top * 1.07, 1e30])])  # fmt: skip
    near = points.view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)
    near = near.flatten().clamp(min=0)
    if DEVICE == "cuda":
        sweep = torch.arange(0, 0x44000000, 7, dtype=torch.int32)
    else:
        sweep = torch.randint(0, 0x44000000, (1 << 16,), generator=torch.Generator().manual_seed(3),
                              dtype=torch.int32)  # fmt: skip
    tiny = torch.tensor([1, 2**20, 0x007FFFFF, 0x00800000], dtype=torch.int32)  # fp32 subnormals
    x = torch.cat([near, sweep, tiny]).view(torch.float32)
    x = torch.cat([x, torch.tensor([float("inf"), float("nan")])]).contiguous()
    out = torch.empty_like(x, device=DEVICE)
    q_lo, q_hi, unit, maxv = flash._grid(fmt)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), out, x.numel(), Q_LO=q_lo,
                                                   Q_HI=q_hi, UNIT=unit, MAXV=maxv,
                                                   BLOCK=1024)  # fmt: skip
    want = fp4lab.formats.round_to_format(x, fmt)
    out = out.cpu()
    assert torch.equal(out.isnan(), want.isnan())  # NaN stays NaN (its payload aside)
    out, want = out.nan_to_num(0.0), want.nan_to_num(0.0)
    bad = (out.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert bad.numel() == 0, (f"{bad.numel()} differ; x={x[bad[0]].item()!r}: "
                              f"{out[bad[0]].item()!r}, want {want[bad[0]].item()!r}")  # fmt: skip


@triton.jit
def _e4m3_cast_kernel(X, Hi, Mid, Lo, Back, Out, FROM_DOT: tl.constexpr, BLOCK: tl.constexpr):
    rows, cols = tl.arange(0, BLOCK)[:, None], tl.arange(0, BLOCK)[None, :]
    offs = tl.program_id(0) * BLOCK * BLOCK + rows * BLOCK + cols
    if FROM_DOT:  # x rebuilt as the score dot leaves a tile: its three bf16 parts times I
        eye = (rows == cols).to(tl.bfloat16)
        x = tl.dot(tl.load(Hi + offs), eye)
        x = tl.dot(tl.load(Mid + offs), eye, x)
        x = tl.dot(tl.load(Lo + offs), eye, x)
    else:
        x = tl.load(X + offs)
    tl.store(Back + offs, x)
    tl.store(Out + offs, x.to(tl.float8e4nv))


@pytest.mark.skipif(DEVICE != "cuda" or not flash.HW_E4M3,
                    reason="the GPU's E4M3 conversion (flash.HW_E4M3): sm_89 and later, compiled")
@pytest.mark.parametrize("from_dot", [False, True], ids=["loaded", "from-a-dot"])
def test_the_gpus_e4m3_cast_of_p_is_the_reference_bit_for_bit(from_dot):
    # the one hardware cast the kernels use (FP8 P^ into the FP8 dot, `_hardware_e4m3`),
    # stored as bytes and widened by torch, on a tile loaded from memory and on one in the
    # layout a tl.dot leaves (where an fp8 round trip in registers went wrong, 2026-12-02):
    # every E4M3 value and midpoint with 64 fp32 neighbours each side, past the maximum, and
    # every 7th fp32 pattern up to 512 (loaded: also inf and NaN, which a dot by I cannot
    # carry, and fp32 subnormals)
    fmt = fp4lab.formats.get("fp8_e4m3fn")
    grid = _nonnegative_values(fmt)
    points = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([470.0, 500.0, 1e30])])
    near = points.view(torch.int32)[:, None] + torch.arange(-64, 65, dtype=torch.int32)
    parts = [near.flatten().clamp(min=0), torch.arange(0, 0x44000000, 7, dtype=torch.int32)]
    if not from_dot:
        parts.append(torch.tensor([1, 2**20, 0x007FFFFF, 0x7F800000, 0x7FC00000],
                                  dtype=torch.int32))  # fmt: skip
    x = torch.cat(parts).view(torch.float32)
    if from_dot:  # bf16 parts stay exact (and the tensor cores' sums with them) above 2^-100
        x = x[x >= 2.0**-100]
    block = 64
    x = torch.cat([x, x[: -x.numel() % (block * block)]]).contiguous()
    hi = x.to(torch.bfloat16)
    mid = (x - hi.float()).to(torch.bfloat16)
    lo = (x - hi.float() - mid.float()).to(torch.bfloat16)
    if from_dot:
        assert torch.equal(hi.float() + mid.float() + lo.float(), x)
    x_d, hi_d, mid_d, lo_d = (t.to(DEVICE) for t in (x, hi, mid, lo))
    back = torch.empty_like(x_d)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=DEVICE)
    _e4m3_cast_kernel[(x.numel() // (block * block),)](x_d, hi_d, mid_d, lo_d, back, out,
                                                      FROM_DOT=from_dot, BLOCK=block)  # fmt: skip
    assert torch.equal(back.cpu().view(torch.int32), x.view(torch.int32))  # the tile is x
    got = out.cpu().float()
    want = fp4lab.formats.round_to_format(x, fmt)
    assert torch.equal(got.isnan(), want.isnan())
    got, want = got.nan_to_num(0.0), want.nan_to_num(0.0)
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert bad.numel() == 0, (f"{bad.numel()} differ; x={x[bad[0]].item()!r}: "
                              f"{got[bad[0]].item()!r}, want {want[bad[0]].item()!r}")  # fmt: skip


@triton.jit
def _bf16_grid_kernel(X, Out, Cast, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    x = tl.load(X + offs, mask=inside, other=0.0)
    y = flash._bf16_grid(x)
    tl.store(Out + offs, y, mask=inside)
    tl.store(Cast + offs, y.to(tl.bfloat16), mask=inside)  # the dot's operand cast after it


def test_p_onto_bf16s_grid_is_the_reference_bit_for_bit():
    # `_bf16_grid`: compiled, the GPU's conversion and back (`_hardware_bf16`); under the
    # interpreter, the rounding on bits. Either way torch's round to nearest even, and
    # compiled the cast that follows it (as into a bf16 dot) changes nothing (the
    # interpreter's own cast truncates and flushes subnormals): every bf16 midpoint with
    # 64 fp32 neighbours each side over the binades P and its lifts reach, fp32 and bf16
    # subnormals, the top binade, inf and NaN, and every 7th fp32 pattern up to 512 on a GPU
    # (a sample of 2^16 under the interpreter)
    exponents = torch.arange(-133, 128, dtype=torch.int32)
    mids = ((exponents + 127).clamp(min=0) << 23) | 0x8000  # a bf16 midpoint in each binade
    mids = torch.cat([mids, mids | 0x10000, torch.tensor([0x4000, 0xC000, 0x7F7F8000])])
    near = (mids[:, None] + torch.arange(-64, 65, dtype=torch.int32)).flatten().clamp(min=0)
    if DEVICE == "cuda":
        sweep = torch.arange(0, 0x44000000, 7, dtype=torch.int32)
    else:
        sweep = torch.randint(0, 0x44000000, (1 << 16,), generator=torch.Generator().manual_seed(5),
                              dtype=torch.int32)  # fmt: skip
    special = torch.tensor([1, 0x7FFF, 0x8000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000],
                           dtype=torch.int32)  # fmt: skip
    x = torch.cat([near, sweep, special]).view(torch.float32).contiguous()
    out = torch.empty_like(x, device=DEVICE)
    cast = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _bf16_grid_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(DEVICE), out, cast, x.numel(),
                                                       BLOCK=1024)  # fmt: skip
    want = x.to(torch.bfloat16).float()
    out, cast = out.cpu(), cast.cpu().float()
    for got in (out, cast) if flash.HW_BF16 else (out,):
        assert torch.equal(got.isnan(), want.isnan())
        got, ref = got.nan_to_num(0.0), want.nan_to_num(0.0)
        bad = (got.view(torch.int32) != ref.view(torch.int32)).nonzero()
        where = bad[0] if bad.numel() else 0
        assert bad.numel() == 0, (f"{bad.numel()} differ; x={x[where].item()!r}: "
                                  f"{got[where].item()!r}, want {ref[where].item()!r}")


def _nonnegative_values(fmt) -> torch.Tensor:
    """Every finite nonnegative value of a float format, ascending (float32)."""
    values = fmt.values.float()
    return values[values >= 0]


@triton.jit
def _quantize_p_kernel(
    P, Values, Factor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MODE: tl.constexpr, LIFT: tl.constexpr, EQ_LO: tl.constexpr, EQ_HI: tl.constexpr,
    E_UNIT: tl.constexpr, E_MAX: tl.constexpr, SQ_LO: tl.constexpr, SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr, S_MAX: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr,
    QBLOCK: tl.constexpr, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr,
):  # fmt: skip
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    values, factor = flash._quantize_p(
        tl.load(P + offs), 0, BLOCK_M, BLOCK_N, MODE, LIFT, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO,
        SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E,
    )  # fmt: skip
    tl.store(Values + offs, values)
    tl.store(Factor + tl.arange(0, 1), tl.full([1], factor, tl.float32))


@pytest.mark.parametrize(
    "p_format",
    ["bf16", "fp8_e4m3fn", "fp8_e5m2", "nvfp4", "nvfp4_1level", "mxfp4", "mxfp4_rceil",
     "mxfp4_ceil", "mxfp4_alpha_ceil", "mxfp4_alpha_mse", "mxfp4_alpha_half", "nvfp4_ue5m3",
     "nvfp4_reciprocal", "nvfp4_divide_unrounded", "mxfp8_e4m3", "mxfp8_e5m2"],
)  # fmt: skip
def test_p_tile_quantized_in_registers_is_the_reference_bit_for_bit(p_format):
    # P of a softmax tile: one 1 per row (its maximum), the rest exp2 of negative scores down
    # to 2^-40, a few exact zeros and ties of the element grid times a power of two
    g = torch.Generator().manual_seed(zlib.crc32(p_format.encode()))
    depth = torch.tensor([1.0, 8.0, 40.0]).repeat(22)[:64]
    p = torch.exp2(-torch.rand(32, 64, generator=g) * depth)
    p[:, ::17] = 1.0
    p[3, :] = 0.0
    p[4, :32] = 2.0**-130  # a block of subnormals
    p[4, 32:] = 2.0**-100
    # a block of amax 1 (E4M3 scale 1/6 rounded: 0.171875) holding E2M1's ties times that
    # scale, and their fp32 neighbours: a quotient off by one ulp would round them otherwise
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]) * 0.171875
    p[5, :16] = torch.cat([torch.ones(1), ties, ties.nextafter(torch.tensor(0.0)), torch.ones(1)])
    p[6, :16] = torch.cat([torch.ones(1), ties, ties.nextafter(torch.tensor(1.0)), torch.ones(1)])
    spec = fp4lab.formats.get(p_format)
    if isinstance(spec, fp4lab.formats.FloatFormat):  # an element cast saturates (a fixed
        # reference lets P pass 1): past the maximum, between it and the next binade, and inf
        top = spec.max
        p[7, :8] = torch.tensor([top, top * 1.03, top * 1.07, top * 1.5, top * 2, 3e38,
                                 float("inf"), 1.0])  # fmt: skip
    pq = flash.PQuantizer.of(spec, 1.0)
    values = torch.empty_like(p).to(DEVICE)
    factor = torch.empty(1, device=DEVICE)
    _quantize_p_kernel[(1,)](
        p.to(DEVICE), values, factor, BLOCK_M=32, BLOCK_N=64, MODE=pq.MODE, LIFT=pq.LIFT,
        EQ_LO=pq.ELEM[0], EQ_HI=pq.ELEM[1], E_UNIT=pq.ELEM[2], E_MAX=pq.ELEM[3],
        SQ_LO=pq.SCALE[0], SQ_HI=pq.SCALE[1], S_UNIT=pq.SCALE[2], S_MAX=pq.SCALE[3],
        E_LO=pq.SCALE_POW2[0], E_HI=pq.SCALE_POW2[1], QBLOCK=pq.BLOCK, RULE=pq.RULE,
        ARITH=pq.ARITH, TENSOR=pq.TENSOR, EMAX_E=pq.EMAX_E,
    )  # fmt: skip
    if isinstance(spec, fp4lab.formats.FloatFormat):
        want = fp4lab.formats.round_to_format(p, spec)
    else:
        want = fp4lab.formats.fake_quantize(p, spec, axis=-1)  # the tile as a whole tensor
    got = (values.cpu() * factor.cpu()).float()
    # values * factor rounds once where the factor is not a power of two (a tensor scale's
    # decode, an alpha grid's 1/M_e): there the reference's own product order decides the ulp
    exact = factor.item() == 2.0 ** round(math.log2(factor.item()))
    ulps = (got.view(torch.int32) - want.view(torch.int32)).abs().max().item()
    assert ulps <= (0 if exact else 1), f"{p_format}: {ulps} ulps (factor {factor.item()})"
    assert torch.equal(got == 0, want == 0)


@triton.jit
def _dot_p_kernel(
    Q, K, P, Values, Factor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    MODE: tl.constexpr, LIFT: tl.constexpr, EQ_LO: tl.constexpr, EQ_HI: tl.constexpr,
    E_UNIT: tl.constexpr, E_MAX: tl.constexpr, SQ_LO: tl.constexpr, SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr, S_MAX: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr,
    QBLOCK: tl.constexpr, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr,
):  # fmt: skip
    # P as the attention kernel holds it: exp2 of a tl.dot's scores, in the dot's layout
    rows, cols, d = tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N), tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * D + d[None, :])
    k = tl.load(K + cols[None, :] * D + d[:, None])
    qk = tl.dot(q, k) * 0.125
    p = tl.exp2(qk - tl.max(qk, 1)[:, None])
    offs = rows[:, None] * BLOCK_N + cols[None, :]
    tl.store(P + offs, p)
    values, factor = flash._quantize_p(
        p, 0, BLOCK_M, BLOCK_N, MODE, LIFT, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO,
        SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E,
    )  # fmt: skip
    tl.store(Values + offs, values)
    tl.store(Factor + tl.arange(0, 1), tl.full([1], factor, tl.float32))


@pytest.mark.parametrize(
    "p_format", ["fp8_e4m3fn", "nvfp4", "mxfp4", "mxfp4_alpha_ceil", "mxfp8_e4m3_alpha_ceil"]
)
def test_p_quantized_in_the_dot_layout_is_the_reference(p_format):
    # the same quantizer on P straight out of tl.dot (the MMA layout on a GPU, where the block
    # reshape has to move elements between threads), against fp4lab.formats on that P
    g = torch.Generator().manual_seed(zlib.crc32(p_format.encode()))
    q, k = (torch.randn(s, 64, generator=g).to(DEVICE, torch.bfloat16) for s in (64, 64))
    if DEVICE != "cuda":
        q, k = q.float(), k.float()
    spec = fp4lab.formats.get(p_format)
    pq = flash.PQuantizer.of(spec, 1.0)
    p, values = (torch.empty(64, 64, device=DEVICE) for _ in range(2))
    factor = torch.empty(1, device=DEVICE)
    _dot_p_kernel[(1,)](
        q, k, p, values, factor, BLOCK_M=64, BLOCK_N=64, D=64, MODE=pq.MODE, LIFT=pq.LIFT,
        EQ_LO=pq.ELEM[0], EQ_HI=pq.ELEM[1], E_UNIT=pq.ELEM[2], E_MAX=pq.ELEM[3],
        SQ_LO=pq.SCALE[0], SQ_HI=pq.SCALE[1], S_UNIT=pq.SCALE[2], S_MAX=pq.SCALE[3],
        E_LO=pq.SCALE_POW2[0], E_HI=pq.SCALE_POW2[1], QBLOCK=pq.BLOCK, RULE=pq.RULE,
        ARITH=pq.ARITH, TENSOR=pq.TENSOR, EMAX_E=pq.EMAX_E,
    )  # fmt: skip
    p = p.cpu()
    if isinstance(spec, fp4lab.formats.FloatFormat):
        want = fp4lab.formats.round_to_format(p, spec)
    else:
        want = fp4lab.formats.fake_quantize(p, spec, axis=-1)
    got = values.cpu() * factor.cpu()
    exact = factor.item() == 2.0 ** round(math.log2(factor.item()))
    ulps = (got.view(torch.int32) - want.view(torch.int32)).abs().max().item()
    assert ulps <= (0 if exact else 1), f"{p_format}: {ulps} ulps"


@pytest.mark.parametrize(
    "spec", ["mxfp4", "nvfp4_1level", "mxfp8_e4m3", "mxfp4_rceil", "nvfp4_ue5m3", "nvfp4"]
)
@pytest.mark.parametrize("field", ["q", "v"])
def test_operands_take_the_fused_path_only_where_it_is_the_same(spec, field):
    # the one-pass path (fake_quantize in the store dtype) against codes times scales in
    # fp32 cast to it, bit for bit
    from fp4lab.kernels import backend

    block_format = fp4lab.formats.get(spec)
    recipe = dataclasses.replace(resolve_recipe("exact"), name="t", **{field: block_format})
    x = inputs(2, 2, 2, 64, 64, 64, seed=9)[0]
    store, factor = backend._operand(x, recipe, field, 1)
    qt = fp4lab.formats.quantize(x, block_format, axis=recipe.block_axis(field))
    if backend._one_pass(block_format):
        want = (qt.element_values() * qt.expanded_scales()).to(store.dtype)
        assert torch.equal(store.cpu(), want.cpu()) and torch.all(factor == 1)
    else:
        assert spec == "nvfp4"  # a tensor scale: the general path, a factor per head
        assert not torch.all(factor == 1)


@pytest.mark.parametrize("groups", ["preset", "all"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_direct_p_affine_code_map_is_the_simulations(groups, causal):
    # fa4fp4_directp's own 128-key tiles, so that its groups mask (bits 1-3 of 4 blocks of 32)
    # selects blocks; the map must matter here, or the comparison could not fail
    recipe = resolve_recipe("fa4fp4_directp")
    if groups == "all":
        recipe = dataclasses.replace(recipe, direct_p_affine_groups=None)
    plain = dataclasses.replace(recipe, direct_p_affine=None)
    q, k, v = inputs(1, 2, 1, 256, 256, 64, seed=31)
    tiles = dict(block_m=128, block_n=128)
    got = fp4lab.attention(q, k, v, recipe, causal=causal, backend="triton", **tiles)
    want = reference_attention(q, k, v, recipe, causal=causal, **tiles)
    without = reference_attention(q, k, v, plain, causal=causal, **tiles)
    assert rel(got, want) <= BUDGET
    assert rel(without, want) > 10 * BUDGET  # the affine blocks move the output


def test_scores_minus_the_maximum_is_one_fma_only_where_p_is_cast_element_by_element():
    # fl(x s - m) moves z by an ulp; where a block scale's power-of-two rule, Direct-P or
    # two-level P need the row maximum's z to be exactly 0 it stays fl(fl(x s) - m), and so
    # it does for scales to nearest, where the backward that rebuilds P from the forward's
    # log-sum-exp moved past its budgets with it
    def decide(name, scale=0.125, traced=False, smooth_q=False, tile_scope=False):
        pq = triton_backend.p_quantizer(resolve_recipe(name))
        return flash._z_in_one_fma(pq, scale, traced, smooth_q, tile_scope)

    for name in ("fa4fp4_causal", "fa3_fp8", "flash_bf16", "exact"):
        assert decide(name) == dict(Z_FMA=True), name
    for name in ("nvfp4", "nvfp4_1level", "sageattn3", "attn_qat", "croissattn_eden", "mxfp4",
                 "mxfp4_alpha_ceil", "fa4fp4_directp", "sageattn3_paper"):  # fmt: skip
        assert decide(name) == {}, name  # block scales, Direct-P, two-level P
    assert decide("fa4fp4_causal", traced=True) == {}
    assert decide("fa4fp4_causal", smooth_q=True) == {}
    assert decide("fa4fp4_causal", tile_scope=True) == {}
    assert decide("fa4fp4_causal", scale=-0.125) == {}  # max fl(x s) is then not fl(s max x)
    assert decide("fa4fp4_causal", scale=0.0) == {}


@pytest.mark.parametrize("scale", [0.3, -0.3])
def test_fused_scores_agree_with_the_simulation_for_either_sign_of_the_scale(scale):
    # a negative scale takes the unfused path: its row maximum is the products' minimum
    q, k, v = inputs(1, 2, 1, 200, 200, 64, seed=41)
    for name in ("fa3_fp8", "flash_bf16"):
        got = fp4lab.attention(q, k, v, name, backend="triton", scale=scale)
        want = reference_attention(q, k, v, name, scale=scale)
        fp8 = DEVICE == "cuda" and _fp8_pv(resolve_recipe(name))
        assert rel(got, want) <= (FP8_PV_BUDGET if fp8 else BUDGET), (name, scale)


@pytest.mark.parametrize("reference", ["RUNNING_MAX", "ZERO"])
def test_per_tile_p_scales_accumulate_in_the_dot_across_far_apart_tiles(reference, monkeypatch):
    # ACC_UNITS (NVFP4's per-tile tensor scale of P, a running maximum): acc in units of
    # each tile factor's significand. Key tiles whose scores lie about 50 and 100 below the
    # rows' maxima give P tile maxima near 2^-72 and 2^-144 (P itself subnormal or flushed),
    # so the tile factors span far more than fp32 could hold as one acc unit; the output must
    # still be the simulation's, and the per-tile product's (ACC_UNITS off) to the same
    # budget. With a fixed reference (zero) the per-tile product runs, checked the same way
    recipe = dataclasses.replace(
        resolve_recipe("nvfp4"), name=f"nvfp4_{reference.lower()}",
        row_reference=type(resolve_recipe("nvfp4").row_reference)[reference],
    )  # fmt: skip
    q, k, v = inputs(1, 2, 2, 130, 200, 64, seed=43)
    q[..., 0], k[..., 0] = 4.0, 1.0
    k[:, :, 64:128, 0], k[:, :, 128:192, 0] = -100.0, -200.0
    got = fp4lab.attention(q, k, v, recipe, causal=False, backend="triton", block_m=64, block_n=64)
    want = reference_attention(q, k, v, recipe, causal=False, block_m=64, block_n=64)
    accumulate = flash._accumulate_in_dot
    monkeypatch.setattr(flash, "_accumulate_in_dot", lambda pq, per_tile, fp8, fixed: (
        {} if not pq.constant_factor else accumulate(pq, per_tile, fp8, fixed)))
    per_tile = fp4lab.attention(q, k, v, recipe, causal=False, backend="triton", block_m=64,
                                block_n=64)  # fmt: skip
    assert torch.isfinite(got).all()
    assert rel(got, want) <= BUDGET and rel(got, per_tile) <= BUDGET


def test_p_v_accumulates_inside_the_dot_only_off_the_fp8_tensor_cores():
    # an FP8 dot's accumulator keeps fewer bits than fp32 (on the H200 in-dot accumulation put
    # fa4fp4_causal's output 2.7x further from the simulation): there each tile's product is
    # added in fp32; a bf16 dot accumulates in fp32 and takes the whole row of tiles
    fp8_p = triton_backend.p_quantizer(resolve_recipe("fa3_fp8"))
    assert flash._accumulate_in_dot(fp8_p, per_tile=False, fp8=True) == {}
    assert flash._accumulate_in_dot(fp8_p, per_tile=False, fp8=False) == dict(
        ACC_DOT=True, ACC_FACTOR=1.0 / fp8_p.LIFT
    )
    assert flash._accumulate_in_dot(fp8_p, per_tile=True, fp8=False) == {}  # a trace, O', ...
    nvfp4_p = triton_backend.p_quantizer(resolve_recipe("nvfp4"))  # a tensor scale per tile
    assert flash._accumulate_in_dot(nvfp4_p, per_tile=False, fp8=False) == dict(
        ACC_DOT=True, ACC_UNITS=True
    )
    assert flash._accumulate_in_dot(nvfp4_p, per_tile=True, fp8=False) == {}
    # a fixed row reference may leave a whole row below 2^-120, where units would lose bits
    assert flash._accumulate_in_dot(nvfp4_p, per_tile=False, fp8=False, fixed=True) == {}
