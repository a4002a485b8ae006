"""How much Python the host runs per `fp4lab.attention(..., backend="triton")` call.

What. For each case (a recipe, causal or not, the forward alone or forward plus backward) the
script counts, under cProfile, the Python calls of one call after warm-up: all of them
(builtins and torch's included), those of fp4lab's own functions, and the tensor allocations
(`torch.empty`, `torch.zeros`, `torch.full`, `torch.ones`); and it times the host's own work per
call without the profiler (calls launched back to back, the GPU not waited for).

Why. On the H200's host an untraced causal call is bound by its host (benchmarks/GPU_SESSION.md,
section 2): the kernels take about 0.6 ms, the host 0.7 to 1.7 ms. Counting calls is stable
across machines where host times are not, so a change to the launch path is judged by both.

How. On a GPU the kernels run for real. Without one (`--stub`, the default there) Triton's
interpreter is on and every kernel launch is a no-op that returns a stand-in compiled kernel,
so `fp4lab.kernels.launch` takes its direct path after the first launch of a signature as it
does on a GPU, and the quantizers' launches take `quantize._run`'s GPU branch (a launch
through the kernel object) instead of the interpreter's: what is counted and timed is then
fp4lab's host code, torch's allocations and ops on small tensors, and nothing of the kernels.
The outputs of a stubbed call are garbage (never read). Differences from a GPU left: the
interpreter's store dtype (float32, not bf16), no key-major FP8 V (`backend._fp8_pv` is off
under the interpreter), and the quantizers' planned launches take `_run` (on a GPU
`launch.launch`, a few calls more). Shapes default to B4 H16 S4096 D128 on a GPU and
B1 H2 S256 D128 without one, where torch runs on one thread (the counts do not depend on the
shape; the CPU's torch ops do).

    python benchmarks/profile_host.py [--cases fa3_fp8/causal/fwd ...] [--calls 20]
        [--shape B H S D] [--out DIR] [--top 30]

Prints one row per case (calls per call, fp4lab's, allocations, host us per call); with --out
writes `profile_host.json` and each case's cProfile table (`<case>.host.txt`, `/` as `-`).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import inspect
import json
import os
import pstats
import statistics
import time
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # before triton is imported: kernels as interpreted functions
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fp4lab  # noqa: E402

RECIPES = ("fa4fp4_causal", "fa3_fp8", "nvfp4")
ALLOCATIONS = ("empty", "zeros", "full", "ones", "empty_like", "zeros_like", "full_like")


def case_names() -> list[str]:
    return [f"{r}/{c}/{p}" for r in RECIPES for c in ("plain", "causal") for p in ("fwd", "fwdbwd")]


class _NoKernel:
    """A stand-in compiled kernel: `compiled[grid](*args)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args: None


@contextlib.contextmanager
def stubbed_kernels():
    """Within: every interpreted kernel launch does nothing and returns a `_NoKernel`, and the
    quantizers' `_run` launches through the kernel object as on a GPU (module docstring)."""
    from triton.runtime.interpreter import InterpretedFunction

    from fp4lab.kernels import quantize

    def run(self, *args, grid, warmup, **kwargs):
        return _NoKernel()

    def run_quantizer(kernel, grid, args, num_warps, constants):
        kernel[grid](*args, num_warps=num_warps, enable_fp_fusion=False, **constants)

    def params(self):  # what `launch` reads of a JITFunction's parameters
        return [SimpleNamespace(name=p.name, default=None if p.default is p.empty else p.default)
                for p in inspect.signature(self.fn).parameters.values()]

    saved = InterpretedFunction.run, quantize._run
    InterpretedFunction.run, quantize._run = run, run_quantizer
    InterpretedFunction.params = property(functools.cache(params))
    try:
        yield
    finally:
        InterpretedFunction.run, quantize._run = saved
        del InterpretedFunction.params


def make_call(name: str, shape: tuple[int, int, int, int], device: str):
    """One call of case `name` as a closure."""
    recipe, causal, passes = name.split("/")
    b, h, s, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, generator=g).to(device, torch.bfloat16)
                   for _ in range(4))
    options = dict(causal=causal == "causal", backend="triton")
    if passes == "fwd":
        return lambda: fp4lab.attention(q, k, v, recipe, **options)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def forward_backward():
        out = fp4lab.attention(q, k, v, recipe, **options)
        return torch.autograd.grad(out, (q, k, v), do)

    return forward_backward


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls: int) -> float:
    """The host's time per call of `calls` calls back to back (the GPU not waited for), the
    median of three such runs."""
    runs = []
    for _ in range(3):
        _sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) * 1e6 / calls)
        _sync()
    return statistics.median(runs)


def profiled(fn, calls: int) -> pstats.Stats:
    profiler = cProfile.Profile()
    _sync()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    _sync()
    return pstats.Stats(profiler)


def counts(stats: pstats.Stats, calls: int) -> dict:
    """Calls per call: all, fp4lab's own functions, tensor allocations."""
    total = fp4 = allocs = 0
    for (filename, _, function), (_, ncalls, *_rest) in stats.stats.items():
        total += ncalls
        if f"{os.sep}fp4lab{os.sep}" in filename and f"{os.sep}benchmarks{os.sep}" not in filename:
            fp4 += ncalls
        if filename == "~" and function.startswith("<built-in method torch.") and (
            function[len("<built-in method torch."):-1] in ALLOCATIONS
        ):
            allocs += ncalls
    return dict(calls=total / calls, fp4lab_calls=fp4 / calls, allocations=allocs / calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=case_names())
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--shape", type=int, nargs=4, default=None, metavar=("B", "H", "S", "D"))
    parser.add_argument("--out", default=None)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    unknown = set(args.cases) - set(case_names())
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}; known {case_names()}")
    gpu = torch.cuda.is_available()
    shape = tuple(args.shape or ((4, 16, 4096, 128) if gpu else (1, 2, 256, 128)))
    device = "cuda" if gpu else "cpu"
    if not gpu:  # torch's CPU ops on small tensors: one thread (a busy second one stalls them)
        torch.set_num_threads(1)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    rows = []
    with contextlib.nullcontext() if gpu else stubbed_kernels():
        for name in args.cases:
            fn = make_call(name, shape, device)
            for _ in range(3):  # compile, fill the caches
                fn()
            stats = profiled(fn, args.calls)
            row = dict(case=name, **counts(stats, args.calls), host_us=host_us(fn, args.calls))
            rows.append(row)
            if args.out:
                with open(os.path.join(args.out, name.replace("/", "-") + ".host.txt"), "w") as f:
                    stats.stream = f
                    f.write(f"{name}, shape {shape}, {args.calls} calls, "
                            f"{'GPU' if gpu else 'kernels stubbed'}\n")
                    stats.sort_stats("ncalls").print_stats(args.top)
                    stats.sort_stats("tottime").print_stats(args.top)
    where = torch.cuda.get_device_name() if gpu else "CPU, kernels stubbed (interpreter)"
    print(f"{where}, shape {shape}, {args.calls} calls; per call:")
    print(f"{'case':<28} {'calls':>8} {'fp4lab':>8} {'allocs':>7} {'host us':>9}")
    for r in rows:
        print(f"{r['case']:<28} {r['calls']:>8.0f} {r['fp4lab_calls']:>8.0f} "
              f"{r['allocations']:>7.1f} {r['host_us']:>9.0f}")
    if args.out:
        with open(os.path.join(args.out, "profile_host.json"), "w") as f:
            json.dump(dict(device=where, shape=shape, calls=args.calls, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
