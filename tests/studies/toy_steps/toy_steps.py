"""A toy data-parallel study for the framework's tests: each cell takes a few "steps", all
ranks together (an all_reduce per step under torchrun), checkpointing its state in its
scratch folder after every step; a third preset, "long"."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

QUESTION = "Do data-parallel cells, scratch checkpoints and extra presets work?"


@dataclass(frozen=True)
class StepsConfig:
    cells: int = 2  # number of cells
    steps: int = 3  # steps per cell, a checkpoint after each

    def __post_init__(self) -> None:
        if self.cells < 1 or self.steps < 1:
            raise ValueError(f"cells and steps must be >= 1, got {self.cells}, {self.steps}")


PRESETS = {"smoke": StepsConfig(), "full": StepsConfig(cells=3), "long": StepsConfig(steps=5)}
STEPS_TAKEN: list[tuple[int, int]] = []  # (cell, step) taken in this process, for the tests


def data_parallel(config: StepsConfig) -> bool:
    return True


def cells(config: StepsConfig) -> list[dict]:
    return [{"i": i} for i in range(config.cells)]


def after_step(cell: int, step: int) -> None:
    """Called after each step's checkpoint (the tests replace it to interrupt a cell)."""


def run_cell(config: StepsConfig, cell: dict, ctx) -> list[dict]:
    path = ctx.scratch / "state.json"
    state = json.loads(path.read_text()) if path.exists() else {"step": 0, "total": 0.0}
    resumed_at = state["step"]
    while state["step"] < config.steps:
        value = torch.tensor([float(ctx.rank + 1 + ctx.cell_seed % 7)], dtype=torch.float64)
        if ctx.world_size > 1:
            dist.all_reduce(value)
        state["step"] += 1
        state["total"] += state["step"] * float(value)
        STEPS_TAKEN.append((cell["i"], state["step"]))
        if ctx.rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(json.dumps(state))
            os.replace(path.with_suffix(".tmp"), path)
        after_step(cell["i"], state["step"])
    return [{"total": state["total"], "world": ctx.world_size, "resumed_at": resumed_at,
             "scratch": ctx.scratch.name}]


def report(config: StepsConfig, metrics):
    return f"## What the numbers show\n\n{len(metrics)} cells.\n", {}
