"""The Triton backend's `Trace`: the instrumented forward's buffers as the simulation's schema.

What. `fp4lab.attention(..., backend="triton", trace=t)` fills `t` with the rows and columns
`backend="reference"` writes (`fp4lab.recipes.trace`: same names, same definitions, same
index columns), so a notebook switches path with one argument. The forward kernel, compiled
with its TRACE flag (`fp4lab.kernels.flash`), writes per (batch, head, query tile, key tile)
sums and counts of P and P^ taken from its registers right after P is quantized
(`FORWARD_STATS`), each row's flushed probability mass per key tile, and per query tile the
softmax denominator's error; `record_forward` turns them into columns here.

Where each column comes from.
- ``pv``'s P columns (``a_err``, ``a_flushed``, ``a_clipped``, ``a_scale_underflow``,
  ``a_scale_overflow``, ``a_nan``), ``p_mass_lost``, ``prod_nan`` of ``qk`` and ``pv``, and
  the out rows' ``row_sum_err``: the kernel. Counts are exact where P^ is the simulation's
  (the same quantizer arithmetic; a P element within float rounding of a rounding boundary,
  where the two paths' differently ordered score sums disagree, moves a count by one), sums
  agree up to the order of their fp32 additions (exp2 of log2-unit scores against exp).
- Q, K and V's operand columns (``qk``'s a_ and b_, ``pv``'s b_): on the host, from the
  unquantized operands and `fp4lab.formats`' quantizer (which the kernels' fused quantizer
  equals bit for bit) with `fp4lab.recipes.tile_stats`, the simulation's own functions: one
  pass over each operand, no attention-sized work.
- ``out_nan``: on the host, from the output (a NaN stays NaN through its bf16 cast).
- Not written, NaN in the frame and listed in each call's ``meta["not_computed"]``:
  ``prod_err`` of qk and pv, ``out_err`` and ``lse_err`` (each needs a reference product or
  exact attention beside the kernel's, a second attention's work), and every backward row
  (dv, dp, dq, dk: the backward kernels are not instrumented yet). A `Trace` created with an
  explicit ``reference_dtype`` asks for those references and is refused.

Memory. The buffers are small (n_q x n_k x 11 floats per head) except the flushed mass,
which is per query row (Sq x n_k floats per head, block_n times smaller than the scores): a
row's mass counts in units of its final softmax denominator, known only after its last key
tile, so the kernel keeps log2(mass) + m per (row, key tile) and the host divides at the end.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from fp4lab.formats import FloatFormat, quantize_blocks, round_to_format
from fp4lab.recipes import AttentionRecipe, Product, TensorScope, Trace
from fp4lab.recipes.tile_stats import (
    block_counts,
    fraction,
    prefix,
    whole_stats,
)

__all__ = ["record_forward", "check_trace", "NOT_COMPUTED"]

NOT_COMPUTED = ("qk.prod_err", "pv.prod_err", "dv", "dp", "dq", "dk")


def check_trace(trace) -> None:
    """Raise for a trace the Triton backend cannot fill as asked."""
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be an fp4lab Trace or None, got {type(trace).__name__}")
    if trace.reference_dtype is not None:
        raise NotImplementedError(
            f"trace: reference_dtype={trace.reference_dtype} asks for reference products and "
            "exact attention (prod_err, out_err, lse_err), which the Triton backend does not "
            "compute; use Trace() (those columns stay NaN) or backend='reference'"
        )


def record_forward(trace: Trace, recipe: AttentionRecipe, inputs, bufs, out, exact, cfg: dict):
    """Add one call to `trace`: `inputs` the unquantized (q, k, v) the kernel's operands were
    quantized from (k smoothed), `bufs` the kernel's `TraceBuffers`, `out` its (O, lse): O
    (B, H, Sq, Dv) in fp32, lse in log2 units; `exact` exact attention's (O, lse) (fp32,
    natural units), `cfg` the call's causal, scale, block_m, block_n and P quantizer mode
    (`mode`)."""
    from fp4lab.kernels.flash import FORWARD_STATS

    o, lse2 = out

    q, k, v = inputs
    B, H, Sq, _ = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    G, bm, bn = H // Hk, cfg["block_m"], cfg["block_n"]
    nQ, nK = -(-Sq // bm), -(-Sk // bn)
    meta = {
        "backend": "triton", "shape_q": tuple(q.shape), "Sk": Sk, "kv_heads": Hk,
        "v_dim": v.shape[-1], "dtype": str(q.dtype), "causal": cfg["causal"],
        "scale": cfg["scale"], "block_m": bm, "block_n": bn, "masked": False, "dropout_p": 0.0,
        "not_computed": NOT_COMPUTED,
    }  # fmt: skip
    rec = trace.begin(recipe.name, (B, Hk, G, nQ, nK), meta)
    heads = lambda x: x.reshape(B, Hk, G, *x.shape[2:]).double()  # noqa: E731  (B, Hkv, G, ...)
    st = {name: heads(bufs.stats[..., i]) for i, name in enumerate(FORWARD_STATS)}
    like = st["p_nonzero"]  # (B, Hkv, G, nQ, nK)
    q_tiles = lambda x: _tiles(heads_of(x, B, Hk, G), bm)  # noqa: E731
    k_tiles = lambda x: _tiles(x, bn)  # noqa: E731
    qs = whole_stats(q.float(), _quantized(q, recipe, "q", G), lambda x: q_tiles(x))
    ks = whole_stats(k.float(), _quantized(k, recipe, "k", 1), k_tiles)
    vs = whole_stats(v.float(), _quantized(v, recipe, "v", 1), k_tiles)
    q_cols = {n: c[..., None].expand_as(like) for n, c in qs.items()}  # (B, Hkv, G, nQ, 1)
    k_cols = {n: c[:, :, None, None].expand_as(like) for n, c in ks.items()}
    v_cols = {n: c[:, :, None, None].expand_as(like) for n, c in vs.items()}
    visible = _visible(nQ, nK, Sq, bm, bn, cfg["causal"], like.device)
    qk = {**prefix(q_cols, "a"), **prefix(k_cols, "b"), "prod_nan": st["qk_nan"]}
    rec.add(Product.QK, 0, 0, qk, visible)
    pv = {
        **prefix(_p_columns(st, cfg["mode"]), "a"),
        **prefix(v_cols, "b"),
        "p_mass_lost": heads(_mass_lost(bufs.lost, lse2, bm)),
        "prod_nan": st["pv_nan"],
    }
    rec.add(Product.PV, 0, 0, pv, visible)
    sums = bufs.out.double()  # (B, H, nQ, 2)
    out = {"row_sum_err": sums[..., 0] / sums[..., 1], **_out_errors(o, lse2, *exact, bm)}
    rec.add_out(0, {name: heads(value) for name, value in out.items()})


def _out_errors(o, lse2, o_ref, lse_ref, bm: int) -> dict:
    """``lse_err``, ``out_err`` and ``out_nan`` per query tile (B, H, nQ) of the output o and
    lse (log2 units) against exact attention's, over the rows where both lse are finite."""
    lse = lse2.double() * math.log(2.0)
    rows = torch.isfinite(lse) & torch.isfinite(lse_ref)  # (B, H, Sq)
    tile_sum = lambda x: _tiles(x, bm).sum((-2, -1))  # noqa: E731  (B, H, nQ)
    count = tile_sum(rows[..., None].double())
    lse_diff = torch.where(rows, (lse - lse_ref.double()).abs(), 0.0)
    diff = torch.where(rows[..., None], o.double() - o_ref.double(), 0.0)
    ref = torch.where(rows[..., None], o_ref.double(), 0.0)
    return {
        "lse_err": tile_sum(lse_diff[..., None]) / count,
        "out_err": tile_sum(diff.square()).sqrt() / tile_sum(ref.square()).sqrt(),
        "out_nan": tile_sum(torch.isnan(o).double()),
    }


def _p_columns(st: dict, mode: int) -> dict:
    """P's operand columns from the kernel's sums (`FORWARD_STATS`), as
    `fp4lab.recipes.tile_stats.operand_stats` defines them; `mode` the PQuantizer's MODE
    (0 none: no clipping, 1 a cast: no block scales, 2 block scales and 3 Direct-P: both)."""
    diff, norm = st["p_diff2"].sqrt(), st["p_norm2"].sqrt()
    nonzero = st["p_nonzero"]
    cols = {
        "err": torch.where(diff == 0, 0.0, diff / norm),
        "flushed": fraction(nonzero - st["p_kept"], nonzero),
        "nan": st["p_nan"],
        "clipped": fraction(st["p_clipped"], nonzero) if mode else torch.zeros_like(diff),
    }
    for name, key in (("scale_underflow", "p_underflow"), ("scale_overflow", "p_overflow")):
        scaled = mode in (2, 3)
        cols[name] = (
            fraction(st[key], st["p_blocks"]) if scaled else torch.full_like(diff, math.nan)
        )
    return cols


def _mass_lost(lost: torch.Tensor, lse2: torch.Tensor, bm: int) -> torch.Tensor:
    """``p_mass_lost`` (B, H, nQ, nK): each row's flushed mass 2^(log2 mass + m - lse) in
    units of its final probabilities, averaged over the tile's rows whose lse is finite."""
    rows = torch.isfinite(lse2)  # (B, H, Sq)
    mass = torch.where(rows[..., None], torch.exp2(lost.double() - lse2.double()[..., None]), 0.0)
    count = _tiles(rows[..., None].double(), bm).sum((-2, -1))  # (B, H, nQ)
    return _tiles(mass, bm).sum(-2) / count[..., None]


def _visible(nQ, nK, Sq, bm, bn, causal, device) -> torch.Tensor:
    """(nQ, nK) bool: the tiles the kernel visits (a causal mask skips those past the last
    row's key)."""
    if not causal:
        return torch.ones(nQ, nK, dtype=torch.bool, device=device)
    last = torch.clamp(torch.arange(1, nQ + 1, device=device) * bm, max=Sq) - 1  # each tile's
    return torch.arange(nK, device=device)[None, :] * bn <= last[:, None]


def heads_of(x: torch.Tensor, B: int, Hk: int, G: int) -> torch.Tensor:
    """(B, H, S, E) as (B, Hkv, G, S, E)."""
    return x.reshape(B, Hk, G, *x.shape[2:])


def _tiles(x: torch.Tensor, rows: int) -> torch.Tensor:
    """(..., S, E) zero-padded to whole tiles of `rows` and cut: (..., n tiles, rows, E)."""
    pad = -x.shape[-2] % rows
    x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], -1, rows, x.shape[-1])


def _quantized(x: torch.Tensor, recipe: AttentionRecipe, field: str, groups: int):
    """Operand `field` quantized as a whole tensor by `fp4lab.formats` (the arithmetic of the
    simulation's and of the kernels' quantizers), with the trace's counts (`block_counts`),
    in float32: `.values` and `.counts` as `whole_stats` reads them."""
    spec, xw = getattr(recipe, field), x.float()
    if spec is None:
        return SimpleNamespace(values=xw, counts=None)
    if isinstance(spec, FloatFormat):
        return SimpleNamespace(
            values=round_to_format(xw, spec), counts={"clipped": xw.abs() > spec.max}
        )
    b, h = x.shape[:2]
    per_head = recipe.tensor_scope is TensorScope.HEAD
    view = xw.reshape(b, h // groups, groups, *x.shape[2:]) if per_head else xw
    bq = quantize_blocks(view, spec, axis=recipe.block_axis(field), batch_dims=2 if per_head else 0)
    values = bq.dequantize(torch.float32).reshape(x.shape)
    counts = block_counts(bq.scaled, bq.amax, bq.decode, spec, bq.layout, per_tile=False)
    counts = {k: c.reshape(x.shape) if c is not None else None for k, c in counts.items()}
    return SimpleNamespace(values=values, counts=counts)
