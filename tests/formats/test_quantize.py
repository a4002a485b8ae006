"""quantize / dequantize / fake_quantize: torchao and Transformer Engine oracles, layouts,
NaN and inf, padding, 2-D tiles, Hadamard, interop, registry and bad input."""

import dataclasses
import importlib
import math
import warnings

import numpy as np
import pytest
import torch

import fp4lab.formats as F
from fp4lab.formats import QuantSpec, ScaleRule, fake_quantize, quantize

from .helpers import assert_same_bits, spread, te_fp4_codes

quantize_module = importlib.import_module("fp4lab.formats.quantize")  # the function shadows it

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.constants import DTYPE_FP6_E2M3, DTYPE_FP6_E3M2
    from torchao.prototype.mx_formats.kernels import unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import ScaleCalculationMode, to_mx
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

# the deterministic block formats (stochastic rounding is tested with its draws below; EDEN's
# stochastic scales in test_eden.py)
DETERMINISTIC = [p for p in F.BLOCK_FORMATS if not p.stochastic]
PRESETS = [p.name for p in DETERMINISTIC]




# -- torchao: to_mx in every scale mode, nvfp4_quantize ------------------------------------
TORCHAO_ELEMENTS = {
    "fp4_e2m1": torch.float4_e2m1fn_x2,
    "fp6_e2m3": DTYPE_FP6_E2M3,
    "fp6_e3m2": DTYPE_FP6_E3M2,
    "fp8_e4m3fn": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
TORCHAO_RULES = {
    ScaleRule.OCP_FLOOR: ScaleCalculationMode.FLOOR,
    ScaleRule.CEIL: ScaleCalculationMode.CEIL,
    ScaleRule.EVEN: ScaleCalculationMode.EVEN,
    ScaleRule.RCEIL: ScaleCalculationMode.RCEIL,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rule", list(TORCHAO_RULES), ids=lambda r: r.value)
@pytest.mark.parametrize("element", list(TORCHAO_ELEMENTS))
def test_mx_matches_torchao_to_mx(element, rule, dtype):
    """Codes and E8M0 scales equal torchao's `to_mx` bit for bit on finite input.

    Blocks whose amax is below 2^-100 are avoided: there torchao clamps the float32 scale it
    divides by to 2^-126 (a workaround for Triton) and its RCEIL reads log2 in float32."""
    x = spread((64, 256), seed=1, dtype=dtype)
    scale_ref, data_ref = to_mx(x, TORCHAO_ELEMENTS[element], 32, TORCHAO_RULES[rule])
    spec = QuantSpec(name="t", element=F.get(element), scale=F.UE8M0, block=(32,), scale_rule=rule)
    q = quantize(x, spec)
    if element == "fp4_e2m1":
        codes_ref = unpack_uint4(data_ref.view(torch.uint8)).reshape(x.shape)
    else:
        codes_ref = data_ref.view(torch.uint8)
    scale_codes = scale_ref.view(torch.uint8).reshape(q.scales.shape)
    assert torch.equal(F.UE8M0.encode(q.scales), scale_codes)
    assert torch.equal(q.codes, codes_ref.to(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("preset", ["torchao_nvfp4", "torchao_nvfp4_1level"])
def test_torchao_nvfp4_presets_match_nvfp4_quantize(preset, dtype):
    x = spread((64, 256), seed=2, dtype=dtype, low=-8, high=8)
    two_level = preset == "torchao_nvfp4"
    per_tensor = per_tensor_amax_to_scale(x.float().abs().amax()) if two_level else None
    scale_ref, data_ref = nvfp4_quantize(x, 16, per_tensor)
    q = quantize(x, preset)
    assert torch.equal(q.scales, scale_ref.float().reshape(q.scales.shape))
    assert torch.equal(q.codes, unpack_uint4(data_ref.view(torch.uint8)).reshape(x.shape))
    if per_tensor is not None:
        assert q.tensor_scale.item() == per_tensor.item()


# -- Transformer Engine's NVFP4 reference quantizer, restated from its source -----------------
FLT_MAX = torch.finfo(torch.float32).max


def te_nvfp4_reference(x, tile=(1, 16)):
    """The float32 operation order of TE's NVFP4QuantizerRef._quantize_blockwise_reference."""
    x = x.float()
    m, n = x.shape
    r, c = tile
    blocks = x.reshape(m // r, r, n // c, c).transpose(1, 2)  # (m/r, n/c, r, c)
    vec_max = blocks.abs().amax(dim=(-1, -2))
    encode = torch.clamp(torch.tensor(448.0) * torch.tensor(6.0) / x.abs().amax(), max=FLT_MAX)
    encode = torch.where(encode == 0, torch.tensor(1.0), encode)
    decode = 1.0 / encode
    multiplier = encode * torch.reciprocal(torch.tensor(6.0))
    scale = torch.clamp(torch.clamp(vec_max * multiplier, max=FLT_MAX), -448, 448)
    scale = scale.to(torch.float8_e4m3fn).float()
    element_scale = torch.clamp(1.0 / (scale * decode), max=FLT_MAX)
    scaled = torch.clamp(blocks * element_scale[..., None, None], -6.0, 6.0)
    codes = te_fp4_codes(scaled).transpose(1, 2).reshape(m, n)
    return codes, scale, decode


@pytest.mark.parametrize("preset, tile", [("nvfp4", (1, 16)), ("nvfp4_2d", (16, 16))])
def test_nvfp4_matches_transformer_engine_reference(preset, tile):
    x = spread((64, 256), seed=3, low=-10, high=10)
    codes, scale, decode = te_nvfp4_reference(x, tile)
    q = quantize(x, preset)
    nonzero = x != 0  # TE's table gives -0.0 the code of +0.0; the values agree
    assert torch.equal(q.codes[nonzero], codes[nonzero])
    assert torch.equal(q.scales.reshape(scale.shape), scale)
    assert q.tensor_scale.item() == decode.item()


# -- NaN, inf, zeros, subnormals, empty --------------------------------------------------------
@pytest.mark.parametrize("preset", ["mxfp4", "mxfp8_e4m3", "mxint8", "nvfp4_ue5m3"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_gives_the_block_a_nan_scale(preset, bad):
    x = torch.randn(2, 64)
    x[1, 40] = bad
    q = quantize(x, preset)
    block = 40 // q.spec.block[0]
    assert math.isnan(q.scales[1, block])
    nan_scales = torch.isnan(q.scales)
    assert int(nan_scales.sum()) == 1, "only the block holding the special value"
    d = q.dequantize()
    span = slice(block * q.spec.block[0], (block + 1) * q.spec.block[0])
    assert torch.isnan(d[1, span]).all()
    assert torch.isfinite(d[0]).all()


def test_nvfp4_follows_transformer_engine_on_nan_and_inf():
    """TE's arithmetic: a NaN reaches every block through the tensor amax; an inf tensor amax
    makes the encode scale 0, which TE replaces by 1, and the inf saturates to 6 * 448."""
    x = torch.randn(2, 32)
    x[0, 3] = math.nan
    assert torch.isnan(quantize(x, "nvfp4").dequantize()).all()
    x[0, 3] = math.inf
    q = quantize(x, "nvfp4")
    assert q.tensor_scale.item() == 1.0
    assert q.dequantize()[0, 3].item() == 6.0 * 448.0


@pytest.mark.parametrize("preset", PRESETS)
def test_all_zero_and_empty_tensors(preset):
    zeros = torch.zeros(3, 64)
    if preset == "torchao_nvfp4":
        # Faithful to torchao: tensor amax 0 gives per_tensor_scale 0 and 0/0 block scales.
        assert torch.isnan(quantize(zeros, preset).scales).all()
    else:
        assert torch.equal(fake_quantize(zeros, preset), zeros)
    q = quantize(torch.empty(0, 64), preset)
    assert q.codes.shape == (0, 64) and q.dequantize().shape == (0, 64)
    assert quantize(torch.empty(4, 0), preset).dequantize().shape == (4, 0)


@pytest.mark.parametrize(
    "preset", ["mxfp4", "mxfp8_e4m3", "nvfp4", "nvfp4_ue5m3", "fp8_e4m3_tensor"]
)
def test_subnormal_inputs(preset):
    """float32 subnormals (|x| ~ 1e-40) quantize to finite values. MXFP8's smallest value,
    2^-9 * 2^-127, resolves them; MXFP4's, 0.5 * 2^-127 ~ 2.9e-39, lies above them all, so
    the block flushes to zero. NVFP4 with TE's arithmetic flushes them too: the encode scale
    2688 / amax exceeds FLT_MAX and saturates there, and so does the element multiplier."""
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6)) * 1e-40
    d = fake_quantize(x, preset)
    assert torch.isfinite(d).all()
    rel = ((d.double() - x.double()).norm() / x.double().norm()).item()
    expected = {
        "mxfp4": 1.0, "mxfp8_e4m3": 0.1, "nvfp4": 1.0, "nvfp4_ue5m3": 1.0, "fp8_e4m3_tensor": 0.1
    }
    assert rel <= expected[preset]
    if preset in ("mxfp4", "nvfp4"):
        assert torch.equal(d, torch.zeros_like(d))


# -- layouts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_partial_blocks_equal_zero_padding(preset):
    x = torch.randn(5, 37)
    q = quantize(x, preset)
    assert q.codes.shape == x.shape
    padded = torch.nn.functional.pad(x, (0, 64 - 37, 0, 16 - 5 if "2d" in preset else 0))
    want = quantize(padded, preset).dequantize()[: x.shape[0], :37]
    assert_same_bits(q.dequantize(), want, x, f"{preset} padded")


@pytest.mark.parametrize("preset", ["mxfp4", "nvfp4", "nvfp4_ue5m3"])
def test_axis_is_a_transpose(preset):
    x = torch.randn(48, 3, 20)
    a = quantize(x, preset, axis=0)
    b = quantize(x.movedim(0, -1), preset, axis=-1)
    assert torch.equal(a.codes, b.codes.movedim(-1, 0))
    assert torch.equal(a.scales, b.scales.movedim(-1, 0))
    assert a.scales.shape == (-(-48 // q_block(preset)), 3, 20)


def q_block(preset):
    return F.get(preset).block[0]


def test_square_tiles_give_a_tensor_and_its_transpose_the_same_quantization():
    """2-D 16x16 tiles (unlike 1-D blocks) commute with transposition (Rahimifar et al.)."""
    x = torch.randn(64, 96)
    assert torch.equal(fake_quantize(x.T, "nvfp4_2d"), fake_quantize(x, "nvfp4_2d").T)
    assert not torch.equal(fake_quantize(x.T, "nvfp4"), fake_quantize(x, "nvfp4").T)
    assert torch.equal(fake_quantize(x, "nvfp4_2d", axis=-2), fake_quantize(x, "nvfp4_2d"))


def test_rectangular_tiles_follow_the_axis():
    spec = dataclasses.replace(F.get("nvfp4_2d"), name="tiles_4x16", block=(4, 16))
    x = torch.randn(32, 48)
    q = quantize(x, spec)
    assert q.scales.shape == (8, 3)
    assert quantize(x, spec, axis=-2).scales.shape == (2, 12)  # 16 along dim -2, 4 along -1
    assert torch.equal(fake_quantize(x, spec, axis=-2), fake_quantize(x.T, spec).T)


# -- Hadamard ----------------------------------------------------------------------------------
def test_hadamard_matrix_is_orthogonal_and_seeded():
    h = F.hadamard_matrix(64, seed=5, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h, F.hadamard_matrix(64, seed=5, dtype=torch.float64))
    assert not torch.equal(h, F.hadamard_matrix(64, seed=6, dtype=torch.float64))


def test_hadamard_is_undone_by_dequantize():
    lossless = QuantSpec(name="fp32_rht", element=F.FP32, scale=F.FP32, block=(16,),
                         scale_rule=ScaleRule.NEAREST, hadamard=16, hadamard_seed=3)
    x = torch.randn(8, 64, dtype=torch.float64)
    assert torch.allclose(fake_quantize(x, lossless), x, atol=1e-6)  # FP32 elements
    q = quantize(x.float(), lossless)
    assert not torch.allclose(q.element_values() * q.expanded_scales(), x.float(), atol=1e-3)


def test_hadamard_spreads_an_outlier():
    """One outlier in a block: MXFP4 flushes the rest of the block, a Hadamard does not."""
    x = torch.full((1, 32), 0.01)
    x[0, 5] = 100.0
    rht = dataclasses.replace(F.get("mxfp4"), name="mxfp4_rht", hadamard=32)
    plain_err = (fake_quantize(x, "mxfp4") - x).abs()[0, 6:].max()
    rht_err = (fake_quantize(x, rht) - x).norm() / x.norm()
    assert plain_err.item() == pytest.approx(0.01)  # flushed to zero
    assert rht_err.item() < (fake_quantize(x, "mxfp4") - x).norm().item() / x.norm().item() + 0.2


# -- fake_quantize ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("preset", PRESETS)
def test_fake_quantize_equals_dequantize_and_passes_gradients(preset, dtype):
    x = spread((16, 64), seed=4, dtype=dtype, low=-6, high=6).requires_grad_()
    y = fake_quantize(x, preset)
    assert y.dtype == dtype
    want = quantize(x, preset).dequantize(dtype).float()
    assert_same_bits(y.detach().float(), want, x.detach().float(), preset)
    g = torch.randn_like(y)
    y.backward(g)
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("preset", ["mxfp4", "mxfp6_e3m2", "mxfp8_e5m2", "mxint8", "mxfp4_rceil"])
def test_float64_input_quantizes_as_float32(preset):
    """Power-of-two scales divide exactly, so float32 values give the same codes in float64."""
    x = spread((16, 64), seed=5)
    assert torch.equal(quantize(x.double(), preset).codes, quantize(x, preset).codes)


def test_stochastic_rounding_of_elements_is_seeded_and_unbiased():
    """mxfp4_rceil never clips, so SR leaves E[dequantize] = x; 5 standard errors from the
    per-element Bernoulli variance over n draws bound the sample mean's error."""
    x = torch.randn(4, 64)
    n = 2000
    draws = torch.stack(
        [fake_quantize(x, "mxfp4_rceil", rounding="stochastic", generator=s) for s in range(n)]
    )
    lo = fake_quantize(x, "mxfp4_rceil", rounding="toward_zero")
    hi = fake_quantize(x, "mxfp4_rceil", rounding="away_from_zero")
    p = torch.where(hi != lo, (x - lo) / (hi - lo), 0.0)
    se = (hi - lo).abs() * torch.sqrt(p * (1 - p) / n)
    assert torch.all((draws.mean(0) - x).abs() <= 5 * se + 1e-7)
    again = fake_quantize(x, "mxfp4_rceil", rounding="stochastic", generator=0)
    assert torch.equal(again, draws[0])


# -- packing and interop ---------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["nvfp4", "mxfp6_e3m2", "mxfp8_e4m3", "mxint8"])
def test_packing_round_trip(preset):
    x = torch.randn(3, 7, 33)
    q = quantize(x, preset)
    packed = q.packed()
    assert packed.dtype == torch.uint8
    assert packed.numel() == -(-x.numel() * q.spec.element.bits // 8)
    back = F.QuantizedTensor.from_packed(
        packed, shape=x.shape, scales=q.scales, tensor_scale=q.tensor_scale, spec=preset,
        axis=q.axis,
    )
    assert torch.equal(back.codes, q.codes)
    assert torch.equal(back.dequantize(), q.dequantize())


def test_fp4_packing_is_low_nibble_first_like_torch_float4():
    q = quantize(torch.tensor([[0.5, 6.0, -1.0, 0.0]]), "nvfp4_ue5m3")
    assert q.codes.tolist() == [[1, 7, 10, 0]]
    assert q.packed().tolist() == [0x71, 0x0A]
    assert q.to_torch().view(torch.uint8).tolist() == [[0x71, 0x0A]]


@pytest.mark.parametrize(
    "fmt", [F.FP8_E4M3FN, F.FP8_E5M2, F.FP8_E4M3FNUZ, F.FP8_E5M2FNUZ, F.UE8M0], ids=str
)
def test_codes_convert_to_torch_float8(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    as_torch = F.to_torch(codes, fmt).float()
    ours = fmt.decode(codes)
    same = (as_torch == ours) | (torch.isnan(as_torch) & torch.isnan(ours))
    assert same.all(), codes[~same]


@pytest.mark.parametrize("preset", ["nvfp4", "mxfp6_e2m3", "mxfp6_e3m2", "mxfp8_e5m2"])
def test_codes_convert_to_ml_dtypes(preset):
    q = quantize(torch.randn(4, 32), preset)
    arr = q.to_ml_dtypes()
    assert torch.equal(torch.from_numpy(arr.astype(np.float32)), q.element_values())


def test_no_torch_dtype_is_an_error():
    with pytest.raises(ValueError, match="torch has no dtype"):
        F.to_torch(torch.zeros(2, dtype=torch.uint8), F.UE5M3)


# -- the recipes table ---------------------------------------------------------------------------
def test_recipes_table_shows_rounding_correction_and_fixed_scales():
    """`fp4lab formats` rows: nvfp4 and nvfp4_sr differ in their rounding column; EDEN and
    fixed scales show their fields; bits per element count what is stored per block."""
    from fp4lab.formats.tables import recipes_frame

    rows = recipes_frame().set_index("name")
    assert set(rows.index) == {s.name for s in F.BLOCK_FORMATS} | set(F.names(QuantSpec))
    assert rows.loc["nvfp4", "rounding"] == "nearest_even"
    assert rows.loc["nvfp4_sr", "rounding"] == "stochastic"
    eden = rows.loc["nvfp4_ms_eden"]
    assert (eden.correction, eden.hadamard) == ("eden", 128)
    assert eden.rounding == "nearest_even, stochastic scales"
    assert eden.amax_target == F.NVFP4_MS_EDEN.amax_target
    x4 = rows.loc["fp8_e4m3_x4"]
    assert (x4.fixed_scale, x4.scale, x4.scale_rule) == (0.25, "fixed", "fixed")
    assert x4.bits_per_element == 8.0
    assert rows.loc["mxfp4_alpha_mse", "scale_rule"] == "alpha_mse"
    assert rows.loc["mxfp4_alpha_rte_2d", "bits_per_element"] == 4 + 8 / 1024
    assert rows.loc["nvfp4_reciprocal_2level", "arithmetic"] == "reciprocal"


def test_every_block_format_is_registered_and_exported():
    for spec in F.BLOCK_FORMATS:
        assert F.get(spec.name) is spec
        constant = spec.name.upper()
        assert constant in F.__all__ and getattr(F, constant) is spec


# -- registry --------------------------------------------------------------------------------
def test_a_registered_custom_format_and_recipe_work_by_name():
    e3m0 = F.FloatFormat(name="test_e3m0", ebits=3, mbits=0, bias=3)
    spec = QuantSpec(
        name="test_mxe3m0", element=e3m0, scale=F.UE8M0, block=(8,), scale_rule="ocp_floor"
    )
    F.register(e3m0)
    F.register(spec)
    try:
        assert F.get("test_mxe3m0") is spec and "test_e3m0" in F.names(F.FloatFormat)
        d = fake_quantize(torch.tensor([[1.0, 3.0, 0.3, -7.0, 0, 0, 0, 0]]), "test_mxe3m0")
        # amax 7: OCP floor gives scale 2^(2 - 4); 3/0.25 = 12 ties to 16; -7/0.25 clips at 16.
        assert d.tolist() == [[1.0, 4.0, 0.25, -4.0, 0, 0, 0, 0]]
        with pytest.raises(ValueError, match="already registered"):
            F.register(dataclasses.replace(spec, block=(16,)))
    finally:
        F.unregister("test_mxe3m0")
        F.unregister("test_e3m0")


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown name 'nvfp5'.*nvfp4"):
        quantize(torch.ones(16), "nvfp5")
    with pytest.raises(ValueError, match="not a QuantSpec"):
        quantize(torch.ones(16), "fp4_e2m1")


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "x, kwargs, error, message",
    [
        (torch.ones(4, 32, dtype=torch.int64), {}, TypeError, "x must be a floating-point"),
        (torch.ones(4, 32, dtype=torch.complex64), {}, TypeError, "x must be a floating-point"),
        (torch.ones(4, 32), {"axis": 2}, ValueError, "axis=2 is out of range"),
        (torch.ones(4, 32), {"axis": 1.0}, TypeError, "axis must be an int"),
        (
            torch.ones(3, 4, 32), {"spec": "nvfp4_2d", "axis": 0}, ValueError,
            "2-D blocks cover the last two",
        ),
        (torch.ones(32), {"spec": "nvfp4_2d"}, ValueError, "at least 2 dims"),
        (torch.ones(4, 24), {"spec": "mxfp4_rht"}, ValueError, "Hadamard size 32"),
        (torch.ones(4, 32), {"rounding": "nearest"}, ValueError, "rounding must be one of"),
    ],
)
def test_bad_input_names_the_argument(x, kwargs, error, message):
    spec = kwargs.pop("spec", "mxfp4")
    if spec == "mxfp4_rht":
        spec = dataclasses.replace(F.get("mxfp4"), name="mxfp4_rht", hadamard=32)
    with pytest.raises(error, match=message):
        quantize(x, spec, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block=(0,)), "block must be"),
        (dict(block=(2, 2, 2)), "block must be"),
        (dict(hadamard=24), "hadamard must be"),
        (dict(sr_bits=60), "sr_bits"),
        (dict(scale_rule="floor"), "floor"),
        (dict(element="fp4_e2m1"), "element must be a FloatFormat"),
    ],
)
def test_bad_specs_name_the_field(kwargs, message):
    base = dict(
        name="bad", element=F.FP4_E2M1, scale=F.UE8M0, block=(32,), scale_rule=ScaleRule.OCP_FLOOR
    )
    with pytest.raises((ValueError, TypeError), match=message):
        QuantSpec(**{**base, **kwargs})


def test_torchao_presets_follow_torchao_on_nan_and_inf():
    x = torch.randn(2, 32)
    x[0, 3] = math.inf
    assert torch.isnan(fake_quantize(x, "torchao_nvfp4")).all()
    one_level = fake_quantize(x, "torchao_nvfp4_1level")
    assert one_level[0, 3].item() == 6.0 * 448.0 and torch.isfinite(one_level).all()
    x[0, 3] = math.nan
    one_level = fake_quantize(x, "torchao_nvfp4_1level")
    assert torch.isnan(one_level[0, :16]).all() and torch.isfinite(one_level[0, 16:]).all()


# -- batch_dims: independent tensors in one call --------------------------------------------------
@pytest.mark.parametrize(
    "preset", ["nvfp4", "nvfp4_2d", "torchao_nvfp4", "fp8_e4m3_tensor", "mxfp4"]
)
def test_batch_dims_equal_quantizing_each_tensor_alone(preset):
    x = spread((3, 2, 32, 48), seed=8, low=-5, high=5)
    x[1, 0] *= 1000.0  # a tensor with a much larger amax must not change the others
    q = quantize(x, preset, batch_dims=2)
    for i in range(3):
        for j in range(2):
            alone = quantize(x[i, j], preset)
            assert torch.equal(q.codes[i, j], alone.codes)
            assert torch.equal(q.scales[i, j], alone.scales)
            if alone.tensor_scale is not None:
                assert q.tensor_scale.shape == (3, 2, 1, 1)
                assert torch.equal(q.tensor_scale[i, j, 0, 0], alone.tensor_scale)
    assert_same_bits(fake_quantize(x, preset, batch_dims=2), q.dequantize(), x, preset)


def test_batch_dims_bad_values():
    x = torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="batch_dims must be an int in"):
        quantize(x, "nvfp4", batch_dims=4)
    with pytest.raises(ValueError, match="blocks never span tensors"):
        quantize(x, "nvfp4", axis=0, batch_dims=1)
    with pytest.raises(ValueError, match="leaves no dims for the blocks"):
        quantize(x, "nvfp4_2d", batch_dims=2)


@pytest.mark.parametrize("spec", DETERMINISTIC, ids=lambda s: s.name)
def test_an_all_zero_tile_of_a_batch_quantizes_to_zeros(spec):
    # A block (and a per-tile tensor scale) of +0 or -0 gives zeros, not NaN: its amax is +0.
    # Except torchao's arithmetic with a tensor scale, which divides 0 by a zero tensor scale
    # (torchao's nvfp4_quantize gives NaN scales for an all-zero tensor too).
    if spec.tensor_scale and spec.arithmetic is F.ScaleArithmetic.TORCHAO_DECODE:
        pytest.skip("torchao's arithmetic: 0 / 0 for an all-zero tensor, as torchao")
    x = torch.rand(3, 16, 64, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    x[2, :8] = -0.0
    out = fake_quantize(x, spec, batch_dims=1, generator=0)
    assert torch.equal(out[1], torch.zeros(16, 64))
    assert not torch.isnan(out).any()


def test_noise_is_the_uniform_each_element_rounds_with():
    spec = dataclasses.replace(F.get("mxfp4"), name="mxfp4_sr", rounding="stochastic")
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    u = torch.rand(8, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    # along the last axis the blocks are x's own order: the generator's draws are these
    assert torch.equal(fake_quantize(x, spec, noise=u), fake_quantize(x, spec, generator=2))
    # along another axis each element still rounds with its own uniform
    along_0 = fake_quantize(x.T, spec, axis=0, noise=u.T)
    assert torch.equal(along_0, fake_quantize(x, spec, noise=u).T)
    assert torch.equal(quantize(x, spec, noise=u).dequantize(), fake_quantize(x, spec, noise=u))
    with pytest.raises(ValueError, match="noise must be a tensor of x's shape"):
        fake_quantize(x, spec, noise=u[:4])
