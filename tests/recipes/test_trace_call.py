"""`TraceCall.add`: the stored table is the same whichever way a block reaches it.

A block on the host of at least `_APART` entries a column is copied column by column (with
broadcast columns never materialized); a smaller one, or one on another device, is stacked
first. Both must store the same float64 numbers at the same places, NaN where nothing was
written."""

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


@pytest.mark.parametrize("dims", [(1, 2, 1, 3, 5), (2, 4, 2, 16, 16)])
def test_whole_block_stored_exactly(dims):
    """A block covering every tile, small (stacked) or large (column by column)."""
    generator = torch.Generator().manual_seed(0)
    stats = _columns(dims, generator)
    per_column = math.prod(dims) >= trace_module._APART
    assert per_column == (dims[-1] == 16)  # the two shapes take the two paths
    call = Trace().begin("r", dims, {})
    visible = torch.ones(dims[3:], dtype=torch.bool)
    call.add(Product.QK, 0, 0, stats, visible)
    entry = call.products[Product.QK]
    assert entry["columns"] == list(stats)
    for c, name in enumerate(entry["columns"]):
        assert entry["table"][c].dtype == torch.float64
        assert torch.equal(entry["table"][c], stats[name].double())
    frame = call.to_frame()
    assert len(frame) == math.prod(dims)
    assert frame["a_flushed"].notna().all()


def test_partial_blocks_leave_nan_where_unwritten():
    """Blocks of query tiles written one after another, a new column added by a later block:
    every entry is the block's value where written and NaN where not."""
    dims = (1, 2, 2, 32, 32)  # 4096 entries a column: the per-column path for whole blocks
    generator = torch.Generator().manual_seed(1)
    call = Trace().begin("r", dims, {})
    top = {name: value[..., :16, :] for name, value in _columns(dims, generator).items()}
    bottom = {name: value[..., 16:, :] for name, value in _columns(dims, generator).items()}
    visible = torch.ones(16, 32, dtype=torch.bool)
    call.add(Product.PV, 0, 0, top, visible)
    call.add(Product.PV, 16, 0, bottom, visible)
    lost = torch.rand(1, 2, 2, 16, 32, generator=generator)
    call.add(Product.PV, 16, 0, {"p_mass_lost": lost}, visible)  # a column new to the table
    entry = call.products[Product.PV]
    table = dict(zip(entry["columns"], entry["table"], strict=True))
    for name in top:
        assert torch.equal(table[name][..., :16, :], top[name].double())
        assert torch.equal(table[name][..., 16:, :], bottom[name].double())
    assert torch.isnan(table["p_mass_lost"][..., :16, :]).all()
    assert torch.equal(table["p_mass_lost"][..., 16:, :], lost.double())
    assert call.done[Product.PV].all()


def test_columns_not_stored_together_are_refused():
    dims = (1, 1, 1, 2, 2)
    call = Trace().begin("r", dims, {})
    visible = torch.ones(2, 2, dtype=torch.bool)
    ones = torch.ones(dims)
    call.add(Product.QK, 0, 0, {"a_err": ones, "b_err": ones, "prod_err": ones}, visible)
    with pytest.raises(ValueError, match="not stored together"):
        call.add(Product.QK, 0, 0, {"a_err": ones, "prod_err": ones}, visible)
