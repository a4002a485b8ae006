"""Numbers for FULL4_MECHANISMS.md: per saved layer-3 input of the fourth full run, the rows
far above the MXFP4 route's anchor, and the mxfp4-pv-mechanisms folders' lse and dQ errors
of the FP8 route B and the MXFP4 route R against exact attention, with the study's first
mechanism; and the arm's own training recipe on its own input (reference path).

    PYTHONPATH=. python studies/_pv_divergence/full4_summary.py [ACTIVATIONS] [RESULTS]

writes RESULTS/mxfp4-pv-mechanisms-full4-summary/{summary,cross}.csv.

Not imported by the study; a one-off reader of results folders."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import fp4lab  # noqa: E402
from _pv_divergence import arms  # noqa: E402
from _pv_divergence.probes import _causal_scores, _row_log2_peaks  # noqa: E402
from fp4lab.recipes import resolve_recipe  # noqa: E402

R, B = "fa4fp4_causal_mxfp4pv", "fa4fp4_causal"


def _arm_name(arm: str) -> str:
    return arm.removesuffix("_loss_scaled")


def input_stats(path: Path) -> dict:
    t = load_file(str(path))
    q, k = t["q"].float(), t["k"].float()
    s = _causal_scores(q, k)
    peaks = _row_log2_peaks(s, resolve_recipe(R), q.shape[-1])  # against R's anchor
    return {"max_logit": float(s.amax()), "rows_over_128": float((peaks > 128).float().mean()),
            "rows_over_89": float((peaks > 89).float().mean()),
            "rows_over_160": float((peaks > 160).float().mean()), "peak_log2p": float(peaks.amax()),
            "do_rms": float(t["do"].float().square().mean().sqrt())}


def folder_stats(folder: Path) -> dict:
    metrics = pd.read_parquet(folder / "metrics.parquet")
    trace = pd.read_parquet(folder / "trace.parquet")
    ranking = pd.read_parquet(folder / "ranking.parquet")
    gap = metrics[metrics["mechanism"] == "mxfp4_route"].set_index("tensor")
    out = trace[trace["product"] == "out"]
    lse = out.groupby("recipe")["lse_err"]
    first = ranking.sort_values("rank").iloc[0]
    named = ranking[ranking["must_test"]]["mechanism"].tolist()
    return {"lse_B": lse.mean()[B], "lse_R": lse.mean()[R], "lse_R_max": lse.max()[R],
            "dq_B": gap.loc["dq", "control_error"], "dq_R": gap.loc["dq", "variant_error"],
            "gap_dq": gap.loc["dq", "effect"],
            "first": f"{first['mechanism']} ({first['largest_share']:.2f})",
            "named": ",".join(named)}


def own_recipe(path: Path, arm: str) -> dict:
    """The arm's own training recipe on its own input: lse error (mean over tiles) and dQ's
    relative L2 error against exact float64 attention."""
    t = load_file(str(path))
    q, k, v, do = (t[n].float() for n in ("q", "k", "v", "do"))
    recipe = arms.ARMS[_arm_name(arm)].recipe
    trace = fp4lab.Trace()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = fp4lab.attention(*leaves, recipe, causal=True, trace=trace, backend="reference",
                         generator=0)  # one fixed draw for the stochastic-rounding arm
    o.backward(do)
    exact = [x.double().clone().requires_grad_() for x in (q, k, v)]
    oe = fp4lab.attention(*exact, "exact", causal=True, backend="reference")
    oe.backward(do.double())
    frame = trace.to_frame()
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    dq = rel(leaves[0].grad, exact[0].grad) if bool(leaves[0].grad.isfinite().all()) else math.nan
    return {"own_recipe": recipe.name,
            "own_lse": float(frame.loc[frame["product"] == "out", "lse_err"].mean()),
            "own_dq": dq, "own_o": rel(o.detach(), oe.detach())}


def main(activations: Path, results: Path) -> pd.DataFrame:
    rows = []
    for folder in sorted(results.glob("mxfp4-pv-mechanisms-full4-*")):
        if not (folder / "metrics.parquet").exists():
            continue  # the summary folder itself
        arm = folder.name.removeprefix("mxfp4-pv-mechanisms-full4-")
        base = arm.removesuffix("-doscale8192").removesuffix("-doscale")
        path = activations / f"text-{base}-seed1-layer3.safetensors"
        row = {"folder": folder.name, **input_stats(path), **folder_stats(folder)}
        if arm == base:
            row |= own_recipe(path, base)
        rows.append(row)
    return pd.DataFrame(rows)




def cross(activations: Path, inputs: tuple[str, ...], recipes: tuple[str, ...]) -> pd.DataFrame:
    """Each arm's training recipe (by arm name) on other models' inputs: does the route cope
    with large logits, or did its model just not have them?"""
    rows = []
    for arm in inputs:
        path = activations / f"text-{arm}-seed1-layer3.safetensors"
        for recipe_arm in recipes:
            got = own_recipe(path, recipe_arm)
            rows.append({"inputs": arm, "recipe_of": recipe_arm, **got})
    return pd.DataFrame(rows)


CROSS_INPUTS = ("mxfp4pv_loss_scaled", "nvfp4pv_loss_scaled", "mxfp4pv_running_max_loss_scaled")
CROSS_RECIPES = ("fp8pv", "mxfp4pv", "mxfp4pv_running_max", "mxfp4pv_leakfix")

if __name__ == "__main__":
    act = Path(sys.argv[1] if len(sys.argv) > 1
               else Path(__file__).resolve().parents[2] / "results" / "pv-divergence-full-4"
               / "activations")
    res = Path(sys.argv[2] if len(sys.argv) > 2 else "results")
    out = res / "mxfp4-pv-mechanisms-full4-summary"
    out.mkdir(exist_ok=True)
    pd.set_option("display.width", 250)
    fmt = lambda x: f"{x:.3g}"  # noqa: E731
    table = main(act, res)
    print(table.to_string(float_format=fmt))
    table.to_csv(out / "summary.csv", index=False)
    other = cross(act, CROSS_INPUTS, CROSS_RECIPES)
    print(other.to_string(float_format=fmt))
    other.to_csv(out / "cross.csv", index=False)
