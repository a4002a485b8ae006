"""How the simulation cuts attention into tiles and blocks of tiles, and the masks on them.

A FlashAttention kernel works on tiles: block_m query rows against block_n key rows. The
simulation keeps every query-side tensor as (B, Hkv, G, nQ, block_m, E), query head
h = kv_head * G + g (grouped-query attention), and every key-side tensor as
(B, Hkv, nK, block_n, E). It runs in blocks of n query tiles by g key tiles whose tile
tensors are (B, Hkv, G, n, g, block_m, block_n): all of a block's tile pairs at once, so that
few, large torch operations do the work of the kernel's many small ones, with memory bounded
by `BLOCK_ELEMENTS` per block tensor (never seq x seq).

Masks, by what they cover:
- `TileBlock.allowed()`: the entries of a block in range of both sequences and not cut by
  the causal mask (top-left aligned, as SDPA's ``is_causal``: query i sees keys j <= i);
- `TileBlock.visible()`: the tile pairs holding at least one allowed entry, the pairs a
  kernel visits; the others are skipped (their products are zero, and absent from the trace);
- `MaskTiles`: a user's ``attn_mask`` cut into the same tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "BLOCK_ELEMENTS",
    "GPU_BLOCK_ELEMENTS",
    "Tiling",
    "TileBlock",
    "MaskTiles",
    "zero_skipped",
    "pairs",
    "times_key",
    "t_times_query",
]

# Elements of one block's tile tensor (B, Hkv, G, n, g, block_m, block_n): the work runs in
# blocks of at most this size (memory ~ 20x this in floats). On the CPU a block's temporaries
# stay near the caches; on a GPU, blocks are sized for the device's memory and launch cost
# (GPU_BLOCK_ELEMENTS: about 5 GB of temporaries in float32), so that what the kernels do not
# cover stays usable there.
BLOCK_ELEMENTS = 1 << 20
GPU_BLOCK_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class Tiling:
    """The shapes of one attention call and its tiles.

    Attributes:
        B, H, Hk: batch, query heads, key/value heads (H a multiple of Hk).
        Sq, Sk: query and key sequence lengths.
        bm, bn: query and key tile sizes (block_m, block_n).
        causal: whether the causal mask applies.
        reverse: whether key tiles are visited from the last to the first.
    """

    B: int
    H: int
    Hk: int
    Sq: int
    Sk: int
    bm: int
    bn: int
    causal: bool
    reverse: bool = False
    gpu: bool = False  # sized for a GPU (GPU_BLOCK_ELEMENTS) rather than a CPU

    @property
    def G(self) -> int:
        """Query heads per key/value head."""
        return self.H // self.Hk

    @property
    def nQ(self) -> int:
        return -(-self.Sq // self.bm)

    @property
    def nK(self) -> int:
        return -(-self.Sk // self.bn)

    def q_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, Sq, ...) -> (B, Hkv, G, nQ, bm, ...), zero padded."""
        if self.nQ * self.bm != self.Sq:  # (F.pad copies even when it pads nothing)
            x = F.pad(x, [0, 0] * (x.ndim - 3) + [0, self.nQ * self.bm - self.Sq])
        return x.reshape(self.B, self.Hk, self.G, self.nQ, self.bm, *x.shape[3:])

    def q_untile(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, G, nQ, bm, ...) -> (B, H, Sq, ...)."""
        return t.reshape(self.B, self.H, self.nQ * self.bm, *t.shape[5:])[:, :, : self.Sq]

    def k_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, Sk, E) -> (B, Hkv, nK, bn, E), zero padded."""
        if self.nK * self.bn != self.Sk:
            x = F.pad(x, (0, 0, 0, self.nK * self.bn - self.Sk))
        return x.reshape(self.B, self.Hk, self.nK, self.bn, x.shape[-1])

    def k_untile(self, t: torch.Tensor) -> torch.Tensor:
        """(B, Hkv, nK, bn, E) -> (B, Hkv, Sk, E)."""
        return t.reshape(self.B, self.Hk, self.nK * self.bn, t.shape[-1])[:, :, : self.Sk]

    def chunks(self) -> list[tuple[int, int, list[TileBlock]]]:
        """Chunks of query tiles [i0, i1), each with the blocks of key tiles it visits, in
        the kernel's order (last to first with `reverse`). A block's tile tensor holds at
        most BLOCK_ELEMENTS (GPU_BLOCK_ELEMENTS on a GPU) elements (or one tile pair per
        (batch, head)); a chunk takes
        every key tile at once when they fit, and then as many query tiles as fit."""
        budget = GPU_BLOCK_ELEMENTS if self.gpu else BLOCK_ELEMENTS
        tiles = max(1, budget // max(self.B * self.H * self.bm * self.bn, 1))
        group = min(tiles, max(self.nK, 1))
        step = max(1, tiles // group)
        out = []
        for i0 in range(0, self.nQ, step):
            i1 = min(i0 + step, self.nQ)
            seen = self.key_tiles_seen(i0, i1)
            blocks = [
                TileBlock(self, i0, i1, j, min(j + group, seen)) for j in range(0, seen, group)
            ]
            out.append((i0, i1, blocks[::-1] if self.reverse else blocks))
        return out

    def key_tiles_seen(self, i0: int, i1: int) -> int:
        """How many key tiles (a prefix) the queries of tiles [i0, i1) can see."""
        if not self.causal:
            return self.nK
        last_row = min(i1 * self.bm, self.Sq) - 1
        return min(self.nK, last_row // self.bn + 1)


@dataclass(frozen=True)
class TileBlock:
    """Query tiles [i0, i1) by key tiles [j0, j1) of a `Tiling`: n = i1 - i0, g = j1 - j0."""

    t: Tiling
    i0: int
    i1: int
    j0: int
    j1: int

    def allowed(self, device) -> torch.Tensor:
        """(n, g, bm, bn) bool: the entries in range of both sequences and not causally cut."""
        t = self.t
        rows = torch.arange(self.i0 * t.bm, self.i1 * t.bm, device=device).view(-1, 1, t.bm, 1)
        cols = torch.arange(self.j0 * t.bn, self.j1 * t.bn, device=device).view(1, -1, 1, t.bn)
        ok = (rows < t.Sq) & (cols < t.Sk)
        return ok & (cols <= rows) if t.causal else ok

    def visible(self) -> torch.Tensor:
        """(n, g) bool (CPU): the tile pairs holding an allowed entry, the ones a kernel
        visits; the trace records only these."""
        t = self.t
        i = torch.arange(self.i0, self.i1).view(-1, 1)
        first_col = torch.arange(self.j0, self.j1).view(1, -1) * t.bn
        ok = (i * t.bm < t.Sq) & (first_col < t.Sk)
        if t.causal:
            ok = ok & (first_col <= torch.clamp((i + 1) * t.bm, max=t.Sq) - 1)
        return ok

    def skipped(self, device) -> torch.Tensor | None:
        """The tile pairs a kernel never visits (causal), as a (n, g, 1, 1) mask on `device`,
        or None when there are none. Their products are zeroed here (P is 0 there, but
        0 * NaN in V or dO would be NaN)."""
        skipped = ~self.visible()
        return skipped.to(device)[..., None, None] if bool(skipped.any()) else None


def zero_skipped(x: torch.Tensor, skipped: torch.Tensor | None) -> torch.Tensor:
    """x (..., n, g, r, c) with the tile pairs `skipped` marks set to 0 (in place)."""
    return x if skipped is None else x.masked_fill_(skipped, 0)


class MaskTiles:
    """attn_mask as tiles: (B|1, Hkv|1, G|1, nQ, nK, bm, bn), padded with 'masked'."""

    def __init__(self, mask: torch.Tensor, t: Tiling):
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        mask = mask.expand(mask.shape[0], mask.shape[1], t.Sq, t.Sk)
        heads = (t.Hk, t.G) if mask.shape[1] == t.H else (1, 1)
        fill = False if mask.dtype == torch.bool else -math.inf
        mask = F.pad(mask, (0, t.nK * t.bn - t.Sk, 0, t.nQ * t.bm - t.Sq), value=fill)
        # (B|1, H|1, nQ bm, nK bn) -> (B|1, Hkv|1, G|1, nQ, nK, bm, bn)
        self.tiles = mask.reshape(mask.shape[0], *heads, t.nQ, t.bm, t.nK, t.bn).transpose(-3, -2)
        self.boolean = mask.dtype == torch.bool

    def apply(self, s: torch.Tensor, block: TileBlock) -> torch.Tensor:
        """Scores s (B, Hkv, G, n, g, bm, bn) of `block` with the mask applied."""
        tile = self.tiles[:, :, :, block.i0 : block.i1, block.j0 : block.j1]
        if self.boolean:
            return s.masked_fill(~tile, -math.inf)
        return s + tile.to(s.dtype)


# -- the products of a block, one per tile pair (i, j): the trace needs each tile's product ----
def pairs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_i y_j^T for query tiles x (B, Hkv, G, n, r, c) and key tiles y (B, Hkv, g, e, c):
    (B, Hkv, G, n, g, r, e) (S = Q K^T, dP = dO V^T)."""
    # A broadcast batched product: it copies both operands per tile pair (3 ms of the exact
    # forward's 11 ms on the H200), but one product of the block's query rows by its key rows
    # rounded the scores differently on CUDA, enough to move nvfp4's dQ from the kernels' by
    # 1.5e-3 in test_both_backends_default_to_the_same_tiles (RESULTS.md, session 22)
    return x.unsqueeze(4) @ y.transpose(-1, -2)[:, :, None, None]


def times_key(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_ij y_j for tiles x (B, Hkv, G, n, g, r, c) and key tiles y (B, Hkv, g, c, e):
    (B, Hkv, G, n, g, r, e) (P V, dS K)."""
    return x @ y[:, :, None, None]


def t_times_query(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_ij^T y_i for tiles x (B, Hkv, G, n, g, r, c) and query tiles y (B, Hkv, G, n, r, e):
    (B, Hkv, G, n, g, c, e) (P^T dO, dS^T Q: each query tile's part of dV_j, dK_j)."""
    return x.transpose(-1, -2) @ y.unsqueeze(4)
