"""plots: the heatmaps show the trace's numbers in the trace's places."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fp4lab.analysis import plots  # noqa: E402
from fp4lab.analysis.compare import compare  # noqa: E402
from fp4lab.analysis.inputs import synthetic_inputs  # noqa: E402


def panels(fig):
    """The heatmap axes of a figure (not its colour bars)."""
    return [ax for ax in fig.axes if ax.collections and ax.get_label() != "<colorbar>"]


@pytest.fixture(scope="module")
def traces():
    x = synthetic_inputs(batch=1, heads=2, seq=96, head_dim=32, seed=0)
    run = lambda r: compare(x.q, x.k, x.v, x.do, r, causal=True, block_m=32, block_n=32).trace  # noqa: E731
    return {"nvfp4": run("nvfp4"), "fa4fp4_causal": run("fa4fp4_causal")}


def test_tile_grid_is_the_trace_pivoted(traces):
    frame = traces["nvfp4"].to_frame()
    grid = plots.tile_grid(frame, "a_flushed", product="pv", head=1)
    assert grid.shape == (3, 3)
    assert np.isnan(grid.loc[0, 2]) and np.isnan(grid.loc[1, 2])  # above the causal diagonal
    row = frame[
        (frame["product"] == "pv")
        & (frame["head"] == 1)
        & (frame["q_tile"] == 2)
        & (frame["k_tile"] == 1)
    ]
    assert grid.loc[2, 1] == row["a_flushed"].item()
    out = plots.tile_grid(frame, "out_err", product="out")
    assert out.shape == (3, 1) and out.notna().all().all()


def test_tile_heatmap_draws_the_grid(traces):
    ax = plots.tile_heatmap(traces["nvfp4"], "prod_err", product="dq", head=1)
    assert isinstance(ax, Axes) and isinstance(ax.figure, Figure)
    mesh = ax.collections[0]
    drawn = np.ma.filled(mesh.get_array(), np.nan).reshape(3, 3)
    want = plots.tile_grid(traces["nvfp4"], "prod_err", product="dq", head=1).to_numpy()
    np.testing.assert_array_equal(np.isnan(drawn), np.isnan(want))
    np.testing.assert_allclose(drawn[~np.isnan(want)], want[~np.isnan(want)])
    assert "dq" in ax.get_title() and ax.get_ylabel() == "query tile"
    assert plt.get_fignums() == []  # nothing registered with pyplot


def test_log_scale_leaves_zeros_blank(traces):
    frame = traces["nvfp4"].to_frame()
    zero = (
        (frame["product"] == "qk")
        & (frame["head"] == 0)
        & (frame["q_tile"] == 1)
        & (frame["k_tile"] == 0)
    )
    frame.loc[zero, "a_err"] = 0.0
    ax = plots.tile_heatmap(frame, "a_err", product="qk", log=True)
    drawn = np.ma.masked_invalid(np.ma.filled(ax.collections[0].get_array(), np.nan)).reshape(3, 3)
    assert drawn.count() == 5  # 6 causal tiles, the zero one blank on a log scale
    assert drawn.mask[1, 0] and not drawn.mask[1, 1]


def test_product_heatmaps_share_one_scale(traces):
    fig = plots.product_heatmaps(traces["nvfp4"], "prod_err")
    heat = panels(fig)
    assert [ax.get_title() for ax in heat] == ["qk", "pv", "dv", "dp", "dq", "dk"]
    norms = {(ax.collections[0].norm.vmin, ax.collections[0].norm.vmax) for ax in heat}
    assert len(norms) == 1
    fig2 = plots.product_heatmaps(traces["nvfp4"], "a_err", products=["qk", "pv"], log=False)
    assert len(panels(fig2)) == 2


def test_recipe_heatmaps_one_panel_per_recipe(traces, tmp_path):
    fig = plots.recipe_heatmaps(traces, "prod_err", product="pv")
    titles = [ax.get_title() for ax in panels(fig)]
    assert titles == ["nvfp4", "fa4fp4_causal"]
    fig.savefig(tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_sweep_and_convergence_curves():
    frame = pd.DataFrame(
        {
            "seq": [64, 128, 256] * 2,
            "rel_l2": [0.1, 0.2, 0.3, 0.2, 0.3, 0.4],
            "recipe": ["a"] * 3 + ["b"] * 3,
        }
    )
    ax = plots.sweep_curve(frame, "seq", "rel_l2", hue="recipe", logx=True)
    assert len(ax.get_lines()) >= 2 and ax.get_xscale() == "log"
    conv = pd.DataFrame(
        {
            "tensor": ["dq"] * 3,
            "n": [1, 2, 4],
            "rel_mse": [1.0, 0.6, 0.5],
            "noise_only": [1.0, 0.5, 0.25],
        }
    )
    ax = plots.convergence_curve(conv)
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and list(dashed[0].get_ydata()) == [1.0, 0.5, 0.25]
    assert ax.get_yscale() == "log"


def test_bad_selections_are_named(traces):
    with pytest.raises(ValueError, match="column 'nope'.*prod_err"):
        plots.tile_heatmap(traces["nvfp4"], "nope")
    with pytest.raises(ValueError, match="product 'xx'"):
        plots.tile_heatmap(traces["nvfp4"], "prod_err", product="xx")
    with pytest.raises(ValueError, match="head=5"):
        plots.tile_heatmap(traces["nvfp4"], "prod_err", head=5)
    with pytest.raises(ValueError, match="column 'n_'"):
        plots.sweep_curve(pd.DataFrame({"n": [1]}), "n_", "n")
    with pytest.raises(TypeError, match="trace must be"):
        plots.tile_grid([1, 2], "prod_err")


def test_reduce_summarises_every_batch_and_head(traces):
    frame = traces["nvfp4"].to_frame()
    heads = [plots.tile_grid(frame, "prod_err", product="pv", head=h) for h in (0, 1)]
    mean = plots.tile_grid(frame, "prod_err", product="pv", reduce="mean")
    worst = plots.tile_grid(frame, "prod_err", product="pv", reduce="max", head=7)  # head unread
    pd.testing.assert_frame_equal(mean, (heads[0] + heads[1]) / 2)
    pd.testing.assert_frame_equal(worst, np.maximum(heads[0], heads[1]))
    with pytest.raises(ValueError, match="reduce must be None, 'mean' or 'max', got 'median'"):
        plots.tile_grid(frame, "prod_err", reduce="median")


def test_the_colour_bar_names_the_statistic_in_words(traces):
    ax = plots.tile_heatmap(traces["nvfp4"], "a_flushed", product="pv")
    bar = next(a for a in ax.figure.axes if a.get_label() == "<colorbar>")
    label = bar.get_ylabel()
    assert (
        " ".join(label.split()) == "fraction of nonzeros flushed to zero (left operand) (a_flushed)"
    )
    assert plots.colour_label("prod_err", "max") == (
        "relative error of the product tile\n(prod_err, max over batch and heads)"
    )


def test_dense_grids_have_no_borders_and_few_ticks():
    rows = [
        {
            "call": 0,
            "recipe": "r",
            "product": "qk",
            "batch": 0,
            "head": 0,
            "q_tile": i,
            "k_tile": j,
            "prod_err": (i + 1) * (j + 1),
        }
        for i in range(40)
        for j in range(40)
    ]
    frame = pd.DataFrame(rows)
    ax = plots.tile_heatmap(frame, "prod_err", product="qk")
    assert ax.collections[0].get_linewidth()[0] == 0
    assert 4 <= len(ax.get_xticklabels()) <= 10 and 4 <= len(ax.get_yticklabels()) <= 10
    small = plots.tile_heatmap(
        frame[(frame.q_tile < 3) & (frame.k_tile < 3)], "prod_err", product="qk"
    )
    assert small.collections[0].get_linewidth()[0] > 0 and len(small.get_xticklabels()) == 3


def test_comparison_heatmaps_put_recipes_side_by_side_on_one_scale(traces):
    norm = plots.shared_norm(traces, "prod_err")
    fig = plots.comparison_heatmaps(traces, "prod_err", products=["qk", "pv"])
    heat = panels(fig)
    assert [ax.get_title() for ax in heat] == [
        "nvfp4: qk",
        "fa4fp4_causal: qk",
        "nvfp4: pv",
        "fa4fp4_causal: pv",
    ]
    bars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 1
    limits = {(ax.collections[0].norm.vmin, ax.collections[0].norm.vmax) for ax in heat}
    assert len(limits) == 1
    every = [plots.product_heatmaps(t, "prod_err", norm=norm) for t in traces.values()]
    shared = {
        (a.collections[0].norm.vmin, a.collections[0].norm.vmax) for f in every for a in panels(f)
    }
    assert shared == {(norm.vmin, norm.vmax)}
    own = plots.product_heatmaps(traces["nvfp4"], "prod_err")
    assert {(a.collections[0].norm.vmin, a.collections[0].norm.vmax) for a in panels(own)} != shared
