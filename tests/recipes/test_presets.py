"""The presets are what the released code does: one test per defining choice.

Each test builds an input on which the choice matters and checks the preset against the
textbook alternative it replaced (FlashAttention-3's 2^8 P lift and reverse key order on an
attention sink; SageAttention3's P scaled against the running maximum on a tile far below
it; Attn-QAT's V blocked along head_dim; fp4-fa4's fixed dO scale, D from the rounded dO,
lazy maximum, alpha-grid V, anchor and shiftless row references, and the future-leakage fix),
so that each would fail if the preset were reverted. The oracles are dense formulas written
from the recipe's docstrings with `fp4lab.formats` (float64 where exactness is asserted) and
the trace's per-tile statistics; the dense helpers of `tests.analysis.test_flash` are reused.
"""

import dataclasses
import importlib
import math

import pytest
import torch

from fp4lab.analysis import attention
from fp4lab.analysis.p_quant import quantize_p
from fp4lab.formats import (
    FP4_E2M1,
    FP8_E4M3_X4,
    FP8_E4M3FN,
    FP8_E5M2_TENSOR,
    FP8_E5M2_X4,
    MXFP4,
    MXFP4_ALPHA_MSE,
    NVFP4_1LEVEL,
    NVFP4_RECIPROCAL,
    UE4M3,
    ScaleRule,
    fake_quantize,
    round_to_format,
)
from fp4lab.recipes import (
    ATTN_QAT,
    CROISSATTN_EDEN,
    FA3_FP8,
    FA4FP4_CAUSAL,
    FA4FP4_CAUSAL_MXFP4PV,
    FA4FP4_CAUSAL_MXFP4PV_FIXED,
    FA4FP4_DIRECTP,
    PRESETS,
    SAGEATTN3,
    AttentionRecipe,
    BackwardV,
    DeltaSource,
    RowReference,
    Trace,
)
from tests.analysis.test_flash import (
    causal_mask,
    close,
    dense_attention,
    dense_backward,
    fq_whole,
    grads,
    qkv,
    rand,
)

F64 = torch.float64
LOG2E = math.log2(math.e)
flash_module = importlib.import_module("fp4lab.analysis.flash")


def rows(trace: Trace, product: str):
    """The trace's rows of one product."""
    frame = trace.to_frame()
    return frame[frame["product"] == product]


def capture_p(monkeypatch) -> list:
    """Record every block of P tiles the forward quantizes, as (P, row reference m)."""
    seen = []

    def recording(p, s, m_row, *rest):
        seen.append((p.detach().clone(), m_row.detach().clone()))
        return quantize_p(p, s, m_row, *rest)

    monkeypatch.setattr(flash_module, "quantize_p", recording)
    return seen


def offset_channels(q, k, keys: slice, nats: float):
    """q, k with the scores of `keys` raised by exactly `nats` for every query: Q's last 16
    channels are 1/4 (their dot with a key's is 1/4 of its sum) and K's are 0, except on
    `keys`, whose 16 are all c with 16 * c / 4 / sqrt(D) = nats (one NVFP4 block of equal
    values, exact in every format)."""
    q, k = q.clone(), k.clone()
    d = q.shape[-1]
    q[..., -16:], k[..., -16:] = 0.25, 0.0
    k[..., keys, -16:] = nats * math.sqrt(d) / 4
    return q, k


def dense_direct_p(s, m, recipe, block_n):
    """P^ of Direct-P written from `PQuant.DIRECT`'s docstring: per block B of 32 keys of a
    row, z = (s - m) log2 e, e_B from the block's largest z by the `p` format's alpha rule,
    clamped below at `p_min_exponent`; x = z - e_B + log2 6; code E2M1(2^x), or
    E2M1(max(0, A x + B)) on the groups of each key tile `direct_p_affine_groups` selects;
    P^ = 2^e_B code / 6."""
    n = recipe.p.block[0]
    zb = ((s - m) * LOG2E).unflatten(-1, (-1, n))  # (..., Sq, Sk / 32, 32)
    top = zb.amax(-1, keepdim=True)
    rule = recipe.p.scale_rule
    assert rule in (ScaleRule.ALPHA_CEIL, ScaleRule.ALPHA_HALF), rule
    e_b = torch.ceil(top) if rule is ScaleRule.ALPHA_CEIL else torch.floor(top + 1 - math.log2(1.5))
    e_b = e_b.clamp(min=recipe.p_min_exponent)
    x = zb - e_b + math.log2(6)
    u = torch.exp2(x)
    if recipe.direct_p_affine is not None:
        a, b = recipe.direct_p_affine
        group = torch.arange(zb.shape[-2]) % (block_n // n)  # the 32-key group within its tile
        chosen = torch.tensor([bool(recipe.direct_p_affine_groups >> int(g) & 1) for g in group])
        u = torch.where(chosen.view(-1, 1), (a * x + b).clamp(min=0), u)
    return (torch.exp2(e_b) * round_to_format(u, FP4_E2M1) / 6).flatten(-2)


def f32(x: float) -> float:
    """x rounded to float32."""
    return torch.tensor(x, dtype=torch.float32).item()


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


# -- FlashAttention-3: 2^8 P in E4M3, key tiles last to first --------------------------------------
SINK_DELTA = 10.0
E4M3_FLUSH_NATS = 10 * math.log(2)  # E4M3's smallest subnormal is 2^-9: P < 2^-10 rounds to 0


def sink_inputs(seq=128, d=32, seed=0):
    """An attention sink in float32: every query scores key 0 exactly SINK_DELTA above zero
    (Q's channel 0 is 1; key 0's only nonzero entry is SINK_DELTA sqrt(d) on it), and every
    other score is a sum of 31 products of N(0, 1) over sqrt(32) (mean 0, sd about 1)."""
    q, k, v = qkv(1, 2, 2, seq, seq, d, dtype=torch.float32, seed=seed)
    q[..., 0], k[..., 0] = 1.0, 0.0
    k[:, :, 0] = 0.0
    k[:, :, 0, 0] = SINK_DELTA * math.sqrt(d)
    return q, k, v


def test_fa3_fp8_lift_and_reverse_order_keep_the_p_a_sink_flushes():
    # Visited first, the sink sets every row's maximum, and a non-sink P = exp(s - s_0)
    # flushes in E4M3 when s - s_0 < -10 ln 2 = -6.93 (P-cast; for scores N(0, 1) a fraction
    # Phi(Delta - 6.93) = Phi(3.07) = 0.999 at Delta = 10); with the 2^8 lift, when s - s_0 <
    # -18 ln 2; the predictions count these on the scores themselves. FlashAttention-3 visits
    # the sink last: the other tiles are referenced to their own maximum, and nothing flushes
    # while their scores span less than 18 ln 2 = 12.5; only the sink's own tile, visited
    # last, is referenced to the sink (and needs the lift).
    q, k, v = sink_inputs()
    bm = bn = 32
    off_diagonal = torch.zeros(128, 128, dtype=torch.bool)  # key tiles 1 .. q_tile - 1
    for qt in range(4):
        off_diagonal[qt * bm : (qt + 1) * bm, bn : qt * bn] = True

    def below_sink(recipe, where):
        """s - s_0 from the recipe's Q^, K^ (fa3_fp8: E4M3 per (batch, kv-head))."""
        q_hat, k_hat = (
            fq_whole(x, getattr(recipe, f), -1, recipe) for x, f in ((q, "q"), (k, "k"))
        )
        s = (q_hat.double() @ k_hat.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        assert s[..., 1:].max() - s[..., 1:].min() < 18 * math.log(2)
        below = s - s[..., :1]
        if where == "others":
            return below[..., off_diagonal]  # 2 heads x 3 tiles x 32 x 32
        return below[..., bm:, :bn]  # query tiles 1..3 on the sink's key tile 0

    textbook = AttentionRecipe(name="e4m3_p_forward", p=FP8_E4M3FN)
    lift_only = dataclasses.replace(textbook, name="e4m3_p_lifted", p_lift=256.0)
    flushed = {}
    for recipe in (textbook, lift_only, FA3_FP8):
        trace = Trace()
        attention(q, k, v, recipe, causal=True, block_m=bm, block_n=bn, trace=trace)
        pv = rows(trace, "pv")
        others = pv[(pv["k_tile"] >= 1) & (pv["k_tile"] < pv["q_tile"])]  # full tiles, no sink
        assert len(others) == 2 * 3  # 2 heads x the tile pairs (2, 1), (3, 1), (3, 2)
        flushed[recipe.name, "others"] = others["a_flushed"].mean()
        flushed[recipe.name, "sink_tile"] = pv[(pv["k_tile"] == 0) & (pv["q_tile"] >= 1)][
            "a_flushed"
        ].mean()
    lifted = E4M3_FLUSH_NATS + 8 * math.log(2)
    predictions = [
        (textbook, "others", E4M3_FLUSH_NATS),
        (lift_only, "others", lifted),
        (FA3_FP8, "sink_tile", lifted),
    ]
    for recipe, where, nats in predictions:
        below = below_sink(recipe, where)
        predicted = (below < -nats).double().mean().item()
        # exact up to the elements float32 may put on the other side of the threshold
        slack = ((below + nats).abs() < 1e-5).double().mean().item()
        got = flushed[recipe.name, where]
        assert abs(got - predicted) <= slack, (
            f"{recipe.name} {where}: flushed {got}, predicted {predicted}"
        )
    # measured (6144 elements): 0.9982 without the lift, 0.0076 with it, 0 in reverse order
    assert flushed["e4m3_p_forward", "others"] > 0.99
    assert 1e-3 < flushed["e4m3_p_lifted", "others"] < 0.02
    assert flushed["fa3_fp8", "others"] == 0.0, flushed
    assert flushed["fa3_fp8", "sink_tile"] < 0.02, flushed


# -- SageAttention3: P against the running maximum, 2688, the unrounded divisor --------------------
def test_sageattn3_p_far_below_the_running_max_gets_subnormal_scales():
    # Reverse order, non-causal: key tile 1 (visited first) scores `gap` nats above key tile 0.
    # The released kernel scales P = exp(S - m) by 448 * 6 against that maximum, so a block
    # scale of tile 0 is 448 times its block max P, about 448 e^-gap: below E4M3's smallest
    # normal 2^-6 once gap > ln(448 * 64) = 10.3 nats, then rounded in steps of 2^-9 or zero.
    # The paper's two-level P rescales every row of the tile to its own maximum first.
    q, k, v = qkv(1, 2, 2, 256, 256, 64, dtype=torch.float32, seed=1)
    errors, flushes = {}, {}
    for gap in (6.0, 12.0):
        qg, kg = offset_channels(q, k, slice(128, 256), gap)
        for name in ("sageattn3", "sageattn3_paper"):
            trace = Trace()
            attention(qg, kg, v, name, trace=trace)
            pv = rows(trace, "pv").groupby("k_tile")
            errors[name, gap] = pv["a_err"].mean().to_dict()
            flushes[name, gap] = pv["a_flushed"].mean().to_dict()
    message = f"P error by key tile: {errors}; flushed: {flushes}"
    for name, gap in errors:  # where the scales stay normal, the tile's level does not matter
        if name == "sageattn3_paper" or gap == 6.0:
            low, top = errors[name, gap][0], errors[name, gap][1]
            assert abs(low / top - 1) < 0.1, message
    # measured at 12 nats: 0.42 (a third of the nonzero P flushed) against the paper's 0.09
    assert errors["sageattn3", 12.0][0] > 3 * errors["sageattn3_paper", 12.0][0], message
    assert 0.05 < errors["sageattn3_paper", 12.0][0] < 0.15, message
    assert flushes["sageattn3", 12.0][0] > 0.2, message
    assert flushes["sageattn3_paper", 12.0][0] < 0.1, message


def read_p_hat(recipe, s):
    """The P^ a one-tile forward of `recipe` consumes for scores `s` (B, H, Sq, 64), read from
    its output: K = sqrt(64) I makes S = Q, V = I makes O = P^ / l, and l = sum_j P_ij
    (`RowSum.UNQUANTIZED_P`) with P = exp(S - rowmax S) is known."""
    b, h, n, d = s.shape
    eye = torch.eye(d, dtype=s.dtype).expand(b, h, d, d)
    out = attention(s, math.sqrt(d) * eye, eye, recipe, block_m=n, block_n=d)
    return out * torch.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True)


def test_sageattn3_divides_p_by_the_unrounded_scale():
    # x = 2688 P; per 16 keys t = max x / 6, s = E4M3(t); codes E2M1(x / t), so a block's
    # maximum is exactly code 6; P^ = code * s / 2688. Multiplying by 1 / s instead (Q, K
    # and V's arithmetic) moves codes: with max P = 0.6 (t = 268.8, s = 256, 5% down), a P of
    # 0.48 has x / t = 4.8 -> 4 but x / s = 5.04 -> 6.
    p_only = dataclasses.replace(
        SAGEATTN3, name="sageattn3_p_only", q=None, k=None, v=None, smooth_k="none", smooth_q=False
    )
    p = rand(1, 1, 8, 64, seed=2).abs().clamp(0.01, 0.9) * 0.5
    p[..., 0, 16], p[..., 0, 0], p[..., 0, 1] = 1.0, 0.6, 0.48  # the row's max is in block 1
    p[..., 1:, 40] = 1.0
    p_hat = read_p_hat(p_only, p.log())
    x = (p * SAGEATTN3.p_lift).unflatten(-1, (4, 16))  # (..., rows, blocks, 16)
    t = x.amax(-1, keepdim=True) / 6
    codes = round_to_format(x / t, FP4_E2M1)
    assert torch.equal(codes.gather(-1, x.argmax(-1, keepdim=True)), torch.full_like(t, 6.0))
    want = (codes * round_to_format(t, UE4M3) / SAGEATTN3.p_lift).flatten(-2)
    close(p_hat, want, 1e-12)
    assert p_hat[0, 0, 0, 1].item() == pytest.approx(4 * 256 / 2688, rel=1e-12)
    reciprocal = dataclasses.replace(p_only, name="p_times_reciprocal", p=NVFP4_RECIPROCAL)
    assert read_p_hat(reciprocal, p.log())[0, 0, 0, 1].item() == pytest.approx(
        6 * 256 / 2688, rel=1e-12
    )


# -- Attn-QAT: V along head_dim, dS in bf16, dV's re-quantized P -----------------------------------
def test_attn_qat_blocks_v_along_head_dim():
    # With Q, K, P unquantized the output is softmax(S) V^: V^ must be V in 16-element blocks
    # along head_dim (FastVideo's fake_quantize_kv), not along the sequence.
    v_only = dataclasses.replace(ATTN_QAT, name="attn_qat_v_only", q=None, k=None, p=None)
    q, k, v = qkv(1, 2, 2, 64, 64, 32, seed=3)
    out = attention(q, k, v, v_only, causal=True)
    s = (q @ k.transpose(-1, -2) / math.sqrt(32)).masked_fill(~causal_mask(64, 64), -math.inf)
    along_head_dim = s.softmax(-1) @ fake_quantize(v, NVFP4_RECIPROCAL, axis=-1)
    along_sequence = s.softmax(-1) @ fake_quantize(v, NVFP4_RECIPROCAL, axis=-2)
    close(out, along_head_dim, 1e-12)
    assert max_diff(out, along_sequence) > 1e-2, "V's blocks along either axis give the same"


def test_attn_qat_casts_ds_to_bf16():
    # bf16 keeps 8 significant bits: each element's relative error is at most 2^-8, and so is
    # a tile's relative Frobenius error; float32 rounding (2^-24) or an FP8 cast (2^-4) are
    # far outside (2^-12, 2^-8].
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 64, 64, 32, seed=4))
    do = rand(1, 2, 64, 32, seed=5)
    for recipe, bf16 in (
        (ATTN_QAT, True),
        (dataclasses.replace(ATTN_QAT, name="fp_ds", dq_ds=None, dk_ds=None), False),
    ):
        trace = Trace()
        attention(q, k, v, recipe, causal=True, trace=trace).backward(do)
        for product in ("dq", "dk"):
            err = rows(trace, product)["a_err"]
            if bf16:
                assert ((err > 2**-12) & (err <= 2**-8)).all(), (product, err.describe())
            else:
                assert (err == 0).all(), (product, err.max())


def test_attn_qat_dv_requantizes_the_normalized_p():
    # dV takes the forward's quantizer applied to the rebuilt, normalized P: not the P^ the
    # forward's P V consumed (quantized before normalization, against the running maximum).
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 64, 64, 32, seed=6))
    do = rand(1, 2, 64, 32, seed=7)
    mismatch = {}
    for recipe in (ATTN_QAT, ATTN_QAT.with_exact_backward()):
        trace = Trace()
        attention(q, k, v, recipe, causal=True, trace=trace).backward(do)
        mismatch[recipe.name] = rows(trace, "dv")["p_fwd_mismatch"]
    assert (mismatch["attn_qat"] > 1e-3).all(), mismatch["attn_qat"].describe()
    assert (mismatch["attn_qat_forward_exact"] == 0).all()


# -- fp4-fa4 v509: fixed dO scale, D from the rounded dO, the lazy maximum -------------------------
DO_SIGMA = 1e-3


def test_fa4fp4_fixed_do_scale_flushes_a_small_do():
    # dO ~ N(0, 1e-6). dP's dO operand with a fixed scale flushes |dO| < c, a fraction
    # erf(c / (sigma sqrt 2)): the preset's E5M2(4 dO) (smallest subnormal 2^-16, so
    # c = 2^-17 / 4) 0.0015; E4M3(4 dO) (2^-9, c = 2^-10 / 4) 0.19; an amax scale (E5M2 with
    # amax / 57344) flushes below amax 2^-17 / 57344 ~ 1e-12: none. Over N = 32768 elements
    # the binomial standard deviation is sqrt(f (1 - f) / N); the tolerance is 5 of them.
    assert FA4FP4_CAUSAL.dp_do == FP8_E5M2_X4
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 256, 256, 64, dtype=torch.float32, seed=8))
    do = rand(1, 2, 256, 64, dtype=torch.float32, seed=9, scale=DO_SIGMA)
    n = do.numel()
    flushed = {}
    for recipe, flush_below in (
        (FA4FP4_CAUSAL, 2.0**-19),
        (dataclasses.replace(FA4FP4_CAUSAL, name="dp_do_e4m3_x4", dp_do=FP8_E4M3_X4), 2.0**-12),
        (dataclasses.replace(FA4FP4_CAUSAL, name="dp_do_e5m2_amax", dp_do=FP8_E5M2_TENSOR), 0.0),
    ):
        trace = Trace()
        attention(q, k, v, recipe, causal=True, trace=trace).backward(do)
        # a query-tile statistic, repeated on every key tile: one value per (head, query tile)
        flushed[recipe.name] = (
            rows(trace, "dp").groupby(["head", "q_tile"])["a_flushed"].first().mean()
        )
        counted = (do.abs() < flush_below).double().mean().item()
        predicted = math.erf(flush_below / (DO_SIGMA * math.sqrt(2)))
        tolerance = 5 * math.sqrt(predicted * (1 - predicted) / n) + 1 / n
        message = f"{recipe.name}: flushed {flushed[recipe.name]:.5f}, predicted {predicted:.5f}"
        assert flushed[recipe.name] == pytest.approx(counted, abs=0.5 / n), message
        assert abs(flushed[recipe.name] - predicted) <= tolerance, message
    # measured: 0.0017, 0.19, 0
    assert flushed["dp_do_e5m2_amax"] == 0, flushed
    assert 0 < flushed["fa4fp4_causal"] < 0.01, flushed
    assert flushed["dp_do_e4m3_x4"] > 0.1, flushed


def test_fa4fp4_delta_comes_from_the_rounded_do():
    # D = rowsum(E5M2(4 dO) / 4 * O): with the preset's tiles (128) one tile covers the
    # input, where the dense one-tile backward is the oracle; D from the unquantized dO
    # (DeltaSource.OUTPUT) is a different gradient.
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 64, 64, 64, seed=10))
    do = rand(1, 2, 64, 64, seed=11)
    from_output = dataclasses.replace(FA4FP4_CAUSAL, name="delta_from_do", delta=DeltaSource.OUTPUT)
    got = {}
    for recipe in (FA4FP4_CAUSAL, from_output):
        out = attention(q, k, v, recipe, causal=True)
        _, lse = dense_attention(q.detach(), k.detach(), v.detach(), recipe, causal=True)
        got[recipe.name] = grads(out, (q, k, v), do)
        want = dense_backward(
            q.detach(), k.detach(), v.detach(), do, out.detach(), lse, recipe, True
        )
        for g, w in zip(got[recipe.name], want, strict=True):
            close(g, w, 1e-11)
    (dq, dk, dv), (dq_other, dk_other, dv_other) = got["fa4fp4_causal"], got["delta_from_do"]
    assert max_diff(dq, dq_other) > 1e-3 and max_diff(dk, dk_other) > 1e-3
    assert torch.equal(dv, dv_other)  # dV = P^T dO does not involve D


def test_fa4fp4_lazy_max_lets_p_exceed_one(monkeypatch):
    # Key tile 1 scores 3 nats (4.3 bits) above key tile 0: no row of query tile 1 raises its
    # maximum there by 8 bits or more, so fp4-fa4 keeps tile 0's maximum as the reference
    # and P reaches e^rise > 1 (at most 2^8); the running maximum keeps P <= 1.
    q, k, v = qkv(1, 2, 2, 256, 256, 64, seed=12)
    q, k = offset_channels(q, k, slice(128, 256), 3.0)
    s = fake_quantize(q, NVFP4_1LEVEL) @ fake_quantize(k, NVFP4_1LEVEL).transpose(-1, -2) / 8.0
    s = s.masked_fill(~causal_mask(256, 256), -math.inf)
    rowmax0, rowmax1 = s[..., 128:, :128].amax(-1), s[..., 128:, 128:].amax(-1)  # (B, H, 128)
    rise_bits = (rowmax1 - rowmax0) * LOG2E
    assert (rise_bits < 8).all() and rise_bits.max() > 3 * LOG2E, rise_bits
    running = dataclasses.replace(
        FA4FP4_CAUSAL, name="running_max", row_reference=RowReference.RUNNING_MAX
    )
    seen = capture_p(monkeypatch)
    top = {}
    for recipe in (FA4FP4_CAUSAL, running):
        seen.clear()
        attention(q, k, v, recipe, causal=True)
        ((p, m_row),) = seen  # one block: (B, Hkv, G, 2 query tiles, 2 key tiles, 128, 128)
        top[recipe.name] = p.amax().item()
        if recipe is FA4FP4_CAUSAL:  # query tile 1 keeps key tile 0's maximum on key tile 1
            close(m_row[:, :, 0, 1, 0], rowmax0, 1e-12)
            close(m_row[:, :, 0, 1, 1], rowmax0, 1e-12)
            close(p[:, :, 0, 1, 1].amax(-1), torch.exp(rowmax1 - rowmax0), 1e-10)
    assert math.exp(3.0) < top["fa4fp4_causal"] <= 256.0, top
    assert top["running_max"] == 1.0, top


# -- fp4-fa4's MXFP4 P/V route ---------------------------------------------------------------------
def extract_v_hat(recipe, v):
    """The V^ a causal forward consumes, read from its output with Q = 0: every allowed score
    is 0, so every P^ of a row is the same and O_i = mean_{j <= i} V^_j."""
    b, h, n, d = v.shape
    out = attention(
        torch.zeros(b, h, n, d, dtype=v.dtype), torch.zeros_like(v), v, recipe, causal=True
    )
    counts = torch.arange(1, n + 1, dtype=v.dtype).view(-1, 1)
    sums = out * counts
    return torch.cat([sums[..., :1, :], sums[..., 1:, :] - sums[..., :-1, :]], dim=-2)


def test_mxfp4pv_v_uses_alpha_grid_scales():
    # fp4-fa4's V: per 32 keys (one head_dim column), alpha = 2^E, E = floor(log2 amax) + 1
    # exactly when amax / 2^floor(log2 amax) >= 1.203125; codes E2M1(6 x / alpha), the block's
    # largest code at alpha. amax 1.1 keeps alpha = 1 and clips to it (1.1 -> 1); amax 1.3
    # takes alpha = 2 (1.3 -> E2M1(3.9) = 4 -> 4/3, a value OCP's power-of-two scale, 0.25
    # here, cannot give: 1.3 / 0.25 = 5.2 -> 6 -> 1.5).
    v = rand(1, 1, 64, 64, seed=13, scale=0.3).clamp(-0.9, 0.9)
    v[0, 0, 7, 0], v[0, 0, 20, 1] = 1.1, 1.3
    v[0, 0, 3, 1] = 0.6  # 3 * 0.6 = 1.8 -> E2M1 2 -> 2/3
    v_hat = extract_v_hat(FA4FP4_CAUSAL_MXFP4PV, v)
    close(v_hat, fake_quantize(v, MXFP4_ALPHA_MSE, axis=-2), 1e-12)
    # decoded as code * fl32(alpha / 6) in float32 (`ScaleRule.alpha_grid`)
    assert v_hat[0, 0, 7, 0].item() == f32(6 * f32(1 / 6)) == 1.0
    assert v_hat[0, 0, 20, 1].item() == f32(4 * f32(2 / 6)) == pytest.approx(4 / 3, rel=1e-7)
    assert v_hat[0, 0, 3, 1].item() == f32(2 * f32(2 / 6)) == pytest.approx(2 / 3, rel=1e-7)
    assert fake_quantize(v, MXFP4, axis=-2)[0, 0, 20, 1].item() == 1.5


def test_mxfp4pv_row_reference_is_the_anchor():
    # m_i = max of row i's scores over the first 32 keys + 64 ln 2 * scale (raw score units),
    # fixed for every tile: the output is the dense Direct-P formula with that m. With
    # scale = 0.1 the margin is 6.4 bits: a fractional shift that moves the codes, so neither
    # the running maximum nor the anchor without its margin gives the same output.
    recipe, scale = FA4FP4_CAUSAL_MXFP4PV, 0.1
    q, k, v = qkv(1, 2, 2, 128, 128, 64, seed=14)
    out = attention(q, k, v, recipe, causal=True, scale=scale)
    s = scale * fake_quantize(q, NVFP4_1LEVEL) @ fake_quantize(k, NVFP4_1LEVEL).transpose(-1, -2)
    s = s.masked_fill(~causal_mask(128, 128), -math.inf)
    v_hat = fake_quantize(v, MXFP4_ALPHA_MSE, axis=-2)
    anchor = s[..., :32].amax(-1, keepdim=True)

    def dense(m):
        p_hat = dense_direct_p(s, m, recipe, 128)
        return p_hat @ v_hat / p_hat.sum(-1, keepdim=True)

    close(out, dense(anchor + 64 * math.log(2) * scale), 1e-12)
    assert max_diff(out, dense(s.amax(-1, keepdim=True))) > 1e-3, "the running max gives the same"
    assert max_diff(out, dense(anchor)) > 1e-3, "the anchor without its margin gives the same"


def test_mxfp4pv_backward_dp_takes_e4m3_of_the_forward_v_hat():
    # backward_v=forward: dP = dO V^T on E4M3(4 V^) of the decoded MXFP4 V^. The trace's dp
    # b_err is that operand's error against the unquantized V, per key tile.
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 2, 128, 128, 64, seed=15))
    do = rand(1, 2, 128, 64, seed=16)
    from_input = dataclasses.replace(
        FA4FP4_CAUSAL_MXFP4PV, name="dp_v_from_input", backward_v=BackwardV.INPUT
    )
    v_hat = fake_quantize(v.detach(), MXFP4_ALPHA_MSE, axis=-2)
    for recipe, source in ((FA4FP4_CAUSAL_MXFP4PV, v_hat), (from_input, v.detach())):
        trace = Trace()
        attention(q, k, v, recipe, causal=True, trace=trace).backward(do)
        v_dp = fake_quantize(source, FP8_E4M3_X4, axis=-1)
        want = ((v_dp - v.detach()).norm(dim=(-2, -1)) / v.detach().norm(dim=(-2, -1))).flatten()
        got = rows(trace, "dp").sort_values("head")["b_err"].to_numpy()
        close(torch.tensor(got), want, 1e-9)


# -- the future-leakage fix ------------------------------------------------------------------------
def test_leakage_fix_keeps_a_later_token_out_of_an_earlier_output():
    # Query 40 and key 50 share V's block of keys 32..63 (along the sequence): a large V_50
    # raises that block's scale and re-rounds V_32..V_40, which query 40 reads, unless the
    # diagonal block's product is computed unquantized.
    q, k, v = qkv(1, 1, 1, 128, 128, 64, seed=17)
    k2, v2 = k.clone(), v.clone()
    k2[0, 0, 50] = rand(64, seed=18)
    v2[0, 0, 50] *= 40.0
    halves = [(dataclasses.replace(FA4FP4_CAUSAL_MXFP4PV_FIXED, name=f"half_{parts}",
                                   leakage_fix_parts=parts), leaks)
              for parts, leaks in (("p", True), ("v", False))]  # only V's half removes it
    for recipe, leaks in ((FA4FP4_CAUSAL_MXFP4PV, True), (FA4FP4_CAUSAL_MXFP4PV_FIXED, False),
                          *halves):
        before = attention(q, k, v, recipe, causal=True)
        after = attention(q, k2, v2, recipe, causal=True)
        assert torch.equal(before[..., :32, :], after[..., :32, :])  # V's earlier block
        assert torch.equal(before[..., 40, :], after[..., 40, :]) != leaks, recipe.name
    # without a causal mask there is no future to leak: the fix changes nothing
    plain = attention(q, k, v, FA4FP4_CAUSAL_MXFP4PV, causal=False)
    assert torch.equal(attention(q, k, v, FA4FP4_CAUSAL_MXFP4PV_FIXED, causal=False), plain)


@pytest.mark.parametrize("parts", ["p_and_v", "p", "v"])
def test_leakage_fix_computes_only_the_diagonal_blocks_unquantized(parts):
    # O_i = (sum over earlier blocks of P^ V^ + sum over i's block of P V) / (the same sums
    # of P^ and P), P = exp(S - m) with the anchor m: the off-diagonal products are the
    # unfixed route's. Half the fix: P with V^ (parts "p") or P^ with V ("v") on i's block.
    recipe = dataclasses.replace(FA4FP4_CAUSAL_MXFP4PV_FIXED, leakage_fix_parts=parts)
    scale = 0.1
    q, k, v = qkv(1, 2, 2, 128, 128, 64, seed=19)
    s = scale * fake_quantize(q, NVFP4_1LEVEL) @ fake_quantize(k, NVFP4_1LEVEL).transpose(-1, -2)
    s = s.masked_fill(~causal_mask(128, 128), -math.inf)
    m = s[..., :32].amax(-1, keepdim=True) + 64 * math.log(2) * scale
    p_hat, p = dense_direct_p(s, m, recipe, 128), torch.exp(s - m)
    diagonal = (torch.arange(128).view(-1, 1) // 32) == (torch.arange(128).view(1, -1) // 32)
    v_hat = fake_quantize(v, MXFP4_ALPHA_MSE, axis=-2)
    p_diag = p_hat if parts == "v" else p
    v_diag = v_hat if parts == "p" else v
    weights = torch.where(diagonal, p_diag, p_hat)
    values = torch.where(diagonal, 0.0, p_hat) @ v_hat + torch.where(diagonal, p_diag, 0.0) @ v_diag
    out = attention(q, k, v, recipe, causal=True, scale=scale)
    close(out, values / weights.sum(-1, keepdim=True), 1e-12)


def test_half_a_leakage_fix_needs_the_fix():
    with pytest.raises(ValueError, match="leakage_fix_parts='v' .* needs leakage_fix=True"):
        dataclasses.replace(FA4FP4_CAUSAL_MXFP4PV, leakage_fix_parts="v")
    with pytest.raises(ValueError, match="leakage_fix_parts"):
        dataclasses.replace(FA4FP4_CAUSAL_MXFP4PV_FIXED, leakage_fix_parts="q")


# -- Direct-P's fast policy ------------------------------------------------------------------------
def test_directp_is_shiftless():
    # RowReference.ZERO: z = s log2 e in absolute terms, e_B = floor(max z + 1 - log2 1.5) per
    # 32 keys (>= -110), the affine code map on groups 1..3 of each key tile, exp2 on group 0.
    recipe = FA4FP4_DIRECTP
    q, k, v = qkv(1, 2, 2, 64, 128, 64, seed=20)
    out = attention(q, k, v, recipe)
    s = fake_quantize(q, NVFP4_1LEVEL) @ fake_quantize(k, NVFP4_1LEVEL).transpose(-1, -2) / 8.0
    v_hat = fake_quantize(v, MXFP4_ALPHA_MSE, axis=-2)

    def dense(m):
        p_hat = dense_direct_p(s, m, recipe, 128)
        return p_hat @ v_hat / p_hat.sum(-1, keepdim=True)

    close(out, dense(torch.zeros(())), 1e-12)
    assert max_diff(out, dense(s.amax(-1, keepdim=True))) > 1e-3, "the running max gives the same"


# -- every preset runs ----------------------------------------------------------------------------
def preset_cases():
    for recipe in PRESETS:
        for causal in (False, True) if recipe.causal is None else (recipe.causal,):
            yield pytest.param(recipe, causal, id=f"{recipe.name}-{'causal' if causal else 'full'}")


@pytest.mark.parametrize("recipe, causal", list(preset_cases()))
def test_every_preset_runs_forward_and_backward_finite_with_its_own_tiles(recipe, causal):
    # GQA (2 query heads on 1 KV head), partial tiles; croissattn_eden's MS-EDEN transforms
    # of 128 need head_dim and tiles of 128
    d, seq = (128, 128) if recipe is CROISSATTN_EDEN else (64, 160)
    q, k, v = (x.requires_grad_() for x in qkv(1, 2, 1, seq, seq, d, dtype=torch.float32, seed=21))
    do = rand(1, 2, seq, d, dtype=torch.float32, seed=22)
    out = attention(q, k, v, recipe, causal=causal, generator=0 if recipe.stochastic else None)
    assert torch.isfinite(out).all(), recipe.name
    for name, g in zip("qkv", grads(out, (q, k, v), do), strict=True):
        assert torch.isfinite(g).all() and g.abs().max() > 0, f"{recipe.name}: d{name}"
