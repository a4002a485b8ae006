"""Study p-operand: its input has the P-Cast model's statistics, its smoke preset reproduces
the FP8 underflow anchor within the stated tolerance, and its runs repeat and split over
ranks exactly."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from fp4lab.formats import FP8_E4M3FN
from fp4lab.studies import load_study, run_study

STUDY = load_study("p-operand").module
ROOT = Path(__file__).resolve().parents[2]
TINY = ["batch=1", "heads=2", "seq=256", "block_m=64", "block_n=64", "deltas=6,9",
        "formats=fp8_e4m3fn,nvfp4_sr,mxfp4", "format_lifts=1", "logit_scales=2",
        "two_level_formats=nvfp4_1level"]


@pytest.fixture
def smoke(p_operand_smoke):
    return p_operand_smoke


def test_smoke_writes_every_file_with_finite_numbers(smoke):
    for name in ("config.json", "environment.json", "metrics.parquet", "metrics.csv",
                 "trace.parquet", "report.md", "figures/sink_flush.png",
                 "figures/sink_flush_log.png", "figures/formats.png", "figures/logit_scale.png"):
        assert (smoke / name).is_file(), name
    metrics = pd.read_parquet(smoke / "metrics.parquet")
    for column in STUDY.UNIT_METRICS:
        assert metrics[column].map(math.isfinite).all(), column
    assert set(metrics["sweep"]) == set(STUDY.SWEEPS)
    trace = pd.read_parquet(smoke / "trace.parquet")
    assert set(trace["product"]) == {"pv", "out"} and set(trace["head"]) == {0}
    assert trace["recipe"].nunique() == (metrics["sweep"] == "format").sum() / 8  # 8 units


def test_smoke_reproduces_the_p_cast_anchor(smoke):
    """Every sink cell within z = 3 standard errors of the exactly evaluated model; forward
    cells within that plus J_4 of the closed form; reverse with S = 256 flushes nothing
    outside the sink's key tile."""
    config = STUDY.PRESETS["smoke"]
    table = STUDY.anchor_table(config, STUDY.per_cell(pd.read_parquet(smoke / "metrics.parquet")))
    assert len(table) == len(config.deltas) * 4
    assert table["model_ok"].all(), table.loc[~table["model_ok"]].to_string()
    forward = table[table["order"] == "forward"]
    assert forward["closed_ok"].astype(bool).all()
    reverse = table[(table["order"] == "reverse") & (table["lift"] == 256.0)]
    assert (reverse["flushed_other_tiles"] == 0).all()
    assert (table[table["delta"] >= 6]["flushed"] > 0).any()  # the check is not vacuous
    assert "FAIL" not in (smoke / "report.md").read_text()


def test_the_model_constants():
    assert STUDY.expected_max(4) == pytest.approx(1.029375, abs=1e-5)  # E max of 4 N(0, 1)
    assert STUDY.flush_threshold(FP8_E4M3FN) == pytest.approx(10 * math.log(2))  # 6.93
    assert 0.04 < STUDY.jensen_bound(4) < 0.06


def test_the_input_has_the_models_score_statistics():
    """Non-sink scores N(0, 1), sink scores Delta + N(0, 1): means and standard deviations
    within 4 standard errors of the sample (n = 8 x 256 x 252 non-sink scores; the rows of a
    head share keys, so the tolerance uses the n_keys x n_heads independent keys)."""
    config = STUDY.POperandConfig(batch=1, heads=8, seq=256, block_m=64, block_n=64)
    q, k, _ = STUDY.sink_inputs(config, 5.0, seed=3, device="cpu")
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(config.head_dim)  # (B, H, N, N)
    rest, sink = scores[..., 4:].flatten(), scores[..., :4].flatten()
    n = 8 * 252
    assert abs(rest.mean().item()) < 4 / math.sqrt(n)
    assert abs(rest.std().item() - 1) < 4 / math.sqrt(2 * n)
    assert abs(sink.mean().item() - 5) < 4 / math.sqrt(8 * 4)
    assert abs(sink.std().item() - 1) < 4 / math.sqrt(2 * 8 * 4)


def test_recipes_quantize_only_p():
    config = STUDY.PRESETS["smoke"]
    cell = next(c for c in STUDY.cells(config) if c["sweep"] == "two_level"
                and c["p_quant"] == "row_scaled")
    recipe = STUDY.recipe_for(config, cell)
    assert recipe.p.name == "nvfp4_1level" and recipe.p_quant.value == "row_scaled"
    assert all(getattr(recipe, f) is None for f in ("q", "k", "v", "dv_p", "dq_ds"))


def test_rerun_with_the_same_seed_gives_identical_metrics(tmp_path):
    first = run_study("p-operand", "smoke", TINY, out=tmp_path / "a", quiet=True)
    again = run_study("p-operand", "smoke", TINY, out=tmp_path / "b", quiet=True)
    for table in ("metrics", "trace"):
        pd.testing.assert_frame_equal(pd.read_parquet(first / f"{table}.parquet"),
                                      pd.read_parquet(again / f"{table}.parquet"))


def test_two_gloo_ranks_give_the_table_of_one_process(tmp_path):
    one = run_study("p-operand", "smoke", TINY, out=tmp_path / "one", quiet=True)
    script = tmp_path / "launch.py"
    script.write_text(
        "import sys\nfrom fp4lab.studies import run_study\n"
        "run_study('p-operand', 'smoke', sys.argv[2:], out=sys.argv[1], quiet=True)\n"
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script),
         str(tmp_path / "two"), *TINY],
        cwd=ROOT, check=True, capture_output=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    for table in ("metrics", "trace"):
        pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "two" / f"{table}.parquet"),
                                      pd.read_parquet(one / f"{table}.parquet"))


@pytest.mark.parametrize(
    "entry, words",
    [("formats=fp8_e4m3fn,nvfp5", "unknown name 'nvfp5'"),
     ("seq=500", "block_m must divide seq"),
     ("two_level_formats=nvfp4", "needs 1-D blocks, no tensor scale"),
     ("sink_format=nvfp4", "not a FloatFormat"),
     ("orders=sideways", "orders: 'sideways'"),
     ("lifts=1,-2", "lifts must be positive")],
    ids=["format", "seq", "two-level", "sink-format", "order", "lift"],
)
def test_bad_set_values_fail_before_anything_runs(tmp_path, entry, words):
    with pytest.raises(ValueError, match=words):
        run_study("p-operand", "smoke", [entry], out=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists()


def test_triton_gets_the_librarys_error_and_no_fallback(tmp_path):
    """The study passes backend='triton' to fp4lab.attention with a trace, which the kernels
    do not write (or, on a CPU, cannot run): the library's error, and nothing is written."""
    with pytest.raises((NotImplementedError, ValueError), match="[Tt]riton|trace"):
        run_study("p-operand", "smoke", TINY, out=tmp_path / "x", backend="triton", quiet=True)
    assert not (tmp_path / "x").exists()


def test_exact_reference_is_float64_reference_path():
    config = STUDY.POperandConfig(batch=1, heads=1, seq=128, block_m=64, block_n=64)
    ref = STUDY._exact(config, 4.0, 1.0, 0, "cpu")
    assert ref.dtype == torch.float64 and ref.shape == (1, 1, 128, 64)


def test_saved_activations_replace_the_model_outside_the_sink_sweep(tmp_path):
    """A save_inputs file runs the format, logit and two-level sweeps on its Q, K, V (its
    (batch, head) pairs the units); the sink sweep needs the model and does not run."""
    from fp4lab.analysis import save_inputs, synthetic_inputs

    x = synthetic_inputs(batch=1, heads=2, seq=128, head_dim=32, seed=2)
    path = save_inputs(tmp_path / "acts.npz", x.q, x.k, x.v)
    out = run_study("p-operand", "smoke", [*TINY, f"inputs={path}"], out=tmp_path / "a",
                    quiet=True)
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert "sink" not in set(metrics["sweep"]) and {"format", "logit"} <= set(metrics["sweep"])
    assert metrics["out_rel_l2"].map(math.isfinite).all() and len(metrics) % 2 == 0
    assert metrics["flushed"].between(0, 1).all() and metrics["flushed_sink_tile"].isna().all()
    report = (out / "report.md").read_text()
    assert "activations read from" in report and "does not run on a file" in report
