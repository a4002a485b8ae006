"""attention-gradients: which of attention's six products matters for dQ, dK, dV, and which
published recipes give biased gradients.

What. Two sweeps on the default synthetic input (`fp4lab.analysis.synthetic_inputs`: outlier
channels, an attention sink, heavy-tailed V, a small dO) or on activations saved with
`fp4lab.analysis.save_inputs` (`inputs`; its hash is recorded), causal:

- ``product``: one block format on the two operands of one product at a time (S = Q K^T,
  O = P V; the backward's dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q), everything
  else exact: which product's quantization moves which gradient;
- ``preset``: the published recipes (the drop-in FP4 forward with a high-precision backward,
  Attn-QAT, FA4-FP4's causal route and its MXFP4 P/V route, CroissAttn).

Each cell runs `fp4lab.compare` (errors of O, dQ, dK, dV against exact float64 attention)
and `fp4lab.gradient_bias` against both references: "exact" (the exact gradient of exact
attention: the forward's rounding and the backward's bias together) and "forward" (the exact
gradient of the recipe's own quantized forward: the backward alone). The bias is the mean
over `samples` stochastic-rounding draws of <g_i - g*, g*> / <g*, g*> with its standard error
and Student's t; the N-sample averaging curve (Quartet II, arXiv 2601.22813) is stored as the
``convergence`` table: an unbiased estimator's error of the mean falls as 1/N, a biased one
flattens at its squared bias.

Claims set against the numbers. Attn-QAT (arXiv 2603.00040): a drop-in FP4 forward with a
high-precision backward is inconsistent; SageBwd (arXiv 2603.02170): the error of low-bit
attention's gradient comes mostly from dS (the dq and dk products); CroissAttn (talk):
stochastic rounding makes its backward unbiased. The report says which of these the data
support at this size, without a tolerance tuned to them: "unbiased" means |t| <= z.

Caveats. A deterministic recipe gives the same gradient on every draw: its bias is its
error (no sampling), reported as such. The input is one draw of the synthetic model; the
reference path only (compare and gradient_bias take no backend).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import seaborn as sns
from matplotlib.figure import Figure

import fp4lab
from fp4lab.analysis import plots
from fp4lab.formats import QuantSpec, get
from fp4lab.recipes import OPERAND_FIELDS, AttentionRecipe, Product, resolve_recipe
from fp4lab.studies import describe_inputs, markdown_table, resolve_inputs, study_inputs

QUESTION = (
    "Which of attention's six products matters for dQ, dK and dV when quantized alone, and "
    "are the published recipes' gradients biased, against exact attention and against the "
    "exact gradient of their own forward?"
)
BACKENDS = ("reference",)  # compare and gradient_bias run the simulation path

PRODUCTS = tuple(p.value for p in Product)
PRESET_RECIPES = ("attn_qat_dropin", "attn_qat", "fa4fp4_causal", "fa4fp4_causal_mxfp4pv",
                  "croissattn", "croissattn_eden")
REFERENCES = ("exact", "forward")
GRADIENTS = ("dq", "dk", "dv")


@dataclass(frozen=True)
class AttentionGradientsConfig:
    batch: int = 1  # the synthetic input's batch
    heads: int = 4  # its heads
    seq: int = 1024  # its tokens
    head_dim: int = 128  # croissattn_eden's Hadamard transform spans 128 along head_dim
    block_m: int = 128  # query tile
    block_n: int = 128  # key tile
    causal: bool = True  # causal mask (the training routes are causal)
    one_at_a_time: tuple[str, ...] = ("nvfp4", "nvfp4_sr")  # block formats, one product each
    products: tuple[str, ...] = PRODUCTS  # the products quantized one at a time
    recipes: tuple[str, ...] = PRESET_RECIPES  # registered attention recipes
    references: tuple[str, ...] = REFERENCES  # gradient_bias references
    samples: int = 32  # stochastic-rounding draws averaged
    z: float = 3.0  # |t| <= z reads as unbiased
    inputs: str | None = None  # a save_inputs file instead of the synthetic model
    inputs_sha256: str | None = None  # the file's hash (recorded; checked when given)

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq", "head_dim", "block_m", "block_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        path, sha = resolve_inputs(self.inputs, self.inputs_sha256)
        object.__setattr__(self, "inputs", path)
        object.__setattr__(self, "inputs_sha256", sha)
        if self.samples < 2:
            raise ValueError(f"samples must be >= 2, got {self.samples}")
        for name in self.one_at_a_time:
            get(name, QuantSpec)
        for name in self.recipes:
            _check_hadamard(resolve_recipe(name), self.head_dim, self.seq)
        for name, allowed in (("products", PRODUCTS), ("references", REFERENCES)):
            for value in getattr(self, name):
                if value not in allowed:
                    raise ValueError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


def _check_hadamard(recipe: AttentionRecipe, head_dim: int, seq: int) -> None:
    """A Hadamard transform along an operand's axis needs that axis a multiple of its size
    (checked on both head_dim and seq, the axes the operands are blocked along)."""
    for field in OPERAND_FIELDS:
        spec = getattr(recipe, field)
        size = getattr(spec, "hadamard", None)
        if size and (head_dim % size or seq % size):
            raise ValueError(f"recipes: {recipe.name}'s {field} takes a Hadamard transform of "
                             f"{size}: head_dim ({head_dim}) and seq ({seq}) must be multiples")


PRESETS = {
    "smoke": AttentionGradientsConfig(
        heads=2, seq=256, head_dim=64, block_m=64, block_n=64, one_at_a_time=("nvfp4_sr",),
        samples=4,
        recipes=("attn_qat_dropin", "attn_qat", "fa4fp4_causal", "fa4fp4_causal_mxfp4pv",
                 "croissattn"),
    ),
    "full": AttentionGradientsConfig(),
}


def cells(config: AttentionGradientsConfig) -> list[dict]:
    found = [{"group": "product", "recipe": f"{fmt}@{product}", "format": fmt,
              "product": product}
             for fmt in config.one_at_a_time for product in config.products]
    found += [{"group": "preset", "recipe": name, "format": None, "product": None}
              for name in config.recipes]
    return found


def recipe_for(cell: dict) -> AttentionRecipe:
    """The preset, or the cell's format on the two operands of its product alone."""
    if cell["group"] == "preset":
        return resolve_recipe(cell["recipe"])
    fields = Product(cell["product"]).fields
    return AttentionRecipe(name=cell["recipe"], **{f: cell["format"] for f in fields},
                           source="studies/attention_gradients.py")


def run_cell(config: AttentionGradientsConfig, cell: dict, ctx) -> dict:
    x = study_inputs(config.inputs, ctx.seed, batch=config.batch, heads=config.heads,
                     seq=config.seq, head_dim=config.head_dim)
    recipe = recipe_for(cell)
    tiles = dict(causal=config.causal, block_m=config.block_m, block_n=config.block_n)
    x_dev = [t.to(ctx.device) for t in (x.q, x.k, x.v, x.do)]
    errors = fp4lab.compare(*x_dev, recipe, generator=ctx.cell_seed if recipe.stochastic
                            else None, trace=False, **tiles).errors.set_index("tensor")
    rows = {t: {"tensor": t, "rel_l2": errors.loc[t, "rel_l2"], "cosine": errors.loc[t, "cosine"]}
            for t in ("o", *GRADIENTS)}
    curves = []
    for reference in config.references:
        bias = fp4lab.gradient_bias(*x_dev, recipe, samples=config.samples,
                                    seed=ctx.cell_seed, reference=reference, **tiles)
        for _, r in bias.tensors.iterrows():
            rows[r["tensor"]].update({f"{c}_{reference}": r[c] for c in (
                "rel_bias", "se", "t", "p_value", "rel_err_mean", "rel_noise")})
        curves += [{"reference": reference, **r} for r in
                   bias.convergence.to_dict("records")]
        for row in rows.values():
            row["samples"] = bias.samples
    return {"metrics": list(rows.values()), "convergence": curves}


# -- the report ----------------------------------------------------------------------------


def _products_section(config, metrics: pd.DataFrame) -> tuple[str, list[str]]:
    rows = metrics[(metrics["group"] == "product") & metrics["tensor"].isin(GRADIENTS)]
    if rows.empty:
        return "", []
    text = ("## One product at a time\n\nRelative L2 error of each gradient against exact "
            "attention when only the named product's two operands are quantized.\n\n")
    short = []
    for fmt, group in rows.groupby("format", sort=False):
        wide = group.pivot_table(index="product", columns="tensor", values="rel_l2",
                                 sort=False).reindex(columns=list(GRADIENTS))
        text += f"{fmt}:\n\n" + markdown_table(wide.reset_index()) + "\n"
        if (group["samples"] > 1).any() and "t_forward" in group:
            reached = group.assign(t_forward=group["t_forward"].where(group["rel_l2"] > 1e-5))
            t = reached.pivot_table(index="product", columns="tensor", values="t_forward",
                                    sort=False, dropna=False).reindex(columns=list(GRADIENTS))
            text += ("t statistic of the bias against the recipe's own forward (|t| <= "
                     f"{config.z:g}: unbiased; a gradient the product does not reach is exact, "
                     "its t undefined):\n\n" + markdown_table(t.reset_index()) + "\n")
        for tensor in GRADIENTS:
            top = wide[tensor].idxmax()
            short.append(f"{fmt} one product at a time: {tensor} moves most when {top} is "
                         f"quantized (relative error {wide.loc[top, tensor]:.3g}; next "
                         f"{wide[tensor].drop(top).max():.3g}).")
        ds = wide.loc[wide.index.intersection(["dq", "dk"]), ["dq", "dk"]].max().max()
        rest = wide.loc[wide.index.difference(["dq", "dk"]), ["dq", "dk"]].max().max()
        verdict = "supports" if ds > rest else "does not support"
        short.append(f"{fmt}: the dS products (dq, dk) give dQ/dK errors up to {ds:.3g}, the "
                     f"other products up to {rest:.3g}: {verdict} SageBwd's 'mostly from dS'.")
    return text, short


def _presets_section(config, metrics: pd.DataFrame) -> tuple[str, list[str]]:
    rows = metrics[(metrics["group"] == "preset") & metrics["tensor"].isin(GRADIENTS)]
    if rows.empty:
        return "", []
    text = ("## Published recipes\n\nrel_l2: error against exact attention; rel_bias_<ref>: "
            "the mean relative bias along the reference gradient, t_<ref> its t statistic "
            f"({config.samples} draws for stochastic recipes; a deterministic recipe's bias "
            "is its error).\n\n")
    columns = {"recipe": "recipe", "tensor": "tensor", "rel_l2": "rel_l2"}
    for ref in config.references:
        columns |= {f"rel_bias_{ref}": f"rel_bias_{ref}", f"t_{ref}": f"t_{ref}"}
    text += markdown_table(rows, columns) + "\n"
    short = []
    stochastic = rows[rows["samples"] > 1]
    for ref in config.references if len(stochastic) else ():
        biased = stochastic[stochastic[f"t_{ref}"].abs() > config.z]
        named = ", ".join(f"{r} {g}" for r, g in zip(biased["recipe"], biased["tensor"],
                                                      strict=True))
        short.append(f"Against the {ref} gradient, {len(stochastic) - len(biased)} of "
                     f"{len(stochastic)} (recipe, tensor) pairs of the stochastic recipes are "
                     f"unbiased within |t| <= {config.z:g}" + (f"; biased: {named}." if named
                                                                else "."))
    drop = rows[rows["recipe"] == "attn_qat_dropin"].set_index("tensor")
    qat = rows[rows["recipe"] == "attn_qat"].set_index("tensor")
    if len(drop) and len(qat):
        worse = [g for g in GRADIENTS if drop.loc[g, "rel_l2"] > qat.loc[g, "rel_l2"]]
        short.append(f"The drop-in backward's gradients are further from exact than Attn-QAT's "
                     f"in {len(worse)} of 3 ({', '.join(worse) or 'none'}; Attn-QAT's claim: "
                     "the drop-in is inconsistent).")
    return text, short


def _convergence_section(config, table: pd.DataFrame | None) -> tuple[str, list[str]]:
    """Averaging: the error of the N-draw mean over the noise-only 1/N line, at N."""
    if table is None or table.empty:
        return "", []
    last = table.loc[table.groupby(["recipe", "reference", "tensor"], sort=False)["n"].idxmax()]
    # only curves with noise: a gradient the quantized product does not reach is exact
    last = last[(last["n"] > 1) & (last["noise_only"] > 1e-12)]
    last = last.assign(ratio=last["rel_mse"] / last["noise_only"])
    if last.empty:
        return "", []
    flat = last[last["ratio"] > 2]
    text = (f"## Averaging {int(last['n'].max())} draws\n\nThe error of the mean over what "
            "noise alone would leave (ratio 1: unbiased; above 1: a bias floor).\n\n"
            + markdown_table(last, {"recipe": "recipe", "reference": "reference",
                                    "tensor": "tensor", "rel_mse": "rel. MSE of mean",
                                    "noise_only": "noise only", "ratio": "ratio"}) + "\n")
    return text, [f"Averaging: {len(flat)} of {len(last)} (recipe, reference, tensor) curves "
                  "flatten above twice the noise-only line."]


def report(config: AttentionGradientsConfig, metrics: pd.DataFrame, tables: dict):
    setup = (
        "## Setup\n\n"
        f"Inputs: {_source(config)}, {'causal' if config.causal else 'non-causal'}, "
        f"tiles {config.block_m} x {config.block_n}; one at a time: "
        f"{', '.join(config.one_at_a_time)} on {', '.join(config.products)}; recipes "
        f"{', '.join(config.recipes)}; gradient_bias against {', '.join(config.references)} "
        f"with {config.samples} draws.\n\n"
    )
    table = tables.get("convergence")
    sections = [_products_section(config, metrics), _presets_section(config, metrics),
                _convergence_section(config, table)]
    short = "".join(f"- {line}\n" for _, lines in sections for line in lines)
    text = setup + "## What the numbers show\n\n" + short + "\n"
    text += "".join(body for body, _ in sections)
    return text, _figures(metrics, table)


def _source(config: AttentionGradientsConfig) -> str:
    return describe_inputs(config.inputs, config.inputs_sha256, batch=config.batch,
                           heads=config.heads, seq=config.seq, head_dim=config.head_dim)


def _figures(metrics: pd.DataFrame, table: pd.DataFrame | None) -> dict[str, Figure]:
    figures = {}
    rows = metrics[metrics["tensor"].isin(GRADIENTS)]
    if len(rows):
        fig = Figure(figsize=(7, 0.3 * rows["recipe"].nunique() * 3 + 1.5), layout="constrained")
        ax = fig.subplots()
        sns.barplot(data=rows, y="recipe", x="rel_l2", hue="tensor", ax=ax)
        ax.set_xscale("log")
        ax.set_xlabel("relative L2 error against exact attention")
        figures["gradient_errors"] = fig
    if table is not None and (table["n"] > 1).any():
        chosen = table[(table["reference"] == "forward") & (table["n"].groupby(
            [table["recipe"]]).transform("max") > 1)]
        names = list(dict.fromkeys(chosen["recipe"]))[:6]
        if names:
            fig = Figure(figsize=(4.5 * min(len(names), 3), 3.8 * math.ceil(len(names) / 3)),
                         layout="constrained")
            axes = fig.subplots(math.ceil(len(names) / 3), min(len(names), 3), squeeze=False)
            for ax, name in zip(axes.flat, names, strict=False):
                plots.convergence_curve(chosen[chosen["recipe"] == name], ax=ax)
                ax.set_title(f"{name} (vs own forward)", fontsize=9)
            for ax in list(axes.flat)[len(names):]:
                ax.set_visible(False)
            figures["averaging"] = fig
    return figures
