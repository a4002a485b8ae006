"""Helpers for a study's report: numbers and tables in markdown, and its summary section."""

from __future__ import annotations

import math
import re

import pandas as pd

__all__ = ["number", "markdown_table", "summary", "SUMMARY_HEADING"]

# The heading of a report's findings in short; `fp4lab study run` prints that section.
SUMMARY_HEADING = "## What the numbers show"


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


def summary(report: str) -> str | None:
    """The body of `report`'s SUMMARY_HEADING section (up to the next ``## `` heading),
    stripped; None when the report has no such section."""
    found = re.search(rf"^{re.escape(SUMMARY_HEADING)}[ \t]*\n(.*?)(?=^## |\Z)", report,
                      flags=re.M | re.S)
    return found.group(1).strip() if found else None
