"""A toy study for the framework's tests: a few cells of seeded random numbers, one attention
call each (so the backend is passed through), a report and a figure."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch
from matplotlib.figure import Figure

import fp4lab

QUESTION = "Does the framework store, resume and gather cells faithfully?"


@dataclass(frozen=True)
class ToyConfig:
    cells: int = 6  # number of cells in the sweep
    size: int = 16  # tokens of each cell's attention call
    scales: tuple[float, ...] = (0.5, 2.0)  # a list field: every cell runs each scale
    draw: Literal["gauss", "uniform"] = "gauss"  # a choice field
    pause: float = 0.0  # seconds each cell sleeps (for the kill test)
    label: str | None = None  # an optional field
    extra: bool = False  # also return a second table

    def __post_init__(self) -> None:
        if self.cells < 1:
            raise ValueError(f"cells must be >= 1, got {self.cells}")


PRESETS = {"smoke": ToyConfig(cells=4), "full": ToyConfig()}


def cells(config: ToyConfig) -> list[dict]:
    return [{"i": i, "parity": "even" if i % 2 == 0 else "odd"} for i in range(config.cells)]


def run_cell(config: ToyConfig, cell: dict, ctx) -> list[dict]:
    time.sleep(config.pause)
    gen = torch.Generator().manual_seed(ctx.cell_seed)
    sample = torch.randn if config.draw == "gauss" else torch.rand
    q, k, v = (sample(1, 1, config.size, 8, generator=gen) for _ in range(3))
    rows = []
    for scale in config.scales:
        out = fp4lab.attention(q, k, v, "nvfp4", scale=scale, backend=ctx.backend)
        rows.append({"scale": scale, "value": float(out.double().sum()), "index": ctx.index})
    if config.extra:
        return {"metrics": rows, "tiles": [{"tile": t, "norm": float(q[..., t].norm())}
                                           for t in range(2)]}
    return rows


def report(config: ToyConfig, metrics):
    fig = Figure(figsize=(3, 2))
    fig.subplots().plot(metrics["i"], metrics["value"], "o")
    text = (f"## What the numbers show\n\n{len(metrics)} rows, sum of values "
            f"{metrics['value'].sum():.6g}.\n\n## More\n\nNothing.\n")
    by_parity = metrics.groupby("parity", as_index=False)["value"].sum()
    return text, {"values": fig}, {"by_parity": by_parity}  # a table derived from the metrics
