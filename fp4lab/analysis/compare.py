"""How far a recipe's attention lands from exact attention: output and gradient errors.

`compare(q, k, v, do, recipe)` runs one forward and backward of `recipe` on the inputs as
given (their dtype is the working precision) and one of exact attention in float64 on the
same inputs, and reports the error of O, dQ, dK and dV, with the recipe's per-tile `Trace`.
The float64 reference is the simulation path's own `exact` recipe (FlashAttention-2's tiled
algorithm with nothing quantized), which equals a float64 `F.scaled_dot_product_attention`
to 1e-10 (tests/analysis/test_compare.py) and, unlike a dense reference, needs memory
linear in the sequence length.

Metrics, for a result x against the reference r (both flattened, in float64), following
SageAttention3's report (arXiv 2505.11594: cosine similarity, relative L1/L2, RMSE):
- ``rel_l2``   ||x - r||_2 / ||r||_2
- ``cosine``   <x, r> / (||x||_2 ||r||_2)
- ``rmse``     sqrt(mean((x - r)^2))
- ``max_abs``  max |x - r|
- ``nan``      number of NaN elements of x (the other metrics are then NaN)

`saturation(trace)` condenses the trace into the figures that say why: per product and
operand, the mean over tiles of the quantization error, the flushed-to-zero and clipped
fractions and the scale under/overflow fractions, and for P the probability mass lost per
query row.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from fp4lab.analysis.flash import attention
from fp4lab.recipes import OPERAND_COLUMNS, AttentionRecipe, Product, Trace, resolve_recipe

__all__ = [
    "Comparison",
    "compare",
    "exact_reference",
    "error_metrics",
    "forward_backward",
    "saturation",
    "TENSORS",
]

TENSORS = ("o", "dq", "dk", "dv")


@dataclass(frozen=True)
class Comparison:
    """What `compare` found.

    Attributes:
        recipe: the recipe's name.
        errors: one row per tensor (o, dq, dk, dv) with columns recipe, tensor and the
            metrics of the module docstring.
        trace: the recipe run's per-tile statistics (None when tracing was off).
        meta: the call's settings (causal, scale, tiles, seed, dtype, shapes).
    """

    recipe: str
    errors: pd.DataFrame
    trace: Trace | None
    meta: dict

    def saturation(self) -> pd.DataFrame:
        """`saturation` of this run's trace."""
        if self.trace is None:
            raise ValueError("trace: this comparison ran with trace=False; rerun with trace=True")
        return saturation(self.trace)


def compare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    recipe: AttentionRecipe | str,
    *,
    causal: bool = False,
    scale: float | None = None,
    generator: torch.Generator | int | None = None,
    trace: Trace | bool = True,
    block_m: int | None = None,
    block_n: int | None = None,
    attn_mask: torch.Tensor | None = None,
) -> Comparison:
    """Errors of `recipe`'s O, dQ, dK, dV against exact float64 attention on the same inputs.

    Args:
        q, k, v: (B, H, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv), as `attention` takes them;
            the recipe runs in their dtype (float64 stays float64, anything else float32).
        do: the output gradient (B, H, Sq, Dv).
        recipe: an `AttentionRecipe` or a registered name.
        causal, scale, generator, block_m, block_n, attn_mask: as for `attention` (the
            reference uses the same mask and scale; tiles do not change exact results).
        trace: True for a fresh `Trace`, a `Trace` to record into, or False for none.

    Returns:
        A `Comparison` (errors DataFrame, trace, settings).
    """
    recipe = resolve_recipe(recipe)
    block_m, block_n = recipe.tiles(block_m, block_n)
    if not isinstance(do, torch.Tensor) or do.shape != (*q.shape[:-1], v.shape[-1]):
        got = tuple(do.shape) if isinstance(do, torch.Tensor) else type(do).__name__
        raise ValueError(
            f"do must be a tensor of shape (B, H, Sq, Dv) = {(*q.shape[:-1], v.shape[-1])}, got "
            f"{got}"
        )
    if isinstance(trace, bool):
        trace = Trace() if trace else None
    elif not isinstance(trace, Trace):
        raise TypeError(f"trace must be a bool or a Trace, got {type(trace).__name__}")
    options = dict(
        causal=causal, scale=scale, block_m=block_m, block_n=block_n, attn_mask=attn_mask
    )
    got = forward_backward(q, k, v, do, recipe, trace=trace, generator=generator, **options)
    ref = exact_reference(q, k, v, do, **options)
    rows = [
        {"recipe": recipe.name, "tensor": name, **error_metrics(x, r)}
        for name, x, r in zip(TENSORS, got, ref, strict=True)
    ]
    meta = {
        "causal": bool(causal),
        "scale": q.shape[-1] ** -0.5 if scale is None else scale,
        "block_m": block_m,
        "block_n": block_n,
        "dtype": str(q.dtype),
        "shape_q": tuple(q.shape),
        "shape_k": tuple(k.shape),
        "shape_v": tuple(v.shape),
        "seed": _seed(generator),
        "masked": attn_mask is not None,
    }
    return Comparison(recipe.name, pd.DataFrame(rows), trace, meta)


def _seed(generator) -> int | None:
    """The int seed the caller gave, or None: a torch.Generator's initial seed does not say
    how far it had advanced, so it would not reproduce the run."""
    return generator if isinstance(generator, int) and not isinstance(generator, bool) else None


def exact_reference(q, k, v, do, **options) -> tuple[torch.Tensor, ...]:
    """(O, dQ, dK, dV) of exact attention in float64 on q, k, v, do (options as `attention`'s:
    causal, scale, block_m, block_n, attn_mask)."""
    q, k, v, do = (x.detach().to(torch.float64) for x in (q, k, v, do))
    return forward_backward(q, k, v, do, "exact", trace=None, generator=None, **options)


def forward_backward(
    q, k, v, do, recipe, *, trace, generator, attend=None, **options
) -> tuple[torch.Tensor, ...]:
    """One forward and backward of `recipe` (`attention`'s options) on detached copies of
    the inputs: (O, dQ, dK, dV). `attend`: the attention function to run (`attention`'s
    signature; the simulation's when None)."""
    attend = attention if attend is None else attend
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    with torch.enable_grad():
        out = attend(q, k, v, recipe, trace=trace, generator=generator, **options)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_outputs=do.to(out.dtype))
    return out.detach(), dq, dk, dv


def error_metrics(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """rel_l2, cosine, rmse, max_abs and nan of x against ref (see the module docstring)."""
    if x.shape != ref.shape:
        raise ValueError(f"x must have ref's shape {tuple(ref.shape)}, got {tuple(x.shape)}")
    if x.numel() == 0:
        return {"rel_l2": 0.0, "cosine": float("nan"), "rmse": 0.0, "max_abs": 0.0, "nan": 0}
    x64, r64 = x.detach().double().flatten(), ref.detach().double().flatten()
    diff = x64 - r64
    return {
        "rel_l2": _ratio(diff.norm(), r64.norm()),
        "cosine": (x64 @ r64 / (x64.norm() * r64.norm())).item(),
        "rmse": diff.square().mean().sqrt().item(),
        "max_abs": diff.abs().max().item(),
        "nan": int(torch.isnan(x64).sum()),
    }


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    """num / den, with 0 / 0 = 0 (both exact), x / 0 = inf and NaN if either is NaN."""
    if torch.isnan(num) or torch.isnan(den):
        return float("nan")
    if den > 0:
        return (num / den).item()
    return 0.0 if num == 0 else float("inf")


_SIDES = tuple(c for c in OPERAND_COLUMNS if c != "nan")  # the saturation figures


def saturation(trace: Trace | pd.DataFrame) -> pd.DataFrame:
    """Per (recipe, product, operand): means over tiles of the operand's quantization error,
    flushed and clipped fractions and scale under/overflow fractions, and for P operands
    ``p_mass_lost``, the probability mass flushed per query row (summed over key tiles,
    averaged over query tiles).

    Rows follow the recipes' order of appearance, attention's order of products (qk, pv,
    dv, dp, dq, dk; the backward's only once it has run) and operands (a, b).
    """
    frame = trace.to_frame() if isinstance(trace, Trace) else trace
    rows = []
    for recipe in frame["recipe"].unique():
        for product in Product:
            tiles = frame[(frame["recipe"] == recipe) & (frame["product"] == product.value)]
            if len(tiles):
                rows += [_operand_row(recipe, product, tiles, side) for side in "ab"]
    return pd.DataFrame(rows, columns=["recipe", "product", "operand", *_SIDES, "p_mass_lost"])


def _operand_row(recipe: str, product: Product, tiles: pd.DataFrame, side: str) -> dict:
    row = {"recipe": recipe, "product": product.value, "operand": tiles[f"{side}_name"].iloc[0]}
    row.update({c: tiles[f"{side}_{c}"].mean() for c in _SIDES})
    is_p = row["operand"] == "p"
    row["p_mass_lost"] = _mass_per_row(tiles) if is_p else float("nan")
    return row


def _mass_per_row(tiles: pd.DataFrame) -> float:
    """Mean over query tiles of the P mass lost per row, summed over a query tile's key tiles."""
    per_query_tile = tiles.groupby(["call", "batch", "head", "q_tile"])["p_mass_lost"].sum(
        min_count=1
    )
    return per_query_tile.mean()
