"""The registry as tables: what `fp4lab formats` prints and the README shows."""

from __future__ import annotations

import pandas as pd

from fp4lab.formats.float_format import FloatFormat
from fp4lab.formats.registry import get, names
from fp4lab.formats.spec import QuantSpec

__all__ = ["formats_frame", "recipes_frame", "to_markdown"]


def formats_frame() -> pd.DataFrame:
    """One row per registered FloatFormat."""
    rows = []
    for name in names(FloatFormat):
        f = get(name)
        rows.append({
            "name": name, "bits": f.bits, "layout": f"{'S' if f.signed else 'U'}E{f.ebits}M{f.mbits}",
            "bias": f.bias, "specials": f.specials.value, "max": f.max, "min_normal": f.min_normal,
            "min_subnormal": f.min_subnormal,
        })
    return pd.DataFrame.from_records(rows)


def recipes_frame() -> pd.DataFrame:
    """One row per registered QuantSpec."""
    rows = []
    for name in names(QuantSpec):
        s = get(name)
        rows.append({
            "name": name, "element": s.element.name, "scale": s.scale.name,
            "block": "tensor" if s.block is None else "x".join(map(str, s.block)),
            "scale_rule": s.scale_rule.value, "tensor_scale": s.tensor_scale,
            "arithmetic": s.arithmetic.value, "hadamard": s.hadamard or "",
            "bits_per_element": s.bits_per_element,
        })
    return pd.DataFrame.from_records(rows)


def to_markdown(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table (floats in repr's shortest form)."""
    def cell(v):
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)
