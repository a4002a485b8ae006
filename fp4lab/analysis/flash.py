"""FlashAttention with every operand of its six products quantized: the simulation path.

What. `attention(q, k, v, recipe)` computes scaled dot-product attention the way a
FlashAttention kernel does, in plain torch, with each operand of S = Q K^T, O = P V and of the
backward's dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q quantized as an
`AttentionRecipe` says, and it can record what quantization did, tile by tile (`Trace`).
It is an autograd Function, so it drops into a model in place of
`F.scaled_dot_product_attention` (and `patch_sdpa` does exactly that without editing the
model).

The algorithm, per query tile i and key tile j (FlashAttention-2, Dao 2023,
arXiv 2307.08691, Algorithms 1 and 2):

    forward                                        the recipe's part
    S = scale * Q^_i K^_j^T (+ mask)               Q^, K^: recipe.q, recipe.k along D
    m_i' = max(m_i, rowmax S);  P = exp(S - m_i')  the online softmax's running maximum
    P^ = quantize P                                recipe.p_quant, recipe.p along the keys
    l_i = e^(m_i - m_i') l_i + rowsum(P or P^)     recipe.row_sum
    acc = e^(m_i - m_i') acc + P^ V^_j             V^: recipe.v along the keys
    O = acc / l_i,  lse = m_i + log l_i

    backward
    P = exp(S - lse), S from Q^, K^ or Q, K        recipe.backward_p
    D = rowsum(dO * O)                             recipe.delta
    dV_j += P^T dO_i,  dP = dO_i V_j^T             recipe.dv_p, dv_do, dp_do, dp_v
    dS = P * (dP - D)
    dQ_i += scale dS K_j,  dK_j += scale dS^T Q_i  recipe.dq_ds, dq_k, dk_ds, dk_q

Why a tiled simulation. The numbers a low-precision kernel produces depend on its tiling: P
tiles are exp(S - m) with m the running row maximum, so a tile's values, and so what
quantization flushes or clips, depend on the tiles visited before it; block scales of P and
dS are chosen per tile; the backward rebuilds P from the forward's log-sum-exp. A dense
reference would miss all of that.

How it runs. Vectorised over batch, heads and tiles, in blocks of query tiles by key tiles
(`tiling`), so memory grows with seq x block_n, never seq^2. Inside a block the running
maximum each key tile sees, m_j = max(m, rowmax S_1, ..., rowmax S_j), is a cumulative
maximum: the same values a kernel's loop holds, so P tiles, their quantization and every
statistic are the same whatever the blocking (tested); only the order in which P^ V^ is
summed differs (a weighted sum with weights exp(m_j - m_end) instead of repeated
rescaling), at float rounding level. Key tiles are visited first to last, or last to first
as FlashAttention-3's and SageAttention3's kernels do (`recipe.kv_order`).

How it differs from a kernel. Arithmetic runs in the working precision (float64 for float64
inputs, float32 otherwise) with torch's matmul, so accumulation order is not the kernel's;
Q, K, V and dO are quantized once as whole tensors (as a kernel receives them), P and dS
tile by tile. Quantized operands are kept dequantized (values exact, storage not).

Caveats. NaN spreads as far as the recipe's blocks carry it (a NaN in one element of a
block-scaled operand poisons its block, and with a per-tile tensor scale its whole tile),
while with unquantized operands it reaches exactly the rows that SDPA's reaches.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4lab.analysis import allocator
from fp4lab.analysis.checks import check_inputs, check_tiling, generator_for
from fp4lab.analysis.context import CallConfig, Pass
from fp4lab.analysis.observe import BackwardTrace, ForwardTrace, begin_trace
from fp4lab.analysis.online_softmax import OnlineSoftmax, rescale_add
from fp4lab.analysis.p_quant import quantize_p
from fp4lab.analysis.quantizers import Quantized, quantize_field
from fp4lab.analysis.streams import DROPOUT_STREAM, Draws, ZeroDraws
from fp4lab.analysis.tiling import (
    TileBlock,
    Tiling,
    pairs,
    t_times_query,
    times_key,
    zero_skipped,
)
from fp4lab.formats import as_generator
from fp4lab.recipes import (
    AttentionRecipe,
    BackwardMode,
    BackwardP,
    BackwardV,
    DeltaSource,
    DsP,
    RowReference,
    RowSum,
    SmoothK,
    Trace,
    TraceCall,
    resolve_recipe,
)
from fp4lab.recipes.transforms import incoherent_qk

__all__ = ["attention", "patch_sdpa"]


@dataclass
class Operands:
    """The forward's tiled operands: query side (B, Hkv, G, nQ, bm, E), key side
    (B, Hkv, nK, bn, E)."""

    q: torch.Tensor  # Q^ (Q minus its tile means with smooth_q), the scores' left operand
    k: torch.Tensor  # K^, the scores' right operand
    v: torch.Tensor  # V^
    q_mean: torch.Tensor | None  # smooth_q's per-query-tile mean of Q, (B, Hkv, G, nQ, 1, D)
    k_plain: torch.Tensor  # unquantized K, for the mean's correction term
    v_plain: torch.Tensor | None = None  # unquantized V, for the leakage fix's diagonal blocks


def _scores(ops: Operands, ps: Pass, block: TileBlock):
    """Scores of a block, before and after masking, and whether nothing in it is masked
    (then the trace need not mask its statistics)."""
    i0, i1, j0, j1, scale = block.i0, block.i1, block.j0, block.j1, ps.cfg.scale
    s = pairs(ops.q[:, :, :, i0:i1], ops.k[:, :, j0:j1]).mul_(scale)  # (B, Hkv, G, n, g, bm, bn)
    if ops.q_mean is not None:  # SageAttention2's correction term, in the working precision
        s = s + scale * pairs(ops.q_mean[:, :, :, i0:i1], ops.k_plain[:, :, j0:j1])
    masked = s if ps.mask is None else ps.mask.apply(s, block)
    allowed = block.allowed(s.device)
    unmasked = ps.mask is None and bool(allowed.all())
    return s, (masked if unmasked else masked.masked_fill(~allowed, -math.inf)), unmasked


# -- the forward's inner step ------------------------------------------------------------------
@dataclass
class ForwardStep:
    """What one block of the forward computed, for the trace."""

    block: TileBlock
    s_raw: torch.Tensor  # scores before masking
    s: torch.Tensor  # scores after masking
    unmasked: bool
    p: torch.Tensor  # exp(S - m_j)
    m_j: torch.Tensor  # the row reference of each tile, (..., n, g, bm)
    p_hat: Quantized
    pv: torch.Tensor  # P^ V^ per tile pair, (..., n, g, bm, Dv)
    weights: tuple
    skipped: torch.Tensor | None
    keep: torch.Tensor | None  # dropout's kept weights scaled by 1 / (1 - p), or None


def _dropout(block: TileBlock, ps: Pass, draws, like: torch.Tensor) -> torch.Tensor | None:
    """Dropout's mask of a block of tiles as M / (1 - p) (M = 1 where a weight is kept),
    drawn by position from `draws` (the forward's, in both passes), or None without dropout."""
    p = ps.cfg.dropout_p
    if p == 0:
        return None
    u = draws.for_tiles(DROPOUT_STREAM, like, (block.i0, block.j0))
    return (u >= p).to(like.dtype) / (1 - p)


def _forward_step(ops: Operands, sm: OnlineSoftmax, block: TileBlock, ps: Pass) -> ForwardStep:
    s_raw, s, unmasked = _scores(ops, ps, block)
    skipped = block.skipped(s.device)
    # -- update m_i --
    p, m_j, weights = sm.advance(s, block.t.reverse)
    # -- quantize P --
    p_hat, diagonal = _forward_p(p, s, m_j, ps, block)
    # -- update l_i and acc -- (dropout drops weights of P V; l_i sums them all, as SDPA)
    v_j = ops.v[:, :, block.j0 : block.j1]
    keep = _dropout(block, ps, ps.draws, p)
    # P V and the row sum run on P^ 2^-S (Direct-P's stored-scale shift: exact, a power of
    # two; it cancels in O and `_forward_chunk` adds it back to the lse)
    down = 2.0 ** -ps.recipe.p_scale_shift
    stored = p_hat.values * down if down != 1.0 else p_hat.values
    consumed = ps.recipe.row_sum is RowSum.QUANTIZED_P
    if diagonal is not None or not consumed:  # unquantized P, in P^'s shifted units
        p_low = p if down == 1.0 else _shifted(p, s, m_j, ps.recipe.p_scale_shift)
    leak_p, leak_v = ps.recipe.leakage_fix_p, ps.recipe.leakage_fix_v
    if diagonal is not None and leak_p and down != 1.0:  # P^ holds P itself on the diagonal
        stored = torch.where(diagonal, p_low, stored)
    weights_pv = stored if keep is None else stored * keep
    if diagonal is None:
        pv = times_key(weights_pv, v_j)  # (B, Hkv, G, n, g, bm, Dv)
    else:  # the leakage fix: P's diagonal blocks times V's, unquantized (or one of them)
        p_diag = weights_pv
        if leak_p:
            p_diag = p_low if keep is None else p_low * keep
        v_diag = ops.v_plain[:, :, block.j0 : block.j1] if leak_v else v_j
        pv = times_key(weights_pv.masked_fill(diagonal, 0), v_j)
        pv += times_key(p_diag.masked_fill(~diagonal, 0), v_diag)
    zero_skipped(pv, skipped)
    row = stored if consumed else p_low
    rescale_add(sm.l_i, weights, row.sum(-1))
    rescale_add(sm.acc, weights, pv)
    if down != 1.0:  # the trace sees P^ V^ itself
        pv = pv / down
    if sm.acc_prime is not None:  # Attn-QAT's O' = (P V^) / sum P
        p_kept = p if keep is None else p * keep
        rescale_add(sm.acc_prime, weights, zero_skipped(times_key(p_kept, v_j), skipped))
        rescale_add(sm.l_prime, weights, p.sum(-1))
    return ForwardStep(block, s_raw, s, unmasked, p, m_j, p_hat, pv, weights, skipped, keep)


def _shifted(p, s, m_j, shift: int) -> torch.Tensor:
    """P 2^-S, the unquantized P in Direct-P's shifted units (the leakage fix's diagonal, an
    unquantized row sum): P times 2^-S (exact) where P is finite, so the same bits as without
    the shift, and exp(z - S ln 2) where P itself passes float32 (log2 P >= 128, which a fixed
    row reference permits), z = s - m_j as `OnlineSoftmax.advance` formed it."""
    low = p * 2.0**-shift
    over = torch.isinf(p)
    if bool(over.any()):
        z = s - m_j.unsqueeze(-1)
        low = torch.where(over, torch.exp(z - shift * math.log(2.0)), low)
    return low


def _forward_p(p, s, m_j, ps: Pass, block: TileBlock):
    """The P^ the forward's P V consumes, and the leakage fix's diagonal mask (or None):
    the recipe's quantizer of P, with P's diagonal blocks left unquantized by the fix (unless
    it keeps only V there, `LeakageParts.V`)."""
    p_hat = quantize_p(p, s, m_j, ps, (block.i0, block.j0))
    diagonal = _diagonal_blocks(block, ps.cfg, s.device)
    if diagonal is not None and ps.recipe.leakage_fix_p:
        p_hat = Quantized(torch.where(diagonal, p, p_hat.values), p_hat.counts)
    return p_hat, diagonal


def _diagonal_blocks(block: TileBlock, cfg: CallConfig, device) -> torch.Tensor | None:
    """(n, g, bm, bn) bool: the entries whose query and key fall in the same block of V's
    (along the sequence), where the leakage fix keeps P and V (or one of them,
    `leakage_fix_parts`) unquantized; None without it."""
    if not (cfg.recipe.leakage_fix and cfg.causal):
        return None
    t, size = block.t, cfg.recipe.leakage_block
    rows = torch.arange(block.i0 * t.bm, block.i1 * t.bm, device=device).view(-1, 1, t.bm, 1)
    cols = torch.arange(block.j0 * t.bn, block.j1 * t.bn, device=device).view(1, -1, 1, t.bn)
    return rows // size == cols // size


# -- the forward -----------------------------------------------------------------------------
def _forward_chunk(ops: Operands, ps: Pass, chunk, observer, m_ref):
    """Query tiles [i0, i1) against the blocks of key tiles they see, in visiting order;
    returns (O, lse, O' or None) of the chunk and writes each tile's row reference into
    `m_ref` (B, Hkv, G, nQ, bm, nK) when given."""
    i0, i1, blocks = chunk
    sm = _online_softmax(ops, ps, i0, i1)
    watch = observer.chunk(i0, i1) if observer is not None else None
    for block in blocks:
        step = _forward_step(ops, sm, block, ps)
        if m_ref is not None:
            m_ref[:, :, :, i0:i1, :, block.j0 : block.j1] = step.m_j.transpose(-1, -2)
        if watch is not None:
            watch.step(step)
        del step  # its block temporaries, before the next block makes its own
    o, lse = sm.finish()
    shift = ps.recipe.p_scale_shift
    if shift:  # the sums ran on P^ 2^-S: the lse of P^ itself, from l 2^S where it is finite
        full = sm.l_i * 2.0**shift  # (exact: a power of two) as without the shift, bit for bit
        lse = torch.where(sm.l_i == 0, lse, torch.where(
            full.isfinite(), sm.m_i + torch.log(full), lse + shift * math.log(2.0)))
    if watch is not None:
        watch.finish(o, lse)
    return o, lse, (sm.finish(prime=True)[0] if sm.acc_prime is not None else None)


def _online_softmax(ops: Operands, ps: Pass, i0: int, i1: int) -> OnlineSoftmax:
    """The running statistics of query tiles [i0, i1), with the recipe's row reference."""
    recipe, t = ps.recipe, ps.t
    shape = (t.B, t.Hk, t.G, i1 - i0, t.bm)
    fixed_m = None
    if recipe.row_reference is RowReference.ZERO:
        fixed_m = ops.q.new_zeros(shape)
    elif recipe.row_reference is RowReference.ANCHOR:
        fixed_m = _anchor(ops, ps, i0, i1)
    lazy = recipe.lazy_rescale_log2 if recipe.row_reference is RowReference.LAZY_MAX else None
    prime = recipe.delta is DeltaSource.UNQUANTIZED_P_OUTPUT
    return OnlineSoftmax.start(shape, ops.v.shape[-1], ops.q, prime, fixed_m, lazy)


def _anchor(ops: Operands, ps: Pass, i0: int, i1: int) -> torch.Tensor:
    """fp4-fa4's anchor row reference of query tiles [i0, i1): each row's largest score over
    its first `anchor_keys` keys (after the masks), plus the margin in scaled units; rows
    that see none of them get -inf (then the reference is 0)."""
    s = _scores(ops, ps, TileBlock(ps.t, i0, i1, 0, 1))[1]  # (B, Hkv, G, n, 1, bm, bn)
    top = s[..., 0, :, : ps.recipe.anchor_keys].amax(dim=-1)  # (B, Hkv, G, n, bm)
    return top + ps.recipe.anchor_margin * ps.cfg.scale


def _forward(q, k, v, ps: Pass, rec):
    """FlashAttention-2's forward over query-tile chunks; returns (O, lse tiles, O' or None,
    saved tensors)."""
    recipe, t, work = ps.recipe, ps.t, _work_dtype(q)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    q_src, q_mean = _smooth_q(qw, t) if recipe.smooth_q else (qw, None)
    q_hat, k_hat, v_hat = (
        quantize_field(x, f, ps) for x, f in ((q_src, "q"), (kw, "k"), (vw, "v"))
    )
    v_plain = t.k_tiles(vw) if recipe.leakage_fix_v and ps.cfg.causal else None
    ops = Operands(
        t.q_tiles(q_hat.values), t.k_tiles(k_hat.values), t.k_tiles(v_hat.values), q_mean,
        t.k_tiles(kw), v_plain,
    )  # fmt: skip
    observer = None
    if rec is not None:
        observer = ForwardTrace(rec, t, ops, (qw, kw, vw), (q_src, q_hat, k_hat, v_hat), ps)
    # outputs are written into tensors allocated up front: chunk results kept alive in a list
    # would pin malloc's heap above each block's temporaries and make it creep
    o = qw.new_empty(t.B, t.Hk, t.G, t.nQ, t.bm, v.shape[-1])
    lse = qw.new_empty(t.B, t.Hk, t.G, t.nQ, t.bm)
    o_prime = torch.empty_like(o) if recipe.delta is DeltaSource.UNQUANTIZED_P_OUTPUT else None
    # the row reference each key tile saw, for a backward that replays the forward's P^
    m_ref = None
    if rec is not None or recipe.backward is BackwardMode.FORWARD_EXACT:
        m_ref = qw.new_zeros(t.B, t.Hk, t.G, t.nQ, t.bm, t.nK)
    for chunk in t.chunks():
        i0, i1 = chunk[0], chunk[1]
        pieces = _forward_chunk(ops, ps, chunk, observer, m_ref)
        for whole, piece in zip((o, lse, o_prime), pieces, strict=True):
            if whole is not None:
                whole[:, :, :, i0:i1] = piece
        del pieces
    saved = Saved(q_hat.values, k_hat.values, v_hat.values, q_mean, m_ref, ps.draws)
    return t.q_untile(o), lse, (t.q_untile(o_prime) if o_prime is not None else None), saved


@dataclass
class Saved:
    """What the forward keeps for the backward besides its inputs and outputs."""

    q_hat: torch.Tensor  # (B, H, Sq, D), Q^ (smoothed)
    k_hat: torch.Tensor
    v_hat: torch.Tensor
    q_mean: torch.Tensor | None  # smooth_q's means, (B, Hkv, G, nQ, 1, D)
    m_ref: torch.Tensor | None  # each key tile's row reference, (B, Hkv, G, nQ, bm, nK)
    draws: Draws | None  # the forward's stochastic-rounding draws


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _smooth_q(qw: torch.Tensor, t: Tiling):
    """Q minus its mean over each query tile, and that mean (B, Hkv, G, nQ, 1, D): the tile's
    sum over block_m, padding rows counting as zeros (SageAttention3's ``triton_group_mean``
    divides by its group size)."""
    tiles = t.q_tiles(qw)  # (B, Hkv, G, nQ, bm, D)
    q_mean = tiles.sum(dim=-2, keepdim=True) / t.bm
    return qw - t.q_untile(q_mean.expand_as(tiles)), q_mean


# -- the backward's inner step -------------------------------------------------------------------
@dataclass
class BackwardOperands:
    """The backward's tiled operands (layouts as `Operands`)."""

    scores: Operands  # what S = Q K^T is rebuilt from
    do_dv: torch.Tensor  # dO in dV = P^T dO, query side
    do_dp: torch.Tensor  # dO in dP = dO V^T, query side
    v_dp: torch.Tensor  # V in dP, key side
    k_dq: torch.Tensor  # K in dQ = dS K, key side
    q_dk: torch.Tensor  # Q in dK = dS^T Q, query side
    replay: Replay | None = None  # to rebuild the forward's own P^
    dropout_draws: Draws | None = None  # the forward's draws, for dropout's mask


@dataclass
class Replay:
    """What the backward needs to rebuild the P^ tiles the forward consumed: the forward's
    score operands, each tile's row reference (B, Hkv, G, nQ, bm, nK), and the forward's
    pass (its draws; no counts)."""

    scores: Operands
    m_ref: torch.Tensor
    forward: Pass

    def p_hat(self, block: TileBlock, lse_c, s=None) -> torch.Tensor:
        """The forward's P^ of a block normalized by its log-sum-exp: the weights its output
        gave each value row, (B, Hkv, G, n, g, bm, bn). `s`: the forward's masked scores if
        the caller has them."""
        if s is None:
            s = _scores(self.scores, self.forward, block)[1]
        m_j = self.m_ref[:, :, :, block.i0 : block.i1, :, block.j0 : block.j1].transpose(-1, -2)
        p = (s - m_j.unsqueeze(-1)).exp_()  # (B, Hkv, G, n, g, bm, bn)
        p_hat, _ = _forward_p(p, s, m_j, self.forward, block)
        return p_hat.values.mul_(torch.exp(m_j - lse_c).unsqueeze(-1))


@dataclass
class BackwardStep:
    """What one block of the backward computed, for the trace."""

    block: TileBlock
    s: torch.Tensor  # scores after masking
    unmasked: bool
    lse: torch.Tensor  # (B, Hkv, G, n, 1, bm)
    p: torch.Tensor  # exp(S - lse)
    p_dv: Quantized  # P as dV = P^T dO consumes it
    dp: torch.Tensor
    ds: torch.Tensor
    ds_dq: Quantized  # dS as dQ = dS K consumes it
    ds_dk: Quantized  # dS as dK = dS^T Q consumes it
    p_fwd: torch.Tensor | None  # the forward's P^ normalized by its lse (with the trace)
    dv: torch.Tensor  # each tile pair's P^T dO, (..., n, g, bn, Dv)
    dq: torch.Tensor  # each tile pair's dS K, (..., n, g, bm, D)
    dk: torch.Tensor  # each tile pair's dS^T Q, (..., n, g, bn, D)
    keep: torch.Tensor | None  # dropout's kept weights scaled by 1 / (1 - p), or None


def _backward_step(ops: BackwardOperands, ps: Pass, block: TileBlock, rows) -> BackwardStep:
    """One block of the backward; `rows` = (lse, D) of its query tiles, (B, Hkv, G, n, 1, bm)
    and (B, Hkv, G, n, 1, bm, 1)."""
    (lse_c, delta_c), recipe, at = rows, ps.recipe, (block.i0, block.j0)
    i0, i1, j0, j1 = block.i0, block.i1, block.j0, block.j1
    _, s, unmasked = _scores(ops.scores, ps, block)
    skipped = block.skipped(s.device)
    # -- rebuild P from the forward's lse --
    p = (s - lse_c.unsqueeze(-1)).exp_()
    p_fwd = None
    if ops.replay is not None:
        p_fwd = ops.replay.p_hat(block, lse_c, s if ops.replay.scores is ops.scores else None)
    if recipe.backward is BackwardMode.STRAIGHT_THROUGH:  # the forward's quantizer of P
        p_dv = quantize_p(p, s, lse_c.expand(s.shape[:-1]), ps, at)
    elif recipe.backward is BackwardMode.FORWARD_EXACT:
        p_dv = Quantized(p_fwd)
    else:
        p_dv = quantize_field(p, "dv_p", ps, at)
    # -- dV_j += P^T dO_i -- (with dropout's mask on P, and on dP below)
    keep = _dropout(block, ps, ops.dropout_draws, p)
    p_dropped = p_dv.values if keep is None else p_dv.values * keep
    dv = zero_skipped(t_times_query(p_dropped, ops.do_dv[:, :, :, i0:i1]), skipped)
    # -- dS = P * (dP - D) --
    dp = pairs(ops.do_dp[:, :, :, i0:i1], ops.v_dp[:, :, j0:j1])
    dp_kept = dp if keep is None else dp * keep
    ds = torch.sub(dp_kept, delta_c).mul_(p_dv.values if recipe.ds_p is DsP.DV_OPERAND else p)
    # -- dQ_i += dS K_j, dK_j += dS^T Q_i --
    ds_dq = quantize_field(ds, "dq_ds", ps, at)
    dq = zero_skipped(times_key(ds_dq.values, ops.k_dq[:, :, j0:j1]), skipped)
    ds_dk = quantize_field(ds, "dk_ds", ps, at)
    dk = zero_skipped(t_times_query(ds_dk.values, ops.q_dk[:, :, :, i0:i1]), skipped)
    return BackwardStep(
        block, s, unmasked, lse_c, p, p_dv, dp, ds, ds_dq, ds_dk, p_fwd, dv, dq, dk, keep
    )


# -- the backward --------------------------------------------------------------------------------
@dataclass
class Forwarded:
    """What the autograd Function keeps of the forward for the backward."""

    inputs: tuple  # (q, k, v) as given to the Function
    o: torch.Tensor  # the forward's output in the working precision, (B, H, Sq, Dv)
    lse: torch.Tensor  # (B, Hkv, G, nQ, bm)
    o_prime: torch.Tensor | None  # Attn-QAT's O'
    saved: Saved
    forward: Pass
    rec: TraceCall | None


def _backward(do, fwd: Forwarded):
    """FlashAttention-2's backward: dQ, dK, dV in the working precision."""
    (q, k, v), t, cfg = fwd.inputs, fwd.forward.t, fwd.forward.cfg
    work = fwd.o.dtype
    dow, qw, kw, vw = do.to(work), q.to(work), k.to(work), v.to(work)
    ps = Pass.start(cfg, t, fwd.rec is not None)  # draws its key after the forward's
    quant, ops = _backward_operands(dow, (qw, kw, vw), fwd, ps)
    delta = t.q_tiles(_delta(cfg.recipe, dow, quant, fwd, q.dtype))  # (B, Hkv, G, nQ, bm)
    observer = None
    if fwd.rec is not None:
        observer = BackwardTrace(fwd.rec, t, (qw, kw, vw, dow), quant)
    dk = qw.new_zeros(t.B, t.Hk, t.nK, t.bn, q.shape[-1])
    dv = qw.new_zeros(t.B, t.Hk, t.nK, t.bn, v.shape[-1])
    dq = qw.new_zeros(t.B, t.Hk, t.G, t.nQ, t.bm, q.shape[-1])
    for i0, i1, blocks in t.chunks():
        lse_c = fwd.lse[:, :, :, i0:i1].unsqueeze(-2)  # (B, Hkv, G, n, 1, bm)
        delta_c = delta[:, :, :, i0:i1, None, :, None]  # (B, Hkv, G, n, 1, bm, 1)
        for block in blocks:
            step = _backward_step(ops, ps, block, (lse_c, delta_c))
            dv[:, :, block.j0 : block.j1] += step.dv.sum((2, 3))
            dq[:, :, :, i0:i1] += cfg.scale * step.dq.sum(4)
            dk[:, :, block.j0 : block.j1] += cfg.scale * step.dk.sum((2, 3))
            if observer is not None:
                observer.step(step)
            del step  # its block temporaries, before the next block makes its own
    return t.q_untile(dq), t.k_untile(dk), t.k_untile(dv)


def _delta(recipe: AttentionRecipe, do, quant: dict, fwd: Forwarded, dtype) -> torch.Tensor:
    """D_i = rowsum(dO_i * O_i) with dO and O as `recipe.delta` says; the outputs as stored, in
    the inputs' dtype (a kernel stores O so)."""
    if recipe.delta is DeltaSource.UNQUANTIZED_P_OUTPUT:
        return (do * fwd.o_prime.to(dtype).to(do.dtype)).sum(-1)
    o_stored = fwd.o.to(dtype).to(do.dtype)
    if recipe.delta is DeltaSource.QUANTIZED_DO:
        return (quant["do_dp"].values * o_stored).sum(-1)
    return (do * o_stored).sum(-1)


_TILER = {
    "do_dv": "q_tiles",
    "do_dp": "q_tiles",
    "v_dp": "k_tiles",
    "k_dq": "k_tiles",
    "q_dk": "q_tiles",
}


def _backward_operands(do, inputs, fwd: Forwarded, ps: Pass):
    """The backward's whole-tensor operands quantized as `recipe.backward` says: the
    `Quantized` operands (for the trace) and their tiles."""
    (q, k, v), recipe, t, saved = inputs, ps.recipe, ps.t, fwd.saved
    forward_scores = Operands(
        t.q_tiles(saved.q_hat), t.k_tiles(saved.k_hat), None, saved.q_mean, t.k_tiles(k)
    )
    if recipe.backward_p is BackwardP.QUANTIZED_QK:
        scores = forward_scores
    else:
        scores = Operands(t.q_tiles(q), t.k_tiles(k), None, None, t.k_tiles(k))
    replay = None
    if saved.m_ref is not None:
        replay = Replay(forward_scores, saved.m_ref, fwd.forward.replace(counts=False))
    quant = {
        name: quantize_field(do, field, ps)
        for name, field in (("do_dv", "dv_do"), ("do_dp", "dp_do"))
    }
    if recipe.backward is BackwardMode.FLASH:
        v_src = saved.v_hat if recipe.backward_v is BackwardV.FORWARD else v
        sources = {"v_dp": (v_src, "dp_v"), "k_dq": (k, "dq_k"), "q_dk": (q, "dk_q")}
        quant.update({name: quantize_field(x, f, ps) for name, (x, f) in sources.items()})
    else:  # straight through or exact: the forward's Q^ (with its mean added back), K^, V^
        q_eff = saved.q_hat
        if saved.q_mean is not None:
            mean = saved.q_mean.expand(*saved.q_mean.shape[:4], t.bm, saved.q_mean.shape[-1])
            q_eff = q_eff + t.q_untile(mean)
        forward = {
            "v_dp": (v, saved.v_hat, "v"),
            "k_dq": (k, saved.k_hat, "k"),
            "q_dk": (q, q_eff, "q"),
        }
        quant.update({name: _forward_counts(*args, ps) for name, args in forward.items()})
    tiles = {name: getattr(t, _TILER[name])(quant[name].values) for name in quant}
    return quant, BackwardOperands(scores=scores, replay=replay, dropout_draws=saved.draws, **tiles)


def _forward_counts(x, x_hat, field: str, ps: Pass) -> Quantized:
    """The forward's quantized operand, with its trace counts recomputed (with zero draws:
    the counts never depend on stochastic rounding's draws)."""
    if not ps.counts:
        return Quantized(x_hat)
    return Quantized(x_hat, quantize_field(x, field, ps.replace(draws=ZeroDraws())).counts)


# -- the autograd Function ---------------------------------------------------------------------
class _FlashAttention(torch.autograd.Function):
    """Forward and backward of `attention` (inputs already transformed by `_transform_qk`)."""

    @staticmethod
    def forward(ctx, q, k, v, cfg: CallConfig):
        t = cfg.tiling(q, k)
        scores = t.B * t.H * t.Sq * t.Sk
        allocator.settle(q.device, scores)
        rec = begin_trace(cfg, t, q, v)
        ps = Pass.start(cfg, t, rec is not None)
        o, lse, o_prime, saved = _forward(q, k, v, ps, rec)
        if not any(ctx.needs_input_grad[:3]):  # else the backward reuses the free heap
            allocator.trim(q.device, scores)
        ctx.forwarded = Forwarded((q, k, v), o, lse, o_prime, saved, ps, rec)
        return o.to(q.dtype, copy=True)  # not a view of o: a caller may modify it in place

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        fwd = ctx.forwarded
        q, k, v = fwd.inputs
        t = fwd.forward.t
        scores = t.B * t.H * t.Sq * t.Sk
        allocator.settle(do.device, scores)
        dq, dk, dv = _backward(do, fwd)
        allocator.trim(do.device, scores)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _transform_qk(q, k, recipe: AttentionRecipe):
    """Softmax-invariant rewrites applied before the kernel (differentiable torch ops)."""
    q, k = incoherent_qk(q, k, recipe)
    if recipe.smooth_k is SmoothK.PER_HEAD:  # SageAttention: each row of S shifts by q_i . mean(K)
        k = k - k.mean(dim=-2, keepdim=True)
    elif recipe.smooth_k is SmoothK.GLOBAL:  # FastVideo's Attn-QAT kernel: one vector for all
        k = k - k.mean(dim=(0, 1, 2), keepdim=True)
    return q, k


# -- the public entry --------------------------------------------------------------------------
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    recipe: AttentionRecipe | str = "exact",
    *,
    causal: bool = False,
    scale: float | None = None,
    trace: Trace | None = None,
    generator: torch.Generator | int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention, FlashAttention-style, with quantized operands.

    Computes softmax(scale * Q K^T + mask) V for q (B, H, Sq, D), k (B, Hkv, Sk, D) and
    v (B, Hkv, Sk, Dv) and returns (B, H, Sq, Dv) in q's dtype, like
    `F.scaled_dot_product_attention`, with a backward, so it replaces SDPA in a model. H must
    be a multiple of Hkv: query head h uses key/value head h // (H / Hkv) (grouped-query
    attention in SDPA's ``enable_gqa=True`` layout). Each operand of the six products is
    quantized as `recipe` says; with the "exact" recipe this is FlashAttention-2 itself. The
    module docstring gives the algorithm.

    Example::

        trace = Trace()
        out = attention(q, k, v, "fa4fp4_causal", causal=True, trace=trace)
        out.backward(do)
        frame = trace.to_frame()  # one row per (product, batch, head, q tile, k tile)
        frame[frame["product"] == "dv"].pivot_table("b_flushed", "q_tile", "k_tile")

    Args:
        q, k, v: floating-point tensors of one dtype and device. float64 inputs are computed
            in float64, all others in float32 (and returned in their own dtype); model
            float32 accumulation with float32 inputs.
        recipe: an `AttentionRecipe` or a registered name: a preset of `fp4lab.recipes`
            (each preset's ``doc`` cites its source and assumptions), a recipe the user
            registered with `fp4lab.formats.register`, or the name of a number or block
            format, meaning it on every operand ("nvfp4").
        causal: the causal mask aligned top-left exactly as SDPA's ``is_causal``: query i
            sees keys j <= i, whatever Sq and Sk. Pairs of tiles in which no query can see
            a key are skipped, as a kernel skips them (or, inside a block, contribute
            nothing), and are absent from the trace.
        scale: softmax scale; 1 / sqrt(D) by default.
        trace: a `Trace` that records per-tile statistics of this call: the forward's now,
            the backward's when backward() runs.
        generator: torch.Generator or int seed for stochastic rounding, required when the
            recipe rounds stochastically and recorded in the trace. The forward draws one key
            from it and the backward another after it, so one seed reproduces forward and
            backward bit for bit; every element's draw then depends on its position only,
            not on the batch size, the number of heads or how fp4lab chunks the work
            (`fp4lab.analysis.streams`). A list of n generators or seeds runs n samples
            stacked along the batch: generator i draws for the i-th of n equal consecutive
            chunks of it exactly as a call on that chunk alone would.
        block_m, block_n: query and key tile sizes, FlashAttention's Br and Bc (positive;
            multiples of the blocks P and dS are quantized in along them); None takes the
            recipe's (the tiles of the kernel it models, `AttentionRecipe.block_m`), or 128.
            Tiles need not divide Sq and Sk.
        attn_mask: optional mask broadcastable to (B, H, Sq, Sk), boolean (True takes part)
            or additive float, as SDPA's; it gets no gradient.
        dropout_p: the probability of dropping each attention weight, as SDPA's: the output
            is (P^ * M / (1 - p)) V^ / l with M a keep-mask of the normalized weights (l sums
            every weight), and the backward multiplies dV's P and dP by the same mask. M is
            drawn by position from the call's generator (required then), in the forward's
            stream, so the backward sees the same mask; the trace records p.

    Fully masked rows (a boolean mask that excludes every key of a row, or Sk = 0) give an
    output row of zeros and zero gradients, as SDPA's CPU and flash kernels do. NaN in q or
    k reaches the rows that attend to it; NaN in v reaches every row of each query tile that
    sees its key (a masked-out zero of P times NaN is NaN in the tile's product, so with a
    causal mask a few earlier rows of that tile turn NaN too; SDPA's math backend spreads it
    further). Through quantization it also reaches the rows that share a block (or a tensor
    scale) with it; the trace counts it.

    Raises:
        TypeError: q, k, v not floating-point tensors of one dtype; a recipe of a wrong type.
        ValueError: shapes that do not agree, different devices, an unknown recipe, a
            head_dim or tile size the recipe's blocks cannot tile, a stochastic recipe
            without a generator, a bad attn_mask.
    """
    recipe = resolve_recipe(recipe)
    block_m, block_n = recipe.tiles(block_m, block_n)
    check_inputs(q, k, v, attn_mask)
    check_tiling(recipe, q.shape[-1], v.shape[-1], block_m, block_n)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    gen = generator_for(recipe, generator, dropout_p)
    if isinstance(gen, tuple) and q.shape[0] % len(gen):
        raise ValueError(
            f"generator: {len(gen)} generators (stacked samples) must split the batch of "
            f"{q.shape[0]} into equal chunks"
        )
    if q.shape[2] == 0:  # no queries: an empty output, still connected to the inputs' graph
        return q.new_zeros(*q.shape[:3], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
    q, k = _transform_qk(q, k, recipe)
    cfg = CallConfig(
        recipe=recipe,
        causal=bool(causal),
        scale=float(scale),
        block_m=block_m,
        block_n=block_n,
        generator=gen,
        trace=trace,
        attn_mask=attn_mask,
        seed=generator if isinstance(generator, int) and not isinstance(generator, bool) else None,
        dropout_p=float(dropout_p),
    )
    return _FlashAttention.apply(q, k, v, cfg)


@contextlib.contextmanager
def patch_sdpa(recipe: AttentionRecipe | str, trace: Trace | None = None, **options):
    """Route `torch.nn.functional.scaled_dot_product_attention` through `attention`.

    Inside the ``with`` block every SDPA call (its query, key, value, attn_mask, is_causal,
    scale and enable_gqa) runs `attention` with `recipe`, recording into `trace` (one call
    index per SDPA call, so per layer); `options` (generator, block_m, block_n) are passed
    on; an int seed becomes one torch.Generator for the whole block, so successive calls
    (layers, steps) draw fresh stochastic-rounding noise from one reproducible stream. 3-D
    inputs (N, L, E) are treated as one head. dropout_p > 0 runs `attention`'s seeded
    dropout (give a `generator` option). Calls that look the function up on `torch.nn.functional`
    when they run are routed (nn.MultiheadAttention, most model code); a module that bound
    the function to its own name before the block keeps calling the original, so a block
    that routed no call at all ends with a RuntimeWarning saying so.
    """
    import warnings

    recipe = resolve_recipe(recipe)
    routed_calls = 0
    original = F.scaled_dot_product_attention
    if "generator" in options:  # one stream for all calls: an int seed would repeat its draws
        options["generator"] = as_generator(options["generator"])

    def routed(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        nonlocal routed_calls
        routed_calls += 1
        if query.shape[-3] != key.shape[-3] and query.ndim == 4 and not enable_gqa:
            raise ValueError(
                "query and key have different head counts; SDPA needs enable_gqa=True for that"
            )
        squeeze = query.ndim == 3
        if squeeze:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            attn_mask = (
                attn_mask.unsqueeze(1)
                if attn_mask is not None and attn_mask.ndim == 3
                else attn_mask
            )
        out = attention(
            query,
            key,
            value,
            recipe,
            causal=is_causal,
            scale=scale,
            trace=trace,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            **options,
        )
        return out.squeeze(1) if squeeze else out

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original
    if routed_calls == 0:
        warnings.warn(
            f"patch_sdpa({recipe.name!r}) routed no scaled_dot_product_attention call: the "
            "code in the block either made none or calls a reference to the function bound "
            "before the block (from torch.nn.functional import scaled_dot_product_attention), "
            "which stays unquantized",
            RuntimeWarning,
            stacklevel=3,
        )
