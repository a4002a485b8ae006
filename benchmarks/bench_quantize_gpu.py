"""The Triton quantizers on the GPU against their bandwidth bound and torchao (issue 9's goals).

In one run on one GPU, each figure timed beside its comparison (triton.testing.do_bench,
median), on fresh random inputs (Gaussian rows at log-spread magnitudes, never zeros):

1. the device-to-device copy bandwidth, counting bytes read plus bytes written;
2. `fp4lab.kernels.quantize.fake_quantize` with nvfp4 and mxfp4, bf16 in and out: first
   checked bit for bit against the reference `fp4lab.formats.fake_quantize` on the same input
   (into memory poisoned beforehand, so an unwritten element would show), then timed. The
   bound is the bytes the format must move over the copy bandwidth: the input read once per
   pass (two for nvfp4, whose tensor scale needs the amax first) and the output written once;
3. `quantize_packed` with torchao_nvfp4_1level (packed FP4 codes and float32 scales) against
   torch.compile of torchao's `nvfp4_quantize` on the same input: both checked against the
   reference's codes and scales, then timed; the goal is a 3x speedup.

Each fp4lab case is timed under a few `LaunchConfig`s; the table shows the best, the JSON under
--out every one. The table is printed last.

    python benchmarks/bench_quantize_gpu.py [--size 8192] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import torch
import triton
import triton.testing

import fp4lab.formats as F
from fp4lab.kernels import quantize as K

CONFIGS = [
    K.LaunchConfig(),
    K.LaunchConfig(tile_elements=8192, num_warps=4),
    K.LaunchConfig(tile_elements=8192, num_warps=8),
    K.LaunchConfig(tile_elements=16384, num_warps=8),
    K.LaunchConfig(tile_elements=2048, num_warps=4, tile_columns=128),
]


def random_input(size: int, seed: int) -> torch.Tensor:
    """Gaussian rows times magnitudes 2^[-8, 8), bf16, on the GPU: never zeros."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(size, size, device="cuda", generator=gen)
    x *= torch.exp2(torch.randint(-8, 8, (size, 1), device="cuda", generator=gen).float())
    return x.bfloat16()


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def graph_ms(fn) -> float | str:
    """The median time of CUDA-graph replays of fn: the GPU's time without Python's launch
    overhead (or why the capture failed)."""
    try:
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as error:  # reported in the table, not fatal
        return f"{type(error).__name__}: {error}"[:80]


def copy_bandwidth() -> float:
    """Bytes read plus written per second of a 2 GiB device-to-device copy."""
    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def poison_allocator(nbytes: int) -> None:
    """Leave freed, poisoned blocks of this size in torch's cache for the next allocation."""
    torch.full((nbytes // 2,), 12345.0, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.float(), b.float()
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def fake_quantize_case(name: str, size: int, seed: int, bandwidth: float) -> dict:
    x = random_input(size, seed)
    ref = F.fake_quantize(x, name)
    poison_allocator(x.numel() * 2)
    same = same_bits(K.fake_quantize(x, name), ref)
    del ref
    spec = F.resolve_spec(name)
    passes = 2 if spec.tensor_scale else 1
    nbytes = (passes + 1) * x.numel() * x.element_size()
    bound_ms = nbytes / bandwidth * 1e3
    runs = []
    for config in CONFIGS:
        ms = median_ms(lambda config=config: K.fake_quantize(x, name, config=config))
        runs.append({"config": config.__dict__, "ms": ms, "fraction_of_bound": bound_ms / ms})
    best = min(runs, key=lambda r: r["ms"])
    config = K.LaunchConfig(**best["config"])
    best["graph_ms"] = graph_ms(lambda: K.fake_quantize(x, name, config=config))
    return {"case": f"fake_quantize {name} bf16 {size}x{size}", "same_bits": same,
            "bytes": nbytes, "bound_ms": bound_ms, "best": best, "runs": runs}


def load_torchao():
    """torchao's nvfp4_quantize, or the reason it cannot be imported."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize
        return nvfp4_quantize, None
    except Exception as error:  # the comparison is skipped, and the reason printed
        return None, f"{type(error).__name__}: {error}"


def quantize_case(size: int, seed: int) -> dict:
    name = "torchao_nvfp4_1level"
    x = random_input(size, seed)
    ref = F.quantize(x, name)
    poison_allocator(x.numel() // 2)
    ours = K.quantize_packed(x, name)
    same = torch.equal(ours.packed, ref.packed()) and same_bits(ours.scales, ref.scales)
    runs = []
    for config in CONFIGS:
        ms = median_ms(lambda config=config: K.quantize_packed(x, name, config=config))
        runs.append({"config": config.__dict__, "ms": ms})
    best = min(runs, key=lambda r: r["ms"])
    config = K.LaunchConfig(**best["config"])
    best["graph_ms"] = graph_ms(lambda: K.quantize_packed(x, name, config=config))
    result = {"case": f"quantize_packed {name} bf16 {size}x{size}", "same_bits": same,
              "best": best, "runs": runs}
    nvfp4_quantize, error = load_torchao()
    if nvfp4_quantize is None:
        result["torchao"] = {"error": error}
        return result
    compiled = torch.compile(nvfp4_quantize)
    scales, data = compiled(x, 16, None)
    torchao_same = torch.equal(data.view(torch.uint8).reshape(-1), ref.packed()) and \
        same_bits(scales.float().reshape(ref.scales.shape), ref.scales)
    torchao_ms = median_ms(lambda: compiled(x, 16, None))
    result["torchao"] = {"compiled_ms": torchao_ms, "same_bits": torchao_same,
                         "speedup": torchao_ms / best["ms"]}
    return result


def _ms(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else value


def table(bandwidth: float, fakes: list[dict], quant: dict) -> str:
    lines = [
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
        f"device-to-device copy: {bandwidth / 1e12:.2f} TB/s (bytes read + written)",
        f"{'case':52s} {'same bits':>9s} {'best config (elems/warps/cols)':>31s} {'ms':>7s} "
        f"{'bound ms':>8s} {'of bound':>8s}  graph replay ms",
    ]
    for r in fakes:
        c = r["best"]["config"]
        lines.append(
            f"{r['case']:52s} {str(r['same_bits']):>9s} "
            f"{c['tile_elements']:>19d}/{c['num_warps']}/{c['tile_columns']:<9d} "
            f"{r['best']['ms']:7.4f} {r['bound_ms']:8.4f} {r['best']['fraction_of_bound']:8.1%}"
            f"  {_ms(r['best']['graph_ms'])}"
        )
    c = quant["best"]["config"]
    lines.append(f"{quant['case']:52s} {str(quant['same_bits']):>9s} "
                 f"{c['tile_elements']:>19d}/{c['num_warps']}/{c['tile_columns']:<9d} "
                 f"{quant['best']['ms']:7.4f} {'':17s}  {_ms(quant['best']['graph_ms'])}")
    t = quant["torchao"]
    if "error" in t:
        lines.append(f"torchao nvfp4_quantize: not compared ({t['error']})")
    else:
        lines.append(f"{'torch.compile(torchao nvfp4_quantize), same input':52s} "
                     f"{str(t['same_bits']):>9s} {'':>31s} {t['compiled_ms']:7.4f}   "
                     f"speedup of fp4lab: {t['speedup']:.2f}x")
    lines.append("goals: fake_quantize >= 80% of its bound; quantize_packed >= 3x torchao")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=8192)
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    results = {"bandwidth": copy_bandwidth(), "fake_quantize": []}
    for seed, name in enumerate(("nvfp4", "mxfp4")):
        results["fake_quantize"].append(
            fake_quantize_case(name, args.size, seed, results["bandwidth"]))
        print(json.dumps(results["fake_quantize"][-1]), flush=True)  # in case a later case fails
    results["quantize"] = quantize_case(args.size, seed=2)
    if args.out:
        with open(os.path.join(args.out, "bench_quantize_gpu.json"), "w") as f:
            json.dump(results, f, indent=1)
    print(table(results["bandwidth"], results["fake_quantize"], results["quantize"]))


if __name__ == "__main__":
    main()
