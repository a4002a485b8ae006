"""Which setting makes the traced forward's P statistics differ from the simulation's on a GPU.

Each variant runs in its own process (module-level switches such as `flash.HW_E4M3` are read
when a kernel compiles): the traced forward plus backward of B1 H4 S1024 D128 bf16 (S64 on a
CPU under TRITON_INTERPRET=1) through the reference and the Triton backend, printing per
variant, for each float column of the pv rows, [NaN count, mean]. Variants: `base`; `no_hw`
(HW_E4M3 off); `b64` (64 x 64 tiles); `w4` (4 warps); `full` (non-causal); `fa4_base` and
`fa4_no_hw` (fa4fp4_causal; the others are fa3_fp8).

On 2026-12-02 (benchmarks/RESULTS.md, "E4M3 by the GPU's conversion") this found P's
statistics wrong wherever `_round` made E4M3 by an fp8 round trip, which it no longer does:
`no_hw` now only turns off the direct cast of P^ into the FP8 dot.

    python3 benchmarks/diag_trace_nan.py            # every variant, side by side
    python3 benchmarks/diag_trace_nan.py fa4_base   # one
"""
import json
import subprocess
import sys

VARIANTS = ["base", "no_hw", "b64", "w4", "full", "fa4_base", "fa4_no_hw"]


def one(variant):
    import torch
    import triton.language as tl

    import fp4lab
    from fp4lab import Trace
    from fp4lab.kernels import backend, flash

    if "no_hw" in variant:
        flash.HW_E4M3 = tl.constexpr(False)
    if variant == "w4":
        backend.LAUNCH["forward"] = (4, 3)
        backend.LAUNCH["backward"] = (4, 2)
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    n = 1024 if DEV == "cuda" else 64
    recipe = "fa4fp4_causal" if variant.startswith("fa4") else "fa3_fp8"
    opts = dict(causal=variant != "full")
    if variant == "b64":
        opts.update(block_m=64, block_n=64)
    if DEV == "cpu":
        opts.update(block_m=32, block_n=32)
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 4, n, 128, generator=g).to(DEV, torch.bfloat16) for _ in "qkvd")
    out = {}
    for name, be in (("ref", "reference"), ("tri", "triton")):
        t = Trace()
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        o = fp4lab.attention(*leaves, recipe, backend=be, trace=t, **opts)
        o.backward(do)
        f = t.to_frame()
        pv = f[f["product"] == "pv"]
        out[name] = {c: [int(pv[c].isna().sum()), float(pv[c].mean())]
                     for c in pv.columns if pv[c].dtype.kind == "f"}
        out[name]["o_nan"] = int(o.isnan().sum())
    return out


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(json.dumps(one(sys.argv[1])))
        sys.exit(0)
    procs = {v: subprocess.Popen([sys.executable, __file__, v], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for v in VARIANTS}
    for v, p in procs.items():
        stdout, stderr = p.communicate(timeout=240)
        try:
            res = json.loads(stdout.strip().splitlines()[-1])
        except Exception:
            res = {"error": stderr[-3000:]}
        print(v, json.dumps(res), flush=True)
