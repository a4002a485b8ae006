"""The backend's fused operand passes against its slow path, bit for bit.

`fp4lab.kernels.backend._operand` takes a whole-tensor operand through a fused pass where one
gives the slow path's (store, factor) bits (`_codes_pass`: one FP32 scale per tensor or head,
`_fixed_pass`: one fixed power-of-two scale in the factor,
`_power_pass`: an alpha grid's 2^E with 1/M_e in the factor, `_factored_pass`: a tensor scale,
stochastic formats included), and through `_quantized_operand` (quantize, then torch)
otherwise. Every (preset recipe, operand field) that takes one of these passes is compared
with the slow path on inputs of a wide spread of magnitudes, zeros, subnormals, and in a
second head NaN and +-inf; the comparisons are on the float32 bits of the store (the
interpreter's store dtype) and of the factor, and on the bf16 bits the GPU would store. The
refusals are checked on formats where each pass's exactness argument fails. Runs under
Triton's interpreter on the CPU.
"""

import dataclasses
import math

import pytest
import torch

import fp4lab.formats as F
from fp4lab.formats import FloatFormat, QuantSpec, Rounding, ScaleRule
from fp4lab.formats.streams import pass_key
from fp4lab.recipes import TensorScope
from fp4lab.recipes.presets import PRESETS

pytest.importorskip("triton")
from fp4lab.kernels import backend  # noqa: E402
from fp4lab.kernels import quantize as K  # noqa: E402

from .helpers import DEVICE  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.* encountered in:RuntimeWarning")

_FIELDS = ("q", "k", "v", "dv_do", "dp_do", "dp_v", "dq_k", "dk_q")
_QUERY_SIDE = ("q", "dv_do", "dp_do", "dk_q")  # shaped as Q: the groups of a KV head share it


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _new_pass(spec) -> str | None:
    """The name of the pass `_operand` takes `spec` by that this file checks, or None."""
    if not isinstance(spec, QuantSpec) or backend._tile_factored(spec):
        return None
    if backend._one_pass(spec):
        return None
    if backend._fixed_pass(spec):
        return "fixed"
    if backend._factored_pass(spec):
        return "factored_sr" if spec.stochastic else None  # nearest: test_quantize's
    if backend._codes_pass(spec):
        return "codes"
    if backend._power_pass(spec):
        return "power"
    return None


FUSED = [
    pytest.param(recipe, field, id=f"{recipe.name}-{field}")
    for recipe in PRESETS
    for field in _FIELDS
    if _new_pass(getattr(recipe, field)) is not None
]


def spread(shape, seed: int, specials: bool = True) -> torch.Tensor:
    """bf16 Gaussian rows times 2^[-40, 40) row magnitudes, zero stretches, subnormal rows;
    with `specials` head 1 of batch 0 with NaN, +inf and -inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.randint(-40, 40, (*shape[:-1], 1), generator=gen).float())
    x[..., :3, :] = 0.0
    x[..., 5, :40] = 0.0
    x[..., 7, :] = x[..., 7, :] * 2.0**-128  # bf16 subnormals
    x[1, 0, 4, 2] = -0.0
    if specials:
        x[0, 1, 9, 3] = float("nan")
        x[0, 1, 11, 5] = float("inf")
        x[0, 1, 12, 6] = -float("inf")
    return x.bfloat16()


def _slow(x, recipe, field, groups, key, rows):
    """`_operand`'s slow path for the same call (the same scope, view and uniforms)."""
    spec = getattr(recipe, field)
    scope = backend._Scope.of(x, recipe, groups, rows)
    noise = backend._noise(x, recipe, field, key)
    if noise is not None:
        noise = scope.view(noise)
    where = dict(axis=recipe.block_axis(field), batch_dims=scope.batch_dims)
    return backend._quantized_operand(scope.view(x), spec, scope, noise, where, torch.float32)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    diff = got.view(bits) != want.view(bits)
    if diff.any():
        i = tuple(int(j) for j in diff.nonzero()[0])
        g, w = got[i].item(), want[i].item()
        gb, wb = int(got.view(bits)[i]), int(want.view(bits)[i])
        raise AssertionError(
            f"{what}: {int(diff.sum())} elements differ, first at {i}: fused {g!r} "
            f"(bits {gb & 0xFFFFFFFF:#010x}), slow path {w!r} (bits {wb & 0xFFFFFFFF:#010x})"
        )


@pytest.mark.parametrize("specials", [False, True], ids=["finite", "nan-inf"])
@pytest.mark.parametrize("recipe, field", FUSED)
def test_fused_operand_is_the_slow_paths_bits(recipe, field, specials):
    spec = getattr(recipe, field)
    heads, groups = (4, 2) if field in _QUERY_SIDE else (2, 1)  # GQA on the query side
    seed = len(recipe.name) * 8 + _FIELDS.index(field)
    x = spread((2, heads, 40, 64), seed, specials)
    key = pass_key(torch.Generator().manual_seed(5)) if spec.stochastic else None
    rows = 16 if recipe.tensor_scope is TensorScope.TILE else None
    store, factor = backend._operand(x, recipe, field, groups, key, rows)
    want_store, want_factor = _slow(x, recipe, field, groups, key, rows)
    if _new_pass(spec) == "factored_sr":  # bf16 values widened: NaN's payload is bf16's
        _same_nan(store, want_store, f"{recipe.name}.{field} store")
    else:
        _assert_same_bits(store, want_store, f"{recipe.name}.{field} store")
    _assert_same_bits(factor, want_factor, f"{recipe.name}.{field} factor")
    if not specials:  # the comparison saw values, not only zeros (per-tensor FP8 flushes many)
        assert torch.isfinite(store).all() and (store != 0).float().mean() > 0.05


def _same_nan(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit, but NaN for NaN: a NaN's payload is not kept on the CPU (torch's NaN in
    bf16 is 0x7FC0 scalar, 0xFFFF vectorized; the factored pass widens bf16 NaN); on the GPU
    the store is bf16 and both paths' casts are the same conversion instruction."""
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"{what}: NaN elsewhere"
    _assert_same_bits(torch.where(nan, 0.0, got), torch.where(nan, 0.0, want), what)


@pytest.mark.parametrize(
    "recipe, field",
    [p for p in FUSED if _new_pass(getattr(*p.values)) in ("codes", "power")],
)
def test_bf16_store_is_torchs_rounding_of_the_slow_paths_product(recipe, field):
    # the GPU's store dtype: the kernel's one rounding into bf16 against torch's
    spec = getattr(recipe, field)
    x = spread((2, 2, 40, 64), seed=3)
    noise = None
    if spec.stochastic:
        noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    where = dict(axis=recipe.block_axis(field), batch_dims=2)
    stored = K.StoredScale.POWER if spec.scale_rule.alpha_grid else K.StoredScale.ONE
    got, _ = K.fake_quantize_stored(x, spec, stored, noise=noise, out_dtype=torch.bfloat16,
                                    **where)
    qt = K.quantize(x, spec, noise=noise, **where)
    codes, scales = qt.element_values(), qt.expanded_scales()
    multiplier = torch.ones_like(scales)
    if stored is K.StoredScale.POWER:
        power = torch.exp2(torch.round(torch.log2(scales * spec.element.max)))
        multiplier = torch.where(scales > 0, power, 0.0)
    _same_nan(got, (codes * multiplier).bfloat16(), f"{spec.name} bf16 store")


ALPHA_SPECS = sorted(
    {getattr(r, f) for r in PRESETS for f in _FIELDS if _new_pass(getattr(r, f)) == "power"},
    key=lambda s: s.name,
)


@pytest.mark.parametrize("spec", ALPHA_SPECS, ids=lambda s: s.name)
def test_every_alpha_exponent_comes_back_from_the_slow_paths_log2(spec):
    # `_power_pass`'s argument on every E the quantizer gives: torch's
    # exp2(round(log2(fl(2^E / M_e) M_e))) is 2^E
    lo, hi = backend._alpha_exponents(spec)
    powers = torch.exp2(torch.arange(lo, hi + 1, dtype=torch.float64)).float()
    s = powers / torch.tensor(spec.element.max, dtype=torch.float32)
    back = torch.exp2(torch.round(torch.log2(s * spec.element.max)))
    assert (s > 0).all() and torch.equal(back, powers)


# -- refusals where the argument fails ----------------------------------------------------------
WIDE = FloatFormat(name="e5m1_test", ebits=5, mbits=1, bias=8)  # M_e = 1.5 * 2^23


def test_power_pass_refuses_an_alpha_grid_whose_scale_underflows():
    # fl(2^-126 / M_e) = 2^-149 (0.67 of it rounded up) for M_e = 1.5 * 2^23, so the slow
    # path's log2(s M_e) = -125.4 rounds to -125 where the kernel's E is -126: the predicate
    # must refuse, and the two must differ
    spec = QuantSpec(name="alpha_wide", element=WIDE, scale=F.UE8M0, block=(32,),
                     scale_rule=ScaleRule.ALPHA_MSE)
    assert not backend._power_pass(spec)
    x = torch.full((1, 1, 1, 32), 2.0**-126)
    recipe = dataclasses.replace(backend.resolve_recipe("exact"), name="t", v=None)
    scope = backend._Scope.of(x, recipe, 1, None)
    slow, _ = backend._quantized_operand(x, spec, scope, None, dict(axis=-1, batch_dims=0),
                                         torch.float32)
    fused, _ = K.fake_quantize_stored(x, spec, K.StoredScale.POWER)
    assert torch.equal(slow, 2.0 * fused) and torch.all(fused != 0)
    assert backend._power_pass(dataclasses.replace(spec, element=F.FP4_E2M1))


def test_codes_pass_refuses_what_the_slow_path_does_not_keep_as_one_scale():
    e4m3 = F.get("fp8_e4m3_tensor")
    assert backend._codes_pass(e4m3)
    blocks = QuantSpec(name="fp32_blocks", element=F.FP8_E4M3FN, scale=F.FP32, block=(16,),
                       scale_rule=ScaleRule.NEAREST)  # a scale per block: not a factor
    two_level = QuantSpec(name="two_level", element=F.FP8_E5M2, scale=F.UE4M3, block=None,
                          scale_rule=ScaleRule.NEAREST, tensor_scale=True)
    unencodable = dataclasses.replace(e4m3, name="fp32_codes", element=F.FP32)
    for spec in (blocks, two_level, unencodable, F.get("mxfp4"), F.get("nvfp4_ms_eden")):
        assert not backend._codes_pass(spec), spec.name
    with pytest.raises(ValueError, match="do not encode"):
        K.fake_quantize_stored(torch.ones(4, 32), unencodable, K.StoredScale.ONE)


def test_factored_pass_refuses_stochastic_products_bf16_cannot_hold():
    # E3M4 elements (5 significant bits) times E4M3 scales (4): 9 bits, beyond bf16's 8, so
    # values rounded into bf16 are not the slow path's float32 products
    e3m4 = FloatFormat(name="e3m4_test", ebits=3, mbits=4, bias=3)
    spec = QuantSpec(name="e3m4_sr", element=e3m4, scale=F.UE4M3, block=(16,),
                     scale_rule=ScaleRule.NEAREST, tensor_scale=True,
                     rounding=Rounding.STOCHASTIC)
    assert not backend._factored_pass(spec)
    assert backend._factored_pass(F.get("nvfp4_sr"))
    x = spread((2, 2, 40, 64), seed=4, specials=False)[:1, :1, 8:]
    noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    values, _ = K.fake_quantize_factored(x, spec, noise=noise)
    qt = K.quantize(x, spec, noise=noise)
    assert not torch.equal(values.float(), qt.element_values() * qt.expanded_scales())


def test_fake_quantize_stored_refuses_what_it_does_not_write():
    x = torch.ones(4, 32)
    with pytest.raises(ValueError, match="alpha grid for StoredScale.POWER"):
        K.fake_quantize_stored(x, F.get("mxfp4"), K.StoredScale.POWER)
    with pytest.raises(ValueError, match="without a tensor scale"):
        K.fake_quantize_stored(x, F.get("nvfp4"), K.StoredScale.ONE)
    with pytest.raises(TypeError, match="out_dtype"):
        K.fake_quantize_stored(x, F.get("fp8_e4m3_tensor"), K.StoredScale.ONE,
                               out_dtype=torch.float16)
    assert math.isfinite(float(K.fake_quantize_stored(x, "fp8_e4m3_tensor", K.StoredScale.ONE)[1]))


@pytest.mark.parametrize("shape", [(2, 3, 130, 64), (1, 1, 64, 128), (1, 2, 7, 33), (4, 0, 8)])
def test_key_major_moves_the_bits_only(shape):
    # any byte, NaN patterns of float8 included, lands where torch's transposing copy puts it;
    # ragged tiles on both axes, an empty tensor
    from fp4lab.kernels.layout import key_major

    g = torch.Generator().manual_seed(len(shape))
    bits = torch.randint(-128, 128, shape, dtype=torch.int8, generator=g).to(DEVICE)
    x = bits.view(torch.float8_e4m3fn)
    got = key_major(x)
    want = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert got.shape == x.shape
    assert got.numel() == 0 or got.stride() == want.stride()  # (an empty tensor's are torch's)
    assert torch.equal(got.view(torch.int8), want.view(torch.int8))


def test_key_major_refuses_what_it_cannot_copy():
    from fp4lab.kernels.layout import key_major

    with pytest.raises(ValueError, match="one-byte elements"):
        key_major(torch.zeros(4, 4, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous: False"):
        key_major(torch.zeros(4, 4, dtype=torch.int8, device=DEVICE).t())


@pytest.mark.parametrize("b, h, groups", [(2, 8, 1), (2, 8, 4), (1, 6, 3), (3, 4, 4)])
def test_per_group_factors_repeat_for_their_heads(b, h, groups):
    """`_per_head`: a per-(batch, KV head) scale as one value per (batch, query head), query
    head = KV head * groups + g, as repeat_interleave would lay it out, contiguous (the
    kernels read the factors as a flat (B, H) table); a single scale broadcast."""
    scale = torch.randn(b, h // groups, generator=torch.Generator().manual_seed(b + h))
    out = backend._per_head(scale, b, h, groups)
    assert out.shape == (b, h) and out.is_contiguous()
    assert torch.equal(out, scale.repeat_interleave(groups, dim=1))
    one = backend._per_head(torch.tensor([2.5]), b, h, groups)
    assert one.shape == (b, h) and bool((one == 2.5).all())


@pytest.mark.parametrize("recipe", ["fa4fp4_causal", "fa4fp4_causal_mxfp4pv", "nvfp4", "mxfp4"])
def test_shared_factors_hold_their_value_after_a_forward_and_backward(monkeypatch, recipe):
    """The factors made once and shared between calls (`backend._filled`: ones, fixed scales,
    1/M_e) are only read: after a forward and backward that took them, each still holds its
    value."""
    import fp4lab

    handed_out = []
    made = backend._filled

    def recording(shape, value, device):
        t = made(shape, value, device)
        handed_out.append((t, value))
        return t

    monkeypatch.setattr(backend, "_filled", recording)
    if DEVICE == "cuda":  # the compiled kernels: this file's fixture asks for the interpreter,
        monkeypatch.delenv("TRITON_INTERPRET")  # which the attention kernels do not run in there
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 64, 64, generator=gen).bfloat16().to(DEVICE)
                   for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    for _ in range(2):
        fp4lab.attention(q, k, v, recipe, backend="triton", causal=True, block_m=32,
                         block_n=32).backward(do)
    assert handed_out
    for t, value in handed_out:
        assert torch.equal(t, torch.full_like(t, value)), (tuple(t.shape), value)
