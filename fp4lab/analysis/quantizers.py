"""How attention quantizes one operand: fp4lab.formats' pipeline, along the right axis.

`quantize_operand(x, spec, axis=...)` is `fake_quantize(lift * x, spec) / lift` with the
operand's own rules: a `FloatFormat` is an element-wise cast (nearest even, saturating), a
`QuantSpec` is block quantization along `axis` (2-D tiles on the tensor's last two dims as
they lie), and None leaves x as it is. A per-tile operand (P, dS: ``per_tile=True``) takes
a tensor scale of its spec per tile, as a fused kernel must, where a whole tensor (Q, K, V,
dO) takes it over the whole tensor. With ``counts=True`` it also returns what the trace
counts: clipped elements and the blocks whose scale left its format's range.

`quantize_field(x, field, ps)` applies this to the pass's recipe's operand `field` with the
facts of the operand table (`fp4lab.recipes.operands`): its axis, per tile or not, its lift.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4lab.analysis.context import Pass
from fp4lab.formats import FloatFormat, QuantSpec, quantize_blocks, round_to_format
from fp4lab.recipes import Seq, TensorScope, operand
from fp4lab.recipes.tile_stats import block_counts

__all__ = ["Quantized", "quantize_operand", "quantize_field", "stochastic", "draw_dtype"]


@dataclass
class Quantized:
    """An operand after quantization and, when asked, its trace counts.

    `counts` holds "clipped" (elements past the block's largest value, in blocks whose
    stored scale is nonzero), "blocks" (blocks
    holding a nonzero), "scale_underflow" and "scale_overflow" (such blocks whose scale left
    its format's range): counts per tile for a per-tile operand, boolean tensors of the
    operand's shape for a whole tensor (a block marked at its first element); entries are
    None where there are no scales.
    """

    values: torch.Tensor
    counts: dict | None = None


def stochastic(spec) -> bool:
    """Whether an operand's format rounds stochastically (then it needs draws)."""
    return isinstance(spec, QuantSpec) and spec.stochastic


def draw_dtype(x: torch.Tensor, spec: QuantSpec) -> torch.dtype:
    """The dtype of the uniforms that round x stochastically: float32 (each uniform rounded
    toward zero, the same decisions: `fp4lab.formats.streams`, "Float32 uniforms") where x's
    values have at most 24 significant bits and at most 24 random bits count (`sr_bits`),
    float64 otherwise."""
    few_bits = spec.sr_bits is None or spec.sr_bits <= 24
    return torch.float32 if x.dtype != torch.float64 and few_bits else torch.float64


def quantize_operand(
    x: torch.Tensor,
    spec: QuantSpec | FloatFormat | None,
    *,
    axis: int,
    per_tile: bool = False,
    lift: float = 1.0,
    counts: bool = False,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | int | None = None,
    scope_dims: int = 0,
) -> Quantized:
    """Quantize one operand as attention does: ``fake_quantize(x * lift, spec) / lift``.

    x is a whole tensor or, with `per_tile`, a batch of tiles (its last two dims). A whole
    tensor's tensor scale is taken over all of it, or separately for each index of its
    first `scope_dims` dims. Stochastic rounding uses `noise` (uniforms of x's shape) or
    draws from `generator`. See the module docstring.
    """
    if spec is None:
        return Quantized(x, None)
    xs = x * lift if lift != 1.0 else x
    if isinstance(spec, FloatFormat):
        values = round_to_format(xs, spec)
        found = None
        if counts:
            clipped = xs.abs() > spec.max
            found = {"clipped": clipped.sum((-2, -1)) if per_tile else clipped}
    else:
        values, found = _block_quantize(
            xs, spec, axis, per_tile, counts, noise, generator, scope_dims
        )
    if lift != 1.0:
        values = values / lift
    return Quantized(values, found)


def quantize_field(x, field: str, ps: Pass, at: tuple[int, int] | None = None) -> Quantized:
    """Operand `field` of the pass's recipe, along its blocks' axis
    (`AttentionRecipe.block_axis`). A stochastic format rounds with the pass's draws at the
    operand's position: a block of tiles whose first (query tile, key tile) is `at`, or a
    whole tensor (B, H, S, E), whose tensor scale is taken as the recipe's `tensor_scope`
    says, over the pass's tiling: per tile of its side's rows, or per (batch, KV head) (a
    query-side tensor's G heads of a group share it)."""
    recipe = ps.recipe
    spec, op, axis = getattr(recipe, field), operand(field), recipe.block_axis(field)
    noise = ps.draws.for_operand(field, x, at, draw_dtype(x, spec)) if stochastic(spec) else None
    lift = getattr(recipe, op.lift) if op.lift else 1.0
    counts = ps.counts
    if op.per_tile or recipe.tensor_scope is TensorScope.TENSOR:
        return quantize_operand(
            x, spec, axis=axis, per_tile=op.per_tile, lift=lift, counts=counts, noise=noise
        )
    query_side = op.seq is Seq.QUERY
    if recipe.tensor_scope is TensorScope.HEAD:
        groups = ps.t.G if query_side else 1
        return _quantize_per_group(x, spec, axis, groups, lift, counts, noise)
    rows = ps.t.bm if query_side else ps.t.bn
    return _quantize_in_tiles(x, spec, axis, rows, lift, counts, noise)


def _quantize_per_group(
    x, spec, axis: int, groups: int, lift: float, counts: bool, noise
) -> Quantized:
    """A whole tensor (B, H, S, E) whose tensor scale is taken per (batch, key/value head):
    `groups` consecutive heads (a query-side tensor's heads of one KV head) share one."""
    b, h, n, e = x.shape
    view = lambda t: t.reshape(b, h // groups, groups, n, e)  # noqa: E731  (B, Hkv, G, S, E)
    noise = view(noise) if noise is not None else None
    out = quantize_operand(
        view(x), spec, axis=axis, lift=lift, counts=counts, noise=noise, scope_dims=2
    )
    found = None
    if out.counts is not None:
        found = {k: v.reshape(x.shape) if v is not None else None for k, v in out.counts.items()}
    return Quantized(out.values.reshape(x.shape), found)


def _quantize_in_tiles(
    x, spec, axis: int, rows: int, lift: float, counts: bool, noise
) -> Quantized:
    """A whole tensor (B, H, S, E) whose tensor scale is taken per tile of `rows` rows."""
    b, h, n, e = x.shape
    pad = -n % rows
    cut = lambda t: F.pad(t, (0, 0, 0, pad)).reshape(b, h, -1, rows, e)  # noqa: E731  (B, H, nT, rows, E)
    join = lambda t: t.reshape(b, h, n + pad, e)[:, :, :n]  # noqa: E731
    noise = cut(noise) if noise is not None else None
    out = quantize_operand(
        cut(x), spec, axis=axis, lift=lift, counts=counts, noise=noise, scope_dims=3
    )
    found = None
    if out.counts is not None:
        found = {k: join(v) if v is not None else None for k, v in out.counts.items()}
    return Quantized(join(out.values), found)


def _block_quantize(
    x,
    spec: QuantSpec,
    axis: int,
    per_tile: bool,
    counts: bool,
    noise,
    generator,
    scope_dims: int = 0,
):
    """fp4lab.formats' quantize pipeline and its dequantization (`quantize_blocks`), with the
    tensor scale taken over the whole of x or, with per_tile, over each tile (the last two
    dims: batch_dims = x.ndim - 2)."""
    if spec.block is not None and len(spec.block) == 2:
        axis = -1  # 2-D tiles lie on the natural layout
    elif spec.block is None and per_tile:
        if spec.hadamard is not None:
            raise ValueError(
                f"spec {spec.name!r}: a per-tile scale does not combine with a Hadamard transform"
            )
        # one scale per tile: a 2-D block covering the tile (then the counts' sums below hold)
        spec, axis = dataclasses.replace(spec, block=tuple(x.shape[-2:])), -1
    batch_dims = (x.ndim - 2 if spec.tensor_scale else 0) if per_tile else scope_dims
    fused = per_tile or not counts  # a whole tensor's counts mark elements: the steps
    b = quantize_blocks(x, spec, axis=axis, batch_dims=batch_dims, noise=noise,
                        generator=generator, fused=fused)
    found = (block_counts(b.scaled, b.amax, b.scales, b.decode, spec, b.layout, per_tile,
                          clipped=b.clipped) if counts else None)
    return b.dequantize(x.dtype), found
