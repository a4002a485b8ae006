"""Figures of what quantization did: per-tile heatmaps of a trace, curves over a sweep.

Every function returns the matplotlib `Figure` or `Axes` it drew on and never shows or
saves it: call ``fig.savefig(...)`` yourself (the CLI does), or let a notebook display it.
Figures are made with `matplotlib.figure.Figure`, not pyplot, so no GUI backend and no global
figure list is involved; pass ``ax=`` to draw into a figure of your own.

- `tile_heatmap(trace, column, product=..., batch=, head=)`: any `Trace` column over (query
  tile, key tile) for one product, batch and head (tiles a causal mask skips stay blank).
- `product_heatmaps(trace, column)`: the same column for several products side by side, on
  one colour scale.
- `recipe_heatmaps({name: trace}, column, product)`: one panel per recipe, one colour scale.
- `comparison_heatmaps({name: trace}, column)`: one row per product, the recipes side by
  side, one colour scale and one colour bar.
- `shared_norm({name: trace}, column)`: one colour scale over several traces, to pass as
  ``norm=`` so that the same value is the same colour in every figure (the CLI's files).

Each heatmap shows one batch and head, or with ``reduce="mean"`` / ``"max"`` a summary over
all of them; its colour bar names the statistic in words (`colour_label`, from the trace's
`COLUMNS`). From 32 tiles on a side the cells lose their borders and the ticks thin out.
- `sweep_curve(frame, x, y, hue=)`: a measured figure over a swept parameter (error against
  sequence length, against the number of samples, ...), optionally log-log.
- `convergence_curve(bias.convergence)`: Quartet II's unbiasedness plot, the n-sample
  average's relative MSE with the 1/n line of pure noise.
"""

from __future__ import annotations

import math
import textwrap
import warnings

import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.axes import Axes
from matplotlib.cm import ScalarMappable
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

from fp4lab.recipes import ID_COLUMNS, Product
from fp4lab.recipes import column as trace_column

__all__ = [
    "tile_grid",
    "tile_heatmap",
    "product_heatmaps",
    "recipe_heatmaps",
    "comparison_heatmaps",
    "shared_norm",
    "colour_label",
    "REDUCTIONS",
    "sweep_curve",
    "convergence_curve",
]

PRODUCTS = tuple(p.value for p in Product)
REDUCTIONS = ("mean", "max")  # summaries over batch and heads (`reduce=`)
DENSE_TILES = 32  # from this many tiles on a side: no cell borders, fewer ticks
CMAP = "viridis"


def _frame(trace) -> pd.DataFrame:
    """A trace's DataFrame from a `Trace` (anything with `to_frame`) or the frame itself."""
    frame = trace.to_frame() if hasattr(trace, "to_frame") else trace
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"trace must be a Trace or its DataFrame, got {type(trace).__name__}")
    return frame


def _check_column(frame: pd.DataFrame, column: str) -> None:
    if column not in frame.columns or column in ID_COLUMNS:
        known = [c for c in frame.columns if c not in ID_COLUMNS]
        raise ValueError(
            f"column {column!r} is not a statistic of the trace; known: {', '.join(known)}"
        )


def tile_grid(
    trace,
    column: str,
    *,
    product: str = "pv",
    batch: int = 0,
    head: int = 0,
    call: int = 0,
    reduce: str | None = None,
) -> pd.DataFrame:
    """`column` of one (call, product) as a (q_tile x k_tile) table: of one batch and head,
    or with `reduce` ("mean" or "max") summarised over every batch and head (NaN skipped;
    `batch` and `head` are then not read). Tiles absent from the trace (skipped by a causal
    mask) are NaN. Product "out" gives one column (k_tile -1) of per-query-tile statistics."""
    frame = _frame(trace)
    _check_column(frame, column)
    if reduce not in (None, *REDUCTIONS):
        raise ValueError(f"reduce must be None, 'mean' or 'max', got {reduce!r}")
    frame = frame[frame["call"] == call]
    rows = frame[frame["product"] == product]
    if rows.empty:
        have = sorted(frame["product"].unique())
        raise ValueError(
            f"product {product!r} has no rows in call {call}; the trace has {have or 'none'}"
        )
    if reduce is None:
        rows = rows[(rows["batch"] == batch) & (rows["head"] == head)]
        if rows.empty:
            raise ValueError(
                f"batch={batch}, head={head} is not in the trace of product {product!r}"
            )
    grid = rows.pivot_table(
        index="q_tile", columns="k_tile", values=column, aggfunc=reduce or "first", dropna=False
    )
    q_tiles = range(int(frame["q_tile"].max()) + 1)
    k_tiles = (
        [-1]
        if product == "out"
        else range(int(frame.loc[frame["k_tile"] >= 0, "k_tile"].max()) + 1)
    )
    return grid.reindex(index=q_tiles, columns=k_tiles).astype(float)


def colour_label(name: str, reduce: str | None = None) -> str:
    """What a colour bar of trace column `name` shows: the statistic in words (its short
    definition, `fp4lab.recipes.column`) over its name and, with `reduce`, the summary taken;
    wrapped to fit beside a panel."""
    try:
        words = textwrap.fill(trace_column(name).short, 36)
    except ValueError:  # a column of the user's own frame
        words = ""
    tag = f"{name}, {reduce} over batch and heads" if reduce else name
    return f"{words}\n({tag})" if words else tag


def _where(batch: int, head: int, reduce: str | None) -> str:
    return f"{reduce} over batch and heads" if reduce else f"batch {batch}, head {head}"


def _norm(values: np.ndarray, log: bool):
    """A colour scale over the finite values (positive ones when `log`)."""
    finite = values[np.isfinite(values)]
    if log:
        finite = finite[finite > 0]
        if finite.size == 0:
            return Normalize(0, 1)
        lo, hi = finite.min(), finite.max()
        return LogNorm(lo, hi if hi > lo else lo * 10)
    if finite.size == 0:
        return Normalize(0, 1)
    return Normalize(
        finite.min(), finite.max() if finite.max() > finite.min() else finite.min() + 1
    )


def _ticks(n: int):
    """Seaborn's tick labels for n tiles: every tile's below DENSE_TILES, else about eight."""
    return "auto" if n < DENSE_TILES else math.ceil(n / 8)


def tile_heatmap(
    trace,
    column: str = "prod_err",
    *,
    product: str = "pv",
    batch: int = 0,
    head: int = 0,
    call: int = 0,
    reduce: str | None = None,
    log: bool = False,
    annot: bool = False,
    ax: Axes | None = None,
    norm=None,
    cbar: bool = True,
) -> Axes:
    """Heatmap of `column` over (query tile, key tile) for one product, batch and head.

    Args:
        trace: a `Trace` or its DataFrame.
        column: any statistic column (``prod_err``, ``a_flushed``, ``p_mass_lost``, ...).
        product: qk, pv, dv, dp, dq, dk, or out (per-query-tile statistics).
        batch, head, call: which slice (head is the query head).
        reduce: "mean" or "max" over every batch and head instead of one (`tile_grid`).
        log: logarithmic colour scale (zeros and NaN left blank).
        annot: write each tile's value in its cell.
        ax: axes to draw into (a new figure when None); norm: a shared colour scale.
        cbar: draw a colour bar, labelled with the statistic in words (`colour_label`).

    From DENSE_TILES tiles on a side the cells have no borders and about eight ticks.
    """
    grid = tile_grid(
        trace, column, product=product, batch=batch, head=head, call=call, reduce=reduce
    )
    rows, cols = grid.shape
    dense = max(rows, cols) >= DENSE_TILES
    if ax is None:
        cell = 0.45 if not dense else max(0.08, 12.0 / max(rows, cols))
        ax = Figure(figsize=(2.7 + cell * cols, 1.8 + cell * rows)).subplots()
    data = grid.where(grid > 0) if log else grid
    norm = norm or _norm(grid.to_numpy(), log)
    with warnings.catch_warnings():  # a blank panel (every tile 0 on a log scale) is a result
        warnings.filterwarnings("ignore", "All-NaN slice", RuntimeWarning)
        sns.heatmap(
            data,
            ax=ax,
            norm=norm,
            cmap=CMAP,
            annot=annot,
            fmt=".2g",
            cbar=cbar,
            cbar_kws={"label": colour_label(column, reduce)},
            square=True,
            linewidths=0 if dense else 0.5,
            linecolor="white",
            xticklabels=_ticks(cols),
            yticklabels=_ticks(rows),
        )
    ax.tick_params(labelsize=8 if dense else 10)
    ax.set_xlabel("key tile" if product != "out" else "")
    ax.set_ylabel("query tile")
    ax.set_title(f"{product}: {column} ({_where(batch, head, reduce)})")
    return ax


def _with_bar(i: int, n: int) -> bool:
    """Whether panel i of n (three to a row) carries the shared colour bar: the last of a row."""
    return i % 3 == 2 or i == n - 1


def _panels(n: int, width: float = 3.6, height: float = 3.2) -> tuple[Figure, list[Axes]]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten().tolist()
    for extra in axes[n:]:
        extra.set_visible(False)
    return fig, axes[:n]


def _products(frames, products, call: int) -> list[str]:
    """`products` as a list, or every product of qk, pv, dv, dp, dq, dk all `frames` hold."""
    if products is not None:
        return list(products)
    present = set(PRODUCTS)
    for frame in frames:
        present &= set(frame.loc[frame["call"] == call, "product"])
    found = [p for p in PRODUCTS if p in present]
    if not found:
        raise ValueError(f"products: the traces hold no product rows in call {call}")
    return found


def shared_norm(
    traces,
    column: str = "prod_err",
    *,
    products=None,
    batch: int = 0,
    head: int = 0,
    call: int = 0,
    reduce: str | None = None,
    log: bool = True,
):
    """One colour scale over `column` of every product of `products` (default: those all
    traces hold) in every trace of `traces` (a mapping of names to `Trace`s or frames, or a
    list of them): pass it as ``norm=`` so that one value is one colour in every figure."""
    frames = [_frame(t) for t in (traces.values() if isinstance(traces, dict) else traces)]
    if not frames:
        raise ValueError("traces must hold at least one trace")
    selection = dict(batch=batch, head=head, call=call, reduce=reduce)
    grids = [
        tile_grid(frame, column, product=p, **selection).to_numpy().ravel()
        for frame in frames
        for p in _products(frames, products, call)
    ]
    return _norm(np.concatenate(grids), log)


def product_heatmaps(
    trace,
    column: str = "prod_err",
    *,
    products=None,
    batch: int = 0,
    head: int = 0,
    call: int = 0,
    reduce: str | None = None,
    log: bool = True,
    norm=None,
) -> Figure:
    """`column` over (query tile, key tile) for each product of `products` (default: every
    product of qk, pv, dv, dp, dq, dk the trace holds), one panel each, on one colour scale:
    `norm` (from `shared_norm`, to compare figures) or this trace's own."""
    frame = _frame(trace)
    products = _products([frame], products, call)
    selection = dict(batch=batch, head=head, call=call, reduce=reduce)
    if norm is None:
        norm = shared_norm([frame], column, products=products, log=log, **selection)
    fig, axes = _panels(len(products))
    for i, (product, ax) in enumerate(zip(products, axes, strict=True)):
        tile_heatmap(
            frame,
            column,
            product=product,
            log=log,
            ax=ax,
            norm=norm,
            cbar=_with_bar(i, len(products)),
            **selection,
        )
        ax.set_title(product)
    recipe = frame.loc[frame["call"] == call, "recipe"].iloc[0]
    fig.suptitle(f"{recipe}: {column} per tile ({_where(batch, head, reduce)})")
    return fig


def recipe_heatmaps(
    traces: dict,
    column: str = "prod_err",
    *,
    product: str = "pv",
    batch: int = 0,
    head: int = 0,
    reduce: str | None = None,
    log: bool = True,
    norm=None,
) -> Figure:
    """`column` of `product` over (query tile, key tile), one panel per recipe of `traces`
    (a mapping of titles to `Trace`s or their frames), on one colour scale."""
    if not traces:
        raise ValueError("traces must hold at least one trace")
    selection = dict(batch=batch, head=head, reduce=reduce)
    if norm is None:
        norm = shared_norm(traces, column, products=[product], log=log, **selection)
    fig, axes = _panels(len(traces))
    for i, ((name, trace), ax) in enumerate(zip(traces.items(), axes, strict=True)):
        tile_heatmap(
            trace,
            column,
            product=product,
            log=log,
            ax=ax,
            norm=norm,
            cbar=_with_bar(i, len(traces)),
            **selection,
        )
        ax.set_title(name)
    fig.suptitle(f"{product}: {column} per tile ({_where(batch, head, reduce)})")
    return fig


def comparison_heatmaps(
    traces: dict,
    column: str = "prod_err",
    *,
    products=None,
    batch: int = 0,
    head: int = 0,
    call: int = 0,
    reduce: str | None = None,
    log: bool = True,
    norm=None,
) -> Figure:
    """`column` over (query tile, key tile), one row per product (default: those all traces
    hold) and the recipes of `traces` (a mapping of titles to `Trace`s or frames) side by
    side, on one colour scale (`norm`, or one over every panel) with one colour bar."""
    if not traces:
        raise ValueError("traces must hold at least one trace")
    frames = {name: _frame(t) for name, t in traces.items()}
    products = _products(frames.values(), products, call)
    selection = dict(batch=batch, head=head, call=call, reduce=reduce)
    if norm is None:
        norm = shared_norm(frames, column, products=products, log=log, **selection)
    fig = Figure(figsize=(3.2 * len(frames) + 1.2, 3.0 * len(products)), layout="constrained")
    axes = fig.subplots(len(products), len(frames), squeeze=False)
    for row, product in enumerate(products):
        for col, (name, frame) in enumerate(frames.items()):
            ax = axes[row, col]
            tile_heatmap(
                frame,
                column,
                product=product,
                log=log,
                ax=ax,
                norm=norm,
                cbar=False,
                **selection,
            )
            ax.set_title(f"{name}: {product}", fontsize=10)
    bar = ScalarMappable(norm=norm, cmap=CMAP)
    fig.colorbar(bar, ax=axes.ravel().tolist(), label=colour_label(column, reduce), shrink=0.5)
    fig.suptitle(f"{column} per tile ({_where(batch, head, reduce)})")
    return fig


def sweep_curve(
    frame: pd.DataFrame,
    x: str,
    y: str,
    *,
    hue: str | None = None,
    logx: bool = False,
    logy: bool = False,
    ax: Axes | None = None,
) -> Axes:
    """`y` against the swept parameter `x`, one line per value of `hue` (seaborn's lineplot;
    repeated x values are averaged with a confidence band)."""
    missing = [c for c in (x, y, hue) if c is not None and c not in frame.columns]
    if missing:
        raise ValueError(
            f"column {missing[0]!r} is not in the frame; it has "
            f"{', '.join(map(str, frame.columns))}"
        )
    if ax is None:
        ax = Figure(figsize=(5.5, 4), layout="constrained").subplots()
    sns.lineplot(data=frame, x=x, y=y, hue=hue, marker="o", ax=ax)
    ax.set_xscale("log" if logx else "linear")
    ax.set_yscale("log" if logy else "linear")
    ax.grid(True, which="both", alpha=0.3)
    return ax


def convergence_curve(convergence: pd.DataFrame, *, ax: Axes | None = None) -> Axes:
    """Relative MSE of the n-sample average gradient against n (log-log), per tensor, with
    dashed 1/n lines of pure noise: an unbiased recipe follows its dashed line, a biased one
    flattens above it (`GradientBias.convergence`; Quartet II, arXiv 2601.22813)."""
    if ax is None:
        ax = Figure(figsize=(5.5, 4), layout="constrained").subplots()
    tensors = list(dict.fromkeys(convergence["tensor"]))
    palette = dict(zip(tensors, sns.color_palette(n_colors=len(tensors)), strict=True))
    sns.lineplot(
        data=convergence, x="n", y="rel_mse", hue="tensor", palette=palette, marker="o", ax=ax
    )
    for tensor, rows in convergence.groupby("tensor", sort=False):
        ax.plot(rows["n"], rows["noise_only"], linestyle="--", color=palette[tensor], alpha=0.7)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.set_xlabel("n (draws averaged)")
    ax.set_ylabel("relative MSE of the average")
    ax.set_title("dashed: 1/n, noise alone")
    return ax
