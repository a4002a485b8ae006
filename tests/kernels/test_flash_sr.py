"""Stochastic rounding in the Triton backend against the simulation path, under Triton's
interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) and compiled
on a GPU.

What is bit for bit. Both paths draw from the one position-keyed generator of
`fp4lab.formats.streams`: each pass takes its key from the call's generator (the forward,
then the backward), each operand's stream is keyed by (pass key, stream id), each element's
uniform is the Philox4x32-10 word at its (column // 4, row, head, batch) counter. Whole-tensor
operands (Q, K, V, dO) round with those uniforms in the fused quantizer, so their codes and
scales are the simulation's bit for bit; P and dS round in registers with the same words
(`fp4lab.kernels.random.tile_words`), so a tile quantized from the same values gives the
simulation's P^ / dS^ bit for bit (tested on the quantizer alone). Inside attention the
values P and dS are rebuilt from fp32 sums ordered differently from the simulation's, so an
element within ~1e-7 of a rounding boundary can round the other way, as with rounding to
nearest: the gradients meet within the budget of tests/kernels/test_flash_bwd.py (1e-3
relative L2), and the tests check that this budget separates a seed from another seed and
from the recipe rounded to nearest (a kernel that drew other bits would fail).
"""

import dataclasses
import zlib

import pandas as pd
import pytest
import torch

import fp4lab
from fp4lab.formats import NVFP4, NVFP4_SR, Rounding
from fp4lab.formats.streams import stream_key, tensor_uniforms, uniforms
from fp4lab.recipes import resolve_recipe

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fp4lab.kernels import backend, flash, flash_bwd  # noqa: E402
from fp4lab.kernels.random import tile_words  # noqa: E402

from .helpers import DEVICE, GRADS, inputs, rel, rel_but_rows, run  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning",
    "ignore:overflow:RuntimeWarning",
)  # fmt: skip

BUDGET = 1e-3  # tests/kernels/test_flash_bwd.py's: summation order only
# Rows of a gradient left out of its budget: where the bf16 output O of the two paths differs
# by one ulp (a 1e-7 difference of fp32 sums crossing a bf16 rounding boundary, a few rows
# per call), D = rowsum(dO * O) differs by ~2^-9 relative, and so does that row's dS: an
# element of it whose uniform lies that close to its fraction rounds the other way, a jump of
# one grid step of NVFP4 (1/6 of its block's maximum) in one term of a key's dK. Measured
# (croissattn per head, causal, seed 173, under the interpreter): dK 1.7e-2 relative from
# one key row, 2e-7 without it; the same recipe's other seeds 1e-4 and 0. Rounding to nearest
# flips the same way near its midpoints, less often at these sizes.
FLIPPED_ROWS = 2
BACKWARD_FIELDS = ("dv_p", "dv_do", "dp_do", "dp_v", "dq_ds", "dq_k", "dk_ds", "dk_q")
SR_BITS_8 = dataclasses.replace(NVFP4_SR, name="nvfp4_sr8", sr_bits=8)


def _variant(name, **fields):
    return dataclasses.replace(resolve_recipe(name), name=f"{name}_sr_test", **fields)


# The recipes with stochastic rounding the kernels run: CroissAttn (its eight backward
# operands), and variants that round P in the forward (and so in the straight-through and
# forward-exact backwards), dS alone, with 8 random bits, or per-head tensor scales.
SR_RECIPES = {
    "croissattn": resolve_recipe("croissattn"),
    "croissattn p_sr": _variant("croissattn", p=NVFP4_SR),
    "nvfp4 ds_sr8": _variant("nvfp4", dq_ds=SR_BITS_8, dk_ds=SR_BITS_8),
    "nvfp4 p_sr straight_through": _variant(
        "nvfp4", p=NVFP4_SR, backward="straight_through", dv_p=None, dp_v=None, dq_k=None,
        dk_q=None,
    ),  # fmt: skip
    "croissattn p_sr forward_exact": _variant("croissattn", p=NVFP4_SR).with_exact_backward(),
    "croissattn per head": _variant("croissattn", tensor_scope="head", p=NVFP4_SR),
}


# -- the words and the quantizers, bit for bit -------------------------------------------------
@triton.jit
def _words_kernel(Out, k0, k1, batch, head, row0, col0, ROWS: tl.constexpr, COLS: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    words = tile_words(k0.to(tl.uint32), k1.to(tl.uint32), batch, head, rows, col0, ROWS, COLS)
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(Out + offs, words.to(tl.int64))


@pytest.mark.parametrize("at", [(0, 0, 0, 0), (1, 3, 40, 96), (2, 0, 7, 4)])
def test_tile_words_are_the_streams_uniforms(at):
    batch, head, row0, col0 = at
    key = stream_key(0x0123456789ABCDEF, 8)
    words = torch.zeros(16, 32, dtype=torch.int64, device=DEVICE)
    _words_kernel[(1,)](words, *flash.sr_key_words(key, True, "key"), batch, head, row0, col0,
                        ROWS=16, COLS=32)  # fmt: skip
    rows, cols = torch.arange(row0, row0 + 16).view(16, 1), torch.arange(col0, col0 + 32)
    want = uniforms(key, torch.tensor(batch), torch.tensor(head), rows, cols.view(1, 32))
    assert torch.equal(words.cpu().double() * 2.0**-32, want)


@triton.jit
def _sr_tile_kernel(
    X, Values, Factor, k0, k1, zero, ROWS: tl.constexpr, COLS: tl.constexpr,
    MODE: tl.constexpr, LIFT: tl.constexpr, EQ_LO: tl.constexpr, EQ_HI: tl.constexpr,
    E_UNIT: tl.constexpr, E_MAX: tl.constexpr, SQ_LO: tl.constexpr, SQ_HI: tl.constexpr,
    S_UNIT: tl.constexpr, S_MAX: tl.constexpr, E_LO: tl.constexpr, E_HI: tl.constexpr,
    QBLOCK: tl.constexpr, RULE: tl.constexpr, ARITH: tl.constexpr, TENSOR: tl.constexpr,
    EMAX_E: tl.constexpr, LOG2_ME: tl.constexpr, TRANS: tl.constexpr, SPLIT: tl.constexpr,
    SR: tl.constexpr, SR_BITS: tl.constexpr, HAD: tl.constexpr, INV_C: tl.constexpr,
):  # fmt: skip
    # a signed tile (dS) of batch 0, head 0, rows 0.., columns 0..: its words, then quantized
    tl.static_assert(not HAD, "rotated tiles: tests/kernels/test_flash_eden.py")
    offs = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    x = tl.load(X + offs)
    words = tile_words(k0.to(tl.uint32), k1.to(tl.uint32), zero, zero, tl.arange(0, ROWS), 0,
                       ROWS, COLS)  # fmt: skip
    values, factor = flash_bwd._quantize_tile(
        x, x, words, ROWS, COLS, True, MODE, LIFT, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI,
        S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E, LOG2_ME, TRANS, SR,
        SR_BITS,
    )  # fmt: skip
    tl.store(Values + offs, values)
    tl.store(Factor + tl.arange(0, 1), tl.full([1], factor, tl.float32))


def _stripped(constants: dict) -> dict:
    return {name.removeprefix("T_"): value for name, value in constants.items()}


@pytest.mark.parametrize("spec", [NVFP4_SR, SR_BITS_8], ids=["nvfp4_sr", "sr_bits8"])
@pytest.mark.parametrize("axis", [-1, -2], ids=["along-rows", "along-columns"])
def test_a_tile_rounded_in_registers_is_the_reference_bit_for_bit(spec, axis):
    # signed values over 2^-20 .. 2^3 and exact zeros, lift 256, blocks along either axis,
    # against the simulation's own per-tile quantizer with the same stream's uniforms
    from fp4lab.analysis.quantizers import quantize_operand

    g = torch.Generator().manual_seed(zlib.crc32(spec.name.encode()) + axis)
    x = torch.randn(32, 64, generator=g) * torch.exp2(-torch.randint(0, 20, (32, 64), generator=g))
    x[3] = 0.0
    key = stream_key(12345, 10)
    tq = flash_bwd.TileQuantizer.of(spec, 256.0, "dk_ds", along_keys=axis == -1)
    assert tq.pq.SR
    values, factor = torch.empty_like(x).to(DEVICE), torch.empty(1, device=DEVICE)
    _sr_tile_kernel[(1,)](x.to(DEVICE), values, factor, *flash.sr_key_words(key, True, "key"), 0,
                          ROWS=32, COLS=64,
                          **_stripped(tq.constants("T", keys_last=True)))  # fmt: skip
    noise = uniforms(key, torch.tensor(0), torch.tensor(0), torch.arange(32).view(32, 1),
                     torch.arange(64).view(1, 64))  # fmt: skip
    want = quantize_operand(x, spec, axis=axis, per_tile=True, lift=256.0, noise=noise).values
    got = values.cpu() * factor.cpu()
    ulps = (got.view(torch.int32) - want.view(torch.int32)).abs().max().item()
    assert ulps <= 1, f"{spec.name}: {ulps} ulps"  # the tensor scale's product, as test_flash_bwd
    assert torch.equal(got == 0, want == 0) and torch.equal(got < 0, want < 0)
    nearest = quantize_operand(x, NVFP4, axis=axis, per_tile=True, lift=256.0).values
    assert (got != nearest).float().mean() > 0.03  # the words decide: elements round up


@pytest.mark.parametrize("field", ["q", "k", "v", "dv_do", "dp_do"])
def test_a_whole_operand_takes_the_simulations_uniforms_bit_for_bit(field):
    # the fused quantizer's codes and scales against fp4lab.formats with the uniforms the
    # simulation's Draws give that operand (its stream, every element's position)
    from fp4lab.analysis.streams import Draws

    recipe = _variant("exact", **{field: NVFP4_SR})
    x = inputs(2, 4, 4, 64, 64, 32, seed=zlib.crc32(field.encode()))[0]
    draws = Draws(torch.Generator().manual_seed(7), 32, 32)
    store, factor = backend._operand(x, recipe, field, 1, draws.key)
    noise = draws.for_operand(field, x.float(), None)
    qt = fp4lab.formats.quantize(x, NVFP4_SR, axis=recipe.block_axis(field), noise=noise)
    want = (qt.element_values() * qt.expanded_scales()).to(store.dtype)
    assert torch.equal(store.cpu(), want.cpu())
    assert torch.all(factor.cpu() == qt.tensor_scale.cpu())
    nearest = fp4lab.formats.quantize(x, NVFP4, axis=recipe.block_axis(field))
    assert not torch.equal(qt.codes, nearest.codes)


# -- attention: kernel against simulation ------------------------------------------------------
@pytest.mark.parametrize("name", SR_RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sr_recipes_are_the_simulations_up_to_summation_order(name, causal):
    # GQA (2 query heads on 1 KV head), a partial last query tile, tiles of 32; the same seed
    recipe = SR_RECIPES[name]
    seed = zlib.crc32(name.encode()) % 1000
    q, k, v, do = inputs(1, 2, 1, 80, 96, 32, seed=seed)
    tiles = dict(block_m=32, block_n=32, causal=causal, generator=seed)
    got = run(q, k, v, do, recipe, **tiles)
    want = run(q, k, v, do, recipe, "reference", **tiles)
    # O within the backward's budget: at these inputs the per-head recipe's round-to-nearest
    # twin (P in NVFP4) is already 3.9e-4 from the simulation (six bf16 one-ulp flips),
    # above test_flash's 2e-4 for its inputs; the stochastic P's outputs lie 2e-9 to 2.5e-4
    assert rel(got["o"], want["o"]) <= BUDGET, f"{name}: O {rel(got['o'], want['o']):.2e}"
    for g in GRADS:
        assert torch.isfinite(got[g].float()).all()
        diff = rel_but_rows(got[g], want[g], FLIPPED_ROWS)
        assert diff <= BUDGET, f"{name}: {g} {rel(got[g], want[g]):.2e}, {diff:.2e} without rows"
    # the budget can fail: another seed, or rounding to nearest, lies beyond it
    other = run(q, k, v, do, recipe, "reference", **{**tiles, "generator": seed + 1})
    moved = max(rel_but_rows(got[g], other[g], FLIPPED_ROWS) for g in GRADS)
    assert moved > 2 * BUDGET, f"{name}: another seed moves the gradients by only {moved:.1e}"
    nearest = dataclasses.replace(
        recipe, name=f"{recipe.name}_nearest",
        **{f: NVFP4 for f in ("p", *BACKWARD_FIELDS)
           if getattr(recipe, f) in (NVFP4_SR, SR_BITS_8)},
    )  # fmt: skip
    assert not nearest.stochastic
    rtn = run(q, k, v, do, nearest, "reference", **{**tiles, "generator": None})
    moved = max(rel_but_rows(got[g], rtn[g], FLIPPED_ROWS) for g in GRADS)
    assert moved > 2 * BUDGET, f"{name}: rounding to nearest moves them by only {moved:.1e}"


def test_the_same_seed_gives_the_same_bits_and_another_seed_others():
    q, k, v, do = inputs(1, 2, 2, 64, 64, 32, seed=21)
    recipe = SR_RECIPES["croissattn p_sr"]
    tiles = dict(block_m=32, block_n=32)
    a, b = (run(q, k, v, do, recipe, generator=5, **tiles) for _ in range(2))
    c = run(q, k, v, do, recipe, generator=torch.Generator().manual_seed(5), **tiles)
    d = run(q, k, v, do, recipe, generator=6, **tiles)
    for name in ("o", *GRADS):
        assert torch.equal(a[name], b[name]) and torch.equal(a[name], c[name])
        assert not torch.equal(a[name], d[name])


def test_a_heads_and_a_batchs_draws_do_not_depend_on_the_others():
    # per-head tensor scales, so that head 0 of batch 0 sees the same inputs alone: every
    # draw is keyed by its position, so its output and gradients are the same bits
    q, k, v, do = inputs(2, 4, 4, 48, 48, 32, seed=22)
    recipe = SR_RECIPES["croissattn per head"]
    tiles = dict(block_m=16, block_n=16, causal=True, generator=9)
    whole = run(q, k, v, do, recipe, **tiles)
    first = run(*(x[:1, :1] for x in (q, k, v, do)), recipe, **tiles)
    for name in ("o", *GRADS):
        assert torch.equal(whole[name][:1, :1], first[name]), name
    shifted = run(*(x[:1, 1:2] for x in (q, k, v, do)), recipe, **tiles)  # head 1 as head 0
    assert not torch.equal(whole["dq"][:1, 1:2], shifted["dq"])  # the head is in the key


# -- what still does not run -------------------------------------------------------------------
@pytest.mark.parametrize(
    "recipe, what",
    [
        (_variant("croissattn_eden", dv_do=NVFP4_SR),
         "dv_p and dv_do with different Hadamard transforms"),
        (_variant("nvfp4", dq_ds=dataclasses.replace(NVFP4_SR, name="sr40", sr_bits=40)),
         "dq_ds: .*sr_bits=40"),
        (_variant("fa4fp4_directp", direct_p_affine=None,
                  p=dataclasses.replace(resolve_recipe("fa4fp4_directp").p, name="directp_sr",
                                        rounding=Rounding.STOCHASTIC)),
         "Direct-P .*rounds stochastically"),
    ],
    ids=["ms-eden-unpaired", "sr-bits-40", "direct-p-sr"],
)  # fmt: skip
def test_what_stochastic_rounding_does_not_run_is_refused_by_name(recipe, what):
    q, k, v, do = inputs(1, 1, 1, 128, 128, 128, seed=4)
    with pytest.raises(NotImplementedError, match=what + ".*use backend='reference'"):
        run(q, k, v, do, recipe, generator=1)


def test_a_stochastic_recipe_without_a_generator_is_refused():
    q, k, v, _ = inputs(1, 1, 1, 32, 32, 32, seed=4)
    with pytest.raises(ValueError, match="generator: recipe 'croissattn' rounds stochastically"):
        fp4lab.attention(q, k, v, "croissattn", backend="triton")


def test_tensor_uniforms_is_what_draws_give_a_whole_operand():
    from fp4lab.analysis.streams import Draws

    draws = Draws(torch.Generator().manual_seed(3), 16, 16)
    x = torch.zeros(2, 3, 5, 6)
    assert torch.equal(draws.for_operand("dk_q", x, None),
                       tensor_uniforms(stream_key(draws.key, 11), x.shape, x.device))  # fmt: skip


def test_gradient_bias_on_the_kernels_batched_is_the_looped_one():
    # three samples of croissattn with a stochastic P, two at a time, on the Triton backend
    # (the GPU's default batches them): stacked samples draw their own bits, so the numbers
    # are those of one sample a call; the kernels' bias lies where the simulation's does
    q, k, v, do = inputs(1, 2, 1, 32, 32, 32, seed=23)
    recipe = SR_RECIPES["croissattn p_sr"]
    run = dict(samples=3, seed=5, reference="forward", block_m=16, block_n=16, causal=True)
    looped = fp4lab.gradient_bias(q, k, v, do, recipe, backend="triton", batch=1, **run)
    batched = fp4lab.gradient_bias(q, k, v, do, recipe, backend="triton", batch=2, **run)
    for frame in ("tensors", "tiles", "convergence"):
        pd.testing.assert_frame_equal(getattr(batched, frame), getattr(looped, frame))
    simulated = fp4lab.gradient_bias(q, k, v, do, recipe, **run)
    # |rel_bias difference| <= ||g_kernel - g_sim|| / ||g|| for both the sample and its
    # reference (Cauchy-Schwarz): twice the gradients' budget
    got, want = looped.tensors["rel_bias"], simulated.tensors["rel_bias"]
    assert ((got - want).abs() <= 2 * BUDGET).all(), (got - want).abs().max()


@pytest.mark.parametrize("backend_name", ["triton", "reference"])
def test_samples_stacked_along_the_batch_draw_as_they_would_alone(backend_name):
    # a list of generators: the i-th draws for the i-th chunk of the batch, as a call on it
    q, k, v, do = inputs(1, 2, 1, 48, 48, 32, seed=24)
    recipe = SR_RECIPES["croissattn p_sr"]
    tiles = dict(block_m=16, block_n=16, causal=True)
    alone = [run(q, k, v, do, recipe, backend_name, generator=s, **tiles) for s in (11, 12, 13)]
    stacked = run(*(x.repeat(3, 1, 1, 1) for x in (q, k, v, do)), recipe, backend_name,
                  generator=[11, 12, 13], **tiles)  # fmt: skip
    for i, one in enumerate(alone):
        for name in ("o", *GRADS):
            assert torch.equal(stacked[name][i : i + 1], one[name]), (i, name)
    with pytest.raises(ValueError, match="2 generators .* batch of 3"):
        run(*(x.repeat(3, 1, 1, 1) for x in (q, k, v, do)), recipe, backend_name,
            generator=[1, 2], **tiles)  # fmt: skip


@pytest.mark.parametrize(
    "key, shape",
    [(12345, (2, 3, 70, 72)), ((7, 2**63 + 5, 99), (6, 2, 33, 64)), (2**64 - 1, (1, 1, 5, 6)),
     ((11, 12), (2, 2, 130, 128))],
    ids=["odd-head-dim", "three-samples", "top-key-tiny", "two-samples-long-rows"],
)  # fmt: skip
def test_the_kernels_whole_operand_uniforms_are_the_streams_bit_for_bit(key, shape):
    # what the Triton backend hands the fused quantizer on a GPU: one kernel in place of the
    # torch reference's passes; every element, head_dims not a multiple of 4 or of the tile,
    # rows past a tile, stacked samples each under its own key with its batch counted from 0
    from fp4lab.kernels.random import stream_uniforms

    got = stream_uniforms(key, shape, DEVICE).cpu()
    want = tensor_uniforms(key, shape, "cpu")
    assert got.dtype == torch.float64 and torch.equal(got, want)
    other = stream_uniforms(key ^ 1 if isinstance(key, int) else (key[0] ^ 1, *key[1:]), shape,
                            DEVICE).cpu()  # fmt: skip
    assert not torch.equal(other, want)  # the key matters (a kernel ignoring it would pass)
    with pytest.raises(ValueError, match="keys: 2 keys do not split a batch of 3"):
        stream_uniforms((1, 2), (3, 1, 4, 4), DEVICE)
