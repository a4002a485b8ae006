"""mxfp4-pv-mechanisms: which mechanism of the MXFP4 P/V route moves the gradients, one at a
time, in a single forward and backward against the FP8 P/V route on the same input.

What. "Hardware-Aware FP4 FlashAttention-4" (MrHuff/fp4-fa4) trains with NVFP4 Q/K and FP8
P/V, and every run with MXFP4 P/V diverged, cause unresolved. Its two causal routes
(`fa4fp4_causal`, `fa4fp4_causal_mxfp4pv`; `fp4lab.recipes.presets` cites the released code)
share Q/K and the v509 backward, and differ in five places: P's format and E8M0 rule (Direct-P
codes, alpha_ceil), P's row reference (an anchor of the first 32 keys plus 64 ln 2, block
exponents floored at -94), the softmax denominator (summed from the represented P), V's format
and rule (MXFP4 along the sequence, alpha_mse) and the backward's view of V (E4M3 of the
forward's MXFP4 V^). Each candidate mechanism is one contrast of two recipes that differ only
in it:

- on the FP8 route (the primary measurement): the FP8 route with the mechanism switched on
  against the FP8 route (or, for a refinement of MXFP4 P or V, against the FP8 route with
  that MXFP4 operand but without the refinement);
- on the MXFP4 route: the route against the route with the mechanism switched off (or, for
  what the route does not do, the route with it against the route).

The mechanisms: P's E8M0 scale rule (OCP's floor, which clips the block maximum, and the
route's alpha_ceil); P underflow and lost mass (the route's anchor row reference and
exponent floor); the denominator summed from represented P (`RowSum`); V's E8M0 rule (OCP's
floor, the route's alpha_mse); V's sequence-axis blocks leaking the future (what MatX's fix,
`AttentionRecipe.leakage_fix`, removes on the diagonal blocks); the mismatch between the
forward's MXFP4 V^ and the backward's E4M3 view of it (`BackwardV`, `dp_v`), and, as a
counterfactual the route avoids, a backward reading E4M3 of the unquantized V.

Measured, per contrast and gradient (dQ, dK, dV; and O): the effect ||g_v - g_c|| / ||g_c||
of switching the mechanism on (v: with it, c: without), split into its bias along the
gradient, <g_v - g_c, g_c> / <g_c, g_c> (a systematic shrink or growth, consistent or not
across tiles: the t statistic of the per-tile biases over the tiles), and the scatter
orthogonal to it; each recipe's error against exact float64 attention; its backward's bias
against the exact gradient of its own forward (`fp4lab.analysis.gradient_bias`, reference
"forward": deterministic recipes, so the bias is that error); what a later token does to
earlier rows' O and dQ (the causal-leakage study's measurement); and from the `Trace`, P's
flushed fraction, lost probability mass and scale underflow, V's error, the backward's
view of V against the unquantized V, and how far the backward's P (dV = P^T dO) is from the
P^ the forward consumed (``p_fwd_mismatch``).

The ranking. The yardstick is the gap, ||g_R - g_B|| / ||g_B|| of the MXFP4 route R against
the FP8 route B. A mechanism's effect in the ranking is the distance from B it adds, in
quadrature: with a = ||g_v - g_B|| / ||g_B|| and b = ||g_c - g_B|| / ||g_B||, sign(a^2 - b^2)
sqrt(|a^2 - b^2|) (a itself when the control is B; independent rounding errors add in
quadrature, so re-rounding the same operand differently does not count as an effect, and a
negative value means switching the mechanism on brings the gradient closer to B's).
Mechanisms are ranked per gradient by that effect on the FP8 route, and overall by their
largest share of the gap over dQ, dK, dV and both contexts; a mechanism of the route is
named for the training study (issue 11) when that share reaches `must_test_share` (0.5: a
quarter of the gap's squared norm), or when it lets a later token move earlier rows' O or dQ
by more than `must_test_leak` (a train/decode skew no one-step error shows). The ranking is
also the results folder's ranking.parquet / ranking.csv.

Caveats. A contrast between two FP4 roundings of the same operand (a refinement against its
control) has a direct effect ||g_v - g_c|| that is mostly the difference of two rounding
patterns (reported, with its bias, in "Every contrast"); the quadrature effect and the bias
are the parts to read. One input, one step: the effect of a mechanism on
training (accumulation over steps, feedback through the weights) is the training study's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure

import fp4lab
from fp4lab.analysis import gradient_bias
from fp4lab.formats import QuantSpec, ScaleRule
from fp4lab.recipes import AttentionRecipe, BackwardV, Trace, resolve_recipe
from fp4lab.studies import (
    describe_inputs,
    load_study,
    markdown_table,
    resolve_inputs,
    study_inputs,
)

QUESTION = (
    "Which candidate mechanism of the MXFP4 P/V divergence (P's and V's E8M0 scale rules, the "
    "represented denominator, P underflow, V's future-leaking sequence blocks, the backward's "
    "E4M3 view of the forward's MXFP4 V) moves dQ, dK and dV most, measured one at a time "
    "against the FP8 P/V route on the same input, and which must the training study test?"
)
BACKENDS = ("reference",)  # gradient_bias and the backward run the simulation path

TENSORS = ("o", "dq", "dk", "dv")
GRADIENTS = ("dq", "dk", "dv")
CONTEXTS = ("fp8_route", "mxfp4_route")
# the fields that make up the route's P (its format and how P is formed before it)
P_FIELDS = ("p", "p_quant", "p_lift", "row_reference", "lazy_rescale_log2", "anchor_keys",
            "anchor_margin", "direct_p_affine", "direct_p_affine_groups", "p_min_exponent",
            "p_scale_shift")


# -- the mechanisms ------------------------------------------------------------------------


def _on(base: AttentionRecipe, name: str, **fields) -> AttentionRecipe:
    return dataclasses.replace(base, name=name, doc="", source="studies/mxfp4_pv_mechanisms.py",
                               **fields)


def _ocp(spec: QuantSpec) -> QuantSpec:
    """The route's block format with OCP's floor rule instead of its own."""
    return dataclasses.replace(spec, name=f"{spec.name}_as_ocp_floor",
                               scale_rule=ScaleRule.OCP_FLOOR)


def _route_p(r: AttentionRecipe) -> dict:
    return {f: getattr(r, f) for f in P_FIELDS}


def _route_v(r: AttentionRecipe, **fields) -> dict:
    return {"v": r.v, "backward_v": r.backward_v, **fields}


def _without_underflow(b: AttentionRecipe, r: AttentionRecipe) -> dict:
    """The route's P codes against the FP8 route's row reference, no exponent floor (and so
    no stored-scale shift, which needs one)."""
    return dict(row_reference=b.row_reference, lazy_rescale_log2=b.lazy_rescale_log2,
                p_min_exponent=None, p_scale_shift=0)


Pair = Callable[[AttentionRecipe, AttentionRecipe], tuple[AttentionRecipe, AttentionRecipe]]


@dataclass(frozen=True)
class Mechanism:
    """One candidate: what it is, whether the MXFP4 route has it, and its contrasts
    (variant with it, control without it) on the FP8 route B and on the MXFP4 route R."""

    description: str
    in_route: bool
    fp8: Pair
    mxfp4: Pair | None = None


MECHANISMS = {
    "p_rule_ocp_floor": Mechanism(
        "P in MXFP4 with OCP's floor rule (clips the block maximum), against B's running max",
        False,
        lambda b, r: (_on(b, "B+P(ocp_floor)", p=_ocp(r.p)), b)),
    "p_rule_route": Mechanism(
        "P in MXFP4 with the route's E8M0 rule (alpha_ceil: never clips), against B's "
        "running max", True,
        lambda b, r: (_on(b, "B+P(route rule)", p=r.p), b)),
    "p_anchor_underflow": Mechanism(
        "P as the route forms it: Direct-P codes against its anchor row reference with block "
        "exponents floored (where its underflow and lost mass come from), against the route's "
        "rule on B's running max", True,
        lambda b, r: (_on(b, "B+P(route)", **_route_p(r)), _on(b, "B+P(route rule)", p=r.p)),
        lambda b, r: (r, _on(r, "R-underflow", **_without_underflow(b, r)))),
    "row_sum": Mechanism(
        "the softmax denominator summed from the represented P (RowSum)", True,
        lambda b, r: (_on(b, "B+row_sum", row_sum=r.row_sum), b),
        lambda b, r: (r, _on(r, "R-row_sum", row_sum=b.row_sum))),
    "v_rule_ocp_floor": Mechanism(
        "V in MXFP4 along the sequence with OCP's floor rule (and the route's backward view)",
        False,
        lambda b, r: (_on(b, "B+V(ocp_floor)", **_route_v(r, v=_ocp(r.v))), b),
        lambda b, r: (_on(r, "R+V(ocp_floor)", v=_ocp(r.v)), r)),
    "v_rule_route": Mechanism(
        "V in MXFP4 along the sequence with the route's rule (alpha_mse) and backward view",
        True,
        lambda b, r: (_on(b, "B+V(route)", **_route_v(r)), b),
        lambda b, r: (r, _on(r, "R-V", v=b.v, backward_v=b.backward_v))),
    "v_leakage": Mechanism(
        "V's sequence blocks on the diagonal, where later tokens set earlier rows' scales, "
        "against MatX's leakage fix (forward only: the backward keeps its view of V^)", True,
        lambda b, r: (_on(b, "B+V(route)", **_route_v(r)),
                      _on(b, "B+V(route)+fix", **_route_v(r, leakage_fix=True))),
        lambda b, r: (r, _on(r, "R+fix", leakage_fix=True))),
    "v_view_rounding": Mechanism(
        "the backward's dP on E4M3 of the forward's MXFP4 V^, not on V^ itself", True,
        lambda b, r: (_on(b, "B+V(route)", **_route_v(r)),
                      _on(b, "B+V(route)+exact view", **_route_v(r, dp_v=None))),
        lambda b, r: (r, _on(r, "R+exact view", dp_v=None))),
    "v_view_source": Mechanism(
        "the backward's dP on E4M3 of the unquantized V while the forward used MXFP4 V "
        "(BackwardV.INPUT; the route reads its forward's V^ instead)", False,
        lambda b, r: (_on(b, "B+V(route)+input view", **_route_v(r, backward_v=BackwardV.INPUT)),
                      _on(b, "B+V(route)", **_route_v(r))),
        lambda b, r: (_on(r, "R+input view", backward_v=BackwardV.INPUT), r)),
}
GAP = "mxfp4_route"  # the cell of the gap itself: R against B


@dataclass(frozen=True)
class MechanismsConfig:
    batch: int = 1  # the synthetic input's batch
    heads: int = 8  # its heads
    seq: int = 2048  # its tokens
    head_dim: int = 128  # its head dimension (the routes are fp4-fa4's D128 ones)
    inputs: str | None = None  # a save_inputs file instead of the synthetic model
    inputs_sha256: str | None = None  # the file's hash (recorded; checked when given)
    fp8_route: str = "fa4fp4_causal"  # B: the FP8 P/V route
    mxfp4_route: str = "fa4fp4_causal_mxfp4pv"  # R: the MXFP4 P/V route
    mechanisms: tuple[str, ...] = tuple(MECHANISMS)  # the candidates (MECHANISMS)
    contexts: tuple[str, ...] = CONTEXTS  # on the FP8 route, and on the MXFP4 route
    leak_positions: int = 8  # later tokens perturbed for the leakage measurement
    perturb_scale: float = 4.0  # their Q, K, V, dO rows multiplied by it
    must_test_share: float = 0.5  # named if its effect reaches this share of the gap (0.5:
    # a quarter of the gap's squared norm)
    must_test_leak: float = 0.0  # or if it makes later tokens move earlier rows by more
    z: float = 3.0  # |t| over tiles above z: a bias consistent across tiles
    do_scale: float = 1.0  # dO multiplied by it, a power of two, before every backward: the
    # pv-divergence study's loss-scaled arms (a trained model's dO, about 1e-7, flushes whole
    # under the FP8 route's fixed-scale E5M2(4 dO)); every effect is a relative distance, so
    # in exact arithmetic it changes nothing and only the quantizers see dO larger

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq", "head_dim", "leak_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        path, sha = resolve_inputs(self.inputs, self.inputs_sha256)
        object.__setattr__(self, "inputs", path)
        object.__setattr__(self, "inputs_sha256", sha)
        _check_routes(resolve_recipe(self.fp8_route), resolve_recipe(self.mxfp4_route))
        for name, allowed in (("mechanisms", MECHANISMS), ("contexts", CONTEXTS)):
            for value in getattr(self, name):
                if value not in allowed:
                    raise ValueError(f"{name}: {value!r} is not one of {', '.join(allowed)}")
        if "fp8_route" not in self.contexts:
            raise ValueError("contexts must hold fp8_route: the ranking is on the FP8 route")
        for name in ("must_test_share", "z", "perturb_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        mantissa = math.frexp(self.do_scale)[0] if math.isfinite(self.do_scale) else 0.0
        if not (self.do_scale > 0 and mantissa == 0.5):
            raise ValueError(f"do_scale must be a positive power of two (an exact scaling), got "
                             f"{self.do_scale}")
        if not (math.isfinite(self.must_test_leak) and self.must_test_leak >= 0):
            raise ValueError(f"must_test_leak must be a finite number >= 0, got "
                             f"{self.must_test_leak}")


def _check_routes(b: AttentionRecipe, r: AttentionRecipe) -> None:
    for field, spec in (("p", r.p), ("v", r.v)):
        ok = (isinstance(spec, QuantSpec) and spec.block is not None and len(spec.block) == 1
              and spec.scale.mbits == 0)
        if not ok:
            raise ValueError(f"mxfp4_route: {r.name}'s {field} must be a 1-D block format with "
                             f"power-of-two (E8M0) scales, got {spec!r}")
    if b.causal is False or r.causal is False:
        raise ValueError(f"fp8_route, mxfp4_route: {b.name} and {r.name} must be causal routes")


def _do_scale_note(do_scale: float) -> str:
    if do_scale == 1.0:
        return ""
    return f", dO times {do_scale:g} (do_scale: as a loss scaled by it)"


PRESETS = {
    "smoke": MechanismsConfig(heads=2, seq=512, leak_positions=2),
    "full": MechanismsConfig(),
}


def cells(config: MechanismsConfig) -> list[dict]:
    found = [{"mechanism": GAP, "context": "fp8_route"}]
    for name in config.mechanisms:
        found += [{"mechanism": name, "context": c} for c in config.contexts
                  if c == "fp8_route" or MECHANISMS[name].mxfp4 is not None]
    return found


def contrast(config: MechanismsConfig, cell: dict) -> tuple[AttentionRecipe, AttentionRecipe]:
    """(variant, control) of a cell: the recipes with and without its mechanism."""
    b, r = resolve_recipe(config.fp8_route), resolve_recipe(config.mxfp4_route)
    if cell["mechanism"] == GAP:
        return r, b
    mechanism = MECHANISMS[cell["mechanism"]]
    pair = mechanism.fp8 if cell["context"] == "fp8_route" else mechanism.mxfp4
    return pair(b, r)


# -- running a recipe once per process -----------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One recipe's forward and backward on the study's input."""

    outputs: dict  # o, dq, dk, dv in float64
    stats: dict  # trace statistics and the backward's bias against its own forward
    leak: dict  # o, dq: mean relative change of earlier rows when a later token moves
    trace: pd.DataFrame


def _inputs(config: MechanismsConfig, seed: int, device: str):
    x = study_inputs(config.inputs, seed, batch=config.batch, heads=config.heads,
                     seq=config.seq, head_dim=config.head_dim)
    return [t.to(device) for t in (x.q, x.k, x.v, x.do * config.do_scale)]


def _leakage():
    return load_study("causal-leakage").module


@functools.lru_cache(maxsize=1)
def _exact(config: MechanismsConfig, seed: int, device: str) -> dict:
    tensors = [t.double() for t in _inputs(config, seed, device)]
    got = _leakage().forward_backward("exact", tensors, generator=None, backend="reference",
                                      tiles={})
    return _outputs(tensors, "exact", got)


def _outputs(tensors, recipe, o_dq=None, trace=None) -> dict:
    """O, dQ, dK, dV of `recipe` in float64 (one forward and backward)."""
    q, k, v, do = tensors
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o = fp4lab.attention(*leaves, recipe, causal=True, trace=trace, backend="reference")
    o.backward(do)
    return dict(zip(TENSORS, (o.detach().double(), *(t.grad.double() for t in leaves)),
                    strict=True))


@functools.lru_cache(maxsize=32)
def run_recipe(config: MechanismsConfig, recipe: AttentionRecipe, seed: int, device: str) -> Run:
    """`recipe` on the input: outputs, trace statistics, backward bias, leakage (cached)."""
    tensors = _inputs(config, seed, device)
    trace = Trace()
    outputs = _outputs(tensors, recipe, trace=trace)
    frame = trace.to_frame()
    bias = gradient_bias(*tensors, recipe, samples=1, seed=0, causal=True,
                         reference="forward").tensors.set_index("tensor")
    stats = _trace_stats(frame)
    for g in GRADIENTS:
        stats[f"{g}_bias_vs_own_forward"] = bias.loc[g, "rel_bias"]
        stats[f"{g}_error_vs_own_forward"] = bias.loc[g, "rel_err_mean"]
    exact = _exact(config, seed, device)
    for t in TENSORS:
        stats[f"{t}_error"] = _relative(outputs[t], exact[t])
    leak = _leak(config, recipe, tensors, seed)
    return Run(outputs, stats, leak, frame)


def _leak(config: MechanismsConfig, recipe, tensors, seed: int) -> dict:
    module = _leakage()
    positions = module.draw_positions(tensors[0].shape[2], config.leak_positions, seed)
    rows, _ = module.measure_leakage(recipe, tensors, positions,
                                     perturb_scale=config.perturb_scale, generator=None)
    frame = pd.DataFrame(rows)
    return frame.groupby("tensor")["rel_change"].mean().to_dict()


def _trace_stats(frame: pd.DataFrame) -> dict:
    """P's and V's quantization in P V, the denominator, and the backward's views."""
    pv, dv, dp = (frame[frame["product"] == p] for p in ("pv", "dv", "dp"))
    out = frame[frame["product"] == "out"]
    return {
        "p_flushed": pv["a_flushed"].mean(),
        "p_mass_lost": pv.groupby(["batch", "head", "q_tile"])["p_mass_lost"].sum().mean(),
        "p_scale_underflow": pv["a_scale_underflow"].mean(),
        "p_err": pv["a_err"].mean(),
        "v_err": pv["b_err"].mean(),
        "row_sum_err": out["row_sum_err"].mean(),
        "p_fwd_mismatch": dv["p_fwd_mismatch"].mean(),
        "v_view_err": dp["b_err"].mean(),
    }


def _relative(x: torch.Tensor, ref: torch.Tensor) -> float:
    norm = ref.norm()
    return ((x - ref).norm() / norm).item() if norm > 0 else math.nan


# -- one cell ------------------------------------------------------------------------------


def _decompose(d: torch.Tensor, ref: torch.Tensor, tile_rows: int) -> dict:
    """d = g_v - g_c against g_c = `ref`: effect ||d|| / ||ref||, bias <d, ref> / <ref, ref>,
    the orthogonal scatter, and the t statistic of the per-tile biases over the tiles (tiles
    of `tile_rows` sequence rows of each batch and head)."""
    norm_sq = ref.square().sum()
    if norm_sq == 0:
        return {"effect": math.nan, "bias": math.nan, "scatter": math.nan, "tile_t": math.nan}
    effect = (d.square().sum() / norm_sq).sqrt().item()
    bias = ((d * ref).sum() / norm_sq).item()
    b, h, s, e = ref.shape
    pad = -s % tile_rows
    tiles = [torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(b, h, -1, tile_rows * e)
             for x in (d, ref)]  # (B, H, nT, tile_rows * E)
    energy = tiles[1].square().sum(-1)
    per_tile = ((tiles[0] * tiles[1]).sum(-1) / energy)[energy > 0]
    n = per_tile.numel()  # 0 where every tile's reference is non-finite (NaN energy)
    spread = per_tile.std().item() if n > 1 else math.nan
    tile_t = per_tile.mean().item() / (spread / math.sqrt(n)) if n > 1 and spread > 0 else (
        math.nan)  # (spread > 0 is False for NaN)
    return {"effect": effect, "bias": bias,
            "scatter": math.sqrt(max(effect**2 - bias**2, 0.0)), "tile_t": tile_t}


def run_cell(config: MechanismsConfig, cell: dict, ctx) -> dict:
    variant, control = contrast(config, cell)
    b = resolve_recipe(config.fp8_route)
    runs = {role: run_recipe(config, recipe, ctx.seed, ctx.device)
            for role, recipe in (("variant", variant), ("control", control), ("fp8", b))}
    rows = []
    for t in TENSORS:
        v, c = runs["variant"].outputs[t], runs["control"].outputs[t]
        tile_rows = variant.block_m if t in ("o", "dq") else variant.block_n
        fp8 = runs["fp8"].outputs[t]
        rows.append({
            "tensor": t, "variant": variant.name, "control": control.name,
            **_decompose(v - c, c, tile_rows or 128),
            "variant_from_fp8": _relative(v, fp8), "control_from_fp8": _relative(c, fp8),
            "variant_error": runs["variant"].stats[f"{t}_error"],
            "control_error": runs["control"].stats[f"{t}_error"],
            "leak_variant": runs["variant"].leak.get(t, math.nan),
            "leak_control": runs["control"].leak.get(t, math.nan),
        })
    recipes = [{"role": role, "recipe": runs[role].trace["recipe"].iloc[0], **runs[role].stats}
               for role in ("variant", "control")]
    for row in rows:
        row["contribution"] = _contribution(row["variant_from_fp8"], row["control_from_fp8"])
    owners = trace_owners(config)
    traces = [runs[role].trace for role in ("variant", "control")
              if owners[runs[role].trace["recipe"].iloc[0]] == ctx.index]
    trace = pd.concat(traces, ignore_index=True) if traces else runs["variant"].trace.iloc[:0]
    return {"metrics": rows, "recipes": recipes, "trace": trace}


def _contribution(with_: float, without: float) -> float:
    """How much further from the FP8 route the mechanism takes a tensor, in quadrature:
    sign(a^2 - b^2) sqrt(|a^2 - b^2|) for distances a (with it) and b (without it); with b = 0
    (the FP8 route itself as control) it is a."""
    delta = with_**2 - without**2
    return math.copysign(math.sqrt(abs(delta)), delta)


def trace_owners(config: MechanismsConfig) -> dict[str, int]:
    """Each recipe's name -> the first cell that runs it: the one that stores its trace (so
    trace.parquet holds every recipe once)."""
    owners = {}
    for index, cell in enumerate(cells(config)):
        for recipe in contrast(config, cell):
            owners.setdefault(recipe.name, index)
    return owners


# -- the ranking ---------------------------------------------------------------------------


def ranking(config: MechanismsConfig, metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per mechanism: its effect on dQ, dK, dV on the FP8 route and its share of the
    gap, its bias, its effect on the MXFP4 route, its leak; ranks; whether to test it."""
    gap = metrics[metrics["mechanism"] == GAP].set_index("tensor")["contribution"]
    rows = []
    for name in config.mechanisms:
        rows.append(_ranking_row(config, name, metrics[metrics["mechanism"] == name], gap))
    table = pd.DataFrame(rows)
    for g in GRADIENTS:
        table[f"rank_{g}"] = table[f"effect_{g}"].rank(ascending=False, method="min")
    table["rank"] = table["largest_share"].rank(ascending=False, method="min")
    return table.sort_values(["rank", "mechanism"]).reset_index(drop=True)


def _ranking_row(config, name: str, rows: pd.DataFrame, gap: pd.Series) -> dict:
    mechanism = MECHANISMS[name]
    fp8 = rows[rows["context"] == "fp8_route"].set_index("tensor")
    mx = rows[rows["context"] == "mxfp4_route"].set_index("tensor")
    row = {"mechanism": name, "description": mechanism.description,
           "in_route": mechanism.in_route}
    shares = []
    for g in GRADIENTS:
        row[f"effect_{g}"] = fp8.loc[g, "contribution"]
        row[f"share_{g}"] = row[f"effect_{g}"] / gap[g] if gap[g] > 0 else math.nan
        row[f"bias_{g}"] = fp8.loc[g, "bias"]
        row[f"tile_t_{g}"] = fp8.loc[g, "tile_t"]
        row[f"on_mxfp4_route_{g}"] = mx.loc[g, "contribution"] if len(mx) else math.nan
        shares += [row[f"share_{g}"], row[f"on_mxfp4_route_{g}"] / gap[g] if gap[g] > 0
                   else math.nan]
    row["largest_share"] = max((s for s in shares if not math.isnan(s)), default=math.nan)
    leaks = [fp8.loc[t, "leak_variant"] - fp8.loc[t, "leak_control"] for t in ("o", "dq")]
    row["leak"] = max(leaks)
    biased = [g for g in GRADIENTS if abs(row[f"tile_t_{g}"]) > config.z]
    row["biased_in"] = ",".join(biased)
    big = row["largest_share"] >= config.must_test_share
    leaky = row["leak"] > config.must_test_leak
    row["must_test"] = bool(mechanism.in_route and (big or leaky))
    row["reason"] = _reason(config, mechanism, big, leaky, row)
    return row


def _reason(config, mechanism: Mechanism, big: bool, leaky: bool, row: dict) -> str:
    parts = []
    if big:
        parts.append(f"effect {row['largest_share']:.2f} of the gap")
    if leaky:
        parts.append(f"later tokens move earlier rows by {row['leak']:.2g}")
    if not parts:
        return (f"below {config.must_test_share:g} of the gap and no leak above "
                f"{config.must_test_leak:g}")
    return "; ".join(parts) + ("" if mechanism.in_route else " (not in the route)")


# -- the report ----------------------------------------------------------------------------


def _gap_line(metrics: pd.DataFrame) -> str:
    gap = metrics[metrics["mechanism"] == GAP].set_index("tensor")
    words = ", ".join(f"{t} {gap.loc[t, 'effect']:.3g}" for t in TENSORS)
    errs = ", ".join(f"{t} {gap.loc[t, 'control_error']:.3g} -> {gap.loc[t, 'variant_error']:.3g}"
                     for t in GRADIENTS)
    undefined = [t for t in TENSORS if math.isnan(gap.loc[t, "effect"])]
    broken = [t for t in undefined if not math.isfinite(gap.loc[t, "variant_error"])]
    zero = [t for t in undefined if t not in broken]
    notes = ""
    if broken:
        notes += (f" Undefined for {', '.join(broken)}: the MXFP4 route's {', '.join(broken)} "
                  "is not finite on these inputs, so no mechanism is ranked on it; such inputs "
                  "show the route overflowing, not a difference of rounding.")
    if zero:
        notes += (f" Undefined for {', '.join(zero)}: the FP8 route's {', '.join(zero)} is "
                  "zero (every element flushed, its error against exact attention 1), so no "
                  "distance relative to it exists and no mechanism is ranked on it; such inputs "
                  "show the FP8 backward's range, not the MXFP4 difference.")
    return (f"The gap: the MXFP4 route's outputs and gradients differ from the FP8 route's by "
            f"{words} (relative L2); against exact attention the errors go {errs}.{notes}")


def _ranking_lines(config, table: pd.DataFrame, gap: pd.Series) -> list[str]:
    named = table[table["must_test"]]
    lines = [f"Named for the training study (effect at least {config.must_test_share:g} of the "
             f"gap, or a leak above {config.must_test_leak:g}): "
             + (", ".join(f"{m} ({r})" for m, r in zip(named["mechanism"], named["reason"],
                                                        strict=True)) or "none") + "."]
    others = table[~table["must_test"] & table["in_route"]]
    if len(others):
        lines.append("Not named (of the route): " + ", ".join(
            f"{m} ({r})" for m, r in zip(others["mechanism"], others["reason"], strict=True))
            + ".")
    aside = table[~table["in_route"]]
    if len(aside):
        lines.append("Not in the route, for comparison: " + ", ".join(
            f"{m} (largest share {s:.2f})" for m, s in zip(aside["mechanism"],
                                                           aside["largest_share"], strict=True))
            + ".")
    closer = table[table["effect_dq"] < 0]
    if len(closer):
        lines.append("Switching these on brings dQ closer to the FP8 route (so their "
                     "counterpart moves it away): " + ", ".join(
                         f"{m} ({e:.3g})" for m, e in zip(closer["mechanism"],
                                                          closer["effect_dq"], strict=True))
                     + ".")
    direct = [n for n in table["mechanism"] if n in ("p_rule_route", "v_rule_route", "row_sum")]
    if direct:
        parts = table.set_index("mechanism").loc[direct]
        total = {g: math.sqrt((parts[f"effect_{g}"] ** 2).sum()) for g in GRADIENTS}
        lines.append(f"In quadrature, {', '.join(direct)} added to the FP8 route one at a time "
                     "come to " + ", ".join(f"{g} {total[g]:.3g}" for g in GRADIENTS)
                     + f" (the gap: {', '.join(f'{g} {gap[g]:.3g}' for g in GRADIENTS)}).")
    biased = table[table["biased_in"] != ""]
    if len(biased):
        lines.append(f"Biased consistently across tiles (|t| > {config.z:g}): " + ", ".join(
            f"{m} in {b}" for m, b in zip(biased["mechanism"], biased["biased_in"], strict=True))
            + ".")
    return lines


def _recipe_lines(config, tables: dict) -> list[str]:
    recipes = tables.get("recipes")
    if recipes is None or recipes.empty:
        return []
    by = recipes.drop_duplicates("recipe").set_index("recipe")
    lines = []
    names = [resolve_recipe(n).name for n in (config.fp8_route, config.mxfp4_route)]
    if all(n in by.index for n in names):
        b, r = (by.loc[n] for n in names)
        lines.append(f"P in P V: flushed {b['p_flushed']:.3g} -> {r['p_flushed']:.3g} of "
                     f"nonzeros, probability mass lost per row {b['p_mass_lost']:.3g} -> "
                     f"{r['p_mass_lost']:.3g} (FP8 route -> MXFP4 route; the route's block "
                     f"exponent floor binds in {r['p_scale_underflow']:.3g} of P's blocks); the "
                     "backward's P "
                     f"differs from the forward's by {b['p_fwd_mismatch']:.3g} -> "
                     f"{r['p_fwd_mismatch']:.3g}; its view of V from the unquantized V by "
                     f"{b['v_view_err']:.3g} -> {r['v_view_err']:.3g}.")
        lines.append("The backward against the exact gradient of its own forward (bias along "
                     "the gradient, gradient_bias): " + ", ".join(
                         f"{g} {b[f'{g}_bias_vs_own_forward']:.3g} -> "
                         f"{r[f'{g}_bias_vs_own_forward']:.3g}" for g in GRADIENTS) + ".")
    return lines


RANKING_COLUMNS = {"rank": "rank", "mechanism": "mechanism", "in_route": "in route",
                   "effect_dq": "dQ", "effect_dk": "dK", "effect_dv": "dV",
                   "on_mxfp4_route_dq": "dQ on R", "largest_share": "share of gap",
                   "bias_dq": "dQ bias", "leak": "leak", "must_test": "test"}


def report(config: MechanismsConfig, metrics: pd.DataFrame, tables: dict):
    table = ranking(config, metrics)
    source = describe_inputs(config.inputs, config.inputs_sha256, batch=config.batch,
                             heads=config.heads, seq=config.seq, head_dim=config.head_dim)
    setup = (
        "## Setup\n\n"
        f"Inputs: {source}{_do_scale_note(config.do_scale)}; causal, the routes' tiles. "
        f"FP8 route B = {config.fp8_route}, "
        f"MXFP4 route R = {config.mxfp4_route}. Each mechanism is a contrast of two recipes "
        "that differ only in it, on B (ranked) and on R; effects are relative L2 changes of "
        "the outputs over B's norm, one forward and backward, float32. Leak: the mean "
        f"relative change of earlier rows' O or dQ when one of {config.leak_positions} later "
        f"tokens is scaled by {config.perturb_scale:g}, variant minus control.\n\n"
    )
    gap = metrics[metrics["mechanism"] == GAP].set_index("tensor")["contribution"]
    short = ([_gap_line(metrics)] + _ranking_lines(config, table, gap)
             + _recipe_lines(config, tables))
    text = (setup + "## What the numbers show\n\nRanked by the largest share of the gap on "
            "dQ, dK, dV (either context). dQ, dK, dV: the distance from the FP8 route each "
            "mechanism adds there (in quadrature; negative: it brings the gradient closer); "
            "dQ on R: the same on the MXFP4 route; dQ bias: along the gradient; leak: what a "
            "later token does to earlier rows, added.\n\n"
            + markdown_table(table, RANKING_COLUMNS) + "\n"
            + "".join(f"- {s}\n" for s in short) + "\n")
    text += _details(metrics, tables)
    return text, _figures(table, metrics), {"ranking": table}


def _details(metrics: pd.DataFrame, tables: dict) -> str:
    grads = metrics[metrics["tensor"].isin(GRADIENTS)]
    text = ("## Every contrast\n\neffect: ||g_v - g_c|| / ||g_c||; bias: <g_v - g_c, g_c> / "
            "<g_c, g_c>; scatter: the orthogonal rest; tile t: the per-tile biases' t over the "
            "tiles; errors against exact attention.\n\n")
    text += markdown_table(grads, {
        "mechanism": "mechanism", "context": "context", "variant": "variant",
        "control": "control", "tensor": "tensor", "effect": "effect", "bias": "bias",
        "scatter": "scatter", "tile_t": "tile t", "variant_error": "variant error",
        "control_error": "control error"}) + "\n"
    recipes = tables.get("recipes")
    if recipes is not None and len(recipes):
        text += ("## Every recipe\n\nFrom the trace (means over tiles) and gradient_bias "
                 "against the recipe's own forward.\n\n")
        text += markdown_table(recipes.drop_duplicates("recipe"), {
            "recipe": "recipe", "p_flushed": "P flushed", "p_mass_lost": "P mass lost",
            "p_scale_underflow": "P scale underflow", "v_err": "V error",
            "row_sum_err": "row-sum error", "p_fwd_mismatch": "backward P mismatch",
            "v_view_err": "backward V view error", "dq_bias_vs_own_forward": "dQ bias vs own fwd",
            "dq_error_vs_own_forward": "dQ error vs own fwd",
            "dk_bias_vs_own_forward": "dK bias vs own fwd"}) + "\n"
    return text


def _figures(table: pd.DataFrame, metrics: pd.DataFrame) -> dict[str, Figure]:
    long = table.melt(id_vars=["mechanism"], value_vars=[f"effect_{g}" for g in GRADIENTS],
                      var_name="gradient", value_name="effect")
    long["gradient"] = long["gradient"].str.removeprefix("effect_")
    fig = Figure(figsize=(8, 0.45 * len(table) + 1.8), layout="constrained")
    ax = fig.subplots()
    sns.barplot(data=long, y="mechanism", x="effect", hue="gradient", ax=ax)
    gap = metrics[metrics["mechanism"] == GAP].set_index("tensor")["contribution"]
    for color, g in zip(sns.color_palette(n_colors=3), GRADIENTS, strict=True):
        ax.axvline(gap[g], color=color, linestyle="--", linewidth=1)
    ax.set_xlabel("distance from the FP8 route added, in quadrature (dashed: the gap R - B)")
    return {"mechanism_effects": fig}
