"""The Gluon forward (`fp4lab.kernels.gluon_fwd`) against the Triton one and SDPA on the H200.

For each recipe and causal setting, in one process: bf16 SDPA (its default backend), the
forward kernel alone on operands prepared once (`backend.prepare_forward`, as
`bench_attention_gpu.py` times it) with `FP4LAB_GLUON=0` (the Triton kernel) and with it on
(the Gluon kernel, where `gluon_fwd.unsupported` admits the call), whether the two gave the
same O and log-sum-exp bit for bit, and the whole `fp4lab.attention(..., backend="triton")`
call both ways. `triton.testing.do_bench` medians; B4 H16 S4096 D128 bf16 unless told.

    python benchmarks/bench_gluon_fwd.py --out DIR [--recipes nvfp4 mxfp4 ...] [--stages 2 3]

The recipes default to the block-format P ones (nvfp4, mxfp4, nvfp4_1level) and the FP8 P V
ones (fa4fp4_causal, fa3_fp8, fp8_per_tensor). `--stages`: the Gluon kernel is also timed
with each of these K/V ring depths (`gluon_fwd.STAGES`, 2 unless told), as
`gluon_kernel_ms_stages<N>`; its other figures are at the module's own depth.

writes DIR/bench_gluon_fwd.json and prints nothing else.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import pathlib
import sys

import torch
import triton

import fp4lab
from fp4lab.kernels import backend, gluon_fwd
from fp4lab.kernels.flash import attention_forward
from fp4lab.recipes import resolve_recipe


@contextlib.contextmanager
def _gluon(on: bool):
    saved = os.environ.get("FP4LAB_GLUON")
    os.environ["FP4LAB_GLUON"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("FP4LAB_GLUON")
        else:
            os.environ["FP4LAB_GLUON"] = saved


def _timed(fn, on: bool) -> tuple[float, object]:
    with _gluon(on):
        out = fn()
        return triton.testing.do_bench(fn), out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--recipes", nargs="+", default=[
        "nvfp4", "mxfp4", "nvfp4_1level", "fa4fp4_causal", "fa3_fp8", "fp8_per_tensor"])
    parser.add_argument("--stages", nargs="*", type=int, default=[])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    B, H, S, D = args.batch, args.heads, args.seq, 128
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g).bfloat16() for _ in "qkv")
    scale = 1.0 / math.sqrt(D)
    rows = []
    for causal in (False, True):
        sdpa = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v,
                                 is_causal=causal)
        t_sdpa = triton.testing.do_bench(sdpa)
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        for name in args.recipes:
            recipe = resolve_recipe(name)
            pq = backend.p_quantizer(recipe)
            ops = backend.prepare_forward(q, k, v, recipe, 128, 128, scale)
            options = dict(causal=causal, scale=scale, block_m=128, block_n=128, num_warps=8,
                           num_stages=3, **backend.forward_options(recipe, causal, v))
            kernel = functools.partial(attention_forward, ops["q"], ops["k"], ops["v"],
                                       ops["factors"], pq, **options)
            whole = functools.partial(fp4lab.attention, q, k, v, recipe, backend="triton",
                                      causal=causal)
            with _gluon(True):
                gap = gluon_fwd.unsupported(
                    ops["q"], ops["k"], ops["v"], pq, block_m=128, block_n=128, num_warps=8,
                    out_dtype=None, scale=scale, causal=causal, extras={
                        name: bool(options[name]) for name in ("lazy_log2", "reverse",
                                                               "row_sum_quantized")})
            t_triton, (o_t, lse_t) = _timed(kernel, False)
            t_gluon, (o_g, lse_g) = _timed(kernel, True)
            t_whole_t, _ = _timed(whole, False)
            t_whole_g, _ = _timed(whole, True)
            depths = {}
            for stages in args.stages:  # the ring's depth, the kernel alone
                saved = gluon_fwd.STAGES
                gluon_fwd.STAGES = stages
                gluon_fwd._constants.cache_clear()
                try:
                    t, (o_s, _) = _timed(kernel, True)
                    depths[f"gluon_kernel_ms_stages{stages}"] = t
                    depths[f"same_o_stages{stages}"] = bool(torch.equal(o_s, o_t))
                finally:
                    gluon_fwd.STAGES = saved
                    gluon_fwd._constants.cache_clear()
            rows.append(dict(**depths,
                recipe=name, causal=causal, gluon_takes_it=gap is None, gap=gap,
                sdpa_ms=t_sdpa, sdpa_tflops=flops / t_sdpa / 1e9,
                triton_kernel_ms=t_triton, gluon_kernel_ms=t_gluon,
                triton_kernel_x_sdpa=t_sdpa / t_triton, gluon_kernel_x_sdpa=t_sdpa / t_gluon,
                whole_triton_ms=t_whole_t, whole_gluon_ms=t_whole_g,
                whole_triton_x_sdpa=t_sdpa / t_whole_t, whole_gluon_x_sdpa=t_sdpa / t_whole_g,
                same_o=bool(torch.equal(o_t, o_g)), same_lse=bool(torch.equal(lse_t, lse_g)),
                o_finite=bool(torch.isfinite(o_g.float()).all()),
            ))
            (args.out / "bench_gluon_fwd.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
