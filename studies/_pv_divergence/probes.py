"""What the study measures every few steps, on a copy of the model (never the one training):

- validation loss with the training recipe;
- one traced forward and backward of a probe batch on the reference backend (the
  instrumented simulation, whatever backend trains): `fp4lab.Trace`'s statistics of P and V
  (flushed fraction and lost mass of P, clipped fraction and scale under/overflow of V, the
  operands' errors, the softmax denominator's error) per layer; each layer's attention
  entropy and largest logit from its q and k; and each layer's gradient error against exact
  attention on the same activations (`fp4lab.compare` on the layer's q, k, v and the dO that
  reached it);
- (at a run's end, when asked) one forward and backward with the training recipe whose
  per-layer q, k, v and dO the run saves as inputs of the analytic studies
  (`captured_step`);
- (at a run's first non-finite loss) an autopsy of that step (`autopsy`): the same batch's
  forward on the same weights, recording per layer whether its q, k, v and attention output
  are finite, the largest logit and log2 P's peak against the recipe's row reference (of
  all rows and of the rows whose output is not finite), and whether the reference path, and
  exact attention, give a finite output on the same q, k, v: where the non-finite value
  first appears, and whether the recipe's arithmetic or the kernel produces it;
- future leakage: the probe sequences with the token at position j replaced, for a few j
  inside blocks of 16 and 32 (a block scale moves only where the changed token holds a
  block's maximum, so one j can miss it): the largest change of the logits at positions
  i < j (exactly 0 for causal attention without scales that span positions) and, averaged
  over the j, its size relative to the change at i >= j.

An arm with a loss scale (`arms.Arm.loss_scale`) trains on the gradients of the loss times
the scale, divided by it after the backward; the probes' backward (`captured_step`, and so the
trace's dO flushed fraction, the gradient errors against exact attention and the saved dO)
uses the same scaled loss, so that the recipe quantizes the dO the training backward
quantizes (the gradient errors are relative: the scale changes them only through the
quantization). The autopsy is a forward only and needs no scale.

Everything is returned as rows (dicts of numbers), nothing is printed.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

import fp4lab
from fp4lab.recipes import EXACT, RowReference

from .gpt import GPT, AttentionCall, Capture, attend

__all__ = ["validation_loss", "captured_step", "traced_step", "autopsy", "leakage",
           "p_overflow_log2", "one_key_row", "TRACE_COLUMNS"]

# (product, trace column) -> the probe's name for it
TRACE_COLUMNS = {
    ("pv", "a_flushed"): "p_flushed",
    ("pv", "p_mass_lost"): "p_mass_lost",
    ("pv", "a_err"): "p_err",
    ("pv", "a_clipped"): "p_clipped",
    ("pv", "a_scale_underflow"): "p_scale_underflow",
    ("pv", "a_scale_overflow"): "p_scale_overflow",
    ("pv", "b_err"): "v_err",
    ("pv", "b_clipped"): "v_clipped",
    ("pv", "b_scale_underflow"): "v_scale_underflow",
    ("pv", "b_scale_overflow"): "v_scale_overflow",
    ("out", "row_sum_err"): "row_sum_err",
    ("out", "out_err"): "out_err",
    ("out", "lse_err"): "lse_err",  # the lse the backward rebuilds P from, against exact's
    ("dv", "p_fwd_mismatch"): "p_fwd_mismatch",
    ("dv", "b_flushed"): "do_flushed",
}


def loss_of(model: GPT, x, y, call: AttentionCall) -> torch.Tensor:
    """Mean cross entropy of the targets that count (y >= 0), in float32."""
    logits = model(x, call)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-1)


@torch.no_grad()
def validation_loss(model: GPT, batches, call: AttentionCall, autocast) -> float:
    """The mean loss over the validation batches."""
    with autocast():
        losses = [float(loss_of(model, x, y, call)) for x, y in batches]
    return sum(losses) / len(losses)


def captured_step(model: GPT, x, y, call: AttentionCall, autocast, batch: int,
                  loss_scale: float = 1.0) -> Capture:
    """One forward and backward of (x, y) with `call`, recording each layer's q, k, v and
    the gradient at its attention output (dO). The loss is normalized as a training step's
    over `batch` such sequences and multiplied by the arm's `loss_scale`, so that the
    gradients reaching attention are the ones a training step's backward quantizes
    (fixed-scale formats such as E5M2(4 dO) flush by size): dO is the scaled one."""
    model.capture = Capture()
    with autocast():
        loss = loss_of(model, x, y, call) * (x.shape[0] / batch) * loss_scale
    loss.backward()
    capture, model.capture = model.capture, None
    model.zero_grad(set_to_none=True)
    return capture


def traced_step(model: GPT, x, y, call: AttentionCall, autocast, batch: int,
                loss_scale: float = 1.0) -> list[dict]:
    """One traced forward and backward of (x, y) (`captured_step`, dO scaled by `loss_scale`
    as training's): a row per layer (see the module)."""
    trace = fp4lab.Trace()
    # the trace is the reference path's (the instrumented simulation; Triton has none)
    traced = dataclasses.replace(call, backend="reference", watch=None,
                                 trace=trace if call.recipe is not None else None)
    capture = captured_step(model, x, y, traced, autocast, batch, loss_scale)
    frame = trace.to_frame()
    rows = []
    for layer in range(len(capture.q)):
        q, k, v = (t[layer].float() for t in (capture.q, capture.k, capture.v))
        row = {"layer": layer, **_scores(q, k, call.recipe)}
        row |= _trace_row(frame[frame["call"] == layer])
        if call.recipe is not None and layer in capture.do:
            row |= _gradient_error(q, k, v, capture.do[layer].float(), call, layer)
        rows.append(row)
    return rows


def _scores(q: torch.Tensor, k: torch.Tensor, recipe) -> dict:
    """Entropy (nats, mean over rows) and the largest logit of causal softmax(q k^T / sqrt d),
    and the peak of log2 P = (s - m) log2 e against the recipe's row reference m where it is
    fixed (`p_log2_peak`: the anchor or 0; 0 with a running maximum; NaN for a lazy one):
    P, and the P V sum, overflow float32 near 128."""
    d = q.shape[-1]
    s = _causal_scores(q, k)
    p = s.softmax(-1)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    return {"entropy": float(entropy.mean()), "max_logit": float(s.amax()),
            "p_log2_peak": _p_log2_peak(s, recipe, d)}


def _causal_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q k^T / sqrt d (B, H, T, T) with the future keys at -inf."""
    t = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return s.masked_fill_(future, float("-inf"))


def step_scores(q: torch.Tensor, k: torch.Tensor, recipe) -> torch.Tensor:
    """(2,) float32 on q's device, without a host sync: the largest causal logit of
    q k^T / sqrt d and the peak of log2 P against the recipe's fixed row reference (NaN for
    a lazy one), as `_scores` gives them at a probe, for one layer of one training step
    (`training.Run.train_step`'s per-step columns)."""
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        s = _causal_scores(q.float(), k.float())
        peaks = _row_log2_peaks(s, recipe, q.shape[-1])
        peak = s.new_tensor(float("nan")) if peaks is None else peaks.amax()
        return torch.stack([s.amax(), peak])


def _p_log2_peak(s: torch.Tensor, recipe, head_dim: int) -> float:
    peaks = _row_log2_peaks(s, recipe, head_dim)
    return float("nan") if peaks is None else float(peaks.amax())


def _row_log2_peaks(s: torch.Tensor, recipe, head_dim: int) -> torch.Tensor | None:
    """Each row's peak of log2 P = (s - m) log2 e against the recipe's fixed row reference m
    (scores s (..., T, T), causal-masked), or None where the reference is a lazy maximum."""
    reference = None if recipe is None else recipe.row_reference
    if reference is RowReference.ANCHOR:  # the first keys' maximum plus the margin
        m = s[..., : recipe.anchor_keys].amax(-1) + recipe.anchor_margin / math.sqrt(head_dim)
        return ((s - m.unsqueeze(-1)) * math.log2(math.e)).amax(-1)
    if reference is RowReference.ZERO:
        return s.amax(-1) * math.log2(math.e)
    if reference is RowReference.RUNNING_MAX or recipe is None:
        return torch.zeros(s.shape[:-1], device=s.device)
    return None


def _trace_row(frame) -> dict:
    row = {}
    for (product, column), name in TRACE_COLUMNS.items():
        values = frame.loc[frame["product"] == product, column]
        row[name] = float(values.mean()) if values.notna().any() else float("nan")
    return row


_OVERFLOW_CACHE: dict = {}


def one_key_row(z: float, head_dim: int = 64, margin: float = 0.0):
    """(q, k, v) float32 (1, 1, 128, head_dim) whose query 100 scores 0 on every key but key
    40, where log2 P is z above a row reference raised by `margin` (in scaled-score units:
    the anchor's margin times the softmax scale); V all 0.5 (`p_overflow_log2`'s row)."""
    q, k = torch.zeros(2, 1, 1, 128, head_dim)
    v = torch.full((1, 1, 128, head_dim), 0.5)
    q[0, 0, 100, 0] = 8.0
    k[0, 0, 40, 0] = (z / math.log2(math.e) + margin) * math.sqrt(head_dim) / 8.0
    return q, k, v


def p_overflow_log2(recipe, head_dim: int = 64, backend: str = "reference",
                    device: str | torch.device = "cpu") -> float:
    """The smallest log2 P, against a fixed row reference, at which the recipe's own output
    turns non-finite (bisection to 1/32) on one row (query 100 of 128) whose scores are 0 but
    for one key (key 40: past the anchor's first 32 keys, off the leakage fix's diagonal
    blocks), V all 0.5 (inf: none up to 256), log2 P counted from the unquantized scores.
    On the reference path (float32 inputs) it is the recipe's own point. With the released
    stored-scale shift (`p_scale_shift`) one key cannot overflow either MXFP4 route (P^
    saturates at 2^127): inf. Before fp4lab had the shift (2026-12-01) the simulation gave
    117.5 for fa4fp4_causal_mxfp4pv and 125.5 for its D64 form. backend="triton" measures
    the kernels (bf16 inputs on `device`), which apply P's and V's 1/M_e after the P V
    product; unshifted, 116.5 for the D64 form under the interpreter."""
    key = (recipe.name, head_dim, backend)
    if key not in _OVERFLOW_CACHE:
        margin = (recipe.anchor_margin / math.sqrt(head_dim)
                  if recipe.row_reference is RowReference.ANCHOR else 0.0)
        dtype = torch.bfloat16 if backend == "triton" else torch.float32

        def finite(z: float) -> bool:
            q, k, v = (t.to(device, dtype) for t in one_key_row(z, head_dim, margin))
            out = fp4lab.attention(q, k, v, recipe, causal=True, block_m=64, block_n=64,
                                   backend=backend)
            return bool(out[0, 0, 100].isfinite().all())

        lo, hi = 0.0, 256.0
        if finite(hi):
            _OVERFLOW_CACHE[key] = math.inf
        else:
            while hi - lo > 1 / 32:
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if finite(mid) else (lo, mid)
            _OVERFLOW_CACHE[key] = hi
    return _OVERFLOW_CACHE[key]


@torch.no_grad()
def autopsy(model: GPT, x, y, call: AttentionCall, autocast) -> list[dict]:
    """Where a non-finite loss of (x, y) on the model's weights comes from: one forward with
    `call`, a row per layer (see the module). `origin` marks the first layer whose attention
    output is not finite while its inputs are; `reproduced` whether this forward's loss is
    non-finite again; `reference_nonfinite` counts the non-finite output elements of the
    same recipe recomputed on the reference path on the layer's q, k, v (the recipe's
    arithmetic, whatever kernel ran), `exact_nonfinite` those of exact attention;
    `rows_p_overflow` counts the rows whose log2 P peak against the recipe's fixed row
    reference (the anchor, or 0) reaches the recipe's overflow point `p_overflow_log2`
    (recorded as `p_overflow_log2`), computed from the unquantized q, k
    (the recipe scores its quantized Q, K, which moves a row's peak by up to a few log2
    units), `nonfinite_rows_p_overflow` those among the rows whose output is not finite; -1
    where not computed (a running or lazy maximum, which cannot overflow so, or non-finite
    inputs)."""
    model.capture = Capture()
    with autocast():
        loss = loss_of(model, x, y, call)
    capture, model.capture = model.capture, None
    exact = AttentionCall(EXACT, "reference", call.block)
    rows, found = [], False
    for layer in range(len(capture.q)):
        q, k, v, o = (t[layer] for t in (capture.q, capture.k, capture.v, capture.o))
        inputs_finite = all(bool(t.isfinite().all()) for t in (q, k, v))
        bad = ~o.isfinite().all(-1)  # (B, H, T): rows with a non-finite output element
        row = {"layer": layer, "reproduced": not math.isfinite(float(loss)),
               "inputs_finite": inputs_finite,
               "o_nonfinite": int((~o.isfinite()).sum()), "o_rows_nonfinite": int(bad.sum()),
               **_scores(q.float(), k.float(), call.recipe)}
        row |= (_peaks_of_rows(q.float(), k.float(), call, bad) if inputs_finite
                else _NO_PEAKS)
        origin = inputs_finite and row["o_nonfinite"] > 0 and not found
        found = found or origin
        row["origin"] = origin
        row["reference_nonfinite"] = (_nonfinite_output(q, k, v, call, layer) if inputs_finite
                                      and call.recipe is not None else row["o_nonfinite"])
        row["exact_nonfinite"] = (_nonfinite_output(q, k, v, exact, layer) if inputs_finite
                                  else row["o_nonfinite"])
        rows.append(row)
    return rows


def _nonfinite_output(q, k, v, call: AttentionCall, layer: int) -> int:
    reference = AttentionCall(call.recipe, "reference", call.block, call.seed)
    return int((~attend(q, k, v, reference, layer).isfinite()).sum())


def _past(point: float | None, peaks=None, rows=None, suffix: str = "") -> dict:
    """The overflow point (`suffix`: "" the recipe's, "_kernel" the kernels') and the rows
    whose log2 P peak reaches it, overall and among `rows`; NaN and -1 without a point."""
    if point is None:
        return {f"p_overflow_log2{suffix}": float("nan"), f"rows_p_overflow{suffix}": -1,
                f"nonfinite_rows_p_overflow{suffix}": -1}
    over = peaks >= point
    return {f"p_overflow_log2{suffix}": point, f"rows_p_overflow{suffix}": int(over.sum()),
            f"nonfinite_rows_p_overflow{suffix}": int((over & rows).sum())}


_NO_PEAKS = {"p_log2_peak_nonfinite_rows": float("nan"), **_past(None),
             **_past(None, suffix="_kernel")}


def _peaks_of_rows(q, k, call: AttentionCall, rows: torch.Tensor) -> dict:
    """log2 P's peak (against the recipe's fixed row reference) over the (B, H, T) rows
    marked (NaN where none is), the recipe's overflow point (`p_overflow_log2`) and the rows
    whose peak reaches it, overall and among those marked (-1 without a fixed reference);
    the same against the kernels' own point (`_kernel` columns) when the call ran on Triton
    (NaN and -1 otherwise)."""
    recipe = call.recipe
    fixed = recipe is not None and recipe.row_reference in (RowReference.ANCHOR,
                                                           RowReference.ZERO)
    if not fixed:
        return dict(_NO_PEAKS)
    t, d = q.shape[-2], q.shape[-1]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1),
                      float("-inf"))
    peaks = _row_log2_peaks(s, recipe, d)
    kernel = (p_overflow_log2(recipe, d, "triton", q.device) if call.backend == "triton"
              else None)
    return {"p_log2_peak_nonfinite_rows": float(peaks[rows].amax()) if bool(rows.any())
            else float("nan"), **_past(p_overflow_log2(recipe, d), peaks, rows),
            **_past(kernel, peaks, rows, "_kernel")}


def _gradient_error(q, k, v, do, call: AttentionCall, layer: int) -> dict:
    """Relative L2 error of the layer's O, dQ, dK, dV under the recipe against exact float64
    attention on the same q, k, v, dO (the reference path's simulation of the recipe); with a
    straight-through `call.gradient`, O's from the recipe and the gradients' from the
    gradient recipe, as training takes them."""
    seed = None if call.seed is None else (call.seed * 1_000_003 + layer) % 2**62

    def errors(recipe):
        found = fp4lab.compare(q, k, v, do, recipe, causal=True, generator=seed, trace=False,
                               block_m=call.block, block_n=call.block)
        return found.errors.set_index("tensor")["rel_l2"]

    forward = errors(call.recipe)
    backward = forward if call.gradient is None else errors(call.gradient)
    return {"o_err_vs_exact": float(forward["o"]),
            **{f"{t}_err_vs_exact": float(backward[t]) for t in ("dq", "dk", "dv")}}


def leak_positions(seq_len: int) -> list[int]:
    """Positions to change: 3/8, 5/8 and 7/8 of the way, off the blocks' first positions."""
    return sorted({seq_len * 3 // 8 + 5, seq_len * 5 // 8 + 3, seq_len * 7 // 8 + 1})


@torch.no_grad()
def leakage(model: GPT, x: torch.Tensor, vocab: int, call: AttentionCall, autocast) -> dict:
    """Logit changes before a replaced token of the sequences x (B, T) (see the module)."""
    with autocast():
        before = model(x, call).float()
    largest, relative = 0.0, []
    for position in leak_positions(x.shape[1]):
        changed = x.clone()
        changed[:, position] = (changed[:, position] + 1) % vocab
        with autocast():
            delta = (model(changed, call).float() - before).abs()  # (B, T, vocab)
        past, rest = delta[:, :position], delta[:, position:]
        largest = max(largest, float(past.max()))
        relative.append(float(past.norm() / rest.norm().clamp_min(1e-30)))
    return {"leak_max_abs": largest, "leak_rel": sum(relative) / len(relative)}
