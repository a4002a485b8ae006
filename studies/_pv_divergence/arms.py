"""The arms of the study: an attention recipe plus the few training choices a cause or a fix
needs (E4M3 QKV projections, gradient clipping, QK-norm, a loss scale).

The three published routes are presets of `fp4lab.recipes`; every variant changes one thing
of one of them with `dataclasses.replace`, using named block formats of `fp4lab.formats`, so
that a difference between two arms' curves has one candidate explanation. `CAUSES` pairs each
candidate cause of the MXFP4 P/V divergence with the arm that tests it and the arm it is
compared with; it covers the mechanisms the mxfp4-pv-mechanisms study names for training
(the represented denominator, P's and V's E8M0 rules, P's anchor and exponent floor, V's
leaking blocks).

The loss-scaled arms test a confound of the study's size rather than a cause of the published
divergence: the v509 backward quantizes dO as E5M2(4 dO), whose smallest subnormal 2^-16
flushes every |dO| below about 2^-18, and this model's mean loss over a global batch of 8192
tokens leaves dO near 1e-7 at the attention outputs, so most of it flushes. A loss scale of
2^13 (the batch's token count: the summed loss) lifts dO by that factor; the gradients are
divided by it again before anything reads them (`training.Run.train_step`), which in exact
arithmetic changes nothing, so the quantized attention backward is the only thing that sees it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fp4lab.formats import (
    FP8_E4M3_TENSOR,
    FP8_E4M3_X4,
    MXFP4_ALPHA_MSE,
    MXFP4_RCEIL,
    NVFP4,
    NVFP4_UE5M3,
    Rounding,
)
from fp4lab.recipes import (
    EXACT,
    FA4FP4_CAUSAL,
    FA4FP4_CAUSAL_MXFP4PV,
    FA4FP4_CAUSAL_MXFP4PV_D64,
    FA4FP4_CAUSAL_MXFP4PV_FIXED,
    FLASH_BF16,
    AttentionRecipe,
    BackwardV,
    RowReference,
    RowSum,
)

__all__ = ["Arm", "ARMS", "CAUSES", "Cause", "REFERENCE_ARM"]


@dataclass(frozen=True)
class Arm:
    """One training configuration.

    Attributes:
        recipe: the attention recipe (None: torch's SDPA, the speed baseline).
        what: what it is, in a phrase.
        qkv_format: a block format on the QKV projection's input and weight, or None.
        grad_clip: the gradient norm clipped to, or None (the default: divergence visible).
        qk_norm: RMS-normalize each head's q and k before attention (`gpt.GPTConfig`).
        loss_scale: the training loss is multiplied by it before the backward and every
            gradient divided by it after (a positive power of two, so both are exact and only
            the quantized attention backward sees dO this many times larger); 1: none.
        gradient: a recipe whose gradient the training backward takes in place of
            `recipe`'s own, straight through the whole attention (`gpt.AttentionCall`): the
            forward's output is `recipe`'s, the gradient `gradient`'s at the same q, k, v;
            None (the default): `recipe`'s own backward.
    """

    recipe: AttentionRecipe | None
    what: str
    qkv_format: str | None = None
    grad_clip: float | None = None
    qk_norm: bool = False
    loss_scale: float = 1.0
    gradient: AttentionRecipe | None = None

    def __post_init__(self) -> None:
        scale = self.loss_scale
        if (isinstance(scale, bool) or not isinstance(scale, (int, float))
                or not (0 < scale < math.inf) or math.frexp(scale)[0] != 0.5):
            name = "torch SDPA" if self.recipe is None else self.recipe.name
            raise ValueError(f"arm {self.what!r} ({name}): loss_scale must be a positive power "
                             f"of two (scaling by it and back is exact), got {scale!r}")


def _variant(base: AttentionRecipe, name: str, **changes) -> AttentionRecipe:
    return dataclasses.replace(base, name=name, source=f"studies/pv_divergence.py: {base.name} "
                               f"with {', '.join(changes)} changed", **changes)


MXFP4_ALPHA_MSE_SR = dataclasses.replace(
    MXFP4_ALPHA_MSE, name="mxfp4_alpha_mse_sr", rounding=Rounding.STOCHASTIC)
_MX = FA4FP4_CAUSAL_MXFP4PV
LOSS_SCALE = 2.0**13  # the loss-scaled arms': the full preset's 16 x 512 tokens per step

ARMS: dict[str, Arm] = {
    "exact": Arm(EXACT, "no quantization (float32 attention)"),
    "bf16": Arm(FLASH_BF16, "BF16 operands, float32 accumulation: the reference"),
    "sdpa": Arm(None, "torch's scaled_dot_product_attention (the speed baseline)"),
    "fp8pv": Arm(FA4FP4_CAUSAL, "NVFP4 Q/K, FP8 P/V: the published stable route (v509)"),
    "mxfp4pv": Arm(_MX, "NVFP4 Q/K, MXFP4 P/V: the published diverging route (D128)"),
    "mxfp4pv_d64": Arm(FA4FP4_CAUSAL_MXFP4PV_D64,
                       "the MXFP4 P/V route as the published 1.2B (head_dim 64) runs had it"),
    "mxfp4_p_only": Arm(
        _variant(_MX, "mxfp4pv_p_only", v=FP8_E4M3_X4, backward_v=BackwardV.INPUT),
        "MXFP4 (Direct-P) P, FP8 V as the FP8 route's"),
    "mxfp4_v_only": Arm(
        _variant(FA4FP4_CAUSAL, "fp8pv_mxfp4_v", v=MXFP4_ALPHA_MSE,
                 backward_v=BackwardV.FORWARD),
        "FP8 P as the FP8 route's, MXFP4 V (and the backward's V from it)"),
    "mxfp4pv_rceil_v": Arm(_variant(_MX, "mxfp4pv_rceil_v", v=MXFP4_RCEIL),
                           "MXFP4 P/V with V's scale rounded up (rceil: its block max never "
                           "clips)"),
    "mxfp4pv_sr_v": Arm(_variant(_MX, "mxfp4pv_sr_v", v=MXFP4_ALPHA_MSE_SR),
                        "MXFP4 P/V with V's elements rounded stochastically"),
    "mxfp4pv_no_rowcorr": Arm(_variant(_MX, "mxfp4pv_no_rowcorr", row_sum=RowSum.UNQUANTIZED_P),
                              "MXFP4 P/V with the denominator from the unquantized P (no row "
                              "correction)"),
    "mxfp4pv_running_max": Arm(
        _variant(_MX, "mxfp4pv_running_max", row_reference=RowReference.RUNNING_MAX,
                 p_min_exponent=None, p_scale_shift=0),
        "MXFP4 P/V with P against the running row maximum and no exponent floor (the anchor "
        "and the underflow it causes removed)"),
    "nvfp4pv": Arm(_variant(FA4FP4_CAUSAL, "fp8pv_nvfp4pv", p=NVFP4, v=NVFP4),
                   "NVFP4 P/V (E4M3 scales per 16, FP32 tensor scale) on the FP8 route"),
    "ue5m3pv": Arm(_variant(FA4FP4_CAUSAL, "fp8pv_ue5m3pv", p=NVFP4_UE5M3, v=NVFP4_UE5M3),
                   "E2M1 P/V with UE5M3 scales per 16 on the FP8 route"),
    "mxfp4pv_unshifted": Arm(
        _variant(_MX, "mxfp4pv_unshifted", p_scale_shift=0),
        "MXFP4 P/V without the released stored-scale shift (P V and the row sum on P^ "
        "itself: fp4lab's arithmetic before 2026-12-01 lacked the shift)"),
    "mxfp4pv_d64_unshifted": Arm(
        _variant(FA4FP4_CAUSAL_MXFP4PV_D64, "mxfp4pv_d64_unshifted", p_scale_shift=0),
        "the D64 MXFP4 P/V route without its stored-scale shift"),
    "mxfp4pv_leakfix": Arm(FA4FP4_CAUSAL_MXFP4PV_FIXED,
                           "MXFP4 P/V with MatX's future-leakage fix on the diagonal blocks"),
    "mxfp4pv_leakfix_p": Arm(
        _variant(FA4FP4_CAUSAL_MXFP4PV_FIXED, "mxfp4pv_leakfix_p", leakage_fix_parts="p"),
        "MXFP4 P/V with the leakage fix's P half: unquantized P times V^ on the diagonal "
        "blocks (the leak stays; P on each query's own 32-key block is exact)"),
    "mxfp4pv_leakfix_v": Arm(
        _variant(FA4FP4_CAUSAL_MXFP4PV_FIXED, "mxfp4pv_leakfix_v", leakage_fix_parts="v"),
        "MXFP4 P/V with the leakage fix's V half: P^ times unquantized V on the diagonal "
        "blocks (the leak removed; P stays quantized)"),
    "mxfp4pv_e4m3qkv": Arm(_MX, "MXFP4 P/V with E4M3 QKV projections (as the published runs)",
                           qkv_format=FP8_E4M3_TENSOR.name),
    "fp8pv_e4m3qkv": Arm(FA4FP4_CAUSAL, "FP8 P/V with E4M3 QKV projections (as the published "
                         "runs)", qkv_format=FP8_E4M3_TENSOR.name),
    "mxfp4pv_clip": Arm(_MX, "MXFP4 P/V with the gradient norm clipped to 1", grad_clip=1.0),
    "mxfp4pv_qknorm": Arm(_MX, "MXFP4 P/V with QK-norm (q and k RMS-normalized per head): "
                          "the logits bounded", qk_norm=True),
    "fp8pv_qknorm": Arm(FA4FP4_CAUSAL, "FP8 P/V with QK-norm (q and k RMS-normalized per "
                        "head): the logits bounded", qk_norm=True),
    "fp8pv_exact_bwd": Arm(FA4FP4_CAUSAL.with_exact_backward(),
                           "FP8 P/V's forward with the exact gradient of it (no FP8 backward)"),
    "mxfp4pv_exact_bwd": Arm(_MX.with_exact_backward(),
                             "MXFP4 P/V's forward with the exact gradient of it (no FP8 "
                             "backward)"),
    "mxfp4pv_bf16_grad": Arm(_MX, "MXFP4 P/V's forward with bf16 attention's gradient, "
                             "straight through the whole attention (no quantized backward, "
                             "no lse rebuilt from the quantized forward)", gradient=FLASH_BF16),
    "mxfp4pv_fp8_grad_loss_scaled": Arm(
        _MX, "MXFP4 P/V's forward with FP8 P/V's gradient (its own forward and v509 backward "
        "at the same q, k, v), straight through the whole attention; the loss scaled by 2^13",
        gradient=FA4FP4_CAUSAL, loss_scale=LOSS_SCALE),
    "fp8pv_loss_scaled": Arm(FA4FP4_CAUSAL, "FP8 P/V with the loss scaled by 2^13 (the batch's "
                             "token count) for the backward: E5M2(4 dO) keeps this model's dO",
                             loss_scale=LOSS_SCALE),
    "mxfp4pv_loss_scaled": Arm(_MX, "MXFP4 P/V with the loss scaled by 2^13 (the batch's token "
                               "count) for the backward: E5M2(4 dO) keeps this model's dO",
                               loss_scale=LOSS_SCALE),
}
# the cause and fix arms again with the loss scaled by 2^13, so that each is compared with a
# baseline whose FP8 backward keeps dO (fp8pv_loss_scaled, mxfp4pv_loss_scaled): in the third
# full run the unscaled v509 backward flushed 85-98% of dO, and fp8pv_loss_scaled trained as
# bf16 did while fp8pv drifted in 1 of 2 seeds (studies/README.md)
_SCALED = ("mxfp4_p_only", "mxfp4_v_only", "mxfp4pv_rceil_v", "mxfp4pv_sr_v", "nvfp4pv",
           "ue5m3pv", "mxfp4pv_leakfix", "mxfp4pv_qknorm", "mxfp4pv_running_max",
           "mxfp4pv_leakfix_p", "mxfp4pv_leakfix_v")
for _name in _SCALED:
    _arm = ARMS[_name]
    ARMS[f"{_name}_loss_scaled"] = dataclasses.replace(
        _arm, what=f"{_arm.what}; the loss scaled by 2^13 for the backward",
        loss_scale=LOSS_SCALE)
REFERENCE_ARM = "bf16"


@dataclass(frozen=True)
class Cause:
    """A candidate cause (or fix) of the divergence, the arm that tests it and its baseline:
    `kind` "cause": the arm adds the suspect to a stable baseline (it should diverge if the
    suspect is the cause); "fix": the arm removes or repairs it in the diverging route (it
    should not diverge if the fix works)."""

    name: str
    arm: str
    baseline: str
    kind: str


CAUSES = (
    Cause("MXFP4 P (Direct-P codes, E8M0 scales)", "mxfp4_p_only", "fp8pv", "cause"),
    Cause("MXFP4 V (1 x 32 blocks along the sequence)", "mxfp4_v_only", "fp8pv", "cause"),
    Cause("V's block maximum clipped by the 1.203125 rule", "mxfp4pv_rceil_v", "mxfp4pv", "fix"),
    Cause("biased (nearest) rounding of V", "mxfp4pv_sr_v", "mxfp4pv", "fix"),
    Cause("the row-corrected denominator", "mxfp4pv_no_rowcorr", "mxfp4pv", "fix"),
    Cause("P's anchor row reference and exponent floor (underflow)", "mxfp4pv_running_max",
          "mxfp4pv", "fix"),
    Cause("4-bit P/V at all (NVFP4, finer scales)", "nvfp4pv", "fp8pv", "cause"),
    Cause("the scale format's range (UE5M3)", "ue5m3pv", "fp8pv", "cause"),
    Cause("future leakage through V's sequence blocks", "mxfp4pv_leakfix", "mxfp4pv", "fix"),
    Cause("P on each query's own 32-key block (the leakage fix's P half; the leak kept)",
          "mxfp4pv_leakfix_p", "mxfp4pv", "fix"),
    Cause("future leakage alone (the leakage fix's V half; P kept quantized)",
          "mxfp4pv_leakfix_v", "mxfp4pv", "fix"),
    Cause("E4M3 QKV projections", "mxfp4pv_e4m3qkv", "mxfp4pv", "cause"),
    Cause("unclipped gradient spikes", "mxfp4pv_clip", "mxfp4pv", "fix"),
    Cause("the v509 FP8 backward (fixed-scale E5M2(4 dO), E4M3 P, dS) on MXFP4 P/V",
          "mxfp4pv_exact_bwd", "mxfp4pv", "fix"),
    Cause("the v509 FP8 backward on FP8 P/V", "fp8pv_exact_bwd", "fp8pv", "fix"),
    Cause("the D128 route's softmax (anchor) versus the D64 one (shiftless)", "mxfp4pv_d64",
          "mxfp4pv", "cause"),
    Cause("attention logit growth (P past float32 against a fixed row reference)",
          "mxfp4pv_qknorm", "mxfp4pv", "fix"),
    Cause("attention logit growth on the FP8 route", "fp8pv_qknorm", "fp8pv", "fix"),
    Cause("the missing stored-scale shift (P V and the row sum on P^ itself, closer to "
          "float32's top)", "mxfp4pv_unshifted", "mxfp4pv", "cause"),
    Cause("MXFP4 P/V's backward at all (the quantized backward and the P it rebuilds from "
          "the represented lse), against the FP8 backward with dO kept", "mxfp4pv_bf16_grad",
          "mxfp4pv_loss_scaled", "fix"),
    Cause("MXFP4 P/V's own backward (the P it rebuilds from its represented lse), against "
          "FP8 P/V's backward on the same forward values", "mxfp4pv_fp8_grad_loss_scaled",
          "mxfp4pv_loss_scaled", "fix"),
    Cause("the FP8 backward's fixed dO scale against this model's gradient magnitude",
          "fp8pv_loss_scaled", "fp8pv", "fix"),
    Cause("the FP8 backward's fixed dO scale against this model's gradient magnitude, on "
          "MXFP4 P/V", "mxfp4pv_loss_scaled", "mxfp4pv", "fix"),
)
CAUSES += tuple(
    Cause(f"{cause.name}, with dO kept (the loss scaled by 2^13)", f"{cause.arm}_loss_scaled",
          f"{cause.baseline}_loss_scaled", cause.kind)
    for cause in CAUSES if cause.arm in _SCALED
)
