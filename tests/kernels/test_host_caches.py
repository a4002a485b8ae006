"""What the host keeps between calls of `fp4lab.attention(..., backend="triton")` so that a call
runs less Python (`backend._memo`, `flash._forward_constants`, `flash._split`, the launch's
static key, the uniform recipe of a format's name): a call served from them gives the bits of
one that made them, and anything they were made from that changes (a recipe, a format, a
tile, a shape, a flag) makes a new entry instead of reusing one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

import fp4lab  # noqa: E402
from fp4lab.formats import registry  # noqa: E402
from fp4lab.kernels import backend, flash, launch  # noqa: E402
from fp4lab.recipes import resolve_recipe  # noqa: E402

from .helpers import DEVICE, inputs, run  # noqa: E402


@pytest.mark.parametrize("recipe", ["fa4fp4_causal", "fa3_fp8", "nvfp4"])
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
def test_a_call_served_from_the_caches_is_the_call_that_made_them_bit_for_bit(recipe, causal):
    q, k, v, do = inputs(1, 2, 2, 64, 64, 32, seed=11)
    tiles = dict(block_m=32, block_n=32, causal=causal)
    backend.clear_caches()
    cold = run(q, k, v, do, recipe, **tiles)
    warm = run(q, k, v, do, recipe, **tiles)
    assert backend._MEMO and flash._forward_constants.cache_info().currsize
    for name in cold:
        assert torch.equal(cold[name], warm[name]), name


def test_a_changed_recipe_or_format_makes_its_own_entries():
    recipe = resolve_recipe("fa4fp4_causal")
    other = dataclasses.replace(recipe, name="fa4fp4_causal_nvfp4_v", v=resolve_recipe("nvfp4").v)
    assert other == dataclasses.replace(other)  # a copy equal by value is another object
    route = backend._memo("route", recipe, "v", lambda: backend._operand_route(recipe, "v"))
    again = backend._memo("route", other, "v", lambda: backend._operand_route(other, "v"))
    assert route[0] is recipe.v and again[0] is other.v and route[1] != again[1]
    assert backend.p_quantizer(recipe) is backend.p_quantizer(recipe)
    nvfp4_p = dataclasses.replace(recipe, name="nvfp4_p", p=resolve_recipe("nvfp4").p)
    assert backend.p_quantizer(nvfp4_p) != backend.p_quantizer(recipe)
    # an equal copy is made anew (keyed by identity), to the same value
    copy = dataclasses.replace(recipe)
    assert backend.p_quantizer(copy) == backend.p_quantizer(recipe)
    assert backend.backward_quantizers(copy) == backend.backward_quantizers(recipe)


def test_the_memo_keeps_what_it_was_made_from_so_an_id_is_never_reused():
    made = []
    for i in range(3):
        spec = dataclasses.replace(resolve_recipe("nvfp4"), name=f"throwaway_{i}")
        made.append(backend._memo("test", spec, None, lambda spec=spec: spec.name))
        del spec  # the entry holds it: its id cannot come back for another recipe
    assert made == ["throwaway_0", "throwaway_1", "throwaway_2"]


def test_a_format_name_gives_one_recipe_until_it_is_registered_anew(monkeypatch):
    first, second = backend._resolved("nvfp4"), backend._resolved("nvfp4")
    assert first is second and first == resolve_recipe("nvfp4")
    spec = dataclasses.replace(registry.get("nvfp4"), name="host_cache_fmt")
    monkeypatch.setitem(registry._REGISTRY, "host_cache_fmt", spec)
    one = backend._resolved("host_cache_fmt")
    assert one is backend._resolved("host_cache_fmt") and one.q is spec
    replaced = dataclasses.replace(spec, name="host_cache_fmt", block=(32,))
    monkeypatch.setitem(registry._REGISTRY, "host_cache_fmt", replaced)
    assert backend._resolved("host_cache_fmt").q is replaced
    with pytest.raises(ValueError, match="unknown name"):
        backend._resolved("no_such_recipe_or_format")


def test_checks_are_kept_only_when_they_pass_and_per_tiles_and_extents():
    q, k, v = inputs(1, 1, 1, 64, 64, 32, seed=3)[:3]
    recipe = resolve_recipe("fa3_fp8_paper")  # 2-D tiles of 128 rows: kernel tiles must fit
    fp4lab.attention(q, k, v, recipe, backend="triton", block_m=64, block_n=64)
    for _ in range(2):  # refused every time, never remembered as checked
        with pytest.raises(NotImplementedError, match="whole number of kernel tiles"):
            fp4lab.attention(q, k, v, recipe, backend="triton", block_m=64, block_n=48)


def test_the_forward_constants_change_with_every_flag_and_keep_types_apart():
    pq = backend.p_quantizer(resolve_recipe("fa4fp4_causal"))
    base = dict(D=32, Dv=32, block_m=32, block_n=32, causal=False, reverse=False,
                lazy_log2=None, row_sum_quantized=False, pv_fp8=False, pq=pq,
                reference="running", anchor_keys=0, leakage_block=0, lse_log2=True,
                prime=False, save_m=False, smooth_q=False, tile_scope=False,
                leakage_parts="p_and_v", traced=False, accumulate=(("ACC_DOT", True),),
                fused=(("Z_FMA", True),), num_warps=4, num_stages=3)  # fmt: skip
    one = flash._forward_constants(**base)
    assert flash._forward_constants(**base) is one
    changes = dict(causal=True, reverse=True, lazy_log2=2.0, row_sum_quantized=True,
                   pv_fp8=True, pq=backend.p_quantizer(resolve_recipe("nvfp4")),
                   reference="zero", leakage_block=16, lse_log2=False, prime=True, save_m=True,
                   smooth_q=True, tile_scope=True, traced=True, accumulate=(), fused=(),
                   num_warps=8, num_stages=2, D=64, block_n=64)  # fmt: skip
    for name, value in changes.items():
        other = flash._forward_constants(**{**base, name: value})
        assert other != one, name
    as_int = flash._forward_constants(**{**base, "causal": 0})
    assert as_int is not flash._forward_constants(**base)  # typed: 0 is not False


def test_launch_fitting_reads_each_constants_object_once_and_by_identity():
    class Kernel:
        fn = type("fn", (), {"__name__": "stand_in"})

    kernel, constants = Kernel(), dict(BLOCK=16, num_warps=4, num_stages=3)
    key, params, options = flash._split(kernel, constants)
    assert params == dict(BLOCK=16) and options == dict(num_warps=4, num_stages=3)
    assert key[2] == launch.static_key(params, options)
    again = flash._split(kernel, constants)
    assert again[0] is key and again[1] is params and again[2] is not options  # a fresh dict
    equal = dict(constants)
    assert flash._split(kernel, equal)[1] is not params  # another object: read anew
    assert flash._split(Kernel(), constants)[1] is not params  # another kernel too


def test_the_static_key_is_the_one_launch_builds():
    calls = []

    class Kernel:
        params = []

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(kwargs)

    kernel, x = Kernel(), torch.zeros(4)
    constants, options = dict(BLOCK=16), dict(num_warps=4)
    launch.launch(kernel, (1,), (x, 3), constants, options)
    launch.launch(kernel, (1,), (x, 3), constants, options,
                  static=launch.static_key(constants, options))
    assert calls == [dict(BLOCK=16, num_warps=4)] * 2  # no compiled kernel: through jit twice


def test_the_deterministic_key_table_is_the_general_ones():
    table, per = flash.sr_key_table((None, None, None), (False, False, False), ("a", "b", "c"),
                                    6, "cpu")  # fmt: skip
    assert per == 6 and torch.equal(table, torch.zeros(1, 3, 2, dtype=torch.int32))
    stacked, per = flash.sr_key_table(((1, 2), None), (False, False), ("a", "b"), 6, "cpu")
    assert per == 3 and stacked.shape == (2, 2, 2) and not stacked.any()  # not the fast path
    with pytest.raises(ValueError, match="needs its stream"):
        flash.sr_key_table((None,), (True,), ("a",), 2, "cpu")


# -- the first passes' one buffer ---------------------------------------------------------------
@pytest.mark.parametrize("name", ["nvfp4", "fp8_e4m3_tensor", "mxfp4", "fp8_e4m3_x4"])
@pytest.mark.parametrize("batch_dims", [0, 2])
def test_first_pass_elements_is_what_the_quantizer_would_make(name, batch_dims):
    from fp4lab.kernels import quantize

    x = torch.randn(2, 3, 1, 40, 32).to(DEVICE, torch.bfloat16)
    spec = registry.get(name)
    n = quantize.first_pass_elements(x.shape, spec, axis=-1, batch_dims=batch_dims)
    req = quantize._request(x, spec, -1, None, batch_dims, None, None, 0, None,
                            quantize.FAKE_QUANTIZE_CONFIG)  # fmt: skip
    plan = quantize._blocks_plan(x, req, torch.float32, (True, False, False, True, False, 1))
    assert n == plan.amax_layout[2]
    assert (n > 0) == (plan.amax_constants is not None)


@pytest.mark.parametrize("name", ["nvfp4", "fp8_e4m3_tensor"])
def test_a_slice_of_a_shared_buffer_gives_the_bits_of_a_buffer_of_its_own(name):
    from fp4lab.kernels import quantize

    spec = registry.get(name)
    x = (torch.randn(2, 3, 40, 32) * 7).to(DEVICE, torch.bfloat16)
    n = quantize.first_pass_elements(x.shape, spec, batch_dims=2)
    shared = torch.zeros(32 + n + 5, dtype=torch.int32, device=DEVICE)
    if spec.tensor_scale:
        run = lambda **kw: quantize.fake_quantize_factored(x, spec, batch_dims=2, **kw)  # noqa: E731
    else:
        run = lambda **kw: quantize.fake_quantize_stored(  # noqa: E731
            x, spec, quantize.StoredScale.ONE, batch_dims=2, out_dtype=torch.bfloat16, **kw)
    own, cut = run(), run(amax=shared[32:32 + n])
    for a, b in zip(own, cut, strict=True):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    with pytest.raises(ValueError, match="first pass needs"):
        run(amax=torch.zeros(n - 1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="int32"):
        run(amax=torch.zeros(n, dtype=torch.int64, device=DEVICE))


@pytest.mark.parametrize("recipe", ["nvfp4", "fa3_fp8", "fa4fp4_causal", "attn_qat_kernel"])
def test_operands_sharing_one_first_pass_buffer_are_each_quantized_alone(recipe):
    recipe = resolve_recipe(recipe)
    q, k, v = inputs(2, 4, 2, 72, 72, 32, seed=9)[:3]
    shared = backend.quantize_operands(q, k, v, recipe, tiles=(32, 32))
    g = q.shape[1] // k.shape[1]
    alone = [backend._operand(x, recipe, f, groups, None, rows)
             for x, f, groups, rows in ((q, "q", g, 32), (k, "k", 1, 32), (v, "v", 1, 32))]
    for (store, factor), got_store, got_factor, f in zip(alone, shared[:3], shared[3], "qkv",
                                                         strict=True):  # fmt: skip
        assert torch.equal(store, got_store), f
        if factor.ndim < got_factor.ndim:  # per head, spread over the tiles of a per-tile one
            factor = factor[:, :, None].expand_as(got_factor)
        assert torch.equal(factor, got_factor), f
    slices, total = backend._memo(
        "first passes", recipe,
        (("q", tuple(q.shape), g, 32), ("k", tuple(k.shape), 1, 32), ("v", tuple(v.shape), 1, 32)),
        lambda: None)  # fmt: skip
    assert all(s.start % 32 == 0 for s in slices.values()) and total % 32 == 0


def test_a_patched_accumulation_choice_is_heard_after_the_constants_were_made(monkeypatch):
    # benchmarks/bench_fwd_launch.py's "noacc" variant patches `_accumulate_in_dot` after
    # "base" ran the same configuration: the forward's constants must follow it
    seen = []
    launch_fitting = flash.launch_fitting

    def recording(kernel, grid, args, constants):
        seen.append("ACC_UNITS" in constants)
        return launch_fitting(kernel, grid, args, constants)

    monkeypatch.setattr(flash, "launch_fitting", recording)
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=4)[:3]
    fp4lab.attention(q, k, v, "nvfp4", backend="triton", block_m=32, block_n=32)
    monkeypatch.setattr(flash, "_accumulate_in_dot", lambda *args: {})
    fp4lab.attention(q, k, v, "nvfp4", backend="triton", block_m=32, block_n=32)
    assert seen == [True, False]


def test_launch_fitting_keys_every_depth_it_tries_as_launch_would(monkeypatch):
    # the H200 takes the forward's and the backward's 128 x 128 tiles one stage below the
    # asked depth on every call: the key at the depth that fits must be launch's own
    import triton

    tried = []

    def recording(kernel, grid, args, constants, options, static=None):
        tried.append(options["num_stages"])
        assert static == launch.static_key(constants, options)
        if options["num_stages"] > 1:
            raise triton.runtime.errors.OutOfResources(1, 0, "shared memory")

    class Kernel:
        fn = type("fn", (), {"__name__": "stand_in_fitting"})

    monkeypatch.setattr(flash, "launch", recording)
    monkeypatch.setattr(flash, "_STAGES", {})
    constants = dict(BLOCK=16, BLOCK_M=16, BLOCK_N=16, HEAD_DIM=16, num_warps=4, num_stages=3)
    kernel = Kernel()
    flash.launch_fitting(kernel, (1,), (), constants)
    flash.launch_fitting(kernel, (1,), (), constants)  # the depth that fit, remembered
    assert tried == [3, 2, 1, 1]
