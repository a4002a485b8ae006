"""Trace: the frame's schema and each statistic against a dense count on known inputs."""

import math

import pandas as pd
import pytest
import torch

from fp4lab.analysis import attention
from fp4lab.formats import FP8_E4M3FN, fake_quantize, round_to_format
from fp4lab.recipes import OPERAND_COLUMNS, OUT_COLUMNS, PRODUCT_COLUMNS, AttentionRecipe, Trace
from tests.analysis.test_flash import causal_mask, qkv, rand

ID_COLUMNS = [
    "call",
    "recipe",
    "product",
    "a_name",
    "b_name",
    "batch",
    "head",
    "kv_head",
    "q_tile",
    "k_tile",
]
STAT_COLUMNS = (
    [f"{s}_{c}" for s in "ab" for c in OPERAND_COLUMNS] + list(PRODUCT_COLUMNS) + list(OUT_COLUMNS)
)


def traced(q, k, v, recipe="exact", do=None, **kw):
    trace = Trace()
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = attention(q, k, v, recipe, trace=trace, **kw)
    if do is not None:
        out.backward(do)
    return trace.to_frame(), out.detach()


def rows(frame, product, **where):
    sel = frame[frame["product"] == product]
    for key, value in where.items():
        sel = sel[sel[key] == value]
    return sel


def test_frame_schema_rows_and_heads():
    q, k, v = qkv(2, 4, 2, 40, 50, 32)
    frame, _ = traced(q, k, v, "nvfp4", block_m=16, block_n=32)
    assert list(frame.columns) == ID_COLUMNS + STAT_COLUMNS
    counts = frame["product"].value_counts().to_dict()
    assert counts == {"qk": 2 * 4 * 3 * 2, "pv": 2 * 4 * 3 * 2, "out": 2 * 4 * 3}
    assert (frame["head"] // 2 == frame["kv_head"]).all()
    assert set(rows(frame, "pv")[["a_name", "b_name"]].itertuples(index=False)) == {("p", "v")}
    assert (rows(frame, "out")["k_tile"] == -1).all()
    frame, _ = traced(q, k, v, "nvfp4", do=rand(2, 4, 40, 32), block_m=16, block_n=32)
    assert set(frame["product"]) == {"qk", "pv", "dv", "dp", "dq", "dk", "out"}
    names = {
        p: tuple(rows(frame, p).iloc[0][["a_name", "b_name"]]) for p in ("dv", "dp", "dq", "dk")
    }
    assert names == {"dv": ("p", "do"), "dp": ("do", "v"), "dq": ("ds", "k"), "dk": ("ds", "q")}


def test_causal_trace_omits_the_tiles_the_mask_skips():
    q, k, v = qkv(1, 1, 1, 64, 64, 32)
    frame, _ = traced(q, k, v, causal=True, do=rand(1, 1, 64, 32), block_m=16, block_n=16)
    for product in ("qk", "pv", "dv", "dp", "dq", "dk"):
        tiles = rows(frame, product)
        assert len(tiles) == 10 and (tiles["k_tile"] <= tiles["q_tile"]).all()


def test_calls_are_numbered_and_empty_trace_has_the_columns():
    assert list(Trace().to_frame().columns) == ID_COLUMNS + STAT_COLUMNS
    trace = Trace()
    q, k, v = qkv(1, 1, 1, 8, 8, 32)
    attention(q, k, v, trace=trace)
    attention(q, k, v, "nvfp4", trace=trace)
    frame = trace.to_frame()
    assert sorted(set(zip(frame["call"], frame["recipe"], strict=True))) == [
        (0, "exact"),
        (1, "nvfp4"),
    ]
    with pytest.raises(ValueError, match="reference_dtype"):
        Trace(reference_dtype=torch.float16)


def test_exact_recipe_reports_no_quantization_error():
    q, k, v = qkv(1, 2, 1, 40, 40, 32)
    frame, _ = traced(q, k, v, causal=True, do=rand(1, 2, 40, 32), block_m=16, block_n=16)
    tiles = frame[frame["product"] != "out"]
    for column in ("a_err", "b_err", "a_flushed", "a_clipped", "b_clipped", "a_nan", "prod_nan"):
        assert (tiles[column].fillna(0) == 0).all(), column
    assert tiles["a_scale_underflow"].isna().all()
    assert tiles["prod_err"].max() < 1e-13
    assert (rows(frame, "pv")["p_mass_lost"] == 0).all()
    out = rows(frame, "out")
    assert (
        (out["row_sum_err"] == 0).all()
        and out["lse_err"].max() < 1e-13
        and out["out_err"].max() < 1e-13
    )


def test_operand_error_is_the_relative_frobenius_error_of_fake_quantize():
    q, k, v = qkv(1, 2, 2, 40, 24, 32)
    frame, _ = traced(q, k, v, AttentionRecipe(name="q_mx", q="mxfp4"), block_m=16, block_n=32)
    q_hat = fake_quantize(q, "mxfp4")
    for (h, i), row in rows(frame, "qk").set_index(["head", "q_tile"]).iterrows():
        tile = slice(16 * i, 16 * (i + 1))
        want = (q_hat[0, h, tile] - q[0, h, tile]).norm() / q[0, h, tile].norm()
        assert row["a_err"] == pytest.approx(want.item(), rel=1e-12) and row["b_err"] == 0


def dense_p(q, k, causal=False):
    """P = exp(S - rowmax) on one key tile, and softmax(S)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~causal_mask(*s.shape[-2:]), -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    return p, p / p.sum(-1, keepdim=True)


def test_flushed_fraction_and_lost_probability_mass_of_e4m3_p():
    # P cast to E4M3 without a scale flushes every P below 2^-10.
    q, k, v = qkv(1, 1, 1, 32, 40, 32, seed=3)
    q = q * 3.0  # peaked rows: many small probabilities
    recipe = AttentionRecipe(name="p_e4m3", p=FP8_E4M3FN)
    frame, _ = traced(q, k, v, recipe, block_m=16, block_n=64)
    p, a = dense_p(q, k)
    flushed = (p > 0) & (round_to_format(p, FP8_E4M3FN) == 0)
    assert flushed.any()
    for i, row in rows(frame, "pv").set_index("q_tile").iterrows():
        tile = slice(16 * i, 16 * (i + 1))
        assert row["a_flushed"] == pytest.approx(
            flushed[0, 0, tile].double().mean().item(), rel=1e-12
        )
        mass = torch.where(flushed, a, 0.0)[0, 0, tile].sum(-1).mean()
        # the forward normalises by its own lse: sum of the unquantized P (same as softmax)
        assert row["p_mass_lost"] == pytest.approx(mass.item(), rel=1e-9)


def test_row_sum_output_and_product_errors_against_dense_values():
    q, k, v = qkv(1, 1, 1, 32, 40, 32, seed=4)
    recipe = AttentionRecipe(name="p_v_mx", p="mxfp4", v="mxfp4")
    frame, out = traced(q, k, v, recipe, block_m=16, block_n=64)
    p, _ = dense_p(q, k)
    p_hat, v_hat = fake_quantize(p, "mxfp4"), fake_quantize(v, "mxfp4", axis=-2)
    exact = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(32), -1) @ v
    for i in range(2):
        tile = slice(16 * i, 16 * (i + 1))
        o_row = rows(frame, "out", q_tile=i).iloc[0]
        want = (p_hat[0, 0, tile].sum(-1) / p[0, 0, tile].sum(-1) - 1).mean()
        assert o_row["row_sum_err"] == pytest.approx(want.item(), rel=1e-9)
        want = (out[0, 0, tile] - exact[0, 0, tile]).norm() / exact[0, 0, tile].norm()
        assert o_row["out_err"] == pytest.approx(want.item(), rel=1e-9)
        pv = rows(frame, "pv", q_tile=i).iloc[0]
        ref = p[0, 0, tile] @ v[0, 0]
        want = (p_hat[0, 0, tile] @ v_hat[0, 0] - ref).norm() / ref.norm()
        assert pv["prod_err"] == pytest.approx(want.item(), rel=1e-9)


def test_clipped_counts_the_saturation_of_ocp_floor_scales():
    # MX's floor rule: a block amax of 1.99 gets scale 2^-2 and lands on 7.96 > 6: clipped.
    q = rand(1, 1, 16, 32, seed=5).clamp(-1, 1)
    q[..., 0] = 1.99
    k, v = rand(1, 1, 16, 32, seed=6), rand(1, 1, 16, 32, seed=7)
    frame, _ = traced(q, k, v, AttentionRecipe(name="q_mx", q="mxfp4"), block_m=16, block_n=32)
    row = rows(frame, "qk").iloc[0]
    assert row["a_clipped"] == pytest.approx(1 / 32)
    assert row["b_clipped"] == 0


@pytest.mark.parametrize("spec", ["nvfp4", "nvfp4_ue5m3"])
def test_a_block_whose_scale_rounds_to_zero_is_flushed_not_clipped(spec):
    # a tensor-scaled format whose E4M3 (or UE5M3) block scale of the small rows rounds to 0:
    # those blocks store zeros (flushed), however large their scaled elements look in the
    # format's arithmetic (NVFP4's clamped reciprocal makes them float32's largest); the
    # large rows' blocks keep their own saturation count
    q = rand(1, 1, 16, 32, seed=5)
    q[..., 8:, :] *= 2.0**-40  # their block amax ~2^-40 of the tensor's: scale 0 in E4M3
    k, v = rand(1, 1, 16, 32, seed=6), rand(1, 1, 16, 32, seed=7)
    frame, _ = traced(q, k, v, AttentionRecipe(name="q_t", q=spec), block_m=16, block_n=32)
    row = rows(frame, "qk").iloc[0]
    q_hat = fake_quantize(q, spec)
    assert bool((q_hat[..., 8:, :] == 0).all())  # the small rows are stored as zeros
    assert row["a_flushed"] >= 0.5
    big = fake_quantize(q[..., :8, :], spec)  # the large rows alone: the same blocks
    alone, _ = traced(q[..., :8, :], k, v, AttentionRecipe(name="q_t", q=spec), block_m=8,
                      block_n=32)
    assert torch.equal(q_hat[..., :8, :], big)
    assert row["a_clipped"] == pytest.approx(rows(alone, "qk").iloc[0]["a_clipped"] / 2)


@pytest.mark.parametrize(
    "magnitude, column", [(1e-5, "a_scale_underflow"), (1e4, "a_scale_overflow")]
)
def test_block_scales_out_of_the_scale_formats_range(magnitude, column):
    q, k, v = (x * s for x, s in zip(qkv(1, 1, 1, 16, 16, 32), (magnitude, 1.0, 1.0), strict=True))
    one_level, _ = traced(
        q, k, v, AttentionRecipe(name="q_1l", q="nvfp4_1level"), block_m=16, block_n=16
    )
    assert rows(one_level, "qk")[column].iloc[0] == 1.0
    two_level, _ = traced(q, k, v, AttentionRecipe(name="q_2l", q="nvfp4"), block_m=16, block_n=16)
    assert rows(two_level, "qk")[["a_scale_underflow", "a_scale_overflow"]].iloc[0].tolist() == [
        0.0,
        0.0,
    ]


def test_nan_is_counted_in_its_tile():
    q, k, v = qkv(1, 1, 1, 32, 32, 32, seed=8)
    q[0, 0, 20, 5] = math.nan
    frame, _ = traced(q, k, v, AttentionRecipe(name="q_mx", q="mxfp4"), block_m=16, block_n=16)
    qk = rows(frame, "qk").set_index(["q_tile", "k_tile"])
    assert (qk.loc[1, "a_nan"] == 32).all() and (qk.loc[0, "a_nan"] == 0).all()  # the whole block
    assert (qk.loc[1, "prod_nan"] == 16).all() and (qk.loc[0, "prod_nan"] == 0).all()
    out = rows(frame, "out").set_index("q_tile")
    assert out.loc[1, "out_nan"] == 32 and out.loc[0, "out_nan"] == 0


def test_backward_statistics_of_an_exact_run_and_of_quantized_ds():
    q, k, v = qkv(1, 2, 2, 24, 40, 32, seed=9)
    do = rand(1, 2, 24, 32, seed=10)
    frame, _ = traced(q, k, v, do=do, block_m=16, block_n=16)
    backward = frame[frame["product"].isin(["dv", "dp", "dq", "dk"])]
    assert backward["prod_err"].max() < 1e-13 and (backward["a_err"] == 0).all()
    frame, _ = traced(
        q, k, v, AttentionRecipe(name="ds_mx", dq_ds="mxfp4"), do=do, block_m=16, block_n=32
    )
    assert (rows(frame, "dq")["a_err"] > 0).all() and (rows(frame, "dk")["a_err"] == 0).all()
    assert (rows(frame, "dq")["prod_err"] > 0).all() and rows(frame, "dk")["prod_err"].max() < 1e-13


def test_generator_seed_and_call_metadata_are_recorded():
    trace = Trace(reference_dtype=torch.float32)
    q, k, v = qkv(1, 2, 1, 8, 8, 32)
    attention(
        q, k, v, "croissattn", trace=trace, generator=1234, causal=True, block_m=32, block_n=32
    )
    meta = trace.calls[0].meta
    assert meta["seed"] == 1234 and meta["causal"] and meta["block_m"] == 32
    assert meta["reference_dtype"] is torch.float32
    assert isinstance(trace.to_frame(), pd.DataFrame)


@pytest.mark.parametrize("recipe", ["exact", "nvfp4", "fa4fp4_causal_mxfp4pv", "attn_qat"])
def test_the_trace_only_reads(recipe):
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 1, 40, 56, 32, dtype=torch.float32, seed=11))
    do = rand(1, 2, 40, 32, dtype=torch.float32, seed=12)
    runs = []
    for trace in (None, Trace()):
        out = attention(q, k, v, recipe, causal=True, trace=trace, block_m=32, block_n=32)
        runs.append((out, torch.autograd.grad(out, (q, k, v), do)))
    (a, ga), (b, gb) = runs
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb, strict=True))


def test_float32_reference_agrees_with_float64_where_errors_are_large():
    q, k, v = qkv(1, 2, 2, 40, 40, 32, seed=13)
    do = rand(1, 2, 40, 32, seed=14)
    frames = {}
    for dtype in (torch.float64, torch.float32):
        trace = Trace(reference_dtype=dtype)
        q_, k_, v_ = (x.detach().float().requires_grad_() for x in (q, k, v))
        attention(q_, k_, v_, "nvfp4", trace=trace, block_m=16, block_n=16).backward(do.float())
        frames[dtype] = trace.to_frame()
    a, b = frames[torch.float64], frames[torch.float32]
    assert list(a["product"]) == list(b["product"])
    tiles = a["product"] != "out"
    assert (a["prod_err"][tiles] - b["prod_err"][tiles]).abs().max() < 1e-5
    assert (a["prod_err"][tiles] > 1e-3).all()


def test_reference_dtype_defaults_to_the_working_precision():
    for dtype, expected in (
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
    ):
        trace = Trace()
        q, k, v = qkv(1, 1, 1, 8, 8, 32, dtype=dtype)
        attention(q, k, v, "nvfp4", trace=trace)
        assert trace.calls[0].meta["reference_dtype"] is expected
    with pytest.raises(ValueError, match="reference_dtype"):
        Trace(reference_dtype=torch.bfloat16)


def test_gram_errors_of_qk_and_dp_equal_the_direct_comparison():
    # Unmasked blocks take qk's and dp's prod_err from Gram matrices; an all-True boolean
    # mask forces the direct comparison on the same values.
    q, k, v = qkv(1, 2, 1, 64, 96, 32, seed=21)
    do = rand(1, 2, 64, 32, seed=22)
    frames = []
    for mask in (None, torch.ones(64, 96, dtype=torch.bool)):
        trace = Trace(reference_dtype=torch.float64)
        q_, k_, v_ = (x.detach().float().requires_grad_() for x in (q, k, v))
        attention(
            q_, k_, v_, "nvfp4", trace=trace, attn_mask=mask, block_m=32, block_n=32
        ).backward(do.float())
        frames.append(trace.to_frame())
    gram, direct = frames
    for product in ("qk", "dp"):
        a, b = (
            rows(gram, product)["prod_err"].to_numpy(),
            rows(direct, product)["prod_err"].to_numpy(),
        )
        assert (b > 1e-2).all() and abs(a / b - 1).max() < 1e-5
    for product in ("pv", "dv", "dq", "dk"):
        assert rows(gram, product)["prod_err"].equals(rows(direct, product)["prod_err"])
