"""Study scale-range: its smoke preset runs (P and dS in every block size and scale format,
read from the trace), repeats exactly, reads saved activations as the synthetic model it
was saved from, and refuses bad settings before running."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from fp4lab.analysis import save_inputs, synthetic_inputs
from fp4lab.studies import load_study, run_study

STUDY = load_study("scale-range").module
TINY = ["seq=128", "heads=1", "head_dim=32", "block_sizes=16,32", "scales=e8m0_ocp_floor,ue4m3"]


def test_smoke_writes_every_file_with_finite_numbers(scale_range_smoke):
    out = scale_range_smoke
    for name in ("metrics.parquet", "metrics.csv", "report.md", "figures/rel_l2.png",
                 "figures/scale_underflow.png"):
        assert (out / name).is_file(), name
    metrics = pd.read_parquet(out / "metrics.parquet")
    config = STUDY.PRESETS["smoke"]
    assert len(metrics) == len(config.block_sizes) * len(config.scales) * 4  # four operands
    for column in ("rel_l2", "tile_err", "flushed", "clipped", "prod_err"):
        assert metrics[column].map(math.isfinite).all(), column
    assert set(metrics["operand"]) == {"p", "p_dv", "ds_dq", "ds_dk"}


def test_e8m0_scales_reach_every_block_and_ue4m3_alone_does_not(scale_range_smoke):
    """E8M0 spans 2^-127 .. 2^127: no block of P or dS leaves it; UE4M3's 2^-9 is left."""
    metrics = pd.read_parquet(scale_range_smoke / "metrics.parquet")
    e8 = metrics[metrics["scale"].str.startswith("e8m0_")]
    assert (e8["scale_underflow"] == 0).all() and (e8["scale_overflow"] == 0).all()
    assert (metrics[metrics["scale"] == "ue4m3"]["scale_underflow"] > 0).all()


def test_rerun_with_the_same_seed_gives_identical_metrics(tmp_path):
    first = run_study("scale-range", "smoke", TINY, out=tmp_path / "a", quiet=True)
    again = run_study("scale-range", "smoke", TINY, out=tmp_path / "b", quiet=True)
    pd.testing.assert_frame_equal(pd.read_parquet(first / "metrics.parquet"),
                                  pd.read_parquet(again / "metrics.parquet"))


def test_saved_activations_give_the_numbers_of_the_model_they_came_from(tmp_path):
    x = synthetic_inputs(batch=1, heads=1, seq=128, head_dim=32, seed=0)
    path = save_inputs(tmp_path / "acts.npz", x.q, x.k, x.v, x.do)
    synthetic = run_study("scale-range", "smoke", TINY, out=tmp_path / "a", quiet=True)
    saved = run_study("scale-range", "smoke", [*TINY, f"inputs={path}"], out=tmp_path / "b",
                      quiet=True)
    pd.testing.assert_frame_equal(pd.read_parquet(synthetic / "metrics.parquet"),
                                  pd.read_parquet(saved / "metrics.parquet"))
    config = json.loads((saved / "config.json").read_text())["config"]
    assert config["inputs"] == str(path.resolve()) and len(config["inputs_sha256"]) == 64
    assert config["inputs_sha256"] in (saved / "report.md").read_text()


@pytest.mark.parametrize(
    "entry, words",
    [("scales=e8m0_floor", "scales: 'e8m0_floor'"), ("block_sizes=48", "block_sizes: 48"),
     ("element=fp4", "unknown name 'fp4'"), ("lifts=0", "lifts must be positive"),
     ("passes=sideways", "passes: 'sideways'"), ("inputs=/no/such.npz", "inputs: no such file")],
    ids=["scale", "block", "element", "lift", "pass", "inputs"],
)
def test_bad_set_values_fail_before_anything_runs(tmp_path, entry, words):
    with pytest.raises(ValueError, match=words):
        run_study("scale-range", "smoke", [entry], out=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists()
