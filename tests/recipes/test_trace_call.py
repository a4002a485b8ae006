"""`TraceCall.add`: the stored columns are the same whichever way a block reaches them.

A host block covering every tile with new columns is kept as given (a private, compact copy);
other blocks go into a stacked table, column by column for a host block of at least `_APART`
entries a column, stacked first otherwise. Every way must store the same float64 numbers at
the same places, NaN where nothing was written."""

import math

import pytest
import torch

from fp4lab.recipes import Product, Trace
from fp4lab.recipes import trace as trace_module


def _columns(dims, generator):
    """Three columns over (B, Hkv, G, nQ, nK): one full, one per query tile broadcast over
    the key tiles, one per key tile broadcast over the query tiles (float32, as the
    kernels' tables are)."""
    B, Hk, G, nQ, nK = dims
    full = torch.randn(dims, generator=generator)
    rows = torch.randn(B, Hk, G, nQ, 1, generator=generator).expand(dims)
    cols = torch.randn(B, Hk, 1, 1, nK, generator=generator).expand(dims)
    return {"a_err": full, "a_flushed": rows, "b_err": cols}


def _bases(stats):
    """The tensors the columns are views of."""
    return [value._base if value._base is not None else value for value in stats.values()]


@pytest.mark.parametrize("dims", [(1, 2, 1, 3, 5), (2, 4, 2, 16, 16)])
def test_whole_block_kept_compact_and_private(dims):
    """A block covering every tile: each column as given, broadcast columns kept at the size
    of their distinct values, and a copy: the caller's tensors changing afterwards does not
    change the trace."""
    generator = torch.Generator().manual_seed(0)
    stats = _columns(dims, generator)
    want = {name: value.double().clone() for name, value in stats.items()}
    call = Trace().begin("r", dims, {})
    call.add(Product.QK, 0, 0, stats, torch.ones(dims[3:], dtype=torch.bool))
    assert call.columns(Product.QK) == list(stats)
    for base in _bases(stats):
        base.add_(1.0)  # the caller reuses its buffers
    for name in stats:
        got = call.column(Product.QK, name)
        assert got.dtype == torch.float64 and got.shape == dims
        assert torch.equal(got, want[name])
    B, Hk, G, nQ, nK = dims
    assert call.column(Product.QK, "a_flushed").untyped_storage().nbytes() == 8 * B * Hk * G * nQ
    assert call.column(Product.QK, "b_err").untyped_storage().nbytes() == 8 * B * Hk * nK
    frame = call.to_frame()
    assert len(frame) == math.prod(dims)
    assert frame["a_flushed"].notna().all()
    rows = frame.set_index(["batch", "head", "q_tile", "k_tile"]).sort_index()
    b, h, i, j = 1 % B, G * Hk - 1, nQ - 1, nK - 2  # one tile, read back through the frame
    assert rows.loc[(b, h, i, j), "b_err"] == want["b_err"][b, h // G, h % G, i, j].item()


@pytest.mark.parametrize("device_like", ["host", "stacked"])
def test_partial_blocks_leave_nan_where_unwritten(device_like, monkeypatch):
    """Blocks of query tiles written one after another, a new column added by a later block:
    every entry is the block's value where written and NaN where not. "stacked" takes the
    stacking path for every block (as a block on the GPU does)."""
    if device_like == "stacked":
        monkeypatch.setattr(trace_module, "_APART", 1 << 62)
    dims = (1, 2, 2, 32, 32)  # 4096 entries a column: the per-column path on the host
    generator = torch.Generator().manual_seed(1)
    call = Trace().begin("r", dims, {})
    top = {name: value[..., :16, :] for name, value in _columns(dims, generator).items()}
    bottom = {name: value[..., 16:, :] for name, value in _columns(dims, generator).items()}
    visible = torch.ones(16, 32, dtype=torch.bool)
    call.add(Product.PV, 0, 0, top, visible)
    call.add(Product.PV, 16, 0, bottom, visible)
    lost = torch.rand(1, 2, 2, 16, 32, generator=generator)
    call.add(Product.PV, 16, 0, {"p_mass_lost": lost}, visible)  # a column new to the table
    for name in top:
        column = call.column(Product.PV, name)
        assert torch.equal(column[..., :16, :], top[name].double())
        assert torch.equal(column[..., 16:, :], bottom[name].double())
    lost_column = call.column(Product.PV, "p_mass_lost")
    assert torch.isnan(lost_column[..., :16, :]).all()
    assert torch.equal(lost_column[..., 16:, :], lost.double())
    assert call.done[Product.PV].all()


def test_a_whole_column_written_again_joins_the_table():
    """A column kept whole, then overwritten in part by a later block: the later block's
    values there, the first block's elsewhere."""
    dims = (1, 2, 1, 8, 8)
    generator = torch.Generator().manual_seed(2)
    call = Trace().begin("r", dims, {})
    first = _columns(dims, generator)
    call.add(Product.DV, 0, 0, first, torch.ones(8, 8, dtype=torch.bool))
    patch = {name: torch.randn(1, 2, 1, 4, 8, generator=generator) for name in first}
    call.add(Product.DV, 4, 0, patch, torch.ones(4, 8, dtype=torch.bool))
    for name in first:
        column = call.column(Product.DV, name)
        assert torch.equal(column[..., :4, :], first[name][..., :4, :].double())
        assert torch.equal(column[..., 4:, :], patch[name].double())
    assert call.products[Product.DV]["whole"] == {}


def test_columns_not_stored_together_are_refused():
    """In the stacked table a block's columns lie side by side, as its first block wrote
    them; a later block naming them apart is refused."""
    dims = (1, 1, 1, 2, 2)
    call = Trace().begin("r", dims, {})
    visible = torch.ones(1, 2, dtype=torch.bool)
    ones = torch.ones(1, 1, 1, 1, 2)
    call.add(Product.QK, 0, 0, {"a_err": ones, "b_err": ones, "prod_err": ones}, visible)
    with pytest.raises(ValueError, match="not stored together"):
        call.add(Product.QK, 0, 0, {"a_err": ones, "prod_err": ones}, visible)
