"""Study quantizer-error: its smoke preset reproduces Quartet II's NVFP4 anchors within the
stated tolerance, its numbers are finite and repeatable, its standard errors are honest."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from fp4lab.analysis.quant_error import quantization_error
from fp4lab.formats import NVFP4, fake_quantize
from fp4lab.studies import load_study, run_study

STUDY = load_study("quantizer-error").module
TINY = ["rows=64", "cols=128", "formats=nvfp4,mxfp4,nvfp4_ms_eden,fp8_e4m3_tensor", "draws=3",
        "inputs=gaussian,heavy_tailed"]


@pytest.fixture
def smoke(quantizer_error_smoke):
    return quantizer_error_smoke


def test_smoke_writes_every_file_with_finite_numbers(smoke):
    for name in ("config.json", "environment.json", "metrics.parquet", "metrics.csv",
                 "report.md", "figures/effective_bits.png", "figures/square_tiles.png",
                 "figures/averaging.png"):
        assert (smoke / name).is_file(), name
    metrics = pd.read_parquet(smoke / "metrics.parquet")
    config = STUDY.PRESETS["smoke"]
    assert len(metrics.groupby("cell")) == len(STUDY.cells(config))
    for column in ("rel_mse", "rel_mse_se", "effective_bits", "misalignment", "rel_mse_row"):
        assert metrics[column].map(math.isfinite).all(), column
    assert set(metrics["rounding"]) == {"nearest", "stochastic", "ms_eden"}


def test_smoke_reproduces_the_quartet_ii_anchors(smoke):
    """9.0e-3 (1 x 16) and 12.4e-3 (16 x 16) within z = 3 standard errors + 0.05e-3."""
    metrics = pd.read_parquet(smoke / "metrics.parquet")
    checks = STUDY.anchor_checks(STUDY.PRESETS["smoke"], metrics)
    assert checks["verdict"].tolist() == ["pass", "pass"], checks.to_string()
    report = (smoke / "report.md").read_text()
    assert report.count("reproduced") >= 2 and "NOT reproduced" not in report


def test_square_tiles_pair_with_their_1d_format():
    layouts = {s.name: base for s, base in STUDY._layouts(STUDY.PRESETS["smoke"])}
    assert layouts["nvfp4_2d"] == "nvfp4" and "nvfp4_16x16" not in layouts  # a named twin
    assert layouts["mxfp4_32x32"] == "mxfp4"
    assert not any(n.startswith(("nvfp4_ms_eden_", "fp8_e4m3_tensor_")) for n in layouts)


def test_band_metrics_are_quantization_errors_definitions():
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    q = fake_quantize(x, NVFP4)
    ours, library = STUDY.metrics(x, q, band=1), quantization_error(x, q)
    for key in ("rel_mse", "effective_bits", "sqnr_db", "misalignment"):
        assert ours[key] == pytest.approx(library[key], rel=1e-12, abs=1e-15), key


def test_the_standard_error_matches_the_spread_over_seeds():
    """The band standard error of one 64 x 256 draw against the standard deviation of the
    relative MSE over 24 independent draws; the latter's own relative error is about
    1 / sqrt(2 * 23) = 15%, so the ratio must lie within [0.55, 1.45] (3 of those)."""
    values, errors = [], []
    for seed in range(24):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
        m = STUDY.metrics(x, fake_quantize(x, NVFP4), band=1)
        values.append(m["rel_mse"])
        errors.append(m["rel_mse_se"])
    ratio = torch.tensor(errors).mean() / torch.tensor(values).std()
    assert 0.55 <= ratio <= 1.45, ratio


def test_rerun_with_the_same_seed_gives_identical_metrics(tmp_path):
    first = run_study("quantizer-error", "smoke", TINY, out=tmp_path / "a", quiet=True)
    again = run_study("quantizer-error", "smoke", TINY, out=tmp_path / "b", quiet=True)
    pd.testing.assert_frame_equal(pd.read_parquet(first / "metrics.parquet"),
                                  pd.read_parquet(again / "metrics.parquet"))


@pytest.mark.parametrize(
    "entry, words",
    [("formats=nvfp4,nvfp5", "unknown name 'nvfp5'"), ("inputs=cauchy", "inputs: 'cauchy'"),
     ("roundings=floor", "roundings: 'floor'"), ("rows=0", "rows must be >= 1"),
     ("draws=two", "draws takes a int")],
    ids=["format", "input", "rounding", "rows", "draws"],
)
def test_bad_set_values_fail_before_anything_runs(tmp_path, entry, words):
    with pytest.raises(ValueError, match=words):
        run_study("quantizer-error", "smoke", [entry], out=tmp_path / "x", quiet=True)
    assert not (tmp_path / "x").exists()


def test_triton_is_refused_up_front(tmp_path):
    with pytest.raises(NotImplementedError, match="calls no attention backend"):
        run_study("quantizer-error", "smoke", TINY, out=tmp_path / "x", backend="triton")
    assert not (tmp_path / "x").exists()
