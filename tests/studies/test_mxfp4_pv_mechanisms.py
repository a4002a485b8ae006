"""Study mxfp4-pv-mechanisms: its smoke preset runs and writes the ranking (also as a table),
contrasts that cannot reach dV leave it exactly, a rerun repeats exactly, the CLI prints the
ranking, and bad settings are refused before anything runs."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import fp4lab
from fp4lab.studies import load_study, run_study

STUDY = load_study("mxfp4-pv-mechanisms").module
ROOT = Path(__file__).resolve().parents[2]
TINY = ["seq=128", "heads=1", "mechanisms=p_rule_route,row_sum,v_leakage", "leak_positions=1"]


def test_smoke_writes_the_ranking_and_every_file(mxfp4_pv_mechanisms_smoke):
    out = mxfp4_pv_mechanisms_smoke
    for name in ("metrics.parquet", "ranking.parquet", "ranking.csv", "recipes.parquet",
                 "trace.parquet", "report.md", "figures/mechanism_effects.png"):
        assert (out / name).is_file(), name
    metrics = pd.read_parquet(out / "metrics.parquet")
    for column in ("effect", "bias", "contribution", "variant_error", "control_error"):
        assert metrics[column].map(math.isfinite).all(), column
    ranking = pd.read_csv(out / "ranking.csv")
    assert sorted(ranking["mechanism"]) == sorted(STUDY.MECHANISMS)
    assert ranking["rank"].min() == 1 and ranking["rank"].is_monotonic_increasing
    keys = ["mechanism", "rank", "effect_dq", "effect_dk", "effect_dv", "must_test"]
    pd.testing.assert_frame_equal(ranking[keys], pd.read_parquet(out / "ranking.parquet")[keys],
                                  check_dtype=False)
    report = (out / "report.md").read_text()
    assert "Named for the training study" in report and "| rank | mechanism |" in report


def test_forward_only_mechanisms_leave_dv_exactly(mxfp4_pv_mechanisms_smoke):
    """dV = P^T dO reads P rebuilt from the log-sum-exp: V's format and P's rule with the
    unquantized denominator do not move it; the represented denominator does."""
    metrics = pd.read_parquet(mxfp4_pv_mechanisms_smoke / "metrics.parquet")
    dv = metrics[(metrics["tensor"] == "dv") & (metrics["context"] == "fp8_route")]
    dv = dv.set_index("mechanism")["effect"]
    for name in ("p_rule_route", "p_rule_ocp_floor", "v_rule_route", "v_view_rounding"):
        assert dv[name] == 0, name
    assert dv["row_sum"] > 0


def test_the_gap_is_the_mxfp4_route_against_the_fp8_route(mxfp4_pv_mechanisms_smoke):
    recipes = pd.read_parquet(mxfp4_pv_mechanisms_smoke / "metrics.parquet")
    gap = recipes[recipes["mechanism"] == STUDY.GAP]
    assert set(gap["variant"]) == {"fa4fp4_causal_mxfp4pv"}
    assert set(gap["control"]) == {"fa4fp4_causal"}
    assert (gap.set_index("tensor").loc[["dq", "dk", "dv"], "effect"] > 0).all()


def test_rerun_with_the_same_seed_gives_identical_metrics(tmp_path):
    first = run_study("mxfp4-pv-mechanisms", "smoke", TINY, out=tmp_path / "a", quiet=True)
    again = run_study("mxfp4-pv-mechanisms", "smoke", TINY, out=tmp_path / "b", quiet=True)
    for table in ("metrics", "ranking", "recipes"):
        pd.testing.assert_frame_equal(pd.read_parquet(first / f"{table}.parquet"),
                                      pd.read_parquet(again / f"{table}.parquet"))


def test_two_gloo_ranks_give_the_tables_of_one_process(tmp_path):
    """Each rank runs its own recipes (cached per process); the trace's owner is the cell."""
    one = run_study("mxfp4-pv-mechanisms", "smoke", TINY, out=tmp_path / "one", quiet=True)
    script = tmp_path / "launch.py"
    script.write_text(
        "import sys\nfrom fp4lab.studies import run_study\n"
        "run_study('mxfp4-pv-mechanisms', 'smoke', sys.argv[2:], out=sys.argv[1], quiet=True)\n"
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script),
         str(tmp_path / "two"), *TINY],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    for table in ("metrics", "ranking", "recipes", "trace"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "two" / f"{table}.parquet"),
                                      pd.read_parquet(one / f"{table}.parquet"))


def test_the_cli_prints_the_ranking(tmp_path, capsys):
    from fp4lab.cli import main

    assert main(["study", "run", "mxfp4-pv-mechanisms", *sum((["--set", s] for s in TINY), []),
                 "--out", str(tmp_path / "run"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "What the numbers show:" in printed and "| rank | mechanism |" in printed
    assert "Named for the training study" in printed and f"Wrote {tmp_path / 'run'}" in printed


@pytest.mark.parametrize(
    "entry, words",
    [("mechanisms=p_rule_route,nope", "mechanisms: 'nope'"),
     ("contexts=mxfp4_route", "contexts must hold fp8_route"),
     ("mxfp4_route=fa4fp4_causal", "fa4fp4_causal's p must be a 1-D block format"),
     ("fp8_route=fa4fp4_directp", "must be causal routes"),
     ("must_test_share=0", "must_test_share must be a positive"),
     ("leak_positions=0", "leak_positions must be >= 1"),
     ("do_scale=3", "do_scale must be a positive power of two"),
     ("do_scale=-2", "do_scale must be a positive power of two")],
    ids=["mechanism", "context", "route", "non-causal", "share", "positions", "do_scale",
         "negative do_scale"],
)
def test_bad_set_values_fail_before_anything_runs(tmp_path, entry, words):
    with pytest.raises(ValueError, match=words):
        run_study("mxfp4-pv-mechanisms", "smoke", [entry], out=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists()


def test_the_gap_says_why_it_is_undefined_where_the_fp8_route_flushed_everything():
    # an FP8 route whose dQ and dK are zero (every element flushed): the effects are NaN
    effect = {"o": 0.1, "dq": math.nan, "dk": math.nan, "dv": 0.3}
    rows = [{"mechanism": STUDY.GAP, "tensor": t, "effect": e,
             "control_error": 1.0 if math.isnan(e) else 0.1,
             "variant_error": 1.0 if math.isnan(e) else 0.2} for t, e in effect.items()]
    line = STUDY._gap_line(pd.DataFrame(rows))
    assert "Undefined for dq, dk: the FP8 route's dq, dk is zero" in line
    assert "not finite" not in line
    rows = [{**r, "effect": 0.2} for r in rows]
    assert "Undefined" not in STUDY._gap_line(pd.DataFrame(rows))


def test_the_gap_says_when_the_mxfp4_route_is_what_is_not_finite():
    # the MXFP4 route overflowing on the inputs (its o, dq, dk NaN): a different reason
    effect = {"o": math.nan, "dq": math.nan, "dk": math.nan, "dv": 0.5}
    rows = [{"mechanism": STUDY.GAP, "tensor": t, "effect": e, "control_error": 0.3,
             "variant_error": e} for t, e in effect.items()]
    line = STUDY._gap_line(pd.DataFrame(rows))
    assert "Undefined for o, dq, dk: the MXFP4 route's o, dq, dk is not finite" in line
    assert "flushed" not in line


def _grads(recipe, tensors):
    q, k, v, do = tensors
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fp4lab.attention(*leaves, recipe, causal=True).backward(do)
    return [t.grad for t in leaves]


def test_do_scale_reaches_the_quantizers_and_nothing_else():
    # the study's inputs with dO times 2^13: Q, K, V unchanged, dO exactly 2^13 times; exact
    # attention's gradients then scale by exactly 2^13 (relative distances do not move),
    # while the FP8 route's fixed-scale E5M2(4 dO), which flushes a trained model's dO
    # (up to 1e-6 here: 4 dO below half of 2^-16) whole, no longer does
    config = dataclasses.replace(STUDY.PRESETS["smoke"], heads=1, seq=128, head_dim=64)
    scaled = dataclasses.replace(config, do_scale=2.0**13)
    plain, big = STUDY._inputs(config, 0, "cpu"), STUDY._inputs(scaled, 0, "cpu")
    for a, b in zip(plain[:3], big[:3], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(big[3], plain[3] * 2.0**13)
    small = [*plain[:3], plain[3] / plain[3].abs().max() * 1e-6]
    small_scaled = [*plain[:3], small[3] * 2.0**13]
    for want, got in zip(_grads("exact", [t.double() for t in small]),
                         _grads("exact", [t.double() for t in small_scaled]), strict=True):
        assert torch.equal(got, want * 2.0**13)
    _, _, dv = _grads("fa4fp4_causal", small)
    _, _, dv_scaled = _grads("fa4fp4_causal", small_scaled)
    assert not dv.any()  # every element of dO flushed
    assert dv_scaled.any()


def test_a_non_finite_reference_gives_nan_statistics_not_an_error():
    # a contrast whose reference gradient is NaN in every tile (the leakage fix's on inputs
    # whose rows pass float32, seen on trained activations): NaN, where the t statistic over
    # no tiles once divided by zero
    ref = torch.full((1, 2, 256, 8), math.nan)
    out = STUDY._decompose(torch.ones_like(ref), ref, tile_rows=128)
    assert set(out) == {"effect", "bias", "scatter", "tile_t"}
    assert all(math.isnan(v) for v in out.values())
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 2, 256, 8, generator=g)
    ref[:, 0] = math.nan  # one head's tiles non-finite: the others still give a t statistic
    d = 0.1 * ref.nan_to_num() + 0.01 * torch.randn(ref.shape, generator=g)
    assert math.isfinite(STUDY._decompose(d, ref.nan_to_num(), tile_rows=128)["tile_t"])
