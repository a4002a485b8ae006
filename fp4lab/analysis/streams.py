"""Stochastic rounding's random numbers inside attention, keyed by position.

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

from fp4lab.formats.philox import philox4x32, split_key
from fp4lab.recipes import operand

__all__ = ["Draws", "ZeroDraws", "DROPOUT_STREAM"]

# The dropout mask's stream id, after the twelve operands' (`fp4lab.recipes.OPERANDS`).
DROPOUT_STREAM = 12

_MASK64 = (1 << 64) - 1
_TWO_TO_MINUS_32 = 2.0**-32


def _mix(*values: int) -> int:
    """A 64-bit hash of a sequence of ints (splitmix64's finalizer, chained): the same on
    every machine and Python version."""
    h = 0
    for v in values:
        h = (h ^ (v & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h


def uniforms(key: int, batch, head, row, column) -> torch.Tensor:
    """float64 uniforms of the broadcast shape of the int64 position tensors, for the stream
    keyed by `key`. Where `column`'s last dim runs over whole aligned groups of four
    (starts at a multiple of 4 and has a multiple of 4 entries), one counter serves four
    columns; elsewhere each element takes word (column % 4) of its own counter."""
    k0, k1 = split_key(key)
    first = column[..., :1]
    aligned = column.shape[-1] % 4 == 0 and bool((first % 4 == 0).all())
    if aligned:  # counters (..., columns / 4), their four words side by side
        words = philox4x32(column[..., ::4] >> 2, row, head, batch, k0, k1)
        stacked = torch.stack(torch.broadcast_tensors(*words), dim=-1).flatten(-2)
    else:
        words = torch.broadcast_tensors(*philox4x32(column >> 2, row, head, batch, k0, k1))
        stacked = (
            torch.stack(words, dim=-1)
            .gather(-1, (column % 4).unsqueeze(-1).expand(*words[0].shape, 1))
            .squeeze(-1)
        )
    return stacked.to(torch.float64).mul_(_TWO_TO_MINUS_32)


class Draws:
    """The uniforms of one pass: `for_operand` gives an operand's, `for_tiles` a stream's on
    a block of tiles."""

    def __init__(self, generator: torch.Generator, block_m: int, block_n: int):
        device = generator.device
        self.key = int(torch.randint(0, 1 << 62, (1,), generator=generator, device=device).item())
        self.block_m, self.block_n = block_m, block_n

    def for_operand(self, field: str, x: torch.Tensor, at: tuple[int, int] | None) -> torch.Tensor:
        """Uniforms of x's shape for operand `field`: x a block of tiles
        (B, Hkv, G, n, g, r, c) whose first tile is (query tile, key tile) `at`, or, when
        `at` is None, a whole tensor (B, heads, seq, E)."""
        stream = operand(field).stream
        if at is not None:
            return self.for_tiles(stream, x, at)
        b, h, s, e = x.shape
        width = -(-e // 4) * 4  # whole groups of four columns, cropped after
        position = (_index(b, 0, 4), _index(h, 1, 4), _index(s, 2, 4), _index(width, 3, 4))
        position = tuple(p.to(x.device) for p in position)
        return uniforms(_mix(self.key, stream), *position)[..., :e]

    def for_tiles(self, stream: int, x: torch.Tensor, at: tuple[int, int]) -> torch.Tensor:
        """Uniforms of x's shape for a block of tiles x (B, Hkv, G, n, g, r, c) whose first
        tile is (query tile, key tile) `at`, from stream `stream`."""
        b, hk, g, n, m, r, c = x.shape
        i0, j0 = at
        head = _index(hk, 1, 7) * g + _index(g, 2, 7)  # the query head
        rows = (i0 + _index(n, 3, 7)) * self.block_m + _index(r, 5, 7)
        cols = (j0 + _index(m, 4, 7)) * self.block_n + _index(c, 6, 7)
        position = tuple(p.to(x.device) for p in (_index(b, 0, 7), head, rows, cols))
        return uniforms(_mix(self.key, stream), *position)


def _index(n: int, dim: int, ndim: int) -> torch.Tensor:
    """arange(n), int64, along dim `dim` of an `ndim`-dim shape of ones."""
    shape = [1] * ndim
    shape[dim] = n
    return torch.arange(n).view(shape)


class ZeroDraws:
    """Uniforms that are all 0, where the draws do not matter: the trace's counts depend on
    block scales and scaled elements before rounding only, never on the draws."""

    def for_operand(self, field: str, x: torch.Tensor, at) -> torch.Tensor:
        return torch.zeros(x.shape, dtype=torch.float64, device=x.device)
