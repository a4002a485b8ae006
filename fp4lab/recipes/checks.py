"""What both backends check of a recipe against a call's shapes before anything runs: the
tiles, and every operand's blocks against the extents they must tile. Here, in the shared
package, so that the simulation and the Triton kernels refuse the same calls with the same
words (`fp4lab.analysis.checks` and `fp4lab.kernels.backend` both call it)."""

from __future__ import annotations

from fp4lab.formats import QuantSpec
from fp4lab.recipes.operands import OPERANDS, Extent
from fp4lab.recipes.recipe import AttentionRecipe, RowReference

__all__ = ["check_tiling"]


def check_tiling(recipe: AttentionRecipe, d: int, dv: int, block_m: int, block_n: int) -> None:
    """Tiles are positive ints; every operand's blocks tile head_dim (or cover it whole) and,
    for P and dS, the tiles."""
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if recipe.incoherent_processing and (d & (d - 1) or d < 2):
        raise ValueError(
            f"head_dim={d}: recipe {recipe.name!r} rotates Q and K by a Hadamard matrix, "
            "which needs a power of two"
        )
    if recipe.row_reference is RowReference.ANCHOR and recipe.anchor_keys > block_n:
        raise ValueError(
            f"block_n={block_n}: recipe {recipe.name!r} anchors each row on its first "
            f"{recipe.anchor_keys} keys, which must lie in the first key tile"
        )
    sizes = {Extent.HEAD_DIM: d, Extent.V_DIM: dv, Extent.BLOCK_M: block_m, Extent.BLOCK_N: block_n}
    for op in OPERANDS:
        spec = getattr(recipe, op.field)
        if not isinstance(spec, QuantSpec) or spec.block is None:
            continue
        if len(spec.block) == 1:  # the extent its axis spans: a tile's columns or rows
            pairs = [
                (spec.block[0], op.tile_cols if recipe.block_axis(op.field) == -1 else op.tile_rows)
            ]
        else:
            pairs = [(spec.block[0], op.tile_rows), (spec.block[1], op.tile_cols)]
        for block, extent in pairs:
            _check_divides(recipe, op.field, block, extent, sizes.get(extent))


def _check_divides(recipe, field: str, block: int, extent: Extent, size: int | None) -> None:
    if size is None or size % block == 0:
        return  # a whole tensor along its sequence is padded, as fake_quantize pads it
    if extent in (Extent.HEAD_DIM, Extent.V_DIM) and block >= size:
        return  # one block covers the whole dimension (zero padding keeps its amax)
    raise ValueError(
        f"{extent.value}={size} is not a multiple of {block}, the block size of operand "
        f"{field!r} of recipe {recipe.name!r}: its blocks cannot tile it"
    )
