"""AttentionRecipe: the data model, its validation, the registry and the presets' literals."""

import dataclasses

import pytest
import torch

from fp4lab.analysis import attention
from fp4lab.formats import BF16, FP8_E4M3FN, get, names, unregister
from fp4lab.recipes import (
    PRESETS,
    AttentionRecipe,
    BackwardMode,
    BackwardP,
    PQuant,
    Product,
    RowReference,
    RowSum,
    resolve_recipe,
)

PRESET_NAMES = [
    "exact",
    "flash_bf16",
    "fp8_per_tensor",
    "fa3_fp8",
    "fa3_fp8_paper",
    "sageattn3",
    "sageattn3_paper",
    "attn_qat",
    "attn_qat_kernel",
    "attn_qat_dropin",
    "fa4fp4_causal",
    "fa4fp4_causal_mxfp4pv",
    "fa4fp4_causal_mxfp4pv_d64",
    "fa4fp4_causal_mxfp4pv_fixed",
    "fa4fp4_causal_mxfp8pv",
    "fa4fp4_directp",
    "croissattn",
    "croissattn_eden",
]


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_resolves_by_name_and_documents_itself(name):
    recipe = resolve_recipe(name)
    assert isinstance(recipe, AttentionRecipe) and recipe.name == name
    assert recipe in PRESETS
    if name != "exact":
        assert "Assumption" in recipe.doc, f"{name} must state its assumptions"
    assert recipe.source, f"{name} must name the code or paper it follows"
    # it cites a file of released code, a paper or (CroissAttn) the talk
    assert any(src in recipe.doc for src in ("``", "arXiv", "talk")), recipe.doc


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_presets_are_in_the_shared_registry(name):
    assert get(name) is resolve_recipe(name)
    assert name in names(AttentionRecipe)


def test_bf16_preset_has_a_name_of_its_own():
    # "bf16" is the number format; as a recipe name it means bf16 on every operand, which is
    # what the flash_bf16 preset is, under its own name (one registry, no second one).
    assert get("bf16") is BF16
    preset, uniform = resolve_recipe("flash_bf16"), resolve_recipe("bf16")
    for recipe in (preset, uniform):
        assert all(s is BF16 for s in (getattr(recipe, f) for p in Product for f in p.fields))
    assert (
        uniform.name == "bf16"
        and dataclasses.replace(uniform, name="flash_bf16", doc=preset.doc, source=preset.source)
        == preset
    )


def test_a_format_name_is_a_uniform_recipe():
    recipe = resolve_recipe("nvfp4")
    assert recipe.name == "nvfp4"
    assert {getattr(recipe, f) for p in Product for f in p.fields} == {get("nvfp4")}


def test_user_recipe_registered_works_everywhere():
    from fp4lab.formats import register

    mine = AttentionRecipe(name="test_mine_mxfp8_v", v="mxfp8_e4m3")
    register(mine)
    try:
        q, k, v = (torch.randn(1, 2, 20, 32, dtype=torch.float64) for _ in range(3))
        by_name = attention(q, k, v, "test_mine_mxfp8_v", block_m=16, block_n=32)
        by_object = attention(q, k, v, mine, block_m=16, block_n=32)
        assert torch.equal(by_name, by_object)
        assert not torch.equal(by_name, attention(q, k, v, "exact", block_m=16, block_n=32))
    finally:
        unregister("test_mine_mxfp8_v")


def test_operands_given_by_name_resolve_to_objects():
    recipe = AttentionRecipe(name="x", q="nvfp4", p="fp8_e4m3fn")
    assert recipe.q is get("nvfp4") and recipe.p is FP8_E4M3FN and recipe.k is None


def test_unknown_operand_name_names_the_field():
    with pytest.raises(ValueError, match="dq_k"):
        AttentionRecipe(name="x", dq_k="no_such_format")


def test_operand_of_wrong_type_is_a_type_error():
    with pytest.raises(TypeError, match="q must be"):
        AttentionRecipe(name="x", q=3)


def test_enum_fields_parse_strings_and_reject_unknown_values():
    recipe = AttentionRecipe(name="x", row_sum="quantized_p", backward_p="unquantized_qk")
    assert recipe.row_sum is RowSum.QUANTIZED_P and recipe.backward_p is BackwardP.UNQUANTIZED_QK
    with pytest.raises(ValueError, match="delta must be one of"):
        AttentionRecipe(name="x", delta="sometimes")


@pytest.mark.parametrize("bad", [0.0, -2.0, float("inf"), float("nan"), True, "2"])
def test_lifts_must_be_positive_finite_numbers(bad):
    with pytest.raises(ValueError, match="p_lift must be a positive finite number"):
        AttentionRecipe(name="x", p_lift=bad)
    assert AttentionRecipe(name="x", p_lift=2688.0).p_lift == 2688.0  # SageAttention3's 448 * 6


@pytest.mark.parametrize("field", ["dv_p", "dp_v", "dq_k", "dk_q"])
def test_straight_through_rejects_the_operands_it_takes_from_the_forward(field):
    with pytest.raises(ValueError, match=f"{field} must be None"):
        AttentionRecipe(name="x", backward=BackwardMode.STRAIGHT_THROUGH, **{field: "nvfp4"})
    # dO and dS are the backward's own: Attn-QAT casts dS to bf16
    AttentionRecipe(name="x", backward=BackwardMode.STRAIGHT_THROUGH, dq_ds="bf16", dv_do="nvfp4")


def test_row_scaled_p_needs_a_spec_without_tensor_scale():
    with pytest.raises(ValueError, match="tensor_scale"):
        AttentionRecipe(name="x", p="nvfp4", p_quant=PQuant.ROW_SCALED)


def test_direct_p_needs_e2m1_blocks():
    with pytest.raises(ValueError, match="FP4_E2M1"):
        AttentionRecipe(name="x", p="mxfp8_e4m3", p_quant=PQuant.DIRECT)
    with pytest.raises(ValueError, match="1-D blocks"):
        AttentionRecipe(name="x", p=FP8_E4M3FN, p_quant=PQuant.DIRECT)
    with pytest.raises(ValueError, match="direct_p_affine"):
        AttentionRecipe(name="x", p="mxfp4", direct_p_affine=(1.5, 1.2))


def test_resolve_recipe_errors():
    with pytest.raises(ValueError, match="recipe: unknown name"):
        resolve_recipe("no_such_recipe")
    with pytest.raises(TypeError, match="recipe must be"):
        resolve_recipe(42)


def test_recipes_are_frozen_and_keyword_only():
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve_recipe("exact").q = get("nvfp4")
    with pytest.raises(TypeError):
        AttentionRecipe("positional")


def test_products_name_their_operands_and_fields():
    assert Product.DV.fields == ("dv_p", "dv_do") and Product.DV.operand_names == ("p", "do")
    assert [p.value for p in Product] == ["qk", "pv", "dv", "dp", "dq", "dk"]
    recipe = resolve_recipe("fa4fp4_causal")
    assert recipe.operands("dp") == (get("fp8_e5m2_x4"), get("fp8_e4m3_x4"))


@pytest.mark.parametrize(
    "changes, words",
    [(dict(p_scale_shift=-1), "p_scale_shift must be an int of at least 0"),
     (dict(p_scale_shift=128), "p_scale_shift must be at most 127"),
     (dict(p_scale_shift=33), "p_scale_shift=33 needs p_min_exponent >= -93"),
     (dict(p_min_exponent=None), "needs p_min_exponent >= -94"),
     (dict(p_quant=PQuant.SPEC), "p_scale_shift=32 is Direct-P's stored-scale shift")],
    ids=["negative", "too-large", "floor-too-low", "no-floor", "not-direct"],
)
def test_a_stored_scale_shift_needs_direct_p_and_its_floor(changes, words):
    route = resolve_recipe("fa4fp4_causal_mxfp4pv")
    with pytest.raises(ValueError, match=words):
        dataclasses.replace(route, **changes)


@pytest.mark.parametrize("name", ["fa4fp4_causal_mxfp4pv", "fa4fp4_causal_mxfp4pv_d64",
                                  "fa4fp4_causal_mxfp4pv_fixed", "fa4fp4_directp"])
def test_the_stored_scale_shift_changes_no_bit_in_range_and_keeps_big_rows_finite(name):
    # P V and the row sum on P^ 2^-S: O, lse (through the gradients) and dQ, dK, dV the same
    # bits as without the shift on ordinary inputs; on a row whose keys all reach log2 P
    # near 128 (several P^ saturating at 2^127), finite with it and not without
    route = resolve_recipe(name)
    bare = dataclasses.replace(route, name=f"{name}_unshifted", p_scale_shift=0)
    assert route.p_scale_shift in (16, 32)
    causal = route.causal is not False
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 256, 64, generator=g) for _ in range(4))
    got = {}
    for recipe in (route, bare):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*leaves, recipe, causal=causal)
        out.backward(do)
        got[recipe.name] = [out.detach(), *(t.grad for t in leaves)]
    for a, b in zip(got[route.name], got[bare.name], strict=True):
        assert torch.equal(a, b)
    q, k = torch.zeros(2, 1, 1, 128, 64)
    q[..., 0] = 8.0
    # keys past the anchor's first 32 at log2 P 140 over it (the margin added back), the
    # first 32 at 0: every query from 32 on sees 32 or more saturating P^ = 2^127
    margin = route.anchor_margin / 8 if route.row_reference is RowReference.ANCHOR else 0.0
    k[..., 32:, 0] = 140 / 1.4426950408889634 + margin
    v = torch.full((1, 1, 128, 64), 0.5)
    big = {r.name: attention(q, k, v, r, causal=causal, block_m=64, block_n=64)
           for r in (route, bare)}
    # V is 0.5 everywhere and the quantized row sum is P V's own (the leakage fix's diagonal
    # unquantized in both, as P 2^-S from exp(z - S ln 2) where P itself passes float32), so
    # O is 0.5 on every row (exactly, but for the fix's float32 sums of P 0.5 over sums of
    # P); without the shift, P^ 2^e_B passes float32
    half = torch.full_like(v, 0.5)
    if route.leakage_fix:
        torch.testing.assert_close(big[route.name], half, rtol=2.0**-20, atol=0.0)
    else:
        assert torch.equal(big[route.name], half)
    assert not big[bare.name].isfinite().all()
