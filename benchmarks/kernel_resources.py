"""What the compiled attention kernels cost in resources, per recipe and configuration.

For each recipe and (tiles, warps, stages) of `bench_attention_gpu.CONFIGS`, the forward with
the trace off and on, and (unless --no-backward) the backward's dK/dV and dQ kernels of a
causal call at each of `BACKWARD_TILES` with the backend's launch defaults: the registers per
thread and spills (`CompiledKernel.n_regs`, `n_spills`), the shared memory, and counts read
from the compiled code (layout conversions and shared-memory buffers in the TTGIR; wgmma
instructions, barriers, E4M3 conversions and lines in the PTX). Registers at the 255 cap with
spills say where a kernel runs out of room (the traced kernels, 2026-12-02: up to 226 spilled).
It reads Triton's in-process kernel cache (`JITFunction.device_caches`, triton 3.6), so it
needs a GPU. Writes `kernel_resources.json` (and each kernel's TTGIR with --ttgir) under --out.

    python benchmarks/kernel_resources.py --recipes exact nvfp4 fa4fp4_causal --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_gpu import BACKWARD_TILES, CONFIGS, kernel_call  # noqa: E402

import fp4lab  # noqa: E402
from fp4lab.kernels.flash import _attn_fwd  # noqa: E402
from fp4lab.kernels.flash_bwd import _attn_bwd_dkdv, _attn_bwd_dq  # noqa: E402
from fp4lab.recipes import resolve_recipe  # noqa: E402


def compiled(kernel) -> dict:
    """A jitted kernel's compiled variants in this process, by cache key."""
    return kernel.device_caches[torch.cuda.current_device()][0]


def resources(compiled_kernel, **labels) -> dict:
    """One compiled kernel's registers, spills, shared memory and code counts (`labels`, which
    may name the kernel, first)."""
    kernel = compiled_kernel
    if not hasattr(kernel, "n_regs"):  # triton 3.6 loads a kernel's handles (and these) lazily
        kernel._init_handles()
    ttgir, ptx = kernel.asm.get("ttgir", ""), kernel.asm.get("ptx", "")
    return dict(
        **labels, registers=kernel.n_regs, spills=kernel.n_spills,
        shared_bytes=kernel.metadata.shared, convert_layout=ttgir.count("convert_layout"),
        local_alloc=ttgir.count("local_alloc"), wgmma=ptx.count("wgmma.mma_async"),
        barriers=ptx.count("bar.sync"), e4m3_cvt=ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
        ptx_lines=ptx.count(";\n"),
    )  # fmt: skip


def new_variants(kernels, run) -> list:
    """(kernel name, compiled kernel) of each variant `run()` compiled or loaded."""
    before = {k.fn.__name__: set(compiled(k)) for k in kernels}
    run()
    torch.cuda.synchronize()
    return [(k.fn.__name__, compiled(k)[key]) for k in kernels
            for key in set(compiled(k)) - before[k.fn.__name__]]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["exact", "nvfp4", "fa4fp4_causal"])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ttgir", action="store_true", help="also write each kernel's TTGIR")
    parser.add_argument("--no-backward", action="store_true", help="the forward's kernels only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 1024, 128, device="cuda", generator=g).bfloat16()
                   for _ in range(4))  # fmt: skip
    rows = []

    def emit(row: dict, kernel, stem: str) -> None:
        rows.append(row)
        print(row, flush=True)
        if args.ttgir:
            with open(os.path.join(args.out, f"{stem}.ttgir"), "w") as f:
                f.write(kernel.asm.get("ttgir", ""))

    for name in args.recipes:
        recipe = resolve_recipe(name)
        for (bm, bn, warps, stages), traced in ((c, t) for c in CONFIGS for t in (False, True)):
            run = kernel_call(recipe, q, k, v, False, bm, bn, warps, stages, traced)
            for kname, kernel in new_variants([_attn_fwd], run):
                tiles = f"{bm}x{bn} w{warps} s{stages}"
                emit(resources(kernel, recipe=name, kernel=kname, tiles=tiles, traced=traced),
                     kernel, f"{name}_{bm}x{bn}_w{warps}{'_traced' if traced else ''}")
        if args.no_backward:
            continue
        for bm, bn in BACKWARD_TILES:  # the whole call at the backend's launch defaults
            def run(bm=bm, bn=bn, recipe=recipe):
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                fp4lab.attention(*leaves, recipe, causal=True, backend="triton", block_m=bm,
                                 block_n=bn).backward(do)  # fmt: skip

            for kname, kernel in new_variants([_attn_bwd_dkdv, _attn_bwd_dq], run):
                emit(resources(kernel, recipe=name, kernel=kname, tiles=f"{bm}x{bn}",
                               traced=False), kernel, f"{name}_{kname}_{bm}x{bn}")  # fmt: skip
    with open(os.path.join(args.out, "kernel_resources.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
