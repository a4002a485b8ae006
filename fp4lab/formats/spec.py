"""Block formats: `QuantSpec` and how its block scales are chosen (`ScaleRule`, `ScaleArithmetic`).

A block format composes an element format, a scale format and a block shape
(the gfloat habit): each block of elements shares one scale, chosen from the block's
absolute maximum by a `ScaleRule`, optionally under a per-tensor second-level scale.
The exact floating-point order of the scale arithmetic differs between implementations
and changes bits, so it is part of the block format too (`ScaleArithmetic`): the same data
model expresses the OCP MX reference, Transformer Engine's NVFP4 reference quantizer and
torchao's `nvfp4_quantize`, each bit for bit, and the quantizers of released attention
kernels: the alpha-grid E8M0 rules of fp4-fa4, SageAttention's and FastVideo's reciprocal
multiply, SageAttention's division by the unrounded P scale. Two options step outside the
amax-to-scale rule: a fixed decode scale (`QuantSpec.fixed_scale`, fp4-fa4's E4M3(4 x)) and
a correction of the scale from the rounded elements (`Correction`, Quartet II's MS-EDEN).

Notation in the docstrings below: a = block amax, A = tensor amax, M_e = element max,
M_s = scale-format max, all float32; fl(.) is one float32 rounding; emax_e is the element
format's largest exponent; rnd_s(.) rounds into the scale format.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from fp4lab.formats.float_format import FloatFormat
from fp4lab.formats.registry import parse_enum
from fp4lab.formats.rounding import Rounding

__all__ = ["ScaleRule", "ScaleArithmetic", "Correction", "QuantSpec"]


class ScaleRule(enum.Enum):
    """How a block's scale s is chosen from its (tensor-scaled) amax a'."""

    OCP_FLOOR = "ocp_floor"
    """s = 2^(floor(log2 a') - emax_e) (OCP MX v1.0, section 6.3). The block maximum can
    clip: a mantissa of 1.99 lands on 7.96 and saturates to 6 in E2M1."""

    CEIL = "ceil"
    """s = 2^(ceil(log2 a') - emax_e): never clips, but can waste up to one binade."""

    EVEN = "even"
    """s = 2^(floor(log2 rnd_m(a')) - emax_e), where rnd_m rounds a' half-up to the element's
    mantissa width first, so a' clips only when it would round into the next binade anyway
    (torchao's EVEN)."""

    RCEIL = "rceil"
    """s = round-up_s(fl(a' / M_e)): the scale is rounded up in the scale format, so the
    block maximum never clips (cuBLAS's E8M0 rule, PTX ``cvt.rp.satfinite``)."""

    NEAREST = "nearest"
    """s = round-to-nearest-even_s(fl(a' / M_e)), clamped to M_s: plain amax over the
    element max, rounded in the scale format (NVFP4's E4M3 block scale)."""

    ALPHA_CEIL = "alpha_ceil"
    """Alpha grid (see `alpha_grid`), E = ceil(log2 a): up iff r > 1. fp4-fa4's "max-safe
    ceiling" (select 4) for P in its MXFP4 P/V training route; HAO's MXFP8 P group scales
    (hao-ai-lab/flash-attention-fp4, ``cvt.rpi`` of log2 of the group's max P), with E4M3
    elements: E4M3_RN_sat(448 P / 2^E). Never clips. HAO's ``cvt_f32_to_ue8m0`` takes the
    ceiling of ``lg2.approx.f32``; fp4lab's log2 is exact, so for an amax within the
    approximation's error (about 2^-22 relative) above a power of two the kernel may keep
    the lower exponent and clip that element to 448 (unverified: the hardware's error)."""

    ALPHA_MSE = "alpha_mse"
    """Alpha grid, E = floor(log2 a) + [r >= 1.203125]: fp4-fa4's
    ``bf16_amax_to_e8m0_1d_mse`` (BF16 mantissa field ``bits & 0x7f >= 0x1a``), its default
    for V's 1 x 32 blocks. Clips (a, alpha] for r in [1, 1.203125)."""

    ALPHA_HALF = "alpha_half"
    """Alpha grid, E = floor(log2 a) + [r >= 1.5]: fp4-fa4's "shifted floor" (select 1),
    floor(log2 a + 1 - log2 1.5)."""

    ALPHA_RTE = "alpha_rte"
    """Alpha grid, E = floor(log2 a) + [r > 1.5 or (r == 1.5 and floor(log2 a) + 127 is
    odd)]: log2 a rounded to nearest with ties to an even biased exponent field, fp4-fa4's
    ``bf16_amax_to_e8m0_rte`` (its rule for 32 x 32 tiles)."""

    @property
    def power_of_two(self) -> bool:
        """True for the rules that pick a power of two from a' directly."""
        return self in (ScaleRule.OCP_FLOOR, ScaleRule.CEIL, ScaleRule.EVEN)

    @property
    def alpha_grid(self) -> bool:
        """True for the alpha-grid rules (MrHuff/fp4-fa4, ``tk_fa4/lowp_fa4_bwd/
        projection_fp4_epilogue.cuh``; hao-ai-lab/flash-attention-fp4). The block's largest
        code M_e sits at alpha = 2^E, E stored as E8M0, so the decode scale is
        s = fl(2^E / M_e), not a power of two. With r = a / 2^floor(log2 a) in [1, 2), each
        rule rounds log2 a up or down to E (its docstring), clamped to the powers of two of
        the scale format (E8M0: [-127, 127]). Elements are x * (M_e * 2^-E), the kernel's
        multiplier ``e8m0_encode_multiplier(e) = 6 * 2^(127 - e)``, computed as
        fl(x * M_e) * 2^-E: one rounding, and the same bits wherever the multiplier is a
        float32 number; at the bottom of the range it is not (6 * 2^126 overflows, so the
        kernel's E = -126 saturates every element), where fp4lab stays finite. They are then
        rounded to the element format to nearest even, saturating at M_e, so values in
        (alpha, a] clip to alpha.

        Dequantization is code * s in float32, with one float32 rounding of 1 / M_e in s; the
        kernel keeps code * 2^E exact and divides the P V sum by M_e^2 = 36 instead.
        fp4-fa4 reads r and the exponent field from the BF16 amax, fp4lab from the float32
        amax: identical for BF16 inputs. A block whose amax is 0 or a float32 subnormal
        (< 2^-126) gets a zero scale and flushes to zero, as the kernel does for a BF16 amax
        with exponent field 0 (e8m0 = 0, multiplier 0). A block holding NaN or inf gets a
        NaN scale (as `ScaleArithmetic.EXACT`; the kernel's e8m0 is 0xFF). At the top,
        E = 127: the kernel's bit construction of its multiplier gives 0 there, fp4lab
        multiplies by M_e * 2^-127."""
        return self in (
            ScaleRule.ALPHA_CEIL, ScaleRule.ALPHA_MSE, ScaleRule.ALPHA_HALF, ScaleRule.ALPHA_RTE
        )


class ScaleArithmetic(enum.Enum):
    """The floating-point order in which scales and scaled elements are computed.

    Per-tensor decode scale d (1 without a tensor scale), block scale s, element x; each
    member gives the float32 operations (fl = one rounding) exactly.
    """

    EXACT = "exact"
    """OCP MX reference: d = fl(A / (M_s * M_e)); power-of-two rules read a' = fl(a / d);
    the other rules round t = fl(a' / M_e); elements are x / fl(s * d), a single correctly
    rounded division (for power-of-two s, exactly x * 2^-log2 s). A zero scale leaves its
    all-zero block at zero. A block holding inf or NaN gets a NaN scale (OCP), so it
    dequantizes to NaN while the other blocks are unaffected."""

    TE_ENCODE = "te_encode"
    """NVIDIA Transformer Engine's NVFP4 reference quantizer: encode scale
    g = min(fl((M_s * M_e) / A), FLT_MAX), replaced by 1 when it is 0; d = fl(1 / g);
    t = min(fl(a * fl(g * fl(1 / M_e))), FLT_MAX); elements are
    x * min(fl(1 / fl(s * d)), FLT_MAX). Without a tensor scale g = d = 1 and a zero scale
    gets the multiplier 0, so its block flushes to zero: this is MrHuff/fp4-fa4's Q/K
    quantizer (``stage_codes_perblock_qk`` in ``tk_fa4/lowp_fa4_bwd/
    projection_fp4_epilogue.cuh``: scale E4M3(amax * (1/6)), multiplier 1 / scale or 0).
    NaN and inf, as TE's reference: a NaN anywhere reaches every block through A (all NaN);
    an infinite A makes g = 0, replaced by 1, so inf saturates to M_e * M_s and the rest of
    its block flushes. A tiny A (all subnormal) saturates g at FLT_MAX and flushes."""

    TORCHAO_DECODE = "torchao_decode"
    """torchao's ``nvfp4_quantize``: d = fl(A / fl(M_s * M_e)); t = fl(fl(a / M_e) / d);
    elements are x * fl(fl(1 / d) / s). Without a tensor scale t = fl(a / M_e) and
    elements are x * fl(1 / s). NaN and inf, as torchao: with a tensor scale a NaN or an
    inf anywhere, and an all-zero tensor (d = 0), make every block NaN; without one, a NaN
    makes its block NaN and an inf saturates to M_e * M_s."""

    RECIPROCAL = "reciprocal"
    """Multiply by the reciprocal of the rounded scale. Without a tensor scale
    (thu-ml/SageAttention, ``sageattention3_blackwell/sageattn3/quantization/
    fp4_quantization_4d.cu``: SFValue = vecMax / 6.0f rounded to ``__nv_fp8_e4m3``,
    SFValueInv = (SFValue == 0) ? 0 : 1 / SFValue): t = fl(a / M_e), s = rnd_s(t), elements
    x * fl(1 / s), and a zero scale gets the multiplier 0 (its block flushes to zero).
    With a tensor scale (hao-ai-lab/FastVideo, ``fastvideo-kernel/python/fastvideo_kernel/
    triton_kernels/nvfp4_utils.py``, ``_compute_quant_and_scale``): g = fl((M_s * M_e) /
    max(A, fl(1e-8))), d = fl(1 / g), t = fl(fl(a / M_e) * g), s = rnd_s(t), elements
    x * fl(1 / b) with b = fl(s * d), replaced by 1 when it is not positive (FastVideo's
    ``where(block_decode > 0, block_decode, 1)``: a zero scale's codes are rnd(x), which
    dequantize to 0). Power-of-two rules read a' = fl(a * g). fp4lab divides correctly
    rounded; that Triton lowers its fp32 ``/`` to the same division (and not to an
    approximate ``div.full.f32``) is an assumption it cannot check. NaN and inf follow the
    arithmetic: a NaN makes its block NaN, an inf saturates to M_e * M_s (the rest of its
    block flushes); with a tensor scale either reaches every block through A, NaN."""

    DIVIDE_UNROUNDED = "divide_unrounded"
    """Divide by the unrounded scale, decode with the rounded one (thu-ml/SageAttention,
    ``sageattention3_blackwell/sageattn3/blackwell/softmax_fused.h``: P elements
    ``/= AbsMaxP`` before the scale is rounded to UE4M3 in ``mainloop_tma_ws.h``):
    d = fl(A / (M_s * M_e)) and a' = fl(a / d) as EXACT, t = fl(a' / M_e), s = rnd_s(t);
    elements are x / fl(t * d), so the block maximum maps to M_e (its code is exactly M_e
    after saturation), and dequantization gives code(x / t) * s * d. A zero t flushes its
    block; a block holding NaN or inf gets a NaN scale, as EXACT."""


class Correction(enum.Enum):
    """A correction of the block scale computed from the rounded elements."""

    NONE = "none"
    """No correction: the block scale is the `ScaleRule`'s."""

    EDEN = "eden"
    """Quartet II's MS-EDEN (arXiv 2601.22813), as its CUDA kernel computes it
    (IST-DASLab/Quartet-II ``kernels/csrc/group_transform_and_eden.cu``,
    ``had128_utils.cuh``; see `fp4lab.formats.eden` for the sources and every difference).
    For each block b of the (Hadamard-rotated) x, with c = `QuantSpec.amax_target` in float32:
    sigma_b = RTZ_4(fl(a_b * fl(1 / c))), the float32 mantissa truncated to 4 bits (0 if
    that is a float32 subnormal); v = fl(x * fl(1 / sigma_b)) (0 for sigma_b = 0);
    q = E2M1_RN_sat(v); S_b = fl(<v, v> / <v, q>) (1 if <v, q> = 0);
    sigma~_b = bf16(fl(sigma_b * S_b)); tensor scale t = fl(max_b sigma~_b * 2^-8);
    stored scale s_b = SR_s(fl(sigma~_b * fl(1 / t))) (0 for t = 0) with the kernel's
    16-bit stochastic rounding; the value is q * s_b * t. Elements round to nearest; the
    scale's random bits come from the uniform at each block's first element (``noise``, or
    drawn from ``generator`` with x's shape). A NaN or inf anywhere makes every block NaN."""


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """A block format: element format, scale format, block shape and scale arithmetic.

    Attributes:
        name: registry name.
        element: element format of the codes.
        scale: format the block scales are rounded into (FP32 for a plain float scale).
        block: (n,) for 1-D blocks of n along the quantized axis; (r, c) for 2-D tiles over
            the last two dims (r along dim -2, c along dim -1); None for one scale for the
            whole tensor.
        scale_rule: how a block scale is chosen (`ScaleRule`).
        tensor_scale: whether a float32 per-tensor second-level scale is used (NVFP4).
        arithmetic: the float32 order of the scale arithmetic (`ScaleArithmetic`).
        scale_floor: block scales (before rounding into `scale`) below this are raised to
            it; torchao's NVFP4 uses E4M3's smallest normal, 2^-6. None: no floor.
        hadamard: size of a random Hadamard transform applied along the quantized axis
            before quantization and undone by dequantization (a power of two from 2 to 256),
            or None.
        hadamard_seed: seed of the transform's random signs (part of the format's fields).
        rounding: rounding of the elements (block scales follow `scale_rule`).
        sr_bits: random bits of stochastic rounding (None: exact); see `Rounding`.
        fixed_scale: a constant decode scale d for the whole tensor instead of one derived
            from its amax: x^ = d * rnd(x / d) (exact division for a power of two d). No
            tensor scale; `scale_rule`, `arithmetic` and `scale` are then not read. Named
            formats take block=None; any block shape gives the same result (every block's
            scale is d), which lets per-tile code give a per-tensor spec tile blocks.
            None: scales come from the amax.
        correction: a correction of the block scales from the rounded elements
            (`Correction`); EDEN defines the whole scale chain (its docstring) and needs
            1-D blocks, a tensor scale, scale_rule NEAREST, arithmetic EXACT and nearest
            elements.
        amax_target: c, the value a block's amax is mapped to before the correction
            (Quartet II's ``fp4_max = 6 / scale_override``); required by Correction.EDEN,
            rejected otherwise.
    """

    name: str
    element: FloatFormat
    scale: FloatFormat
    block: tuple[int, ...] | None
    scale_rule: ScaleRule
    tensor_scale: bool = False
    arithmetic: ScaleArithmetic = ScaleArithmetic.EXACT
    scale_floor: float | None = None
    hadamard: int | None = None
    hadamard_seed: int = 0
    rounding: Rounding = Rounding.NEAREST_EVEN
    sr_bits: int | None = None
    fixed_scale: float | None = None
    correction: Correction = Correction.NONE
    amax_target: float | None = None

    def __post_init__(self) -> None:
        for field in ("element", "scale"):
            if not isinstance(getattr(self, field), FloatFormat):
                raise TypeError(f"{field} must be a FloatFormat, got {getattr(self, field)!r}")
        if self.block is not None:
            if isinstance(self.block, int):
                object.__setattr__(self, "block", (self.block,))
            ok = isinstance(self.block, tuple) and len(self.block) in (1, 2)
            if not ok or not all(isinstance(b, int) and b >= 1 for b in self.block):
                raise ValueError(
                    f"block must be None, (n,) or (r, c) of positive ints, got {self.block!r}"
                )
        for field, kind in (
            ("scale_rule", ScaleRule), ("arithmetic", ScaleArithmetic), ("correction", Correction)
        ):
            object.__setattr__(self, field, parse_enum(kind, getattr(self, field), field))
        object.__setattr__(self, "rounding", Rounding.parse(self.rounding))
        if self.hadamard is not None and self.hadamard not in (2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(
                f"hadamard must be a power of two in [2, 256] or None, got {self.hadamard!r}"
            )
        if self.hadamard is not None and self.block is not None and len(self.block) == 2:
            raise ValueError(
                "hadamard is applied along one axis; it does not combine with 2-D blocks"
            )
        if self.sr_bits is not None and not 1 <= self.sr_bits <= 52:
            raise ValueError(f"sr_bits must be in [1, 52] or None, got {self.sr_bits!r}")
        if self.scale_floor is not None and not self.scale_floor > 0:
            raise ValueError(f"scale_floor must be positive or None, got {self.scale_floor!r}")
        self._check_alpha_grid()
        self._check_fixed_scale()
        self._check_correction()

    def _check_alpha_grid(self) -> None:
        if not self.scale_rule.alpha_grid:
            return
        rule = f"scale_rule={self.scale_rule.value}"
        if self.scale.mbits != 0:
            raise ValueError(f"{rule} stores 2^E: scale must be a power-of-two format such as "
                             f"ue8m0, got {self.scale.name}")
        if self.tensor_scale or self.arithmetic is not ScaleArithmetic.EXACT:
            raise ValueError(f"{rule} fixes its own arithmetic: tensor_scale must be False and "
                             f"arithmetic exact, got {self.tensor_scale}, {self.arithmetic.value}")
        if self.scale_floor is not None:
            raise ValueError(f"{rule} takes no scale_floor, got {self.scale_floor!r}")

    def _check_fixed_scale(self) -> None:
        d = self.fixed_scale
        if d is None:
            return
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 < d < float("inf"):
            raise ValueError(f"fixed_scale must be a positive finite float or None, got {d!r}")
        if float(torch.tensor(float(d), dtype=torch.float32)) != d:
            raise ValueError(f"fixed_scale must be a float32 number, got {d!r}")
        if self.tensor_scale:
            raise ValueError("fixed_scale is the whole tensor's scale: tensor_scale must be False")
        if self.scale_floor is not None or self.correction is not Correction.NONE:
            raise ValueError("fixed_scale takes no scale_floor and no correction")

    def _check_correction(self) -> None:
        if self.correction is Correction.NONE:
            if self.amax_target is not None:
                raise ValueError(f"amax_target is read by correction=eden only, got "
                                 f"amax_target={self.amax_target!r} with correction=none")
            return
        c = self.amax_target
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < float("inf"):
            raise ValueError(
                f"correction=eden needs amax_target, a positive finite float, got {c!r}"
            )
        ok = (
            self.block is not None and len(self.block) == 1 and self.tensor_scale
            and self.scale_rule is ScaleRule.NEAREST and self.arithmetic is ScaleArithmetic.EXACT
            and self.scale_floor is None and self.rounding is Rounding.NEAREST_EVEN
            and self.sr_bits is None
        )
        if not ok:
            raise ValueError("correction=eden defines its own scale chain: it needs 1-D blocks, "
                             "tensor_scale=True, scale_rule=nearest, arithmetic=exact, no "
                             "scale_floor, rounding=nearest_even and sr_bits=None")
        if self.scale.mbits > 23 - 16:
            raise ValueError(f"correction=eden rounds its scales with 16 random bits below "
                             f"the mantissa: scale needs at most 7 mantissa bits, got "
                             f"{self.scale.name}")

    @property
    def block_size(self) -> int | None:
        """Number of elements a block scale covers (None for per-tensor)."""
        if self.block is None:
            return None
        size = 1
        for b in self.block:
            size *= b
        return size

    @property
    def stochastic(self) -> bool:
        """Whether quantizing draws random numbers (stochastic element rounding, or EDEN's
        stochastic rounding of the block scales): such a format needs noise or a generator."""
        return self.rounding is Rounding.STOCHASTIC or self.correction is Correction.EDEN

    @property
    def bits_per_element(self) -> float:
        """Information per element: element bits plus the block scale's bits over the block
        (UE4M3 counts 7, though hardware stores it in a byte); the tensor scale and a fixed
        scale are not stored per block, so they count nothing."""
        if self.block_size is None or self.fixed_scale is not None:
            return float(self.element.bits)
        return self.element.bits + self.scale.bits / self.block_size

    def __str__(self) -> str:
        return self.name
