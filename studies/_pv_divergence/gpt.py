"""A small GPT in the style of nanoGPT whose attention is `fp4lab.attention`.

What. Token and no position embedding, `n_layer` pre-norm blocks (LayerNorm, causal
self-attention with rotary positions on q and k, a 4x GELU MLP), a final LayerNorm and a head
tied to the token embedding, as nanoGPT's ``model.py`` has them (nanoGPT's learned positions
replaced by rotary ones, RoFormer, arXiv 2104.09864, the pairing of Llama's ``rotate_half``).

Why. The question is what a quantized P/V does to training, so the attention recipe must be
the only quantization: every matrix product outside attention runs in bf16 under autocast on
a GPU and in float32 on the CPU, and attention itself is `fp4lab.attention` with the run's
recipe and backend (autocast off inside it: the simulation keeps its own precision). How
every layer attends is one `AttentionCall` passed to `GPT.forward`, so the same weights can be
evaluated with another recipe (exact attention on a model trained with a quantized one); a
call without a recipe runs torch's ``F.scaled_dot_product_attention`` (the speed baseline).

The QKV projection can take a block format on its input and weight (``qkv_format``, e.g.
``fp8_e4m3_tensor``): `fp4lab.fake_quantize` with a straight-through gradient, modelling the
published runs' E4M3 projections (their ``fp8_qkv_projection_format``); the assumption that
the projection's own backward is unquantized is stated in the report.

With ``qk_norm`` each head's q and k are RMS-normalized (a learned gain per dimension, one
per layer for q and one for k, initialised to 1) before the rotary map: QK-norm (Dehghani et
al. 2023, arXiv 2302.05442; Wortsman et al. 2023, arXiv 2309.14322), which bounds the
attention logits by the gains. It adds no random draws, so a QK-norm model starts from the
same weights as the one without.

A model may record, for one forward, each layer's q, k, v and the gradient arriving at its
attention output (`GPT.capture`), which the study's probes read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp4lab
from fp4lab.recipes import AttentionRecipe

__all__ = ["GPTConfig", "GPT", "AttentionCall", "Capture"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    seq_len: int = 256  # context length
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads
    n_embd: int = 256  # model width (head_dim = n_embd / n_head)
    rope_base: float = 10000.0  # rotary frequency base
    qkv_format: str | None = None  # block format on the QKV projection's input and weight
    qk_norm: bool = False  # RMS-normalize each head's q and k (learned gains) before rotary

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head "
                             f"({self.n_head})")
        if (self.n_embd // self.n_head) % 2:
            raise ValueError(f"head_dim ({self.n_embd // self.n_head}) must be even for "
                             "rotary positions")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class AttentionCall:
    """How every layer calls attention: a recipe through `fp4lab.attention` on `backend`, or
    torch's SDPA (recipe None). `seed` (with the layer index) seeds stochastic rounding."""

    recipe: AttentionRecipe | None
    backend: str = "reference"
    block: int = 128  # the query and key tiles
    seed: int | None = None  # None: no generator (deterministic recipes)
    trace: fp4lab.Trace | None = None  # records every layer's call (call index = layer)
    # called as watch(layer, q, k) with each layer's detached q and k, before it attends (the
    # training loop's per-step logit statistics); None: nothing
    watch: object = None
    # the recipe whose gradient the backward takes, straight through the whole attention:
    # the output is `recipe`'s (run without autograd) and the gradient `gradient`'s at the
    # same q, k, v (its own forward run for it); None: `recipe`'s own backward
    gradient: AttentionRecipe | None = None


@dataclass
class Capture:
    """Each layer's attention inputs, output and output gradient from one forward (and
    backward)."""

    q: list = field(default_factory=list)  # (B, H, T, D) per layer, detached
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    o: list = field(default_factory=list)  # (B, H, T, D) per layer: attention's output
    do: dict = field(default_factory=dict)  # layer -> (B, H, T, D), set by the backward


def rotary(x: torch.Tensor, base: float) -> torch.Tensor:
    """x (B, H, T, D) rotated by position: pairs (x_i, x_{i + D/2}) turned by t * base^(-2i/D),
    computed in float32."""
    _, _, t, d = x.shape
    inv = base ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)  # (T, D/2)
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)  # (T, D)
    xf = x.float()
    half = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], dim=-1)
    return (xf * cos + half * sin).to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = nn.RMSNorm(config.head_dim, eps=1e-6)
            self.k_norm = nn.RMSNorm(config.head_dim, eps=1e-6)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        weight, fmt = self.c_attn.weight, self.config.qkv_format
        if fmt is not None:  # straight-through fake quantization of input and weight
            x = fp4lab.fake_quantize(x.float(), fmt).to(x.dtype)
            weight = fp4lab.fake_quantize(weight.float(), fmt).to(weight.dtype)
        return F.linear(x, weight)

    def forward(self, x: torch.Tensor, call: AttentionCall, capture: Capture | None):
        b, t, c = x.shape
        h, d = self.config.n_head, self.config.head_dim
        q, k, v = self.qkv(x).view(b, t, 3, h, d).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, D)
        if self.q_norm is not None:  # in v's dtype (autocast may run the norm in float32)
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        q, k = rotary(q, self.config.rope_base), rotary(k, self.config.rope_base)
        if call.watch is not None:
            call.watch(self.layer, q.detach(), k.detach())
        y = attend(q, k, v, call, self.layer)  # (B, H, T, D)
        if capture is not None:
            capture.q.append(q.detach())
            capture.k.append(k.detach())
            capture.v.append(v.detach())
            capture.o.append(y.detach())
            if y.requires_grad:
                y.register_hook(lambda g: capture.do.__setitem__(self.layer, g.detach()))
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


def attend(q, k, v, call: AttentionCall, layer: int) -> torch.Tensor:
    """Causal attention of (B, H, T, D) tensors as `call` says."""
    if call.recipe is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    seed = None if call.seed is None else (call.seed * 1_000_003 + layer) % 2**62
    run = dict(causal=True, backend=call.backend, block_m=call.block, block_n=call.block)
    with torch.autocast(q.device.type, enabled=False):
        if call.gradient is None:
            return fp4lab.attention(q, k, v, call.recipe, generator=seed, trace=call.trace,
                                    **run)
        with torch.no_grad():
            y = fp4lab.attention(q, k, v, call.recipe, generator=seed, trace=call.trace, **run)
        through = fp4lab.attention(q, k, v, call.gradient, **run)
        # y's value bit for bit (t - t is 0 where t is finite) with `through`'s gradient
        return (through - through.detach()) + y


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = SelfAttention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x, call: AttentionCall, capture: Capture | None):
        x = x + self.attn(self.ln_1(x), call, capture)
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.capture: Capture | None = None  # set to a Capture to record one forward
        self._init_weights()

    def _init_weights(self) -> None:
        """nanoGPT's: N(0, 0.02), the residual projections scaled by 1 / sqrt(2 n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith(
                    ("c_proj.weight", "proj.weight")) else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor, call: AttentionCall) -> torch.Tensor:
        """Logits (B, T, vocab) of token ids idx (B, T)."""
        x = self.wte(idx)
        for block in self.blocks:
            x = block(x, call, self.capture)
        return F.linear(self.ln_f(x), self.wte.weight)  # tied head

    def attention_parameters(self, layer: int) -> list[nn.Parameter]:
        """The parameters of layer `layer`'s attention (QKV and output projections, and the
        QK-norm gains where there are any)."""
        attn = self.blocks[layer].attn
        gains = [] if attn.q_norm is None else [attn.q_norm.weight, attn.k_norm.weight]
        return [attn.c_attn.weight, attn.c_proj.weight, *gains]
