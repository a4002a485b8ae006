"""Quantization-error diagnostics: formulas on hand-made cases, seeded inputs."""

import math

import pytest
import torch

from fp4lab.analysis.quant_error import error_report, quantization_error, standard_inputs


def test_formulas_on_a_known_case():
    x = torch.tensor([3.0, 4.0])
    q = torch.tensor([3.0, 0.0])  # 4 flushed: error energy 16 of 25
    e = quantization_error(x, q)
    assert e["rel_mse"] == pytest.approx(16 / 25)
    assert e["effective_bits"] == pytest.approx(-math.log2(16 / 25) / 2)
    assert e["sqnr_db"] == pytest.approx(10 * math.log10(25 / 16))
    assert e["misalignment"] == pytest.approx(1 - 9 / 25)
    exact = quantization_error(x, x)
    assert exact["rel_mse"] == 0 and exact["effective_bits"] == math.inf


def test_shape_mismatch_names_the_argument():
    with pytest.raises(ValueError, match="xq must have x's shape"):
        quantization_error(torch.ones(3), torch.ones(4))


def test_standard_inputs_are_seeded():
    a, b, c = (
        standard_inputs(4, 32, seed=1),
        standard_inputs(4, 32, seed=1),
        standard_inputs(4, 32, seed=2),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["gaussian"], c["gaussian"])
    rows = a["gaussian_logspaced"].abs().amax(1)
    assert rows[-1] / rows[0] > 2.0**20  # the row magnitudes span 2^32


def test_report_orders_recipes_as_expected():
    """FP8 beats FP4 by about two effective bits, and NVFP4 beats MXFP4 on Gaussians."""
    frame = error_report(["mxfp4", "nvfp4", "mxfp8_e4m3"], rows=32, cols=1024).set_index(
        ["input", "recipe"]
    )
    bits = frame.loc["gaussian", "effective_bits"]
    assert bits["mxfp8_e4m3"] > bits["nvfp4"] + 1.5 > bits["mxfp4"] + 1.5
    assert frame.loc["gaussian", "misalignment"]["mxfp4"] > 0  # floor scales clip: a shrink
