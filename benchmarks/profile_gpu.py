"""Where the time goes in the two GPU calls that are far from their goals (issue 9): the
simulation path's `exact` forward on CUDA (B1 H16 S4096 D128, goal within 20x of SDPA) and the
whole traced `fp4lab.attention(..., backend="triton", trace=Trace())` call (B4 H16 S4096 D128,
fa4fp4_causal; goal 0.4x SDPA), each under torch.profiler after warm-up.

Writes, per case, the operators sorted by their total device time (`<case>.txt`, the
profiler's own table) and the same as JSON rows (`profile_gpu.json`: name, calls, device and
host microseconds), with the case's wall time per call (CUDA-synchronised, median of 5), and
the Python functions of 20 calls under cProfile sorted by their own time
(`<case>.host.txt`): where a call's host time goes when it exceeds the GPU's; and the host's
time per call without cProfile (20 calls launched back to back, the GPU not waited for), with
the compiled kernels called directly (`fp4lab.kernels.launch`) and again with every launch
through `triton.jit` (FP4LAB_DIRECT_LAUNCH=0). Cases `fq_nvfp4` and `fq_mxfp4` are the fused
`fake_quantize` of the quantizers' bandwidth goal (bf16 8192 x 8192). Under the
profiler the trace's own steps (`RANGES`: the kernels' trace conversion, the operands'
reference quantization and statistics, the product errors, `TraceCall.add`) are wrapped in
`record_function` ranges, so that `<case>.ranges.txt` gives each step's device and host time
(a range's device time is that of the kernels launched inside it; ranges nest: the outer
`record_forward` holds the others). The functions are wrapped only for that profiled call.

    python benchmarks/profile_gpu.py --out DIR [--cases reference traced untraced]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import fp4lab
from fp4lab.analysis import attention as reference_attention
from fp4lab.recipes import Trace

# (module, attribute): the trace's steps timed as ranges (a class's method as "Class.method")
RANGES = (
    ("fp4lab.kernels.trace", "record_forward"),
    ("fp4lab.kernels.trace", "_quantized"),
    ("fp4lab.kernels.trace", "whole_stats"),
    ("fp4lab.kernels.trace", "_product_errors"),
    ("fp4lab.kernels.trace", "_out_errors"),
    ("fp4lab.kernels.trace", "_mass_lost"),
    ("fp4lab.kernels.trace", "_operand_columns"),
    ("fp4lab.kernels.trace", "_host_all"),
    ("fp4lab.recipes.trace", "TraceCall.add"),
)


@contextlib.contextmanager
def ranges():
    """Within: each of `RANGES` runs inside a `record_function` named after it."""
    saved = []
    for module_name, attribute in RANGES:
        owner = importlib.import_module(module_name)
        *outer, name = attribute.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = getattr(owner, name)

        def wrapped(*args, _fn=fn, _label=f"{module_name}.{attribute}", **kwargs):
            with record_function(_label):
                return _fn(*args, **kwargs)

        saved.append((owner, name, fn))
        setattr(owner, name, wrapped)
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def _inputs(b, h, s, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, s, d, device="cuda", generator=g).bfloat16() for _ in range(3)]


def cases() -> dict:
    """name -> (description, a closure of one call)."""
    from fp4lab.kernels.quantize import fake_quantize

    small = _inputs(1, 16, 4096, 128, 2)
    big = _inputs(4, 16, 4096, 128, 6)
    square = _inputs(1, 1, 8192, 8192, 7)[0][0, 0]
    return {
        "reference": (
            "simulation path, exact forward, B1 H16 S4096 D128, non-causal",
            lambda: reference_attention(*small, "exact", causal=False),
        ),
        "reference_causal": (
            "simulation path, exact forward, B1 H16 S4096 D128, causal",
            lambda: reference_attention(*small, "exact", causal=True),
        ),
        "traced": (
            "fp4lab.attention(backend='triton', trace=Trace()), fa4fp4_causal, B4 H16 S4096 "
            "D128, non-causal",
            lambda: fp4lab.attention(*big, "fa4fp4_causal", backend="triton", trace=Trace()),
        ),
        "untraced": (
            "fp4lab.attention(backend='triton'), fa4fp4_causal, B4 H16 S4096 D128, non-causal",
            lambda: fp4lab.attention(*big, "fa4fp4_causal", backend="triton"),
        ),
        # causal, the kernel takes about half the time: where the whole call's host work
        # shows (session 26: fa4fp4_causal's whole call 1.26 ms causal and not, fa3_fp8's
        # 1.78 ms causal against 1.48 non-causal, with kernels of 0.6 and 1.05 ms)
        "untraced_causal": (
            "fp4lab.attention(backend='triton'), fa4fp4_causal, B4 H16 S4096 D128, causal",
            lambda: fp4lab.attention(*big, "fa4fp4_causal", backend="triton", causal=True),
        ),
        "fp8_causal": (
            "fp4lab.attention(backend='triton'), fa3_fp8, B4 H16 S4096 D128, causal",
            lambda: fp4lab.attention(*big, "fa3_fp8", backend="triton", causal=True),
        ),
        # the quantizers' goal (80% of the bandwidth bound, bench_quantize_gpu.py): two
        # launches and their allocations a call against 0.1 ms of device time
        "fq_nvfp4": (
            "fp4lab.kernels.quantize.fake_quantize(x, 'nvfp4'), bf16 8192 x 8192",
            lambda: fake_quantize(square, "nvfp4"),
        ),
        "fq_mxfp4": (
            "fp4lab.kernels.quantize.fake_quantize(x, 'mxfp4'), bf16 8192 x 8192",
            lambda: fake_quantize(square, "mxfp4"),
        ),
    }


def wall_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_ms_plain(fn, calls: int = 20) -> float:
    """The host's time per call of `calls` calls launched back to back (not waited for)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    ms = (time.perf_counter() - start) * 1e3 / calls
    torch.cuda.synchronize()
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", nargs="+", default=["reference", "traced", "untraced"])
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    table = cases()
    unknown = set(args.cases) - set(table)
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}; known {sorted(table)}")
    result = {"device": torch.cuda.get_device_name(), "cases": {}}
    for name in args.cases:
        what, fn = table[name]
        for _ in range(3):  # compile, allocate, warm the caches
            fn()
        ms = wall_ms(fn)
        with ranges(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        averages = prof.key_averages()
        steps = [e for e in averages if e.key.startswith("fp4lab.")]
        with open(os.path.join(args.out, f"{name}.ranges.txt"), "w") as f:
            f.write(f"{what}\nthe trace's steps (record_function ranges, one profiled call)\n\n")
            f.write(f"{'range':<48} {'calls':>5} {'device ms':>10} {'host ms':>10}\n")
            for e in sorted(steps, key=lambda e: -e.device_time_total):
                f.write(f"{e.key:<48} {e.count:>5} {e.device_time_total / 1e3:>10.3f} "
                        f"{e.cpu_time_total / 1e3:>10.3f}\n")
        with open(os.path.join(args.out, f"{name}.txt"), "w") as f:
            f.write(f"{what}\nwall {ms:.3f} ms per call (median of 5)\n\n")
            f.write(averages.table(sort_by="cuda_time_total", row_limit=args.top))
            f.write("\n\nby host time\n")
            f.write(averages.table(sort_by="cpu_time_total", row_limit=args.top))
        rows = sorted(
            (
                dict(name=e.key, calls=e.count, device_us=e.device_time_total,
                     self_device_us=e.self_device_time_total, host_us=e.cpu_time_total,
                     self_host_us=e.self_cpu_time_total)
                for e in averages
            ),
            key=lambda r: -r["self_device_us"],
        )  # fmt: skip
        host_plain_ms = host_ms_plain(fn)  # the host's own time: 20 calls back to back
        saved = os.environ.get("FP4LAB_DIRECT_LAUNCH")
        os.environ["FP4LAB_DIRECT_LAUNCH"] = "0"  # every launch through triton.jit
        fn()
        host_jit_ms = host_ms_plain(fn)
        if saved is None:
            os.environ.pop("FP4LAB_DIRECT_LAUNCH")
        else:
            os.environ["FP4LAB_DIRECT_LAUNCH"] = saved
        host = cProfile.Profile()
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.enable()
        for _ in range(20):
            fn()
        host.disable()
        host_ms = (time.perf_counter() - start) * 1e3 / 20  # launched, not synchronised
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(args.top)
        pstats.Stats(host, stream=text).sort_stats("cumulative").print_stats(args.top)
        with open(os.path.join(args.out, f"{name}.host.txt"), "w") as f:
            f.write(f"{what}\nhost {host_ms:.3f} ms per call under cProfile (20 calls, "
                    f"launch only); {host_plain_ms:.3f} ms without it ({host_jit_ms:.3f} ms with "
                    f"every launch through triton.jit)\n\n{text.getvalue()}")
        result["cases"][name] = dict(what=what, wall_ms=ms, host_ms_cprofile=host_ms,
                                     host_ms=host_plain_ms, host_ms_jit=host_jit_ms,
                                     ops=rows[: args.top * 2])
        print(f"{name}: {what}: {ms:.3f} ms, host {host_plain_ms:.3f} ms ({host_ms:.3f} ms "
              f"under cProfile, {host_jit_ms:.3f} ms with every launch through triton.jit)",
              flush=True)
        with open(os.path.join(args.out, "profile_gpu.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
