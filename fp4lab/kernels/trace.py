"""The Triton backend's `Trace`: the instrumented kernels' buffers as the simulation's schema.

What. `fp4lab.attention(..., backend="triton", trace=t)` fills `t` with the rows and columns
`backend="reference"` writes (`fp4lab.recipes.trace`: same names, same definitions, same
index columns), so a notebook switches path with one argument. The forward kernel, compiled
with its TRACE flag (`fp4lab.kernels.flash`), writes per (batch, head, query tile, key tile)
sums and counts of P and P^ taken from its registers right after P is quantized
(`FORWARD_STATS`), each row's flushed probability mass per key tile, and per query tile the
softmax denominator's error; once `backward()` runs, the backward's dK/dV and dQ kernels,
compiled with theirs (`fp4lab.kernels.flash_bwd`), write the same sums and counts of P in dV
and of dS in dK and in dQ (`BACKWARD_STATS`). `record_forward` and `record_backward` turn
them into columns here.

Where each column comes from.
- The in-register operands' columns, ``a_err``, ``a_flushed``, ``a_clipped``,
  ``a_scale_underflow``, ``a_scale_overflow``, ``a_nan`` of ``pv`` (P), ``dv`` (P), ``dq``
  and ``dk`` (dS), and ``p_mass_lost``, ``prod_nan`` of ``qk`` and ``pv``, the out rows'
  ``row_sum_err``: the kernels. Counts are exact where the quantized operand is the
  simulation's (the same quantizer arithmetic; an element within float rounding of a
  rounding boundary, where the paths' differently ordered sums disagree, moves a count by
  one: with a per-tile tensor scale the tile's largest element sits on the saturation
  boundary by construction, so ``a_clipped`` may differ by that one element), sums agree up
  to the order of their fp32 additions (exp2 of log2-unit scores against exp).
- The whole-tensor operands' columns (Q, K, V in qk and pv; dO, V, K, Q in dv, dp, dq, dk):
  in torch beside the kernels (on their device), from the unquantized operands and
  `fp4lab.formats`' quantizer (which the kernels' fused quantizer equals bit for bit) with
  `fp4lab.recipes.tile_stats`, the simulation's own functions: one pass over each operand.
  With smooth_q, Q's are those of Q - M, the operand quantized, as the simulation's.
- ``out_err``, ``lse_err``: in torch, against exact attention computed by the same forward
  kernel on the unquantized inputs (a second forward launch). Its P V multiplies P in 16 bits
  (two bf16 halves) on a GPU, so O_ref carries a relative ~1e-5 (the simulation's float32
  reference ~1e-7): far below any FP8 or FP4 error. ``out_nan``: from the fp32 output.
- ``prod_err`` of qk and dp, whose operands are whole tensors: in torch as the simulation
  computes it, from the tiles' float64 Gram matrices (`fp4lab.recipes.tile_stats.gram_errors`,
  O(S E^2) work) where a tile has nothing masked, and from both products in float32 over the
  allowed entries of the masked tiles (the causal band, ragged last tiles). With smooth_q,
  S^ = (Q - M)^ K^^T + M K^T is one product of operands side by side, [(Q - M)^, M] times
  [K^, K], against [Q - M, M] times [K, K] = Q K^T up to Q - M's fp32 rounding (the
  simulation compares with Q K^T in float32 on every tile: the same number to ~1e-7).
- Not written, NaN in the frame and listed in each call's ``meta["not_computed"]``
  (`NOT_COMPUTED`): ``prod_err`` of pv, dv, dq, dk (an in-register operand's product error
  needs the same product on the unquantized operand beside the kernel's, more matmuls per
  tile), the backward products' ``prod_nan``, and ``p_fwd_mismatch``. A `Trace` created
  with an explicit ``reference_dtype`` asks for reference products and is refused.

Memory. The buffers are small (n_q x n_k x 11 floats per head and product) except the
forward's flushed mass, which is per query row (Sq x n_k floats per head, block_n times
smaller than the scores): a row's mass counts in units of its final softmax denominator,
known only after its last key tile, so the kernel keeps log2(mass) + m per (row, key tile) and
torch divides at the end. (The backward's P is normalized already: a sum per tile.)

Where the work runs. Everything above runs on the kernels' device, asynchronously; the
per-tile tables the columns need (tiles' numbers: a whole-tensor operand's columns per tile
of its own side, not broadcast over the other's) then cross to the host in one packed copy
(`_host_all`), the call's only wait for the GPU, and `TraceCall.add` keeps each column as
it arrives, broadcast columns unexpanded.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from fp4lab.formats import FloatFormat, quantize_blocks, round_to_format
from fp4lab.recipes import (
    AttentionRecipe,
    BackwardMode,
    BackwardV,
    Product,
    TensorScope,
    Trace,
    TraceCall,
)
from fp4lab.recipes.tile_stats import (
    block_counts,
    fraction,
    gram_errors,
    grams,
    prefix,
    product_stats,
    whole_stats,
)

__all__ = ["record_forward", "record_backward", "check_trace", "NOT_COMPUTED"]

PINNED_MAX = 64 << 20
"""The largest packed trace tables (bytes) that cross to the host through page-locked memory."""

NOT_COMPUTED = (
    "pv.prod_err", "dv.prod_err", "dv.prod_nan", "dv.p_fwd_mismatch", "dp.prod_nan",
    "dq.prod_err", "dq.prod_nan", "dk.prod_err", "dk.prod_nan",
)  # fmt: skip


def check_trace(trace) -> None:
    """Raise for a trace the Triton backend cannot fill as asked."""
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be an fp4lab Trace or None, got {type(trace).__name__}")
    if trace.reference_dtype is not None:
        raise NotImplementedError(
            f"trace: reference_dtype={trace.reference_dtype}: the Triton backend takes its "
            "references in fixed precisions (exact attention on its kernel in fp32, the qk and "
            "dp products from float64 Gram matrices) and cannot take another; use Trace() or "
            "backend='reference'"
        )


def record_forward(
    trace: Trace, recipe: AttentionRecipe, inputs, bufs, out, exact, cfg: dict, smoothed=None
):
    """Add one call to `trace`: `inputs` the unquantized (q, k, v) the kernel's operands were
    quantized from (k smoothed), `bufs` the kernel's `TraceBuffers`, `out` its (O, lse): O
    (B, H, Sq, Dv) in fp32, lse in log2 units; `exact` exact attention's (O, lse) (fp32,
    natural units), `cfg` the call's causal, scale, block_m, block_n and P quantizer mode
    (`mode`); `smoothed`: smooth_q's (Q - M, M), (B, H, Sq, D) and (B, H, n_q, D) fp32
    (`fp4lab.kernels.backend.smooth_q`), or None. With smooth_q, Q's columns are those of
    Q - M against its quantized form (the operand the kernel multiplies), as the
    simulation's, and qk's error is that of S^ = (Q - M)^ K^^T + M K^T against Q K^T."""
    from fp4lab.kernels.flash import FORWARD_STATS

    (o, lse2), (q, k, v) = out, inputs
    B, H, Sq, _ = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    G, bm, bn = H // Hk, cfg["block_m"], cfg["block_n"]
    nQ, nK = -(-Sq // bm), -(-Sk // bn)
    meta = {
        "backend": "triton", "shape_q": tuple(q.shape), "Sk": Sk, "kv_heads": Hk,
        "v_dim": v.shape[-1], "dtype": str(q.dtype), "causal": cfg["causal"],
        "scale": cfg["scale"], "block_m": bm, "block_n": bn, "masked": False, "dropout_p": 0.0,
        "not_computed": NOT_COMPUTED, "reference_dtype": torch.float32, "seed": None,
        "generator_initial_seed": None,
    }  # fmt: skip
    rec = trace.begin(recipe.name, (B, Hk, G, nQ, nK), meta)
    heads = lambda x: x.reshape(B, Hk, G, *x.shape[2:]).double()  # noqa: E731  (B, Hkv, G, ...)
    q_tiles = lambda x: _tiles(heads_of(x, B, Hk, G), bm)  # noqa: E731
    k_tiles = lambda x: _tiles(x, bn)  # noqa: E731
    q_src = q.float() if smoothed is None else smoothed[0]
    q_hat, k_hat = _quantized(q_src, recipe, "q", G, bm), _quantized(k, recipe, "k", 1, bn)
    qs = whole_stats(q_src, q_hat, q_tiles)
    ks = whole_stats(k.float(), k_hat, k_tiles)
    vs = whole_stats(v.float(), _quantized(v, recipe, "v", 1, bn), k_tiles)
    if smoothed is None:
        qk_err = _product_errors((q, q_hat.values), (k, k_hat.values), cfg["scale"], cfg, G)
    else:  # [Q - M, M] [K^, K]^T = S^, and [Q - M, M] [K, K]^T = Q K^T up to fp32 rounding
        mean = _mean_rows(smoothed[1], bm, Sq)
        kf = k.float()
        side = lambda a, b: torch.cat((a, b), dim=-1)  # noqa: E731
        qk_err = _product_errors(
            (side(q_src, mean), side(q_hat.values, mean)), (side(kf, kf), side(k_hat.values, kf)),
            cfg["scale"], cfg, G,
        )  # fmt: skip
    stats = bufs.stats.double()  # (B, H, nQ, nK, N)
    st = {name: heads(stats[..., i]) for i, name in enumerate(FORWARD_STATS)}
    host = _host_all({  # every per-tile table the columns need, in one copy
        **_named("p", _operand_columns(st, cfg["mode"])), "p_mass_lost": _mass_lost(bufs.lost,
        lse2, bm), "qk_nan": st["qk_nan"], "pv_nan": st["pv_nan"], "sums": bufs.out,
        "qk_err": qk_err, **_named("q", qs), **_named("k", ks), **_named("v", vs),
        **_named("out", _out_errors(o, lse2, *exact, bm)),
    })  # fmt: skip
    like = host["qk_nan"]  # (B, Hkv, G, nQ, nK)
    q_cols = {n: c[..., None].expand_as(like) for n, c in _unnamed("q", host).items()}
    k_cols = {n: c[:, :, None, None].expand_as(like) for n, c in _unnamed("k", host).items()}
    v_cols = {n: c[:, :, None, None].expand_as(like) for n, c in _unnamed("v", host).items()}
    visible = _visible(nQ, nK, Sq, bm, bn, cfg["causal"])
    qk = {**prefix(q_cols, "a"), **prefix(k_cols, "b"), "prod_err": host["qk_err"],
          "prod_nan": like}  # fmt: skip
    rec.add(Product.QK, 0, 0, qk, visible)
    pv = {
        **prefix(_unnamed("p", host), "a"),
        **prefix(v_cols, "b"),
        "p_mass_lost": heads(host["p_mass_lost"]),
        "prod_nan": host["pv_nan"],
    }
    rec.add(Product.PV, 0, 0, pv, visible)
    sums = host["sums"].double()  # (B, H, nQ, 2)
    out = {"row_sum_err": sums[..., 0] / sums[..., 1], **_unnamed("out", host)}
    rec.add_out(0, {name: heads(value) for name, value in out.items()})
    return rec


def record_backward(
    rec: TraceCall,
    recipe: AttentionRecipe,
    inputs,
    bufs: dict,
    lse2,
    modes: dict,
    cfg: dict,
    smoothed=None,
) -> None:
    """Add the backward's rows to the forward's record `rec`: `inputs` the unquantized
    (q, k, v, do) (k smoothed), `bufs` the backward kernels' `trace_buffers`, lse2 the
    forward's log-sum-exp (log2 units), `modes` the MODE of the quantizers of P in dV and of
    dS in dQ and dK, `cfg` causal, block_m, block_n; `smoothed` smooth_q's (Q - M, M) as
    `record_forward` takes them, or None."""
    from fp4lab.kernels.flash_bwd import BACKWARD_STATS

    B, Hk, G, nQ, nK = rec.dims
    bm, bn, Sq = cfg["block_m"], cfg["block_n"], lse2.shape[-1]
    heads = lambda x: x.reshape(B, Hk, G, *x.shape[2:]).double()  # noqa: E731  (B, Hkv, G, ...)
    visible = _visible(nQ, nK, Sq, bm, bn, cfg["causal"])
    rows = _tiles(torch.isfinite(lse2)[..., None].double(), bm).sum((-2, -1))
    whole = _backward_operands(recipe, inputs, G, bm, bn, smoothed)
    (do, do_hat), (v, v_hat) = whole["do_dp"].pop("operands"), whole["v_dp"].pop("operands")
    dp_err = _product_errors((do, do_hat), (v, v_hat), 1.0, cfg, G)
    keys = {Product.DV: "dv", Product.DQ: "dq", Product.DK: "dk"}
    products = {}  # each product's own columns, (B, Hkv, G, nQ, nK)
    for product, key in keys.items():
        kernel = bufs[key].double()
        st = {name: heads(kernel[..., i]) for i, name in enumerate(BACKWARD_STATS)}
        products[key] = prefix(_operand_columns(st, modes[key]), "a")
        if product is Product.DV:  # P is normalized: the flushed mass is in final units
            products[key]["p_mass_lost"] = st["lost"] / heads(rows)[..., None]
    host = _host_all({  # every per-tile table the columns need, in one copy
        "dp_err": dp_err, **{k: c for key, cols in products.items()
                             for k, c in _named(key, cols).items()},
        **{k: c for name, cols in whole.items() for k, c in _named(name, cols).items()},
    })  # fmt: skip
    like = host["dp_err"]
    side = lambda name: {  # noqa: E731  an operand's tile columns, broadcast to (..., nQ, nK)
        n: (c[..., None] if name in ("do_dv", "do_dp", "q_dk")
            else c[:, :, None, None]).expand_as(like)
        for n, c in _unnamed(name, host).items()
    }  # fmt: skip
    for (product, key), b_name in zip(keys.items(), ("do_dv", "k_dq", "q_dk"), strict=True):
        cols = {**_unnamed(key, host), **prefix(side(b_name), "b")}
        rec.add(product, 0, 0, cols, visible)
    rec.add(Product.DP, 0, 0, {**prefix(side("do_dp"), "a"), **prefix(side("v_dp"), "b"),
                               "prod_err": host["dp_err"]}, visible)  # fmt: skip


def _backward_operands(
    recipe: AttentionRecipe, inputs, G: int, bm: int, bn: int, smoothed=None
) -> dict:
    """The operand columns (`whole_stats`) of the backward's whole-tensor operands, each the
    unquantized tensor against its quantized form as the recipe's backward takes it: dO for
    dV and dP, V for dP (or the forward's V^), K for dQ, Q for dK; the forward's Q^, K^, V^
    in a straight-through backward, with smooth_q's Q^ the forward's (Q - M)^ + M against Q
    (its counts Q's own quantization's, as the simulation's `_forward_counts` takes them)."""
    q, k, v, do = inputs
    B, H = q.shape[:2]
    q_tiles = lambda x: _tiles(heads_of(x, B, H // G, G), bm)  # noqa: E731
    k_tiles = lambda x: _tiles(x, bn)  # noqa: E731
    if recipe.backward is BackwardMode.FLASH:
        v_src = v
        if recipe.backward_v is BackwardV.FORWARD:  # the forward's V^, quantized again
            v_src = _quantized(v, recipe, "v", 1, bn).values
        sources = {"v_dp": (v_src, "dp_v", 1), "k_dq": (k, "dq_k", 1), "q_dk": (q, "dk_q", G)}
    else:  # straight through the forward's quantizers
        sources = {"v_dp": (v, "v", 1), "k_dq": (k, "k", 1), "q_dk": (q, "q", G)}
    sources.update(do_dv=(do, "dv_do", G), do_dp=(do, "dp_do", G))
    plain = {"do_dv": do, "do_dp": do, "v_dp": v, "k_dq": k, "q_dk": q}
    out = {}
    for name, (x, field, groups) in sources.items():
        tiler = q_tiles if groups == G and name != "k_dq" and name != "v_dp" else k_tiles
        quant = _quantized(x, recipe, field, groups, bm if tiler is q_tiles else bn)
        if name == "q_dk" and smoothed is not None and recipe.backward is not BackwardMode.FLASH:
            q_src, q_mean = smoothed
            quant.values = _quantized(q_src, recipe, "q", G, bm).values + _mean_rows(
                q_mean, bm, q.shape[2]
            )
        out[name] = whole_stats(plain[name].float(), quant, tiler)
        if name in ("do_dp", "v_dp"):  # dP's operands, for its prod_err
            out[name]["operands"] = (plain[name], quant.values)
    return out


def _mean_rows(q_mean: torch.Tensor, bm: int, Sq: int) -> torch.Tensor:
    """smooth_q's tile means (B, H, n_q, D) repeated for each row of their tile: (B, H, Sq, D)."""
    return q_mean.repeat_interleave(bm, dim=2)[:, :, :Sq]


def _product_errors(a: tuple, b: tuple, scale: float, cfg: dict, G: int) -> torch.Tensor:
    """``prod_err`` (B, Hkv, G, nQ, nK) of y^ = scale A^ B^^T against y = scale A B^T for
    whole-tensor operands a = (A, A^) (B, H, Sq, E) and b = (B, B^) (B, Hkv, Sk, E) (S and
    dP), as the simulation computes it: from the tiles' float64 Gram matrices
    (`gram_errors`) where a tile has nothing masked, from both products in float32 over the
    allowed entries where it has (the causal band, ragged last tiles), in chunks of tiles."""
    (x, x_hat), (z, z_hat) = a, b
    B, H, Sq = x.shape[:3]
    Sk, bm, bn = z.shape[2], cfg["block_m"], cfg["block_n"]
    q_tiles = lambda t: _tiles(heads_of(t.float(), B, H // G, G), bm)  # noqa: E731
    k_tiles = lambda t: _tiles(t.float(), bn)  # noqa: E731
    err = gram_errors(grams(x, x_hat, q_tiles), grams(z, z_hat, k_tiles))
    nQ, nK = err.shape[-2:]
    visible = _visible(nQ, nK, Sq, bm, bn, cfg["causal"])
    masked = (_masked_tiles(nQ, nK, Sq, Sk, bm, bn, cfg["causal"]) & visible).nonzero()
    xs, xh, zs, zh = q_tiles(x), q_tiles(x_hat), k_tiles(z), k_tiles(z_hat)
    for chunk in masked.split(64):  # (M, 2): (i, j) of masked tiles
        i, j = chunk[:, 0].to(err.device), chunk[:, 1].to(err.device)
        keep = _tile_masks(i, j, Sq, Sk, bm, bn, cfg["causal"])  # (M, bm, bn)
        y = _tile_pairs(xh, zh, i, j, scale).masked_fill(~keep, 0)  # (B, Hkv, G, M, bm, bn)
        y_ref = _tile_pairs(xs, zs, i, j, scale).masked_fill(~keep, 0)
        err[:, :, :, i, j] = product_stats(y, y_ref, overwrite=True)["prod_err"]
    return err


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


def _operand_columns(st: dict, mode: int) -> dict:
    """An in-register operand's columns from a kernel's sums (`BACKWARD_STATS`' names), as
    `fp4lab.recipes.tile_stats.operand_stats` defines them; `mode` its quantizer's MODE
    (0 none: no clipping; 1 a cast and 5 bf16: no block scales; 2 block scales, 3 Direct-P
    and 4 one FP32 scale per tile: both)."""
    diff, norm = st["diff2"].sqrt(), st["norm2"].sqrt()
    nonzero = st["nonzero"]
    cols = {
        "err": torch.where(diff == 0, 0.0, diff / norm),
        "flushed": fraction(nonzero - st["kept"], nonzero),
        "nan": st["nan"],
        "clipped": fraction(st["clipped"], nonzero) if mode else torch.zeros_like(diff),
    }
    for name in ("underflow", "overflow"):
        scaled = mode in (2, 3, 4, 6)
        nan = torch.full_like(diff, math.nan)
        cols[f"scale_{name}"] = fraction(st[name], st["blocks"]) if scaled else nan
    return cols


def _mass_lost(lost: torch.Tensor, lse2: torch.Tensor, bm: int) -> torch.Tensor:
    """``p_mass_lost`` (B, H, nQ, nK): each row's flushed mass 2^(log2 mass + m - lse) in
    units of its final probabilities, averaged over the tile's rows whose lse is finite (in
    fp32, summed in float64: `lost` is Sq x nK per head, the largest buffer of the trace)."""
    rows = torch.isfinite(lse2)  # (B, H, Sq)
    mass = torch.where(rows[..., None], torch.exp2(lost - lse2[..., None]), 0.0)
    count = _tiles(rows[..., None].double(), bm).sum((-2, -1))  # (B, H, nQ)
    return _tiles(mass, bm).sum(-2, dtype=torch.float64) / count[..., None]


def _tile_pairs(p, r, i, j, scale: float) -> torch.Tensor:
    """scale P_i R_j^T of the tile pairs (i[m], j[m]): p (B, Hkv, G, nQ, bm, E), r
    (B, Hkv, nK, bn, E) -> (B, Hkv, G, M, bm, bn)."""
    return (p[:, :, :, i] @ r[:, :, None, j].transpose(-1, -2)) * scale


def _masked_tiles(nQ, nK, Sq, Sk, bm, bn, causal) -> torch.Tensor:
    """(nQ, nK) bool on the CPU: the tiles with an entry outside the allowed (query, key)
    pairs (a ragged last query or key tile, or, causal, a key after a row), from the tiles'
    bounds alone: no (Sq, Sk) mask is ever built."""
    i, j = torch.arange(nQ)[:, None], torch.arange(nK)[None, :]
    ragged = ((i + 1) * bm > Sq) | ((j + 1) * bn > Sk)
    if not causal:
        return ragged
    return ragged | ((j + 1) * bn - 1 > i * bm)  # the tile's last key after its first row


def _tile_masks(i, j, Sq, Sk, bm, bn, causal) -> torch.Tensor:
    """(M, bm, bn) bool: the allowed (query, key) entries of tiles (i[m], j[m])."""
    rows = i[:, None, None] * bm + torch.arange(bm, device=i.device)[None, :, None]
    keys = j[:, None, None] * bn + torch.arange(bn, device=i.device)[None, None, :]
    keep = (rows < Sq) & (keys < Sk)
    return keep & (keys <= rows) if causal else keep


def _visible(nQ, nK, Sq, bm, bn, causal) -> torch.Tensor:
    """(nQ, nK) bool on the CPU (where `TraceCall` keeps its tables): the tiles the kernel
    visits (a causal mask skips those whose first key comes after the tile's last row)."""
    if not causal:
        return torch.ones(nQ, nK, dtype=torch.bool)
    last = torch.clamp(torch.arange(1, nQ + 1) * bm, max=Sq) - 1  # each tile's last row
    return torch.arange(nK)[None, :] * bn <= last[:, None]


def heads_of(x: torch.Tensor, B: int, Hk: int, G: int) -> torch.Tensor:
    """(B, H, S, E) as (B, Hkv, G, S, E)."""
    return x.reshape(B, Hk, G, *x.shape[2:])


def _tiles(x: torch.Tensor, rows: int) -> torch.Tensor:
    """(..., S, E) zero-padded to whole tiles of `rows` and cut: (..., n tiles, rows, E); a
    view of a contiguous x whose S is whole tiles (no copy: the callers only read it)."""
    pad = -x.shape[-2] % rows
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    return x.reshape(*x.shape[:-2], -1, rows, x.shape[-1])


def _host_all(tables: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-tile tables (small: tiles, not elements) on the host, where `TraceCall` keeps its
    columns, in one device-to-host copy (`_packed`). They cross before the columns derived
    from them (elementwise float64, the same bits on either device) and before their
    broadcast over the other side's tiles, so that a call waits for the GPU once and moves
    tiles' numbers, not tile pairs'. Tables already all on the host are returned as they
    are."""
    tables = {name: t.detach() for name, t in tables.items()}
    devices = [t.device for t in tables.values() if t.device.type != "cpu"]
    return _packed(tables, devices[0]) if devices else tables


def _packed(tables: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """`tables` on the host through one copy: their bytes side by side in one buffer on
    `device` (each padded to 8 bytes), copied once, cut apart and viewed as their own dtypes
    and shapes. From CUDA the copy lands in page-locked memory (torch's caching host
    allocator keeps the buffer for the next call) where the tables are at most `PINNED_MAX`
    bytes: a pageable copy of the same bytes is staged through the driver's bounce buffer,
    3.8 ms for B4 H16 S4096's 5 MB against 0.12 ms pinned (H200, sessions 25 and 26). Larger
    tables (a 131072-token call's run to a gigabyte) are copied pageable, so that a long call
    does not leave that much page-locked memory cached in the process."""
    parts, spans, start = [], {}, 0
    for name, t in tables.items():
        line = t.reshape(-1)
        if line.stride(0) != 1:  # strided, or one element of a strided table ("contiguous")
            line = line.clone(memory_format=torch.contiguous_format)
        raw = line.view(torch.uint8).to(device)
        pad = -raw.numel() % 8
        parts.append(raw if not pad else torch.cat((raw, raw.new_zeros(pad))))
        spans[name] = (start, raw.numel())
        start += raw.numel() + pad
    flat = torch.cat(parts)
    if flat.device.type == "cuda" and flat.numel() <= PINNED_MAX:
        flat = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True).copy_(flat)
    else:
        flat = flat.cpu()
    return {
        name: flat[a : a + n].view(t.dtype).reshape(t.shape)
        for (name, t), (a, n) in zip(tables.items(), spans.values(), strict=True)
    }


def _named(prefix_: str, columns: dict) -> dict:
    """columns renamed "<prefix_>.<name>" (to travel in one `_host_all`)."""
    return {f"{prefix_}.{name}": value for name, value in columns.items()}


def _unnamed(prefix_: str, tables: dict) -> dict:
    """The tables `_named(prefix_, ...)` put in, under their own names."""
    mark = f"{prefix_}."
    return {name[len(mark):]: t for name, t in tables.items() if name.startswith(mark)}


def _quantized(x: torch.Tensor, recipe: AttentionRecipe, field: str, groups: int, rows: int):
    """Operand `field` quantized as a whole tensor by `fp4lab.formats` (the arithmetic of the
    simulation's and of the kernels' quantizers), its tensor scale over the recipe's
    `tensor_scope` (per tile: of `rows` rows), with the trace's counts (`block_counts`), in
    float32: `.values` and `.counts` as `whole_stats` reads them."""
    spec, xw = getattr(recipe, field), x.float()
    if spec is None:
        return SimpleNamespace(values=xw, counts=None)
    if isinstance(spec, FloatFormat):
        return SimpleNamespace(
            values=round_to_format(xw, spec), counts={"clipped": xw.abs() > spec.max}
        )
    b, h, n = x.shape[:3]
    if recipe.tensor_scope is TensorScope.TILE:  # (B, H, nT, rows, E), zero rows padding
        view, batch_dims = _tiles(xw, rows), 3
    elif recipe.tensor_scope is TensorScope.HEAD:  # (B, Hkv, G, S, E)
        view, batch_dims = xw.reshape(b, h // groups, groups, *x.shape[2:]), 2
    else:
        view, batch_dims = xw, 0
    bq = quantize_blocks(view, spec, axis=recipe.block_axis(field), batch_dims=batch_dims)
    back = lambda t: t.reshape(b, h, -1, x.shape[-1])[:, :, :n]  # noqa: E731  (B, H, S, E)
    values = back(bq.dequantize(torch.float32))
    counts = block_counts(bq.scaled, bq.amax, bq.scales, bq.decode, spec, bq.layout,
                          per_tile=False)
    counts = {k: back(c) if c is not None else None for k, c in counts.items()}
    return SimpleNamespace(values=values, counts=counts)
