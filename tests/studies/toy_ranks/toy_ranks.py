"""A toy study for the framework's tests under several ranks: one cell may be slow, one may
fail with an error that does not unpickle."""

from __future__ import annotations

import time
from dataclasses import dataclass

QUESTION = "Does a sweep over ranks name its slow and failing cells?"
BACKENDS = ("reference",)


@dataclass(frozen=True)
class RanksConfig:
    cells: int = 2  # number of cells
    slow: int = -1  # the cell that sleeps `pause` seconds (-1: none)
    pause: float = 0.0
    fail: int = -1  # the cell that raises `KeywordError` (-1: none)


PRESETS = {"smoke": RanksConfig(), "full": RanksConfig()}


class KeywordError(Exception):
    """An error whose __init__ takes a keyword only: pickle rebuilds it from its args, so it
    pickles but does not unpickle."""

    def __init__(self, *, part: str) -> None:
        super().__init__(f"the {part} broke")


def cells(config: RanksConfig) -> list[dict]:
    return [{"i": i} for i in range(config.cells)]


def run_cell(config: RanksConfig, cell: dict, ctx) -> list[dict]:
    if cell["i"] == config.slow:
        time.sleep(config.pause)
    if cell["i"] == config.fail:
        raise KeywordError(part="widget")
    return [{"value": float(cell["i"])}]


def report(config: RanksConfig, metrics):
    return f"## What the numbers show\n\n{len(metrics)} rows.\n", {}
