"""Per-tile statistics of attention's operands and products, for the `Trace`.

The definitions of every column are in `fp4lab.recipes.trace`; these functions compute them
for a batch of tiles (reductions over the last two dims). Both execution paths use them: the
simulation for every column, the Triton backend for its whole-tensor operands (Q, K, V), whose
statistics it takes on the host, and for the columns it builds from the kernels' per-tile sums.
"""

from __future__ import annotations

import torch

from fp4lab.formats import QuantSpec

__all__ = [
    "operand_stats",
    "product_stats",
    "whole_stats",
    "grams",
    "gram_errors",
    "block_counts",
    "exact_count",
    "prefix",
    "fraction",
]

# Relative slack when judging a block scale out of its format's range: NVFP4's tensor scale
# maps the tensor amax to exactly 448 up to float32 rounding, which is not an overflow.
SLACK = 2.0**-20


def operand_stats(
    x: torch.Tensor,
    xq: torch.Tensor,
    counts: dict | None = None,
    *,
    of_x: dict | None = None,
    extras: dict | None = None,
) -> dict[str, torch.Tensor]:
    """The operand columns for tiles x -> x^ (..., rows, cols), reduced over the tile.

    `counts` holds per-tile counts of "clipped" elements and of "blocks" with a nonzero
    element, of which "scale_underflow" and "scale_overflow" left the scale format's range
    (missing or None: no block scales), or is None for an unquantized operand. `of_x`, a dict
    of x's own per-tile "norm" and "nonzero" count, is read where it holds them and filled in
    where not: two quantizations of one x (dS as dQ and as dK consume it) share them. A dict
    given as `extras` receives "kept_mass", each row's sum of x over the elements x^ keeps
    nonzero (..., rows). Sums run in x's precision; the columns are float64. One scratch
    tensor of x's size is allocated (fresh large tensors cost page faults).
    """
    dims = (-2, -1)
    of_x = {} if of_x is None else of_x
    scratch = torch.sub(xq, x)
    diff = torch.linalg.vector_norm(scratch, dim=dims).double()
    if "norm" not in of_x:
        of_x["norm"] = torch.linalg.vector_norm(x, dim=dims).double()
    # 1 where nonzero, 0 elsewhere, NaN where NaN (then the count is NaN): |sign|, or, where
    # both tiles are finite (their norms are), a comparison's 0 / 1, the same numbers
    finite = bool(torch.isfinite(diff).all() & torch.isfinite(of_x["norm"]).all())

    def ones(t):
        return torch.ne(t, 0, out=scratch) if finite else torch.sign(t, out=scratch).abs_()

    if "nonzero" not in of_x:
        of_x["nonzero"] = exact_count(ones(x), dims)
    norm, nonzero = of_x["norm"], of_x["nonzero"]
    kept = exact_count(ones(xq), dims)
    stats = {
        "err": torch.where(diff == 0, 0.0, diff / norm),
        # quantization maps 0 to 0, so the nonzeros lost are the ones flushed
        "flushed": fraction(nonzero - kept, nonzero),
        "nan": _nan_count(xq, diff),
    }
    if extras is not None:
        extras["kept_mass"] = scratch.mul_(x).sum(-1)
    counts = counts or {}
    stats["clipped"] = (
        fraction(counts["clipped"], nonzero) if "clipped" in counts else torch.zeros_like(diff)
    )
    blocks = counts.get("blocks")
    for name in ("scale_underflow", "scale_overflow"):
        hits = counts.get(name)
        stats[name] = (
            fraction(hits, blocks) if hits is not None else torch.full_like(diff, float("nan"))
        )
    return stats


def product_stats(
    y: torch.Tensor, y_ref: torch.Tensor, *, overwrite: bool = False
) -> dict[str, torch.Tensor]:
    """``prod_err`` and ``prod_nan`` of product tiles y (..., rows, cols) against y_ref
    (in y_ref's precision). With `overwrite`, y_ref is used as scratch (no allocation)."""
    dims = (-2, -1)
    norm = torch.linalg.vector_norm(y_ref, dim=dims).double()
    scratch = y_ref.sub_(y.to(y_ref.dtype)) if overwrite else y.to(y_ref.dtype) - y_ref
    diff = torch.linalg.vector_norm(scratch, dim=dims).double()
    return {"prod_err": torch.where(diff == 0, 0.0, diff / norm), "prod_nan": _nan_count(y, diff)}


def exact_count(ones: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Sum of 0/1 (or NaN) entries over `dims` as float64, summed in the entries' own float
    dtype when that is exact (at most 2^24 terms in float32): a float64 sum of a float32
    tensor would first copy it."""
    terms = 1
    for d in dims:
        terms *= ones.shape[d]
    if ones.dtype == torch.float64 or terms <= 1 << 24:
        return ones.sum(dims).double()
    return ones.sum(dims, dtype=torch.float64)


def _nan_count(y: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """NaN elements per tile; a tile whose norm is finite holds none, so on the CPU only
    tiles with a non-finite norm are counted. Elsewhere every tile is counted (the same
    numbers): one reduction on the device costs less than the host waiting for it to learn
    whether any norm is infinite."""
    if norm.device.type != "cpu":
        return torch.isnan(y).sum((-2, -1)).double()
    if bool(torch.isfinite(norm).all()):
        return torch.zeros_like(norm)
    return torch.isnan(y).sum((-2, -1)).double()


def prefix(stats: dict[str, torch.Tensor], side: str) -> dict[str, torch.Tensor]:
    """Operand statistics renamed for operand `side` ("a" or "b")."""
    return {f"{side}_{k}": v for k, v in stats.items()}


def fraction(hits: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.where(count > 0, hits.double() / count.clamp(min=1).double(), float("nan"))


def whole_stats(x, quant, tiler) -> dict:
    """Per-tile operand statistics of a whole-tensor operand x (B, H, S, E) and its quantized
    form `quant` (`.values` shaped as x, `.counts` as `block_counts` gives a whole tensor's,
    or None); `tiler` cuts (B, H, S, E) into the trace's tiles (..., tiles, rows, E)."""
    counts = None
    if quant.counts is not None:
        tile_sum = lambda f: tiler(f.to(torch.uint8)).sum((-2, -1))  # noqa: E731
        counts = {k: tile_sum(f) if f is not None else None for k, f in quant.counts.items()}
    return operand_stats(tiler(x), tiler(quant.values), counts)


def block_counts(scaled, amax, scales, decode, spec: QuantSpec, layout, per_tile: bool,
                 clipped=None) -> dict:
    """The trace's counts of a block quantization (`fp4lab.formats.quantize_blocks`'s scaled
    elements, blocks before rounding, overwritten here; its block amax, stored block scales
    and decode scale): "clipped" elements past the block's largest value in blocks whose
    stored scale is nonzero (a block whose scale rounds to zero stores zeros, which the trace
    counts as flushed: how large its scaled elements look depends only on the format's
    arithmetic, 0 for a quotient by the zero scale, float32's largest for a clamped
    reciprocal), "blocks" holding a nonzero,
    "scale_underflow" and "scale_overflow" such blocks whose ideal scale left the scale
    format's range beyond float32 rounding. Per tile (the last two block dims) with
    `per_tile`, else boolean tensors of the operand's shape (a block marked at its first
    element, through `layout`). A per-tile operand's `clipped` may give each block's count
    of those elements (float32, (..., blocks): `quantize_blocks`' fused pass) in place of
    `scaled` (then None)."""
    d = decode if decode is not None else torch.ones((), dtype=torch.float32)
    if clipped is not None and not per_tile:
        raise ValueError("block_counts: counts per block are for a per-tile operand only")
    stores = scales > 0  # only blocks that store a nonzero scale count
    ideal = amax / (spec.element.max * d)  # beyond the float32 rounding of the scale chain:
    nonzero = amax > 0
    blocks = {
        "blocks": nonzero,
        "scale_underflow": nonzero & (ideal < spec.scale.min_subnormal * (1 - SLACK)),
        "scale_overflow": ideal > spec.scale.max * (1 + SLACK),
    }
    elements = (scaled.shape[-3:].numel() if scaled is not None
                else scales.shape[-2:].numel() * layout.size)  # a tile's
    if clipped is None:  # |x| > M_e s d: saturated
        clipped = scaled.abs_().sub_(spec.element.max).clamp_(min=0).sign_()
        if per_tile:
            clipped = clipped.sum(-1)
    if per_tile:  # each block's count masked, not each element (integers: exact either way)
        per_block = clipped.mul_(stores)
        exact = elements <= 1 << 24  # every partial sum exact in float32
        tile = per_block.sum((-2, -1)) if exact else per_block.sum((-2, -1),
                                                                   dtype=torch.float64)
        return {"clipped": tile.double(), **{k: v.sum((-2, -1)) for k, v in blocks.items()}}
    clipped.mul_(stores.unsqueeze(-1))
    marks = {}
    for name, flag in blocks.items():
        mark = torch.zeros(scaled.shape, dtype=torch.bool, device=scaled.device)
        mark[..., 0] = flag
        marks[name] = layout.from_blocks(mark)
    return {"clipped": layout.from_blocks(clipped.bool()), **marks}


def grams(x: torch.Tensor, x_hat: torch.Tensor, tiler) -> tuple:
    """Per-tile Gram matrices of a whole-tensor operand in float64, flattened, for
    `gram_errors`: (X^T X, X^^T X, X^^T X^), each (..., tiles, E * E)."""
    t, th = tiler(x).double(), tiler(x_hat).double()
    gram = lambda a, b: (a.transpose(-1, -2) @ b).flatten(-2)  # noqa: E731
    return gram(t, t), gram(th, t), gram(th, th)


def gram_errors(a: tuple, b: tuple) -> torch.Tensor:
    """``prod_err`` of every tile pair (i, j) of y^ = A^_i B^_j^T against y = A_i B_j^T
    (S = Q K^T, dP = dO V^T), in float64 from the tiles' Gram matrices (`grams` of the
    query-side operand A, (B, Hkv, G, n, E * E), and the key-side operand B, (B, Hkv, g,
    E * E)), never forming y: ||y||^2 = <A^T A, B^T B>, <y^, y> = <A^^T A, B^^T B>,
    ||y^||^2 = <A^^T A^, B^^T B^>, ||y^ - y||^2 = ||y^||^2 - 2 <y^, y> + ||y||^2. This is
    the exact product of the quantized operands against the exact product of the unquantized
    ones (a path's own float32 rounding of y^, ~1e-7, is not in it), with float64 rounding:
    errors from about 1e-7 up are resolved. Returns (B, Hkv, G, n, g)."""

    def inner(x, z):  # <x_i, z_j> for every pair
        return x @ z.transpose(-1, -2)[:, :, None]

    ref, cross, quant = (inner(x, z) for x, z in zip(a, b, strict=True))
    err2 = (quant - 2 * cross + ref).clamp_(min=0)
    return torch.where(err2 == 0, 0.0, (err2 / ref).sqrt())
