"""Quartet II's MS-EDEN scale correction (`Correction.EDEN`), as its CUDA kernel computes it.

What. MS-EDEN (Quartet II, arXiv 2601.22813) quantizes a gradient operand to NVFP4 without
stochastic rounding of the elements. A random Hadamard transform of size 128 along the
reduction axis (signs redrawn every step) spreads each group; elements are rounded to the
nearest E2M1 value; each 16-element block's scale is then multiplied by the EDEN correction
S_b = <v, v> / <v, q(v)>, which makes <x_b, x^_b> = <x_b, x_b> for every block, and the
corrected scale is stochastically rounded into E4M3, so that the scale's own rounding keeps
this in expectation. Over the random rotation the result is unbiased (the paper's claim;
tested here) at a lower variance than element-wise stochastic rounding.

How (the training path: ``kernels/python/quartet2/linear.py`` calls ``quant_had_eden`` in
``kernels/python/quartet2/quant.py`` with ``scale_override = (17 / 16) * 0.93``, which passes
``fp4_max = 6.0 / scale_override`` and ``fp8_max = 256.0`` to
``cutlass_group_transform_128_eden_kernel`` and ``eden_convert_scales_kernel`` in
``kernels/csrc/group_transform_and_eden.cu``; the epilogue is ``eden_rounding`` in
``kernels/csrc/had128_utils.cuh``, the scale rounding ``stochastic_rounding`` in
``kernels/csrc/utils.cuh``). For each block b of the rotated x, all in float32:

1. sigma_b = fl(a_b * fl(1 / c)), c = fl(fp4_max) (`QuantSpec.amax_target`), its mantissa
   truncated to the top 4 bits (``& 0xFFF80000``: round toward zero, one bit more than E4M3);
2. v = fl(x * fl(1 / sigma_b)) (0 for sigma_b = 0), q = E2M1_RN_sat(v) (``cvt`` to nearest);
3. S_b = fl(<v, v> / <v, q>) over the block's 16 elements, 1 where <v, q> = 0;
4. sigma~_b = bf16(fl(sigma_b * S_b)): the kernel writes the corrected scales to a BF16
   scratch buffer, because the tensor scale is not known until every block is done;
5. t = fl(max_b sigma~_b / 256) (``global_scale = max_scale * inv_fp8_max``);
6. s_b = SR(fl(sigma~_b * fl(1 / t))) into E4M3, with 16 random bits k: the 20 bits below
   E4M3's mantissa are compared with 16 k and rounded up iff they exceed it, so
   P(up) = ceil(r / 16) / 2^16 for those bits r (biased up by less than 2^-16 of a step);
   values outside [2^-6, 448] are rounded to nearest (saturating), as the kernel does.

The dequantized value is q * s_b * t, in the rotated domain (the GEMM consumes it there;
fp4lab's dequantize undoes the Hadamard transform, as for every hadamard spec).

How fp4lab draws and sums. The kernel draws k from Philox keyed by a seed per call; fp4lab
takes k_b = floor(2^16 u_b), u_b the uniform at the block's first element (``noise``, or
``generator``'s draw of x's shape), so a result is a function of the noise. The kernel sums
<v, v> and <v, q> with float32 FMAs in two interleaved chains and multiplies by an approximate
reciprocal (``reciprocal_approximate_ftz``) for S_b, 1 / sigma_b and 1 / t; fp4lab sums in
float64, rounds each sum once to float32 and divides correctly rounded: S_b can differ in its
last float32 bits, which the BF16 rounding of step 4 hides almost always. The kernel's FTZ
reciprocal of a subnormal sigma_b is inf (a NaN block); fp4lab sets such a sigma_b to 0 and
flushes the block, as another published copy of ``had128_utils.cuh`` does
(``if (m3_scale < 1.17549435e-38f) m3_scale = 0``). A NaN or inf anywhere
makes t, and so every block, NaN (the kernel's max over the scales' bits picks NaN too).

What differs elsewhere in the release, and what fp4lab does not model:
- The Python reference (``src/models/quantization/quantizers/eden.py``, ``EdenSRQuantizer``
  with ``scale_dtype="e4m3"``) takes scale groups of ``group_dim`` (by default the Hadamard
  size), rounds a_b / t to nearest E4M3 before the correction with
  t = max_b a_b / 256 and the decode factor t * (17 / 16) * scale_override / 6, takes the
  correction over each 128-element Hadamard group instead of each block of 16, and draws its
  scale rounding exactly (``torch.bernoulli`` over the E4M3 neighbours). The Triton kernels
  (``eden_1x16s_fp4_kernel`` in ``src/models/quantization/schemes/quartet_2.py`` and
  ``quantizers/nvfp4_triton.py``) take t = amax / 255.99 / (6 / scale_override) from the
  tensor amax, round scales to nearest E4M3, and correct over 128-element groups too.
- The kernel multiplies bf16 x by a bf16 Hadamard matrix, whose entries bf16(2^-3.5) are
  2^-3.5 * (1 - 1.1e-4); fp4lab's transform is orthonormal, in float32 (float64 for float64
  input), with signs from ``hadamard_seed`` (the release redraws them every backward step:
  pass a fresh seed per step).
"""

from __future__ import annotations

import torch

from fp4lab.formats.float_format import FloatFormat
from fp4lab.formats.rounding import Rounding, round_to_format
from fp4lab.formats.spec import QuantSpec

__all__ = ["corrected_scales", "stored_scales"]

_MANTISSA_4 = -(1 << 19)  # 0xFFF80000 as int32: sign, exponent and 4 mantissa bits
_NOISE_BITS = 16  # the kernel's random bits per scale (lo or hi half of a Philox word)


def corrected_scales(blocks: torch.Tensor, amax: torch.Tensor, spec: QuantSpec):
    """Steps 1-4 on blocks (..., blocks, 16) with amax (..., blocks): (sigma, v, q, sigma~),
    float32; sigma~ is NaN where the block holds NaN or inf."""
    finite = torch.isfinite(amax)
    sigma = _pre_scale(torch.where(finite, amax, 0.0), spec.amax_target)
    factor = torch.where(sigma > 0, 1.0 / sigma, 0.0)
    v = blocks.float() * factor.unsqueeze(-1)
    q = round_to_format(v, spec.element, rounding=Rounding.NEAREST_EVEN, saturate=True)
    v_v = (v.double() * v.double()).sum(-1).float()
    v_q = (v.double() * q.double()).sum(-1).float()
    correction = torch.where(v_q == 0, 1.0, v_v / v_q)
    corrected = (sigma * correction).to(torch.bfloat16).float()
    return sigma, v, q, torch.where(finite, corrected, torch.nan)


def _pre_scale(amax: torch.Tensor, amax_target: float) -> torch.Tensor:
    """sigma = RTZ_4(fl(a * fl(1 / fl(c)))); a float32 subnormal sigma becomes 0."""
    one = torch.ones((), dtype=torch.float32, device=amax.device)
    inverse = one / torch.tensor(amax_target, dtype=torch.float32, device=amax.device)
    bits = (amax * inverse).view(torch.int32) & _MANTISSA_4
    sigma = bits.view(torch.float32)
    return torch.where(sigma >= torch.finfo(torch.float32).tiny, sigma, 0.0)


def stored_scales(
    corrected: torch.Tensor, t: torch.Tensor, uniforms: torch.Tensor, fmt: FloatFormat
) -> torch.Tensor:
    """Step 6: fl(sigma~ * fl(1 / t)) stochastically rounded into `fmt` with the random
    bits floor(2^16 u) of the uniforms u (one per block)."""
    inverse = torch.clamp(torch.where(t != 0, 1.0 / t, 0.0), max=torch.finfo(torch.float32).max)
    pre = corrected * inverse
    k = torch.floor(uniforms * (1 << _NOISE_BITS)).to(torch.int32)
    return _kernel_stochastic_rounding(pre, k, fmt)


def _kernel_stochastic_rounding(pre: torch.Tensor, k: torch.Tensor, fmt: FloatFormat):
    """The kernel's ``stochastic_rounding``: the float32 bits below `fmt`'s mantissa set to
    all ones (round up) iff they exceed k shifted to the top of that field, else cleared,
    then rounded to nearest; values outside [min_normal, max] are rounded to nearest only."""
    dropped = 23 - fmt.mbits  # 20 for E4M3
    mask = (1 << dropped) - 1
    bits = pre.view(torch.int32)
    up = (bits & mask) > (k << (dropped - _NOISE_BITS))
    moved = torch.where(up, bits | mask, bits & ~mask).view(torch.float32)
    in_range = (pre.abs() <= fmt.max) & (pre.abs() >= fmt.min_normal)
    moved = torch.where(in_range, moved, pre)
    return round_to_format(moved, fmt, rounding=Rounding.NEAREST_EVEN, saturate=True).float()
