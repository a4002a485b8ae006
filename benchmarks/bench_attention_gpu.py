"""The Triton attention forward against bf16 SDPA on the GPU (issue 9's attention goals).

For each recipe and mask: check the kernel against the simulation path on a slice (B1 H2
S1024, the same tiles), then time the kernel alone on already quantized operands (Q, K, V as
the kernel reads them; the `fp4lab.attention` row below adds their quantization) beside
`F.scaled_dot_product_attention` (its default backend, bf16) in the same run, with
`triton.testing.do_bench` (median), at B4 H16 S4096 D128, over a few tile and warp
configurations. Forward FLOPs count 4 B H S^2 D (half of it causal).

Each recipe also has a row `fp4lab.attention`: the whole call as a user makes it (Q, K, V
quantized by the fused Triton quantizer, then the kernel at the recipe's tiles,
`AttentionRecipe.tiles`).

Also (`--reference`): the simulation path itself on CUDA, the `exact` recipe's forward at
B1 H16 S4096 D128 bf16 beside SDPA (issue 9: within 20x).

Also (`--backward`): forward plus backward, the whole `fp4lab.attention(...).backward(dO)`
call (Q, K, V, dO quantized by the fused quantizer, the forward kernel, the three backward
kernels of `fp4lab.kernels.flash_bwd`) beside SDPA's forward plus backward in the same run,
at B4 H16 S4096 D128 over a few tiles (the backward's warps and stages at their defaults),
each first checked against the simulation's gradients on a slice (B1 H2 S1024, the same
tiles; the worst relative L2 of dQ, dK, dV). FLOPs count the forward's 4 B H S^2 D (half
causal) times 3.5 (the backward does 2.5 times the forward's). Issue 9's goal:
`fa4fp4_causal` at least 0.35x SDPA's forward plus backward.

Also (`--gradient-bias`): `fp4lab.gradient_bias(..., backend="triton")` with 256 samples of
each stochastic recipe (`--bias-recipes`, croissattn by default) at B1 H16 S4096 D128 bf16,
causal, against the exact reference, its samples stacked along the batch (`batch` at its
default), timed end to end after one warm-up call of 2 samples (compilation), beside the
simulation path's time per sample on CUDA (2 samples, exact reference included, scaled to
256) in the same run; each first checked on 4 samples of a slice (B1 H2 S1024) against the
simulation's gradient_bias (the largest difference of the per-tensor rel_bias, and the
samples' se for scale). Issue 9's goal: under 10 s.

Also (`--trace`): the forward with instrumentation on beside off, B4 H16 S4096 D128 at the
recipe's tiles: the kernel alone compiled with TRACE (per-tile statistics into its
`TraceBuffers`) and without, and the whole `fp4lab.attention(..., trace=Trace())` call (the
instrumented kernel, exact attention on the same kernel for out_err and lse_err, Q, K, V's
statistics and the conversion into the `Trace` on the host), each beside SDPA; first checked
against the simulation's trace on a slice (B1 H2 S1024: the largest difference of a P column,
``a_flushed`` or ``p_mass_lost``). Issue 9's goal: NVFP4 at least 0.4x SDPA with it on.

Also (`--scale`): issue 9's scale run, B1 H8 S131072 D128 bf16 causal, forward plus backward
with the trace on (`--scale-recipes`, fa4fp4_causal by default): its time, the peak CUDA
memory beside one seq x seq bf16 buffer over the heads (256 GiB, more than the H200 holds),
and whether the outputs and gradients are finite; not checked against the simulation at
that size (it would not fit).

    python benchmarks/bench_attention_gpu.py [--recipes exact nvfp4 ...] [--reference]
        [--backward [--backward-recipes fa4fp4_causal ...] [--backward-configs 128x128:8:2 ...]]
        [--trace [--trace-recipes nvfp4 ...]] [--no-kernels] [--out DIR]
        [--gradient-bias [--bias-recipes croissattn ...] [--bias-samples 256]]
        [--scale [--scale-recipes fa4fp4_causal ...]] [--configs 64x64:4:3 ...]
        [--warm I/N]

`--warm I/N` compiles shard I of N of the kernels the same arguments would time and times
nothing: run N of them side by side (each with its own --out), then the timed run, which then
finds every kernel in the Triton cache (TRITON_CACHE_DIR) instead of compiling them one by
one. The traced forward's and the backward's launch configurations (warps, stages) are swept
through `fp4lab.kernels.backend.LAUNCH`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import time

import torch
import torch.nn.functional as F
import triton.testing

import fp4lab
from fp4lab.analysis import attention as reference_attention
from fp4lab.kernels import backend
from fp4lab.kernels.flash import TraceBuffers, attention_forward
from fp4lab.recipes import Trace, resolve_recipe

SHAPE = dict(B=4, H=16, S=4096, D=128)
CONFIGS = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
TRACE_LAUNCH = [(4, 2), (8, 3)]  # the traced forward's (warps, stages), at the recipe's tiles
WARM = None  # (shard, shards) under --warm: compile this shard's kernels, time nothing
_ITEMS = itertools.count()


def skip() -> bool:
    """Under --warm, whether the next work item (a recipe's configuration) is another
    shard's; the items are counted in the same order in every shard."""
    return WARM is not None and next(_ITEMS) % WARM[1] != WARM[0]


def bench(fn, **kwargs) -> float:
    """triton.testing.do_bench's median, ms; under --warm one call (compiling), NaN."""
    if WARM is not None:
        fn()
        torch.cuda.synchronize()
        return float("nan")
    return triton.testing.do_bench(fn, **kwargs)


def kernel_call(recipe, q, k, v, causal, block_m, block_n, warps, stages, traced=False):
    """A closure running the kernel on operands prepared once, as the backend prepares them
    (`backend.prepare_forward`: smooth_q's mean scores included);
    `traced`: compiled with TRACE, writing its statistics into buffers allocated once."""
    scale = 1 / math.sqrt(q.shape[-1])
    ops = backend.prepare_forward(q, k, v, recipe, block_m, block_n, scale)
    qs, ks, vs, factors = ops["q"], ops["k"], ops["v"], ops["factors"]
    pq = backend.p_quantizer(recipe)
    options = dict(
        causal=causal, scale=scale, block_m=block_m, block_n=block_n, num_warps=warps,
        num_stages=stages, mean_scores=ops["mean_scores"],
        **backend.forward_options(recipe, causal, v),
    )  # fmt: skip
    if traced:
        b, h, s = q.shape[:3]
        options["trace"] = TraceBuffers.empty(b, h, s, k.shape[2], block_m, block_n, q.device)
        options["out_dtype"] = torch.float32  # as the instrumented call writes it
    return lambda: attention_forward(qs, ks, vs, factors, pq, **options)[0]


def check(recipe, causal, block_m, block_n) -> float:
    """Kernel against the simulation path on a slice: relative L2 difference (a stochastic
    recipe's forward with the same seed on both paths)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(1, 2, 1024, 128, device="cuda", generator=g).bfloat16() for _ in range(3)
    )
    options = dict(causal=causal, block_m=block_m, block_n=block_n,
                   generator=0 if recipe.stochastic else None)  # fmt: skip
    got = backend.attention(q, k, v, recipe, **options)
    want = reference_attention(q, k, v, recipe, **options)
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def _config(text: str) -> tuple[int, int, int, int]:
    """(block_m, block_n, warps, stages) of a BMxBN:W:S argument."""
    try:
        tiles, warps, stages = text.split(":")
        bm, bn = tiles.split("x")
        return int(bm), int(bn), int(warps), int(stages)
    except ValueError:
        raise SystemExit(
            f"a configuration must read BMxBN:W:S (as 128x128:8:3), got {text!r}"
        ) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--recipes",
        nargs="+",
        default=["exact", "flash_bf16", "nvfp4", "attn_qat", "mxfp4", "fa4fp4_causal",
                 "fa4fp4_causal_mxfp4pv", "fa3_fp8"],  # fmt: skip
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--reference", action="store_true", help="time the simulation on CUDA too")
    parser.add_argument("--no-kernels", action="store_true", help="skip the forward timings")
    parser.add_argument("--backward", action="store_true", help="time forward plus backward")
    parser.add_argument(
        "--backward-recipes", nargs="+",
        default=["fa4fp4_causal", "exact", "nvfp4"],
    )  # fmt: skip
    parser.add_argument("--gradient-bias", action="store_true",
                        help="time gradient_bias's samples on the kernels")  # fmt: skip
    parser.add_argument("--bias-recipes", nargs="+", default=["croissattn"])
    parser.add_argument("--bias-samples", type=int, default=256)
    parser.add_argument("--trace", action="store_true", help="time the forward traced too")
    parser.add_argument("--trace-recipes", nargs="+", default=["nvfp4", "fa4fp4_causal", "fa3_fp8"])
    parser.add_argument("--scale", action="store_true",
                        help="the 131072-token causal fwd+bwd with the trace on")
    parser.add_argument("--scale-recipes", nargs="+", default=["fa4fp4_causal"])
    parser.add_argument(
        "--warm", metavar="I/N",
        help="compile shard I of N of the selected kernels (checks and one call each) and "
        "time nothing: N such processes run side by side fill the Triton cache, so that the "
        "timed run then compiles nothing",
    )  # fmt: skip
    parser.add_argument(
        "--backward-configs", nargs="+", metavar="BMxBN:W:S",
        help="forward plus backward's tiles and the backward kernels' warps and stages "
        "(default: each of BACKWARD_TILES with each of BACKWARD_LAUNCH)",
    )  # fmt: skip
    parser.add_argument(
        "--configs", nargs="+", metavar="BMxBN:W:S",
        help="the kernel-alone forward's tiles, warps and stages (default: CONFIGS)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.configs:
        global CONFIGS
        CONFIGS = [_config(text) for text in args.configs]
    if args.backward_configs:
        global BACKWARD_CONFIGS
        BACKWARD_CONFIGS = [_config(text) for text in args.backward_configs]
    if args.warm:
        global WARM
        shard, shards = (int(x) for x in args.warm.split("/"))
        if not 0 <= shard < shards:
            raise SystemExit(f"--warm must be I/N with 0 <= I < N, got {args.warm!r}")
        WARM = (shard, shards)
    os.makedirs(args.out, exist_ok=True)
    if args.scale:
        scale_run(args.scale_recipes, args.out)
    if args.gradient_bias:
        gradient_bias_timing(args.bias_recipes, args.bias_samples, args.out)
    if args.reference:
        reference_on_cuda()
    if args.trace:
        traced_forward(args.trace_recipes, args.out)
    if args.backward:
        forward_backward(args.backward_recipes, args.out)
    if args.no_kernels:
        return
    b, h, s, d = SHAPE["B"], SHAPE["H"], SHAPE["S"], SHAPE["D"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16() for _ in range(3))
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"forward, B{b} H{h} S{s} D{d} bf16; check = kernel vs simulation on B1 H2 S1024")
    print(
        f"{'recipe':30s} {'causal':6s} {'tiles':16s} {'ms':>8s} {'TFLOP/s':>8s} "
        f"{'x SDPA':>7s} {'check':>8s}"
    )

    def emit(row: dict) -> None:  # printed and stored as it comes: a killed run keeps its rows
        rows.append(row)
        print(
            f"{row['recipe']:30s} {str(row['causal']):6s} {row['tiles']:16s} {row['ms']:8.3f} "
            f"{row['tflops']:8.1f} {row['x_sdpa']:7.3f} {row['check']:8.1e} "
            f"{row.get('error', '')}",
            flush=True,
        )
        with open(os.path.join(args.out, "bench_attention_gpu.json"), "w") as f:
            json.dump(
                {"shape": SHAPE, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1
            )

    for causal in (False, True):
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        sdpa_ms = bench(
            lambda causal=causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        )
        emit(
            {
                "recipe": "sdpa (bf16, default backend)",
                "causal": causal,
                "tiles": "-",
                "ms": sdpa_ms,
                "tflops": flops / sdpa_ms / 1e9,
                "x_sdpa": 1.0,
                "check": 0.0,
            }
        )
        for name in args.recipes:
            recipe = resolve_recipe(name)
            for bm, bn, warps, stages in CONFIGS:
                if skip():
                    continue
                try:
                    diff = check(recipe, causal, bm, bn)
                    fn = kernel_call(recipe, q, k, v, causal, bm, bn, warps, stages)
                    out = fn()
                    assert torch.isfinite(out.float()).all(), "non-finite output"
                    ms = bench(fn)
                except Exception as err:  # a configuration that does not compile or fit
                    emit(
                        {
                            "recipe": name,
                            "causal": causal,
                            "tiles": f"{bm}x{bn} w{warps} s{stages}",
                            "ms": float("nan"),
                            "tflops": float("nan"),
                            "x_sdpa": float("nan"),
                            "check": float("nan"),
                            "error": repr(err)[:200],
                        }
                    )
                    continue
                emit(
                    {
                        "recipe": name,
                        "causal": causal,
                        "tiles": f"{bm}x{bn} w{warps} s{stages}",
                        "ms": ms,
                        "tflops": flops / ms / 1e9,
                        "x_sdpa": sdpa_ms / ms,
                        "check": diff,
                    }
                )
            # the whole call as a user makes it: Q, K, V quantized by the Triton quantizer, then
            # the kernel at the recipe's tiles (128 x 128 where it names none) and the
            # backend's launch defaults (`backend.launch_options`)
            if skip():
                continue
            ms = bench(
                lambda r=recipe, c=causal: fp4lab.attention(q, k, v, r, causal=c, backend="triton")
            )
            emit(
                {
                    "recipe": name,
                    "causal": causal,
                    "tiles": "fp4lab.attention",
                    "ms": ms,
                    "tflops": flops / ms / 1e9,
                    "x_sdpa": sdpa_ms / ms,
                    "check": float("nan"),
                }
            )


def check_trace(recipe, causal) -> float:
    """The Triton trace against the simulation's on a slice: the largest difference of the
    P columns a_flushed and p_mass_lost over the tiles."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (
        torch.randn(1, 2, 1024, 128, device="cuda", generator=g).bfloat16() for _ in range(3)
    )
    frames = []
    for name in ("triton", "reference"):
        trace = Trace()
        fp4lab.attention(q, k, v, recipe, causal=causal, trace=trace, backend=name)
        frame = trace.to_frame()
        frames.append(frame[frame["product"] == "pv"].set_index(["head", "q_tile", "k_tile"]))
    got, want = frames
    cols = ["a_flushed", "p_mass_lost"]
    return float((got[cols] - want.loc[got.index, cols]).abs().max().max())


def traced_forward(recipes, out_dir) -> None:
    """The forward with instrumentation on beside off, B4 H16 S4096 D128 bf16, each beside
    SDPA: the kernel alone (TRACE off, on) and the whole traced fp4lab.attention call."""
    b, h, s, d = SHAPE["B"], SHAPE["H"], SHAPE["S"], SHAPE["D"]
    gen = torch.Generator(device="cuda").manual_seed(6)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16() for _ in range(3))
    rows = []
    print(f"forward with the trace, B{b} H{h} S{s} D{d} bf16; check = largest P-column "
          "difference vs the simulation's trace on B1 H2 S1024")  # fmt: skip
    print(f"{'recipe':16s} {'causal':6s} {'what':28s} {'tiles':16s} {'ms':>8s} {'TFLOP/s':>8s} "
          f"{'x SDPA':>7s} {'check':>8s}")  # fmt: skip
    for causal in (False, True):
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        sdpa_ms = bench(
            lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)
        )
        for name, (warps, stages) in itertools.product(recipes, TRACE_LAUNCH):
            recipe = resolve_recipe(name)
            bm, bn = recipe.tiles(None, None)
            if skip():
                continue
            backend.LAUNCH["forward"] = (warps, stages)
            try:
                diff = check_trace(recipe, causal)
                calls = {
                    "kernel, trace off": kernel_call(recipe, q, k, v, causal, bm, bn, warps,
                                                     stages),
                    "kernel, TRACE on": kernel_call(recipe, q, k, v, causal, bm, bn, warps,
                                                    stages, True),
                    "fp4lab.attention(trace=...)": lambda r=recipe, c=causal: fp4lab.attention(
                        q, k, v, r, causal=c, backend="triton", trace=Trace()),
                }  # fmt: skip
                timings = {what: bench(fn) for what, fn in calls.items()}
            except Exception as err:  # a configuration that does not compile or fit
                print(f"{name:16s} {str(causal):6s} failed: {repr(err)[:200]}", flush=True)
                continue
            finally:
                backend.LAUNCH["forward"] = None
            tiles = f"{bm}x{bn} w{warps} s{stages}"
            for what, ms in timings.items():
                row = dict(recipe=name, causal=causal, what=what, tiles=tiles, ms=ms,
                           tflops=flops / ms / 1e9, x_sdpa=sdpa_ms / ms, check=diff)  # fmt: skip
                rows.append(row)
                print(f"{name:16s} {str(causal):6s} {what:28s} {tiles:16s} {ms:8.3f} "
                      f"{row['tflops']:8.1f} {row['x_sdpa']:7.3f} {diff:8.1e}",
                      flush=True)  # fmt: skip
            with open(os.path.join(out_dir, "bench_attention_gpu_trace.json"), "w") as f:
                json.dump({"shape": SHAPE, "device": torch.cuda.get_device_name(), "rows": rows},
                          f, indent=1)  # fmt: skip


BACKWARD_TILES = [(64, 64), (128, 128)]
# the backward kernels' (warps, stages) (backend.LAUNCH): 64-row tiles' default is (4, 3)
BACKWARD_LAUNCH = [(4, 3), (8, 2)]
# (block_m, block_n, warps, stages) that forward_backward times: --backward-configs, else each
# tile size with each launch
BACKWARD_CONFIGS = [(bm, bn, w, st) for (bm, bn), (w, st)
                    in itertools.product(BACKWARD_TILES, BACKWARD_LAUNCH)]  # fmt: skip


def gradients(recipe, q, k, v, do, causal, block_m, block_n, backend_name="triton"):
    """dQ, dK, dV of one fp4lab.attention call with `backend_name`."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = fp4lab.attention(*leaves, recipe, causal=causal, backend=backend_name,
                           block_m=block_m, block_n=block_n)  # fmt: skip
    out.backward(do)
    return [x.grad for x in leaves]


def check_backward(recipe, causal, block_m, block_n) -> float:
    """Kernel against the simulation's gradients on a slice: the worst relative L2 of the three."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (
        torch.randn(1, 2, 1024, 128, device="cuda", generator=g).bfloat16() for _ in range(4)
    )
    got = gradients(recipe, q, k, v, do, causal, block_m, block_n)
    want = gradients(recipe, q, k, v, do, causal, block_m, block_n, "reference")
    return max(((a.float() - b.float()).norm() / b.float().norm()).item()
               for a, b in zip(got, want, strict=True))  # fmt: skip


def forward_backward(recipes, out_dir) -> None:
    """fp4lab.attention forward plus backward beside SDPA's, B4 H16 S4096 D128 bf16."""
    b, h, s, d = SHAPE["B"], SHAPE["H"], SHAPE["S"], SHAPE["D"]
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, do = (
        torch.randn(b, h, s, d, device="cuda", generator=gen).bfloat16() for _ in range(4)
    )
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    rows = []
    print(f"forward + backward, B{b} H{h} S{s} D{d} bf16; check = worst gradient vs simulation "
          "on B1 H2 S1024")  # fmt: skip
    print(f"{'recipe':30s} {'causal':6s} {'tiles':10s} {'ms':>8s} {'TFLOP/s':>8s} "
          f"{'x SDPA':>7s} {'check':>8s}")  # fmt: skip

    def timed(fn) -> float:
        return bench(fn, grad_to_none=leaves)

    def emit(row: dict) -> None:
        rows.append(row)
        print(f"{row['recipe']:30s} {str(row['causal']):6s} {row['tiles']:10s} {row['ms']:8.3f} "
              f"{row['tflops']:8.1f} {row['x_sdpa']:7.3f} {row['check']:8.1e} "
              f"{row.get('error', '')}", flush=True)  # fmt: skip
        with open(os.path.join(out_dir, "bench_attention_gpu_backward.json"), "w") as f:
            json.dump({"shape": SHAPE, "device": torch.cuda.get_device_name(), "rows": rows}, f,
                      indent=1)  # fmt: skip

    for causal in (False, True):
        flops = 3.5 * 4 * b * h * s * s * d / (2 if causal else 1)

        def sdpa(causal=causal):
            F.scaled_dot_product_attention(*leaves, is_causal=causal).backward(do)

        sdpa_ms = timed(sdpa)
        emit(dict(recipe="sdpa (bf16, default backend)", causal=causal, tiles="-", ms=sdpa_ms,
                  tflops=flops / sdpa_ms / 1e9, x_sdpa=1.0, check=0.0))  # fmt: skip
        for name in recipes:
            recipe = resolve_recipe(name)
            for bm, bn, warps, stages in BACKWARD_CONFIGS:
                launch = (warps, stages)
                if skip():
                    continue
                row = dict(recipe=name, causal=causal,
                           tiles=f"{bm}x{bn} w{launch[0]} s{launch[1]}")  # fmt: skip
                backend.LAUNCH["backward"] = launch
                try:
                    diff = check_backward(recipe, causal, bm, bn)

                    def call(r=recipe, c=causal, bm=bm, bn=bn):
                        fp4lab.attention(*leaves, r, causal=c, backend="triton", block_m=bm,
                                         block_n=bn).backward(do)  # fmt: skip

                    ms = timed(call)
                except Exception as err:  # a configuration that does not compile, fit or tile
                    nan = float("nan")
                    emit({**row, "ms": nan, "tflops": nan, "x_sdpa": nan, "check": nan,
                          "error": repr(err)[:200]})  # fmt: skip
                    continue
                finally:
                    backend.LAUNCH["backward"] = None
                emit({**row, "ms": ms, "tflops": flops / ms / 1e9, "x_sdpa": sdpa_ms / ms,
                      "check": diff})  # fmt: skip


def gradient_bias_timing(recipes, samples: int, out_dir) -> None:
    """fp4lab.gradient_bias on the kernels, B1 H16 S4096 D128 bf16 causal, beside the
    simulation's time per sample (see the module docstring)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (
        torch.randn(1, 16, 4096, 128, device="cuda", generator=g).bfloat16() for _ in range(4)
    )
    run = dict(seed=0, causal=True, reference="exact")
    rows = []
    print(f"gradient_bias, B1 H16 S4096 D128 bf16 causal, {samples} samples against exact")
    print(f"{'recipe':20s} {'kernels s':>10s} {'sim s (scaled)':>15s} {'x faster':>9s} "
          f"{'rel_bias diff':>14s} {'se':>9s}")  # fmt: skip
    part = [x[:, :2, :1024] for x in (q, k, v, do)]  # the check's slice: B1 H2 S1024
    for name in recipes:
        if skip():
            continue
        if WARM is not None:  # the shapes the timing runs compile: the samples' and the check's
            fp4lab.gradient_bias(q, k, v, do, name, samples=2, backend="triton", **run)
            fp4lab.gradient_bias(*part, name, samples=4, backend="triton", **run)
            torch.cuda.synchronize()
            continue
        # each phase prints its time as it ends, and the kernels' timing comes first, so a
        # call killed at its limit still says where the time went (a 250 s call on the H200
        # printed no row)
        phase = time.perf_counter()
        fp4lab.gradient_bias(q, k, v, do, name, samples=2, backend="triton", **run)  # warm-up
        torch.cuda.synchronize()
        print(f"  {name}: warm-up, 2 samples: {time.perf_counter() - phase:.1f} s", flush=True)
        phase = time.perf_counter()  # again: what the first call spent compiling, by difference
        fp4lab.gradient_bias(q, k, v, do, name, samples=2, backend="triton", **run)
        torch.cuda.synchronize()
        print(f"  {name}: 2 samples again: {time.perf_counter() - phase:.1f} s", flush=True)
        start = time.perf_counter()
        result = fp4lab.gradient_bias(q, k, v, do, name, samples=samples, backend="triton", **run)
        torch.cuda.synchronize()
        kernels_s = time.perf_counter() - start
        print(f"  {name}: {samples} samples on the kernels: {kernels_s:.2f} s", flush=True)
        phase = time.perf_counter()
        check = []
        for b in ("triton", "reference"):
            check.append(fp4lab.gradient_bias(*part, name, samples=4, backend=b, **run).tensors)
            torch.cuda.synchronize()
            print(f"  {name}: the check's 4 samples on B1 H2 S1024, {b}: "
                  f"{time.perf_counter() - phase:.1f} s", flush=True)
            phase = time.perf_counter()
        diff = (check[0]["rel_bias"] - check[1]["rel_bias"]).abs().max()
        # the simulation's time per sample from the fewest samples a stochastic recipe takes
        # (2; gradient_bias refuses fewer), the exact reference included, scaled to `samples`
        start = time.perf_counter()
        fp4lab.gradient_bias(q, k, v, do, name, samples=2, **run)
        torch.cuda.synchronize()
        simulation_s = (time.perf_counter() - start) * samples / 2
        row = dict(recipe=name, samples=samples, kernels_s=kernels_s, simulation_s=simulation_s,
                   check_rel_bias_diff=float(diff), se=float(check[1]["se"].max()),
                   rel_bias=result.tensors["rel_bias"].tolist())  # fmt: skip
        rows.append(row)
        speedup = simulation_s / kernels_s
        print(f"{name:20s} {kernels_s:10.2f} {simulation_s:15.1f} {speedup:9.1f} {diff:14.1e} "
              f"{row['se']:9.1e}", flush=True)  # fmt: skip
        with open(os.path.join(out_dir, "bench_attention_gpu_bias.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def scale_run(recipes, out_dir, seq: int = 131072) -> None:
    """The issue's scale run: B1 H8 S`seq` D128 bf16, causal, forward plus backward with the
    trace on, on the kernels; its wall time, peak CUDA memory against one (Sq x Sk) bf16
    buffer per head (what no part may allocate), and whether the outputs and the trace are
    finite where written."""
    g = torch.Generator(device="cuda").manual_seed(11)
    if WARM is not None:  # the same kernels at a size that compiles them quickly
        seq = 4096
    rows = []
    seq_by_seq_gb = 8 * seq * seq * 2 / 2**30
    print(f"scale: B1 H8 S{seq} D128 bf16 causal, fwd+bwd traced; one seq x seq bf16 buffer "
          f"over the heads would be {seq_by_seq_gb:.0f} GiB")
    for name in recipes:
        if skip():
            continue
        q, k, v, do = (torch.randn(1, 8, seq, 128, device="cuda", generator=g).bfloat16()
                       for _ in range(4))  # fmt: skip
        leaves = [x.requires_grad_() for x in (q, k, v)]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trace = Trace()
        out = fp4lab.attention(*leaves, name, causal=True, backend="triton", trace=trace)
        out.backward(do)
        frame = trace.to_frame()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        grads = [x.grad for x in leaves]
        finite = all(bool(torch.isfinite(t.float()).all()) for t in (out, *grads))
        row = dict(recipe=name, seq=seq, seconds=seconds,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30,
                   seq_by_seq_gib=seq_by_seq_gb, trace_rows=len(frame), outputs_finite=finite)
        rows.append(row)
        print(f"{name:20s} {seconds:8.1f} s  peak {row['peak_gib']:6.1f} GiB  trace rows "
              f"{len(frame)}  finite {finite}", flush=True)
        with open(os.path.join(out_dir, "bench_attention_gpu_scale.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


def reference_on_cuda() -> None:
    """The simulation path's exact forward on CUDA beside SDPA, B1 H16 S4096 D128 bf16."""
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (
        torch.randn(1, 16, 4096, 128, device="cuda", generator=g).bfloat16() for _ in range(3)
    )
    for causal in (False, True):
        sdpa = triton.testing.do_bench(
            lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c)
        )
        ref = triton.testing.do_bench(
            lambda c=causal: reference_attention(q, k, v, "exact", causal=c), warmup=50, rep=500
        )
        out = reference_attention(q, k, v, "exact", causal=causal).float()
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
        err = ((out - want).norm() / want.norm()).item()
        print(
            f"reference exact forward on CUDA, causal={causal}: {ref:.2f} ms, SDPA {sdpa:.3f} ms, "
            f"{ref / sdpa:.1f}x SDPA's time (goal: within 20x); error vs fp32 SDPA {err:.1e}"
        )


if __name__ == "__main__":
    main()
