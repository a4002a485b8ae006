"""fake_quantize on the CPU against torchao's eager reference for the same recipe.

For each recipe and size: check that fp4lab's codes and scales equal torchao's bit for bit,
then time both (quantize + dequantize to float32, median of repeats, same process, same
threads) and report the ratio. Goal (issue 2): fp4lab at least 2x torchao's speed.

    python benchmarks/bench_fake_quantize.py [--sizes 1024 2048 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

import fp4lab
import fp4lab.formats as F

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.kernels import unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import (
        NVFP4Tensor,
        nvfp4_quantize,
        per_tensor_amax_to_scale,
    )


def torchao_nvfp4(x):
    scale = per_tensor_amax_to_scale(x.abs().amax())
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)


def torchao_mxfp4(x):
    return MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)


def torchao_mxfp8(x):
    return MXTensor.to_mx(x, torch.float8_e4m3fn, 32).dequantize(torch.float32)


def check_nvfp4(x):
    s, d = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax()))
    q = fp4lab.quantize(x, "torchao_nvfp4")
    return torch.equal(q.scales, s.float().reshape(q.scales.shape)) and torch.equal(
        q.codes, unpack_uint4(d.view(torch.uint8)).reshape(x.shape)
    )


def check_mx(element, torch_dtype):
    def check(x):
        s, d = to_mx(x, torch_dtype, 32)
        q = fp4lab.quantize(x, element)
        codes = unpack_uint4(d.view(torch.uint8)) if element == "mxfp4" else d.view(torch.uint8)
        return torch.equal(
            F.UE8M0.encode(q.scales), s.view(torch.uint8).reshape(q.scales.shape)
        ) and (torch.equal(q.codes, codes.reshape(x.shape)))

    return check


CASES = {
    "torchao_nvfp4": (torchao_nvfp4, check_nvfp4),
    "mxfp4": (torchao_mxfp4, check_mx("mxfp4", torch.float4_e2m1fn_x2)),
    "mxfp8_e4m3": (torchao_mxfp8, check_mx("mxfp8_e4m3", torch.float8_e4m3fn)),
}


def median_seconds(fn, x, repeats):
    fn(x)  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"{'recipe':<14} {'size':>11} {'same bits':>9} {'fp4lab ms':>10} {'torchao ms':>10} "
        f"{'speedup':>8}"
    )
    for size in args.sizes:
        x = torch.randn(size, size, generator=gen)
        for recipe, (reference, check) in CASES.items():
            same = check(x)
            ours = median_seconds(lambda t, r=recipe: fp4lab.fake_quantize(t, r), x, args.repeats)
            theirs = median_seconds(reference, x, args.repeats)
            print(
                f"{recipe:<14} {f'{size}x{size}':>11} {str(same):>9} {ours * 1e3:>10.1f} "
                f"{theirs * 1e3:>10.1f} {theirs / ours:>7.2f}x"
            )


if __name__ == "__main__":
    main()
