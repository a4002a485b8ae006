"""The forward kernel of `fp4lab.kernels.gluon_fwd` in Gluon (Triton's explicit-layout
language), for Hopper: what it computes and where it runs is that module's docstring; this one
holds the kernel, imported only when it is about to be launched (Gluon's API is Triton 3.6's
here and is not needed anywhere else).

The arithmetic is `fp4lab.kernels.flash._attn_fwd`'s for the calls `gluon_fwd.unsupported`
admits, step for step: the scores' product times the per-head scale (qk_scale from the host
times Q's and K's factors), the running maximum, z = s - m, exp2, P quantized by the same
`flash._quantize_p`, P^ V^ accumulated inside the product (ACC_DOT: in units of each tile
factor's significand with a per-tile tensor scale, ACC_UNITS; else of the constant factor,
applied at the end), the row sum of the unquantized P, O = acc / l times V's factor and the
log-sum-exp. What differs is only when each product is issued and waited for:
FlashAttention-3's intra-warpgroup pipelining (hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp): in
the loop over key tiles, S_{j+1} = Q K_{j+1}^T is issued, acc rescaled, P_j V_j issued, the
wait is for S_{j+1} alone, tile j+1's softmax and P quantization run while P_j V_j does, then
it is waited for. Every wait is for a product issued in the same iteration: where a register
of a product still in flight across the loop's back edge is read, ptxas serializes every
wgmma of the kernel (its C7514 note; found with the probe this kernel came from, commit
45df220's `benchmarks/gluon_fwd_probe.py`).
K and V stream through rings of STAGES shared-memory buffers that TMA fills.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fp4lab.kernels.flash import _quantize_p, _round


@gluon.jit
def _issue(desc, ring, bars, row, slot):
    """TMA: rows [row, row + block) of `desc` into ring slot `slot`, arriving on its barrier."""
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, 0], bars.index(slot), ring.index(slot))


@gluon.jit
def _issue_at(desc, ring, bars, row, col, slot):
    """TMA: the tile of `desc` at (row, col) into ring slot `slot`, arriving on its barrier
    (key-major V: its D rows of one key-value head at the key tile's first column)."""
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bars.index(slot), ring.index(slot))


@gluon.jit
def _softmax_fp8(s, m_i, l_i, qk_scale, offs_m, start_n, MASK: gl.constexpr,
                 BLOCK_N: gl.constexpr, s_layout: gl.constexpr, LIFT: gl.constexpr,
                 LAZY: gl.constexpr, LAZY_LOG2: gl.constexpr, HW: gl.constexpr,
                 EQ_LO: gl.constexpr, EQ_HI: gl.constexpr, E_UNIT: gl.constexpr,
                 E_MAX: gl.constexpr):
    """One tile of unscaled scores s to (P^ in E4M3, in the scores' layout, alpha, m, l) for
    P cast to E4M3 (`flash._fwd_inner` with MODE 1, Z_FMA and PV_FP8): the row maximum of
    the scaled scores, kept while the tile raises it by at most LAZY_LOG2 (LAZY), z = S s - m
    in one fma, P = exp2(z), P LIFT cast by the GPU's conversion (HW, `flash.HW_E4M3`) or
    rounded by `_round`'s arithmetic and cast exactly, l plus the unquantized P's row sum."""
    qk = s
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        qk = gl.where(offs_n[None, :] <= offs_m[:, None], qk, -float("inf"))
    top = gl.maximum(m_i, gl.max(qk, 1) * qk_scale)
    if LAZY:
        m_new = gl.where(top - m_i > LAZY_LOG2, top, m_i)
    else:
        m_new = top
    if MASK:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(gl.fma(qk, qk_scale, -m_use[:, None]))
    if HW:
        p8 = (p * LIFT).to(gl.float8e4nv)
    else:  # `_quantize_p`'s MODE 1, then an exact cast: P^ lies on E4M3's grid
        p8 = _round(p * LIFT, EQ_LO, EQ_HI, E_UNIT, E_MAX).to(gl.float8e4nv)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p8, alpha, m_new, l_i


@gluon.jit
def _softmax_tile(s, m_i, l_i, qk_scale, offs_m, start_n, MASK: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
                  p_layout: gl.constexpr, EQ_LO: gl.constexpr, EQ_HI: gl.constexpr,
                  E_UNIT: gl.constexpr, E_MAX: gl.constexpr, SQ_LO: gl.constexpr,
                  SQ_HI: gl.constexpr, S_UNIT: gl.constexpr, S_MAX: gl.constexpr,
                  E_LO: gl.constexpr, E_HI: gl.constexpr, QBLOCK: gl.constexpr,
                  RULE: gl.constexpr, ARITH: gl.constexpr, TENSOR: gl.constexpr,
                  EMAX_E: gl.constexpr, UNITS: gl.constexpr):
    """One tile of unscaled scores s to (P^ as P V's bf16 register operand, alpha, m, l, the
    tile factor), as `flash._fwd_inner` takes a tile (MASK: the causal diagonal band's
    -inf above the diagonal)."""
    qk = s * qk_scale
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        qk = gl.where(offs_n[None, :] <= offs_m[:, None], qk, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    if MASK:  # a row with no key yet keeps m = -inf (never here: key 0 is every row's)
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = gl.exp2(m_i - m_use)
    p = gl.exp2(qk - m_use[:, None])
    p_hat, factor = _quantize_p(
        p, 0, BLOCK_M, BLOCK_N, 2, 1.0, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT,
        S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E, False, 0, UNITS,
    )
    l_i = l_i * alpha + gl.sum(p, 1)
    # back into the scores' layout (the same map: `_quantize_p`'s reshapes leave an equal
    # linear layout), so that P^ reaches the product's operand layout as the scores' would;
    # converted from the linear layout directly, the second warpgroup's rows came out wrong
    # on the H200 (Triton 3.6)
    p_hat = gl.convert_layout(p_hat, s_layout, assert_trivial=True)
    return gl.convert_layout(p_hat.to(gl.bfloat16), p_layout), alpha, m_new, l_i, factor


@gluon.jit
def _rescaled(acc, alpha, factor, unit, UNITS: gl.constexpr, o_rows: gl.constexpr):
    """(acc, unit) before a tile's P^ V^ adds to acc: acc times alpha, and with UNITS also
    from the last tile's unit into this tile's factor (`flash._fwd_inner`'s ACC_UNITS)."""
    if UNITS:
        ratio = gl.div_rn(unit, factor)
        return acc * gl.convert_layout(alpha * ratio, o_rows)[:, None], factor
    return acc * gl.convert_layout(alpha, o_rows)[:, None], unit


@gluon.jit
def _tile(s, m_i, l_i, qk_scale, offs_m, start_n, diagonal, CAUSAL: gl.constexpr,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr,
          p_layout: gl.constexpr, EQ_LO: gl.constexpr, EQ_HI: gl.constexpr,
          E_UNIT: gl.constexpr, E_MAX: gl.constexpr, SQ_LO: gl.constexpr, SQ_HI: gl.constexpr,
          S_UNIT: gl.constexpr, S_MAX: gl.constexpr, E_LO: gl.constexpr, E_HI: gl.constexpr,
          QBLOCK: gl.constexpr, RULE: gl.constexpr, ARITH: gl.constexpr,
          TENSOR: gl.constexpr, EMAX_E: gl.constexpr, UNITS: gl.constexpr,
          PV_FP8: gl.constexpr, LIFT: gl.constexpr, LAZY: gl.constexpr,
          LAZY_LOG2: gl.constexpr, HW: gl.constexpr):
    """Key tile start_n's (P^ operand, alpha, m, l, tile factor), masked where it reaches the
    diagonal: `_softmax_fp8` (its factor 1 / LIFT) with PV_FP8, else `_softmax_tile`."""
    if PV_FP8:
        if CAUSAL and start_n + BLOCK_N > diagonal:
            p_op, alpha, m_i, l_i = _softmax_fp8(
                s, m_i, l_i, qk_scale, offs_m, start_n, True, BLOCK_N, s_layout, LIFT, LAZY,
                LAZY_LOG2, HW, EQ_LO, EQ_HI, E_UNIT, E_MAX)
        else:
            p_op, alpha, m_i, l_i = _softmax_fp8(
                s, m_i, l_i, qk_scale, offs_m, start_n, False, BLOCK_N, s_layout, LIFT, LAZY,
                LAZY_LOG2, HW, EQ_LO, EQ_HI, E_UNIT, E_MAX)
        factor = gl.full([], 1.0 / LIFT, gl.float32)
    else:
        if CAUSAL and start_n + BLOCK_N > diagonal:
            p_op, alpha, m_i, l_i, factor = _softmax_tile(
                s, m_i, l_i, qk_scale, offs_m, start_n, True, BLOCK_M, BLOCK_N, s_layout,
                p_layout, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI,
                QBLOCK, RULE, ARITH, TENSOR, EMAX_E, UNITS)
        else:
            p_op, alpha, m_i, l_i, factor = _softmax_tile(
                s, m_i, l_i, qk_scale, offs_m, start_n, False, BLOCK_M, BLOCK_N, s_layout,
                p_layout, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI,
                QBLOCK, RULE, ARITH, TENSOR, EMAX_E, UNITS)
    return p_op, alpha, m_i, l_i, factor


@gluon.jit
def _key_tile(j, n_tiles, REVERSE: gl.constexpr):
    """The key tile visited j-th: last to first with REVERSE."""
    if REVERSE:
        return n_tiles - 1 - j
    return j


@gluon.jit
def _issue_kv(k_desc, v_desc, k_ring, v_ring, k_bars, v_bars, k_row, kv_head, tile, slot,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, PV_FP8: gl.constexpr,
              WHICH: gl.constexpr):
    """TMA of key tile `tile` into ring slot `slot`: K's (WHICH 0), V's (WHICH 1) or both
    (2); V key-major with PV_FP8 (its HEAD_DIM rows of head kv_head, the tile's columns)."""
    if WHICH != 1:
        _issue(k_desc, k_ring, k_bars, k_row + tile * BLOCK_N, slot)
    if WHICH != 0:
        if PV_FP8:
            _issue_at(v_desc, v_ring, v_bars, kv_head * HEAD_DIM, tile * BLOCK_N, slot)
        else:
            _issue(v_desc, v_ring, v_bars, k_row + tile * BLOCK_N, slot)


@gluon.jit
def _stage_p(p_smem, buf, p8):
    """E4M3 P^ into P's shared buffer `buf`, visible to the next product that reads it (the
    async proxy's fence, then every warp's stores done)."""
    p_smem.index(buf).store(p8)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _p_operand(p_op, p_smem, buf, PV_FP8: gl.constexpr):
    """P^ as its product reads it: with PV_FP8 its shared buffer `buf`, else the register
    operand p_op."""
    if PV_FP8:
        operand = p_smem.index(buf)
    else:
        operand = p_op
    return operand


@gluon.jit
def _folded(pv, factor, acc, PV_FP8: gl.constexpr):
    """acc after a tile's waited P^ V^: with PV_FP8 acc (already times alpha) plus the tile's
    product times its factor in one fma (`flash._fwd_inner`'s FOLD), else the product itself,
    which accumulated inside the dot."""
    if PV_FP8:
        acc = gl.fma(pv, factor, acc)
    else:
        acc = pv
    return acc


@gluon.jit
def _pv(p_op, v_ring, slot, acc, zero_o, PV_FP8: gl.constexpr):
    """Issue P^ V^ of the V tile in ring slot `slot`: with PV_FP8 on the FP8 tensor cores,
    p_op P^'s shared buffer, from zero (each tile's product is added to acc in fp32 after,
    `flash._fwd_inner`'s FOLD), V's key-major tile transposed in place; else p_op the
    register operand, accumulated into acc (ACC_DOT)."""
    if PV_FP8:
        return warpgroup_mma(p_op, v_ring.index(slot).permute((1, 0)), zero_o, use_acc=False,
                             is_async=True)
    return warpgroup_mma(p_op, v_ring.index(slot), acc, is_async=True)


@gluon.jit
def attn_fwd(q_desc, k_desc, v_desc, o_desc, LSE, QF, KF, VF, qk_scale, H, G, S,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             CAUSAL: gl.constexpr, STAGES: gl.constexpr, LSE_LOG2: gl.constexpr,
             EQ_LO: gl.constexpr, EQ_HI: gl.constexpr, E_UNIT: gl.constexpr,
             E_MAX: gl.constexpr, SQ_LO: gl.constexpr, SQ_HI: gl.constexpr,
             S_UNIT: gl.constexpr, S_MAX: gl.constexpr, E_LO: gl.constexpr, E_HI: gl.constexpr,
             QBLOCK: gl.constexpr, RULE: gl.constexpr, ARITH: gl.constexpr,
             TENSOR: gl.constexpr, EMAX_E: gl.constexpr, UNITS: gl.constexpr,
             ACC_FACTOR: gl.constexpr, PV_FP8: gl.constexpr, LIFT: gl.constexpr,
             LAZY: gl.constexpr, LAZY_LOG2: gl.constexpr, HW: gl.constexpr,
             REVERSE: gl.constexpr, num_warps: gl.constexpr):
    """One 128-row query tile of one (batch, query head) (program ids: the query tile, longest
    first when causal, and b H + h): O into o_desc's rows (b H + h) S + m, the log-sum-exp
    into LSE (B H S, natural units, or log2 with LSE_LOG2). q_desc, o_desc: (B H S, D) rows;
    k_desc: (B Hkv S, D) rows, Hkv = H / G; v_desc the same, or with PV_FP8 V key-major
    E4M3, (B Hkv D, S); QF (B H,), KF and VF (B Hkv,) fp32. PV_FP8: P cast to E4M3
    (`_softmax_fp8`), P^ V^ on the FP8 tensor cores from zero and added to acc times alpha
    by one fma with the factor 1 / LIFT; else a block-format P (`_softmax_tile`) whose
    products accumulate in the dot. REVERSE: key tiles last to first."""
    n_q = S // BLOCK_M
    if CAUSAL:
        start_m = n_q - 1 - gl.program_id(0)
    else:
        start_m = gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    kvh = b * (H // G) + (bh % H) // G
    q_row = bh * S + start_m * BLOCK_M
    k_row = kvh * S
    if CAUSAL:
        n_tiles = (start_m + 1) * BLOCK_M // BLOCK_N
    else:
        n_tiles = S // BLOCK_N
    qk_scale = qk_scale * gl.load(QF + bh) * gl.load(KF + kvh)
    out_factor = gl.load(VF + kvh)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    if PV_FP8:  # an FP8 product's K step is 32; P^ reaches it through shared memory
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 32])
        p_layout: gl.constexpr = s_layout  # (unused: no register operand)
    else:
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout,
                                                     k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM],
                                       k_desc.layout)
    if PV_FP8:  # key-major: a tile is V's HEAD_DIM rows of BLOCK_N keys
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, HEAD_DIM, BLOCK_N],
                                           v_desc.layout)
    else:
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM],
                                           v_desc.layout)
    if PV_FP8:
        p_smem = gl.allocate_shared_memory(
            gl.float8e4nv, [2, BLOCK_M, BLOCK_N],
            gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv))
    else:
        p_smem = q_smem  # (unused: P^ is the register operand)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        if i < n_tiles:
            _issue_kv(k_desc, v_desc, k_ring, v_ring, k_bars, v_bars, k_row, kvh,
                      _key_tile(i, n_tiles, REVERSE), i, BLOCK_N, HEAD_DIM, PV_FP8, 2)

    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    zero_o = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
    unit = gl.full([], 1.0, gl.float32)
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    diagonal = start_m * BLOCK_M  # the first key the causal mask can hide from a row here

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), zero_s, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    p_op, alpha, m_i, l_i, factor = _tile(
        s, m_i, l_i, qk_scale, offs_m, _key_tile(0, n_tiles, REVERSE) * BLOCK_N, diagonal,
        CAUSAL, BLOCK_M, BLOCK_N, s_layout, p_layout, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO,
        SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E, UNITS, PV_FP8,
        LIFT, LAZY, LAZY_LOG2, HW)
    if PV_FP8:
        _stage_p(p_smem, 0, p_op)
    for j in range(n_tiles - 1):
        slot = j % STAGES
        nslot = (j + 1) % STAGES
        mbarrier.wait(k_bars.index(nslot), ((j + 1) // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_ring.index(nslot).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        if j + STAGES < n_tiles:  # S_j (waited for last iteration) is done: K's slot refills
            _issue_kv(k_desc, v_desc, k_ring, v_ring, k_bars, v_bars, k_row, kvh,
                      _key_tile(j + STAGES, n_tiles, REVERSE), slot, BLOCK_N, HEAD_DIM,
                      PV_FP8, 0)
        # (with PV_FP8 acc alpha, rounded as `flash._fwd_inner`'s fma takes it)
        acc, unit = _rescaled(acc, alpha, factor, unit, UNITS, o_rows)
        mbarrier.wait(v_bars.index(slot), (j // STAGES) & 1)
        pv = _pv(_p_operand(p_op, p_smem, j % 2, PV_FP8), v_ring, slot, acc, zero_o, PV_FP8)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_{j+1}; P_j V_j runs on
        tile_factor = factor
        p_op, alpha, m_i, l_i, factor = _tile(
            s, m_i, l_i, qk_scale, offs_m, _key_tile(j + 1, n_tiles, REVERSE) * BLOCK_N,
            diagonal, CAUSAL, BLOCK_M, BLOCK_N, s_layout, p_layout, EQ_LO, EQ_HI, E_UNIT,
            E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR,
            EMAX_E, UNITS, PV_FP8, LIFT, LAZY, LAZY_LOG2, HW)
        if PV_FP8:  # into the buffer P_{j-1} V_{j-1}, waited for, read
            _stage_p(p_smem, (j + 1) % 2, p_op)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))  # P_j V_j
        acc = _folded(pv, tile_factor, acc, PV_FP8)
        if j + STAGES < n_tiles:  # V's slot refills
            _issue_kv(k_desc, v_desc, k_ring, v_ring, k_bars, v_bars, k_row, kvh,
                      _key_tile(j + STAGES, n_tiles, REVERSE), slot, BLOCK_N, HEAD_DIM,
                      PV_FP8, 1)
    last = n_tiles - 1
    acc, unit = _rescaled(acc, alpha, factor, unit, UNITS, o_rows)
    mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
    pv = _pv(_p_operand(p_op, p_smem, last % 2, PV_FP8), v_ring, last % STAGES, acc, zero_o,
             PV_FP8)
    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv,))
    acc = _folded(pv, factor, acc, PV_FP8)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
    mbarrier.invalidate(q_bar)

    empty = l_i == 0.0
    if UNITS:
        acc = acc * unit
    elif not PV_FP8:
        acc = acc * ACC_FACTOR
    l_o = gl.convert_layout(gl.where(empty, 1.0, l_i), o_rows)
    out = gl.where(gl.convert_layout(empty, o_rows)[:, None], 0.0, acc / l_o[:, None])
    out = out * out_factor
    lse = m_i + gl.log2(gl.where(empty, 1.0, l_i))
    if not LSE_LOG2:
        lse = lse * 0.6931471805599453
    lse = gl.where(empty, float("inf"), lse)
    gl.store(LSE + bh * S + offs_m, lse)
    q_smem.store(out.to(o_desc.dtype))  # Q's buffer, free now, stages O for its TMA store
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    tma.store_wait(pendings=0)
