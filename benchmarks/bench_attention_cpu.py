"""The simulation path's attention on the CPU: time against plain torch, and peak memory.

(a) Time. Batch 1, 4 heads, seq 2048, head_dim 64, float32, recipe "nvfp4" (NVFP4 on all
    twelve operands of the six products) with the trace on (`Trace()`, its reference in the
    working precision, float32 here), forward plus backward, against plain float32 torch
    attention forward plus backward of the same shape in the same process:
    S = Q K^T / sqrt(d), P = softmax(S) materialised, O = P V, autograd backward. Also timed:
    the trace with a float64 reference (`Trace(reference_dtype=torch.float64)`), no trace,
    and the exact recipe. Median and minimum of interleaved rounds after a warm-up.
    Goal (issue 3): the traced nvfp4 run within 4x of plain torch. Also timed: `croissattn`
    (stochastic rounding, seed 0) with the trace; goal (issue 9): within 4x as well.
(b) Memory. Seq 16384, 1 head, head_dim 64, float32, forward plus backward of the reference
    path. Measured as peak resident-set growth: each case runs in a fresh child process,
    which builds its inputs, warms up on a small call, reads its current RSS
    (/proc/self/statm), runs, and reads its peak RSS (VmHWM in /proc/self/status); the growth is the
    difference. It counts every byte the call touched (torch's CPU allocator, the trace's
    tensors and DataFrame), not only Python objects (tracemalloc would miss torch's).
    Goal (issue 3): under 256 MiB, a quarter of one dense 16384^2 float32 matrix (1 GiB).

    python benchmarks/bench_attention_cpu.py [--repeats 7] [--skip-memory] [--skip-time]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

import fp4lab

MiB = 1 << 20


def inputs(heads: int, seq: int, dim: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, seq, dim, generator=g) for _ in range(4)]


def plain_step(q, k, v, do) -> None:
    """Plain float32 attention, softmax(Q K^T / sqrt(d)) V materialised, forward + backward."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    (p @ v).backward(do)


def fp4lab_step(
    q, k, v, do, recipe: str, traced: bool, reference_dtype=None, generator=None
) -> None:
    """fp4lab's reference attention, forward + backward (trace frame built when traced)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    trace = fp4lab.Trace(reference_dtype=reference_dtype) if traced else None
    out = fp4lab.attention(q, k, v, recipe, trace=trace, backend="reference", generator=generator)
    out.backward(do)
    if trace is not None:
        trace.to_frame()


def interleaved_seconds(steps: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds of each step over `repeats` rounds, the steps taking turns within a round (so
    that load from other processes falls on all of them alike), after one warm-up each."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return times


def time_case(repeats: int) -> None:
    q, k, v, do = inputs(heads=4, seq=2048)
    print(
        "(a) time: batch 1, 4 heads, seq 2048, head_dim 64, float32, forward + backward; "
        f"{repeats} interleaved rounds"
    )
    steps = {
        "plain torch float32 (materialised softmax)": lambda: plain_step(q, k, v, do),
        "fp4lab nvfp4, trace on": lambda: fp4lab_step(q, k, v, do, "nvfp4", True),
        "fp4lab nvfp4, trace on, float64 reference": lambda: fp4lab_step(
            q, k, v, do, "nvfp4", True, torch.float64
        ),
        "fp4lab nvfp4, trace off": lambda: fp4lab_step(q, k, v, do, "nvfp4", False),
        "fp4lab exact, trace off": lambda: fp4lab_step(q, k, v, do, "exact", False),
        "fp4lab croissattn (SR), trace on": lambda: fp4lab_step(
            q, k, v, do, "croissattn", True, generator=0
        ),
    }
    times = interleaved_seconds(steps, repeats)
    plain = next(iter(times.values()))
    print(
        f"{'case':48s} {'median s':>9s} {'min s':>7s} {'x plain (median)':>17s} "
        f"{'x plain (min)':>14s}"
    )
    for name, seconds in times.items():
        median, best = statistics.median(seconds), min(seconds)
        print(
            f"{name:48s} {median:9.3f} {best:7.3f} {median / statistics.median(plain):16.1f}x "
            f"{best / min(plain):13.1f}x"
        )
    traced = times["fp4lab nvfp4, trace on"]
    met = statistics.median(traced) <= 4 * statistics.median(plain) and min(traced) <= 4 * min(
        plain
    )
    print(f"goal: nvfp4 with the trace within 4x of plain torch -> {'met' if met else 'NOT met'}")
    sr = statistics.median(times["fp4lab croissattn (SR), trace on"]) / statistics.median(plain)
    verdict = "met" if sr <= 4 else "NOT met"
    print(f"goal (issue 9): croissattn with the trace within 4x -> {verdict}")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(recipe: str, traced: bool, seq: int) -> dict:
    """Run in a fresh process: peak RSS growth of one forward + backward."""
    q, k, v, do = inputs(heads=1, seq=seq)
    small = inputs(heads=1, seq=256)
    fp4lab_step(*small, recipe, traced)  # load every code path before measuring
    before = rss_bytes()
    start = time.perf_counter()
    fp4lab_step(q, k, v, do, recipe, traced)
    seconds = time.perf_counter() - start
    return {"growth": peak_rss_bytes() - before, "seconds": seconds}


def peak_rss_bytes() -> int:
    """This process's peak RSS, VmHWM. (getrusage's ru_maxrss is no good here: Linux carries
    it across fork and exec, so a child would report its parent's peak.)"""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024  # kB


def memory_case(seq: int = 16384) -> None:
    dense = seq * seq * 4
    print(
        f"\n(b) memory: seq {seq}, 1 head, head_dim 64, float32, forward + backward; "
        "peak RSS growth in a fresh process"
    )
    print(
        f"one dense {seq}^2 float32 matrix: {dense / MiB:.0f} MiB; goal: under "
        f"{dense / 4 / MiB:.0f} MiB"
    )
    print(f"{'case':32s} {'peak growth MiB':>16s} {'seconds':>8s}  goal")
    for recipe, traced in (("exact", False), ("nvfp4", False), ("nvfp4", True)):
        code = (
            f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import bench_attention_cpu as b; print(json.dumps(b.memory_child({recipe!r}, "
            f"{traced}, {seq})))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        ok = "met" if result["growth"] < dense / 4 else "NOT met"
        name = f"fp4lab {recipe}, trace {'on' if traced else 'off'}"
        print(f"{name:32s} {result['growth'] / MiB:16.1f} {result['seconds']:8.1f}  {ok}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-time", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    args = parser.parse_args()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp4lab "
        f"{fp4lab.__version__}, "
        f"load average {os.getloadavg()[0]:.2f} at the start"
    )
    if not args.skip_time:
        time_case(args.repeats)
    if not args.skip_memory:
        memory_case()
    print(
        f"load average {os.getloadavg()[0]:.2f} at the end (other processes on the machine skew "
        "times)"
    )


if __name__ == "__main__":
    main()
