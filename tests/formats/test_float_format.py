"""FloatFormat: invariants of every format, exhaustive code round trips, known numbers."""

import math

import pytest
import torch

import fp4lab.formats as F
from fp4lab.formats import FloatFormat, Specials

SMALL = [f for f in F.FORMATS if f.bits <= 16]

# (max, smallest subnormal) from the specs cited in fp4lab/formats/named.py and LITERATURE.md.
KNOWN = {
    "fp4_e2m1": (6.0, 0.5),
    "fp6_e3m2": (28.0, 0.0625),
    "fp6_e2m3": (7.5, 0.125),
    "fp8_e4m3fn": (448.0, 2.0**-9),
    "fp8_e5m2": (57344.0, 2.0**-16),
    "fp8_e4m3fnuz": (240.0, 2.0**-10),
    "fp8_e5m2fnuz": (57344.0, 2.0**-17),
    "ue8m0": (2.0**127, 2.0**-127),
    "ue4m3": (448.0, 2.0**-9),
    "ue5m3": (114688.0, 2.0**-17),
    "ue5m3_ieee": (61440.0, 2.0**-17),
    "int8": (127 / 64, 1 / 64),
    "int4": (7 / 4, 1 / 4),
    "bf16": (float(torch.finfo(torch.bfloat16).max), 2.0**-133),
    "fp16": (65504.0, 2.0**-24),
    "fp32": (float(torch.finfo(torch.float32).max), 2.0**-149),
}


@pytest.mark.parametrize("fmt", F.FORMATS, ids=str)
def test_known_numbers(fmt):
    assert (fmt.max, fmt.min_subnormal) == KNOWN[fmt.name]


@pytest.mark.parametrize("fmt", F.FORMATS, ids=str)
def test_bits_add_up_and_max_is_a_code(fmt):
    assert fmt.bits == int(fmt.signed) + fmt.ebits + fmt.mbits
    assert fmt.num_codes == 2**fmt.bits
    assert fmt.decode(torch.tensor([fmt.max_code]), torch.float64).item() == fmt.max
    assert fmt.encode(torch.tensor([fmt.max], dtype=torch.float64)).item() == fmt.max_code
    assert fmt.emax == math.floor(math.log2(fmt.max))
    assert fmt.min_normal == 2.0**fmt.emin


@pytest.mark.parametrize("fmt", SMALL, ids=str)
def test_every_code_round_trips(fmt):
    codes = torch.arange(fmt.num_codes)
    values = fmt.decode(codes, torch.float64)
    back = fmt.encode(values).to(torch.int64)
    finite = torch.isfinite(values)
    assert torch.equal(back[finite], codes[finite])
    # NaN codes decode to NaN and re-encode to a NaN code.
    assert torch.isnan(fmt.decode(back[torch.isnan(values)], torch.float64)).all()


@pytest.mark.parametrize("fmt", SMALL, ids=str)
def test_values_grid(fmt):
    v = fmt.values
    assert torch.all(v[1:] > v[:-1])
    assert v.max().item() == fmt.max
    assert v[v > 0].min().item() == fmt.min_subnormal
    assert (0.0 in v.tolist()) == fmt.has_zero
    if fmt.signed:
        assert torch.equal(v, -v.flip(0))


@pytest.mark.parametrize("fmt", SMALL, ids=str)
def test_specials(fmt):
    values = fmt.decode(torch.arange(fmt.num_codes), torch.float64)
    n_nan = int(torch.isnan(values).sum())
    n_inf = int(torch.isinf(values).sum())
    expect_nan = {
        Specials.NONE: 0,
        Specials.FN: 1 + int(fmt.signed),
        Specials.FNUZ: 1,
        Specials.IEEE: (2 ** fmt.mbits - 1) * (1 + int(fmt.signed)),
    }[fmt.specials]
    assert n_nan == expect_nan
    assert n_inf == (1 + int(fmt.signed) if fmt.specials is Specials.IEEE else 0)
    if fmt.specials is Specials.FNUZ:
        assert not torch.signbit(values[values == 0]).any()  # no negative zero


def test_ue8m0_is_powers_of_two_without_zero():
    v = F.UE8M0.values
    assert torch.equal(v, torch.exp2(torch.arange(-127, 128, dtype=torch.float64)))
    assert F.UE8M0.nan_code == 0xFF


def test_int_formats_are_symmetric_fixed_point():
    assert torch.equal(F.INT8.values, torch.arange(-127, 128, dtype=torch.float64) / 64)
    assert torch.equal(F.INT4.values, torch.arange(-7, 8, dtype=torch.float64) / 4)


def test_encode_rejects_off_grid_values():
    with pytest.raises(ValueError, match="not a value of fp4_e2m1"):
        F.FP4_E2M1.encode(torch.tensor([0.75]))
    with pytest.raises(ValueError, match="not a value of ue8m0"):
        F.UE8M0.encode(torch.tensor([0.0]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(ebits=0, mbits=1, bias=0), "ebits"),
        (dict(ebits=2, mbits=-1, bias=1), "mbits"),
        (dict(ebits=4, mbits=3, bias=7, signed=False, specials=Specials.FNUZ), "FNUZ"),
        (dict(ebits=20, mbits=20, bias=1), "32 bits"),
        (dict(ebits=4, mbits=3, bias=7, specials="fn"), "specials"),
    ],
)
def test_bad_literals_name_the_field(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        FloatFormat(name="bad", **kwargs)


def test_formats_are_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        FloatFormat("x", 2, 1, 1)  # positional arguments are refused
    with pytest.raises(AttributeError):
        F.FP4_E2M1.mbits = 2
