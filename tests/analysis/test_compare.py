"""compare: errors against a float64 reference that is itself checked against SDPA."""

import math

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from fp4lab.analysis.compare import TENSORS, compare, error_metrics, exact_reference, saturation
from fp4lab.analysis.inputs import synthetic_inputs
from fp4lab.recipes import Trace

OPTS = dict(block_m=32, block_n=32)


@pytest.fixture(scope="module")
def x():
    return synthetic_inputs(batch=1, heads=2, kv_heads=1, seq=80, head_dim=32, seed=0)


def sdpa_reference(q, k, v, do, causal):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return (o, *torch.autograd.grad(o, (q, k, v), do.double()))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_reference_is_float64_sdpa(x, causal):
    ours = exact_reference(x.q, x.k, x.v, x.do, causal=causal, **OPTS)
    theirs = sdpa_reference(x.q, x.k, x.v, x.do, causal)
    for name, a, b in zip(TENSORS, ours, theirs, strict=True):
        assert a.dtype == torch.float64
        assert (a - b).abs().max() <= 1e-10 * b.abs().max(), name


def test_exact_recipe_in_float32_is_within_float32_rounding(x):
    """Exact attention in float32 against float64: errors of float32 rounding, no more."""
    c = compare(x.q, x.k, x.v, x.do, "exact", causal=True, **OPTS)
    assert list(c.errors["tensor"]) == list(TENSORS)
    assert (c.errors["rel_l2"] < 1e-5).all() and (c.errors["rel_l2"] > 0).all()
    assert (c.errors["cosine"] > 1 - 1e-9).all() and (c.errors["nan"] == 0).all()


def test_exact_recipe_in_float64_is_exact(x):
    c = compare(*(t.double() for t in (x.q, x.k, x.v, x.do)), "exact", **OPTS)
    assert (c.errors["rel_l2"] < 1e-12).all()


def test_quantized_recipe_errors_and_trace(x):
    c = compare(x.q, x.k, x.v, x.do, "fa4fp4_causal", causal=True, **OPTS)
    err = c.errors.set_index("tensor")
    assert (err["rel_l2"] > 1e-3).all() and (err["rel_l2"] < 2).all()
    assert (err["cosine"] < 1).all() and set(c.errors["recipe"]) == {"fa4fp4_causal"}
    frame = c.trace.to_frame()
    assert set(frame["product"]) == {"qk", "pv", "dv", "dp", "dq", "dk", "out"}
    assert c.meta["causal"] and c.meta["block_m"] == 32


def test_errors_are_what_the_recipe_returned():
    """The metrics are of the recipe's own outputs: recompute them by hand."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 1, 64, 32, generator=g) for _ in range(4))
    c = compare(q, k, v, do, "nvfp4", trace=False, **OPTS)
    assert c.trace is None
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    from fp4lab.analysis import attention

    o = attention(qq, kk, vv, "nvfp4", **OPTS)
    o.backward(do)
    ref = exact_reference(q, k, v, do, **OPTS)
    for got, r, (_, row) in zip(
        (o, qq.grad, kk.grad, vv.grad), ref, c.errors.iterrows(), strict=True
    ):
        want = ((got.double() - r).norm() / r.norm()).item()
        assert row["rel_l2"] == pytest.approx(want, rel=1e-12)


def test_stochastic_recipe_needs_and_records_its_seed(x):
    with pytest.raises(ValueError, match="generator"):
        compare(x.q, x.k, x.v, x.do, "croissattn", **OPTS)
    a = compare(x.q, x.k, x.v, x.do, "croissattn", generator=7, trace=False, **OPTS)
    b = compare(x.q, x.k, x.v, x.do, "croissattn", generator=7, trace=False, **OPTS)
    c = compare(x.q, x.k, x.v, x.do, "croissattn", generator=8, trace=False, **OPTS)
    pd.testing.assert_frame_equal(a.errors, b.errors)
    assert not a.errors.equals(c.errors)
    assert a.meta["seed"] == 7


def test_given_trace_is_filled(x):
    trace = Trace()
    c = compare(x.q, x.k, x.v, x.do, "nvfp4", trace=trace, **OPTS)
    assert c.trace is trace and len(trace.calls) == 1


def test_error_metrics_by_hand():
    m = error_metrics(torch.tensor([1.0, 2.0, 2.0]), torch.tensor([1.0, 2.0, 3.0]))
    assert m["rel_l2"] == pytest.approx(1 / math.sqrt(14))
    assert m["cosine"] == pytest.approx(11 / (3 * math.sqrt(14)))
    assert m["rmse"] == pytest.approx(math.sqrt(1 / 3)) and m["max_abs"] == 1.0 and m["nan"] == 0
    assert error_metrics(torch.zeros(2), torch.zeros(2))["rel_l2"] == 0.0
    assert error_metrics(torch.ones(2), torch.zeros(2))["rel_l2"] == math.inf
    nan = error_metrics(torch.tensor([float("nan"), 1.0]), torch.ones(2))
    assert nan["nan"] == 1 and math.isnan(nan["rel_l2"])
    both = error_metrics(torch.tensor([float("nan"), 1.0]), torch.tensor([float("nan"), 1.0]))
    assert math.isnan(both["rel_l2"]) and both["nan"] == 1


def test_saturation_lists_every_operand_and_the_lost_mass(x):
    c = compare(x.q, x.k, x.v, x.do, "fa4fp4_causal_mxfp4pv", causal=True, **OPTS)
    sat = c.saturation()
    assert list(zip(sat["product"], sat["operand"], strict=True)) == [
        ("qk", "q"),
        ("qk", "k"),
        ("pv", "p"),
        ("pv", "v"),
        ("dv", "p"),
        ("dv", "do"),
        ("dp", "do"),
        ("dp", "v"),
        ("dq", "ds"),
        ("dq", "k"),
        ("dk", "ds"),
        ("dk", "q"),
    ]
    frame = c.trace.to_frame()
    pv = frame[frame["product"] == "pv"]
    want = pv.groupby(["batch", "head", "q_tile"])["p_mass_lost"].sum().mean()
    got = sat.set_index(["product", "operand"]).loc[("pv", "p"), "p_mass_lost"]
    assert got == pytest.approx(want) and 0 < got < 1
    assert sat.set_index(["product", "operand"]).loc[("pv", "p"), "flushed"] == pytest.approx(
        pv["a_flushed"].mean()
    )
    assert math.isnan(sat.set_index(["product", "operand"]).loc[("qk", "q"), "p_mass_lost"])


def test_saturation_of_several_recipes_keeps_their_order(x):
    frames = [
        compare(x.q, x.k, x.v, x.do, r, **OPTS).trace.to_frame() for r in ("nvfp4", "fa4fp4_causal")
    ]
    sat = saturation(pd.concat(frames, ignore_index=True))
    assert list(dict.fromkeys(sat["recipe"])) == ["nvfp4", "fa4fp4_causal"] and len(sat) == 24


def test_bad_arguments_are_named(x):
    with pytest.raises(ValueError, match="do must be"):
        compare(x.q, x.k, x.v, x.do[..., :3], "exact")
    with pytest.raises(TypeError, match="trace must be"):
        compare(x.q, x.k, x.v, x.do, "exact", trace="yes")
    with pytest.raises(ValueError, match="recipe"):
        compare(x.q, x.k, x.v, x.do, "no_such_recipe")
    with pytest.raises(ValueError, match="trace=False"):
        compare(x.q, x.k, x.v, x.do, "exact", trace=False, **OPTS).saturation()
