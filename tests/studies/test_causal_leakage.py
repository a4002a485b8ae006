"""Study causal-leakage: its smoke preset runs, exact attention and fixed-scale FP8 leak
nothing bit for bit, the leakage fix removes what V's blocks leak into O, a rerun repeats
exactly, saved activations are read, and bad settings are refused before running."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from fp4lab.analysis import save_inputs, synthetic_inputs
from fp4lab.studies import load_study, run_study

STUDY = load_study("causal-leakage").module
TINY = ["seq=96", "heads=1", "head_dim=32", "positions=2", "profile_distances=8",
        "recipes=exact,fa4fp4_causal_mxfp4pv"]


def _summary(out) -> pd.DataFrame:
    return STUDY.summarize(pd.read_parquet(out / "metrics.parquet")).set_index(
        ["recipe", "leakage_fix", "tensor"]).sort_index()


def test_smoke_writes_every_file_with_finite_numbers(causal_leakage_smoke):
    out = causal_leakage_smoke
    for name in ("metrics.parquet", "profile.parquet", "report.md", "figures/leak_profile.png"):
        assert (out / name).is_file(), name
    metrics = pd.read_parquet(out / "metrics.parquet")
    for column in ("changed", "rel_change", "own_error", "reach"):
        assert metrics[column].map(math.isfinite).all(), column
    config = STUDY.PRESETS["smoke"]
    assert len(metrics) == len(STUDY.cells(config)) * config.positions * 2  # o and dq


def test_exact_and_fixed_scale_fp8_leak_nothing_and_the_fix_clears_o(causal_leakage_smoke):
    table = _summary(causal_leakage_smoke)
    for recipe in ("exact", "fa4fp4_causal"):  # no scale spans tokens: not one bit moves
        assert (table.loc[recipe, "changed"] == 0).all(), recipe
    mx = table.loc["fa4fp4_causal_mxfp4pv"]
    assert mx.loc[(False, "o"), "changed"] > 0  # V's 32-token blocks carry the future
    assert mx.loc[(False, "o"), "reach"] < 32
    assert mx.loc[(True, "o"), "changed"] == 0  # the fix: diagonal blocks unquantized
    assert "Check: exact attention leaks nothing, bit for bit (pass)" in (
        causal_leakage_smoke / "report.md").read_text()


def test_rerun_with_the_same_seed_gives_identical_metrics(tmp_path):
    first = run_study("causal-leakage", "smoke", TINY, out=tmp_path / "a", quiet=True)
    again = run_study("causal-leakage", "smoke", TINY, out=tmp_path / "b", quiet=True)
    for table in ("metrics", "profile"):
        pd.testing.assert_frame_equal(pd.read_parquet(first / f"{table}.parquet"),
                                      pd.read_parquet(again / f"{table}.parquet"))


def test_saved_activations_are_read_and_recorded(tmp_path):
    x = synthetic_inputs(batch=1, heads=1, seq=80, head_dim=32, seed=5)
    path = save_inputs(tmp_path / "acts.safetensors", x.q, x.k, x.v)  # no dO: one is drawn
    out = run_study("causal-leakage", "smoke", [*TINY, f"inputs={path}"], out=tmp_path / "a",
                    quiet=True)
    config = json.loads((out / "config.json").read_text())["config"]
    assert config["inputs_sha256"] and config["inputs"] == str(path.resolve())
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert metrics["position"].max() < 80 and "activations read from" in (
        out / "report.md").read_text()


@pytest.mark.parametrize(
    "entry, words",
    [("recipes=exact,nope", "unknown name 'nope'"), ("perturb_scale=1", "perturb_scale must"),
     ("positions=0", "positions must be >= 1"), ("positions=300", "positions must be below"),
     ("inputs_sha256=abc", "inputs_sha256 is the hash of an inputs file")],
    ids=["recipe", "scale", "no-positions", "too-many", "stray-hash"],
)
def test_bad_set_values_fail_before_anything_runs(tmp_path, entry, words):
    with pytest.raises(ValueError, match=words):
        run_study("causal-leakage", "smoke", [entry], out=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists()
