"""The registered attention recipes as tables: what `fp4lab recipes` prints and the README shows."""

from __future__ import annotations

import pandas as pd

from fp4lab.formats import FloatFormat, QuantSpec, get, names
from fp4lab.recipes.operands import Product
from fp4lab.recipes.recipe import AttentionRecipe

__all__ = ["recipes_frame", "summary"]


def summary(recipe: AttentionRecipe) -> str:
    """The first paragraph of a recipe's doc on one line (a preset's is one sentence)."""
    return " ".join(recipe.doc.split("\n\n")[0].split())


def _format_name(spec) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, (QuantSpec, FloatFormat)):
        return spec.name
    raise TypeError(f"an operand must be a QuantSpec, a FloatFormat or None, got {spec!r}")


def _mask(recipe: AttentionRecipe) -> str:
    return {True: "causal", False: "non-causal", None: "either"}[recipe.causal]


def recipes_frame(products: bool = True) -> pd.DataFrame:
    """One row per registered `AttentionRecipe`: its name, the first sentence of its doc, the
    mask it was made for, its source and (with `products`) the formats of each product's
    operands as "a / b" ("-" for an unquantized operand)."""
    rows = []
    for name in names(AttentionRecipe):
        recipe = get(name, AttentionRecipe)
        row = {
            "name": name,
            "summary": summary(recipe),
            "mask": _mask(recipe),
            "source": recipe.source,
        }
        if products:
            for product in Product:
                a, b = recipe.operands(product)
                row[product.value] = f"{_format_name(a)} / {_format_name(b)}"
        rows.append(row)
    return pd.DataFrame.from_records(rows)
