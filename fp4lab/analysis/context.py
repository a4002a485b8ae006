"""What an attention call and each of its passes run with, as two small records.

`CallConfig` is what the caller chose (recipe, mask, scale, tiles, generator, trace);
`Pass` is what one pass, the forward or the backward, works with besides its tensors: the
call's config, its tiling and mask tiles, the stochastic-rounding draws of the pass, and
whether the trace's counts are computed. Every step of the simulation takes one `Pass`
instead of a long list of arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fp4lab.analysis.streams import Draws, ZeroDraws
from fp4lab.analysis.tiling import MaskTiles, Tiling
from fp4lab.recipes import AttentionRecipe, KVOrder, Trace

__all__ = ["CallConfig", "Pass"]


@dataclass(frozen=True)
class CallConfig:
    """What one attention call runs with."""

    recipe: AttentionRecipe
    causal: bool
    scale: float  # softmax scale
    block_m: int  # query tile
    block_n: int  # key tile
    generator: torch.Generator | None  # stochastic rounding's (None for deterministic recipes)
    trace: Trace | None
    attn_mask: torch.Tensor | None
    seed: int | None = None  # the int seed the caller gave, if any (then the run reproduces)
    dropout_p: float = 0.0  # the probability of dropping an attention weight

    def tiling(self, q: torch.Tensor, k: torch.Tensor) -> Tiling:
        """The call's tiles for q (B, H, Sq, D) and k (B, Hkv, Sk, D)."""
        return Tiling(
            B=q.shape[0], H=q.shape[1], Hk=k.shape[1], Sq=q.shape[2], Sk=k.shape[2],
            bm=self.block_m, bn=self.block_n, causal=self.causal,
            reverse=self.recipe.kv_order is KVOrder.REVERSE, gpu=q.device.type == "cuda",
        )  # fmt: skip


@dataclass(frozen=True)
class Pass:
    """One pass of a call: the forward or the backward."""

    cfg: CallConfig
    t: Tiling
    mask: MaskTiles | None  # the call's attn_mask as tiles
    draws: Draws | ZeroDraws | None  # stochastic rounding's (None for deterministic recipes)
    counts: bool  # whether quantizers compute the trace's counts

    @classmethod
    def start(cls, cfg: CallConfig, t: Tiling, counts: bool) -> Pass:
        """A new pass: a stochastic recipe draws the pass's key from the call's generator
        now (the forward first, the backward after it)."""
        random = cfg.recipe.stochastic or cfg.dropout_p > 0
        draws = Draws(cfg.generator, t.bm, t.bn) if random else None
        mask = MaskTiles(cfg.attn_mask, t) if cfg.attn_mask is not None else None
        return cls(cfg, t, mask, draws, counts)

    @property
    def recipe(self) -> AttentionRecipe:
        return self.cfg.recipe

    def replace(self, **fields) -> Pass:
        """This pass with other draws or counts (a replay, the straight-through counts)."""
        return dataclasses.replace(self, **fields)
