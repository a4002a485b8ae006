"""The Triton backend's trace (`fp4lab.kernels.trace`, the kernels' TRACE flags) against
the simulation's, under Triton's interpreter on the CPU and compiled on a GPU.

Both paths quantize Q, K, V the same way and P with the same arithmetic, so a count (a
fraction of flushed or clipped elements, of blocks whose scale left its range, of NaNs) is
the same number, and a sum (an operand's relative error, the flushed probability mass, the
softmax denominator's, the log-sum-exp's and the output's errors) moves only by the order of
its fp32 additions: at most a few 1e-7 here (observed up to 4e-7), budget 2e-6 absolute plus
1e-5 relative. Under the interpreter the kernel's scores are numpy's fp32 sums and the
simulation's torch's, the same order at these sizes, so no P element rounds the other way.
On a GPU the order differs and a P element within rounding of a boundary of its format may
round the other way; the full-size test budgets that (a few elements per 128 x 128 tile).

One count sits on a boundary by construction: with a per-tile tensor scale (NVFP4's), the
block holding the tile's largest P gets the scale that maps it to E2M1's 6, up to float32
rounding of the scale chain, so whether that one element counts as clipped (scaled above 6)
hangs on the last bit of P, exp2 of log2-unit scores here and exp there. ``a_clipped`` is
budgeted one element of its tile for it.

dS = P (dP - D) is not the same bits on the two paths: dP - D cancels where dP is near D, and
D is a sum of dO O (for attn_qat of dO O', whose P V the kernel takes with P in two bf16
halves, 16 bits, against the simulation's 24), so dS moves by up to ~1e-4 of itself in such
elements, and where that moves a block's amax across a rounding boundary of its scale format,
the block's scale rounds the other way and all its elements are quantized anew. dS's columns
(dq's and dk's a_) are budgeted 1e-4 absolute plus 2e-2 relative for their sums (measured:
attn_qat's bf16 dS, whose error is 1.6e-3, moves by 4e-5; NVFP4's dS by 5e-3 relative in the
one GQA tile where a block scale flipped, 1e-6 elsewhere) and one block (32 elements) of the
tile for their counts (measured: one element).
"""

import dataclasses
import inspect
import os
import zlib

import pandas as pd
import pytest
import torch

import fp4lab
from fp4lab.analysis import attention as reference_attention
from fp4lab.formats import MXFP4
from fp4lab.recipes import STATISTICS, KVOrder, RowReference, Trace, resolve_recipe

pytest.importorskip("triton")

from fp4lab.kernels import flash  # noqa: E402
from fp4lab.kernels.trace import NOT_COMPUTED  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KEY = ["product", "batch", "head", "kv_head", "q_tile", "k_tile"]
COUNTS = ("flushed", "clipped", "scale_underflow", "scale_overflow", "nan")  # and *_nan
ATOL, RTOL = 2e-6, 1e-5
# compiled on a GPU (the small tests too): a P element on a rounding boundary may round the
# other way (scores summed in another order, exp2 against exp), so a count moves by an
# element or two of its tile and a sum by that element's share (measured on the H200,
# 2026-12-02: a_flushed by one element of a 32 x 32 tile, out's row_sum_err by 4e-5 of 1.4e-3)
GPU_ELEMENTS, GPU_ATOL, GPU_RTOL = 2, 1e-4, 1e-3
DS_ATOL, DS_RTOL, DS_ELEMENTS = 1e-4, 2e-2, 32  # dS's columns: see the module docstring
RECIPES = [
    "exact", "nvfp4", "mxfp4", "fa4fp4_causal", "fa4fp4_causal_mxfp4pv",
    "fa4fp4_causal_mxfp4pv_fixed", "attn_qat", "fa3_fp8", "flash_bf16", "sageattn3_paper",
    "attn_qat_kernel",
]  # fmt: skip


def inputs(b, h, hk, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda heads, s: torch.randn(b, heads, s, d, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
    return make(h, sq), make(hk, sk), make(hk, sk)


def traces(q, k, v, recipe, triton_recipe=None, do=None, **options):
    """(reference frame, Triton frame, Triton trace) of one forward, and of its backward
    with output gradient `do` when given."""
    ref, tri = Trace(), Trace()
    for trace, run, r in ((ref, reference_attention, recipe),
                          (tri, _triton, triton_recipe or recipe)):  # fmt: skip
        leaves = [x.clone().requires_grad_(do is not None) for x in (q, k, v)]
        out = run(*leaves, r, trace=trace, **options)
        if do is not None:
            out.backward(do)
    return ref.to_frame(), tri.to_frame(), tri


def _triton(*args, **options):
    return fp4lab.attention(*args, backend="triton", **options)


def visible_pairs(frame, meta) -> pd.Series:
    """The number of (query, key) pairs each row's tile holds (its P's nonzeros)."""
    sq, sk, bm, bn = meta["shape_q"][2], meta["Sk"], meta["block_m"], meta["block_n"]
    causal = meta["causal"]

    def pairs(i, j):
        rows = torch.arange(i * bm, min((i + 1) * bm, sq))[:, None]
        keys = torch.arange(j * bn, min((j + 1) * bn, sk))[None, :]
        return int(((keys <= rows) | (not causal)).sum())

    return frame.apply(lambda row: pairs(row["q_tile"], max(row["k_tile"], 0)), axis=1)


def compare(ref, tri, meta, atol=ATOL, rtol=RTOL, count_atol=0.0, clipped_elements=1) -> None:
    """Assert the Triton frame equals the reference's forward rows: the same rows, counts
    within count_atol (exactly by default; ``a_clipped`` one element more, see the module),
    sums within atol + rtol |ref|, NaN where the reference's is; on failure, the first
    differing tile and both values. `meta`: the call's (tile geometry). On a GPU the
    budgets widen to GPU_ELEMENTS elements a tile and GPU_ATOL + GPU_RTOL |ref|."""
    gpu = DEVICE == "cuda"
    if gpu:
        atol, rtol = max(atol, GPU_ATOL), max(rtol, GPU_RTOL)
    assert sorted(map(tuple, ref[KEY].values)) == sorted(map(tuple, tri[KEY].values))
    both = ref.merge(tri, on=KEY, suffixes=("_ref", "_tri"))
    assert len(both) == len(ref)
    one_element = 1.0 / visible_pairs(both, meta).clip(lower=1) + 1e-12
    cells = pd.DataFrame({name: both["product"] + "." + name for name in STATISTICS})
    not_written = cells.isin(NOT_COMPUTED)  # (rows, statistics)
    for name in STATISTICS:
        missing = not_written[name]
        assert both.loc[missing, f"{name}_tri"].isna().all(), f"{name}: written though listed"
        a, b = both.loc[~missing, f"{name}_ref"], both.loc[~missing, f"{name}_tri"]
        is_count = name.endswith("nan") or name[2:] in COUNTS
        tol = count_atol + 0 * a if is_count else atol + rtol * a.abs()
        if is_count and gpu:
            tol = tol + GPU_ELEMENTS * one_element[~missing]
        if name == "a_clipped":
            tol = tol + clipped_elements * one_element[~missing]
        ds = both.loc[~missing, "product"].isin(["dq", "dk"]) & name.startswith("a_")
        if is_count:  # dS's elements near a rounding boundary: a few per tile
            tol = tol + ds * DS_ELEMENTS * one_element[~missing]
        else:
            tol = tol + ds * (DS_ATOL + DS_RTOL * a.abs())
        bad = (a.isna() != b.isna()) | ((a - b).abs() > tol)
        if bad.any():
            row = both.loc[~missing][bad].iloc[0]
            raise AssertionError(
                f"{name}: {int(bad.sum())} tiles differ; first {row[KEY].to_dict()}: "
                f"reference {row[f'{name}_ref']!r}, triton {row[f'{name}_tri']!r}"
            )


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_kernel_trace_is_the_simulations(recipe, causal):
    # ragged on both sides (80 queries, 72 keys in tiles of 32)
    q, k, v = inputs(1, 2, 2, 80, 72, 32, seed=zlib.crc32(recipe.encode()) % 1000)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(q)
    ref, tri, trace = traces(q, k, v, recipe, do=do, causal=causal, block_m=32, block_n=32)
    # two-level P scales each tile row so its maximum maps to M_e M_s: that element sits on
    # the clip boundary to the last bit in both paths, so up to one per row may count apart
    clipped = 32 if resolve_recipe(recipe).p_quant.value == "row_scaled" else 1
    compare(ref, tri, trace.calls[0].meta, clipped_elements=clipped)
    assert set(tri["product"]) == {"qk", "pv", "dv", "dp", "dq", "dk", "out"}
    assert trace.calls[0].meta["backend"] == "triton"
    assert set(trace.calls[0].meta["not_computed"]) == set(NOT_COMPUTED)


def test_p_blocks_whose_scale_rounds_to_zero_count_as_flushed_in_both_paths():
    # NVFP4 P/V on the FP8 route (P up to 256 under the lazy maximum, its tensor scale per
    # tile): with scores spread over many decades most of P's blocks get an E4M3 scale of 0
    # and store zeros. Both paths count them flushed and not clipped (NVFP4's clamped
    # reciprocal would make every element of such a block look saturated)
    fp8 = resolve_recipe("fa4fp4_causal")
    recipe = dataclasses.replace(fp8, name="fp8_route_nvfp4pv", p="nvfp4", v="nvfp4")
    q, k, v = inputs(1, 2, 2, 64, 64, 32, seed=21)
    q, k = q * 4, k * 4  # logits of tens to hundreds
    ref, tri, trace = traces(q, k, v, recipe, causal=True, block_m=32, block_n=32)
    compare(ref, tri, trace.calls[0].meta)
    pv = ref[ref["product"] == "pv"]
    assert pv["a_scale_underflow"].mean() > 0.2 and pv["a_flushed"].mean() > 0.2
    assert pv["a_clipped"].max() < 0.05


@pytest.mark.parametrize("recipe", ["nvfp4", "fa3_fp8"])
def test_a_forward_only_trace_has_the_forward_rows(recipe):
    q, k, v = inputs(1, 2, 1, 64, 96, 32, seed=8)
    ref, tri, trace = traces(q, k, v, recipe, causal=True, block_m=32, block_n=32)
    assert set(tri["product"]) == {"qk", "pv", "out"}
    compare(ref, tri, trace.calls[0].meta)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_tile_scope_trace_takes_each_tiles_tensor_scale(causal):
    # attn_qat_kernel (tensor_scope=tile), forward and backward: Q's, K's and V's columns
    # from operands quantized with a tensor scale per tile, as the simulation's; dV's P the
    # backward's two-level P, its counts on r P; two-level P's row maximum on the clip
    # boundary in both passes (up to one per row)
    q, k, v = inputs(1, 4, 2, 80, 72, 32, seed=12)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(q)
    ref, tri, trace = traces(q, k, v, "attn_qat_kernel", do=do, causal=causal, block_m=32,
                             block_n=16)  # fmt: skip
    assert set(tri["product"]) == {"qk", "pv", "dv", "dp", "dq", "dk", "out"}
    compare(ref, tri, trace.calls[0].meta, clipped_elements=32)


@pytest.mark.parametrize("recipe", ["nvfp4", "fa4fp4_causal"])
def test_grouped_query_heads_and_longer_rows(recipe):
    q, k, v = inputs(1, 4, 2, 160, 130, 32, seed=7)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(q)
    ref, tri, trace = traces(q, k, v, recipe, do=do, causal=True, block_m=32, block_n=32)
    compare(ref, tri, trace.calls[0].meta)
    assert set(tri["kv_head"]) == {0, 1} and set(tri["head"]) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    "change",
    [dict(kv_order=KVOrder.REVERSE), dict(row_reference=RowReference.LAZY_MAX,
                                          lazy_rescale_log2=8.0)],
    ids=["reverse", "lazy_max"],
)  # fmt: skip
def test_key_order_and_lazy_rescaling(change):
    # tiles visited last to first, and FA4's lazy maximum: P of a tile against another m
    recipe = dataclasses.replace(resolve_recipe("nvfp4"), name="nvfp4_variant", **change)
    q, k, v = inputs(1, 2, 1, 80, 72, 32, seed=3)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(q)
    ref, tri, trace = traces(q, k, v, recipe, do=do, causal=True, block_m=32, block_n=32)
    compare(ref, tri, trace.calls[0].meta)


@pytest.mark.parametrize("backward", ["flash", "straight_through"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_smooth_q(backward, causal):
    # SageAttention3's split of Q: Q's columns are those of Q - M against its quantized form,
    # qk's prod_err that of (Q - M)^ K^^T + M K^T against Q K^T, and a straight-through dK
    # takes (Q - M)^ + M; on Q offset per channel, where Q and Q - M differ the most
    recipe = dataclasses.replace(
        resolve_recipe("sageattn3"), name="sageattn3_variant", backward=backward,
        backward_p="quantized_qk" if backward == "straight_through" else "unquantized_qk",
    )  # fmt: skip
    q, k, v = inputs(1, 4, 2, 80, 72, 64, seed=5)
    q = (q.float() + 2.0 * torch.randn(64, generator=torch.Generator().manual_seed(2)).to(q.device))
    q = q.to(torch.bfloat16)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(q)
    ref, tri, trace = traces(q, k, v, recipe, do=do, causal=causal, block_m=32, block_n=32)
    compare(ref, tri, trace.calls[0].meta)


def test_p_statistics_are_not_trivially_zero():
    # the comparison means something only where P loses something: nvfp4 flushes and clips
    q, k, v = inputs(1, 2, 2, 96, 96, 32, seed=3)
    _, tri, _ = traces(q, k, v, "nvfp4", block_m=32, block_n=32)
    pv = tri[tri["product"] == "pv"]
    assert (pv["a_flushed"] > 0).all() and (pv["a_clipped"] > 0).any()
    assert (pv["p_mass_lost"] > 0).all() and (pv["a_err"] > 0.01).all()


def test_a_different_p_quantizer_is_caught():
    # the same Q, K, V quantizers with MXFP4 P instead of NVFP4 P on the Triton side: the P
    # columns must differ, so the comparison above can fail
    nvfp4 = resolve_recipe("nvfp4")
    other = dataclasses.replace(nvfp4, name="nvfp4", p=MXFP4)
    q, k, v = inputs(1, 2, 2, 64, 64, 32, seed=5)
    ref, tri, trace = traces(q, k, v, nvfp4, triton_recipe=other, block_m=32, block_n=32)
    with pytest.raises(AssertionError, match="a_err|a_flushed|a_clipped|p_mass_lost"):
        compare(ref, tri, trace.calls[0].meta)


def test_a_different_ds_quantizer_is_caught():
    # MXFP4 dS in dQ on the Triton side: dq's dS columns must differ, the others not
    nvfp4 = resolve_recipe("nvfp4")
    other = dataclasses.replace(nvfp4, name="nvfp4", dq_ds=MXFP4)
    q, k, v = inputs(1, 2, 2, 64, 64, 32, seed=6)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(11)).to(q)
    ref, tri, trace = traces(q, k, v, nvfp4, triton_recipe=other, do=do, block_m=32, block_n=32)
    with pytest.raises(AssertionError, match=r"a_\w+: \d+ tiles differ; first \{'product': 'dq'"):
        compare(ref, tri, trace.calls[0].meta)
    keep = lambda f: f[f["product"] != "dq"]  # noqa: E731
    compare(keep(ref), keep(tri), trace.calls[0].meta)


def test_the_uninstrumented_call_compiles_trace_off(monkeypatch):
    # TRACE defaults to False in the kernel's signature and only a traced call sets it
    params = inspect.signature(flash._attn_fwd.fn).parameters
    defaults = {name: p.default for name, p in params.items()}
    assert defaults["TRACE"] is False
    launched = []
    kernel = flash._attn_fwd

    class Spy:
        fn = kernel.fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs.get("TRACE", defaults["TRACE"]))
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(flash, "_attn_fwd", Spy())
    monkeypatch.setenv("FP4LAB_DIRECT_LAUNCH", "0")  # every launch through kernel[grid]
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=1)
    fp4lab.attention(q, k, v, "nvfp4", backend="triton", block_m=32, block_n=32)
    assert launched == [False]
    fp4lab.attention(q, k, v, "nvfp4", backend="triton", trace=Trace(), block_m=32, block_n=32)
    assert launched[1:] == [True, False]  # the instrumented call, then exact attention's


@pytest.mark.parametrize("kernel", ["_attn_bwd_dkdv", "_attn_bwd_dq"])
def test_the_uninstrumented_backward_compiles_trace_off(monkeypatch, kernel):
    from fp4lab.kernels import flash_bwd

    params = inspect.signature(getattr(flash_bwd, kernel).fn).parameters
    assert params["TRACE"].default is False
    launched = []
    original = getattr(flash_bwd, kernel)

    class Spy:
        fn = original.fn

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs.get("TRACE", False))
                return original[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(flash_bwd, kernel, Spy())
    monkeypatch.setenv("FP4LAB_DIRECT_LAUNCH", "0")  # every launch through kernel[grid]
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=1)
    for trace in (None, Trace()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        fp4lab.attention(*leaves, "nvfp4", backend="triton", trace=trace).float().sum().backward()
    assert launched == [False, True]


def test_the_trace_changes_no_output_and_no_gradient():
    q, k, v = inputs(1, 2, 1, 64, 64, 32, seed=2)
    tiles = dict(block_m=32, block_n=32, causal=True)
    grads = []
    for trace in (None, Trace()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fp4lab.attention(*leaves, "nvfp4", backend="triton", trace=trace, **tiles)
        out.float().square().sum().backward()
        grads.append([out] + [x.grad for x in leaves])
    for plain, traced in zip(*grads, strict=True):
        assert torch.equal(plain, traced)


def test_an_explicit_reference_precision_is_refused():
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=4)
    with pytest.raises(NotImplementedError, match="reference_dtype"):
        fp4lab.attention(
            q, k, v, "nvfp4", backend="triton", trace=Trace(reference_dtype=torch.float64)
        )
    with pytest.raises(TypeError, match="trace must be an fp4lab Trace"):
        fp4lab.attention(q, k, v, "nvfp4", backend="triton", trace={})


@pytest.mark.skipif(DEVICE != "cuda", reason="full size on the GPU only")
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4", "fa4fp4_causal", "fa3_fp8"])
def test_full_size_trace_on_the_gpu(recipe):
    # fresh inputs each run (the seed is in the message); default tiles (128 x 128). The GPU's
    # score sums differ from torch's in order, so a P element on a rounding boundary may round
    # the other way: a count moves by a few per 16384-element tile (budget 1e-3 of a tile's
    # nonzeros). Exact attention on the kernel multiplies P in 16 bits (two bf16 halves):
    # out_err moves by ~1e-5; FP8 P V on the tensor cores accumulates in reduced precision
    # (tests/kernels/test_flash.py measured 5e-4): budget 1e-3 there. dS's columns take the
    # module's budgets on top.
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (
        torch.randn(1, 4, 1024, 128, generator=g).to(DEVICE, torch.bfloat16) for _ in "qkvd"
    )
    ref, tri, trace = traces(q, k, v, recipe, do=do, causal=True)
    try:
        atol = 1e-3 if recipe == "fa3_fp8" else 1e-4
        compare(ref, tri, trace.calls[0].meta, atol=atol, rtol=1e-3, count_atol=1e-3)
    except AssertionError as error:
        raise AssertionError(f"seed {seed}: {error}") from None


def test_a_trace_of_a_stochastic_recipe_is_refused():
    # the host computes the operands' columns without the kernels' draws: refused, not guessed
    q, k, v = inputs(1, 2, 2, 64, 64, 32, seed=6)
    with pytest.raises(NotImplementedError, match="trace: recipe 'croissattn' rounds"):
        fp4lab.attention(q, k, v, "croissattn", backend="triton", trace=Trace(), generator=0,
                         causal=True)  # fmt: skip


def test_both_passes_lay_out_their_shared_statistics_alike():
    # _stat_columns stacks the first nine of either layout
    from fp4lab.kernels.flash_bwd import BACKWARD_STATS

    assert flash.FORWARD_STATS[:9] == BACKWARD_STATS[:9]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_masked_tiles_come_from_tile_bounds_not_a_seq_by_seq_mask(causal):
    # the product errors find the tiles with masked entries, and their masks, from the tiles'
    # bounds (no (Sq, Sk) mask, which at 131072 tokens would hold 2^34 entries)
    from fp4lab.kernels.trace import _masked_tiles, _tile_masks

    for sq, sk, bm, bn in [(80, 72, 32, 32), (1, 129, 16, 64), (130, 32, 32, 16), (64, 64, 64, 64)]:
        n_q, n_k = -(-sq // bm), -(-sk // bn)
        rows, keys = torch.arange(n_q * bm)[:, None], torch.arange(n_k * bn)[None, :]
        allowed = (rows < sq) & (keys < sk) & ((keys <= rows) | (not causal))
        tiles = allowed.reshape(n_q, bm, n_k, bn).transpose(1, 2)
        assert torch.equal(_masked_tiles(n_q, n_k, sq, sk, bm, bn, causal),
                           ~tiles.all((-2, -1)))
        i, j = torch.cartesian_prod(torch.arange(n_q), torch.arange(n_k)).unbind(1)
        assert torch.equal(_tile_masks(i, j, sq, sk, bm, bn, causal), tiles[i, j])


@pytest.mark.parametrize("where", ["cpu", "cuda-pinned", "cuda-pageable"])
def test_tables_cross_to_the_host_in_one_buffer(where, monkeypatch):
    """`_host_all`'s packing (`_packed`): tables of several dtypes and odd sizes side by side
    in one byte buffer come back bit for bit, in their own dtypes and shapes (NaN and -inf
    included); from CUDA through page-locked memory, or pageable above `PINNED_MAX`."""
    from fp4lab.kernels import trace as kernel_trace

    if where != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if where == "cuda-pageable":
        monkeypatch.setattr(kernel_trace, "PINNED_MAX", 0)
    device = torch.device("cpu" if where == "cpu" else "cuda")
    g = torch.Generator().manual_seed(3)
    on = lambda t: t.to(device)  # noqa: E731  (slices are taken on the device)
    tables = {
        "f32": on(torch.randn(3, 5, 7, generator=g)),  # 105 floats: 420 bytes, padded to 424
        "f64": on(torch.randn(2, 3, generator=g, dtype=torch.float64)),
        "strided": on(torch.randn(4, 6, generator=g))[:, ::2],
        "odd": on(torch.tensor([float("nan"), -float("inf"), 1e-45])),
        "count": on(torch.arange(5, dtype=torch.int32)),
        # one element of a strided table: contiguous to torch, yet stride 11 when flattened
        "single": on(torch.randn(1, 1, 1, 1, 11, generator=g, dtype=torch.float64))[..., 3],
    }
    back = kernel_trace._packed(tables, device)
    tables = {name: t.cpu() for name, t in tables.items()}
    assert all(t.device.type == "cpu" for t in back.values())
    if where == "cuda-pinned":
        assert all(t.is_pinned() for t in back.values())

    def bits(x):
        return torch.empty(x.numel(), dtype=x.dtype).copy_(x.reshape(-1)).view(torch.uint8)

    assert list(back) == list(tables)
    for name, t in tables.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(bits(back[name]), bits(t)), name


def test_the_profiled_trace_steps_exist():
    """`benchmarks/profile_gpu.py` wraps the trace's steps by name: each must resolve (a
    renamed function would otherwise fail only on the GPU machine), and be put back."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_gpu.py"
    spec = importlib.util.spec_from_file_location("profile_gpu", path)
    profile_gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_gpu)
    import fp4lab.kernels.trace as kernel_trace

    before = kernel_trace.record_forward
    with profile_gpu.ranges():
        assert kernel_trace.record_forward is not before
    assert kernel_trace.record_forward is before
