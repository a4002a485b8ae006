"""Softmax-invariant rewrites of a recipe's operands that both paths apply before attention,
as the same torch ops (so the simulation and the kernels rotate bit for bit alike)."""

from __future__ import annotations

import torch

from fp4lab.formats import hadamard_matrix
from fp4lab.recipes.recipe import AttentionRecipe

__all__ = ["incoherent_qk"]


def incoherent_qk(q, k, recipe: AttentionRecipe):
    """(Q H, K H) with incoherent processing, H the random-sign Hadamard matrix along head_dim
    (FlashAttention-3, Sec. 3.3: (Q H)(K H)^T = Q K^T), in float64 rounded once to the inputs'
    dtype (differentiable torch ops); (q, k) without it."""
    if not recipe.incoherent_processing:
        return q, k
    h = hadamard_matrix(q.shape[-1], recipe.incoherent_seed, torch.float64).to(q.device)
    return (q.to(torch.float64) @ h).to(q.dtype), (k.to(torch.float64) @ h).to(k.dtype)
