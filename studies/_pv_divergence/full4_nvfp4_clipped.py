"""Why the fourth run's report shows NVFP4 P "clipped" 0.45 on the FP8 route (nvfp4pv_loss_scaled,
recipe fp8pv_nvfp4pv) and UE5M3 P 0.011: a check for FULL4_MECHANISMS.md.

1. One 1 x 32 tile, a block of 192s and a block of 1e-5s, through `quantize_blocks` and the
   trace's `block_counts`: the second block's scale rounds to 0 under both specs and its x^ is
   0 (flushed); under NVFP4's TE_ENCODE arithmetic its scaled elements are x * FLT_MAX
   (the multiplier min(1 / (s d), FLT_MAX)), so block_counts counted all 16 as clipped; under
   UE5M3's EXACT arithmetic they are x / inf = 0 and none is. (Fixed since: block_counts now
   counts clipping only in blocks with a nonzero stored scale, so part 1 prints 0 for both;
   part 2's split is computed here directly, with the old rule, as the report had it.)
2. The saved nvfp4pv_loss_scaled layer-3 inputs (seed 1) through both recipes with a Trace
   (the report's statistic), then P's tiles as the quantizer saw them (captured from
   `fp4lab.analysis.quantizers._block_quantize`), split into elements of zero-scale blocks and
   true saturation |p| > 6 s d with s > 0 (pooled over elements, not averaged over tiles).

    PYTHONPATH=. python studies/_pv_divergence/full4_nvfp4_clipped.py [ACTIVATIONS]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fp4lab  # noqa: E402
import fp4lab.analysis.quantizers as quantizers  # noqa: E402
from _pv_divergence import arms  # noqa: E402
from fp4lab.formats import NVFP4, NVFP4_UE5M3, quantize_blocks  # noqa: E402
from fp4lab.recipes.tile_stats import block_counts  # noqa: E402


def one_tile() -> None:
    x = torch.tensor([[192.0] * 16 + [1e-5] * 16])
    for spec in (NVFP4, NVFP4_UE5M3):
        b = quantize_blocks(x, spec, axis=-1, batch_dims=x.ndim - 2)
        c = block_counts(b.scaled.clone(), b.amax, b.scales, b.decode, spec, b.layout,
                         per_tile=True)
        print(f"{spec.name} ({spec.arithmetic.value}): block scales {b.scales.tolist()}, "
              f"tiny block's scaled element {float(b.scaled[..., 1, 0]):.3g}, its x^ "
              f"{b.dequantize(torch.float32)[0, 16].item()}, clipped {float(c['clipped']):g} "
              f"of 32, scale underflow {float(c['scale_underflow'].sum()):g} of 2 blocks")


def saved(path: Path) -> None:
    t = load_file(str(path))
    q, k, v, do = (t[n].float() for n in ("q", "k", "v", "do"))
    for arm in ("nvfp4pv", "ue5m3pv"):
        recipe = arms.ARMS[arm].recipe
        trace = fp4lab.Trace()
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        fp4lab.attention(*leaves, recipe, causal=True, trace=trace,
                         backend="reference").backward(do)
        f = trace.to_frame()
        pv = f[f["product"] == "pv"]
        print(f"{recipe.name} trace, P in P V (mean over tiles): flushed "
              f"{pv.a_flushed.mean():.3f}, clipped {pv.a_clipped.mean():.3f}, scale underflow "
              f"{pv.a_scale_underflow.mean():.3f}, scale overflow {pv.a_scale_overflow.mean():.3f}")
        tiles = []
        original = quantizers._block_quantize

        def spy(x, spec, *args, _recipe=recipe, _tiles=tiles, _original=original, **kwargs):
            if spec.name == _recipe.p.name and args[1] and tuple(x.shape[-2:]) == (128, 128):
                _tiles.append(x.detach().clone())  # P (per_tile, a 128 x 128 tile)
            return _original(x, spec, *args, **kwargs)

        quantizers._block_quantize = spy
        try:
            with torch.no_grad():
                fp4lab.attention(q, k, v, recipe, causal=True, backend="reference")
        finally:
            quantizers._block_quantize = original
        spec = recipe.p
        n = dict(nonzero=0, counted=0, zero_scale=0, counted_zero_scale=0, true=0, flushed=0)
        p_max = 0.0
        for x in tiles:
            b = quantize_blocks(x, spec, axis=-1, batch_dims=x.ndim - 2)
            xb = b.layout.to_blocks(x)
            nz = xb != 0
            counted = (b.scaled.abs() > spec.element.max) & nz  # as block_counts did
            zero = (b.scales == 0).unsqueeze(-1) & nz
            d = b.decode if b.decode is not None else torch.ones(())
            top = (spec.element.max * b.scales * d).unsqueeze(-1)
            true = (xb.abs() > top * (1 + 2**-20)) & nz & ~zero
            xq = b.layout.to_blocks(b.dequantize(torch.float32))
            for key, mask in (("nonzero", nz), ("counted", counted), ("zero_scale", zero),
                              ("counted_zero_scale", counted & zero), ("true", true),
                              ("flushed", nz & (xq == 0))):
                n[key] += int(mask.sum())
            p_max = max(p_max, float(x.amax()))
        share = {k: n[k] / n["nonzero"] for k in n if k != "nonzero"}
        print(f"  P tiles as quantized (largest P {p_max:.1f}; pooled over {n['nonzero']} "
              f"nonzeros): counted clipped {share['counted']:.4f}, of which in zero-scale "
              f"blocks {share['counted_zero_scale']:.4f}; in zero-scale blocks "
              f"{share['zero_scale']:.4f}; true saturation (|p| > 6 s d, s > 0) "
              f"{share['true']:.4f}; flushed {share['flushed']:.4f}")


if __name__ == "__main__":
    one_tile()
    act = Path(sys.argv[1] if len(sys.argv) > 1
               else Path(__file__).resolve().parents[2] / "results" / "pv-divergence-full-4"
               / "activations")
    saved(act / "text-nvfp4pv_loss_scaled-seed1-layer3.safetensors")
