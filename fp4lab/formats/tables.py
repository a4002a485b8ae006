"""The registry as tables: what `fp4lab formats` prints and the README shows."""

from __future__ import annotations

import pandas as pd

from fp4lab.formats.float_format import FloatFormat
from fp4lab.formats.registry import get, names
from fp4lab.formats.spec import Correction, QuantSpec

__all__ = ["formats_frame", "recipes_frame", "to_markdown"]


def formats_frame() -> pd.DataFrame:
    """One row per registered FloatFormat."""
    rows = []
    for name in names(FloatFormat):
        f = get(name)
        rows.append({
            "name": name, "bits": f.bits,
            "layout": f"{'S' if f.signed else 'U'}E{f.ebits}M{f.mbits}",
            "bias": f.bias, "specials": f.specials.value, "max": f.max, "min_normal": f.min_normal,
            "min_subnormal": f.min_subnormal,
        })
    return pd.DataFrame.from_records(rows)


def recipes_frame() -> pd.DataFrame:
    """One row per registered QuantSpec. Fields a format does not use print empty: a fixed
    scale's rule, arithmetic and scale format are not read (shown as "fixed")."""
    rows = []
    for name in names(QuantSpec):
        s = get(name)
        fixed = s.fixed_scale is not None
        rows.append({
            "name": name, "element": s.element.name, "scale": "fixed" if fixed else s.scale.name,
            "block": "tensor" if s.block is None else "x".join(map(str, s.block)),
            "scale_rule": "fixed" if fixed else s.scale_rule.value, "tensor_scale": s.tensor_scale,
            "arithmetic": "fixed" if fixed else s.arithmetic.value,
            "rounding": _rounding(s), "hadamard": s.hadamard or "",
            "correction": "" if s.correction is Correction.NONE else s.correction.value,
            "amax_target": s.amax_target if s.amax_target is not None else "",
            "fixed_scale": s.fixed_scale if fixed else "",
            "bits_per_element": s.bits_per_element,
        })
    return pd.DataFrame.from_records(rows)


def _rounding(spec: QuantSpec) -> str:
    """The element rounding, with its random bits when they are limited (and EDEN's
    stochastic scale rounding)."""
    bits = f" ({spec.sr_bits} bits)" if spec.sr_bits is not None else ""
    scales = ", stochastic scales" if spec.correction is Correction.EDEN else ""
    return spec.rounding.value + bits + scales


def to_markdown(frame: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table (floats in repr's shortest form)."""
    def cell(v):
        return f"{v:.6g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(frame.columns) + " |", "|" + "---|" * len(frame.columns)]
    rows = frame.itertuples(index=False)
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
