"""Stochastic rounding's random numbers inside attention, keyed by position, tile by tile.

The definition lives in `fp4lab.formats.streams` (the Triton backend draws from it too); this
module hands the simulation its uniforms per operand and per block of tiles.

Each pass (the forward, then the backward) draws one key of 62 bits from the call's
generator. Every element of every operand then takes its uniform from Philox4x32-10
(`fp4lab.formats.philox`, the generator the Triton kernels implement bit for bit) as a pure
function of:

- the key of the stream: a 64-bit hash of (pass key, stream id), the operand's stream id
  from `fp4lab.recipes.OPERANDS` (`DROPOUT_STREAM` for dropout's mask);
- the counter: its absolute position, (c0, c1, c2, c3) = (column // 4, row, head, batch),
  the row being its sequence position (the query position for P and dS), the column its
  feature (the key position for P and dS), the head the query head (a whole key-side tensor's
  own head); the counter's four output words serve four consecutive columns.

So an element's draw depends on the seed, the operand and its position alone: not on the
tiles, how the simulation chunks the work, the batch size or the number of heads of the call.
A uniform is a 32-bit word times 2^-32: rounding up where u < frac is exactly unbiased for a
fraction of at most 32 bits below the quantum (every float32 input within 2^8 quanta of the
format's grid), and biased by less than 2^-32 of a quantum otherwise. Draws are made on the
operand's device.
"""

from __future__ import annotations

import torch

from fp4lab.formats.streams import pass_key, stream_key, stream_keys, tensor_uniforms, uniforms
from fp4lab.recipes import operand

__all__ = ["Draws", "ZeroDraws", "DROPOUT_STREAM"]

# The dropout mask's stream id, after the twelve operands' (`fp4lab.recipes.OPERANDS`).
DROPOUT_STREAM = 12


class Draws:
    """The uniforms of one pass: `for_operand` gives an operand's, `for_tiles` a stream's on
    a block of tiles."""

    def __init__(self, generator, block_m: int, block_n: int):
        """`generator`: a torch.Generator, or a tuple of n of them for n samples stacked along
        the batch (`fp4lab.formats.streams.as_generators`): then `key` is a tuple."""
        self.key = pass_key(generator)
        self.block_m, self.block_n = block_m, block_n

    def for_operand(
        self, field: str, x: torch.Tensor, at: tuple[int, int] | None, dtype=torch.float64
    ) -> torch.Tensor:
        """Uniforms of x's shape for operand `field`: x a block of tiles
        (B, Hkv, G, n, g, r, c) whose first tile is (query tile, key tile) `at`, or, when
        `at` is None, a whole tensor (B, heads, seq, E); float64, or float32 rounded toward
        zero (`fp4lab.formats.streams`, "Float32 uniforms")."""
        stream = operand(field).stream
        if at is not None:
            return self.for_tiles(stream, x, at, dtype)
        return tensor_uniforms(stream_keys(self.key, stream), x.shape, x.device, dtype)

    def for_tiles(
        self, stream: int, x: torch.Tensor, at: tuple[int, int], dtype=torch.float64
    ) -> torch.Tensor:
        """Uniforms of x's shape for a block of tiles x (B, Hkv, G, n, g, r, c) whose first
        tile is (query tile, key tile) `at`, from stream `stream`."""
        b, hk, g, n, m, r, c = x.shape
        if isinstance(self.key, tuple):  # stacked samples: each chunk of the batch alone
            chunks = x.chunk(len(self.key))
            return torch.cat([self._tiles(k, stream, part, at, dtype)
                              for k, part in zip(self.key, chunks, strict=True)])  # fmt: skip
        return self._tiles(self.key, stream, x, at, dtype)

    def _tiles(self, key: int, stream: int, x: torch.Tensor, at: tuple[int, int], dtype):
        b, hk, g, n, m, r, c = x.shape
        i0, j0 = at
        head = _index(hk, 1, 7) * g + _index(g, 2, 7)  # the query head
        rows = (i0 + _index(n, 3, 7)) * self.block_m + _index(r, 5, 7)
        cols = (j0 + _index(m, 4, 7)) * self.block_n + _index(c, 6, 7)
        position = tuple(p.to(x.device) for p in (_index(b, 0, 7), head, rows, cols))
        return uniforms(stream_key(key, stream), *position, dtype=dtype)


def _index(n: int, dim: int, ndim: int) -> torch.Tensor:
    """arange(n), int64, along dim `dim` of an `ndim`-dim shape of ones."""
    shape = [1] * ndim
    shape[dim] = n
    return torch.arange(n).view(shape)


class ZeroDraws:
    """Uniforms that are all 0, where the draws do not matter: the trace's counts depend on
    block scales and scaled elements before rounding only, never on the draws."""

    def for_operand(self, field: str, x: torch.Tensor, at, dtype=torch.float64) -> torch.Tensor:
        return torch.zeros(x.shape, dtype=dtype, device=x.device)
