"""The online softmax's running statistics, advanced a block of key tiles at a time.

A FlashAttention kernel keeps, per query row, the running maximum m_i of the scores seen so
far, the denominator l_i and the numerator acc, and rescales the last two by exp(m_old - m_new)
whenever the maximum grows. The simulation visits a block of g key tiles at once: the maximum
a kernel would hold after each of them is a cumulative maximum over the block's tiles (in the
order they are visited), so every P tile is what the kernel's loop computes, and each tile's
terms are weighted by exp(m_j - m_end) instead of being rescaled step by step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["OnlineSoftmax", "rescale_add"]


@dataclass
class OnlineSoftmax:
    """The online softmax of a chunk of n query tiles, advanced a block of key tiles at a time.

    m_i is the row reference (the running row maximum, unless fixed or lazy), l_i the
    denominator, acc the numerator, all (B, Hkv, G, n, bm[, Dv]); l_prime, acc_prime the same
    sums of the unquantized P for Attn-QAT's second output O' (None otherwise). A `fixed_m`
    (B, Hkv, G, n, bm) is the reference of every tile (fp4-fa4's shiftless softmax and its
    anchor); `lazy_log2` keeps the old maximum while a tile raises it by at most that many
    powers of two (FlashAttention-4's lazy rescaling).
    """

    m_i: torch.Tensor
    l_i: torch.Tensor
    acc: torch.Tensor
    l_prime: torch.Tensor | None = None
    acc_prime: torch.Tensor | None = None
    fixed_m: torch.Tensor | None = None
    lazy_log2: float | None = None

    @classmethod
    def start(
        cls,
        shape,
        dv: int,
        like: torch.Tensor,
        prime: bool = False,
        fixed_m=None,
        lazy_log2: float | None = None,
    ) -> OnlineSoftmax:
        zeros = lambda *extra: like.new_zeros(*shape, *extra)  # noqa: E731
        m_i = like.new_full(shape, -math.inf)
        primes = (zeros(), zeros(dv)) if prime else (None, None)
        return cls(m_i, zeros(), zeros(dv), *primes, fixed_m=fixed_m, lazy_log2=lazy_log2)

    def advance(self, s: torch.Tensor, reverse: bool, consume: bool = False):
        """-- update m_i -- over a block of scores s (..., n, g, bm, bn), key tile by key
        tile in visiting order: m_j = max(m_i, rowmax S_1, ..., rowmax S_j), a cumulative
        maximum. Returns P = exp(S_j - m_j), m_j (0 where a row has seen nothing yet)
        (..., n, g, bm), and the weights (alpha, w) that bring the old sums and each tile's
        terms to the block's last maximum m_end: alpha = exp(m_i - m_end),
        w_j = exp(m_j - m_end). With `consume`, P is computed in s's memory."""
        m_tiles = self._references(s.amax(dim=-1), reverse)
        m_end = m_tiles[..., 0 if reverse else -1, :]
        end = torch.where(m_end == -math.inf, 0.0, m_end)
        m_use = torch.where(m_tiles == -math.inf, 0.0, m_tiles)
        weights = (torch.exp(self.m_i - end), torch.exp(m_tiles - end.unsqueeze(-2)))
        self.m_i = m_end
        p = s.sub_(m_use.unsqueeze(-1)) if consume else s - m_use.unsqueeze(-1)
        return p.exp_(), m_use, weights

    def finish(self, prime: bool = False):
        """O = acc / l_i (0 for fully masked rows, as SDPA) and lse = m_i + log l_i (+inf
        there, so that the backward's exp(S - lse) is 0); with `prime`, of O' instead."""
        acc, denom = (self.acc_prime, self.l_prime) if prime else (self.acc, self.l_i)
        empty = denom == 0
        out = torch.where(empty.unsqueeze(-1), 0.0, acc / denom.unsqueeze(-1))
        lse = torch.where(empty, math.inf, self.m_i + torch.log(denom))
        return out, lse

    def _references(self, rowmax: torch.Tensor, reverse: bool) -> torch.Tensor:
        """The row reference each key tile of a block sees, (..., n, g, bm), from the tiles'
        row maxima (..., n, g, bm), in visiting order."""
        if self.fixed_m is not None:
            return self.fixed_m.unsqueeze(-2).expand_as(rowmax)
        if self.lazy_log2 is None:
            return torch.maximum(_cumulative_max(rowmax, reverse), self.m_i.unsqueeze(-2))
        out, m = torch.empty_like(rowmax), self.m_i
        tiles = range(rowmax.shape[-2])
        for j in reversed(tiles) if reverse else tiles:  # the decision depends on the path
            top = torch.maximum(m, rowmax[..., j, :])
            m = torch.where((top - m) * _LOG2E > self.lazy_log2, top, m)  # -inf - -inf: kept
            out[..., j, :] = m
        return out


_LOG2E = math.log2(math.e)


def _cumulative_max(rowmax: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Cumulative maximum over the key tiles (dim -2) in the order they are visited."""
    if not reverse:
        return torch.cummax(rowmax, dim=-2).values
    return torch.cummax(rowmax.flip(-2), dim=-2).values.flip(-2)


def rescale_add(total: torch.Tensor, weights, value: torch.Tensor) -> None:
    """total = alpha * total + sum_j w_j value_j, in place, for the terms value
    (..., n, g, bm[, E]) of a block's key tiles j (weights from `OnlineSoftmax.advance`)."""
    alpha, w = weights
    if value.ndim > w.ndim:
        alpha, w = alpha.unsqueeze(-1), w.unsqueeze(-1)
    summed = (value * w.to(value.dtype)).sum(dim=4)
    total.mul_(alpha.to(summed.dtype)).add_(summed)
