"""How much a block-scaling recipe loses on standard inputs: the diagnostics of Quartet II.

For a tensor x and its quantize-dequantize q(x), all in float64:
- relative MSE  ||x - q(x)||^2 / ||x||^2
- effective bits  -log2(relative MSE) / 2  (the bits of a uniform quantizer with that error)
- SQNR  10 log10(||x||^2 / ||x - q(x)||^2) in dB
- magnitude misalignment  1 - <x, q(x)> / <x, x>: positive when q shrinks x (flushing,
  clipping), a proxy for the bias of a product that uses q(x) (Quartet II, arXiv 2601.22813).

`standard_inputs` draws the inputs `fp4lab error` reports on, from one seed.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from fp4lab.formats import QuantSpec, fake_quantize, resolve_spec

__all__ = ["quantization_error", "standard_inputs", "error_report", "INPUT_KINDS"]

INPUT_KINDS = {
    "gaussian": "N(0, 1)",
    "gaussian_logspaced": "N(0, 1) times a row magnitude log-spaced over 2^-16 .. 2^16",
    "heavy_tailed": "Student t with 3 degrees of freedom",
    "outliers": "N(0, 1) + N(0, 100) * Bernoulli(0.001), FlashAttention-3's FP8 error test",
}


def quantization_error(x: torch.Tensor, xq: torch.Tensor) -> dict[str, float]:
    """Relative MSE, effective bits, SQNR (dB) and magnitude misalignment of xq against x."""
    if x.shape != xq.shape:
        raise ValueError(f"xq must have x's shape {tuple(x.shape)}, got {tuple(xq.shape)}")
    x64, q64 = x.double(), xq.double()
    energy = (x64 * x64).sum()
    rel_mse = ((x64 - q64).pow(2).sum() / energy).item()
    return {
        "rel_mse": rel_mse,
        "effective_bits": -math.log2(rel_mse) / 2 if rel_mse > 0 else math.inf,
        "sqnr_db": -10 * math.log10(rel_mse) if rel_mse > 0 else math.inf,
        "misalignment": 1.0 - ((x64 * q64).sum() / energy).item(),
    }


def standard_inputs(rows: int = 256, cols: int = 4096, seed: int = 0) -> dict[str, torch.Tensor]:
    """The float32 inputs of `INPUT_KINDS`, each (rows, cols), all drawn from `seed`."""
    if rows < 1 or cols < 1:
        raise ValueError(f"rows and cols must be positive, got rows={rows}, cols={cols}")
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    magnitudes = torch.logspace(-16, 16, rows, base=2, dtype=torch.float64)[:, None]
    chi2 = normal(3, rows, cols).pow(2).sum(0)  # chi-squared with 3 degrees of freedom
    spikes = torch.rand(rows, cols, generator=gen, dtype=torch.float64) < 0.001
    inputs = {
        "gaussian": normal(rows, cols),
        "gaussian_logspaced": normal(rows, cols) * magnitudes,
        "heavy_tailed": normal(rows, cols) / torch.sqrt(chi2 / 3),
        "outliers": normal(rows, cols) + 10.0 * normal(rows, cols) * spikes,
    }
    return {name: x.float() for name, x in inputs.items()}


def error_report(
    specs: list[QuantSpec | str],
    *,
    rows: int = 256,
    cols: int = 4096,
    seed: int = 0,
    axis: int = -1,
) -> pd.DataFrame:
    """One row per (recipe, input): bits per element and the four error figures."""
    if not specs:
        raise ValueError("specs must name at least one recipe")
    resolved = [resolve_spec(s) for s in specs]
    records = []
    for name, x in standard_inputs(rows, cols, seed).items():
        for spec in resolved:
            xq = fake_quantize(x, spec, axis=axis)
            record = {"recipe": spec.name, "input": name, "bits_per_element": spec.bits_per_element}
            records.append(record | quantization_error(x, xq))
    return pd.DataFrame.from_records(records)
