"""`fp4lab.attention`: one entry to attention on an explicitly chosen backend.

Two backends share one `AttentionRecipe` and one `Trace` schema (DESIGN.md):
- ``"reference"``: the simulation path, `fp4lab.analysis.attention` (plain torch, any device,
  float64-capable, fully instrumented);
- ``"triton"``: the fused GPU kernels of `fp4lab.kernels` (forward and backward of the
  recipes they cover so far; anything else raises, see `fp4lab.kernels.backend`).

The backend is never picked for you and a missing one never falls back to the other: a
study that asked for the kernels must not silently measure the reference.
"""

from __future__ import annotations

import functools

import torch

from fp4lab.analysis import attention as reference_attention
from fp4lab.analysis.bias import GradientBias
from fp4lab.analysis.bias import gradient_bias as _gradient_bias
from fp4lab.recipes import AttentionRecipe, Trace

__all__ = ["attention", "gradient_bias", "BACKENDS"]

BACKENDS = ("reference", "triton")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    recipe: AttentionRecipe | str = "exact",
    *,
    causal: bool = False,
    scale: float | None = None,
    trace: Trace | None = None,
    generator: torch.Generator | int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    backend: str = "reference",
) -> torch.Tensor:
    """Scaled dot-product attention with quantized operands, on `backend`.

    Arguments other than `backend` are those of `fp4lab.analysis.attention` (layout
    (B, H, S, D) as `F.scaled_dot_product_attention`, autograd backward, `trace` for per-tile
    statistics, `generator` for stochastic rounding); see its docstring.

    Raises:
        NotImplementedError: backend="triton" for what its kernels do not run yet (some
            recipe mechanisms of the forward or the backward, a trace with an explicit
            reference_dtype), or without triton installed. Its trace leaves some columns
            NaN (``prod_err`` of pv, dv, dq, dk, ...: `fp4lab.kernels.trace`).
        ValueError: any other backend than "reference" or "triton".
    """
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )
    options = dict(
        causal=causal, scale=scale, trace=trace, generator=generator, block_m=block_m,
        block_n=block_n, attn_mask=attn_mask, dropout_p=dropout_p,
    )  # fmt: skip
    if backend == "triton":
        return _triton_attention()(q, k, v, recipe, **options)
    return reference_attention(q, k, v, recipe, **options)


def gradient_bias(q, k, v, do, recipe, *, backend: str = "reference", **options) -> GradientBias:
    """`fp4lab.analysis.gradient_bias` (its arguments and result) with the recipe's samples
    run on `backend`: "reference" (the simulation) or "triton" (the kernels; their samples
    stacked along the batch, `batch` at a time, each drawing as it would alone)."""
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}"
        )
    attend = functools.partial(attention, backend=backend) if backend == "triton" else None
    return _gradient_bias(q, k, v, do, recipe, attend=attend, **options)


def _triton_attention():
    """The Triton backend's entry; a clear error when triton is not installed."""
    try:
        from fp4lab.kernels.backend import attention as triton_attention
    except ImportError as err:
        raise NotImplementedError(
            f"backend='triton' needs the triton package ({err}); install fp4lab[kernels], or "
            "use backend='reference' (no silent fallback)"
        ) from None
    return triton_attention
