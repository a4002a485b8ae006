"""fp4lab.config: every registered format and recipe survives JSON field by field, and what does
not parse is refused with the place it sits and the rule it broke."""

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Literal

import pytest

import fp4lab.formats as F
from fp4lab.analysis import SyntheticConfig
from fp4lab.config import ConfigError, closest_first, from_fields, suggestions, to_fields
from fp4lab.recipes import AttentionRecipe


def round_trip(obj):
    return from_fields(type(obj), json.loads(json.dumps(to_fields(obj))))


@pytest.mark.parametrize("name", F.names())
def test_every_registered_object_round_trips(name):
    obj = F.get(name)
    again = round_trip(obj)
    assert again == obj and type(again) is type(obj)
    assert to_fields(again) == to_fields(obj)


def test_a_uniform_recipe_and_the_synthetic_input_round_trip():
    recipe = AttentionRecipe.uniform("nvfp4_sr_everywhere", "nvfp4_sr", causal=True)
    assert round_trip(recipe) == recipe
    assert round_trip(SyntheticConfig(seq=77, kv_heads=1)) == SyntheticConfig(seq=77, kv_heads=1)


def test_fields_are_values_nested_formats_and_kinds():
    fields = to_fields(F.get("fa4fp4_causal"))
    assert fields["kind"] == "AttentionRecipe" and fields["p_quant"] == "spec"
    assert fields["q"]["kind"] == "QuantSpec" and fields["q"]["block"] == [16]
    assert fields["q"]["element"]["kind"] == "FloatFormat" and fields["q"]["element"]["ebits"] == 2
    assert fields["dq_ds"] is None or isinstance(fields["dq_ds"], dict)


def test_numbers_keep_their_json_type():
    spec = dataclasses.replace(F.get("fp8_e4m3_x4"), name="x4_int", fixed_scale=4)
    assert type(round_trip(spec).fixed_scale) is int  # the value recorded is the value used


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda f: f.update(q_lift=2.0),
            "recipe: AttentionRecipe has no field 'q_lift'; its fields, closest first: p_lift",
        ),
        (
            lambda f: f["q"].update(scale_rule="ocp_flor"),
            "recipe.q.scale_rule: 'ocp_flor' is not "
            "a ScaleRule value; its values, closest first: ocp_floor",
        ),
        (
            lambda f: f["q"]["element"].update(ebits="2"),
            "recipe.q.element.ebits: must be an integer, got '2'",
        ),
        (
            lambda f: f["q"]["element"].update(ebits=True),
            "recipe.q.element.ebits: must be an integer, got True",
        ),
        (
            lambda f: f["q"]["element"].update(ebits=0),
            "recipe.q.element: ebits must be an integer >= 1",
        ),
        (
            lambda f: f.update(q="nvfp4"),
            "recipe.q: must be QuantSpec or FloatFormat or null by its fields",
        ),
        (
            lambda f: f["q"].update(kind="FloatFormat"),
            "recipe.q: FloatFormat has no field 'element'",
        ),
        (lambda f: f["q"].update(block=16), "recipe.q.block: must be a list, got 16"),
        (lambda f: f.update(causal="yes"), "recipe.causal: must be true or false, got 'yes'"),
        (lambda f: f.pop("name"), "recipe: AttentionRecipe needs the field 'name'"),
        (lambda f: f.update(kind="QuantSpec"), "recipe: kind must be 'AttentionRecipe'"),
        (
            lambda f: f.update(block_axes=[["v", -1, 0]]),
            "recipe.block_axes[0]: must be a list of 2",
        ),
    ],
)
def test_what_does_not_parse_is_named(edit, message):
    fields = json.loads(json.dumps(to_fields(F.get("fa4fp4_causal"))))
    edit(fields)
    with pytest.raises(ConfigError) as err:
        from_fields(AttentionRecipe, fields, where="recipe")
    assert str(err.value).startswith(message), str(err.value)


def test_loading_never_reads_the_registry():
    fields = to_fields(F.get("nvfp4"))
    fields["name"] = "not_registered_anywhere"
    spec = from_fields(F.QuantSpec, fields)
    assert spec.name not in F.names() and spec.element == F.FP4_E2M1


class Colour(enum.Enum):
    RED = "red"


@dataclass(frozen=True)
class Study:
    """A study's config, as a study script would write one."""

    colour: Colour
    sizes: tuple[int, ...] = (64, 128)
    recipe: AttentionRecipe | None = None
    pair: tuple[float, str] = (1.0, "a")
    reduce: Literal["mean", "max"] = "mean"


def test_a_study_config_of_its_own_reuses_the_module():
    study = Study(Colour.RED, recipe=F.get("croissattn"))
    assert round_trip(study) == study
    assert from_fields(Study, {"colour": "red"}) == Study(Colour.RED)
    with pytest.raises(ConfigError, match=r"config\.sizes\[1\]: must be an integer, got 1\.5"):
        from_fields(Study, {"colour": "red", "sizes": [1, 1.5]})
    with pytest.raises(
        ConfigError, match=r"config\.reduce: 'mena' is not allowed; one of, closest"
    ):
        from_fields(Study, {"colour": "red", "reduce": "mena"})


def test_objects_without_fields_are_refused():
    with pytest.raises(ConfigError, match="a set has no JSON fields"):
        to_fields({1, 2})


def test_closest_first():
    assert closest_first("nvfp5", ["mxfp4", "nvfp4", "e8m0"])[0] == "nvfp4"
    assert suggestions("a", list("abcdefghij"), limit=3).endswith(" and 7 more")
