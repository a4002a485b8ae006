"""Probe: does a Gluon forward with asynchronous wgmma overlap attention's softmax with its
products on the H200, where plain Triton 3.6 waits on every wgmma right after issuing it
(GPU_SESSION.md section 2)? The experiment `fp4lab.kernels.gluon_fwd` came from (session 28,
benchmarks/RESULTS.md), kept for its variants: bf16 P at 128 and 64 keys a tile, 2 to 4
stages, and OVERLAP off (every wgmma waited for at once, the same arithmetic). Not a part of
fp4lab: non-causal and causal, B H S D with S a multiple of 128, 128-row tiles, 8 warps; it
prints nothing but the JSON it writes.

Two P paths in one kernel (`P_NVFP4`):
- bf16 P (the plain flash forward): compared with SDPA's output and timed beside it and beside
  fp4lab's Triton kernel for `flash_bf16` on the same operands;
- the `nvfp4` recipe's P, quantized in registers by fp4lab's own `_quantize_p` as the
  integrated kernel does (`fp4lab.kernels._gluon_fwd_kernel`, whose bit-for-bit tests and
  benchmark are tests/kernels/test_gluon_fwd.py and benchmarks/bench_gluon_fwd.py): compared
  element by element with fp4lab's Triton kernel (with `FP4LAB_GLUON=0` set, that kernel is
  the Triton one; otherwise `attention_forward` takes the Gluon one for it). The first two
  runs (gpu-runs/2026-12-04-s28/probe1, probe2) got the second warpgroup's rows wrong: P^ was
  converted to the product's operand layout from the linear layout `_quantize_p`'s reshapes
  leave; now it goes back to the scores' layout first.

The loop (FlashAttention-3's intra-warpgroup order): S_{j+1} issued, acc rescaled, P_j V_j
issued, the wait for S_{j+1} alone, tile j+1's softmax while P_j V_j runs, then its wait. (The
first version waited for P_{j-1} V_{j-1} in the next iteration, across the loop's back edge:
ptxas then serializes every wgmma of the kernel, its C7514 note.) K and V stream through rings
of STAGES shared-memory buffers loaded by TMA.

    FP4LAB_GLUON=0 python benchmarks/gluon_fwd_probe.py --out DIR [--batch 4 --heads 16 \
        --seq 4096]

writes DIR/gluon_fwd_probe.json. Needs an sm_90 GPU and Triton's Gluon (3.6).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sys
import time

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fp4lab.kernels import backend
from fp4lab.kernels._gluon_fwd_kernel import _issue
from fp4lab.kernels.flash import LOG2E, _quantize_p, attention_forward
from fp4lab.recipes import resolve_recipe


@gluon.jit
def _p_tile(s, m_i, l_i, qk_scale, offs_m, start_n, MASK: gl.constexpr,
            P_NVFP4: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            s_layout: gl.constexpr, p_layout: gl.constexpr, EQ_LO: gl.constexpr,
            EQ_HI: gl.constexpr, E_UNIT: gl.constexpr, E_MAX: gl.constexpr,
            SQ_LO: gl.constexpr, SQ_HI: gl.constexpr, S_UNIT: gl.constexpr,
            S_MAX: gl.constexpr, E_LO: gl.constexpr, E_HI: gl.constexpr, QBLOCK: gl.constexpr,
            RULE: gl.constexpr, ARITH: gl.constexpr, TENSOR: gl.constexpr,
            EMAX_E: gl.constexpr):
    """One tile of scores s (unscaled products) to (P^ as P V's bf16 operand, alpha, m, l,
    the tile factor), in the Triton kernel's order for its recipe (`flash._fwd_inner`
    without Z_FMA: s times the scale, the running maximum, z = s - m, exp2, `_quantize_p`
    with UNITS for nvfp4; l rescaled by alpha plus the row sum of the unquantized P)."""
    qk = s * qk_scale
    if MASK:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        qk = gl.where(offs_n[None, :] <= offs_m[:, None], qk, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(qk, 1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(qk - m_new[:, None])
    if P_NVFP4:
        p_hat, factor = _quantize_p(
            p, 0, BLOCK_M, BLOCK_N, 2, 1.0, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT,
            S_MAX, E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E, False, 0, True,
        )
    else:
        p_hat = p
        factor = 1.0
    l_i = l_i * alpha + gl.sum(p, 1)
    # back into the scores' layout first (the same map: `_quantize_p`'s reshapes leave an
    # equal linear layout), so that P^ reaches P V's operand layout as the scores' does
    p_hat = gl.convert_layout(p_hat, s_layout, assert_trivial=True)
    return gl.convert_layout(p_hat.to(gl.bfloat16), p_layout), alpha, m_new, l_i, factor


@gluon.jit
def _rescaled(acc, alpha, factor, unit, P_NVFP4: gl.constexpr, o_rows: gl.constexpr):
    """acc times alpha before a tile's P V adds to it; with nvfp4's units (ACC_UNITS) also
    from the last tile's unit into this tile's factor: (acc, unit)."""
    if P_NVFP4:
        ratio = gl.div_rn(unit, factor)
        return acc * gl.convert_layout(alpha * ratio, o_rows)[:, None], factor
    return acc * gl.convert_layout(alpha, o_rows)[:, None], unit


@gluon.jit
def _fwd(q_desc, k_desc, v_desc, o_desc, QS, VF, S,
         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr,
         CAUSAL: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
         P_NVFP4: gl.constexpr,
         EQ_LO: gl.constexpr, EQ_HI: gl.constexpr, E_UNIT: gl.constexpr,
         E_MAX: gl.constexpr, SQ_LO: gl.constexpr, SQ_HI: gl.constexpr,
         S_UNIT: gl.constexpr, S_MAX: gl.constexpr, E_LO: gl.constexpr, E_HI: gl.constexpr,
         QBLOCK: gl.constexpr, RULE: gl.constexpr, ARITH: gl.constexpr,
         TENSOR: gl.constexpr, EMAX_E: gl.constexpr, num_warps: gl.constexpr):
    """One 128-row query tile. The loop over key tiles j (FlashAttention-3's intra-warpgroup
    order, hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp): S_{j+1} issued, acc rescaled, P_j V_j
    issued, wait for S_{j+1} only, tile j+1's softmax and P quantization while P_j V_j runs,
    then wait for it. Every wait is for a wgmma of the same iteration (ptxas serializes every
    wgmma of the kernel where a register of one still in flight across the loop's back edge
    is read). OVERLAP False: each wgmma waited for at once, the same arithmetic."""
    n_q = S // BLOCK_M
    if CAUSAL:  # the longest rows first
        start_m = n_q - 1 - gl.program_id(0)
    else:
        start_m = gl.program_id(0)
    bh = gl.program_id(1)
    q_row = bh * S + start_m * BLOCK_M
    k_row = bh * S
    if CAUSAL:
        n_tiles = (start_m + 1) * BLOCK_M // BLOCK_N
    else:
        n_tiles = S // BLOCK_N
    qk_scale = gl.load(QS + bh)

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_D], q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_D], v_desc.layout)
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
            _issue(k_desc, k_ring, k_bars, k_row + i * BLOCK_N, i)
            _issue(v_desc, v_ring, v_bars, k_row + i * BLOCK_N, i)

    offs_m = start_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=s_rows)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, layout=s_rows)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=s_rows)
    acc = gl.zeros([BLOCK_M, HEAD_D], gl.float32, layout=o_layout)
    unit = 1.0
    zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    diagonal = start_m * BLOCK_M  # the first key a causal tile masks

    # tile 0's scores and softmax
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), zero_s, use_acc=False,
                      is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    if CAUSAL and BLOCK_N > diagonal:
        p_op, alpha, m_i, l_i, factor = _p_tile(
            s, m_i, l_i, qk_scale, offs_m, 0, True, P_NVFP4, BLOCK_M, BLOCK_N, s_layout,
            p_layout, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI,
            QBLOCK, RULE, ARITH, TENSOR, EMAX_E)
    else:
        p_op, alpha, m_i, l_i, factor = _p_tile(
            s, m_i, l_i, qk_scale, offs_m, 0, False, P_NVFP4, BLOCK_M, BLOCK_N, s_layout,
            p_layout, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX, E_LO, E_HI,
            QBLOCK, RULE, ARITH, TENSOR, EMAX_E)

    for j in range(n_tiles - 1):
        slot = j % STAGES
        nslot = (j + 1) % STAGES
        mbarrier.wait(k_bars.index(nslot), ((j + 1) // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_ring.index(nslot).permute((1, 0)), zero_s, use_acc=False,
                          is_async=True)
        if not OVERLAP:
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            s = warpgroup_mma_init(s)
        if j + STAGES < n_tiles:  # S_j (last iteration's) is done: K's slot j refills
            _issue(k_desc, k_ring, k_bars, k_row + (j + STAGES) * BLOCK_N, slot)
        acc, unit = _rescaled(acc, alpha, factor, unit, P_NVFP4, o_rows)
        mbarrier.wait(v_bars.index(slot), (j // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_ring.index(slot), acc, is_async=True)
        if not OVERLAP:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = warpgroup_mma_init(acc)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))  # S_{j+1}; P_j V_j may run on
        start_n = (j + 1) * BLOCK_N
        if CAUSAL and start_n + BLOCK_N > diagonal:
            p_op, alpha, m_i, l_i, factor = _p_tile(
                s, m_i, l_i, qk_scale, offs_m, start_n, True, P_NVFP4, BLOCK_M, BLOCK_N,
                s_layout, p_layout, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX,
                E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E)
        else:
            p_op, alpha, m_i, l_i, factor = _p_tile(
                s, m_i, l_i, qk_scale, offs_m, start_n, False, P_NVFP4, BLOCK_M, BLOCK_N,
                s_layout, p_layout, EQ_LO, EQ_HI, E_UNIT, E_MAX, SQ_LO, SQ_HI, S_UNIT, S_MAX,
                E_LO, E_HI, QBLOCK, RULE, ARITH, TENSOR, EMAX_E)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))  # P_j V_j done
        if j + STAGES < n_tiles:  # V's slot j refills
            _issue(v_desc, v_ring, v_bars, k_row + (j + STAGES) * BLOCK_N, slot)

    last = n_tiles - 1
    acc, unit = _rescaled(acc, alpha, factor, unit, P_NVFP4, o_rows)
    mbarrier.wait(v_bars.index(last % STAGES), (last // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_ring.index(last % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    if P_NVFP4:
        acc = acc * unit
    vf = gl.load(VF + bh)
    out = acc / gl.convert_layout(l_i, o_rows)[:, None] * vf
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))
    mbarrier.invalidate(q_bar)
    q_smem.store(out.to(o_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, 0], q_smem)
    tma.store_wait(pendings=0)


def gluon_forward(q, k, v, qk_scale, vf, causal, pq=None, stages=2, block_n=128,
                  overlap=True, warps=8):
    """O of bf16 q, k, v (B, H, S, D), S a multiple of 128: qk_scale and vf fp32 (B H,) (the
    scores' scale in log2 units and V's factor, per head); `pq` the nvfp4 recipe's P
    quantizer or None (bf16 P); 128-row query tiles and `block_n`-key tiles; `overlap`:
    the softmax runs while the last tile's P V does (else every wgmma is waited for at
    once)."""
    B, H, S, D = q.shape
    block_m = 128
    if not all(x.is_contiguous() for x in (q, k, v)):
        raise ValueError("q, k, v must be contiguous (the descriptors view them as rows)")
    o = torch.empty(B, H, S, D, dtype=q.dtype, device=q.device)
    descs = []
    for x, rows in ((q, block_m), (k, block_n), (v, block_n), (o, block_m)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        descs.append(TensorDescriptor(x.reshape(B * H * S, D), [B * H * S, D], [D, 1],
                                      [rows, D], layout))
    nv = pq is not None
    pq = pq or backend.p_quantizer(resolve_recipe("nvfp4"))
    _fwd[(S // block_m, B * H)](
        *descs, qk_scale, vf, S, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_D=D,
        CAUSAL=causal, STAGES=stages, OVERLAP=overlap, P_NVFP4=nv,
        EQ_LO=pq.ELEM[0], EQ_HI=pq.ELEM[1], E_UNIT=pq.ELEM[2], E_MAX=pq.ELEM[3],
        SQ_LO=pq.SCALE[0], SQ_HI=pq.SCALE[1], S_UNIT=pq.SCALE[2], S_MAX=pq.SCALE[3],
        E_LO=pq.SCALE_POW2[0], E_HI=pq.SCALE_POW2[1], QBLOCK=pq.BLOCK, RULE=pq.RULE,
        ARITH=pq.ARITH, TENSOR=pq.TENSOR, EMAX_E=pq.EMAX_E,
        num_warps=warps, enable_fp_fusion=False,
    )
    return o


# (recipe, key tile, stages, overlap): bf16 P at 128 and 64 keys, nvfp4's at its 128
VARIANTS = (
    ("flash_bf16", 128, 2, False), ("flash_bf16", 128, 2, True), ("flash_bf16", 128, 3, True),
    ("flash_bf16", 64, 3, True), ("flash_bf16", 64, 4, True),
    ("nvfp4", 128, 2, False), ("nvfp4", 128, 2, True), ("nvfp4", 128, 3, True),
)


def _compare(got, want) -> dict:
    g, w = got.float(), want.float()
    return dict(
        rel_l2=((g - w).norm() / w.norm()).item(),
        max_abs=(g - w).abs().max().item(),
        equal_fraction=(got == want).float().mean().item(),
        nonfinite=int((~torch.isfinite(g)).sum().item()),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    B, H, S, D = args.batch, args.heads, args.seq, 128
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g).bfloat16()
               for _ in range(3))
    scale = 1.0 / math.sqrt(D)
    flops = lambda causal: 4 * B * H * S * S * D / (2 if causal else 1)  # noqa: E731
    rows = []
    bench = triton.testing.do_bench
    for causal in (False, True):
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                                 is_causal=causal)
        t_sdpa = bench(sdpa)
        want = sdpa()
        ones = torch.ones(B * H, device="cuda")
        qs = torch.full((B * H,), scale * LOG2E, device="cuda")
        for name in ("flash_bf16", "nvfp4"):
            recipe = resolve_recipe(name)
            pq = backend.p_quantizer(recipe)
            ops = backend.prepare_forward(q, k, v, recipe, 128, 128, scale)
            options = dict(causal=causal, scale=scale, block_m=128, block_n=128, num_warps=8,
                           num_stages=3, **backend.forward_options(recipe, causal, v))
            triton_call = functools.partial(attention_forward, ops["q"], ops["k"], ops["v"],
                                            ops["factors"], pq, **options)
            t_triton = bench(triton_call)
            o_triton = triton_call()[0]
            if name == "nvfp4":
                qf, kf, vf = (f.to(torch.float32).reshape(-1) for f in ops["factors"])
                qk_scale = (torch.tensor(scale * LOG2E, device="cuda") * qf) * kf
                gq, gk, gv = (ops[x].contiguous() for x in "qkv")  # (a copy, not timed)
                gpq = pq
                layouts = {x: (tuple(ops[x].shape), ops[x].stride()) for x in "qkv"}
            else:
                qk_scale, vf, gq, gk, gv, gpq = qs, ones, q, k, v, None
                layouts = {}
            for recipe_name, block_n, stages, overlap in VARIANTS:
                if recipe_name != name:
                    continue
                call = functools.partial(gluon_forward, gq, gk, gv, qk_scale, vf, causal, gpq,
                                         stages, block_n, overlap)
                what = dict(causal=causal, recipe=name, block_n=block_n, stages=stages,
                            overlap=overlap)
                t0 = time.time()
                try:
                    o = call()
                    torch.cuda.synchronize()
                except Exception as err:  # a probe records what failed and goes on
                    rows.append(dict(**what, error=f"{type(err).__name__}: {err}"[-2000:]))
                    continue
                compile_s = time.time() - t0
                t = bench(call)
                rows.append(dict(
                    **what, compile_s=compile_s, operand_layouts=layouts,
                    sdpa_ms=t_sdpa, triton_ms=t_triton, gluon_ms=t,
                    sdpa_tflops=flops(causal) / t_sdpa / 1e9,
                    triton_x_sdpa=t_sdpa / t_triton, gluon_x_sdpa=t_sdpa / t,
                    gluon_vs_triton=_compare(o, o_triton),
                    gluon_vs_sdpa=_compare(o, want), triton_vs_sdpa=_compare(o_triton, want),
                ))
            (args.out / "gluon_fwd_probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
