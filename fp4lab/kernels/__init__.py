"""Triton kernels for the GPU (see DESIGN.md).

What exists:

- `quantize`: fused `fake_quantize`, `quantize` and `quantize_packed` for every block format
  the registry can hold, bit for bit `fp4lab.formats`' reference (deterministic modes, and
  stochastic rounding from the shared Philox stream);
- `random`: Philox4x32-10 in Triton, bit-identical to `fp4lab.formats.philox`;
- `flash`: FlashAttention's forward with P quantized in registers along the keys, driven by
  an `fp4lab.recipes.AttentionRecipe`;
- `gluon_fwd` (with `_gluon_fwd_kernel`): the same forward for block-format P recipes on
  Hopper in Gluon, its products overlapped with the softmax (FlashAttention-3's
  intra-warpgroup order), bit for bit the Triton kernel's; `flash.attention_forward` hands it
  the calls `gluon_fwd.unsupported` admits (`FP4LAB_GLUON=0` turns it off);
- `flash_bwd`: FlashAttention-2's backward (a preprocess for D, a dK/dV kernel per key tile,
  a dQ kernel per query tile) with P and dS quantized in registers as the recipe's backward
  fields say: the flash, straight-through and forward-exact backwards, and Hadamard-rotated
  operands (Quartet II's MS-EDEN, `croissattn_eden`);
- `backend`: `fp4lab.attention(..., backend="triton")`, which quantizes Q, K, V (and dO)
  with `quantize` and runs `flash` and, through autograd, `flash_bwd` (their warps and
  pipeline stages by tile size, `launch_options`);
- `layout`: V's bytes transposed to the key-major layout FP8 P V reads (`key_major`);
- `launch`: a kernel launched again for a call signature it ran before by calling its
  compiled kernel directly, past `triton.jit`'s argument binding (`FP4LAB_DIRECT_LAUNCH=0`
  turns it off);
- `trace`: the per-tile statistics of the forward and the backward (the `flash` and
  `flash_bwd` kernels compiled with their TRACE flag write them to small buffers) as the
  simulation's `Trace` schema, so that `trace=Trace()` fills the same frame on either
  backend; its docstring says where each column comes from and lists those it does not
  write (``prod_err`` of pv, dv, dq, dk, the backward products' ``prod_nan``,
  ``p_fwd_mismatch``).

Not yet: the recipe mechanisms `fp4lab.kernels.flash` and
`fp4lab.kernels.backend.check_backward` list; asking for them raises `NotImplementedError`
naming them, never a silent fallback to the reference. The modules here import `triton`,
which is not a dependency of the CPU install; nothing here is imported eagerly.
"""
