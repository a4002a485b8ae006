"""What `attention` checks before it computes anything: every error names its argument."""

from __future__ import annotations

import torch

from fp4lab.formats.streams import as_generators
from fp4lab.recipes import AttentionRecipe
from fp4lab.recipes.checks import check_tiling

__all__ = ["check_inputs", "check_tiling", "generator_for"]


def check_inputs(q, k, v, attn_mask) -> None:
    """q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv): one floating dtype and device,
    H a multiple of Hkv; attn_mask broadcastable to (B, H, Sq, Sk)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(x.shape)}"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must agree in (batch, heads, seq), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}"
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of k's heads ({k.shape[1]})")
    if attn_mask is not None:
        _check_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)


def _check_mask(mask, shape, device) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be boolean or floating point, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"attn_mask must be on q's device {device}, got {mask.device}")
    try:
        torch.broadcast_shapes(mask.shape, shape)
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {shape}"
        ) from None
    if mask.ndim > 4 or (mask.ndim == 4 and mask.shape[1] not in (1, shape[1])):
        raise ValueError(
            f"attn_mask must broadcast to (B, H, Sq, Sk) = {shape}, got {tuple(mask.shape)}"
        )


def generator_for(recipe: AttentionRecipe, generator, dropout_p: float = 0.0):
    """The call's generator; a stochastic recipe or dropout without one is an error, and so
    is a dropout probability outside [0, 1)."""
    ok = isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool)
    if not ok or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    gen = as_generators(generator)
    if gen is None and (recipe.stochastic or dropout_p > 0):
        why = (
            f"recipe {recipe.name!r} rounds stochastically"
            if recipe.stochastic
            else (f"dropout_p={dropout_p} draws a dropout mask")
        )
        raise ValueError(
            f"generator: {why}; pass a torch.Generator or an int seed (fp4lab never draws "
            "from torch's global random state)"
        )
    return gen
