"""Block formats: `QuantSpec` and how its block scales are chosen (`ScaleRule`, `ScaleArithmetic`).

A block format composes an element format, a scale format and a block shape
(the gfloat habit): each block of elements shares one scale, chosen from the block's
absolute maximum by a `ScaleRule`, optionally under a per-tensor second-level scale.
The exact floating-point order of the scale arithmetic differs between implementations
and changes bits, so it is part of the block format too (`ScaleArithmetic`): the same data
model expresses the OCP MX reference, Transformer Engine's NVFP4 reference quantizer and
torchao's `nvfp4_quantize`, each bit for bit.

Notation in the docstrings below: a = block amax, A = tensor amax, M_e = element max,
M_s = scale-format max, all float32; fl(.) is one float32 rounding; emax_e is the element
format's largest exponent; rnd_s(.) rounds into the scale format.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fp4lab.formats.float_format import FloatFormat
from fp4lab.formats.registry import parse_enum
from fp4lab.formats.rounding import Rounding

__all__ = ["ScaleRule", "ScaleArithmetic", "QuantSpec"]


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

    @property
    def power_of_two(self) -> bool:
        """True for the rules that pick a power of two from a' directly."""
        return self in (ScaleRule.OCP_FLOOR, ScaleRule.CEIL, ScaleRule.EVEN)


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
    x * min(fl(1 / fl(s * d)), FLT_MAX). Without a tensor scale g = d = 1.
    NaN and inf, as TE's reference: a NaN anywhere reaches every block through A (all NaN);
    an infinite A makes g = 0, replaced by 1, so inf saturates to M_e * M_s and the rest of
    its block flushes. A tiny A (all subnormal) saturates g at FLT_MAX and flushes."""

    TORCHAO_DECODE = "torchao_decode"
    """torchao's ``nvfp4_quantize``: d = fl(A / fl(M_s * M_e)); t = fl(fl(a / M_e) / d);
    elements are x * fl(fl(1 / d) / s). Without a tensor scale t = fl(a / M_e) and
    elements are x * fl(1 / s). NaN and inf, as torchao: with a tensor scale a NaN or an
    inf anywhere, and an all-zero tensor (d = 0), make every block NaN; without one, a NaN
    makes its block NaN and an inf saturates to M_e * M_s."""


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

    def __post_init__(self) -> None:
        for field in ("element", "scale"):
            if not isinstance(getattr(self, field), FloatFormat):
                raise TypeError(f"{field} must be a FloatFormat, got {getattr(self, field)!r}")
        if self.block is not None:
            if isinstance(self.block, int):
                object.__setattr__(self, "block", (self.block,))
            ok = isinstance(self.block, tuple) and len(self.block) in (1, 2)
            if not ok or not all(isinstance(b, int) and b >= 1 for b in self.block):
                raise ValueError(f"block must be None, (n,) or (r, c) of positive ints, got {self.block!r}")
        object.__setattr__(self, "scale_rule", parse_enum(ScaleRule, self.scale_rule, "scale_rule"))
        object.__setattr__(self, "arithmetic", parse_enum(ScaleArithmetic, self.arithmetic, "arithmetic"))
        object.__setattr__(self, "rounding", Rounding.parse(self.rounding))
        if self.hadamard is not None and self.hadamard not in (2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"hadamard must be a power of two in [2, 256] or None, got {self.hadamard!r}")
        if self.hadamard is not None and self.block is not None and len(self.block) == 2:
            raise ValueError("hadamard is applied along one axis; it does not combine with 2-D blocks")
        if self.sr_bits is not None and not 1 <= self.sr_bits <= 52:
            raise ValueError(f"sr_bits must be in [1, 52] or None, got {self.sr_bits!r}")
        if self.scale_floor is not None and not self.scale_floor > 0:
            raise ValueError(f"scale_floor must be positive or None, got {self.scale_floor!r}")

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
    def bits_per_element(self) -> float:
        """Information per element: element bits plus the block scale's bits over the block
        (UE4M3 counts 7, though hardware stores it in a byte); the tensor scale is ignored."""
        if self.block_size is None:
            return float(self.element.bits)
        return self.element.bits + self.scale.bits / self.block_size

    def __str__(self) -> str:
        return self.name
