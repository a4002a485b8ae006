"""Block quantization: `quantize` to codes and scales, `QuantizedTensor.dequantize`,
`fake_quantize`.

The pipeline, for a `QuantSpec` and a tensor x:

1. optional random Hadamard transform along the quantized axis (x @ diag(signs) H / sqrt(n));
2. cut x into blocks (1-D along `axis`, 2-D tiles over the last two dims, or the whole
   tensor), padding a partial last block with zeros, which leaves its amax unchanged;
3. block amax a and, with a second-level scale, tensor amax A;
4. block scales from the spec's `ScaleRule` in float32, in the order its `ScaleArithmetic`
   prescribes, rounded into the scale format (alpha-grid rules: fl(2^E / M_e); a fixed
   scale: its constant);
5. elements divided (or multiplied by the reciprocal, as the arithmetic says) in the input's
   working precision (float64 for float64 input, float32 otherwise), rounded into the element
   format with the spec's rounding, saturating at +-max; then encoded.

`Correction.EDEN` replaces steps 4-5 by Quartet II's chain (`fp4lab.formats.eden`, float32):
elements rounded first, the block scales corrected from them, then the tensor scale, then the
stochastic rounding of the stored scales.

Dequantization is (code value * block scale) * tensor scale in float32, then the inverse
Hadamard transform. NaN or inf in a block: see `ScaleArithmetic` (EXACT gives the block a
NaN scale, as OCP MX specifies, so the whole block dequantizes to NaN).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4lab.formats import eden, fused_rounding
from fp4lab.formats.float_format import FloatFormat, _pow2
from fp4lab.formats.interop import pack_codes, to_ml_dtypes, to_torch, unpack_codes
from fp4lab.formats.registry import get
from fp4lab.formats.rounding import Rounding, _check_tensor, _uniforms, round_to_format
from fp4lab.formats.spec import Correction, QuantSpec, ScaleArithmetic, ScaleRule

__all__ = [
    "QuantizedTensor", "BlockQuantized", "quantize", "quantize_blocks", "fake_quantize",
    "resolve_spec", "hadamard_matrix",
]

_FLT_MAX = torch.finfo(torch.float32).max


def resolve_spec(spec: QuantSpec | str) -> QuantSpec:
    """A QuantSpec from itself or its registered name."""
    if isinstance(spec, QuantSpec):
        return spec
    if isinstance(spec, str):
        return get(spec, QuantSpec)
    raise TypeError(f"spec must be a QuantSpec or a registered name, got {type(spec).__name__}")


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes and scales of a block-quantized tensor.

    Attributes:
        codes: element codes (uint8 for formats of up to 8 bits), with x's shape.
        scales: float32 block scales (decode multipliers: value = code * scale * tensor
            scale). 1-D blocks: x's shape with the quantized axis replaced by the number of
            blocks; 2-D tiles: x.shape[:-2] + (row tiles, column tiles); per-tensor: a 0-dim
            tensor. Alpha-grid rules store fl(2^E / M_e), not the E8M0 value 2^E (E is
            log2(scale * M_e) rounded to an integer); a fixed-scale format stores its constant.
        tensor_scale: float32 0-dim per-tensor decode scale, or None.
        spec: the recipe.
        axis: the quantized axis (non-negative).
        batch_dims: leading dims that index independent tensors (see `quantize`); scales
            and tensor_scale then carry those dims first.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    spec: QuantSpec
    axis: int
    batch_dims: int = 0

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def element_values(self) -> torch.Tensor:
        """The element codes' values in float32 (before scaling)."""
        return self.spec.element.decode(self.codes)

    def expanded_scales(self) -> torch.Tensor:
        """The block scale of every element, float32, x's shape."""
        return _layout(self.spec, self.shape, self.axis, self.batch_dims).expand(self.scales)

    def packed(self) -> torch.Tensor:
        """The codes packed densely into bytes (two FP4 codes a byte; see interop)."""
        return pack_codes(self.codes, self.spec.element.bits)

    @classmethod
    def from_packed(
        cls, packed: torch.Tensor, *, shape, scales, tensor_scale, spec: QuantSpec, axis: int,
        batch_dims: int = 0,
    ) -> QuantizedTensor:
        """Rebuild a QuantizedTensor from `packed()` bytes and its scales."""
        spec = resolve_spec(spec)
        codes = unpack_codes(packed, spec.element.bits, tuple(shape), spec.element.code_dtype)
        return cls(codes, scales, tensor_scale, spec, axis, batch_dims)

    def to_torch(self) -> torch.Tensor:
        """The element codes as torch's float8 / float4_e2m1fn_x2 dtype (no scales applied)."""
        return to_torch(self.codes, self.spec.element)

    def to_ml_dtypes(self):
        """The element codes as a numpy array of ml_dtypes' type (no scales applied)."""
        return to_ml_dtypes(self.codes, self.spec.element)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(code value * block scale) * tensor scale in float32, inverse Hadamard, to dtype."""
        out = self.element_values() * self.expanded_scales()
        if self.tensor_scale is not None:
            out = out * self.tensor_scale
        return _finish(out, self.spec, self.axis, dtype)


def quantize(
    x: torch.Tensor,
    spec: QuantSpec | str,
    *,
    axis: int = -1,
    rounding: Rounding | str | None = None,
    generator: torch.Generator | int | None = None,
    batch_dims: int = 0,
    noise: torch.Tensor | None = None,
) -> QuantizedTensor:
    """Block-quantize x with `spec` (a QuantSpec or a registered name).

    Args:
        x: floating-point tensor (float16, bfloat16, float32, float64).
        spec: the block-scaling recipe.
        axis: the axis 1-D blocks (and the Hadamard transform) run along. 2-D tiles cover the
            last two dims; axis must then be one of them, and the tile's second extent runs
            along it. Ignored (but checked) for per-tensor recipes.
        rounding: element rounding; None uses the spec's.
        generator: torch.Generator or int seed, required for stochastic rounding.
        batch_dims: the leading `batch_dims` dims index independent tensors: the per-tensor
            amax, the second-level scale and a per-tensor spec's one scale are taken for each
            of them (e.g. each (block_m, block_n) tile of a batch of attention tiles, as a
            fused kernel sees them). Blocks never span them; axis must not be one of them.
        noise: uniforms in [0, 1) of x's shape for stochastic rounding, used instead of
            drawing from `generator` (so that the caller decides which element gets which
            draw, e.g. by position); element i of x (of the rotated x, with a Hadamard
            transform) is rounded with noise[i]. With `Correction.EDEN` (nearest elements,
            stochastic scales) the uniform at each block's first element rounds its scale.
    """
    spec = resolve_spec(spec)
    blocked = quantize_blocks(
        x, spec, axis=axis, rounding=rounding, generator=generator, batch_dims=batch_dims,
        noise=noise,
    )
    layout = blocked.layout
    codes = layout.from_blocks(spec.element.encode(blocked.values))
    tensor_scale = None if blocked.decode is None else layout.tensor_scale_out(blocked.decode)
    scales = layout.scales_out(blocked.scales)
    return QuantizedTensor(codes, scales, tensor_scale, spec, layout.axis, batch_dims)


@dataclass
class BlockQuantized:
    """The pipeline's intermediates in block layout, for instrumentation (`quantize_blocks`).

    Attributes:
        layout: maps x's layout to and from (..., blocks, block elements).
        amax: float32 block amax (..., blocks), after the Hadamard transform if any.
        scaled: the elements after scaling, before rounding (..., blocks, block elements).
        values: the rounded element values, same shape.
        scales: float32 block scales (..., blocks); for a fixed-scale format the constant d
            (then decode is None), so that the ideal scale amax / (M_e * d) and the clipped
            count |scaled| > M_e read as for any other format.
        decode: the float32 second-level decode scale, broadcastable to `scales`, or None
            (EDEN: its tensor scale t).
        dequantized: where the steps after the scales ran as one compiled pass
            (``quantize_blocks(..., fused=True)``): (value * block scale) * decode in x's
            layout, float32; `scaled` and `values` are then None.
        clipped: with `dequantized`, each block's count of scaled elements past the element
            format's largest value, float32 (..., blocks); else None.
    """

    layout: object
    amax: torch.Tensor
    scaled: torch.Tensor | None
    values: torch.Tensor | None
    scales: torch.Tensor
    decode: torch.Tensor | None
    dequantized: torch.Tensor | None = None
    clipped: torch.Tensor | None = None

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """(value * block scale) * decode in float32, back in x's layout, inverse Hadamard,
        in `dtype`: the bits of ``quantize(...).dequantize(dtype)``. Consumes `values`."""
        if self.dequantized is not None:
            return _finish(self.dequantized, self.layout.spec, self.layout.axis, dtype)
        out = self.values.float().mul_(self.scales.unsqueeze(-1))  # ours: in place
        if self.decode is not None:
            out.mul_(self.decode.unsqueeze(-1))
        return _finish(self.layout.from_blocks(out), self.layout.spec, self.layout.axis, dtype)


def _finish(out: torch.Tensor, spec: QuantSpec, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """The last step of dequantization: undo the Hadamard transform (in float64 for float64
    output), then cast to dtype."""
    if spec.hadamard is not None:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        out = _hadamard(out.to(work), spec, axis, inverse=True)
    return out.to(dtype)


def quantize_blocks(
    x: torch.Tensor,
    spec: QuantSpec | str,
    *,
    axis: int = -1,
    rounding: Rounding | str | None = None,
    generator: torch.Generator | int | None = None,
    batch_dims: int = 0,
    noise: torch.Tensor | None = None,
    fused: bool = False,
) -> BlockQuantized:
    """Steps 1-5 of the pipeline, keeping what instrumentation needs (block amax, scaled
    elements, scales). Arguments as `quantize`; ``.dequantize(dtype)`` is fake_quantize.
    With `fused`, step 5 and the dequantization run as one compiled pass where
    `fp4lab.formats.fused_rounding` applies (then `dequantized` and `clipped` are set in
    place of `scaled` and `values`; the same bits)."""
    spec = resolve_spec(spec)
    _check_tensor(x, "x")
    axis = _normalize_axis(axis, x.ndim, spec, batch_dims)
    rounding = _element_rounding(spec, rounding)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    xw = x.detach().to(work)
    if spec.hadamard is not None:
        xw = _hadamard(xw, spec, axis, inverse=False)
    layout = _layout(spec, x.shape, axis, batch_dims)
    blocks = layout.to_blocks(xw)  # (..., blocks, block elements)
    amax = _block_amax(blocks, xw, layout).float()
    noise_x = noise
    noise = _noise_blocks(noise, x, layout)
    if spec.correction is Correction.EDEN:
        if noise is None:
            noise = layout.to_blocks(_uniforms(x, generator, None))
        return _eden(layout, blocks, amax, spec, noise[..., 0], batch_dims)
    decode, encode = _tensor_scales(amax, spec, batch_dims)
    if fused and _fuses(spec, xw, layout, rounding, noise_x):
        out = _fused_steps(xw, layout, amax, decode, encode, spec, rounding, noise_x)
        if out is not None:
            return out
    scales, scaled = _scale(blocks, amax, decode, encode, spec)
    values = round_to_format(
        scaled, spec.element, rounding=rounding, saturate=True, generator=generator,
        sr_bits=spec.sr_bits, noise=noise,
    )
    return BlockQuantized(layout, amax, scaled, values, scales, decode)


def _element_rounding(spec: QuantSpec, rounding) -> Rounding:
    """The element rounding: the spec's unless overridden (EDEN's elements are nearest)."""
    rounding = spec.rounding if rounding is None else Rounding.parse(rounding)
    if spec.correction is Correction.EDEN and rounding is not Rounding.NEAREST_EVEN:
        raise ValueError(f"rounding must be nearest_even for correction=eden (spec "
                         f"{spec.name}), got {rounding.value}")
    return rounding


def _fuses(spec: QuantSpec, xw: torch.Tensor, layout, rounding: Rounding, noise) -> bool:
    """Whether the compiled pass may take step 5: 1-D blocks cutting their axis evenly,
    block scales by a rule and elements multiplied by a factor (`_element_factor`), no
    Hadamard transform, a format and rounding `fused_rounding` takes (stochastic: float32
    uniforms given, exact ones)."""
    return (
        isinstance(layout, _Blocks1D)
        and layout.nblocks * layout.size == layout.n
        and spec.hadamard is None
        and spec.fixed_scale is None
        and not spec.scale_rule.alpha_grid
        and spec.arithmetic not in _DIVIDING
        and xw.dtype == torch.float32
        and xw.is_contiguous()
        and xw.numel() >= fused_rounding.MIN_ELEMENTS
        and fused_rounding.takes(spec.element, rounding)
        and (rounding is not Rounding.STOCHASTIC
             or (spec.sr_bits is None and noise is not None and noise.dtype == torch.float32))
    )


def _fused_steps(xw, layout, amax, decode, encode, spec: QuantSpec, rounding, noise):
    """Step 5 and the dequantization as one compiled pass in x's own layout (blocks along
    the last dim as (rows, size), along another as (P, size, C), each block a column of
    size elements), or None where it does not run: blocks or factors not all finite (NaN
    and inf take the steps), or `fused_rounding` declining."""
    if not _all_finite(amax):
        return None
    scaled_amax, t = _scale_input(amax, decode, encode, spec)
    scales = _round_scale(scaled_amax, t, spec)
    factor = _element_factor(scales, t, decode, spec)[0]
    if not _all_finite(factor):
        return None
    axis, size = layout.axis, layout.size
    if axis == xw.ndim - 1:
        shape = (-1, size)
        per_block = lambda f: f.expand(amax.shape).reshape(-1, 1).contiguous()  # noqa: E731
        back = lambda c: c.view(amax.shape)  # noqa: E731
    else:
        moved = amax.movedim(-1, axis).shape  # one per block, in x's layout
        inner = math.prod(xw.shape[axis + 1:])
        shape = (-1, size, inner)
        per_block = lambda f: (f.expand(amax.shape).movedim(-1, axis)  # noqa: E731
                               .reshape(-1, 1, inner).contiguous())  # (P, 1, C)
        back = lambda c: c.view(moved).movedim(axis, -1)  # noqa: E731
    u = noise.contiguous().view(shape) if noise is not None else None
    out = fused_rounding.fused_block_values(
        xw.view(shape), per_block(factor), per_block(scales),
        per_block(decode) if decode is not None else None, spec.element, rounding, u,
        float(spec.element.max),
    )
    if out is None:
        return None
    values, clipped = out
    return BlockQuantized(layout, amax, None, None, scales, decode, values.view(xw.shape),
                          back(clipped))


def _all_finite(t: torch.Tensor) -> bool:
    """Whether a non-empty tensor of non-negative numbers (or NaN, inf) is all finite: its
    maximum is, as NaN propagates through it (one reduction, where isfinite and all take a
    pass each)."""
    return bool(t.max() < math.inf)


def _noise_blocks(noise, x: torch.Tensor, layout) -> torch.Tensor | None:
    """The caller's uniforms in block layout (float32 kept, others in float64: see
    `round_to_format`), checked against x's shape."""
    if noise is None:
        return None
    if not isinstance(noise, torch.Tensor) or noise.shape != x.shape:
        shape = tuple(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
        raise ValueError(f"noise must be a tensor of x's shape {tuple(x.shape)}, got {shape}")
    dtype = torch.float32 if noise.dtype == torch.float32 else torch.float64
    return layout.to_blocks(noise.to(device=x.device, dtype=dtype))


def _eden(layout, blocks, amax, spec: QuantSpec, uniforms, batch_dims: int) -> BlockQuantized:
    """Quartet II's MS-EDEN (`Correction.EDEN`, `fp4lab.formats.eden`): block scales
    corrected from the rounded elements, a tensor scale from the corrected scales, the
    stored scales stochastically rounded with the block's first uniform."""
    sigma, scaled, values, corrected = eden.corrected_scales(blocks, amax, spec)
    decode = _amax_beyond(corrected, batch_dims) * 2.0**-8  # t = max_b sigma~_b / 256
    scales = eden.stored_scales(corrected, decode, uniforms, spec.scale)
    return BlockQuantized(layout, amax, scaled, values, scales, decode)


def _block_amax(blocks: torch.Tensor, x: torch.Tensor | None = None, layout=None) -> torch.Tensor:
    """max |x| over each block, the last dim of `blocks` (x in block layout; `x` and `layout`,
    where given, x in its own layout and the map between them; NaN propagates; +0 for
    all-zero and empty blocks). All ways below are exact. 1-D blocks along a dim
    other than the last, cutting it evenly, are reduced in x's own layout (..., blocks,
    size, inner): the elements one maximum compares then lie side by side, where in block
    layout each block is strided (12x faster on the CPU for blocks of 16 rows of a
    contiguous tile). Otherwise, on the CPU, a max-pool over rows of blocks is 2.5x faster
    than amax over a last dim of 16 (and aminmax is slower still). Elsewhere amax: CUDA's
    max-pool reads each window on one thread, so a whole-tensor block (2^21 elements) would
    be read serially."""
    if blocks.shape[-1] == 0 or blocks.numel() == 0:
        return blocks.new_zeros(blocks.shape[:-1])
    fused = _fused_amax(x, layout)
    if fused is not None:
        return fused
    if (isinstance(layout, _Blocks1D) and x is not None and layout.axis != x.ndim - 1
            and layout.nblocks * layout.size == layout.n):
        rows = x.abs().unflatten(layout.axis, (layout.nblocks, layout.size))
        amax = rows.amax(dim=layout.axis + 1).movedim(layout.axis, -1).contiguous()
        return amax.masked_fill_(amax.isnan(), math.nan)  # its vector max gives NaN all ones
    magnitudes = blocks.abs()
    if (magnitudes.device.type != "cpu" or magnitudes.ndim < 2
            or not magnitudes.is_contiguous()):
        return magnitudes.amax(dim=-1)
    rows = magnitudes.view(-1, 1, blocks.shape[-2] * blocks.shape[-1])
    return torch.nn.functional.max_pool1d(rows, blocks.shape[-1]).view(blocks.shape[:-1])


def _fused_amax(x: torch.Tensor | None, layout) -> torch.Tensor | None:
    """The block amax of 1-D blocks cutting their axis evenly by one compiled pass
    (`fused_rounding.block_amax`) in x's own layout, or None (then `_block_amax`'s ways)."""
    if not (isinstance(layout, _Blocks1D) and x is not None and x.is_contiguous()
            and layout.nblocks * layout.size == layout.n):
        return None
    axis, size = layout.axis, layout.size
    if axis == x.ndim - 1:
        amax = fused_rounding.block_amax(x.view(-1, size))  # (rows,)
        return amax.view(*x.shape[:-1], layout.nblocks) if amax is not None else None
    amax = fused_rounding.block_amax(x.view(-1, size, math.prod(x.shape[axis + 1:])))
    if amax is None:
        return None
    moved = (*x.shape[:axis], layout.nblocks, *x.shape[axis + 1:])  # one per block
    return amax.view(moved).movedim(axis, -1).contiguous()


def _fake_quantize(x, spec: QuantSpec, axis, rounding, generator, batch_dims, noise=None):
    """quantize(...).dequantize(x.dtype) without building codes: the same float32 products."""
    blocked = quantize_blocks(
        x, spec, axis=axis, rounding=rounding, generator=generator, batch_dims=batch_dims,
        noise=noise,
    )
    return blocked.dequantize(x.dtype)


class _FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, axis, rounding, generator, batch_dims, noise):
        return _fake_quantize(x, spec, axis, rounding, generator, batch_dims, noise)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    spec: QuantSpec | str,
    *,
    axis: int = -1,
    rounding: Rounding | str | None = None,
    generator: torch.Generator | int | None = None,
    batch_dims: int = 0,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """quantize then dequantize to x's dtype (the same bits as ``quantize(...).dequantize``);
    the gradient passes straight through. Arguments as `quantize`."""
    return _FakeQuantize.apply(x, resolve_spec(spec), axis, rounding, generator, batch_dims, noise)


# -- scale arithmetic ---------------------------------------------------------------------------
def _scale(blocks, amax, decode, encode, spec: QuantSpec):
    """Block scales (float32) and the scaled elements, in the spec's arithmetic."""
    if spec.fixed_scale is not None:
        return _fixed_scale(blocks, amax, spec)
    if spec.scale_rule.alpha_grid:
        return _alpha_scale(blocks, amax, spec)
    scaled_amax, t = _scale_input(amax, decode, encode, spec)
    s = _round_scale(scaled_amax, t, spec)
    return s, _scaled_elements(blocks, s, t, decode, spec)


def _scale_input(amax, decode, encode, spec: QuantSpec):
    """(a', t): the scale's input, a' for power-of-two rules, t = a'/M_e for the others."""
    arith, m_e = spec.arithmetic, spec.element.max
    if arith is ScaleArithmetic.TE_ENCODE:
        t = torch.clamp(amax * (encode * (1.0 / torch.tensor(m_e))), max=_FLT_MAX)
        return amax * encode, t
    if arith is ScaleArithmetic.RECIPROCAL:
        return amax * encode, _true_div(amax, m_e) * encode  # encode is 1 without a tensor scale
    scaled_amax = amax / decode if decode is not None else amax
    if arith is ScaleArithmetic.TORCHAO_DECODE and decode is not None:
        return scaled_amax, _true_div(amax, m_e) / decode
    return scaled_amax, _true_div(scaled_amax, m_e)


def _scaled_elements(blocks, s, t, decode, spec: QuantSpec) -> torch.Tensor:
    """The elements divided by (or multiplied by the reciprocal of) their block's scale."""
    factor, divides = _element_factor(s, t, decode, spec)
    factor = factor.unsqueeze(-1).to(blocks.dtype)
    return blocks / factor if divides else blocks * factor


_DIVIDING = (ScaleArithmetic.EXACT, ScaleArithmetic.DIVIDE_UNROUNDED)


def _element_factor(s, t, decode, spec: QuantSpec):
    """(f, divides): each block's divisor (divides) or multiplier of its elements, float32
    (..., blocks)."""
    arith = spec.arithmetic
    d = decode if decode is not None else torch.ones((), dtype=torch.float32)
    if arith in _DIVIDING:
        denom = (s if arith is ScaleArithmetic.EXACT else t) * d
        return torch.where(denom == 0, torch.inf, denom), True  # a zero scale flushes its block
    if arith is ScaleArithmetic.TE_ENCODE:
        factor = torch.clamp(1.0 / (s * d), max=_FLT_MAX)
        if decode is None:  # fp4-fa4's Q/K quantizer: a zero scale's multiplier is 0
            factor = torch.where(s == 0, 0.0, factor)
    elif arith is ScaleArithmetic.RECIPROCAL and decode is None:
        factor = torch.where(s == 0, 0.0, 1.0 / s)  # SageAttention: SFValueInv = 0
    elif arith is ScaleArithmetic.RECIPROCAL:
        b = s * d
        factor = 1.0 / torch.where(b > 0, b, 1.0)  # FastVideo: where(block_decode > 0, ., 1)
    else:
        factor = (1.0 / d) / s if decode is not None else 1.0 / s
    return factor, False


def _fixed_scale(blocks, amax, spec: QuantSpec):
    """One constant decode scale d: scales of d everywhere, elements x / d (correctly
    rounded; exact for a power of two)."""
    d = spec.fixed_scale
    scales = torch.full(amax.shape, d, dtype=torch.float32, device=amax.device)
    return scales, blocks / _device_scalar(d, blocks)


def _alpha_scale(blocks, amax, spec: QuantSpec):
    """The alpha-grid rules (`ScaleRule.alpha_grid`): s = fl(2^E / M_e), elements
    fl(x * M_e) * 2^-E; zero and subnormal amax flush, NaN and inf give a NaN scale."""
    m_e = spec.element.max
    e = _alpha_exponent(amax, spec.scale_rule, spec.scale)
    flush = ~(amax >= torch.finfo(torch.float32).tiny) & torch.isfinite(amax)  # 0 or subnormal
    s = _true_div(_pow2(e).float(), m_e)
    s = torch.where(flush, 0.0, torch.where(torch.isfinite(amax), s, torch.nan))
    step = torch.where(flush, 0.0, _pow2(-e)).to(blocks.dtype)  # 2^-E, exact; 0 flushes
    return s, (blocks * m_e) * step.unsqueeze(-1)


def _alpha_exponent(a: torch.Tensor, rule: ScaleRule, fmt: FloatFormat) -> torch.Tensor:
    """E = floor(log2 a) + up, up from r = a / 2^floor(log2 a) as the rule says, clamped to
    the powers of two of the scale format. Non-positive and non-finite a read as 1."""
    mant, ex = torch.frexp(torch.where(torch.isfinite(a) & (a > 0), a, 1.0))  # a = mant * 2^ex
    e = ex.to(torch.int64) - 1  # floor(log2 a)
    r = 2 * mant  # in [1, 2), exact
    if rule is ScaleRule.ALPHA_CEIL:
        up = r > 1
    elif rule is ScaleRule.ALPHA_MSE:
        up = r >= 1.203125  # BF16 mantissa field >= 0x1a
    elif rule is ScaleRule.ALPHA_HALF:
        up = r >= 1.5
    else:  # ALPHA_RTE: ties to an even biased exponent field
        up = (r > 1.5) | ((r == 1.5) & ((e + 127) % 2 == 1))
    lo = int(torch.tensor(fmt.min_subnormal).log2().floor())
    hi = int(torch.tensor(fmt.max).log2().floor())
    return torch.clamp(e + up.to(torch.int64), lo, hi)


def _device_scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """value as a 0-dim tensor of like's dtype on like's device, rounded as `torch.tensor`
    rounds it (past the dtype's range: infinity): rounded on the host, then filled in on
    the device, where copying it from the host would wait for the GPU's queue."""
    rounded = float(torch.tensor(value, dtype=like.dtype))
    return torch.full((), rounded, dtype=like.dtype, device=like.device)


def _true_div(a: torch.Tensor, b: float) -> torch.Tensor:
    """a / b correctly rounded on every device: CUDA turns division by a CPU scalar into
    multiplication by its reciprocal, which can differ in the last bit (`_device_scalar`)."""
    return a / _device_scalar(b, a)


def _tensor_scales(amax: torch.Tensor, spec: QuantSpec, batch_dims: int):
    """(decode, encode) second-level scales in float32, one per tensor of the batch, shaped to
    broadcast against the block amax; (None, 1) without a tensor scale."""
    one = torch.ones((), dtype=torch.float32)
    if not spec.tensor_scale:
        return None, one
    big = _device_scalar(spec.scale.max * spec.element.max, amax)
    tensor_amax = _amax_beyond(amax, batch_dims)
    if spec.arithmetic is ScaleArithmetic.TE_ENCODE:
        encode = torch.clamp(big / tensor_amax, max=_FLT_MAX)
        encode = torch.where(encode == 0, one, encode)
        return 1.0 / encode, encode
    if spec.arithmetic is ScaleArithmetic.RECIPROCAL:  # FastVideo: max(A, 1e-8)
        encode = big / torch.clamp(tensor_amax, min=1e-8)  # fl(1e-8), as Triton's literal
        return 1.0 / encode, encode
    decode = tensor_amax / big
    return decode, one / decode


def _amax_beyond(amax: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """max over every dim after the first `batch_dims`, kept as size-1 dims (0 if empty)."""
    dims = tuple(range(batch_dims, amax.ndim))
    if amax.numel() == 0 or not dims:
        shape = amax.shape[:batch_dims] + (1,) * len(dims)
        return amax if not dims else amax.new_zeros(shape)
    return amax.amax(dim=dims, keepdim=True)


def _round_scale(scaled_amax: torch.Tensor, t: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    rule, fmt = spec.scale_rule, spec.scale
    if rule.power_of_two:
        raw = _power_of_two_scale(scaled_amax, rule, spec.element, fmt)
        nonfinite = ~torch.isfinite(scaled_amax)
    else:
        raw = t
        keeps_nan = spec.arithmetic in (ScaleArithmetic.EXACT, ScaleArithmetic.DIVIDE_UNROUNDED)
        nonfinite = ~torch.isfinite(t) if keeps_nan else None
    if spec.scale_floor is not None:
        raw = torch.clamp(raw, min=spec.scale_floor)
    if rule.power_of_two and spec.scale_floor is None:
        s = raw.float()  # already a power of two the scale format holds
    else:
        mode = Rounding.AWAY_FROM_ZERO if rule is ScaleRule.RCEIL else Rounding.NEAREST_EVEN
        s = round_to_format(raw, fmt, rounding=mode, saturate=True).float()
    if nonfinite is not None:
        s = torch.where(nonfinite, torch.nan, s)
    return s


def _power_of_two_scale(a: torch.Tensor, rule: ScaleRule, element: FloatFormat, fmt: FloatFormat):
    """2^E with E from the rule, clamped to the powers of two the scale format holds."""
    mant, ex = torch.frexp(torch.where(torch.isfinite(a), a, 1.0))  # a = mant * 2^ex
    e = ex.to(torch.int64) - 1  # floor(log2 a)
    if rule is ScaleRule.CEIL:
        e = e + (mant != 0.5).to(torch.int64)
    elif rule is ScaleRule.EVEN:
        e = e + (2 * mant >= 2 - 2.0 ** -(element.mbits + 1)).to(torch.int64)
    lo = int(torch.tensor(fmt.min_subnormal).log2().floor())
    hi = int(torch.tensor(fmt.max).log2().floor())
    e = torch.where(a == 0, lo, e - element.emax)
    return _pow2(torch.clamp(e, lo, hi))


# -- layouts ------------------------------------------------------------------------------------
def _normalize_axis(axis: int, ndim: int, spec: QuantSpec, batch_dims: int = 0) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"axis must be an int, got {axis!r}")
    if not isinstance(batch_dims, int) or not 0 <= batch_dims <= ndim:
        raise ValueError(
            f"batch_dims must be an int in [0, {ndim}] for x with {ndim} dims, got {batch_dims!r}"
        )
    if spec.block is not None and batch_dims and batch_dims > ndim - len(spec.block):
        raise ValueError(
            f"batch_dims={batch_dims} leaves no dims for the blocks {spec.block} of x with "
            f"{ndim} dims"
        )
    if ndim == 0 and spec.block is None:
        return 0
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis={axis} is out of range for x with {ndim} dims")
    axis = axis % ndim
    if spec.block is not None and len(spec.block) == 1 and axis < batch_dims:
        raise ValueError(
            f"axis={axis} is one of the batch_dims={batch_dims}: blocks never span tensors"
        )
    if spec.block is not None and len(spec.block) == 2:
        if ndim < 2:
            raise ValueError(
                f"spec {spec.name} has 2-D blocks {spec.block}: x needs at least 2 dims, has {ndim}"
            )
        if axis < ndim - 2:
            raise ValueError(
                f"axis={axis}: 2-D blocks cover the last two dims of x, so axis must be one of them"
            )
    return axis


def _layout(spec: QuantSpec, shape: torch.Size, axis: int, batch_dims: int = 0):
    if spec.block is None:
        return _PerTensor(spec, shape, axis, batch_dims)
    if len(spec.block) == 1:
        return _Blocks1D(spec, shape, axis, batch_dims)
    return _Tiles2D(spec, shape, axis, batch_dims)


class _Layout:
    """How x's elements are grouped into blocks. Subclasses give to_blocks / from_blocks
    (x's layout <-> (..., blocks, block elements)), scales_out / expand (block scales in
    the user's layout, and broadcast to every element)."""

    def __init__(self, spec, shape, axis, batch_dims):
        self.spec, self.shape, self.axis, self.batch_dims = spec, shape, axis, batch_dims

    def tensor_scale_out(self, decode: torch.Tensor) -> torch.Tensor:
        """The decode scale as a 0-dim tensor, or batch shape + size-1 dims (x's rank)."""
        if self.batch_dims == 0:
            return decode.reshape(())
        rest = len(self.shape) - self.batch_dims
        return decode.reshape(*self.shape[: self.batch_dims], *[1] * rest)


class _PerTensor(_Layout):
    def _batch(self):
        return tuple(self.shape[: self.batch_dims])

    def to_blocks(self, x):
        return x.reshape(*self._batch(), 1, -1)

    def from_blocks(self, b):
        return b.reshape(self.shape)

    def scales_out(self, s):
        return s.reshape(self._batch())

    def expand(self, s):
        rest = len(self.shape) - self.batch_dims
        return s.reshape(*self._batch(), *[1] * rest).expand(self.shape)


class _Blocks1D(_Layout):
    def __init__(self, spec, shape, axis, batch_dims):
        super().__init__(spec, shape, axis, batch_dims)
        self.size = spec.block[0]
        self.n = shape[axis] if len(shape) else 1
        self.nblocks = -(-self.n // self.size)

    def to_blocks(self, x):
        x = x.movedim(self.axis, -1)  # (..., n)
        if self.nblocks * self.size != self.n:
            x = F.pad(x, (0, self.nblocks * self.size - self.n))
        return x.reshape(*x.shape[:-1], self.nblocks, self.size)  # (..., blocks, size)

    def from_blocks(self, b):
        b = b.reshape(*b.shape[:-2], self.nblocks * self.size)[..., : self.n]
        return b.movedim(-1, self.axis)

    def scales_out(self, s):
        return s.movedim(-1, self.axis)

    def expand(self, s):
        s = s.movedim(self.axis, -1).repeat_interleave(self.size, dim=-1)[..., : self.n]
        return s.movedim(-1, self.axis)


class _Tiles2D(_Layout):
    """Tiles (r, c) over the last two dims; with axis = ndim - 2 the tile is transposed."""

    def __init__(self, spec, shape, axis, batch_dims):
        super().__init__(spec, shape, axis, batch_dims)
        self.transposed = axis == len(shape) - 2
        self.r, self.c = spec.block
        rows, cols = shape[-2:] if not self.transposed else (shape[-1], shape[-2])
        self.rows, self.cols = rows, cols
        self.nr, self.nc = -(-rows // self.r), -(-cols // self.c)

    def _orient(self, x):
        return x.transpose(-1, -2) if self.transposed else x

    def to_blocks(self, x):
        x = self._orient(x)
        x = F.pad(x, (0, self.nc * self.c - self.cols, 0, self.nr * self.r - self.rows))
        x = x.reshape(*x.shape[:-2], self.nr, self.r, self.nc, self.c).transpose(-3, -2)
        return x.reshape(*x.shape[:-4], self.nr, self.nc, self.r * self.c)  # (..., nr, nc, r*c)

    def from_blocks(self, b):
        b = b.reshape(*b.shape[:-3], self.nr, self.nc, self.r, self.c).transpose(-3, -2)
        b = b.reshape(*b.shape[:-4], self.nr * self.r, self.nc * self.c)
        return self._orient(b[..., : self.rows, : self.cols])

    def scales_out(self, s):
        return self._orient(s)

    def expand(self, s):
        s = self._orient(s).repeat_interleave(self.r, dim=-2).repeat_interleave(self.c, dim=-1)
        return self._orient(s[..., : self.rows, : self.cols])


# -- random Hadamard transform -------------------------------------------------------------------
def hadamard_matrix(
    n: int, seed: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """diag(signs) H_n / sqrt(n): Sylvester's H_n with random signs from `seed` (orthogonal).
    The signs come from a CPU generator, so they are the same on every device."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    gen = torch.Generator().manual_seed(seed)
    signs = 1.0 - 2.0 * torch.randint(0, 2, (n,), generator=gen).to(torch.float64)
    return (signs[:, None] * h / n**0.5).to(dtype=dtype, device=device)


def _hadamard(x: torch.Tensor, spec: QuantSpec, axis: int, *, inverse: bool) -> torch.Tensor:
    n = spec.hadamard
    if x.shape[axis] % n:
        raise ValueError(
            f"x.shape[{axis}] = {x.shape[axis]} is not a multiple of the spec's Hadamard size {n}"
        )
    h = hadamard_matrix(n, spec.hadamard_seed, x.dtype, x.device)
    t = x.movedim(axis, -1)
    t = t.reshape(*t.shape[:-1], -1, n) @ (h.T if inverse else h)  # (..., n_axis / n, n)
    return t.reshape(*t.shape[:-2], -1).movedim(-1, axis)
