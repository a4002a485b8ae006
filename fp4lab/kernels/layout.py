"""Operand layouts the attention kernels read: V with its keys contiguous, for FP8 P V.

FP8 matrix instructions on Hopper take their B operand K-major, so where P V runs on the FP8
tensor cores the forward reads V^ (B, Hkv, Sk, Dv) stored transposed, keys contiguous.
`key_major` makes that copy in one Triton pass over the bytes (a tile loaded, transposed in
registers and stored along the keys) where torch's transposing `contiguous()` took 0.2 ms of
a 1.7 ms call at B4 H16 S4096 D128 on the H200 (torch.profiler, 2026-12-02). It moves bits
only: the result equals `x.transpose(-1, -2).contiguous().transpose(-1, -2)` element for
element, whatever the values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fp4lab.kernels.launch import launch

__all__ = ["key_major"]


@triton.jit
def _transpose_kernel(Src, Dst, S, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Dst[n, d, s] = Src[n, s, d] for one (BLOCK_S, BLOCK_D) tile of matrix n (both
    row-major, int8 bits)."""
    n = tl.program_id(2).to(tl.int64)
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    inside = (offs_s[:, None] < S) & (offs_d[None, :] < D)
    tile = tl.load(Src + n * S * D + offs_s[:, None] * D + offs_d[None, :], mask=inside)
    out = Dst + n * S * D + offs_d[:, None] * S + offs_s[None, :]
    tl.store(out, tl.trans(tile), mask=tl.trans(inside))


def key_major(x: torch.Tensor) -> torch.Tensor:
    """x (..., S, D), a contiguous tensor of one-byte elements (float8 or int8), as the same
    values stored with its S axis contiguous: a (..., S, D) view of a (..., D, S) contiguous
    tensor, strides (..., 1, S)."""
    if x.element_size() != 1 or not x.is_contiguous() or x.ndim < 2:
        raise ValueError(
            f"key_major: x must be a contiguous tensor of one-byte elements with at least 2 "
            f"dims, got {x.dtype} {tuple(x.shape)} (contiguous: {x.is_contiguous()})"
        )
    *lead, S, D = x.shape
    out = torch.empty(*lead, D, S, dtype=x.dtype, device=x.device)
    n = x.numel() // max(S * D, 1)
    if x.numel():
        block_s, block_d = 64, min(128, triton.next_power_of_2(D))
        grid = (triton.cdiv(S, block_s), triton.cdiv(D, block_d), n)
        launch(_transpose_kernel, grid, (x.view(torch.int8), out.view(torch.int8), S, D),
               dict(BLOCK_S=block_s, BLOCK_D=block_d), {})
    return out.transpose(-1, -2)
