"""gradient_bias: Quartet II's unbiasedness test finds bias where there is some, and only there.

Tolerances: for an unbiased recipe the per-tensor t-statistics follow Student's t with N - 1
degrees of freedom (N draws), so |t| stays below t_{1 - a/2}(N - 1) with probability 1 - a;
with a = 1e-6 spread over the three tensors (Bonferroni) a pass is all but certain, and
with the fixed seeds below the test is deterministic anyway. The per-tile bound spreads the
same a over all tiles.
"""

import dataclasses

import pandas as pd
import pytest
import torch
from scipy import stats

import fp4lab.formats as F
from fp4lab.analysis.bias import derive_seeds, gradient_bias
from fp4lab.analysis.compare import compare, exact_reference, forward_backward
from fp4lab.analysis.inputs import synthetic_inputs
from fp4lab.recipes import AttentionRecipe

N = 32
ALPHA = 1e-6
OPTS = dict(block_m=32, block_n=32)
BACKWARD = ("dv_p", "dv_do", "dp_do", "dp_v", "dq_ds", "dq_k", "dk_ds", "dk_q")
# MXFP4 with the scale rounded up (no element clips, E8M0 never underflows here) and exact
# stochastic rounding: each backward operand is an unbiased estimate of itself.
SR = dataclasses.replace(F.get("mxfp4_rceil"), name="test_mxfp4_rceil_sr", rounding="stochastic")


def backward_recipe(name, **overrides):
    """Exact forward; every backward operand in SR MXFP4 unless overridden."""
    return AttentionRecipe(name=name, **{f: overrides.get(f, SR) for f in BACKWARD})


UNBIASED = backward_recipe("test_sr_backward")
# Hardware SR with 1 random bit: P(up) = floor(2 frac) / 2, biased toward zero.
SR_1BIT = backward_recipe(
    "test_sr1_backward", **dict.fromkeys(BACKWARD, dataclasses.replace(SR, sr_bits=1))
)
# One operand truncated: dV = P^T dO with dO rounded toward zero shrinks dV.
TRUNCATED_DO = backward_recipe("test_tz_do", dv_do=dataclasses.replace(SR, rounding="toward_zero"))


@pytest.fixture(scope="module")
def x():
    """float64 inputs, so that the working precision's own error is negligible."""
    return synthetic_inputs(
        batch=1, heads=2, seq=128, head_dim=32, seed=0, dtype="float64", do_scale=1.0
    )


def bound(tests: int) -> float:
    return stats.t.isf(ALPHA / 2 / tests, df=N - 1)


@pytest.fixture(scope="module")
def unbiased(x):
    return gradient_bias(x.q, x.k, x.v, x.do, UNBIASED, samples=N, seed=0, **OPTS)


def test_unbiased_recipe_stays_within_the_t_bound(unbiased):
    t = unbiased.tensors.set_index("tensor")
    assert list(t.index) == ["dq", "dk", "dv"] and (t["samples"] == N).all()
    assert (t["t"].abs() < bound(3)).all(), t
    assert (t["se"] > 0).all() and (t["p_value"] > ALPHA).all()
    # the N-sample average's error is the noise's, not more
    assert (t["rel_err_mean"] < 2 * t["rel_noise"]).all(), t


def test_unbiased_recipe_per_tile(unbiased):
    tiles = unbiased.tiles
    assert len(tiles) == 3 * 2 * 4  # (dq, dk, dv) x heads x (128 / 32) tiles
    assert tiles["t"].notna().all()
    assert (tiles["t"].abs() < bound(len(tiles))).all()


def test_unbiased_error_falls_as_one_over_n(unbiased):
    curve = unbiased.convergence
    assert list(curve.loc[curve["tensor"] == "dq", "n"]) == [1, 2, 4, 8, 16, 32]
    last = curve[curve["n"] == N].set_index("tensor")
    first = curve[curve["n"] == 1].set_index("tensor")
    assert (last["rel_mse"] < 2 * last["noise_only"]).all()
    assert (last["rel_mse"] < first["rel_mse"] / 8).all()  # 1/32 expected; no floor


def test_one_bit_stochastic_rounding_is_detected(x):
    res = gradient_bias(x.q, x.k, x.v, x.do, SR_1BIT, samples=N, seed=0, **OPTS)
    t = res.tensors.set_index("tensor")
    assert (t["t"] < -bound(3)).all(), t  # shrinks every gradient
    assert (t["rel_err_mean"] > 2 * t["rel_noise"]).all()
    last = res.convergence[res.convergence["n"] == N].set_index("tensor")
    assert (last["rel_mse"] > 4 * last["noise_only"]).all()  # flattens at the bias


def test_a_truncated_operand_is_detected_where_it_acts(x):
    res = gradient_bias(x.q, x.k, x.v, x.do, TRUNCATED_DO, samples=N, seed=0, **OPTS)
    t = res.tensors.set_index("tensor")["t"]
    assert t["dv"] < -bound(3)  # dV = P^T trunc(dO)
    assert abs(t["dq"]) < bound(3) and abs(t["dk"]) < bound(3)  # dO toward zero only in dV
    dv_tiles = res.tiles[res.tiles["tensor"] == "dv"]
    assert (dv_tiles["rel_bias"] < 0).all()


def test_same_seed_same_result_and_recorded_seeds_are_used(x):
    a = gradient_bias(x.q, x.k, x.v, x.do, UNBIASED, samples=3, seed=11, **OPTS)
    b = gradient_bias(x.q, x.k, x.v, x.do, UNBIASED, samples=3, seed=11, **OPTS)
    c = gradient_bias(x.q, x.k, x.v, x.do, UNBIASED, samples=3, seed=12, **OPTS)
    for name in ("tensors", "tiles", "convergence"):
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name))
    assert not a.tensors.equals(c.tensors)
    assert a.seeds == derive_seeds(11, 3) and a.seed == 11 and len(set(a.seeds)) == 3
    # rerun the recorded draws by hand: the mean gradient's error is the reported one
    exact = exact_reference(x.q, x.k, x.v, x.do, **OPTS)
    draws = [
        forward_backward(x.q, x.k, x.v, x.do, UNBIASED, trace=None, generator=s, **OPTS)
        for s in a.seeds
    ]
    for i, name in enumerate(("dq", "dk", "dv"), start=1):
        mean = sum(d[i] for d in draws) / 3
        want = ((mean - exact[i]).norm() / exact[i].norm()).item()
        got = a.tensors.set_index("tensor").loc[name, "rel_err_mean"]
        assert got == pytest.approx(want, rel=1e-10)


def test_deterministic_recipe_bias_is_its_error(x):
    res = gradient_bias(x.q, x.k, x.v, x.do, "fa4fp4_causal", samples=N, causal=True, **OPTS)
    assert not res.stochastic and res.samples == 1 and len(res.seeds) == 1
    assert "deterministic" in res.note and "error itself" in res.note
    t = res.tensors.set_index("tensor")
    assert (t["se"] == 0).all() and t["t"].abs().eq(float("inf")).all()
    errors = compare(x.q, x.k, x.v, x.do, "fa4fp4_causal", causal=True, trace=False, **OPTS).errors
    for name, row in errors.set_index("tensor").iloc[1:].iterrows():
        assert t.loc[name, "rel_err_mean"] == pytest.approx(row["rel_l2"], rel=1e-9)


def test_bad_arguments_are_named(x):
    with pytest.raises(ValueError, match="samples must be an int of at least 2 for stochastic"):
        gradient_bias(x.q, x.k, x.v, x.do, UNBIASED, samples=1, **OPTS)
    with pytest.raises(ValueError, match="at least 1 for deterministic recipe 'exact'"):
        gradient_bias(x.q, x.k, x.v, x.do, "exact", samples=0, **OPTS)
    with pytest.raises(ValueError, match="seed"):
        gradient_bias(x.q, x.k, x.v, x.do, UNBIASED, samples=2, seed=-1, **OPTS)
    with pytest.raises(ValueError, match="recipe"):
        gradient_bias(x.q, x.k, x.v, x.do, "no_such_recipe")


def test_seeds_are_independent_of_the_count():
    """The first draws of a longer run are the draws of a shorter one."""
    assert derive_seeds(3, 8)[:4] == derive_seeds(3, 4)
    assert derive_seeds(3, 4) != derive_seeds(4, 4)
    assert torch.tensor(derive_seeds(0, 100)).unique().numel() == 100


@pytest.mark.parametrize("reference", ["exact", "forward"])
def test_batched_samples_give_the_looped_numbers(x, reference):
    # five samples three at a time (a remainder of two) against one at a time, on the CPU
    # reference: each stacked sample draws its own bits, so every statistic is the same;
    # the recipe rounds P in the forward too, so the "forward" reference is per sample
    recipe = dataclasses.replace(UNBIASED, name="test_sr_p", p=SR)
    q, k, v, do = (t[:, :, :64] for t in (x.q, x.k, x.v, x.do))
    run = dict(samples=5, seed=3, reference=reference, **OPTS)
    looped = gradient_bias(q, k, v, do, recipe, **run)
    batched = gradient_bias(q, k, v, do, recipe, batch=3, **run)
    for frame in ("tensors", "tiles", "convergence"):
        pd.testing.assert_frame_equal(getattr(batched, frame), getattr(looped, frame))
    other = gradient_bias(q, k, v, do, recipe, **{**run, "seed": 4})
    assert not other.tensors["rel_bias"].equals(looped.tensors["rel_bias"])
    with pytest.raises(ValueError, match="batch must be a positive int"):
        gradient_bias(q, k, v, do, recipe, batch=0, **run)
