"""What the compiled forward kernel costs in resources, per recipe and launch configuration.

For each recipe and (tiles, warps, stages) of `bench_attention_gpu.CONFIGS`, with the trace off
and on: the registers per thread and spills (`CompiledKernel.n_regs`, `n_spills`), the shared
memory, and counts read from the compiled code (layout conversions and shared-memory buffers
in the TTGIR; wgmma instructions, barriers, E4M3 conversions and lines in the PTX). Registers
at the 255 cap with spills say where a kernel runs out of room (the traced kernels,
2026-12-02: up to 226 spilled).
It reads Triton's in-process kernel cache (`JITFunction.device_caches`, triton 3.6), so it
needs a GPU. Writes `kernel_resources.json` (and each nvfp4 kernel's TTGIR with --ttgir) under
--out.

    python benchmarks/kernel_resources.py --recipes exact nvfp4 fa4fp4_causal --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_gpu import CONFIGS, kernel_call  # noqa: E402

from fp4lab.kernels.flash import _attn_fwd  # noqa: E402
from fp4lab.recipes import resolve_recipe  # noqa: E402


def compiled() -> dict:
    """The forward kernel's compiled variants in this process, by cache key."""
    return _attn_fwd.device_caches[torch.cuda.current_device()][0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["exact", "nvfp4", "fa4fp4_causal"])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--ttgir", action="store_true", help="also write each kernel's TTGIR")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 128, device="cuda", generator=g).bfloat16()
               for _ in range(3))  # fmt: skip
    rows = []
    for name in args.recipes:
        recipe = resolve_recipe(name)
        for (bm, bn, warps, stages), traced in ((c, t) for c in CONFIGS for t in (False, True)):
            before = set(compiled())
            kernel_call(recipe, q, k, v, False, bm, bn, warps, stages, traced)()
            torch.cuda.synchronize()
            for key in set(compiled()) - before:
                kernel = compiled()[key]
                ttgir, ptx = kernel.asm.get("ttgir", ""), kernel.asm.get("ptx", "")
                row = dict(
                    recipe=name, tiles=f"{bm}x{bn} w{warps} s{stages}", traced=traced,
                    registers=kernel.n_regs, spills=kernel.n_spills,
                    shared_bytes=kernel.metadata.shared,
                    convert_layout=ttgir.count("convert_layout"),
                    local_alloc=ttgir.count("local_alloc"),
                    wgmma=ptx.count("wgmma.mma_async"), barriers=ptx.count("bar.sync"),
                    e4m3_cvt=ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
                    ptx_lines=ptx.count(";\n"),
                )  # fmt: skip
                rows.append(row)
                print(row, flush=True)
                if args.ttgir:
                    suffix = "_traced" if traced else ""
                    path = os.path.join(args.out, f"{name}_{bm}x{bn}_w{warps}{suffix}.ttgir")
                    with open(path, "w") as f:
                        f.write(ttgir)
    with open(os.path.join(args.out, "kernel_resources.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
