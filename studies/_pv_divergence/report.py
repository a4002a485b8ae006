"""The pv-divergence report: the divergence rule applied to every run, the statistics inside
attention around it, the causes and fixes with the evidence for and against each, and the
comparison with the published fp4-fa4 training records (``published.json``).

Everything here reads the stored tables (``metrics`` per step, ``evals`` and ``layers`` per
probe, ``autopsy`` per layer at a non-finite step, ``runs`` per run), so
``fp4lab study report DIR`` redraws it without training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from fp4lab.studies import markdown_table, number

from .arms import ARMS, CAUSES, REFERENCE_ARM

__all__ = ["report", "divergence_table", "published_records", "speed_verdict"]

PUBLISHED = Path(__file__).resolve().with_name("published.json")
CAUSE_COLUMNS = ["task", "cause", "kind", "arm", "baseline", "arm_diverged",
                 "baseline_diverged", "arm_nonfinite", "baseline_nonfinite", "seeds",
                 "val_gap_delta", "val_gap_delta_se", "evidence_for", "evidence_against"]
RUN_KEYS = ["task", "seed", "arm"]
PROBE_COLUMNS = {  # layers-table column: heading
    "p_flushed": "P flushed", "p_mass_lost": "P mass lost", "p_clipped": "P clipped",
    "p_scale_underflow": "P scale underflow", "v_err": "V rel. err",
    "v_clipped": "V clipped", "v_scale_underflow": "V scale underflow",
    "out_err": "O rel. err", "lse_err": "lse err", "dq_err_vs_exact": "dQ err",
    "dk_err_vs_exact": "dK err",
    "dv_err_vs_exact": "dV err", "do_flushed": "dO flushed", "entropy": "entropy",
    "max_logit": "max logit", "p_log2_peak": "log2 P peak",
}


def published_records() -> dict:
    """The published runs and curves (see published.json's "about")."""
    return json.loads(PUBLISHED.read_text())


# -- the divergence rule ---------------------------------------------------------------------
def rolling_gap(config, run: pd.DataFrame, reference: pd.DataFrame) -> pd.Series:
    """Per step: the mean over the last `divergence_window` steps of the run's loss minus the
    reference run's on the same step (NaN until the window is full)."""
    gap = run.set_index("step")["loss"] - reference.set_index("step")["loss"]
    return gap.rolling(config.divergence_window, min_periods=config.divergence_window).mean()


def _first_sustained(above: pd.Series, patience: int):
    """The step at which `above` has held for `patience` consecutive steps, or None."""
    streak = above.astype(int).groupby((~above).cumsum()).cumsum()
    hit = streak.index[streak >= patience]
    return int(hit[0]) if len(hit) else None


SATURATION_LOG2 = 128.0  # log2 P against a fixed row reference where an E8M0 P^ saturates


def _saturation_step(run: pd.DataFrame):
    """The first step whose largest log2 P against the recipe's fixed row reference (the
    per-step `p_log2_peak_<layer>`, the maximum over layers) reached `SATURATION_LOG2`: past
    it an MXFP4 P^ block needs a scale above E8M0's 2^127 and saturates. None where it never
    did, or where the run logged no peak (a running reference, or metrics from before the
    per-step columns)."""
    peaks = [c for c in run.columns if c.startswith("p_log2_peak_")]
    if not peaks:
        return None
    hit = run.loc[run[peaks].max(axis=1) >= SATURATION_LOG2, "step"]
    return int(hit.iloc[0]) if len(hit) else None


def divergence_table(config, metrics: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """One row per run: its divergence step under the rule, the first step its rolling gap
    passed `split_margin`, its first non-finite loss or gradient norm, the first step its P
    reached E8M0's top against a fixed row reference (`_saturation_step`), and its final
    numbers."""
    rows = []
    tokens_per_step = config.batch * config.seq_len
    for (task, seed), group in metrics.groupby(["task", "seed"], sort=False):
        reference = group[group["arm"] == REFERENCE_ARM]
        for arm, run in group.groupby("arm", sort=False):
            gap = rolling_gap(config, run, reference)
            finite = np.isfinite(run["loss"])
            if "grad_norm" in run:
                finite &= np.isfinite(run["grad_norm"])
            nonfinite = run.loc[~finite, "step"]
            first_bad = int(nonfinite.iloc[0]) if len(nonfinite) else None
            sustained = _first_sustained(gap > config.divergence_margin,
                                         config.divergence_patience)
            split = gap.index[gap > config.split_margin]
            steps = [s for s in (first_bad, sustained) if s is not None]
            step = min(steps) if steps else None
            rows.append({
                "task": task, "seed": seed, "arm": arm, "diverged": step is not None,
                "divergence_step": step,
                "divergence_tokens": None if step is None else (step + 1) * tokens_per_step,
                "split_step": int(split[0]) if len(split) else None,
                "saturation_step": _saturation_step(run),
                "nonfinite_step": first_bad, "max_rolling_gap": float(gap.max()),
                "steps_done": int(run["step"].max()) + 1,
                "max_grad_norm": float(run["grad_norm"].max()),
            })
    table = pd.DataFrame(rows)
    final = runs[RUN_KEYS + ["val_loss", "val_loss_exact_attention", "tokens",
                             "tokens_per_second"]]
    table = table.merge(final, on=RUN_KEYS, how="left")
    ref = table[table["arm"] == REFERENCE_ARM][["task", "seed", "val_loss"]]
    table = table.merge(ref.rename(columns={"val_loss": "ref_val_loss"}), on=["task", "seed"])
    table["val_gap"] = table["val_loss"] - table["ref_val_loss"]
    table["exact_minus_trained"] = table["val_loss_exact_attention"] - table["val_loss"]
    return table.drop(columns="ref_val_loss")


# -- statistics inside attention --------------------------------------------------------------
PEAKS = ("max_logit", "p_log2_peak")  # taken as the maximum over layers, the rest the mean


def layer_means(layers: pd.DataFrame) -> pd.DataFrame:
    """The probe statistics over layers (the mean; the maximum of `PEAKS`), per (run, probe
    step)."""
    how = {c: "max" if c in PEAKS else "mean" for c in PROBE_COLUMNS if c in layers}
    return layers.groupby(RUN_KEYS + ["step", "tokens"], sort=False).agg(how).reset_index()


def around_divergence(table: pd.DataFrame, probes: pd.DataFrame, evals: pd.DataFrame,
                      metrics: pd.DataFrame) -> pd.DataFrame:
    """For each diverged run: its probes just before and at/after its divergence step, with
    the training loss and gradient norm of those steps."""
    rows = []
    steps = metrics[RUN_KEYS + ["step", "loss", "grad_norm"]]
    for _, run in table[table["diverged"]].iterrows():
        mine = probes[(probes[RUN_KEYS] == run[RUN_KEYS].values).all(axis=1)]
        mine = mine.merge(evals, on=RUN_KEYS + ["step", "tokens"], how="left")
        mine = mine.merge(steps, on=RUN_KEYS + ["step"], how="left")
        before = mine[mine["step"] < run["divergence_step"]].tail(1)
        after = mine[mine["step"] >= run["divergence_step"]].head(1)
        for when, found in (("before", before), ("after", after)):
            rows += [{"when": when, **r} for r in found.to_dict("records")]
    return pd.DataFrame(rows)


# -- causes and fixes ---------------------------------------------------------------------------
def _paired_gap(table: pd.DataFrame, arm: str, baseline: str) -> tuple[float, float, int]:
    """Mean over the shared seeds of val_gap(arm) - val_gap(baseline), its standard error
    (NaN with one seed) and the number of seeds."""
    a = table[table["arm"] == arm].set_index("seed")["val_gap"]
    b = table[table["arm"] == baseline].set_index("seed")["val_gap"]
    d = (a - b).dropna()
    se = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else float("nan")
    return float(d.mean()) if len(d) else float("nan"), se, len(d)


def _verdict(cause, diverged: tuple[int, int], base: tuple[int, int], delta, se,
             nonfinite: tuple[int, int] = (0, 0)) -> tuple:
    """(evidence for, evidence against) in words, from the divergence counts, the paired
    gap and the non-finite counts (arm, baseline): a divergence is either a non-finite loss
    or a sustained drift, and a change that removes the one can leave the other."""
    found, against = _drift_verdict(cause, diverged, base, delta, se)
    clause = _nonfinite_clause(cause, nonfinite, diverged[1], base[1])
    if clause is None:
        return found, against
    supports, text = clause
    if supports:
        return text if found in ("none", "untestable here") else f"{found}; {text}", against
    return found, text if against == "none" else f"{against}; {text}"


def _nonfinite_clause(cause, nonfinite: tuple[int, int], n: int, n_base: int):
    """(whether it supports the cause or fix, the words) where the non-finite counts differ,
    else None."""
    arm, base = nonfinite
    if arm == base:
        return None
    text = (f"non-finite loss in {arm}/{n} seeds, {cause.baseline} in {base}/{n_base}")
    return (arm > base) == (cause.kind == "cause"), text


def _drift_verdict(cause, diverged: tuple[int, int], base: tuple[int, int], delta,
                   se) -> tuple:
    noise = "one seed: no noise estimate" if math.isnan(se) else f"+- {number(2 * se, 2)}"
    gap_text = f"final val. loss {number(delta, 3)} nats vs {cause.baseline} ({noise})"
    if math.isnan(delta):
        gap_text = (f"no final val. loss gap vs {cause.baseline} (no seed where both have a "
                    "finite one)")
    worse = not math.isnan(delta) and not math.isnan(se) and delta > 2 * se
    better = not math.isnan(delta) and not math.isnan(se) and delta < -2 * se
    if cause.kind == "cause":
        if diverged[0] > base[0]:
            return f"diverged in {diverged[0]}/{diverged[1]} seeds, {cause.baseline} in " \
                   f"{base[0]}/{base[1]}", gap_text
        against = f"no more divergence than {cause.baseline} ({diverged[0]}/{diverged[1]})"
        return (gap_text, against) if worse else ("none", f"{against}; {gap_text}")
    if base[0] == 0:
        return "untestable here", f"{cause.baseline} did not diverge at this scale; {gap_text}"
    if diverged[0] < base[0]:
        return f"diverged in {diverged[0]}/{diverged[1]} seeds where {cause.baseline} did " \
               f"in {base[0]}/{base[1]}; {gap_text}", "none" if better else gap_text
    how = "as often as" if diverged[0] == base[0] else "more often than"
    return "none", (f"diverged {how} {cause.baseline} ({diverged[0]}/{diverged[1]} vs "
                    f"{base[0]}/{base[1]}); {gap_text}")


def causes_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per task and candidate cause whose two arms ran: the evidence for and against it."""
    rows = []
    for task, runs in table.groupby("task", sort=False):
        arms = set(runs["arm"])
        for cause in CAUSES:
            if cause.arm not in arms or cause.baseline not in arms:
                continue
            count = {a: (int(runs.loc[runs["arm"] == a, "diverged"].sum()),
                         int((runs["arm"] == a).sum())) for a in (cause.arm, cause.baseline)}
            bad = {a: int(runs.loc[runs["arm"] == a, "nonfinite_step"].notna().sum())
                   for a in (cause.arm, cause.baseline)}
            delta, se, seeds = _paired_gap(runs, cause.arm, cause.baseline)
            evidence_for, against = _verdict(cause, count[cause.arm], count[cause.baseline],
                                             delta, se, (bad[cause.arm], bad[cause.baseline]))
            rows.append({"task": task, "cause": cause.name, "kind": cause.kind,
                         "arm": cause.arm, "baseline": cause.baseline,
                         "arm_diverged": count[cause.arm][0],
                         "baseline_diverged": count[cause.baseline][0],
                         "arm_nonfinite": bad[cause.arm],
                         "baseline_nonfinite": bad[cause.baseline], "seeds": seeds,
                         "val_gap_delta": delta, "val_gap_delta_se": se,
                         "evidence_for": evidence_for, "evidence_against": against})
    return pd.DataFrame(rows, columns=CAUSE_COLUMNS)


# -- the published records ----------------------------------------------------------------------
def _published_table(records: dict) -> pd.DataFrame:
    rows = []
    for run in records["runs"]:
        diverged = {k: v for k, v in run["status"].items() if "diverged" in v}
        update = run.get("mxfp4pv_divergence_update")
        tokens = update * run["tokens_per_update"] if update else run.get(
            "mxfp4pv_split_tokens")
        rows.append({
            "run": run["id"], "parameters": run["parameters"],
            "tokens_per_update": run["tokens_per_update"],
            "tokens_trained": run.get("updates_done", run["updates"]) * run["tokens_per_update"],
            "mxfp4pv": "diverged" if diverged else "stable", "divergence_tokens": tokens,
            "grad_clip": run["grad_clip"], "flags": run["flags"], "file": run["paths"][0],
        })
    return pd.DataFrame(rows)


def _published_section(config, table: pd.DataFrame, records: dict) -> tuple[str, list[str]]:
    frame = _published_table(records)
    ours = table[table["arm"].isin(["mxfp4pv", "mxfp4pv_d64"])]
    reached = int(table["tokens"].max()) if len(table) else 0
    text = ("## Against the published records\n\nThe training records of MrHuff/fp4-fa4 "
            "(repository, file of each run below; the figures are copied into "
            "studies/_pv_divergence/published.json). Divergence tokens: the update their drift "
            "gate failed (1.2B) or the report's onset (8B) times the tokens per update.\n\n"
            + markdown_table(frame, {"run": "run", "parameters": "parameters",
                                     "tokens_per_update": "tokens/update",
                                     "tokens_trained": "tokens trained", "mxfp4pv": "MXFP4 P/V",
                                     "divergence_tokens": "diverged at (tokens)",
                                     "grad_clip": "clipping", "file": "file"}) + "\n"
            + "Flags of each run:\n\n" + "".join(
                f"- {r['run']}: {r['flags']}\n" for _, r in frame.iterrows()) + "\n")
    first = frame.loc[frame["mxfp4pv"] == "diverged", "divergence_tokens"].min()
    short = [f"Published: MXFP4 P/V diverged in {int((frame['mxfp4pv'] == 'diverged').sum())} "
             f"of {len(frame)} recorded runs, the earliest at {number(first, 3)} tokens; "
             f"this study's runs reached {number(reached, 3)} tokens"
             + (f", {number(reached / first, 2)}x the earliest published divergence."
                if first and reached else ".")]
    if len(ours):
        text += ("This study's MXFP4 P/V runs: " + ", ".join(
            f"{r['arm']} seed {r['seed']} ({r['task']}): "
            + (f"diverged at {number(r['divergence_tokens'], 3)} tokens" if r["diverged"]
               else f"did not diverge in {number(r['tokens'], 3)} tokens")
            for _, r in ours.iterrows()) + ".\n\n")
    return text, short


# -- the text ----------------------------------------------------------------------------------
def _parameters(config, vocab: int) -> int:
    d, layers = config.n_embd, config.n_layer
    return vocab * d + layers * (12 * d * d + 4 * d) + 2 * d


def _setup(config, runs: pd.DataFrame) -> str:
    tokens = config.batch * config.seq_len
    text = (
        "## Setup\n\n"
        f"A GPT of {config.n_layer} layers, {config.n_head} heads of "
        f"{config.n_embd // config.n_head}, width {config.n_embd}, context {config.seq_len}, "
        "rotary positions, tied head "
        f"({_parameters(config, 256):,} parameters on text); attention through "
        "fp4lab.attention with each arm's recipe (tiles "
        f"{config.tile}), everything else bf16 on a GPU and float32 on the CPU. AdamW "
        f"(lr {config.lr:g}, betas 0.9/{config.beta2:g}, weight decay {config.weight_decay:g} "
        f"on matrices), {config.warmup} warm-up steps, cosine decay to "
        f"{config.min_lr_ratio:g} x lr over {config.steps} steps, no gradient clipping (but "
        f"in mxfp4pv_clip); global batch {config.batch} x {config.seq_len} = {tokens:,} "
        f"tokens per step; seeds {', '.join(map(str, config.seeds))}, each seed's initial "
        "weights and data order shared by every arm"
        + ("" if not any(ARMS[a].qk_norm for a in config.arms) else
           f" (the QK-norm arms add {2 * config.n_layer * (config.n_embd // config.n_head)} "
           "gains, initialised to 1)") + ".\n\n")
    if "text" in config.tasks and "corpus_train_sha256" in runs:
        row = runs[runs["task"] == "text"].iloc[0]
        text += (f"Text: {int(row['corpus_documents'])} documents of pydoc_data.topics and "
                 f"the standard library ({int(row['corpus_train_bytes']):,} training bytes, "
                 f"sha256 {row['corpus_train_sha256'][:16]}...; "
                 f"{int(row['corpus_val_bytes']):,} validation bytes, sha256 "
                 f"{row['corpus_val_sha256'][:16]}...).\n\n")
    if "recall" in config.tasks:
        text += (f"Recall: {config.recall_pairs} key-value pairs, then each key queried, the "
                 "loss on the answers only.\n\n")
    arms = pd.DataFrame([{"arm": a, "recipe": ARMS[a].recipe.name if ARMS[a].recipe else
                          "torch SDPA", "what": ARMS[a].what} for a in config.arms])
    return text + markdown_table(arms) + "\n"


def _rule(config) -> str:
    return (
        "## The divergence rule\n\nFixed before the runs: a run diverges at its first "
        "non-finite training loss or gradient norm (the gradient norm added after the first "
        "full run, where it moved no run: each run's first non-finite gradient norm came "
        "with its first non-finite loss), or at the first step where the mean over the last "
        f"{config.divergence_window} steps of its loss minus the {REFERENCE_ARM} run's loss "
        f"on the same batch has been above {config.divergence_margin:g} nats for "
        f"{config.divergence_patience} consecutive steps. The full preset takes the window, "
        "threshold and patience of the published 1.2B runs' drift gate (32, 0.15, 3), which "
        "also required the gap against FP8 P/V and started at update 256. The split step is "
        f"the first at which that mean passes {config.split_margin:g} (their warning).\n\n")


def last_probes(probes: pd.DataFrame, evals: pd.DataFrame) -> pd.DataFrame:
    """Each run's last probe (layer means) with its leakage."""
    last = probes.loc[probes.groupby(RUN_KEYS, sort=False)["step"].idxmax()]
    return last.merge(evals[RUN_KEYS + ["step", "leak_max_abs", "leak_rel"]],
                      on=RUN_KEYS + ["step"], how="left")


def _logit_summary(probes: pd.DataFrame) -> list[str]:
    """The largest logit per arm (maximum over the run's probes and layers, mean over seeds)
    against bf16's: attention logit growth, which a fixed row reference turns into overflow."""
    if "max_logit" not in probes or REFERENCE_ARM not in set(probes["arm"]):
        return []
    lines = []
    for task, rows in probes.groupby("task", sort=False):
        peak = rows.groupby(["arm", "seed"], sort=False)["max_logit"].max()
        mean = peak.groupby(level="arm", sort=False).mean()
        if REFERENCE_ARM not in mean:
            continue
        base = mean[REFERENCE_ARM]
        lines.append(f"{task}, largest logit over each run's probes (mean over seeds): "
                     + ", ".join(f"{arm} {number(v, 3)}" for arm, v in mean.items())
                     + f"; above 4x {REFERENCE_ARM}'s in "
                     + (", ".join(a for a, v in mean.items() if v > 4 * base) or "no arm")
                     + " (a run stopped by a non-finite loss has only its probes before it).")
    return lines


def _inside_summary(last: pd.DataFrame) -> list[str]:
    lines = []
    for task, rows in last.groupby("task", sort=False):
        mean = rows.groupby("arm", sort=False).mean(numeric_only=True)
        errors = ", ".join(f"{arm} {number(r['dq_err_vs_exact'], 2)} / "
                           f"{number(r['dk_err_vs_exact'], 2)}" for arm, r in mean.iterrows()
                           if not math.isnan(r.get("dq_err_vs_exact", float("nan"))))
        leaking = [arm for arm, r in mean.iterrows() if r["leak_max_abs"] > 0]
        lines.append(f"{task}, inside attention at the last probe: dQ / dK error against exact "
                     f"attention on the same activations {errors}; later tokens move earlier "
                     f"logits in {', '.join(leaking) or 'no arm'}.")
    return lines


def _summary(config, table: pd.DataFrame, causes: pd.DataFrame) -> list[str]:
    lines = []
    for (task, arm), rows in table.groupby(["task", "arm"], sort=False):
        diverged = rows[rows["diverged"]]
        lines.append(
            f"{task}, {arm}: diverged in {len(diverged)} of {len(rows)} seeds"
            + (f" (first at step {int(diverged['divergence_step'].min())}; "
               f"{int(rows['nonfinite_step'].notna().sum())} by a non-finite loss)"
               if len(diverged) else f" in {number(rows['tokens'].max(), 3)} tokens")
            + f"; final validation loss {number(rows['val_gap'].mean(), 3)} nats from "
              f"{REFERENCE_ARM} (mean over seeds), with exact attention on its weights "
              f"{number(rows['exact_minus_trained'].mean(), 3)} from its own recipe's.")
    mx = table[table["arm"] == "mxfp4pv"]
    if len(mx) and not mx["diverged"].any():
        lines.append(f"Null result: MXFP4 P/V (fa4fp4_causal_mxfp4pv) did not diverge at this "
                     f"scale ({config.n_layer} layers, width {config.n_embd}, "
                     f"{number(mx['tokens'].max(), 3)} tokens); the rule was not tuned to find "
                     "a divergence.")
    supported = causes[~causes["evidence_for"].isin(["none", "untestable here"])]
    if len(causes):
        lines.append(f"Causes and fixes: {len(supported)} of {len(causes)} (task, cause) pairs "
                     "have evidence for them here" + "".join(
                         f"; {r['cause']} ({r['task']}, {r['arm']}): {r['evidence_for']}"
                         for _, r in supported.iterrows()) + ".")
    return lines


SPEED_GOAL = 0.4  # the issue's: fa4fp4_causal_mxfp4pv on Triton at >= 0.4x SDPA's tokens/s


STEADY = "tokens_per_second_steady"


def _timed(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs table with a steady rate and a backend (a folder written before they were
    recorded: the overall rate, "not recorded"), and each run's steady rate over the sdpa
    arm's of the same task and seed (`vs_sdpa`, NaN without one)."""
    if STEADY not in runs:
        runs = runs.assign(**{STEADY: runs["tokens_per_second"]})
    if "backend" not in runs:
        runs = runs.assign(backend="not recorded")
    base = runs[runs["arm"] == "sdpa"].set_index(["task", "seed"])[STEADY]
    return runs.assign(vs_sdpa=[r[STEADY] / base.get((r["task"], r["seed"]), float("nan"))
                                for _, r in runs.iterrows()])


def speed_verdict(runs: pd.DataFrame) -> str | None:
    """The issue's speed goal in a sentence, where this run measured it (mxfp4pv on the
    Triton backend beside the sdpa arm); None where it did not."""
    timed = _timed(runs)
    mx = timed[(timed["arm"] == "mxfp4pv") & (timed["backend"] == "triton")]["vs_sdpa"]
    if not mx.notna().any():
        return None
    found = float(mx.mean())
    return (f"Speed: fa4fp4_causal_mxfp4pv on the Triton backend trains at {number(found, 3)}x "
            f"the steady tokens/s of bf16 SDPA in the same run (mean over seeds); the goal, "
            f"{SPEED_GOAL:g}x, is " + ("met." if found >= SPEED_GOAL else "not met."))


def _speed(config, runs: pd.DataFrame) -> str:
    """Each run's training time and tokens/s, and (with the sdpa arm) each arm's steady
    tokens/s as a fraction of sdpa's on the same task and seed, in the same run."""
    timed = _timed(runs)
    columns = {"task": "task", "seed": "seed", "arm": "arm", "backend": "backend",
               "steps_done": "steps", "train_seconds": "training s",
               "tokens_per_second": "tokens/s", STEADY: "steady tokens/s"}
    text = ("## Time and speed\n\nEach run's training time (its optimizer steps alone, without "
            "probes and checkpoints; on a GPU each step synchronized), its tokens/s over all "
            "steps, and its steady tokens/s (the median step, after the first "
            f"{config.speed_skip} steps).\n\n" + markdown_table(timed, columns) + "\n")
    if "sdpa" not in set(timed["arm"]):
        return text
    mean = timed.groupby(["arm", "backend"], sort=False)[[STEADY, "vs_sdpa"]].mean()
    verdict = speed_verdict(runs) or (
        f"The goal, fa4fp4_causal_mxfp4pv on the Triton backend at {SPEED_GOAL:g}x the sdpa "
        "arm or better, is not measured here: mxfp4pv did not run on the Triton backend.")
    return (text + "As a fraction of the sdpa arm's steady tokens/s (same task, seed and "
            f"run; mean over seeds). {verdict}\n\n" + markdown_table(
                mean.reset_index(), {"arm": "arm", "backend": "backend", STEADY: "steady "
                                     "tokens/s", "vs_sdpa": "vs sdpa"}) + "\n")


def _activations(saved: pd.DataFrame | None) -> str:
    """The saved attention inputs, and the command that feeds one to an analytic study."""
    if saved is None or not len(saved):
        return ""
    mx = saved[saved["arm"] == "mxfp4pv"]
    example = (mx if len(mx) else saved).iloc[-1]["file"]  # the last layer's
    return (
        "## Saved activations\n\nAt each run's end, one forward and backward with the run's "
        f"own recipe (column recipe, on backend {', '.join(sorted(set(saved['backend'])))}) "
        f"of the first {int(saved['rows'].max())} sequences of its first validation batch, "
        "the loss scaled as a training step's (and by the arm's loss scale where it has one: "
        "the dO a loss-scaled arm's backward quantizes); each layer's q, k (after the rotary "
        "map), v and dO, in the layout (rows, heads, sequence, head_dim), written with "
        "fp4lab.analysis.save_inputs to the file named, relative to this folder. Any analytic "
        "study reads one as its input, e.g.\n\n```\nfp4lab study run mxfp4-pv-mechanisms "
        f"--set inputs=<this folder>/{example}\n```\n\n(also attention-gradients, "
        "scale-range, causal-leakage, p-operand; their config records the file's sha256).\n\n"
        + markdown_table(saved.assign(sha256=saved["sha256"].str[:12]), {
            "task": "task", "seed": "seed", "arm": "arm", "layer": "layer", "file": "file",
            "recipe": "recipe", "after_step": "after step", "finite": "finite",
            "sha256": "sha256 (first 12)"}) + "\n")


def report(config, metrics: pd.DataFrame, tables: dict):
    runs, evals, layers = tables["runs"], tables["evals"], tables["layers"]
    table = divergence_table(config, metrics, runs)
    causes = causes_table(table)
    probes = layer_means(layers)
    records = published_records()
    published, published_short = _published_section(config, table, records)
    speed = speed_verdict(runs)
    autopsies = tables.get("autopsy")
    summary = (_summary(config, table, causes) + _inside_summary(last_probes(probes, evals))
               + _logit_summary(probes)
               + _autopsy_summary(autopsies if autopsies is not None and len(autopsies)
                                  else None)
               + published_short + ([speed] if speed else []))
    text = _setup(config, runs) + _rule(config) + "## What the numbers show\n\n" + "".join(
        f"- {line}\n" for line in summary) + "\n"
    text += ("## Divergence\n\n" + markdown_table(table, {
        "task": "task", "seed": "seed", "arm": "arm", "diverged": "diverged",
        "divergence_step": "step", "divergence_tokens": "tokens", "split_step": "split step",
        "saturation_step": "P saturates", "nonfinite_step": "non-finite step",
        "max_rolling_gap": "max rolling gap", "max_grad_norm": "max grad norm",
        "val_loss": "final val. loss", "val_gap": "val. gap",
        "exact_minus_trained": "exact attention - own"}) + "\n"
        + "\"P saturates\": the first step at which the step's own batch put log2 P "
        f"{SATURATION_LOG2:g} above the recipe's fixed row reference in some layer, where an "
        "MXFP4 P^ block needs a scale past E8M0's 2^127 (n/a: never, or a running "
        "reference).\n\n")
    text += _inside(table, probes, evals, metrics)
    autopsy = tables.get("autopsy")
    text += _autopsy(autopsy if autopsy is not None and len(autopsy) else None, table)
    text += ("## Causes and fixes\n\nEach candidate, the arm that tests it and its baseline "
             "(a cause is added to a stable route, a fix applied to the diverging one); the "
             "evidence is the divergence counts and the paired (same seed) final validation "
             "gap, 2 standard errors over seeds as its noise.\n\n"
             + markdown_table(causes, {"task": "task", "cause": "cause", "kind": "kind",
                                      "arm": "arm",
                                       "baseline": "baseline", "evidence_for": "evidence for",
                                       "evidence_against": "evidence against"}) + "\n")
    text += published + _speed(config, runs) + _activations(tables.get("activations"))
    figures = _figures(config, metrics, table, probes, evals, records)
    return text, figures, {"divergence": table, "causes": causes}


def _inside(table: pd.DataFrame, probes: pd.DataFrame, evals: pd.DataFrame,
            metrics: pd.DataFrame) -> str:
    columns = {c: h for c, h in PROBE_COLUMNS.items() if c in probes}
    last = last_probes(probes, evals)
    mean = last.groupby(["task", "arm"], sort=False)[[*columns, "leak_max_abs",
                                                      "leak_rel"]].mean().reset_index()
    text = ("## Inside attention\n\nAt the last probe, averaged over layers (the largest "
            "logit and log2 P's peak against the row reference: their maximum over layers) "
            "and seeds: the "
            "trace of P and V (fractions of nonzeros flushed or clipped, fraction of blocks "
            "whose scale underflowed, relative errors), each layer's gradient error against "
            "exact attention on the same activations, attention entropy and largest logit, "
            "and future leakage (largest logit change at positions before a changed token; "
            "0 for causal attention).\n\n"
            + markdown_table(mean, {"task": "task", "arm": "arm", **columns,
                                    "leak_max_abs": "leak", "leak_rel": "leak rel."}) + "\n")
    around = around_divergence(table, probes, evals, metrics)
    if len(around):
        text += ("Around each divergence (the probe before the divergence step, and the "
                 "first at or after it):\n\n" + markdown_table(around, {
                     "task": "task", "arm": "arm", "seed": "seed", "when": "when",
                     "step": "step", "loss": "train loss", "grad_norm": "grad norm",
                     "val_loss": "val. loss", **columns, "leak_max_abs": "leak"}) + "\n")
    else:
        text += "No run diverged, so there are no statistics around a divergence step.\n\n"
    return text


AUTOPSY_COLUMNS = {
    "task": "task", "seed": "seed", "arm": "arm", "step": "step", "world": "world",
    "reproduced": "reproduced",
    "origin_layer": "first layer", "inputs_finite": "inputs finite",
    "o_rows_nonfinite": "rows non-finite", "p_overflow_log2": "overflow point",
    "nonfinite_rows_p_overflow": "of them past it", "rows_p_overflow": "rows past it",
    "p_log2_peak_nonfinite_rows": "log2 P peak there",
    "p_overflow_log2_kernel": "kernel's point", "nonfinite_rows_p_overflow_kernel":
    "of them past the kernel's",
    "max_logit": "max logit", "reference_nonfinite": "reference non-finite",
    "exact_nonfinite": "exact non-finite",
}


def autopsy_table(autopsy: pd.DataFrame) -> pd.DataFrame:
    """A row per run with a non-finite step: the first layer whose attention output was not
    finite while its inputs were (`origin_layer`, -1 for none: the value came from
    elsewhere, or the forward did not repeat it) and that layer's autopsy row (the last
    layer's where there is none)."""
    rows = []
    for _, run in autopsy.groupby(RUN_KEYS, sort=False):
        origin = run[run["origin"].astype(bool)]
        row = (origin if len(origin) else run.tail(1)).iloc[0].to_dict()
        row["origin_layer"] = int(row["layer"]) if len(origin) else -1
        rows.append(row)
    return pd.DataFrame(rows)


def _autopsy_summary(autopsy: pd.DataFrame | None) -> list[str]:
    if autopsy is None:
        return []
    runs = autopsy_table(autopsy)
    inside = runs[runs["origin_layer"] >= 0]
    line = (f"At the first non-finite step ({len(runs)} runs, the same batch's forward on the "
            f"same weights): the non-finite value first appeared in attention's output, from "
            f"finite inputs, in {len(inside)}")
    if len(inside):
        ref = int((inside["reference_nonfinite"] > 0).sum())
        exact = int((inside["exact_nonfinite"] > 0).sum())
        over = inside[inside["rows_p_overflow"] >= 0]
        whole = int((over["nonfinite_rows_p_overflow"] == over["o_rows_nonfinite"]).sum())
        some = int((over["nonfinite_rows_p_overflow"] > 0).sum())
        line += (f"; there the reference path gave a non-finite output too in {ref} and exact "
                 f"attention in {exact}; log2 P against the recipe's fixed row reference "
                 f"reached the recipe's overflow point (where its own output turns non-finite) "
                 f"in some of the non-finite rows in {some} of {len(over)} runs with a fixed "
                 f"reference, in all of them in {whole}")
    return [line + "."]


def _autopsy(autopsy: pd.DataFrame | None, table: pd.DataFrame) -> str:
    head = "## At the first non-finite step\n\n"
    if autopsy is None:
        bad = int(table["nonfinite_step"].notna().sum())
        if bad:
            return head + (f"{bad} runs had a non-finite loss, but this folder has no autopsy "
                           "table (written before the runs recorded one).\n\n")
        return head + "No run had a non-finite loss.\n\n"
    return head + (
        "Each run's first step whose training loss or gradient norm was not finite, examined "
        "on rank 0 with the same global batch, the same weights (the optimizer skipped the "
        "step) and, in one process, the same stochastic-rounding draws (under several ranks "
        "the draws and whole-tensor scales of the ranks' shares differ; column world): "
        "whether that forward repeated the non-finite loss (not where only the gradient "
        "was); the first layer whose attention output was not finite while its q, k, v were "
        "(-1: none); that layer's rows (batch, head, query) with a non-finite output and how "
        "many of them, and of all its rows, have log2 P against the recipe's fixed row "
        "reference (the anchor, or 0; -1 for a running or lazy maximum) at or past the "
        "recipe's overflow point (the log2 P at which its own output turns non-finite, "
        "measured on the reference path on one dominant key: 117.5 for the D128 anchor "
        "route and 125.5 for the D64 one without the stored-scale shift, none (inf) with it) "
        "and, for a run on the Triton kernels, their own point "
        "(measured on them the same way; they apply P's and V's 1/M_e after the P V "
        "product, so they can overflow first), computed from the "
        "unquantized q, k (the recipe scores its quantized Q, K, which moves a row's peak by "
        "up to a few log2 units); the largest logit; and the non-finite output elements of "
        "the same recipe recomputed on the reference path and of exact attention on the "
        "same q, k, v.\n\n"
        + markdown_table(autopsy_table(autopsy), AUTOPSY_COLUMNS) + "\n")


# -- figures ------------------------------------------------------------------------------------
def _colors(arms) -> dict:
    import matplotlib

    name, size = ("tab10", 10) if len(arms) <= 10 else ("tab20", 20)
    cmap = matplotlib.colormaps[name]
    return {arm: cmap(i % size) for i, arm in enumerate(arms)}


def _figures(config, metrics, table, probes, evals, records) -> dict[str, Figure]:
    figures = {}
    colors = _colors(list(dict.fromkeys(metrics["arm"])))
    styles = {seed: s for seed, s in zip(config.seeds, ["-", "--", ":", "-."] * 8,
                                         strict=False)}
    for task, rows in metrics.groupby("task", sort=False):
        figures[f"curves_{task}"] = _curves(config, rows, colors, styles, table)
        figures[f"runs_{task}"] = _run_panels(config, rows, styles, table)
        figures[f"probes_{task}"] = _probe_curves(probes[probes["task"] == task],
                                                  evals[evals["task"] == task], colors, styles)
    figures["published"] = _published_figure(config, table, evals, records)
    return figures


def _curves(config, rows, colors, styles, table) -> Figure:
    fig = Figure(figsize=(11, 10), layout="constrained")
    logit_columns = [c for c in rows.columns if c.startswith("max_logit_")]
    axes = fig.subplots(3 + bool(logit_columns), 1, sharex=True)
    for (arm, seed), run in rows.groupby(["arm", "seed"], sort=False):
        reference = rows[(rows["arm"] == REFERENCE_ARM) & (rows["seed"] == seed)]
        style = dict(color=colors[arm], linestyle=styles[seed], linewidth=1)
        label = f"{arm} seed {seed}"
        axes[0].plot(run["tokens"], run["loss"], label=label, **style)
        gap = rolling_gap(config, run, reference)
        axes[1].plot(run["tokens"].values, gap.reindex(run["step"]).values, **style)
        axes[2].plot(run["tokens"], run["grad_norm"], **style)
        if logit_columns:  # each step's own batch, the largest over layers
            axes[3].plot(run["tokens"], run[logit_columns].max(axis=1), **style)
        found = table[(table["arm"] == arm) & (table["seed"] == seed) & table["diverged"]]
        for tokens in found["divergence_tokens"]:
            axes[1].axvline(tokens, color=colors[arm], linestyle=styles[seed], alpha=0.5)
    axes[1].axhline(config.divergence_margin, color="black", linewidth=0.8)
    axes[0].set_ylabel("training loss")
    axes[1].set_ylabel(f"rolling loss gap to {REFERENCE_ARM}")
    axes[2].set_ylabel("gradient norm")
    axes[2].set_yscale("log")
    if logit_columns:
        axes[3].set_ylabel("largest logit (log scale)")
        axes[3].set_yscale("log")
    axes[-1].set_xlabel("training tokens")
    axes[0].legend(fontsize=6, ncol=4)
    return fig


def _run_panels(config, rows, styles, table) -> Figure:
    """One panel per arm (the reference's aside): each seed's rolling loss gap to the
    reference against the divergence margin, its divergence step (solid vertical) and the
    step its P saturated (`_saturation_step`, dotted vertical), and on the right axis the
    per-step largest log2 P against the fixed row reference (grey) with E8M0's top: the order
    of saturation and divergence run by run, which the all-arms curves crowd out."""
    arms = [a for a in dict.fromkeys(rows["arm"]) if a != REFERENCE_ARM]
    ncols = min(4, max(len(arms), 1))
    nrows = max(1, -(-len(arms) // ncols))
    fig = Figure(figsize=(4 * ncols, 2.6 * nrows), layout="constrained")
    axes = list(fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).flat)
    peaks = [c for c in rows.columns if c.startswith("p_log2_peak_")]
    for ax, arm in zip(axes, arms, strict=False):
        right = None
        for seed, run in rows[rows["arm"] == arm].groupby("seed", sort=False):
            reference = rows[(rows["arm"] == REFERENCE_ARM) & (rows["seed"] == seed)]
            gap = rolling_gap(config, run, reference).reindex(run["step"]).values
            style = styles[seed]
            ax.plot(run["step"].values, gap, color="C0", linestyle=style, linewidth=1,
                    label=f"seed {seed}")
            row = table[(table["arm"] == arm) & (table["seed"] == seed)]
            for column, line in (("divergence_step", "-"), ("saturation_step", ":")):
                step = row[column].iloc[0] if len(row) and column in row else None
                if step is not None and pd.notna(step):
                    ax.axvline(step, color="C3", linestyle=line, linewidth=1)
            if peaks and run[peaks].notna().any().any():
                right = right or ax.twinx()
                right.plot(run["step"].values, run[peaks].max(axis=1).values, color="0.6",
                           linestyle=style, linewidth=0.7)
        if right is not None:
            right.axhline(SATURATION_LOG2, color="0.6", linewidth=0.6)
            right.tick_params(labelsize=6)
        ax.axhline(config.divergence_margin, color="black", linewidth=0.6)
        ax.set_title(arm, fontsize=8)
        ax.tick_params(labelsize=6)
    for ax in axes[len(arms):]:
        ax.set_visible(False)
    fig.supxlabel("step (red: divergence, solid; P saturates, dotted)", fontsize=8)
    fig.supylabel(f"rolling loss gap to {REFERENCE_ARM} (blue); grey, right: log2 P peak",
                  fontsize=8)
    return fig


def _probe_curves(probes, evals, colors, styles) -> Figure:
    panels = [("val_loss", "validation loss", evals), ("p_flushed", "P flushed", probes),
              ("v_clipped", "V clipped", probes), ("do_flushed", "dO flushed (dV)", probes),
              ("dq_err_vs_exact", "dQ error vs exact (log scale)", probes),
              ("leak_max_abs", "future leakage (max |logit change|)", evals),
              ("max_logit", "largest logit (log scale)", probes),
              ("p_log2_peak", "log2 P peak (float32 overflows near 128)", probes)]
    fig = Figure(figsize=(16, 6.5), layout="constrained")
    for ax, (column, title, frame) in zip(fig.subplots(2, 4).flat, panels, strict=True):
        for (arm, seed), run in frame.groupby(["arm", "seed"], sort=False):
            if column in run and run[column].notna().any():
                ax.plot(run["tokens"], run[column], color=colors[arm], linestyle=styles[seed],
                        marker=".", linewidth=1, label=f"{arm} {seed}")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("training tokens", fontsize=8)
        if "log scale" in title and ax.has_data():
            ax.set_yscale("log")  # the arms' values span orders of magnitude
    fig.axes[0].legend(fontsize=6, ncol=2)
    return fig


def _published_figure(config, table, evals, records) -> Figure:
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    left, right = fig.subplots(1, 2)
    curves = records["curves"]
    run = next(r for r in records["runs"] if r["id"] == curves["run"])
    tokens = [max(1, (u + 1) * run["tokens_per_update"]) for u in curves["update"]]
    ref = np.array(curves["val_loss"]["bf16"])
    for route in ("fp8pv", "mxfp4pv"):
        left.plot(tokens, np.array(curves["val_loss"][route]) - ref, marker="o",
                  label=f"published 1.2B {route}")
    text = evals[evals["task"] == "text"]  # the published runs are language models
    ours = text.merge(text[text["arm"] == REFERENCE_ARM][["seed", "step", "val_loss"]],
                      on=["seed", "step"], suffixes=("", "_ref"))
    ours = ours.assign(gap=ours["val_loss"] - ours["val_loss_ref"])
    for arm in ("fp8pv", "mxfp4pv", "mxfp4pv_d64"):
        mine = ours[ours["arm"] == arm].groupby("tokens")["gap"].mean()
        if len(mine):
            left.plot(np.maximum(mine.index.values, 1), mine.values, marker=".", linestyle="--",
                      label=f"this study {arm} (mean over seeds)")
    left.set_xscale("log")
    left.set_xlabel("training tokens (the initial model at 1)")
    left.set_ylabel(f"validation loss minus {REFERENCE_ARM}'s (text)")
    left.legend(fontsize=7)
    _horizons(right, table, records)
    return fig


def _horizons(ax, table, records) -> None:
    """Tokens trained per run (bars) and where MXFP4 P/V diverged (crosses)."""
    frame = _published_table(records)
    labels, y = [], 0
    for _, r in frame.iterrows():
        ax.barh(y, r["tokens_trained"], color="lightgray")
        if r["mxfp4pv"] == "diverged":
            ax.plot(r["divergence_tokens"], y, "rx", markersize=9)
        labels.append(f"published {r['run']}")
        y += 1
    for (arm, task), rows in table[table["arm"].str.startswith("mxfp4pv")].groupby(
            ["arm", "task"], sort=False):
        ax.barh(y, rows["tokens"].max(), color="steelblue")
        for tokens in rows.loc[rows["diverged"], "divergence_tokens"]:
            ax.plot(tokens, y, "rx", markersize=9)
        labels.append(f"this study {arm} ({task})")
        y += 1
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (x: MXFP4 P/V diverged)")
