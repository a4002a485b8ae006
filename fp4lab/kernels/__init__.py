"""Triton kernels for the GPU (being built; see DESIGN.md).

This package holds the GPU path: fused quantize / fake-quantize kernels for every block
format and a FlashAttention forward and backward with in-kernel quantization driven by an
`fp4lab.recipes.AttentionRecipe`, writing the same per-tile statistics as the simulation
path (`fp4lab.recipes.Trace`) behind a compile-time flag. What exists today: `random`, the
counter-based Philox4x32 generator in Triton, bit-identical to `fp4lab.formats.philox`.
Until the attention kernels exist `fp4lab.attention(..., backend="triton")` raises; nothing
falls back silently to the reference. The modules here import `triton`, which is not a
dependency of the CPU install; nothing here is imported eagerly.
"""
