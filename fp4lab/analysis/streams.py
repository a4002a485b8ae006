"""Stochastic rounding's random numbers inside attention, keyed by position.

Each pass (the forward, then the backward) draws one key of 62 bits from the call's
generator. Every tile of every operand then has its own stream: a Philox4x64 counter-based
generator (numpy's) whose key is a 64-bit hash of (pass key, operand stream id, batch, head,
query tile, key tile); a whole-tensor operand's tiles are its block_m (query side) or block_n
(key side) rows of one (batch, head). So an element's draw depends on the seed, the operand
and its position alone: not on how the simulation chunks the work, nor on the batch size or
the number of heads of the call. Two tiles share a stream only if their 64-bit hashes collide
(torch's CPU generator would keep 32 bits of a seed, and streams would collide within a long
run). Draws are float64 uniforms with 53 random bits, made on the CPU and moved to the
operand's device, so every device rounds alike.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from fp4lab.recipes import Seq, operand

__all__ = ["Draws", "ZeroDraws", "DROPOUT_STREAM"]

# The dropout mask's stream id, after the twelve operands' (`fp4lab.recipes.OPERANDS`).
DROPOUT_STREAM = 12

_MASK64 = (1 << 64) - 1


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


class Draws:
    """The uniforms of one pass: `for_operand` gives those of an operand's tensor or tiles."""

    def __init__(self, generator: torch.Generator, block_m: int, block_n: int):
        device = generator.device
        self.key = int(torch.randint(0, 1 << 62, (1,), generator=generator, device=device).item())
        self.rows = {Seq.QUERY: block_m, Seq.KEY: block_n}  # a whole tensor's tile rows

    def _uniforms(self, *position: int, shape) -> torch.Tensor:
        stream = np.random.Generator(np.random.Philox(key=_mix(self.key, *position)))
        return torch.from_numpy(stream.random(shape))

    def for_operand(self, field: str, x: torch.Tensor, at: tuple[int, int] | None) -> torch.Tensor:
        """Uniforms of x's shape for operand `field`: x a block of tiles
        (B, Hkv, G, n, g, r, c) whose first tile is (query tile, key tile) `at`, or, when
        `at` is None, a whole tensor (B, heads, seq, E) taken in tiles of its side's rows."""
        op = operand(field)
        if at is not None:
            return self.for_tiles(op.stream, x, at)
        out = torch.empty(x.shape, dtype=torch.float64)
        rows = self.rows[op.seq]
        tiles = range(-(-x.shape[2] // rows))
        for b, h, i in itertools.product(range(x.shape[0]), range(x.shape[1]), tiles):
            part = out[b, h, i * rows : (i + 1) * rows]
            part.copy_(
                self._uniforms(op.stream, b, h, i, shape=(rows, x.shape[3]))[: part.shape[0]]
            )
        return out.to(x.device)

    def for_tiles(self, stream: int, x: torch.Tensor, at: tuple[int, int]) -> torch.Tensor:
        """Uniforms of x's shape for a block of tiles x (B, Hkv, G, n, g, r, c) whose first
        tile is (query tile, key tile) `at`, from stream `stream`."""
        out = torch.empty(x.shape, dtype=torch.float64)
        i0, j0 = at
        b_, hk_, g_, n_, m_ = x.shape[:5]
        for b, hk, g, i, j in itertools.product(*map(range, (b_, hk_, g_, n_, m_))):
            position = (stream, b, hk * g_ + g, i0 + i, j0 + j)
            out[b, hk, g, i, j] = self._uniforms(*position, shape=x.shape[-2:])
        return out.to(x.device)


class ZeroDraws:
    """Uniforms that are all 0, where the draws do not matter: the trace's counts depend on
    block scales and scaled elements before rounding only, never on the draws."""

    def for_operand(self, field: str, x: torch.Tensor, at) -> torch.Tensor:
        return torch.zeros(x.shape, dtype=torch.float64, device=x.device)
