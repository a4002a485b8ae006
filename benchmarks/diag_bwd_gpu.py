"""Which backward change moves a recipe's gradients from the simulation's on the GPU: the
gradients at the shape of `test_both_backends_default_to_the_same_tiles` (B1 H2 S160 D32, the
recipe's default tiles; inputs of their own, from a CUDA generator, not the test's) against
the reference, with the in-dot sums on (the default) and off, and the backward kernels at 2
and 3 stages; rows printed as JSON.

    python benchmarks/diag_bwd_gpu.py [--recipes nvfp4 ...]
"""

from __future__ import annotations

import argparse
import json

import torch

import fp4lab
from fp4lab.kernels import backend, flash_bwd


def inputs(seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(1, 2, 160, 32, device="cuda", generator=g).bfloat16() for _ in range(4)]


def grads(name, q, k, v, do, backend_name, **kw):
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fp4lab.attention(*leaves, name, backend=backend_name, **kw).backward(do)
    return [x.grad.float() for x in leaves]


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["nvfp4", "fa4fp4_causal"])
    args = parser.parse_args()
    saved = flash_bwd._sums_in_dot
    for name in args.recipes:
        q, k, v, do = inputs(17)
        want = grads(name, q, k, v, do, "reference")
        for in_dot in (True, False):
            for stages in (None, 2, 3):
                if not in_dot:
                    flash_bwd._sums_in_dot = lambda *a, **kw: ({}, {})
                backend.LAUNCH["backward"] = None if stages is None else (8, stages)
                try:
                    got = grads(name, q, k, v, do, "triton")
                    row = dict(recipe=name, in_dot=in_dot, stages=stages,
                               **{n: rel(g, w) for n, g, w in zip(("dq", "dk", "dv"), got, want,
                                                                  strict=True)})
                except Exception as err:  # noqa: BLE001 - reported as the row
                    row = dict(recipe=name, in_dot=in_dot, stages=stages, error=repr(err)[:200])
                finally:
                    flash_bwd._sums_in_dot = saved
                    backend.LAUNCH["backward"] = None
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
