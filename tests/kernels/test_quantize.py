"""fp4lab.kernels.quantize against the reference fp4lab.formats.quantize, bit for bit.

Under Triton's interpreter on the CPU (TRITON_INTERPRET=1 is set for each test and read at
call time, so it does not matter when fp4lab.kernels.quantize was imported): every block
format of the registry and custom ones (elements, scales, rules and arithmetics of their own),
1-D blocks along the last axis and along others, 2-D tiles either way round, partial and
non-power-of-two blocks, batch_dims, tensor scales, NaN, inf, zeros and subnormals, every
rounding mode, stochastic rounding from noise and from Philox draws, packed codes, and the
errors. The fake-quantized values, codes, scales and tensor scales must equal the
reference's (torch.equal on the bits; NaN where the reference has NaN). The GPU tests at the
end run the same comparisons at larger sizes on CUDA and skip without it.
"""

import importlib

import numpy as np
import pytest
import torch

import fp4lab.formats as F
from fp4lab.formats import FloatFormat, QuantSpec, Rounding, ScaleArithmetic, ScaleRule, Specials

pytest.importorskip("triton")
K = importlib.import_module("fp4lab.kernels.quantize")
from .helpers import DEVICE  # noqa: E402

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# numpy's IEEE warnings from the interpreter (0 / 0, inf - inf) are the arithmetic under test
pytestmark = pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning")


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# -- inputs -------------------------------------------------------------------------------------
def spread(shape, seed=0, dtype=torch.float32, low=-20, high=20, device="cpu"):
    """Gaussian rows times log-spaced row magnitudes 2^[low, high), one all-zero stretch."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.randint(low, high, (*shape[:-1], 1), generator=gen).float())
    x.view(-1)[:32] = 0
    return x.to(dtype=dtype, device=device)


def with_specials(x):
    """x with NaN, +-inf, float32 subnormals and a block of tiny values in separate rows."""
    x = x.clone()
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3, 7] = -float("inf")
    x[4, :] = x[4, :].sign() * 2.0**-140 * torch.arange(1, x.shape[1] + 1, device=x.device)
    x[5, :] = x[5, :] * 2.0**-120
    x[6, 9] = -0.0
    return x


def uniforms(x, seed=7):
    return torch.rand(x.shape, generator=torch.Generator().manual_seed(seed),
                      dtype=torch.float64)


# -- comparisons --------------------------------------------------------------------------------
def assert_same(ours, ref, x, what, spec):
    """Equal bit for bit (float: NaN where the reference has NaN); else the first mismatch with
    its index, block, input, both values and their bits."""
    if ref is None or ours is None:
        assert ours is None and ref is None, f"{what}: ours {ours!r}, reference {ref!r}"
        return
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert ours.dtype == ref.dtype, f"{what}: dtype {ours.dtype} != {ref.dtype}"
    if ref.dtype.is_floating_point:
        o, r = ours.float(), ref.float()
        same = (o.view(torch.int32) == r.view(torch.int32)) | (o.isnan() & r.isnan())
        bits = lambda t, i: hex(int(t.float().reshape(-1)[i].view(torch.int32)))  # noqa: E731
    else:
        same = ours == ref
        bits = lambda t, i: bin(int(t.reshape(-1)[i]))  # noqa: E731
    if bool(same.all()):
        return
    i = int((~same.reshape(-1)).nonzero()[0])
    index = tuple(int(k) for k in np.unravel_index(i, tuple(ref.shape)))
    shown = x[index].item() if x is not None and x.shape == ref.shape else None
    raise AssertionError(
        f"{spec.name} {what}: {int((~same).sum())} of {same.numel()} differ; first at {index}"
        f" (block {spec.block}), input {shown!r}: ours {ours.reshape(-1)[i].item()!r} "
        f"(bits {bits(ours, i)}), reference {ref.reshape(-1)[i].item()!r} "
        f"(bits {bits(ref, i)})"
    )


def check(x, spec, **kw):
    """fake_quantize, quantize and quantize_packed of the kernels against the reference."""
    spec = F.resolve_spec(spec)
    ref = F.quantize(x, spec, **kw)
    assert_same(K.fake_quantize(x, spec, **kw), F.fake_quantize(x, spec, **kw), x, "values",
                spec)
    q = K.quantize(x, spec, **kw)
    assert_same(q.codes, ref.codes, x, "codes", spec)
    assert_same(q.scales, ref.scales, None, "scales", spec)
    assert_same(q.tensor_scale, ref.tensor_scale, None, "tensor scale", spec)
    assert (q.axis, q.batch_dims) == (ref.axis, ref.batch_dims)
    if spec.element.bits in (4, 8):
        p = K.quantize_packed(x, spec, **kw)
        assert torch.equal(p.packed, ref.packed()), f"{spec.name}: packed codes differ"
        assert_same(p.unpack().codes, ref.codes, x, "unpacked codes", spec)


def noise_for(spec, x):
    return {"noise": uniforms(x)} if spec.stochastic else {}


# -- every registered block format --------------------------------------------------------------
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("spec", F.BLOCK_FORMATS, ids=lambda s: s.name)
def test_block_format_matches_reference(spec, dtype):
    x = spread((40, 256), seed=1, dtype=dtype)
    check(x, spec, **noise_for(spec, x))


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("spec", [s for s in F.BLOCK_FORMATS if s.hadamard is None],
                         ids=lambda s: s.name)
def test_nan_inf_zeros_subnormals(spec):
    """One NaN, +-inf, subnormal and tiny rows, a negative zero: each arithmetic's documented
    behaviour (a NaN block, the whole tensor NaN through the tensor amax, saturation)."""
    x = with_specials(spread((40, 96), seed=2, low=-6, high=6))
    check(x, spec, **noise_for(spec, x))


@pytest.mark.usefixtures("interpreter")
def test_float16_input_and_output():
    x = spread((24, 64), seed=3, low=-4, high=4).half()
    for name in ("nvfp4", "mxfp8_e4m3", "fp8_e4m3_x4"):
        check(x, name)


# -- custom formats: the format's fields become the kernel's constants ---------------------------
E3M2_BIAS2 = FloatFormat(name="e3m2_bias2", ebits=3, mbits=2, bias=2)
UE3M2 = FloatFormat(name="ue3m2", ebits=3, mbits=2, bias=3, signed=False)
UE4M3_FNUZ_LIKE = FloatFormat(name="e4m3_fnuz_like", ebits=4, mbits=3, bias=8,
                              specials=Specials.FNUZ)


def custom(name, **fields):
    base = dict(element=F.FP4_E2M1, scale=F.UE8M0, block=(32,), scale_rule=ScaleRule.OCP_FLOOR)
    return QuantSpec(name=name, **{**base, **fields})


CUSTOM = [
    custom("e3m2_bias2_ceil", element=E3M2_BIAS2, scale_rule=ScaleRule.CEIL),
    custom("unsigned_elements", element=UE3M2, scale_rule=ScaleRule.EVEN),
    custom("fnuz_elements_rceil", element=UE4M3_FNUZ_LIKE, scale_rule=ScaleRule.RCEIL),
    custom("e5m2fnuz_floor_16", element=F.FP8_E5M2FNUZ, block=(16,)),
    custom("int4_blocks_of_24", element=F.INT4, block=(24,)),
    custom("pow2_with_floor", scale_floor=2.0**-9 + 2.0**-12),
    custom("fp16_elements_fp32_scale", element=F.FP16, scale=F.FP32,
           scale_rule=ScaleRule.NEAREST, block=(8,)),
    custom("ue5m3_ieee_exact_tensor", scale=F.UE5M3_IEEE, scale_rule=ScaleRule.NEAREST,
           block=(16,), tensor_scale=True),
    custom("bf16_scale_torchao_floor", scale=F.BF16, scale_rule=ScaleRule.NEAREST, block=(16,),
           tensor_scale=True, arithmetic=ScaleArithmetic.TORCHAO_DECODE, scale_floor=1e-3),
    custom("e4m3_scale_divide_unrounded_tensor", scale=F.UE4M3, scale_rule=ScaleRule.NEAREST,
           block=(16,), tensor_scale=True, arithmetic=ScaleArithmetic.DIVIDE_UNROUNDED),
    custom("te_encode_blocks_of_12", scale=F.UE4M3, scale_rule=ScaleRule.NEAREST, block=(12,),
           tensor_scale=True, arithmetic=ScaleArithmetic.TE_ENCODE),
    custom("reciprocal_ue5m3_tensor", scale=F.UE5M3, scale_rule=ScaleRule.NEAREST, block=(16,),
           tensor_scale=True, arithmetic=ScaleArithmetic.RECIPROCAL),
    custom("tiles_3x5_ceil", block=(3, 5), scale_rule=ScaleRule.CEIL),
    custom("tiles_64x128_nearest_fp32", element=F.FP8_E4M3FN, scale=F.FP32, block=(64, 128),
           scale_rule=ScaleRule.NEAREST),
    custom("alpha_half_fp6", element=F.FP6_E2M3, scale_rule=ScaleRule.ALPHA_HALF),
    custom("alpha_rte_tiles_8x8", block=(8, 8), scale_rule=ScaleRule.ALPHA_RTE),
    custom("fixed_non_power_of_two", element=F.FP8_E4M3FN, scale=F.FP32, block=None,
           scale_rule=ScaleRule.NEAREST, fixed_scale=float(torch.tensor(0.3))),
    custom("fixed_power_of_two_blocks", element=F.FP8_E5M2, scale=F.FP32, block=(16,),
           scale_rule=ScaleRule.NEAREST, fixed_scale=2.0**-5),
    custom("per_tensor_e5m2_two_level", element=F.FP8_E5M2, scale=F.UE4M3, block=None,
           scale_rule=ScaleRule.NEAREST, tensor_scale=True),
    custom("sr_3_bits", scale=F.UE4M3, scale_rule=ScaleRule.NEAREST, block=(16,),
           rounding=Rounding.STOCHASTIC, sr_bits=3),
]


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("spec", CUSTOM, ids=lambda s: s.name)
def test_custom_format_matches_reference(spec):
    x = with_specials(spread((36, 120), seed=4, low=-10, high=10))
    x[0, 40:50] = -x[0, 40:50].abs()  # negatives for the unsigned element format
    check(x, spec, **noise_for(spec, x))


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("rounding", list(Rounding), ids=lambda r: r.value)
def test_every_rounding_mode(rounding):
    x = spread((24, 80), seed=5, low=-3, high=3)
    kw = {"noise": uniforms(x)} if rounding is Rounding.STOCHASTIC else {}
    for name in ("nvfp4", "mxfp6_e3m2", "mxint8"):
        check(x, name, rounding=rounding, **kw)


# -- layouts: any axis through strides, 2-D tiles either way, batch_dims -------------------------
LAYOUTS = {  # spec, shape, axis, batch_dims
    "keys-along-seq-nvfp4": ("nvfp4", (2, 3, 40, 24), -2, 2),
    "keys-along-seq-mxfp4": ("mxfp4", (2, 3, 70, 16), 2, 0),
    "axis-0-of-3d": ("mxfp8_e4m3", (50, 3, 7), 0, 0),
    "axis-1-batch-1": ("nvfp4_reciprocal_2level", (3, 37, 10), 1, 1),
    "tiles-transposed": ("nvfp4_2d", (2, 40, 24), -2, 0),
    "tiles-batch-1": ("mxfp4_alpha_rte_2d", (3, 33, 70), -1, 1),
    "tile128-batch-2": ("fp8_e4m3_tile128", (2, 2, 150, 40), -1, 2),
    "per-tensor-batch-2": ("fp8_e5m2_tensor", (2, 3, 5, 8), -1, 2),
    "odd-last-dim": ("torchao_nvfp4", (5, 3, 21), -1, 1),
    "eden-batch-1": ("nvfp4_ms_eden", (2, 4, 128), -1, 1),
}


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name, shape, axis, batch_dims", LAYOUTS.values(), ids=LAYOUTS)
def test_layouts_match_reference(name, shape, axis, batch_dims):
    x = spread(shape, seed=6, low=-8, high=8)
    spec = F.resolve_spec(name)
    check(x, spec, axis=axis, batch_dims=batch_dims, **noise_for(spec, x))


@pytest.mark.usefixtures("interpreter")
def test_strided_input_is_read_in_place_or_copied():
    """A transposed view along either axis, and a view whose dims cannot be merged."""
    base = spread((48, 64), seed=8, low=-4, high=4)
    check(base.T, "nvfp4", axis=-1)
    check(base.T, "mxfp4", axis=0)
    check(spread((4, 16, 64), seed=9)[:, ::2, 1:], "nvfp4_1level")


# -- stochastic rounding: noise or Philox draws by position --------------------------------------
@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", ["nvfp4_sr", "nvfp4_ms_eden"])
def test_seed_draws_philox_noise(name):
    """seed= gives the rounding of the reference fed philox_noise(x.shape, seed)."""
    x = spread((6, 256), seed=10, low=-4, high=4)
    noise = K.philox_noise(x.shape, 0xDEADBEEF12345678, stream=3)
    ours = K.fake_quantize(x, name, seed=0xDEADBEEF12345678, stream=3)
    assert_same(ours, F.fake_quantize(x, name, noise=noise), x, "values", F.resolve_spec(name))
    q = K.quantize(x, name, seed=0xDEADBEEF12345678, stream=3)
    ref = F.quantize(x, name, noise=noise)
    assert_same(q.codes, ref.codes, x, "codes", ref.spec)
    assert_same(q.scales, ref.scales, None, "scales", ref.spec)
    assert not torch.equal(ours, K.fake_quantize(x, name, seed=1, stream=3))


def test_philox_noise_is_uniform53_of_the_position():
    u = K.philox_noise((3, 5), seed=12345, stream=1)
    assert u.dtype == torch.float64 and ((0 <= u) & (u < 1)).all()
    assert torch.equal((u * 2.0**53).floor(), u * 2.0**53)
    assert not torch.equal(u, K.philox_noise((3, 5), seed=12345, stream=2))


# -- errors -------------------------------------------------------------------------------------
def test_cpu_tensor_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="x is on cpu"):
        K.fake_quantize(torch.ones(4, 32), "mxfp4")


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("name", ["nvfp4", "torchao_nvfp4"])
@pytest.mark.parametrize("batch_dims", [0, 2])
def test_factored_values_are_the_codes_times_block_scales(interpreter, name, batch_dims):
    # what the attention kernels read: codes x block scales in bf16 (exact there), the tensor
    # scale apart; their product is fake_quantize's up to its final rounding
    spec = F.get(name)
    x = spread((2, 3, 8, 64), seed=11).to(torch.bfloat16)
    values, decode = K.fake_quantize_factored(x, spec, batch_dims=batch_dims)
    want = F.quantize(x, spec, batch_dims=batch_dims)
    assert values.dtype == torch.bfloat16
    assert torch.equal(values, (want.element_values() * want.expanded_scales()).bfloat16())
    assert torch.equal(decode, want.tensor_scale)
    assert not torch.equal(values, F.fake_quantize(x, spec, batch_dims=batch_dims))  # not d


def test_factored_refuses_what_has_no_tensor_scale_to_keep_apart(interpreter):
    x = spread((4, 64)).to(torch.bfloat16)
    with pytest.raises(ValueError, match="mxfp4: fake_quantize_factored takes"):
        K.fake_quantize_factored(x, F.get("mxfp4"))


def test_bad_arguments_are_refused():
    # on the kernels' device: on a GPU machine a CPU tensor is refused for its device first
    x = torch.ones(4, 32, device=DEVICE)
    with pytest.raises(TypeError, match="float64"):
        K.quantize(x.double(), "mxfp4")
    with pytest.raises(TypeError, match="generator"):
        K.quantize(x, "nvfp4_sr", generator=torch.Generator())
    with pytest.raises(ValueError, match="noise .* seed"):
        K.fake_quantize(x, "nvfp4_sr")
    with pytest.raises(ValueError, match="noise must be a tensor of x's shape"):
        K.fake_quantize(x, "nvfp4_sr",
                        noise=torch.rand(4, 16, dtype=torch.float64, device=DEVICE))
    with pytest.raises(ValueError, match="nearest_even for correction=eden"):
        K.fake_quantize(torch.ones(4, 128, device=DEVICE), "nvfp4_ms_eden",
                        rounding="stochastic", seed=1)
    with pytest.raises(ValueError, match="axis=2 is out of range"):
        K.fake_quantize(x, "mxfp4", axis=2)
    with pytest.raises(ValueError, match="at least one dim and one element"):
        K.fake_quantize(torch.ones(0, 32, device=DEVICE), "mxfp4")
    huge = FloatFormat(name="e9m2", ebits=9, mbits=2, bias=255)
    with pytest.raises(ValueError, match="outside the kernels' float32 rounding"):
        K.fake_quantize(x, custom("huge", element=huge))
    with pytest.raises(ValueError, match="packing takes 4- or 8-bit codes"):
        K.quantize_packed(x, "mxfp6_e3m2")


# -- on the GPU ---------------------------------------------------------------------------------
GPU_LAYOUTS = {  # spec, shape, axis, batch_dims
    "nvfp4-keys-along-seq": ("nvfp4", (2, 4, 300, 128), -2, 2),
    "mxfp4-odd": ("mxfp4", (3, 257, 100), -1, 0),
    "nvfp4_2d-transposed": ("nvfp4_2d", (3, 200, 72), -2, 1),
    "tile128": ("fp8_e4m3_tile128", (2, 4, 500, 128), -1, 2),
    "eden": ("nvfp4_ms_eden", (2, 256, 512), -1, 1),
}


@requires_cuda
@pytest.mark.parametrize("spec", F.BLOCK_FORMATS, ids=lambda s: s.name)
def test_block_format_on_gpu(spec):
    x = with_specials(spread((512, 1024), seed=11, dtype=torch.bfloat16, device="cuda"))
    kw = {k: v.cuda() for k, v in noise_for(spec, x).items()}
    check(x, spec, **kw)
    check(x.float(), spec, **kw)


@requires_cuda
@pytest.mark.parametrize("name, shape, axis, batch_dims", GPU_LAYOUTS.values(), ids=GPU_LAYOUTS)
def test_layouts_on_gpu(name, shape, axis, batch_dims):
    x = spread(shape, seed=12, dtype=torch.bfloat16, device="cuda")
    spec = F.resolve_spec(name)
    kw = {"noise": K.philox_noise(x.shape, 9, device="cuda")} if spec.stochastic else {}
    check(x, spec, axis=axis, batch_dims=batch_dims, **kw)
    if spec.stochastic:
        q = K.quantize(x, spec, axis=axis, batch_dims=batch_dims, seed=9)
        assert_same(q.scales, F.quantize(x, spec, axis=axis, batch_dims=batch_dims,
                                         **kw).scales, None, "scales from seed", spec)
