"""scale-range: which block size and scale format P and dS need, measured inside attention.

What. P (the softmax numerators P = exp(S - m), m the running row maximum, in the forward's
O = P V; the rebuilt, normalized P = exp(S - lse) in the backward's dV = P^T dO) and dS
(P * (dP - D), in dQ = dS K along the keys and dK = dS^T Q along the queries) are narrow in
an unusual way: non-negative (P) or tiny (dS is of the size of dO times P, 1e-3 and far
below on the default input), with most entries many binades below their tile's largest. A
block format's scale must reach down to them. This study quantizes P alone, or P and dS of
the backward alone, with E2M1 elements in blocks of 8 to 64 along each product's reduction
axis under every scale format:

- E8M0 (a power of two, 2^-127 .. 2^127) with each rule: OCP's floor (which clips the
  block maximum), ceil, even, rceil, and fp4-fa4's alpha-grid rules (alpha_ceil, alpha_mse,
  alpha_half, alpha_rte);
- UE4M3 (2^-9 .. 448) alone, and under a float32 tensor scale taken per tile (NVFP4's
  two-level scaling; a fused kernel sees one tile of P or dS at a time);
- UE5M3 (2^-17 .. 114688) alone.

Each format is the named preset (`mxfp4` with the rule, `nvfp4_1level`, `nvfp4`,
`nvfp4_ue5m3`) with its block size replaced, so its arithmetic is the preset's. Every other
operand stays unquantized in float32, so the error against exact float64 attention is this
operand's alone (float32's own is ~1e-7).

Taken from attention, not assumed. The P and dS measured are those `fp4lab.attention`
computes on the study's input (the default synthetic model, or activations saved with
`fp4lab.analysis.save_inputs`), tiled and normalized as a FlashAttention kernel does, and
the statistics are read from its `Trace`: per tile, the operand's relative error, the
fractions of its nonzeros flushed to zero and clipped, the fractions of its blocks whose
ideal scale fell below (underflow) or above (overflow) the scale format's range, the
probability mass flushed, and the product tile's error. The effect downstream is the error
of O (forward) and of dV, dQ, dK (backward) against exact attention.

Caveats. Tile statistics are averaged over tiles with equal weight (a tile of tiny P counts
as much as the sink's); the end-to-end errors weigh by magnitude. A lift (`lifts`) multiplies
P and dS before quantizing and divides after (fp4-fa4 stores 256 dS): it moves a narrow
range into UE4M3's and UE5M3's, and changes nothing for E8M0 away from its ends.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

import fp4lab
from fp4lab.formats import (
    MXFP4,
    NVFP4,
    NVFP4_1LEVEL,
    NVFP4_UE5M3,
    FloatFormat,
    QuantSpec,
    ScaleRule,
    get,
)
from fp4lab.recipes import AttentionRecipe, Trace
from fp4lab.studies import describe_inputs, markdown_table, resolve_inputs, study_inputs

QUESTION = (
    "Which block size (8 to 64) and scale format (E8M0 with each rule, UE4M3 with and without "
    "a tensor scale, UE5M3) do P and dS need, on the distributions they have inside "
    "attention: how much of them underflows, flushes or clips, and what does it cost O, dQ, "
    "dK and dV?"
)

_E8M0_RULES = tuple(r for r in ScaleRule if r is not ScaleRule.NEAREST)
# scale format -> (the preset it is built from, the E8M0 rule it takes, or None)
SCALES = {
    **{f"e8m0_{r.value}": (MXFP4, r) for r in _E8M0_RULES},
    "ue4m3": (NVFP4_1LEVEL, None),
    "ue4m3_tensor": (NVFP4, None),
    "ue5m3": (NVFP4_UE5M3, None),
}
PASSES = ("forward", "backward")
# operand: (pass, trace product, what it is, the tensor its error reaches)
OPERANDS = {
    "p": ("forward", "pv", "P in O = P V, against the running maximum", "o"),
    "p_dv": ("backward", "dv", "P in dV = P^T dO, normalized, along the queries", "dv"),
    "ds_dq": ("backward", "dq", "dS in dQ = dS K, along the keys", "dq"),
    "ds_dk": ("backward", "dk", "dS in dK = dS^T Q, along the queries", "dk"),
}


@dataclass(frozen=True)
class ScaleRangeConfig:
    batch: int = 1  # the synthetic input's batch
    heads: int = 4  # its heads
    seq: int = 2048  # its tokens
    head_dim: int = 128  # its head dimension
    inputs: str | None = None  # a save_inputs file instead of the synthetic model
    inputs_sha256: str | None = None  # the file's hash (recorded; checked when given)
    causal: bool = True  # causal mask
    block_m: int = 128  # query tile (a multiple of every block size)
    block_n: int = 128  # key tile
    block_sizes: tuple[int, ...] = (8, 16, 32, 64)  # elements sharing a scale
    scales: tuple[str, ...] = tuple(SCALES)  # scale formats (SCALES)
    element: str = "fp4_e2m1"  # the element format
    passes: tuple[str, ...] = PASSES  # forward: P; backward: P and dS
    lifts: tuple[float, ...] = (1.0, 256.0)  # P and dS multiplied before quantizing

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq", "head_dim", "block_m", "block_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        path, sha = resolve_inputs(self.inputs, self.inputs_sha256)
        object.__setattr__(self, "inputs", path)
        object.__setattr__(self, "inputs_sha256", sha)
        get(self.element, FloatFormat)
        for name, allowed in (("scales", SCALES), ("passes", PASSES)):
            for value in getattr(self, name):
                if value not in allowed:
                    raise ValueError(f"{name}: {value!r} is not one of {', '.join(allowed)}")
        for n in self.block_sizes:
            if n < 1 or self.block_m % n or self.block_n % n:
                raise ValueError(f"block_sizes: {n} must be positive and divide block_m "
                                 f"({self.block_m}) and block_n ({self.block_n})")
        if not all(s > 0 and math.isfinite(s) for s in self.lifts):
            raise ValueError(f"lifts must be positive finite numbers, got {self.lifts}")


PRESETS = {
    "smoke": ScaleRangeConfig(heads=2, seq=512, head_dim=64, lifts=(1.0,)),
    "full": ScaleRangeConfig(),
}


def cells(config: ScaleRangeConfig) -> list[dict]:
    return [{"pass": p, "scale": s, "block": n, "lift": float(lift)}
            for p in config.passes for s in config.scales for n in config.block_sizes
            for lift in config.lifts]


def block_format(scale: str, block: int, element: str) -> QuantSpec:
    """The preset of `scale` (SCALES) with `block` elements of `element` per scale."""
    base, rule = SCALES[scale]
    fields = {"block": (block,), "element": get(element, FloatFormat)}
    if rule is not None:
        fields["scale_rule"] = rule
    return dataclasses.replace(base, name=f"{scale}@{block}", **fields)


def recipe_for(config: ScaleRangeConfig, cell: dict) -> AttentionRecipe:
    """P alone (forward), or the backward's P and dS alone, in the cell's block format."""
    spec = block_format(cell["scale"], cell["block"], config.element)
    name = f"{cell['pass']}:{spec.name},S={cell['lift']:g}"
    if cell["pass"] == "forward":
        fields = dict(p=spec, p_lift=cell["lift"])
    else:
        fields = dict(dv_p=spec, dq_ds=spec, dk_ds=spec, dv_p_lift=cell["lift"],
                      ds_lift=cell["lift"])
    return AttentionRecipe(name=name, **fields, source="studies/scale_range.py")


# -- one cell ------------------------------------------------------------------------------


def _inputs(config: ScaleRangeConfig, seed: int, device: str):
    x = study_inputs(config.inputs, seed, batch=config.batch, heads=config.heads,
                     seq=config.seq, head_dim=config.head_dim)
    return [t.to(device) for t in (x.q, x.k, x.v, x.do)]


def _run(config: ScaleRangeConfig, recipe, tensors, backward: bool, backend: str,
         trace: Trace | None = None):
    """(O, dQ, dK, dV) of one call (gradients None for a forward alone), in float64."""
    q, k, v, do = tensors
    leaves = [t.clone().requires_grad_(backward) for t in (q, k, v)]
    o = fp4lab.attention(*leaves, recipe, causal=config.causal, block_m=config.block_m,
                         block_n=config.block_n, trace=trace, backend=backend)
    if backward:
        o.backward(do)
    grads = [t.grad.double() if backward else None for t in leaves]
    return [o.detach().double(), *grads]


@functools.lru_cache(maxsize=1)
def _exact(config: ScaleRangeConfig, seed: int, device: str):
    """Exact attention in float64 on the reference path: the oracle, whatever the backend."""
    tensors = [t.double() for t in _inputs(config, seed, device)]
    return _run(config, "exact", tensors, True, "reference")


def run_cell(config: ScaleRangeConfig, cell: dict, ctx) -> list[dict]:
    backward = cell["pass"] == "backward"
    trace = Trace()
    got = _run(config, recipe_for(config, cell), _inputs(config, ctx.seed, ctx.device),
               backward, ctx.backend, trace)
    exact = dict(zip(("o", "dq", "dk", "dv"), _exact(config, ctx.seed, ctx.device),
                     strict=True))
    got = dict(zip(("o", "dq", "dk", "dv"), got, strict=True))
    frame = trace.to_frame()
    spec = block_format(cell["scale"], cell["block"], config.element)
    rows = []
    for operand, (pass_, product, _, tensor) in OPERANDS.items():
        if pass_ != cell["pass"]:
            continue
        rows.append({"operand": operand, "tensor": tensor,
                     "bits_per_element": spec.bits_per_element,
                     **_tile_stats(frame[frame["product"] == product]),
                     **_error(got[tensor], exact[tensor])})
    return rows


def _tile_stats(tiles: pd.DataFrame) -> dict:
    """Means over the product's tiles of its left operand's (P's or dS's) statistics."""
    return {
        "tile_err": tiles["a_err"].mean(),
        "tile_err_median": tiles["a_err"].median(),
        "flushed": tiles["a_flushed"].mean(),
        "clipped": tiles["a_clipped"].mean(),
        "scale_underflow": tiles["a_scale_underflow"].mean(),
        "scale_overflow": tiles["a_scale_overflow"].mean(),
        "p_mass_lost": tiles.groupby(["batch", "head", "q_tile"])["p_mass_lost"].sum().mean(),
        "prod_err": tiles["prod_err"].mean(),
    }


def _error(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative L2 error and magnitude bias 1 - <x, r>/<r, r> against the exact tensor."""
    norm = ref.square().sum()
    return {"rel_l2": ((x - ref).norm() / norm.sqrt()).item(),
            "magnitude_bias": (1 - (x * ref).sum() / norm).item()}


# -- the report ----------------------------------------------------------------------------


def _operand_section(config, rows: pd.DataFrame, operand: str) -> tuple[str, list[str]]:
    _, _, what, tensor = OPERANDS[operand]
    text = f"### {operand}: {what}\n\n"
    short = []
    for lift, group in rows.groupby("lift", sort=False):
        wide = group.pivot_table(index="scale", columns="block", values="rel_l2", sort=False)
        under = group.pivot_table(index="scale", columns="block", values="scale_underflow",
                                  sort=False)
        flushed = group.pivot_table(index="scale", columns="block", values="flushed",
                                    sort=False)
        label = f"lift {lift:g}"
        text += (f"Relative L2 error of {tensor} against exact attention ({label}):\n\n"
                 + markdown_table(wide.add_prefix("block ").reset_index()) + "\n"
                 + "Fraction of blocks whose ideal scale underflows the scale format:\n\n"
                 + markdown_table(under.add_prefix("block ").reset_index()) + "\n"
                 + "Fraction of nonzeros flushed to zero (mean over tiles):\n\n"
                 + markdown_table(flushed.add_prefix("block ").reset_index()) + "\n")
        short += _operand_findings(operand, tensor, label, wide, under)
    return text, short


def _operand_findings(operand, tensor, label, wide: pd.DataFrame, under: pd.DataFrame):
    best = wide.stack().idxmin()
    worst = wide.stack().idxmax()
    short = [f"{operand} ({label}): the lowest {tensor} error is {wide.loc[best]:.3g} with "
             f"{best[0]} in blocks of {best[1]}, the highest {wide.loc[worst]:.3g} with "
             f"{worst[0]} in blocks of {worst[1]}."]
    first, last = wide.columns.min(), wide.columns.max()
    if first != last:
        falls = wide[wide[first] < wide[last]].index.tolist()
        short.append(f"{operand} ({label}): blocks of {first} beat blocks of {last} for "
                     f"{len(falls)} of {len(wide)} scale formats; error at {last} over error "
                     f"at {first}: {_span(wide, first, last)}.")
    worst_under = under.max(axis=1)
    named = [f"{s} (up to {u:.2g})" for s, u in worst_under.items() if u > 0.01]
    short.append(f"{operand} ({label}): block scales underflow (in more than 1% of blocks) "
                 f"with {', '.join(named) if named else 'no scale format'}.")
    return short


def _span(wide: pd.DataFrame, first, last) -> str:
    ratio = wide[last] / wide[first]
    return f"{ratio.min():.2f} ({ratio.idxmin()}) to {ratio.max():.2f} ({ratio.idxmax()})"


def _rules_findings(rows: pd.DataFrame) -> list[str]:
    """OCP's floor against the other E8M0 rules: clipping, and its cost."""
    e8 = rows[rows["scale"].str.startswith("e8m0_")]
    if "e8m0_ocp_floor" not in set(e8["scale"]) or e8["scale"].nunique() < 2:
        return []
    means = e8.groupby(["operand", "scale"], sort=False)[["rel_l2", "clipped"]].mean()
    short = []
    for operand in dict.fromkeys(e8["operand"]):
        m = means.loc[operand]
        floor, others = m.loc["e8m0_ocp_floor"], m.drop("e8m0_ocp_floor")
        best = others["rel_l2"].idxmin()
        short.append(f"{operand}, E8M0 rules (means over block sizes): OCP's floor clips "
                     f"{floor['clipped']:.2g} of nonzeros, error {floor['rel_l2']:.3g}; the "
                     f"best other rule is {best} ({others.loc[best, 'rel_l2']:.3g}, clipping "
                     f"{others.loc[best, 'clipped']:.2g}).")
    return short


def report(config: ScaleRangeConfig, metrics: pd.DataFrame):
    source = describe_inputs(config.inputs, config.inputs_sha256, batch=config.batch,
                             heads=config.heads, seq=config.seq, head_dim=config.head_dim)
    setup = (
        "## Setup\n\n"
        f"Inputs: {source}; {'causal' if config.causal else 'non-causal'}, tiles "
        f"{config.block_m} x {config.block_n}. Elements {config.element}; blocks of "
        f"{', '.join(map(str, config.block_sizes))} along each product's reduction axis; "
        f"scale formats {', '.join(config.scales)} (each the named preset with its block "
        f"size replaced); lifts {', '.join(f'{s:g}' for s in config.lifts)}. Only the named "
        "operand is quantized (the forward's P, or the backward's P and dS); errors against "
        "exact float64 attention; tile statistics from fp4lab's Trace.\n\n"
    )
    sections = [_operand_section(config, metrics[metrics["operand"] == op], op)
                for op in OPERANDS if op in set(metrics["operand"])]
    short = [line for _, lines in sections for line in lines] + _rules_findings(metrics)
    text = setup + "## What the numbers show\n\n" + "".join(f"- {s}\n" for s in short) + "\n"
    text += "## Per operand\n\n" + "".join(body for body, _ in sections)
    return text, _figures(metrics)


def _figures(metrics: pd.DataFrame) -> dict[str, Figure]:
    figures = {}
    rows = metrics[metrics["lift"] == metrics["lift"].min()]
    operands = list(dict.fromkeys(rows["operand"]))
    for column, label, log in (("rel_l2", "error against exact attention", True),
                               ("scale_underflow", "blocks whose scale underflows", False)):
        fig = Figure(figsize=(4.2 * len(operands), 4.2), layout="constrained")
        axes = fig.subplots(1, len(operands), squeeze=False)[0]
        for ax, operand in zip(axes, operands, strict=True):
            part = rows[rows["operand"] == operand]
            sns.lineplot(data=part, x="block", y=column, hue="scale", marker="o", ax=ax,
                         legend=operand == operands[-1])
            ax.set_xscale("log", base=2)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"{operand} ({OPERANDS[operand][3]})", fontsize=9)
            ax.set_ylabel(label)
        if len(axes):
            axes[-1].legend(fontsize=7, loc="best")
        fig.suptitle(f"{label} against block size (lift {rows['lift'].min():g})")
        figures[column] = fig
    return figures
