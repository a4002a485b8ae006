"""Helpers for a study's report: numbers and tables in markdown."""

from __future__ import annotations

import math

import pandas as pd

__all__ = ["number", "markdown_table"]


def number(x, digits: int = 3) -> str:
    """A value in `digits` significant figures; "n/a" for None and NaN."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def markdown_table(frame: pd.DataFrame, columns: dict[str, str] | None = None,
                   digits: int = 3) -> str:
    """A GitHub markdown table of `frame`'s `columns` (name: heading; default all), floats in
    `digits` significant figures; a column the frame lacks prints n/a."""
    columns = {c: c for c in frame.columns} if columns is None else columns
    lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    for _, row in frame.iterrows():
        lines.append("| " + " | ".join(number(row.get(c), digits) for c in columns) + " |")
    return "\n".join(lines) + "\n"
