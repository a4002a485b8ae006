"""Launch variants of the Triton forward kernel alone, each beside bf16 SDPA in the same run.

Issue 9's NVFP4 forward goal (at least 0.5x SDPA at B4 H16 S4096 D128 bf16) asks where the
kernel's time goes; this script times one recipe's forward kernel on operands prepared once
(as `bench_attention_gpu.py`'s kernel rows: `kernel_call`) over tiles, warps, stages and
variants of how it is compiled, each variant first checked against the simulation path on a
slice (B1 H2 S1024, the same tiles: relative L2 of the output), with the compiled kernel's
registers and spills:

- ``base``: the kernel as the backend compiles it;
- ``noacc``: without ACC_DOT for P with a per-tile tensor scale (`flash._accumulate_in_dot`
  as it was before ACC_UNITS: each tile's P^ V^ from zero, then acc alpha + pv factor);
- ``regN``: ``base`` with Triton's register cap (``maxnreg``) at N a thread: fewer registers
  let more programs share an SM (65536 registers; 128 threads at 255 registers fit two),
  the overlap of one program's softmax with another's tensor-core work that a Triton kernel
  on Hopper has (its wgmma waits before the scores' first use).

    python benchmarks/bench_fwd_launch.py [--recipes nvfp4 ...] [--configs 64x64:4:3 ...]
        [--variants base noacc reg168 ...] [--causal both|true|false] [--out DIR]

Rows go to DIR/bench_fwd_launch.json as they come (a killed run keeps its rows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_gpu import _config, check, kernel_call  # noqa: E402

from fp4lab.kernels import flash  # noqa: E402
from fp4lab.recipes import resolve_recipe  # noqa: E402

SHAPE = dict(B=4, H=16, S=4096, D=128)
LAST = {}  # the last launched forward kernel's registers and spills


@contextlib.contextmanager
def variant(name: str):
    """The compilation variant `name` (module docstring) for the calls inside."""
    launch, accumulate = flash.launch_fitting, flash._accumulate_in_dot
    cap = int(name[3:]) if name.startswith("reg") else None

    def launch_recorded(kernel, grid, args, constants):
        extra = {} if cap is None else {"maxnreg": cap}
        compiled = kernel[grid](*args, **constants, **extra)
        if kernel is flash._attn_fwd and compiled is not None:  # None under the interpreter
            compiled._init_handles()
            LAST.update(registers=compiled.n_regs, spills=compiled.n_spills)

    def no_units(pq, per_tile, fp8, fixed):
        return {} if not pq.constant_factor else accumulate(pq, per_tile, fp8, fixed)

    if name not in ("base", "noacc") and cap is None:
        raise SystemExit(f"a variant is base, noacc or regN (N registers), got {name!r}")
    flash.launch_fitting = launch_recorded
    if name == "noacc":
        flash._accumulate_in_dot = no_units
    try:
        yield
    finally:
        flash.launch_fitting, flash._accumulate_in_dot = launch, accumulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["nvfp4"])
    parser.add_argument("--configs", nargs="+", metavar="BMxBN:W:S",
                        default=["64x64:4:3", "128x128:8:3"])  # fmt: skip
    parser.add_argument("--variants", nargs="+", default=["base", "noacc"])
    parser.add_argument("--causal", choices=("both", "true", "false"), default="both")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    configs = [_config(text) for text in args.configs]
    masks = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    os.makedirs(args.out, exist_ok=True)
    b, h, s, d = SHAPE["B"], SHAPE["H"], SHAPE["S"], SHAPE["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16() for _ in range(3))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"forward kernel alone, B{b} H{h} S{s} D{d} bf16; check on B1 H2 S1024")
    rows = []
    for causal in masks:
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        sdpa = triton.testing.do_bench(
            lambda c=causal: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c)
        )
        print(f"sdpa causal={causal}: {sdpa:.3f} ms ({flops / sdpa / 1e9:.0f} TFLOP/s)", flush=True)
        for recipe in args.recipes:
            for bm, bn, warps, stages in configs:
                for name in args.variants:
                    row = dict(recipe=recipe, causal=causal, tiles=f"{bm}x{bn} w{warps} s{stages}",
                               variant=name, sdpa_ms=sdpa)  # fmt: skip
                    try:
                        with variant(name):
                            err = check(resolve_recipe(recipe), causal, bm, bn)
                            call = kernel_call(resolve_recipe(recipe), q, k, v, causal, bm, bn,
                                               warps, stages)  # fmt: skip
                            ms = triton.testing.do_bench(call)
                        row.update(ms=ms, x_sdpa=sdpa / ms, check=err, **LAST)
                    except Exception as error:  # a variant that does not compile or fit
                        row.update(ms=math.nan, x_sdpa=math.nan, check=math.nan,
                                   error=f"{type(error).__name__}: {str(error)[:200]}")
                    rows.append(row)
                    print(
                        f"{recipe:16s} {str(causal):6s} {row['tiles']:16s} {name:8s} "
                        f"{row['ms']:8.3f} {row['x_sdpa']:7.3f} {row['check']:8.1e} "
                        f"regs {row.get('registers', '-')} spills {row.get('spills', '-')} "
                        f"{row.get('error', '')}",
                        flush=True,
                    )
                    with open(os.path.join(args.out, "bench_fwd_launch.json"), "w") as f:
                        json.dump({"shape": SHAPE, "device": torch.cuda.get_device_name(),
                                   "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
