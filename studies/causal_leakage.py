"""causal-leakage: do block scales that span sequence positions let later tokens change earlier
outputs and gradients?

What. Under a causal mask, query i attends to keys j <= i only, so in exact attention the
output O_i and the query gradient dQ_i do not depend on any later token j > i: not on its
query, key, value or output gradient. (dK_i and dV_i do depend on later tokens, whose
queries attend to key i, so they are not measured.) A quantized operand whose blocks run
along the sequence breaks this: V in O = P V is blocked along the keys, so a later value row
sets the scale an earlier one is rounded with; K in dQ = dS K likewise, and a backward that
reads the forward's quantized V (`BackwardV.FORWARD`) carries V's blocks into dP and dQ. A
tensor scale over the whole tensor (NVFP4's) makes every token's rounding depend on every
other token's. The MatX research post "Future leakage in block-quantized attention" calls
this a train/decode skew (a model trained so sees its future in training and not in
decoding) and gives a fix: the products of P's diagonal blocks with V's own block computed
unquantized (`AttentionRecipe.leakage_fix`).

How. For each recipe, with and without the fix where it applies (V a block format), one
forward and backward on the study's input (the default synthetic model, or activations saved
with `fp4lab.analysis.save_inputs`), then again with one token j's rows of Q, K, V and dO
multiplied by `perturb_scale`, for `positions` tokens j drawn from the run's seed (the same
in every cell). For every earlier row i < j (each batch and head) the change of O_i and dQ_i
is measured: whether it changed at all (any bit), its size ||O'_i - O_i|| / ||O_i||, and the
largest distance j - i at which anything changed (a block's reach, or the whole prefix for a
tensor scale). The recipe's own error on those rows against exact attention (same input,
unperturbed) sets the scale: a leak far below the error is small per step, though it is a
systematic dependence a decoder never sees. Stochastic recipes draw with the cell's seed in
both runs: their draws depend on positions only, so the leak measured is the scales'.

Checks. The exact recipe must leak nothing, bit for bit (the report says whether it did).

Caveats. A token scaled by 4 is a strong perturbation chosen to cross block maxima; smaller
ones change fewer blocks. Leakage is measured in one forward and backward; what it does to
training is the training study's question.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

import fp4lab
from fp4lab.formats import QuantSpec
from fp4lab.recipes import AttentionRecipe, resolve_recipe
from fp4lab.studies import describe_inputs, markdown_table, resolve_inputs, study_inputs

QUESTION = (
    "Do quantization blocks that span sequence positions (V in P V, K in dS K, the backward's "
    "view of V, tensor scales) let a later token change earlier outputs and query gradients, "
    "per recipe, with and without the future-leakage fix?"
)

RECIPES = ("exact", "fa4fp4_causal", "fa4fp4_causal_mxfp4pv", "fa4fp4_causal_mxfp4pv_d64",
           "fa4fp4_causal_mxfp8pv", "attn_qat", "sageattn3", "croissattn")
TENSORS = ("o", "dq")


@dataclass(frozen=True)
class CausalLeakageConfig:
    batch: int = 1  # the synthetic input's batch
    heads: int = 4  # its heads
    seq: int = 1024  # its tokens
    head_dim: int = 128  # its head dimension (the fa4fp4 routes are D128)
    inputs: str | None = None  # a save_inputs file instead of the synthetic model
    inputs_sha256: str | None = None  # the file's hash (recorded; checked when given)
    recipes: tuple[str, ...] = RECIPES  # registered attention recipes
    fix: bool = True  # also run each recipe whose V is a block format with leakage_fix
    positions: int = 16  # perturbed tokens j, drawn from the run's seed
    perturb_scale: float = 4.0  # token j's Q, K, V, dO rows are multiplied by it
    profile_distances: int = 256  # the profile's distances j - i: 1 .. this

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq", "head_dim", "positions", "profile_distances"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        path, sha = resolve_inputs(self.inputs, self.inputs_sha256)
        object.__setattr__(self, "inputs", path)
        object.__setattr__(self, "inputs_sha256", sha)
        for name in self.recipes:
            resolve_recipe(name)
        if not (math.isfinite(self.perturb_scale) and self.perturb_scale > 0
                and self.perturb_scale != 1):
            raise ValueError(f"perturb_scale must be a positive finite number other than 1, "
                             f"got {self.perturb_scale}")
        if self.inputs is None and self.positions >= self.seq:
            raise ValueError(f"positions must be below seq ({self.seq}), got {self.positions}")


PRESETS = {
    "smoke": CausalLeakageConfig(
        heads=2, seq=256, head_dim=64, positions=3, profile_distances=64,
        recipes=("exact", "fa4fp4_causal", "fa4fp4_causal_mxfp4pv", "croissattn"),
    ),
    "full": CausalLeakageConfig(),
}


def fixable(recipe: AttentionRecipe) -> bool:
    """Whether the leakage fix applies: V is a block format with blocks."""
    return isinstance(recipe.v, QuantSpec) and recipe.v.block is not None


def with_fix(recipe: AttentionRecipe) -> AttentionRecipe:
    """The recipe with MatX's fix on its diagonal blocks (a new name, `<name>+fix`)."""
    return dataclasses.replace(recipe, name=f"{recipe.name}+fix", leakage_fix=True)


def cells(config: CausalLeakageConfig) -> list[dict]:
    found = []
    for name in config.recipes:
        recipe = resolve_recipe(name)
        fixes = (False, True) if config.fix and fixable(recipe) and not recipe.leakage_fix else (
            (recipe.leakage_fix,))
        found += [{"recipe": name, "leakage_fix": f} for f in fixes]
    return found


# -- the measurement -----------------------------------------------------------------------


def draw_positions(seq: int, count: int, seed: int) -> list[int]:
    """`count` distinct tokens j in [1, seq), ascending, drawn from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    count = min(count, seq - 1)
    return sorted((torch.randperm(seq - 1, generator=gen)[:count] + 1).tolist())


def perturb(tensors, j: int, factor: float):
    """q, k, v, do with token j's rows (every batch and head) multiplied by `factor`."""
    out = []
    for t in tensors:
        t = t.clone()
        t[:, :, j] *= factor
        out.append(t)
    return out


def forward_backward(recipe, tensors, *, generator, backend: str, tiles: dict):
    """(O, dQ) of one causal forward and backward, detached."""
    q, k, v, do = tensors
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fp4lab.attention(*leaves, recipe, causal=True, generator=generator, backend=backend,
                         **tiles)
    o.backward(do)
    return o.detach(), leaves[0].grad


def _row_change(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row (B, H, S): whether any element changed, and ||new - old|| / ||old|| in float64
    (NaN for a row that is zero in `old`: a query whose gradient is exactly zero)."""
    diff = (new.double() - old.double()).norm(dim=-1)
    norm = old.double().norm(dim=-1)
    changed = (new != old).any(dim=-1)
    return changed, torch.where(norm > 0, diff / norm, math.nan)


def _prefix_error(new: torch.Tensor, old: torch.Tensor, j: int) -> float:
    """||new - old|| / ||old|| over the rows i < j of every batch and head (float64)."""
    a, b = new[:, :, :j].double(), old[:, :, :j].double()
    norm = b.norm()
    return ((a - b).norm() / norm).item() if norm > 0 else math.nan


def measure_leakage(recipe, tensors, positions, *, perturb_scale: float, generator,
                    backend: str = "reference", tiles: dict | None = None,
                    distances: int = 0, exact=None):
    """Leakage of `recipe` on (q, k, v, do) when each token j of `positions` is scaled by
    `perturb_scale`: (rows, profile). `rows`: per (j, tensor: o, dq) over the earlier rows
    (b, h, i < j), the share that changed at all, the relative change over all of them
    (Frobenius norms) and the largest of one row's, the largest distance j - i that changed
    and, given `exact` (O, dQ of exact attention), the recipe's own relative error on those
    rows. `profile`: per (tensor, distance 1 .. `distances`) the mean over positions and
    rows of one row's relative change."""
    tiles = tiles or {}
    run = dict(generator=generator, backend=backend, tiles=tiles)
    base = forward_backward(recipe, tensors, **run)
    rows, profile = [], {}
    for j in positions:
        moved = forward_backward(recipe, perturb(tensors, j, perturb_scale), **run)
        for t, (new, old) in enumerate(zip(moved, base, strict=True)):
            changed, rel = (x[:, :, :j] for x in _row_change(new, old))  # rows i < j
            reach = torch.nonzero(changed.any(dim=(0, 1))).flatten()
            rows.append({
                "position": j, "tensor": TENSORS[t], "earlier_rows": changed.numel(),
                "changed": changed.double().mean().item(),
                "rel_change": _prefix_error(new, old, j),
                "max_row_change": _nanmax(rel),
                "reach": int(j - reach.min().item()) if len(reach) else 0,
                "own_error": _prefix_error(old, exact[t], j) if exact else math.nan,
            })
            for d in range(1, min(distances, j) + 1):
                profile.setdefault((TENSORS[t], d), []).append(rel[:, :, j - d])
    table = [{"tensor": t, "distance": d, "mean_rel_change": _nanmean(torch.cat(v)),
              "positions": len(v)} for (t, d), v in sorted(profile.items())]
    return rows, table


def _nanmax(x: torch.Tensor) -> float:
    kept = x[~x.isnan()]
    return kept.max().item() if kept.numel() else math.nan


def _nanmean(x: torch.Tensor) -> float:
    kept = x[~x.isnan()]
    return kept.mean().item() if kept.numel() else math.nan


# -- one cell ------------------------------------------------------------------------------


def _inputs(config: CausalLeakageConfig, seed: int, device: str):
    x = study_inputs(config.inputs, seed, batch=config.batch, heads=config.heads,
                     seq=config.seq, head_dim=config.head_dim)
    return [t.to(device) for t in (x.q, x.k, x.v, x.do)]


def recipe_for(cell: dict) -> AttentionRecipe:
    recipe = resolve_recipe(cell["recipe"])
    return with_fix(recipe) if cell["leakage_fix"] and not recipe.leakage_fix else recipe


def run_cell(config: CausalLeakageConfig, cell: dict, ctx) -> dict:
    tensors = _inputs(config, ctx.seed, ctx.device)
    recipe = recipe_for(cell)
    exact = forward_backward("exact", [t.double() for t in tensors], generator=None,
                             backend="reference", tiles={})
    positions = draw_positions(tensors[0].shape[2], config.positions, ctx.seed)
    rows, profile = measure_leakage(
        recipe, tensors, positions, perturb_scale=config.perturb_scale,
        generator=ctx.cell_seed if recipe.stochastic else None, backend=ctx.backend,
        distances=config.profile_distances, exact=exact)
    return {"metrics": rows, "profile": profile}


# -- the report ----------------------------------------------------------------------------


def summarize(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per (recipe, leakage_fix, tensor), means over the positions of the share of earlier
    rows that changed, their relative change and the own error; the largest row change and
    reach; the relative change over the own error."""
    keys = ["recipe", "leakage_fix", "tensor"]
    grouped = metrics.groupby(keys, sort=False)
    out = grouped.agg(changed=("changed", "mean"), rel_change=("rel_change", "mean"),
                      max_row_change=("max_row_change", "max"), reach=("reach", "max"),
                      own_error=("own_error", "mean"), positions=("position", "nunique"))
    out["leak_over_error"] = out["rel_change"] / out["own_error"]
    return out.reset_index()


def _findings(table: pd.DataFrame) -> list[str]:
    short = []
    exact = table[table["recipe"] == "exact"]
    if len(exact):
        clean = bool((exact["changed"] == 0).all())
        verdict = "nothing, bit for bit (pass)" if clean else "SOMETHING (FAIL)"
        short.append(f"Check: exact attention leaks {verdict}.")
    for (recipe, fix), group in table[table["recipe"] != "exact"].groupby(
            ["recipe", "leakage_fix"], sort=False):
        parts = []
        for _, r in group.iterrows():
            if r["changed"] == 0:
                parts.append(f"{r['tensor']} none")
            else:
                parts.append(f"{r['tensor']} changes in {r['changed']:.2g} of earlier rows by "
                             f"{r['rel_change']:.2g} relative ({r['leak_over_error']:.2g} of "
                             f"its own error; one row by up to {r['max_row_change']:.2g}), "
                             f"reaching back {int(r['reach'])} tokens")
        name = f"{recipe} with the fix" if fix else recipe
        short.append(f"{name}: {'; '.join(parts)}.")
    short += _fix_findings(table)
    return short


def _fix_findings(table: pd.DataFrame) -> list[str]:
    short = []
    wide = table.pivot_table(index=["recipe", "tensor"], columns="leakage_fix",
                             values="rel_change", sort=False)
    if True not in wide.columns or False not in wide.columns:
        return short
    for recipe, group in wide.dropna().groupby(level=0, sort=False):
        words = []
        for (_, tensor), r in group.iterrows():
            before, after = r[False], r[True]
            verdict = ("removes it" if after == 0 < before else
                       "leaves none to remove" if before == 0 else
                       f"changes it {before:.2g} -> {after:.2g}")
            words.append(f"{tensor}: {verdict}")
        short.append(f"The fix on {recipe}: {'; '.join(words)}.")
    return short


def report(config: CausalLeakageConfig, metrics: pd.DataFrame, tables: dict):
    source = describe_inputs(config.inputs, config.inputs_sha256, batch=config.batch,
                             heads=config.heads, seq=config.seq, head_dim=config.head_dim)
    table = summarize(metrics)
    skipped = [n for n in config.recipes if config.fix and not fixable(resolve_recipe(n))]
    setup = (
        "## Setup\n\n"
        f"Inputs: {source}; causal; each recipe's own tiles. {config.positions} tokens j "
        f"(drawn from the run's seed) each scaled by {config.perturb_scale:g} in Q, K, V and "
        "dO, one at a time; changes of O and dQ measured on every earlier row i < j. Recipes: "
        f"{', '.join(config.recipes)}"
        + (f"; the fix does not apply to {', '.join(skipped)} (V is not a block format)"
           if skipped else "") + ".\n\n"
    )
    text = setup + "## What the numbers show\n\n" + "".join(f"- {s}\n" for s in _findings(table))
    text += ("\n## Per recipe\n\nchanged: share of earlier rows with any changed bit; "
             "change: ||O' - O|| / ||O|| over the earlier rows (mean over positions); max row: "
             "the largest ||O'_i - O_i|| / ||O_i|| of one row; reach: the largest j - i that "
             "changed; own error: the recipe's relative error on those rows against exact "
             "attention.\n\n")
    text += markdown_table(table, {
        "recipe": "recipe", "leakage_fix": "fix", "tensor": "tensor", "changed": "changed",
        "rel_change": "change", "max_row_change": "max row", "reach": "reach",
        "own_error": "own error", "leak_over_error": "change / own error"}) + "\n"
    return text, _figures(tables.get("profile"))


def _figures(profile: pd.DataFrame | None) -> dict[str, Figure]:
    if profile is None or profile.empty or not (profile["mean_rel_change"] > 0).any():
        return {}
    rows = profile.assign(recipe=[f"{r}+fix" if f else r for r, f in
                                  zip(profile["recipe"], profile["leakage_fix"], strict=True)])
    rows = rows[rows.groupby("recipe")["mean_rel_change"].transform("max") > 0]
    fig = Figure(figsize=(10, 4), layout="constrained")
    axes = fig.subplots(1, len(TENSORS), sharey=True)
    for ax, tensor in zip(axes, TENSORS, strict=True):
        part = rows[(rows["tensor"] == tensor) & (rows["mean_rel_change"] > 0)]
        sns.lineplot(data=part, x="distance", y="mean_rel_change", hue="recipe", ax=ax,
                     legend=tensor == TENSORS[-1])
        ax.set_yscale("log")
        ax.set_xlabel("distance j - i of the earlier row")
        ax.set_title(f"{tensor}: mean relative change at i < j")
    fig.suptitle("What a later token does to earlier rows")
    return {"leak_profile": fig}
