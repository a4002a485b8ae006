"""How the forward turns a probability tile P = exp(S - m) into the P^ that P V consumes.

m is the row reference of the online softmax (its running maximum), so a tile's values
depend on the tiles visited before it, as in a kernel. Three ways, one per `PQuant` member:

- SPEC: the recipe's `p` format along the keys, after the recipe's lift (`quantize_field`);
- ROW_SCALED: two-level P, each row of the tile scaled so that its maximum maps to the
  largest value the `p` format represents, quantized, and scaled back;
- DIRECT: Direct-P, E2M1 codes computed from the scores themselves.
"""

from __future__ import annotations

import math

import torch

from fp4lab.analysis.context import Pass
from fp4lab.analysis.quantizers import (
    Quantized,
    draw_dtype,
    quantize_field,
    quantize_operand,
    stochastic,
)
from fp4lab.formats import ScaleRule, round_to_format
from fp4lab.recipes import AttentionRecipe, PQuant

__all__ = ["quantize_p"]

_LOG2E = math.log2(math.e)


def quantize_p(p, s, m_row, ps: Pass, at: tuple[int, int]) -> Quantized:
    """P^ from P = exp(S - m_row) as the pass's recipe's `p_quant` says, for a block of
    tiles (..., bm, bn) whose first tile is `at`; S are the scores, m_row (..., bm)."""
    recipe = ps.recipe
    if recipe.p_quant is PQuant.SPEC:
        return quantize_field(p, "p", ps, at)
    if recipe.p_quant is PQuant.ROW_SCALED:
        return _row_scaled_p(p, recipe, ps.draws, ps.counts, at)
    return _direct_p(s, m_row, recipe, ps.counts)


def _row_scaled_p(p, recipe: AttentionRecipe, draws, counts: bool, at) -> Quantized:
    """Two-level P: r_i = (M_e * M_s) / max_j P_ij per row of the tile (float32, unrounded),
    P^ = q(r P) / r."""
    top = recipe.p.element.max * recipe.p.scale.max
    rowmax = p.amax(dim=-1, keepdim=True)
    r = torch.where(rowmax > 0, top / rowmax, torch.ones_like(rowmax))
    noise = None
    if stochastic(recipe.p):
        noise = draws.for_operand("p", p, at, draw_dtype(p, recipe.p))
    out = quantize_operand(p * r, recipe.p, axis=-1, per_tile=True, counts=counts, noise=noise)
    return Quantized(out.values / r, out.counts)


def _direct_p(s, m_row, recipe: AttentionRecipe, counts: bool) -> Quantized:
    """Direct-P (fp4-fa4, ``hao_direct_transform_pack_mxfp4_quarter_log2``): E2M1 codes
    straight from the scores.

    Per block B of n keys: z = (s - m) log2(e) (log2 P), e_B from the block's largest z by
    the `p` format's alpha rule (clamped to [p_min_exponent, 127]), x = z - e_B + log2(M_e),
    q = E2M1(2^x), or E2M1(max(0, A x + B)) on the blocks `direct_p_affine_groups` selects;
    the represented P is 2^e_B q / M_e.
    """
    spec = recipe.p
    n, m_e = spec.block[0], spec.element.max
    z = (s - m_row.unsqueeze(-1)) * _LOG2E  # log2 P, (..., bm, bn)
    zb = z.reshape(*z.shape[:-1], -1, n)  # (..., bm, bn / n, n)
    lo = math.log2(spec.scale.min_subnormal)
    if recipe.p_min_exponent is not None:
        lo = max(lo, recipe.p_min_exponent)
    top = zb.amax(dim=-1, keepdim=True)
    e_b = _block_exponent(top, spec.scale_rule).clamp(lo, math.log2(spec.scale.max))
    x = zb - e_b + math.log2(m_e)
    u = torch.exp2(x)
    if recipe.direct_p_affine is not None:
        a, b = recipe.direct_p_affine
        affine = (a * x + b).clamp(min=0)
        groups = recipe.direct_p_affine_groups
        if groups is None:
            u = affine
        else:  # bit g: the g-th block of each key tile
            chosen = torch.tensor(
                [bool(groups >> g & 1) for g in range(zb.shape[-2])], device=z.device
            )
            u = torch.where(chosen.view(-1, 1), affine, u)
    codes = round_to_format(u, spec.element)
    # 2^e_B times codes / M_e: no intermediate overflows at e_B = 127 (the released kernel
    # never forms 2^e_B codes either: it stores its scale S steps low, `p_scale_shift`);
    # the same bits as (2^e_B codes) / M_e wherever that is finite and normal
    p_hat = (torch.exp2(e_b) * (codes / m_e)).reshape(z.shape)
    found = None
    if counts:  # codes past M_e; e_B clamped at the bottom (no overflow)
        seen = top.squeeze(-1) > -math.inf
        under = ((e_b.squeeze(-1) == lo) & seen).sum((-2, -1))
        found = {
            "clipped": (u > m_e).sum((-3, -2, -1)),
            "blocks": seen.sum((-2, -1)),
            "scale_underflow": under,
            "scale_overflow": torch.zeros_like(under),
        }
    return Quantized(p_hat, found)


def _block_exponent(top: torch.Tensor, rule: ScaleRule) -> torch.Tensor:
    """e_B from the log2 of a block's largest P by an alpha rule, as fp4-fa4 computes it in
    the log domain: select 4 (ALPHA_CEIL) ceil(z); select 1 (ALPHA_HALF)
    floor(z + 1 - log2 1.5); the others from r = 2^(z - floor z) as `ScaleRule` says."""
    if rule is ScaleRule.ALPHA_CEIL:
        return torch.ceil(top)
    if rule is ScaleRule.ALPHA_HALF:
        return torch.floor(top + 1 - math.log2(1.5))
    floor = torch.floor(top)
    r = torch.exp2(top - floor)
    if rule is ScaleRule.ALPHA_MSE:
        return floor + (r >= 1.203125)
    odd = torch.remainder(floor + 127, 2) == 1  # ALPHA_RTE
    return floor + ((r > 1.5) | ((r == 1.5) & odd))
