"""The forward of block-format P and FP8 P/V recipes on Hopper, its products overlapped (Gluon).

What. `fp4lab.kernels.flash.attention_forward` runs this kernel in place of its Triton one
where `unsupported` returns None: an H200 (sm_90) with Triton's Gluon, and P either a block
format rounded to nearest that the Triton kernel accumulates inside its product (`nvfp4`,
`mxfp4`: `flash._accumulate_in_dot`), or P cast to E4M3 with V key-major E4M3 on the FP8
tensor cores (`fa4fp4_causal`, `fa3_fp8`, `fp8_per_tensor`; not causal, where it measured no
faster); no instrumentation and none of the mechanisms the kernel does not have, bf16 Q and K
contiguous as (B, H, S, D) with D = 128, one sequence length S, a multiple of the 128 x 128
tiles, GQA allowed. The arithmetic is the Triton kernel's, step for step
(`fp4lab.kernels._gluon_fwd_kernel`); on the H200 the two give the same O and log-sum-exp bit
for bit (tests/kernels/test_gluon_fwd.py, GPU only). `FP4LAB_GLUON=0` turns it off.

Why. Plain Triton 3.6 waits on every wgmma right after issuing it, so the forward's loop runs
one dependent chain (scores, softmax, P's quantization, P V) with nothing overlapping it; NVFP4
P, whose tile-wide amax spans both warpgroups, cannot use warpgroup ping-pong either. Gluon's
asynchronous wgmma lets the kernel issue the next tile's scores before this tile's P V and run
the softmax while P V is on the tensor cores (FlashAttention-3's intra-warpgroup pipelining).
Measured in benchmarks/RESULTS.md ("Session 28"), which also says what was tried and not
kept: the loads in a warp of their own (FlashAttention-3's producer warp; the same bits and
times, commit 54cc3e1) and the probe the kernel came from (bf16 P variants, commit 45df220's
benchmarks/gluon_fwd_probe.py).
"""

from __future__ import annotations

import functools
import os

import torch

from fp4lab.kernels.flash import LOG2E, PQuantizer, _accumulate_in_dot
from fp4lab.kernels.launch import launch, static_key

BLOCK = 128  # the kernel's query and key tile
HEAD_DIM = 128
NUM_WARPS = 8
STAGES = 2  # K and V ring buffers (measured best of 2 and 3 in the probe)


def enabled() -> bool:
    """Whether the Gluon forward may run at all: not switched off by FP4LAB_GLUON=0."""
    return os.environ.get("FP4LAB_GLUON", "1") != "0"


@functools.cache
def _device_ready(index: int) -> str | None:
    """None where CUDA device `index` is an sm_90 GPU and Triton's Gluon for Hopper imports,
    else why not."""
    if torch.cuda.get_device_capability(index) != (9, 0):
        return "not an sm_90 GPU"
    try:
        from fp4lab.kernels import _gluon_fwd_kernel  # noqa: F401
    except ImportError as err:  # a Triton without Gluon's Hopper API
        return f"Triton's Gluon for Hopper does not import ({err})"
    return None


# E4M3's grid as `PQuantizer.ELEM` holds it: the FP8 P V the kernel runs (`_fp8_p`)
_E4M3_GRID = (0.015625, 512.0, 0.125, 448.0)
# what each kind of P also takes of the forward's other arguments (`unsupported`'s extras)
_FP8_EXTRAS = frozenset({"lazy_log2", "reverse"})


def _fp8_p(pq: PQuantizer) -> bool:
    """Whether P is cast to E4M3 (and so meets V on the FP8 tensor cores): MODE 1 on E4M3's
    grid, rounded to nearest."""
    return pq.MODE == 1 and not pq.SR and tuple(pq.ELEM) == _E4M3_GRID


def unsupported(q, k, v, pq: PQuantizer, *, block_m: int, block_n: int, num_warps: int,
                out_dtype, extras: dict, scale: float = 1.0, causal: bool = False) -> str | None:
    """Why the Gluon forward does not take this call (None: it does), the call's own rules
    first and the device last (so that they are testable without a GPU). Two kinds of P:
    a block format rounded to nearest whose products accumulate inside the dot (nvfp4,
    mxfp4, ...), or P cast to E4M3 with V key-major E4M3 (`backend._key_major_fp8`), P V on
    the FP8 tensor cores (fa3_fp8, fa4fp4_causal, fp8_per_tensor), which also takes a lazy
    running maximum and the reversed key order, needs a positive `scale` (its z in one fma,
    `flash._z_in_one_fma`) and is not `causal` (on the H200 it ran no faster than the Triton
    kernel there, and slower for fa3_fp8: benchmarks/RESULTS.md, "Session 29"). `extras`
    holds the forward's other arguments as `attention_forward` received them (each must be
    its default, except those the FP8 kind takes: the trace, O', the saved references,
    smooth_q's scores, the leakage fix, a lazy or fixed row reference, the quantized row
    sum, the reversed key order, stochastic keys, a per-tile operand factor)."""
    if not enabled():
        return "FP4LAB_GLUON=0"
    fp8 = _fp8_p(pq)
    if fp8:
        if v.dtype != torch.float8_e4m3fn or not v.transpose(-1, -2).is_contiguous():
            return "P is E4M3 but V is not key-major E4M3 (P V on the FP8 tensor cores)"
        if not scale > 0:
            return f"scale {scale} (P's z in one fma needs it positive)"
        if causal:  # measured on the H200 (benchmarks/RESULTS.md, "Session 29"): no faster
            return "causal with E4M3 P (the Triton kernel is as fast: 0.84x against 0.78x-0.84x)"
    elif pq.MODE != 2 or pq.SR:
        return "P is not a block format rounded to nearest, nor E4M3 with E4M3 V"
    elif not _accumulate_in_dot(pq, False, False).get("ACC_DOT"):
        return "P's products do not accumulate inside the dot"
    busy = sorted(name for name, value in extras.items()
                  if value and not (fp8 and name in _FP8_EXTRAS))
    if busy:
        return f"arguments the Gluon forward does not take: {', '.join(busy)}"
    if (block_m, block_n, num_warps) != (BLOCK, BLOCK, NUM_WARPS):
        return f"tiles {block_m} x {block_n} at {num_warps} warps (it runs 128 x 128 at 8)"
    if any(x.dtype != torch.bfloat16 for x in (q, k, *(() if fp8 else (v,)))):
        return "q, k, v are not bf16"
    if out_dtype not in (None, q.dtype):
        return f"O in {out_dtype} (it writes q's dtype)"
    if not all(x.is_contiguous() for x in (q, k, *(() if fp8 else (v,)))):
        return "q, k, v are not contiguous"
    if any(x.data_ptr() % 16 for x in (q, k, v)):
        return "q, k, v do not start on 16 bytes (TMA's alignment)"
    (B, H, Sq, D), (Bk, Hk, Sk, Dk), Dv = q.shape, k.shape, v.shape[-1]
    if D != HEAD_DIM or Dk != D or Dv != D or v.shape[:3] != k.shape[:3] or Bk != B:
        return f"head dims {D}, {Dk}, {Dv} (it takes 128)"
    if Sq != Sk or Sq % BLOCK:
        return f"sequence lengths {Sq}, {Sk} (it takes one, a multiple of {BLOCK})"
    if H % Hk:
        return f"{H} query heads over {Hk} key heads"
    if not q.is_cuda:
        return "not on a GPU"
    return _device_ready(q.device.index if q.device.index is not None else 0)


def attention_forward(q, k, v, factors, pq: PQuantizer, *, causal: bool, scale: float,
                      lse_log2: bool, o=None, lse=None, lazy_log2: float | None = None,
                      reverse: bool = False):
    """(O, lse) as `flash.attention_forward` returns them, for a call `unsupported` admits:
    O (B, H, S, D) in q's dtype, lse (B, H, S) fp32, natural units unless `lse_log2`, into
    `o` and `lse` where given (contiguous, as `flash.attention_forward` allocates them).
    `factors`: Q's (B, H), K's and V's (B, Hkv) fp32 factors. With E4M3 P (V key-major
    E4M3), `lazy_log2` (the lazy running maximum's threshold, None: the running maximum)
    and `reverse` (key tiles last to first) as `flash.attention_forward` takes them. Launched
    through
    `fp4lab.kernels.launch` (after the first call of a signature, the compiled kernel
    directly), its constants made once per configuration."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fp4lab.kernels._gluon_fwd_kernel import attn_fwd

    B, H, S, D = q.shape
    Hk = k.shape[1]
    if o is None:
        o = torch.empty(B, H, S, D, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    layout = _shared_layout((BLOCK, D), q.dtype)
    rows = [x for x in (q, k, v, o) if x.dtype != torch.float8_e4m3fn]
    descs = [TensorDescriptor(x.view(-1, D), [x.numel() // D, D], [D, 1], [BLOCK, D], layout)
             for x in rows]
    fp8 = _fp8_p(pq)
    if fp8:  # V key-major: (B Hkv D, S) rows, a tile V's D rows of one head over BLOCK keys
        vt = v.transpose(-1, -2)
        descs.insert(2, TensorDescriptor(vt.view(-1, S), [vt.numel() // S, S], [S, 1],
                                         [D, BLOCK], _shared_layout((D, BLOCK), v.dtype)))
    qf, kf, vf = (f.to(torch.float32).contiguous() for f in factors)
    constants, options, static = _constants(pq, bool(causal), bool(lse_log2), D,
                                            None if lazy_log2 is None else float(lazy_log2),
                                            bool(reverse) and fp8)
    launch(attn_fwd, (S // BLOCK, B * H), (*descs, lse, qf, kf, vf, scale * LOG2E, H, H // Hk,
                                          S), constants, options, static=static)
    return o, lse


@functools.cache
def _shared_layout(block: tuple[int, int], dtype: torch.dtype):
    """The shared-memory layout of a `block` tile of `dtype`, for its TMA descriptors."""
    from triton.experimental.gluon import language as gl

    element = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
               torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), element)


@functools.lru_cache(maxsize=256)
def _constants(pq: PQuantizer, causal: bool, lse_log2: bool, d: int,
               lazy_log2: float | None = None, reverse: bool = False):
    """(constexprs, launch options, their `static_key`) of one configuration. HW: P's E4M3
    cast by the GPU's conversion, as `flash.HW_E4M3` decides for the Triton kernel."""
    from fp4lab.kernels.flash import HW_E4M3

    fp8 = _fp8_p(pq)
    accumulate = {} if fp8 else _accumulate_in_dot(pq, False, False)
    constants = dict(
        BLOCK_M=BLOCK, BLOCK_N=BLOCK, HEAD_DIM=d, CAUSAL=causal, STAGES=STAGES,
        LSE_LOG2=lse_log2,
        EQ_LO=pq.ELEM[0], EQ_HI=pq.ELEM[1], E_UNIT=pq.ELEM[2], E_MAX=pq.ELEM[3],
        SQ_LO=pq.SCALE[0], SQ_HI=pq.SCALE[1], S_UNIT=pq.SCALE[2], S_MAX=pq.SCALE[3],
        E_LO=pq.SCALE_POW2[0], E_HI=pq.SCALE_POW2[1], QBLOCK=pq.BLOCK, RULE=pq.RULE,
        ARITH=pq.ARITH, TENSOR=pq.TENSOR, EMAX_E=pq.EMAX_E,
        UNITS=accumulate.get("ACC_UNITS", False), ACC_FACTOR=accumulate.get("ACC_FACTOR", 1.0),
        PV_FP8=fp8, LIFT=pq.LIFT, LAZY=lazy_log2 is not None, LAZY_LOG2=lazy_log2 or 0.0,
        HW=bool(fp8 and HW_E4M3.value), REVERSE=reverse,
    )  # fmt: skip
    options = dict(num_warps=NUM_WARPS, enable_fp_fusion=False)
    return constants, options, static_key(constants, options)


__all__ = ["attention_forward", "enabled", "unsupported", "BLOCK"]
