"""Codes as bytes and as other libraries' types: bit packing, torch float8/float4, ml_dtypes.

A format is matched to a torch or ml_dtypes type by its layout (exponent and mantissa bits,
bias, sign, subnormals, specials), never by its name, so a user's own literal with the same
layout converts too. Packing is little-endian within a byte: the first code takes the low
bits (two FP4 codes a byte: element 2i in bits 0-3, element 2i+1 in bits 4-7, as torch's
float4_e2m1fn_x2 and the OCP MX layout).
"""

from __future__ import annotations

import numpy as np
import torch

from fp4lab.formats.float_format import FloatFormat, Specials

__all__ = ["pack_codes", "unpack_codes", "torch_dtype", "ml_dtype", "to_torch", "to_ml_dtypes"]


def _layout(fmt: FloatFormat) -> tuple:
    return (fmt.ebits, fmt.mbits, fmt.bias, fmt.signed, fmt.subnormals, fmt.specials)


# layout -> (torch dtype name, ml_dtypes type name); None where that library has no such type.
_NAMES = {
    (4, 3, 7, True, True, Specials.FN): ("float8_e4m3fn", "float8_e4m3fn"),
    (5, 2, 15, True, True, Specials.IEEE): ("float8_e5m2", "float8_e5m2"),
    (4, 3, 8, True, True, Specials.FNUZ): ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    (5, 2, 16, True, True, Specials.FNUZ): ("float8_e5m2fnuz", "float8_e5m2fnuz"),
    (8, 0, 127, False, False, Specials.FN): ("float8_e8m0fnu", "float8_e8m0fnu"),
    (2, 1, 1, True, True, Specials.NONE): ("float4_e2m1fn_x2", "float4_e2m1fn"),
    (3, 2, 3, True, True, Specials.NONE): (None, "float6_e3m2fn"),
    (2, 3, 1, True, True, Specials.NONE): (None, "float6_e2m3fn"),
    (8, 7, 127, True, True, Specials.IEEE): ("bfloat16", "bfloat16"),
    (5, 10, 15, True, True, Specials.IEEE): ("float16", None),
    (8, 23, 127, True, True, Specials.IEEE): ("float32", None),
}


def torch_dtype(fmt: FloatFormat) -> torch.dtype | None:
    """torch's dtype with fmt's layout (FP4 as the packed float4_e2m1fn_x2), or None."""
    name = _NAMES.get(_layout(fmt), (None, None))[0]
    return getattr(torch, name, None) if name else None


def ml_dtype(fmt: FloatFormat):
    """ml_dtypes' scalar type with fmt's layout, or None (needs the ml_dtypes package)."""
    name = _NAMES.get(_layout(fmt), (None, None))[1]
    if name is None:
        return None
    import ml_dtypes

    return getattr(ml_dtypes, name, None)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of `bits` bits each (any shape, read in row-major order) packed densely into a
    1-D uint8 tensor, first code in the lowest bits; the tail of the last byte is zero."""
    if not 1 <= bits <= 32:
        raise ValueError(f"bits must be in [1, 32], got {bits}")
    c = codes.reshape(-1).to(torch.int64)
    if bits == 8:
        return c.to(torch.uint8)
    if bits == 4:
        c = torch.cat([c, c.new_zeros(c.numel() % 2)])
        return (c[0::2] | (c[1::2] << 4)).to(torch.uint8)
    bitplane = (c[:, None] >> torch.arange(bits)) & 1  # (n, bits), LSB first
    flat = bitplane.reshape(-1)
    flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)])
    return (flat.reshape(-1, 8) << torch.arange(8)).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, shape, dtype: torch.dtype = torch.uint8):
    """Inverse of `pack_codes`: codes of the given shape (dtype: the format's code_dtype)."""
    if packed.dtype != torch.uint8 or packed.ndim != 1:
        raise ValueError(
            f"packed must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    n = int(np.prod(shape)) if len(shape) else 1
    if packed.numel() * 8 < n * bits:
        raise ValueError(
            f"packed holds {packed.numel()} bytes, too few for {n} codes of {bits} bits"
        )
    p = packed.to(torch.int64)
    if bits == 8:
        c = p[:n]
    elif bits == 4:
        c = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(-1)[:n]
    else:
        flat = ((p[:, None] >> torch.arange(8)) & 1).reshape(-1)[: n * bits]
        c = (flat.reshape(n, bits) << torch.arange(bits)).sum(-1)
    return c.reshape(shape).to(dtype)


def to_torch(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The codes as a tensor of torch's own dtype for fmt (FP4: pairs along the last dim)."""
    dtype = torch_dtype(fmt)
    if dtype is None:
        raise ValueError(f"torch has no dtype with the layout of {fmt.name}")
    if fmt.bits == 4:
        if codes.shape[-1] % 2:
            raise ValueError(
                f"float4_e2m1fn_x2 packs pairs: the last dim must be even, got {codes.shape[-1]}"
            )
        c = codes.to(torch.uint8)
        return (c[..., 0::2] | (c[..., 1::2] << 4)).view(dtype)
    container = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[fmt.bits]
    return codes.to(container).view(dtype)


def to_ml_dtypes(codes: torch.Tensor, fmt: FloatFormat) -> np.ndarray:
    """The codes as a numpy array of ml_dtypes' type for fmt (one code a byte for FP4/FP6)."""
    dtype = ml_dtype(fmt)
    if dtype is None:
        raise ValueError(f"ml_dtypes has no type with the layout of {fmt.name}")
    container = np.uint8 if fmt.bits <= 8 else np.uint16
    return codes.cpu().numpy().astype(container).view(dtype)
