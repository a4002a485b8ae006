"""The trace's side of the simulation: what each step of attention did to its operands.

The forward and the backward each hand every step (one block of tile pairs) to an observer,
once, and the observer turns it into the `Trace`'s columns (`fp4lab.recipes.trace` defines
them): the operand statistics of both operands of each product, the product tile's error
against the same product on unquantized operands, and, per query tile, the output's error
against exact attention computed alongside in the reference precision. The observers only
read: attention's outputs and gradients are the same bits with and without a trace.

Products whose operands are whole tensors (S = Q K^T, dP = dO V^T) take their errors from
float64 Gram matrices of the tiles (`gram_product_stats`), never forming a reference
product, in blocks with nothing masked; elsewhere the reference product is computed in the
reference precision and compared over the entries the masks leave.
"""

from __future__ import annotations

import math

import torch

from fp4lab.analysis.online_softmax import OnlineSoftmax, rescale_add
from fp4lab.analysis.tiling import (
    TileBlock,
    Tiling,
    pairs,
    t_times_query,
    times_key,
    zero_skipped,
)
from fp4lab.recipes import Product, TraceCall
from fp4lab.recipes.tile_stats import (
    gram_errors,
    grams,
    operand_stats,
    prefix,
    product_stats,
    whole_stats,
)

__all__ = ["begin_trace", "ForwardTrace", "BackwardTrace"]


def begin_trace(cfg, t: Tiling, q: torch.Tensor, v: torch.Tensor) -> TraceCall | None:
    """Open the trace's record of one call (None without a trace)."""
    if cfg.trace is None:
        return None
    meta = {
        "reference_dtype": cfg.trace.reference_dtype or _work_dtype(q),
        "shape_q": tuple(q.shape),
        "Sk": t.Sk,
        "kv_heads": t.Hk,
        "v_dim": v.shape[-1],
        "dtype": str(q.dtype),
        "causal": cfg.causal,
        "scale": cfg.scale,
        "block_m": t.bm,
        "block_n": t.bn,
        "masked": cfg.attn_mask is not None,
        "dropout_p": cfg.dropout_p,
        "seed": cfg.seed,  # None unless an int seed was given (a Generator may have advanced)
        "generator_initial_seed": _initial_seeds(cfg.generator),
    }
    return cfg.trace.begin(cfg.recipe.name, (t.B, t.Hk, t.G, t.nQ, t.nK), meta)


def _initial_seeds(generator):
    """The generator's initial seed, a list of them for stacked samples' generators, or None."""
    if isinstance(generator, tuple):
        return [g.initial_seed() for g in generator]
    return generator.initial_seed() if generator is not None else None


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# -- the forward ---------------------------------------------------------------------------------
class ForwardTrace:
    """The forward's observer: whole-operand statistics, then a `ChunkTrace` per chunk."""

    def __init__(self, rec: TraceCall, t: Tiling, ops, inputs, quantized, ps):
        (qw, kw, vw), (q_src, q_hat, k_hat, v_hat) = inputs, quantized
        self.rec, self.t, self.ops, self.scale, self.mask = rec, t, ops, ps.cfg.scale, ps.mask
        self.stats = {
            "q": whole_stats(q_src, q_hat, t.q_tiles),
            "k": whole_stats(kw, k_hat, t.k_tiles),
            "v": whole_stats(vw, v_hat, t.k_tiles),
        }
        ref = rec.meta["reference_dtype"]
        self.ref = (t.q_tiles(qw.to(ref)), t.k_tiles(kw.to(ref)), t.k_tiles(vw.to(ref)))
        # the scores are Q^ K^^T: their errors come from Gram matrices (not with smooth_q)
        self.grams = None
        if ops.q_mean is None:
            self.grams = (grams(q_src, q_hat.values, t.q_tiles), grams(kw, k_hat.values, t.k_tiles))

    def chunk(self, i0: int, i1: int) -> ChunkTrace:
        return ChunkTrace(self, i0, i1)


class ChunkTrace:
    """The forward's observer on query tiles [i0, i1): exact attention in the reference
    dtype alongside, and the qk / pv statistics of every tile."""

    def __init__(self, parent: ForwardTrace, i0: int, i1: int):
        self.parent, self.t, self.rec, self.i0, self.i1 = parent, parent.t, parent.rec, i0, i1
        q64, k64, v64 = parent.ref
        self.q64, self.k64, self.v64 = q64[:, :, :, i0:i1], k64, v64
        shape = (self.t.B, self.t.Hk, self.t.G, i1 - i0, self.t.bm)
        self.exact = OnlineSoftmax.start(shape, v64.shape[-1], q64)
        self.log_lost = q64.new_full(shape + (self.t.nK,), -math.inf)
        like = parent.ops.q
        self.l_consumed, self.l_plain = like.new_zeros(shape), like.new_zeros(shape)

    def step(self, st) -> None:
        """Statistics of qk and pv on one block (a `flash.ForwardStep`), and the exact
        softmax's step."""
        stats, block = self.parent.stats, st.block
        i0, i1, j0, j1 = block.i0, block.i1, block.j0, block.j1
        like, visible = st.s[..., 0, 0], block.visible()
        consumed, plain = st.p_hat.values.sum(-1), st.p.sum(-1)
        rescale_add(self.l_consumed, st.weights, consumed)
        rescale_add(self.l_plain, st.weights, plain)
        s_ref = pairs(self.q64, self.k64[:, :, j0:j1]).mul_(self.parent.scale)
        allowed = None if st.unmasked else st.s > -math.inf  # entries the masks leave
        qk = {
            **prefix(q_block(stats["q"], i0, i1, like), "a"),
            **prefix(k_block(stats["k"], j0, j1, like), "b"),
        }
        if st.unmasked and self.parent.grams is not None:
            qk.update(gram_product_stats(*self.parent.grams, block, st.s_raw))
        else:
            qk.update(masked_product_stats(st.s_raw, s_ref, allowed, overwrite=False))
        self.rec.add(Product.QK, i0, j0, qk, visible)
        v64 = self.v64[:, :, j0:j1]
        p_extras = {}
        pv = {
            **prefix(operand_stats(st.p, st.p_hat.values, st.p_hat.counts, extras=p_extras), "a"),
            **prefix(k_block(stats["v"], j0, j1, like), "b"),
        }
        p_kept = st.p if st.keep is None else st.p * st.keep  # dropout's mask in both products
        pv.update(product_stats(st.pv, times_key(p_kept.to(v64.dtype), v64), overwrite=True))
        self.rec.add(Product.PV, i0, j0, pv, visible)
        lost = plain - p_extras["kept_mass"]  # flushed P of each row
        self.log_lost[..., j0:j1] = (
            (st.m_j + torch.log(lost)).transpose(-1, -2).to(self.log_lost.dtype)
        )
        if not st.unmasked:
            mask = self.parent.mask
            s_ref = (s_ref if mask is None else mask.apply(s_ref, block)).masked_fill(
                ~allowed, -math.inf
            )
        p_ref, _, weights = self.exact.advance(s_ref, self.t.reverse, consume=True)
        rescale_add(self.exact.l_i, weights, p_ref.sum(-1))
        p_ref_kept = p_ref if st.keep is None else p_ref * st.keep.to(p_ref.dtype)
        rescale_add(self.exact.acc, weights, zero_skipped(times_key(p_ref_kept, v64), st.skipped))

    def finish(self, o: torch.Tensor, lse: torch.Tensor) -> None:
        """Per-query-tile statistics of the chunk, and P's lost probability mass per tile."""
        o_ref, lse_ref = self.exact.finish()
        rows = torch.isfinite(lse_ref) & torch.isfinite(lse)  # (B, Hkv, G, n, bm)
        count = rows.sum(-1).double()
        mean = lambda x: torch.where(rows, x, 0.0).double().sum(-1) / count  # noqa: E731
        diff = torch.where(rows.unsqueeze(-1), o.to(o_ref.dtype) - o_ref, 0.0)
        ref_norm = torch.where(rows.unsqueeze(-1), o_ref, 0.0).square().sum((-2, -1)).sqrt()
        out = {
            "row_sum_err": mean(self.l_consumed / self.l_plain - 1),
            "lse_err": mean((lse.to(lse_ref.dtype) - lse_ref).abs()),
            "out_err": diff.square().sum((-2, -1)).sqrt() / ref_norm,
            "out_nan": torch.isnan(o).sum((-2, -1)).double(),
        }
        self.rec.add_out(self.i0, out)
        lost = torch.exp(self.log_lost - lse.to(self.log_lost.dtype).unsqueeze(-1))
        lost = torch.where(rows.unsqueeze(-1), lost, 0.0).sum(-2) / count.unsqueeze(
            -1
        )  # (B, Hkv, G, n, nK)
        seen = self.t.key_tiles_seen(self.i0, self.i1)
        visible = TileBlock(self.t, self.i0, self.i1, 0, seen).visible()
        self.rec.add(Product.PV, self.i0, 0, {"p_mass_lost": lost[..., :seen]}, visible)


# -- the backward --------------------------------------------------------------------------------
class BackwardTrace:
    """The backward's observer: statistics of dv, dp, dq, dk on every block. dV and dK tiles
    are each query tile's contribution P^T dO, dS^T Q (the backward sums them over the
    query tiles)."""

    def __init__(self, rec: TraceCall, t: Tiling, inputs, quant: dict):
        qw, kw, vw, dow = inputs
        self.rec, self.t = rec, t
        plain = {"do_dv": dow, "do_dp": dow, "v_dp": vw, "k_dq": kw, "q_dk": qw}
        tiler = {
            "do_dv": t.q_tiles,
            "do_dp": t.q_tiles,
            "v_dp": t.k_tiles,
            "k_dq": t.k_tiles,
            "q_dk": t.q_tiles,
        }
        self.stats = {name: whole_stats(plain[name], quant[name], tiler[name]) for name in quant}
        self.grams = (
            grams(dow, quant["do_dp"].values, t.q_tiles),
            grams(vw, quant["v_dp"].values, t.k_tiles),
        )
        ref = rec.meta["reference_dtype"]
        self.ref = (
            t.q_tiles(qw.to(ref)),
            t.k_tiles(kw.to(ref)),
            t.k_tiles(vw.to(ref)),
            t.q_tiles(dow.to(ref)),
        )

    def step(self, st) -> None:
        """Record one block (a `flash.BackwardStep`)."""
        block, st_ = st.block, self.stats
        i0, i1, j0, j1 = block.i0, block.i1, block.j0, block.j1
        q64, k64, v64, do64 = self.ref
        q64, do64, k64j, v64j = (
            q64[:, :, :, i0:i1],
            do64[:, :, :, i0:i1],
            k64[:, :, j0:j1],
            v64[:, :, j0:j1],
        )
        like = st.s[..., 0, 0]
        p64, ds64 = st.p.to(q64.dtype), st.ds.to(q64.dtype)
        if st.keep is not None:  # dV's reference product takes dropout's mask too
            p64 = p64 * st.keep.to(p64.dtype)
        rows = torch.isfinite(st.lse)  # rows that see a key, (B, Hkv, G, n, 1, bm)
        p_extras, of_ds = {}, {}
        p_stats = operand_stats(st.p, st.p_dv.values, st.p_dv.counts, extras=p_extras)
        lost = st.p.sum(-1) - p_extras["kept_mass"]  # flushed P per row
        mass = torch.where(rows, lost, 0.0).double().sum(-1) / rows.sum(-1).double()
        allowed = None if st.unmasked else st.s > -math.inf
        dq_stats = operand_stats(st.ds, st.ds_dq.values, st.ds_dq.counts, of_x=of_ds)
        dk_stats = operand_stats(st.ds, st.ds_dk.values, st.ds_dk.counts, of_x=of_ds)
        if st.unmasked:
            dp_err = gram_product_stats(*self.grams, block, st.dp)
        else:
            dp_err = masked_product_stats(st.dp, pairs(do64, v64j), allowed)
        dv_extra = {"p_mass_lost": mass}
        if st.p_fwd is not None:  # the backward's P against the forward's
            dv_extra["p_fwd_mismatch"] = product_stats(st.p_dv.values, st.p_fwd)["prod_err"]
        records = {
            Product.DV: (
                p_stats,
                q_block(st_["do_dv"], i0, i1, like),
                product_stats(st.dv, t_times_query(p64, do64), overwrite=True),
                dv_extra,
            ),
            Product.DP: (
                q_block(st_["do_dp"], i0, i1, like),
                k_block(st_["v_dp"], j0, j1, like),
                dp_err,
                {},
            ),
            Product.DQ: (
                dq_stats,
                k_block(st_["k_dq"], j0, j1, like),
                product_stats(st.dq, times_key(ds64, k64j), overwrite=True),
                {},
            ),
            Product.DK: (
                dk_stats,
                q_block(st_["q_dk"], i0, i1, like),
                product_stats(st.dk, t_times_query(ds64, q64), overwrite=True),
                {},
            ),
        }
        visible = block.visible()
        for product, (sa, sb, prod, extra) in records.items():
            self.rec.add(
                product, i0, j0, {**prefix(sa, "a"), **prefix(sb, "b"), **prod, **extra}, visible
            )


# -- statistics of whole-tensor operands and of products -------------------------------------------
def gram_product_stats(a: tuple, b: tuple, block, y: torch.Tensor) -> dict:
    """``prod_err`` and ``prod_nan`` of every tile pair of `block` from the tiles' Gram
    matrices (`fp4lab.recipes.tile_stats.gram_errors`); y (..., n, g, r, c), the simulation's
    product, is read only to count NaN."""
    i0, i1, j0, j1 = block.i0, block.i1, block.j0, block.j1
    err = gram_errors(tuple(x[:, :, :, i0:i1] for x in a), tuple(z[:, :, j0:j1] for z in b))
    nan = (
        torch.zeros_like(err)
        if bool(torch.isfinite(err).all())
        else torch.isnan(y).sum((-2, -1)).double()
    )
    return {"prod_err": err, "prod_nan": nan}


def masked_product_stats(y, y_ref, allowed, overwrite: bool = True) -> dict:
    """product_stats over the entries `allowed` leaves (all when None); y_ref is scratch
    unless `overwrite` is False."""
    if allowed is None:
        return product_stats(y, y_ref, overwrite=overwrite)
    return product_stats(y.masked_fill(~allowed, 0), y_ref.masked_fill(~allowed, 0), overwrite=True)


def q_block(stats: dict, i0: int, i1: int, like: torch.Tensor) -> dict:
    """Query-tile statistics (B, Hkv, G, nQ) of tiles [i0, i1), broadcast to like's
    (B, Hkv, G, n, g)."""
    return {k: v[:, :, :, i0:i1, None].expand_as(like) for k, v in stats.items()}


def k_block(stats: dict, j0: int, j1: int, like: torch.Tensor) -> dict:
    """Key-tile statistics (B, Hkv, nK) of tiles [j0, j1), broadcast to like's shape."""
    return {k: v[:, :, None, None, j0:j1].expand_as(like) for k, v in stats.items()}
