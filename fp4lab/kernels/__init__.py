"""Triton kernels for the GPU: not built yet.

This package will hold fused quantize / fake-quantize kernels for every `QuantSpec` and a
FlashAttention forward and backward with in-kernel quantization driven by an
`AttentionRecipe`, writing the same per-tile statistics as `fp4lab.analysis.Trace` behind a
compile-time flag (see DESIGN.md). Until then `fp4lab.attention(..., backend="triton")`
raises; nothing falls back silently to the reference.
"""
