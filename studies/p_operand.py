"""p-operand: what quantizing P does inside attention, and when FP8 P underflows.

What. Attention's O = P V consumes P = exp(S - m), m the online softmax's running row
maximum; a low-precision P loses the small probabilities (they flush to zero), the row sum
l no longer matches the P that P V consumed, and the output shrinks or moves. This study
runs `fp4lab.attention` with only P quantized (every other operand exact) and reads the
trace (`pv` a_flushed, p_mass_lost, a_err; the out rows' row_sum_err, out_err) and the
output against exact float64 attention, per (batch, head), over four sweeps:

- ``sink``: the attention-sink strength Delta, the P lift S (`p_lift`) and the key/value
  order (`kv_order`), P cast to FP8 E4M3: the P-Cast anchor below;
- ``format``: P's format (FP8 casts; NVFP4 with its per-tile tensor scale, one level, UE5M3
  scales, stochastic rounding; MXFP4 with each E8M0 rule, the alpha rules included; MXFP8)
  against S, the order and the row sum (`row_sum`: unquantized P, or the represented P, the
  softmax row correction);
- ``logit``: the logit scale (the scores' temperature) for each format;
- ``two_level``: P against the running max, with S = 1 and with S = M_e M_s (SageAttention3's
  2688 for E4M3-scaled E2M1), against two-level P scaled per row (`p_quant=row_scaled`).

The input (the P-Cast model). Per (batch, head), query i is (sqrt(D), sqrt(D) u_i) with u_i
uniform on the unit sphere of the other D - 1 channels, key j is (0, g_j), g_j ~ N(0, I),
and the first `sink_keys` keys are (Delta, g_j). With the softmax scale lambda / sqrt(D) the
scores are lambda (u_i . g_j) + lambda Delta [j is a sink], and u_i . g_j is exactly N(0, 1)
for every fixed query: non-sink scores N(0, lambda^2), sink scores lambda (Delta + N(0, 1)),
as the model assumes (lambda = 1 in the anchor sweep). V_j = mu + N(0, I), mu ~ N(0, I)
shared by a head's keys: values share a mean direction in trained models, and only then does
lost probability mass shrink the output (with zero-mean values it would move O by noise).
The same draws serve every cell (paired comparisons); only Delta and lambda change.

Saved activations. With `inputs` (a file written by `fp4lab.analysis.save_inputs`) the
format, logit and two-level sweeps run on the file's Q, K, V instead of the model, with its
(batch, head) pairs as the units; the sink sweep, which varies the model's sink margin,
does not run, and the report says so.

Anchor ("P-Cast Precision in FP8 Attention", arXiv 2606.06521). With forward iteration the
sink's tile comes first, m is the sink's score Delta + M_k (M_k the largest of k standard
normals), and a non-sink P = exp(z - Delta - M_k) times S flushes in E4M3 below 2^-10 (half
its smallest subnormal): a fraction Phi(Delta + delta_k - 6.93 - ln S), delta_k = E M_k =
1.03 for k = 4. With reverse iteration and S = 256, none flushes. The report checks

1. the measurement against the same model evaluated exactly: the flush probability of a key
   in tile t is E Phi((m_t - c - ln S) / lambda), c = -ln(2^-10), m_t / lambda =
   max(Delta + M_k, M_n) over the sink (if tile 0 has been visited) and the n non-sink keys
   visited so far, whose CDF is Phi(x - Delta)^k Phi(x)^n; tolerance z standard errors of
   the mean over (batch, head) units plus the binomial floor of the count;
2. the paper's closed form, which plugs the mean delta_k into Phi instead of averaging over
   M_k: its tolerance adds J_k = max_a |Phi(a) - E Phi(a + M_k - delta_k)|, the error that
   replacement makes by construction (computed from k alone, 0.05 for k = 4);
3. reverse iteration with S = 256: no non-sink probability outside the sink's key tile
   flushes, at any Delta (exactly zero). The sink's own tile is visited last with the sink
   in it, so its other keys flush as under forward iteration; the report says how many.

Caveats. The flushed fractions are read from the trace's per-tile a_flushed (a fraction of
the tile's nonzero P; every P of this input is a normal float32, so the count is exact); the
sink tile's count is taken as the non-sink keys', assuming the sinks (the row's largest
scores) never flush. Standard errors treat (batch, head) pairs as independent units; the
rows of one head share its keys.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.figure import Figure
from scipy.special import log_ndtr, ndtr

import fp4lab
from fp4lab.formats import FloatFormat, QuantSpec, get
from fp4lab.recipes import AttentionRecipe, KVOrder, PQuant, RowSum, Trace
from fp4lab.studies import describe_inputs, markdown_table, resolve_inputs, study_inputs

QUESTION = (
    "What does quantizing P do to attention (flushed fraction and mass, row-sum bias, output "
    "error and magnitude bias) across sink strength, logit scale, key/value order, the P lift "
    "and P's format, with and without row correction and two-level scaling; does FP8 P "
    "underflow as P-Cast's Phi(Delta + delta_k - 6.93 - ln S) says?"
)

FORMATS = (
    "fp8_e4m3fn", "fp8_e5m2", "nvfp4", "nvfp4_1level", "nvfp4_ue5m3", "nvfp4_sr", "mxfp4",
    "mxfp4_ceil", "mxfp4_even", "mxfp4_rceil", "mxfp4_alpha_ceil", "mxfp4_alpha_mse",
    "mxfp4_alpha_half", "mxfp8_e4m3", "mxfp8_e4m3_alpha_ceil",
)
ORDERS = tuple(o.value for o in KVOrder)
ROW_SUMS = tuple(r.value for r in RowSum)
SWEEPS = ("sink", "format", "logit", "two_level")


@dataclass(frozen=True)
class POperandConfig:
    batch: int = 2  # batch x heads are the independent units of the standard errors
    heads: int = 8
    seq: int = 4096  # queries = keys
    head_dim: int = 64
    block_m: int = 128  # query tile
    block_n: int = 128  # key tile
    sink_keys: int = 4  # k: keys 0 .. k-1 score Delta above the rest
    deltas: tuple[float, ...] = tuple(0.5 * i for i in range(33))  # sink sweep: 0 .. 16
    lifts: tuple[float, ...] = (1.0, 256.0)  # sink sweep: S
    orders: tuple[str, ...] = ORDERS  # key/value orders of the sink and format sweeps
    sink_format: str = "fp8_e4m3fn"  # P's element cast in the sink sweep
    formats: tuple[str, ...] = FORMATS  # P's formats in the format and logit sweeps
    format_delta: float = 8.0  # Delta of the format, logit and two-level sweeps
    format_lifts: tuple[float, ...] = (1.0, 256.0, 2688.0)  # S of the format sweep
    row_sums: tuple[str, ...] = ROW_SUMS  # row sum: unquantized or represented P
    logit_scales: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0)  # lambda: scores' scale
    two_level_formats: tuple[str, ...] = ("nvfp4_1level", "nvfp4_ue5m3")  # no tensor scale
    sweeps: tuple[str, ...] = SWEEPS  # which sweeps run
    trace_head: bool = True  # keep the per-tile trace of (batch 0, head 0) of format cells
    z: float = 3.0  # tolerances, in standard errors
    inputs: str | None = None  # a save_inputs file's Q, K, V instead of the P-Cast model
    inputs_sha256: str | None = None  # the file's hash (recorded; checked when given)

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq", "head_dim", "block_m", "block_n", "sink_keys"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("block_m", "block_n"):
            if self.seq % getattr(self, name):
                raise ValueError(f"{name} must divide seq ({self.seq}), got "
                                 f"{getattr(self, name)}: the counts assume whole tiles")
        if self.sink_keys >= self.block_n:
            raise ValueError(f"sink_keys must be below block_n, got {self.sink_keys}")
        get(self.sink_format, FloatFormat)  # the closed form is for an element cast
        for name in (*self.formats, *self.two_level_formats):
            get(name, (QuantSpec, FloatFormat))
        for name in self.two_level_formats:
            _check_two_level(get(name, (QuantSpec, FloatFormat)))
        _check_choices("orders", self.orders, ORDERS)
        _check_choices("row_sums", self.row_sums, ROW_SUMS)
        _check_choices("sweeps", self.sweeps, SWEEPS)
        for name in ("lifts", "format_lifts", "logit_scales"):
            if not all(x > 0 and math.isfinite(x) for x in getattr(self, name)):
                raise ValueError(f"{name} must be positive finite numbers, got "
                                 f"{getattr(self, name)}")
        if not self.z > 0:
            raise ValueError(f"z must be positive, got {self.z}")
        path, sha = resolve_inputs(self.inputs, self.inputs_sha256)
        object.__setattr__(self, "inputs", path)
        object.__setattr__(self, "inputs_sha256", sha)


def _check_choices(name: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    for value in values:
        if value not in allowed:
            raise ValueError(f"{name}: {value!r} is not one of {', '.join(allowed)}")


def _check_two_level(spec) -> None:
    ok = isinstance(spec, QuantSpec) and spec.block is not None and len(spec.block) == 1
    if not ok or spec.tensor_scale or spec.element.max * spec.scale.max > 3e38:
        raise ValueError(f"two_level_formats: {spec.name} needs 1-D blocks, no tensor scale "
                         "and a finite M_e x M_s (row-scaled P maps each row's max there)")


PRESETS = {
    "smoke": POperandConfig(
        batch=1, heads=8, seq=512, deltas=(0.0, 2.0, 4.0, 5.0, 6.0, 7.0, 8.0, 10.0, 11.0, 12.0,
                                           13.0, 14.0),
        formats=("fp8_e4m3fn", "nvfp4", "nvfp4_1level", "nvfp4_sr", "mxfp4",
                 "mxfp4_alpha_ceil"),
        format_lifts=(1.0, 256.0), logit_scales=(0.5, 1.0, 2.0),
        two_level_formats=("nvfp4_1level",),
    ),
    "full": POperandConfig(),
}


# -- the sweep -----------------------------------------------------------------------------


def _cell(sweep, fmt, lift, order, row_sum, p_quant, delta, logit) -> dict:
    return {"sweep": sweep, "format": fmt, "lift": float(lift), "order": order,
            "row_sum": row_sum, "p_quant": p_quant, "delta": float(delta),
            "logit_scale": float(logit)}


def cells(config: POperandConfig) -> list[dict]:
    found = []
    unq, spec = RowSum.UNQUANTIZED_P.value, PQuant.SPEC.value
    if "sink" in config.sweeps and config.inputs is None:  # it varies the model's sink
        found += [_cell("sink", config.sink_format, s, o, unq, spec, d, 1.0)
                  for d in config.deltas for s in config.lifts for o in config.orders]
    delta = config.format_delta
    if "format" in config.sweeps:
        found += [_cell("format", f, s, o, r, spec, delta, 1.0) for f in config.formats
                  for s in config.format_lifts for o in config.orders for r in config.row_sums]
    if "logit" in config.sweeps:
        found += [_cell("logit", f, 1.0, "forward", unq, spec, delta, lam)
                  for lam in config.logit_scales for f in config.formats]
    if "two_level" in config.sweeps:
        for f in config.two_level_formats:
            p = get(f, QuantSpec)
            top = p.element.max * p.scale.max
            for o in config.orders:
                found += [_cell("two_level", f, 1.0, o, unq, spec, delta, 1.0),
                          _cell("two_level", f, top, o, unq, spec, delta, 1.0),
                          _cell("two_level", f, 1.0, o, unq, PQuant.ROW_SCALED.value, delta, 1.0)]
    return found


def recipe_for(config: POperandConfig, cell: dict) -> AttentionRecipe:
    """Only P quantized, as the cell says; every other operand exact."""
    name = (f"p={cell['format']},S={cell['lift']:g},{cell['order']},{cell['row_sum']},"
            f"{cell['p_quant']}")
    return AttentionRecipe(
        name=name, p=cell["format"], p_lift=cell["lift"], kv_order=cell["order"],
        row_sum=cell["row_sum"], p_quant=cell["p_quant"], block_m=config.block_m,
        block_n=config.block_n, source="studies/p_operand.py",
    )


# -- the input and one cell ----------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _draws(config: POperandConfig, seed: int, device: str):
    """(u, g, v): unit query directions (B, H, N, D-1), key channels (B, H, N, D-1), values
    (B, H, N, D) with a mean shared by each head's keys, drawn on the CPU from the run's
    seed, moved to `device`."""
    gen = torch.Generator().manual_seed(seed)
    shape = (config.batch, config.heads, config.seq, config.head_dim - 1)
    u = torch.randn(*shape, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    g = torch.randn(*shape, generator=gen)
    mean = torch.randn(config.batch, config.heads, 1, config.head_dim, generator=gen)
    v = mean + torch.randn(*shape[:-1], config.head_dim, generator=gen)
    return u.to(device), g.to(device), v.to(device)


def sink_inputs(config: POperandConfig, delta: float, seed: int, device: str):
    """q, k, v of the P-Cast model (module docstring), each (B, H, N, D)."""
    u, g, v = _draws(config, seed, device)
    root = math.sqrt(config.head_dim)
    q = torch.cat([torch.full_like(u[..., :1], root), root * u], dim=-1)
    sink = torch.zeros_like(g[..., :1])
    sink[:, :, : config.sink_keys] = delta
    return q, torch.cat([sink, g], dim=-1), v


@functools.lru_cache(maxsize=1)
def _saved(path: str, seed: int, device: str):
    """q, k, v of a save_inputs file, on `device`."""
    x = study_inputs(path, seed)
    return x.q.to(device), x.k.to(device), x.v.to(device)


def cell_inputs(config: POperandConfig, delta: float, seed: int, device: str):
    """q, k, v of a cell: the P-Cast model at `delta`, or the inputs file's (delta unused)."""
    if config.inputs is not None:
        return _saved(config.inputs, seed, device)
    return sink_inputs(config, delta, seed, device)


@functools.lru_cache(maxsize=1)
def _exact(config: POperandConfig, delta: float, logit: float, seed: int, device: str):
    """Exact attention in float64 on the reference path: the oracle, whatever the backend."""
    q, k, v = cell_inputs(config, delta, seed, device)
    scale = logit / math.sqrt(q.shape[-1])
    return fp4lab.attention(q.double(), k.double(), v.double(), "exact", scale=scale,
                            block_m=config.block_m, block_n=config.block_n, backend="reference")


def run_cell(config: POperandConfig, cell: dict, ctx) -> dict:
    q, k, v = cell_inputs(config, cell["delta"], ctx.seed, ctx.device)
    recipe = recipe_for(config, cell)
    trace = Trace()
    out = fp4lab.attention(
        q, k, v, recipe, scale=cell["logit_scale"] / math.sqrt(q.shape[-1]), trace=trace,
        generator=ctx.cell_seed if recipe.stochastic else None, backend=ctx.backend,
    )
    ref = _exact(config, cell["delta"], cell["logit_scale"], ctx.seed, ctx.device)
    frame = trace.to_frame()
    unit = _unit if config.inputs is None else _file_unit
    rows = [unit(config, frame, out, ref, b, h)
            for b in range(q.shape[0]) for h in range(q.shape[1])]
    keep = config.trace_head and cell["sweep"] == "format"
    head = frame[(frame["batch"] == 0) & (frame["head"] == 0)] if keep else frame.iloc[:0]
    return {"metrics": rows, "trace": head[head["product"].isin(["pv", "out"])]}


def _unit(config, frame: pd.DataFrame, out, ref, b: int, h: int) -> dict:
    """One (batch, head)'s figures: flushed fractions of the non-sink P (all, in the sink's
    key tile, elsewhere), mass lost, P error, row-sum error, output error and bias."""
    here = frame[(frame["batch"] == b) & (frame["head"] == h)]
    pv, rows = here[here["product"] == "pv"], here[here["product"] == "out"]
    bm, bn, k = config.block_m, config.block_n, config.sink_keys
    sink_tile = pv["k_tile"] == 0
    flushed = pv["a_flushed"] * bm * bn  # every P of this input is nonzero
    n_queries = config.seq
    o, r = out[b, h].double(), ref[b, h].double()
    return {
        "batch": b, "head": h,
        "flushed": flushed.sum() / (n_queries * (config.seq - k)),
        "flushed_sink_tile": flushed[sink_tile].sum() / (n_queries * (bn - k)),
        "flushed_other_tiles": (flushed[~sink_tile].sum() / (n_queries * (config.seq - bn))
                                if config.seq > bn else math.nan),
        "p_mass_lost": pv.groupby("q_tile")["p_mass_lost"].sum().mean(),
        "p_err": pv["a_err"].mean(),
        "row_sum_err": rows["row_sum_err"].mean(),
        "out_err_tiles": rows["out_err"].mean(),
        "out_rel_l2": ((o - r).norm() / r.norm()).item(),
        "out_bias": 1 - ((o * r).sum() / (r * r).sum()).item(),
    }


def _file_unit(config, frame: pd.DataFrame, out, ref, b: int, h: int) -> dict:
    """`_unit`'s figures on an inputs file's (batch, head), which has no sink by
    construction: the flushed fraction is the mean over tiles of the trace's share of
    nonzero P flushed, the sink-tile split NaN."""
    here = frame[(frame["batch"] == b) & (frame["head"] == h)]
    pv, rows = here[here["product"] == "pv"], here[here["product"] == "out"]
    o, r = out[b, h].double(), ref[b, h].double()
    return {
        "batch": b, "head": h, "flushed": pv["a_flushed"].mean(),
        "flushed_sink_tile": math.nan, "flushed_other_tiles": math.nan,
        "p_mass_lost": pv.groupby("q_tile")["p_mass_lost"].sum().mean(),
        "p_err": pv["a_err"].mean(),
        "row_sum_err": rows["row_sum_err"].mean(),
        "out_err_tiles": rows["out_err"].mean(),
        "out_rel_l2": ((o - r).norm() / r.norm()).item(),
        "out_bias": 1 - ((o * r).sum() / (r * r).sum()).item(),
    }


# -- the model ----------------------------------------------------------------------------


def flush_threshold(fmt: FloatFormat) -> float:
    """c = -ln(half the smallest subnormal): a lifted P below e^-c rounds to zero (6.93 for
    E4M3)."""
    return -math.log(fmt.min_subnormal / 2)


_GRID = np.linspace(-12.0, 40.0, 52001)  # x, in units of the non-sink scores' spread


def _max_cdf(delta: float, k: int, n: int, sink: bool) -> np.ndarray:
    """CDF on _GRID of max(Delta + M_k, M_n) (or of M_n without the sink)."""
    log_cdf = n * log_ndtr(_GRID) + (k * log_ndtr(_GRID - delta) if sink else 0.0)
    return np.exp(log_cdf)


@functools.lru_cache
def expected_max(k: int) -> float:
    """delta_k = E[max of k standard normals]."""
    cdf = _max_cdf(0.0, k, 0, True)
    mid = (_GRID[1:] + _GRID[:-1]) / 2
    return float((mid * np.diff(cdf)).sum())


def _mean_flush(cdf: np.ndarray, shift: float) -> float:
    """E Phi(X - shift) for X with the CDF `cdf` on _GRID."""
    mid = (_GRID[1:] + _GRID[:-1]) / 2
    return float((ndtr(mid - shift) * np.diff(cdf)).sum())


def model_fraction(config: POperandConfig, cell: dict) -> dict[str, float]:
    """The model's flushed fractions of non-sink P (all, sink tile, other tiles) for a cell
    with an element cast P (module docstring, check 1)."""
    fmt = get(cell["format"], FloatFormat)
    lam, delta, k, bn = cell["logit_scale"], cell["delta"], config.sink_keys, config.block_n
    shift = (flush_threshold(fmt) + math.log(cell["lift"])) / lam
    tiles = config.seq // bn
    fractions = []
    for t in range(tiles):
        visited = t + 1 if cell["order"] == "forward" else tiles - t  # tiles seen, t's included
        sink = cell["order"] == "forward" or t == 0
        n = visited * bn - (k if sink else 0)
        fractions.append(_mean_flush(_max_cdf(delta, k, n, sink), shift))
    weights = np.full(tiles, float(bn))
    weights[0] -= k
    return {
        "flushed": float((np.array(fractions) * weights).sum() / weights.sum()),
        "flushed_sink_tile": fractions[0],
        "flushed_other_tiles": float(np.mean(fractions[1:])) if tiles > 1 else math.nan,
    }


def closed_form(config: POperandConfig, cell: dict) -> float:
    """P-Cast's Phi(Delta + delta_k - c - ln S) (c = 6.93 for E4M3)."""
    fmt = get(cell["format"], FloatFormat)
    a = cell["delta"] + expected_max(config.sink_keys) - flush_threshold(fmt)
    return float(ndtr(a - math.log(cell["lift"])))


@functools.lru_cache
def jensen_bound(k: int) -> float:
    """J_k = max over a of |Phi(a) - E Phi(a + M_k - delta_k)|: how far plugging the mean of
    the sink's maximum into Phi can be from averaging over it."""
    cdf, mean = _max_cdf(0.0, k, 0, True), expected_max(k)
    shifts = np.linspace(-6, 6, 241)
    return float(max(abs(ndtr(-s) - _mean_flush(cdf, s + mean)) for s in shifts))


# -- the report ----------------------------------------------------------------------------


UNIT_METRICS = ("flushed", "flushed_sink_tile", "flushed_other_tiles", "p_mass_lost", "p_err",
                "row_sum_err", "out_err_tiles", "out_rel_l2", "out_bias")
CELL_KEYS = ("sweep", "format", "lift", "order", "row_sum", "p_quant", "delta", "logit_scale")


def per_cell(metrics: pd.DataFrame) -> pd.DataFrame:
    """Means over the (batch, head) units of each cell, with standard errors (_se)."""
    grouped = metrics.groupby(["cell", *CELL_KEYS], sort=False)[list(UNIT_METRICS)]
    mean, sem, n = grouped.mean(), grouped.sem(), grouped.size()
    out = mean.join(sem.add_suffix("_se"))
    out["units"] = n
    return out.reset_index()


def anchor_table(config: POperandConfig, cells_frame: pd.DataFrame) -> pd.DataFrame:
    """The sink sweep's cells with the model, the closed form and the three checks."""
    sink = cells_frame[cells_frame["sweep"] == "sink"].copy()
    if sink.empty:
        return sink
    j = jensen_bound(config.sink_keys)
    count = config.batch * config.heads * config.seq * (config.seq - config.sink_keys)
    records = []
    for _, row in sink.iterrows():
        model = model_fraction(config, row)
        closed = closed_form(config, row)
        floor = model["flushed"] * (1 - model["flushed"]) / count
        tol = config.z * math.sqrt(row["flushed_se"] ** 2 + floor)
        records.append({
            "model": model["flushed"], "model_sink_tile": model["flushed_sink_tile"],
            "model_other_tiles": model["flushed_other_tiles"], "closed_form": closed,
            "tolerance": tol, "model_ok": abs(row["flushed"] - model["flushed"]) <= tol,
            "closed_ok": (abs(row["flushed"] - closed) <= tol + j
                          if row["order"] == KVOrder.FORWARD.value else None),
        })
    return pd.concat([sink.reset_index(drop=True), pd.DataFrame(records)], axis=1)


def _midpoint(deltas: np.ndarray, values: np.ndarray) -> float:
    """The Delta at which a rising fraction crosses 1/2 (linear interpolation), or NaN."""
    above = np.nonzero(values >= 0.5)[0]
    if not len(above) or above[0] == 0:
        return math.nan
    i = above[0]
    d0, d1, v0, v1 = deltas[i - 1], deltas[i], values[i - 1], values[i]
    return float(d0 + (0.5 - v0) * (d1 - d0) / (v1 - v0))


def _anchor_section(config: POperandConfig, table: pd.DataFrame) -> tuple[str, list[str]]:
    if table.empty:
        return "", ["The sink sweep did not run: no anchor check."]
    k, j = config.sink_keys, jensen_bound(config.sink_keys)
    c = flush_threshold(get(config.sink_format, FloatFormat))
    text = (
        "## Anchor: P-Cast's FP8 underflow\n\n"
        f"P cast to {config.sink_format} (flush below e^-c, c = {c:.3f}), {k} sink keys, "
        f"delta_k = E M_k = {expected_max(k):.4f}; Delta over "
        f"{min(table['delta']):g} .. {max(table['delta']):g}. Tolerance z = {config.z:g} "
        "standard errors of the mean over (batch, head) units (with the binomial floor of the "
        f"count); the closed form's adds J_k = {j:.4f}, the error of plugging delta_k into "
        "Phi.\n\n"
    )
    short = []
    model_ok, forward = table["model_ok"], table[table["order"] == "forward"]
    text += (f"1. Measured against the model evaluated exactly: {int(model_ok.sum())} of "
             f"{len(table)} cells within tolerance (largest deviation "
             f"{(table['flushed'] - table['model']).abs().max():.2g}).\n")
    short.append(f"FP8 P underflow follows the P-Cast model exactly evaluated in "
                 f"{int(model_ok.sum())} of {len(table)} cells "
                 f"({'pass' if model_ok.all() else 'FAIL'}).")
    text += (f"2. Measured against the closed form Phi(Delta + {expected_max(k):.2f} - "
             f"{c:.2f} - ln S), forward order: {int(forward['closed_ok'].sum())} of "
             f"{len(forward)} cells within tolerance + J_k (largest deviation "
             f"{(forward['flushed'] - forward['closed_form']).abs().max():.3f}).\n")
    for lift, rows in forward.groupby("lift"):
        rows = rows.sort_values("delta")
        measured = _midpoint(rows["delta"].to_numpy(), rows["flushed"].to_numpy())
        closed = c + math.log(lift) - expected_max(k)
        slope = _slope(rows)
        text += (f"   - S = {lift:g}: half the non-sink P flush at Delta = {measured:.2f} "
                 f"(closed form {closed:.2f}); the measured curve's slope at its midpoint is "
                 f"{slope:.2f} of the closed form's (the sink's random maximum spreads it).\n")
        short.append(
            f"Forward, S = {lift:g}: half the non-sink P flush at Delta = {measured:.2f} "
            f"(closed form {closed:.2f}), "
            f"{'within' if forward['closed_ok'].all() else 'NOT within'} the closed form's "
            "tolerance over the sweep.")
    reverse = table[(table["order"] == "reverse") & (table["lift"] == 256.0)]
    if len(reverse):
        outside = reverse["flushed_other_tiles"].max()
        worst = reverse.loc[reverse["flushed"].idxmax()]
        text += (f"3. Reverse order, S = 256: the largest flushed fraction outside the sink's "
                 f"key tile is {outside:.3g} (claim: none); over all non-sink keys it reaches "
                 f"{worst['flushed']:.3g} at Delta = {worst['delta']:g}, all of it in the "
                 f"sink's own tile (its fraction {worst['flushed_sink_tile']:.3g}, visited "
                 "last with the sink, as under forward order).\n")
        short.append(f"Reverse order with S = 256: {'no' if outside == 0 else 'SOME'} non-sink "
                     "P outside the sink's key tile flushes at any Delta "
                     f"({'reproduced' if outside == 0 else 'NOT reproduced'}); the "
                     f"{config.block_n - k} other keys of the sink's tile flush as forward "
                     f"order's do (up to {worst['flushed']:.2g} of all non-sink P).")
    rev1 = table[(table["order"] == "reverse") & (table["lift"] == 1.0)]
    if len(rev1):
        text += (f"4. Reverse order alone (S = 1) still flushes up to "
                 f"{rev1['flushed_other_tiles'].max():.2g} of the keys outside the sink's tile "
                 "(their running maximum is the largest non-sink score seen).\n")
    table_view = table[table["delta"].isin(sorted(set(table["delta"]))[::2])]
    text += "\n" + markdown_table(table_view, {
        "order": "order", "lift": "S", "delta": "Delta", "flushed": "measured",
        "flushed_se": "std. error", "model": "model", "closed_form": "closed form",
        "flushed_other_tiles": "outside sink tile", "model_ok": "model ok",
        "closed_ok": "closed form ok"}) + "\n"
    return text, short


def _slope(rows: pd.DataFrame) -> float:
    """d fraction / d Delta at the measured midpoint over the closed form's 1/sqrt(2 pi)."""
    d, v = rows["delta"].to_numpy(), rows["flushed"].to_numpy()
    i = int(np.argmin(np.abs(v - 0.5)))
    lo, hi = max(i - 1, 0), min(i + 1, len(d) - 1)
    return float((v[hi] - v[lo]) / (d[hi] - d[lo]) * math.sqrt(2 * math.pi))


def _where(config: POperandConfig) -> str:
    """The input of the format sweep in a few words."""
    return "the inputs file" if config.inputs is not None else f"Delta = {config.format_delta:g}"


def _format_section(config, frame: pd.DataFrame) -> tuple[str, list[str]]:
    rows = frame[frame["sweep"] == "format"]
    if rows.empty:
        return "", []
    text = (f"## P's format ({_where(config)}, logit scale 1)\n\n"
            "Means over (batch, head); flushed: fraction of non-sink P flushed; mass lost: "
            "probability mass flushed per row; row-sum error: l^/l - 1 of the row sum P V "
            "used; output bias: 1 - <O, O_ref>/<O_ref, O_ref>.\n\n")
    unq = rows[rows["row_sum"] == RowSum.UNQUANTIZED_P.value]
    text += markdown_table(unq, {
        "format": "format", "lift": "S", "order": "order", "flushed": "flushed",
        "p_mass_lost": "mass lost", "p_err": "P error", "row_sum_err": "row-sum error",
        "out_rel_l2": "output error", "out_bias": "output bias"}) + "\n"
    best = unq.loc[unq["out_rel_l2"].idxmin()]
    worst = unq.loc[unq["out_rel_l2"].idxmax()]
    short = [f"P's format ({_where(config)}): output error from "
             f"{best['out_rel_l2']:.3g} ({best['format']}, S = {best['lift']:g}, "
             f"{best['order']}) to {worst['out_rel_l2']:.3g} ({worst['format']}, S = "
             f"{worst['lift']:g}, {worst['order']})."]
    text2, short2 = _row_correction(config, rows)
    return text + text2, short + short2


def _row_correction(config, rows: pd.DataFrame) -> tuple[str, list[str]]:
    """Row correction (row_sum = quantized_p) against the unquantized row sum, paired."""
    keys = ["format", "lift", "order"]
    wide = rows.pivot_table(index=keys, columns="row_sum",
                            values=["out_bias", "out_bias_se", "row_sum_err", "out_rel_l2"],
                            sort=False)
    if RowSum.QUANTIZED_P.value not in set(rows["row_sum"]) or wide.empty:
        return "", []
    u, q = RowSum.UNQUANTIZED_P.value, RowSum.QUANTIZED_P.value
    bias_u, bias_q = wide[("out_bias", u)], wide[("out_bias", q)]
    biased = (bias_u.abs() > config.z * wide[("out_bias_se", u)]).sum()
    unbiased = (bias_q.abs() <= config.z * wide[("out_bias_se", q)]).sum()
    smaller = (bias_q.abs() < bias_u.abs()).sum()
    better = (wide[("out_rel_l2", q)] < wide[("out_rel_l2", u)]).sum()
    text = (
        "### Row correction\n\n"
        f"Over {len(wide)} (format, S, order) settings: with the unquantized row sum the "
        f"output's magnitude bias exceeds {config.z:g} standard errors in {biased} (median "
        f"|bias| {bias_u.abs().median():.2g}); with the row correction (l summed from the "
        f"represented P) |bias| is smaller in {smaller} (median {bias_q.abs().median():.2g}) "
        f"and within {config.z:g} standard errors of zero in {unbiased}. The correction "
        "renormalizes the kept probabilities; it cannot give the lost mass back to the keys "
        "it belonged to, so a residual bias of either sign remains. It lowers the output "
        f"error in {better} of {len(wide)}.\n\n"
    )
    return text, [f"Row correction: |output bias| smaller in {smaller} of {len(wide)} settings "
                  f"(median {bias_u.abs().median():.2g} -> {bias_q.abs().median():.2g}), zero "
                  f"within {config.z:g} standard errors in {unbiased}; output error lower in "
                  f"{better} of {len(wide)}."]


def _logit_section(frame: pd.DataFrame) -> tuple[str, list[str]]:
    rows = frame[frame["sweep"] == "logit"]
    if rows.empty:
        return "", []
    wide = rows.pivot_table(index="format", columns="logit_scale", values="flushed", sort=False)
    err = rows.pivot_table(index="format", columns="logit_scale", values="out_rel_l2",
                           sort=False)
    shown = pd.concat([wide.add_prefix("flushed @"), err.add_prefix("error @")], axis=1)
    text = ("## Logit scale (forward order, S = 1, unquantized row sum)\n\n"
            "Flushed fraction and output error against the scores' scale lambda (sharper "
            "softmax: more P far below the row maximum).\n\n"
            + markdown_table(shown.reset_index()) + "\n")
    grow = int((wide.iloc[:, -1] >= wide.iloc[:, 0]).sum())
    return text, [f"A larger logit scale flushes more P in {grow} of {len(wide)} formats "
                  f"(lambda {wide.columns[0]:g} -> {wide.columns[-1]:g})."]


def _two_level_section(config, frame: pd.DataFrame) -> tuple[str, list[str]]:
    rows = frame[frame["sweep"] == "two_level"]
    if rows.empty:
        return "", []
    rows = rows.assign(scaling=[
        "two-level (per row)" if p == PQuant.ROW_SCALED.value
        else ("running max, S = M_e M_s" if s > 1 else "running max, S = 1")
        for p, s in zip(rows["p_quant"], rows["lift"], strict=True)])
    text = ("## Running-max against two-level scaling\n\n"
            + markdown_table(rows, {"format": "format", "order": "order", "scaling": "P scaling",
                                    "flushed": "flushed", "p_mass_lost": "mass lost",
                                    "out_rel_l2": "output error", "out_bias": "output bias"})
            + "\n")
    short = []
    for (fmt, order), group in rows.groupby(["format", "order"], sort=False):
        best = group.loc[group["out_rel_l2"].idxmin()]
        se = np.hypot(group["out_rel_l2_se"], best["out_rel_l2_se"])
        tied = group[(group["out_rel_l2"] - best["out_rel_l2"]).abs() <= config.z * se]
        names = " = ".join(tied["scaling"])
        short.append(f"{fmt} ({order}): lowest output error {best['out_rel_l2']:.3g} with "
                     + (f"{names} (indistinguishable within {config.z:g} standard errors)."
                        if len(tied) > 1 else f"{best['scaling']}."))
    return text, short


def report(config: POperandConfig, metrics: pd.DataFrame):
    frame = per_cell(metrics)
    table = anchor_table(config, frame)
    setup = _file_setup(config) if config.inputs is not None else (
        "## Setup\n\n"
        f"{config.batch} x {config.heads} (batch x heads) independent units, {config.seq} "
        f"queries and keys, head_dim {config.head_dim}, tiles {config.block_m} x "
        f"{config.block_n}; {config.sink_keys} sink keys scoring Delta + N(0, 1) above "
        "non-sink N(0, 1) scores (times the logit scale); V = mu + N(0, 1), mu ~ N(0, 1) per "
        "head. Only P is quantized; "
        "errors against exact float64 attention. Sweeps: "
        f"{', '.join(config.sweeps)}.\n\n"
    )
    sections = [_anchor_section(config, table), _format_section(config, frame),
                _logit_section(frame), _two_level_section(config, frame)]
    short = "".join(f"- {line}\n" for _, lines in sections for line in lines)
    text = setup + "## What the numbers show\n\n" + short + "\n"
    text += "".join(body for body, _ in sections)
    return text, _figures(config, frame, table)


def _file_setup(config: POperandConfig) -> str:
    return (
        "## Setup\n\n"
        f"Inputs: {describe_inputs(config.inputs, config.inputs_sha256)}; its (batch, head) "
        f"pairs are the units, non-causal, tiles {config.block_m} x {config.block_n}. The "
        "sink sweep, which varies the P-Cast model's sink margin, does not run on a file; "
        "flushed is the trace's mean share of nonzero P flushed per tile. Only P is "
        "quantized; errors against exact float64 attention. Sweeps: "
        f"{', '.join(s for s in config.sweeps if s != 'sink')}.\n\n"
    )


def _figures(config, frame: pd.DataFrame, table: pd.DataFrame) -> dict[str, Figure]:
    figures = {}
    if len(table):
        for log in (False, True):
            figures["sink_flush" + ("_log" if log else "")] = _sink_figure(config, table, log)
    rows = frame[(frame["sweep"] == "format") & (frame["row_sum"] == RowSum.UNQUANTIZED_P.value)]
    if len(rows):
        fig = Figure(figsize=(11, 0.3 * rows["format"].nunique() + 2.5), layout="constrained")
        axes = fig.subplots(1, 3, sharey=True)
        rows = rows.assign(setting=[f"S={s:g}, {o}" for s, o in
                                    zip(rows["lift"], rows["order"], strict=True)])
        for ax, column in zip(axes, ("flushed", "row_sum_err", "out_rel_l2"), strict=True):
            sns.barplot(data=rows, y="format", x=column, hue="setting", ax=ax,
                        legend=column == "out_rel_l2")
            ax.set_xscale("symlog", linthresh=1e-4)
        fig.suptitle(f"P's format ({_where(config)}, unquantized row sum)")
        figures["formats"] = fig
    logit = frame[frame["sweep"] == "logit"]
    if len(logit):
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.subplots()
        sns.lineplot(data=logit, x="logit_scale", y="out_rel_l2", hue="format", marker="o", ax=ax)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylabel("output relative error")
        figures["logit_scale"] = fig
    return figures


def _sink_figure(config, table: pd.DataFrame, log: bool) -> Figure:
    """Measured non-sink flushed fraction over Delta against the model and closed form."""
    fig = Figure(figsize=(10, 4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    palette = dict(zip(sorted(set(table["lift"])), sns.color_palette(n_colors=len(
        set(table["lift"]))), strict=True))
    for ax, (order, rows) in zip(axes, table.groupby("order", sort=False), strict=False):
        for lift, curve in rows.groupby("lift"):
            curve = curve.sort_values("delta")
            color = palette[lift]
            ax.errorbar(curve["delta"], curve["flushed"], yerr=config.z * curve["flushed_se"],
                        fmt="o", color=color, label=f"measured, S = {lift:g}")
            ax.plot(curve["delta"], curve["model"], "-", color=color, label="model (exact)")
            if order == "forward":
                fine = np.linspace(curve["delta"].min(), curve["delta"].max(), 200)
                closed = [closed_form(config, {"format": config.sink_format, "delta": d,
                                               "lift": lift}) for d in fine]
                ax.plot(fine, closed, "--", color=color, label="closed form")
        ax.set_title(f"{order} key/value order")
        ax.set_xlabel("sink margin Delta")
        if log:
            ax.set_yscale("log")
            ax.set_ylim(1e-7, 1.5)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("fraction of non-sink P flushed")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"P cast to {config.sink_format}: Phi(Delta + delta_k - c - ln S) "
                 "(P-Cast) against measurement")
    return fig

