"""Study attention-gradients: its smoke preset runs (errors, biases against both references,
the averaging curves), repeats exactly, and refuses bad settings before running."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from fp4lab.studies import load_study, run_study

STUDY = load_study("attention-gradients").module
TINY = ["seq=128", "heads=1", "products=pv,dq", "recipes=croissattn", "samples=3"]


def test_smoke_writes_every_file_with_finite_errors(attention_gradients_smoke):
    out = attention_gradients_smoke
    for name in ("metrics.parquet", "convergence.parquet", "report.md",
                 "figures/gradient_errors.png", "figures/averaging.png"):
        assert (out / name).is_file(), name
    metrics = pd.read_parquet(out / "metrics.parquet")
    assert metrics["rel_l2"].map(math.isfinite).all()
    grads = metrics[metrics["tensor"].isin(["dq", "dk", "dv"])]
    for ref in ("exact", "forward"):
        assert grads[f"rel_bias_{ref}"].map(math.isfinite).all()
    config = STUDY.PRESETS["smoke"]
    assert set(metrics["recipe"]) == {c["recipe"] for c in STUDY.cells(config)}
    curve = pd.read_parquet(out / "convergence.parquet")
    assert set(curve["reference"]) == {"exact", "forward"}
    assert curve["n"].max() == config.samples


def test_a_product_alone_moves_only_the_gradients_it_reaches(attention_gradients_smoke):
    """Quantizing dq = dS K alone leaves dK and dV exact (float32 level), moves dQ."""
    metrics = pd.read_parquet(attention_gradients_smoke / "metrics.parquet")
    dq = metrics[metrics["recipe"] == "nvfp4_sr@dq"].set_index("tensor")["rel_l2"]
    assert dq["dq"] > 1e-3 and dq["dk"] < 1e-5 and dq["dv"] < 1e-5 and dq["o"] < 1e-5


def test_rerun_with_the_same_seed_gives_identical_metrics(tmp_path):
    first = run_study("attention-gradients", "smoke", TINY, out=tmp_path / "a", quiet=True)
    again = run_study("attention-gradients", "smoke", TINY, out=tmp_path / "b", quiet=True)
    for table in ("metrics", "convergence"):
        pd.testing.assert_frame_equal(pd.read_parquet(first / f"{table}.parquet"),
                                      pd.read_parquet(again / f"{table}.parquet"))


@pytest.mark.parametrize(
    "entry, words",
    [("recipes=croissattn,nope", "unknown name 'nope'"), ("products=qk,xy", "products: 'xy'"),
     ("samples=1", "samples must be >= 2"), ("references=approx", "references: 'approx'"),
     ("recipes=croissattn_eden", "Hadamard transform of 128")],
    ids=["recipe", "product", "samples", "reference", "hadamard"],
)
def test_bad_set_values_fail_before_anything_runs(tmp_path, entry, words):
    with pytest.raises(ValueError, match=words):
        run_study("attention-gradients", "smoke", [entry], out=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists()


def test_saved_activations_give_the_numbers_of_the_model_they_came_from(tmp_path):
    from fp4lab.analysis import save_inputs, synthetic_inputs

    tiny = ["batch=1", *TINY]
    x = synthetic_inputs(batch=1, heads=1, seq=128, head_dim=64, seed=0)
    path = save_inputs(tmp_path / "acts.npz", x.q, x.k, x.v, x.do)
    synthetic = run_study("attention-gradients", "smoke", tiny, out=tmp_path / "a", quiet=True)
    saved = run_study("attention-gradients", "smoke", [*tiny, f"inputs={path}"],
                      out=tmp_path / "b", quiet=True)
    pd.testing.assert_frame_equal(pd.read_parquet(synthetic / "metrics.parquet"),
                                  pd.read_parquet(saved / "metrics.parquet"))
    assert "sha256" in (saved / "report.md").read_text()
