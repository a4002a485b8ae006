"""Compile the attention kernels for a Hopper GPU on a machine without one, and report what
each compiled kernel costs: compile time, registers, spills, shared memory.

Why. Device time is scarce (30 minutes a session) and a kernel that does not compile, or
compiles for minutes, or spills, is found here for free. Triton's wheel carries ptxas and
cuobjdump, so the whole pipeline (TTIR, TTGIR, LLVM IR, PTX, cubin) runs on a CPU; only
loading and launching need the GPU.

How. Inside `compile_only()`:
- Triton's active driver is a stand-in that names an sm_90 target (`--arch`) and device 0;
- every `JITFunction.run` compiles and returns without launching (`warmup=True`), and each
  kernel compiled anew is recorded with its compile time and, from `cuobjdump
  -res-usage` on its cubin, its registers per thread, its local memory (stack frame and
  the rest: Triton's n_spills is their sum over 4) and shared memory;
- `fp4lab.kernels.quantize._kernel_device` accepts CPU tensors (and its planned launches go
  through `triton.jit`, not a compiled kernel's own launcher), so fp4lab's host code runs
  as it would on the GPU (bf16 operands, the FP8 P V path, `flash.HW_E4M3` on as on sm_89+)
  and launches every kernel a call needs. Its outputs are never written: what the host
  computes from them afterwards is garbage and is ignored.

The figures are those of the Triton installed here: to match the H200's (triton 3.6,
../shared/GPU.md), put that version first on the path, e.g. `pip install --target /tmp/t36
triton==3.6.0` and `PYTHONPATH=/tmp/t36`. Compile times are this machine's (2 cores here;
the H200's host compiles several at once). Registers and spills are the compiler's and do
not depend on the machine.

    PYTHONPATH=/tmp/t36:$PWD python benchmarks/compile_offline.py \\
        --recipes fa4fp4_causal nvfp4 --tiles 128x128:8:3 [--backward] [--trace] --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_attention_gpu import _config  # noqa: E402  (BMxBN:W:S, as the bench reads it)

_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
H200_SHARED_BYTES = 232448  # dynamic shared memory a block may take on sm_90 (227 KiB)


class _CompileOnlyDriver:
    """Triton's driver where there is no GPU: the target to compile for, device 0, stream 0.
    Anything that would load or launch a kernel is not here, and fails loudly."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def set_current_device(self, device):
        pass


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """What the cuobjdump in Triton's wheel prints for a cubin with `flag`."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def resource_usage(cubin: bytes) -> dict:
    """registers per thread, spills and static shared bytes of a cubin, read by the cuobjdump
    in Triton's wheel. spills is Triton's `n_spills`, a thread's local memory (the CUDA
    driver's LOCAL_SIZE_BYTES: ptxas's stack frame, where it spills, plus any other local
    memory) over 4; both parts are kept."""
    text = _cuobjdump(cubin, "-res-usage")
    match = _RESOURCES.search(text)
    if match is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no resource line: {text[:500]!r}")
    reg, stack, shared, local = (int(x) for x in match.groups())
    return dict(registers=reg, spills=(stack + local) // 4, stack_bytes=stack, local_bytes=local,
                static_shared=shared)


_BRANCH = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+@!?U?P\d BRA 0x([0-9a-f]+)")
_INSTRUCTION_BYTES = 16  # sm_70 and later


def loop_instructions(cubin: bytes) -> list[int]:
    """The instructions in each loop body of a cubin's SASS (cuobjdump -sass), in code order:
    from a conditional branch backwards to its target. The issue slots a thread spends on
    one iteration of its key loop outside the dots: a change to the per-element arithmetic
    shows here before any GPU time (on the H200 the forward's time moved with these counts,
    though by less: RESULTS.md, "Session 21"). Straight-line count, the loop's own branches
    and any slow path it jumps over included."""
    text = _cuobjdump(cubin, "-sass")
    loops = []
    for match in _BRANCH.finditer(text):
        here, target = int(match.group(1), 16), int(match.group(2), 16)
        if target < here:
            loops.append((here - target) // _INSTRUCTION_BYTES + 1)
    return loops


@contextlib.contextmanager
def compile_only(arch: int = 90):
    """Within: kernels compile for sm_`arch` and never launch; yields the list to which each
    kernel compiled anew is appended as a dict (kernel, seconds, registers, spills, shared
    memory, whether that fits an H200 block, E4M3 conversions and wgmma in its PTX, the
    instructions of each loop body in its SASS)."""
    from fp4lab.kernels import quantize

    records: list[dict] = []
    saved_run, saved_device = JITFunction.run, quantize._kernel_device
    saved_direct = os.environ.get("FP4LAB_DIRECT_LAUNCH")
    saved_driver = triton.runtime.driver._active

    def run(self, *args, grid, warmup, **kwargs):
        before = sum(len(cache[0]) for cache in self.device_caches.values())
        start = time.perf_counter()
        kernel = saved_run(self, *args, grid=grid, warmup=True, **kwargs)
        seconds = time.perf_counter() - start
        if sum(len(cache[0]) for cache in self.device_caches.values()) > before:
            ptx = kernel.asm.get("ptx", "")
            shared = kernel.metadata.shared
            records.append(dict(
                kernel=self.fn.__name__, seconds=round(seconds, 2),
                num_warps=kernel.metadata.num_warps, num_stages=kernel.metadata.num_stages,
                **resource_usage(kernel.asm["cubin"]), shared_bytes=shared,
                fits_shared=shared <= H200_SHARED_BYTES,
                e4m3_cvt=ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
                wgmma=ptx.count("wgmma.mma_async"),
                loop_instructions=loop_instructions(kernel.asm["cubin"]),
            ))  # fmt: skip
        return kernel

    triton.runtime.driver.set_active(_CompileOnlyDriver(arch))
    JITFunction.run = run
    quantize._kernel_device = lambda x: True
    os.environ["FP4LAB_DIRECT_LAUNCH"] = "0"  # every launch through triton.jit, never the
    # compiled kernel called directly (`fp4lab.kernels.launch`), which cannot launch here
    try:
        yield records
    finally:
        JITFunction.run, quantize._kernel_device = saved_run, saved_device
        if saved_direct is None:
            os.environ.pop("FP4LAB_DIRECT_LAUNCH", None)
        else:
            os.environ["FP4LAB_DIRECT_LAUNCH"] = saved_direct
        triton.runtime.driver._active = saved_driver


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["fa4fp4_causal", "nvfp4"])
    parser.add_argument(
        "--tiles", nargs="+", default=["128x128:8:3"], metavar="BMxBN:W:S",
        help="tiles, warps and stages, the forward's and the backward's (flash.launch_fitting "
        "drops stages that do not fit, as on the GPU)",
    )  # fmt: skip
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--trace", action="store_true", help="the traced kernels instead")
    parser.add_argument("--backward", action="store_true", help="the backward's kernels too")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)

    import triton.language as tl

    import fp4lab
    from fp4lab.kernels import backend, flash

    flash.HW_E4M3 = tl.constexpr(flash._hardware_e4m3(divmod(args.arch, 10)))  # as on the GPU
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, args.seq, 128, generator=g).bfloat16() for _ in range(4))
    rows = []
    print(f"triton {triton.__version__}, sm_{args.arch}, B1 H2 S{args.seq} D128 bf16, "
          f"causal {args.causal}, trace {args.trace}", flush=True)  # fmt: skip
    for name in args.recipes:
        for bm, bn, warps, stages in map(_config, args.tiles):
            backend.LAUNCH["forward"] = (warps, stages)
            backend.LAUNCH["backward"] = (warps, stages)
            leaves = [x.clone().requires_grad_(args.backward) for x in (q, k, v)]
            with compile_only(args.arch) as records:
                try:
                    trace = fp4lab.Trace() if args.trace else None
                    out = fp4lab.attention(*leaves, name, backend="triton", causal=args.causal,
                                           block_m=bm, block_n=bn, trace=trace,
                                           generator=0)  # fmt: skip
                    if args.backward:
                        out.backward(do)
                    error = ""
                except Exception as exc:  # noqa: BLE001 - reported as the row's outcome
                    error = f"{type(exc).__name__}: {str(exc)[:300]}"
            for record in records:
                row = dict(recipe=name, tiles=f"{bm}x{bn}", **record)
                rows.append(row)
                print(row, flush=True)
            if error:
                rows.append(dict(recipe=name, tiles=f"{bm}x{bn}", error=error))
                print(f"{name} {bm}x{bn}: {error}", flush=True)
    backend.LAUNCH.update(forward=None, backward=None)
    with open(os.path.join(args.out, "compile_offline.json"), "w") as f:
        json.dump(dict(triton=triton.__version__, arch=args.arch, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
