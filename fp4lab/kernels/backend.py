"""`fp4lab.attention(..., backend="triton")`: a recipe's attention on the fused kernels.

The operands Q, K, V are quantized as whole tensors exactly as the simulation path quantizes
them, along each operand's block axis with the recipe's tensor scope, by the fused Triton
quantizer (`fp4lab.kernels.quantize.quantize`, bit for bit `fp4lab.formats.quantize`), and
handed to the kernel as bf16 values that are exact (codes times block scales)
plus fp32 factors per (batch, head) for what bf16 cannot hold (tensor scales, the 1/M_e of an
alpha grid); with tensor_scope=tile (Attn-QAT's kernel) one factor per tile instead, Q's per
query tile and K's and V's per key tile of the kernel's tiling, each tile's tensor scale taken
over its rows of one (batch, head), the last tile's padding rows counting as zeros, as the
simulation cuts it. P is quantized inside the kernel (`fp4lab.kernels.flash`).

SageAttention3's smooth_q splits Q on the host, as the simulation does: Q - M (M each query
tile's mean, in fp32) is the operand quantized, and the mean's scores M K^T against the
unquantized (smoothed) K, one fp32 per (query tile, key) per head (`mean_scores`: block_m
times smaller than the scores, as the released kernel's ``delta_s``), are added to each
tile's scores in the kernels; the backward rebuilds its scores the same way where it takes
the forward's Q^ (backward_p=quantized_qk), and a dK on the forward's Q^ (straight through,
forward_exact) takes (Q - M)^ + M, as the simulation's.

Incoherent processing (FlashAttention-3's paper, `fa3_fp8_paper`) rotates Q and K on the host
by the simulation's own transform (`fp4lab.recipes.transforms.incoherent_qk`, bit for bit) as
torch ops outside the autograd Function, so the gradients go through the rotation as the
simulation's do. A format of 2-D tiles with one FP32 scale each and codes exact in bf16
(`fp8_e4m3_tile128`: E4M3 per 128 rows by the whole head_dim) is stored as its codes with
each kernel tile's scale as a per-tile factor (the kernels' TILE_SCOPE), which holds where a
2-D tile spans the whole head_dim and a whole number of kernel tiles (`tile_geometry_gap`).

The backward (`fp4lab.kernels.flash_bwd`, through the autograd Function here) quantizes its
whole-tensor operands the same way, as the recipe's backward fields say (dO for dV and for
dP, V, K and Q for dP, dQ and dK; or the forward's Q^, K^, V^ for the straight-through and
forward_exact backwards), and P and dS inside its kernels. K smoothing runs outside the
Function, as in the simulation, so K's gradient takes the mean's Jacobian in torch. A call
whose inputs require grad is checked for the backward too, before the forward runs.

Stochastic rounding draws what the simulation draws (`fp4lab.formats.streams`): the forward
takes one pass key from the call's generator and the backward another after it; a
whole-tensor operand rounds with its stream's uniforms at every element's position, handed
to the fused quantizer as `noise` (so its codes and scales are the simulation's bit for bit),
and P and dS round in the kernels with the same streams' words made in registers. A list of
generators runs samples stacked along the batch, each drawing as a call on it alone
(`gradient_bias` batches so).

`trace=Trace()` runs the forward kernel compiled with its TRACE flag and fills the trace with
the simulation's schema (`fp4lab.kernels.trace`: which columns come from the kernel, which
from the host, which are not written); uninstrumented calls compile the kernel without it.

What the kernels do not cover yet raises `NotImplementedError` naming it, before anything
runs: a trace with an explicit reference_dtype, masks other than causal, inputs other than
bf16/fp16, dropout, the recipe mechanisms `fp4lab.kernels.flash` lists, 2-D tiles that do not
line up with the kernel's tiles (narrower than head_dim, or splitting a kernel tile), smooth_q
on an unquantized Q (or a cast wider than bf16: Q - M is fp32), and the backward's
(`check_backward`: tensor_scope=tile with backward=flash, 2-D blocks on its operands,
Hadamard transforms that do not pair up (`_rotation_gaps`), two-level P replayed in dV
(forward_exact), fixed scales or other block formats on P and dS than the kernel
quantizes). attn_qat_kernel's straight-through backward runs: its per-tile factors (dO's
per query tile too) and two-level P in dV.
Nothing falls back to the reference.

Hadamard transforms in the backward (MS-EDEN, `croissattn_eden`). A product A B reducing over
r, both operands rotated along r in groups of n, is (A H)(H^T B): the kernels multiply the
rotated operands as quantized, (A H)^ (H^T B)^, where the simulation dequantizes each back
(A^ = (A H)^ H^T) and multiplies those, the same product up to fp32 rounding (H is orthogonal,
its 1/sqrt(n) in each factor). So a whole-tensor operand with a transform is stored as its
rotated codes times block scales (the fused quantizer's, bit for bit), its tensor scale the
factor, and P and dS are rotated in registers before their quantizer
(`fp4lab.kernels.flash_bwd`). This holds where both operands of each backward product carry
the same transform (size and seed) along its reduction axis and nothing else reads a
rotated operand (`_rotation_gaps`: D from dO^, dS from P^), with whole groups along every
rotated axis: the tiles (`flash_bwd.check_tiles`), head_dim and the sequences
(`check_rotated_extents`).
"""

from __future__ import annotations

import enum
import functools
import math
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from fp4lab.formats import BF16, FP8_E4M3FN, FP16, FP32, FloatFormat, QuantSpec, round_to_format
from fp4lab.formats.spec import Correction
from fp4lab.formats.streams import as_generators, pass_key, stream_keys, tensor_uniforms
from fp4lab.recipes import (
    AttentionRecipe,
    BackwardMode,
    BackwardP,
    BackwardV,
    DeltaSource,
    DsP,
    KVOrder,
    LeakageParts,
    PQuant,
    Product,
    RowReference,
    RowSum,
    Seq,
    SmoothK,
    TensorScope,
    operand,
    resolve_recipe,
)
from fp4lab.recipes.checks import check_tiling
from fp4lab.recipes.operands import Extent

__all__ = ["attention", "check_recipe"]


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel_device(x: torch.Tensor) -> bool:
    """Whether the kernels take x where it is (`fp4lab.kernels.quantize._kernel_device`)."""
    from fp4lab.kernels.quantize import _kernel_device as takes

    return takes(x)


def _store_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the kernel reads operands in: bf16 on the GPU (exact for the quantized
    values); fp32 under the interpreter, whose bf16 dot product is wrong (Triton 3.9)."""
    return torch.float32 if _interpreted() else torch.bfloat16


def _ones(shape: tuple, device: torch.device) -> torch.Tensor:
    """The factor of an operand whose values need none (`_filled` with 1)."""
    return _filled(shape, 1.0, device)


def _filled(shape: tuple, value: float, device: torch.device) -> torch.Tensor:
    """A float32 tensor of `value` (an operand's factor), made once per shape, value and device
    (each `torch.ones` is an allocation and a fill kernel: three a call, about 50 us each on
    the H200's host under cProfile, session 26). Shared between calls: kernels and the
    factors' products only read it, and nothing writes it in place. While a CUDA graph is
    being captured a fresh one is made each call (one made there would live in the graph's
    memory and be filled only when the graph replays)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.full(shape, value, dtype=torch.float32, device=device)
    return _filled_once(shape, value, device)


@functools.lru_cache(maxsize=64)
def _filled_once(shape: tuple, value: float, device: torch.device) -> torch.Tensor:
    """`_filled`'s shared tensor, its fill waited for once, so that a call on any stream
    reads it filled."""
    t = torch.full(shape, value, dtype=torch.float32, device=device)
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return t


_MEMO: dict = {}  # (what, id(obj), extra) -> (obj, value): `_memo`'s
_MAX_MEMO = 1024


def _memo(what: str, obj, extra, make):
    """`make()`, a pure function of the frozen `obj` (a recipe or a format) and the hashable
    `extra`, made once and kept while `obj` lives: keyed by obj's identity (hashing a recipe
    by value costs some 180 Python calls), the entry holding obj so its id is not reused, the
    whole table dropped at `_MAX_MEMO` entries. What raises is not kept. `clear_caches`
    empties it."""
    key = (what, id(obj), extra)
    entry = _MEMO.get(key)
    if entry is not None and entry[0] is obj:
        return entry[1]
    value = make()
    if len(_MEMO) >= _MAX_MEMO:
        _MEMO.clear()
    _MEMO[key] = (obj, value)
    return value


def clear_caches() -> None:
    """Empty what the host keeps per recipe, format and call signature (`_memo`; the forward's
    constants, `flash._forward_constants`; the launches' compiled kernels,
    `fp4lab.kernels.launch`): for a test or a benchmark that patches a function those were
    made by. Nothing else needs it; every entry is keyed by what it was made from."""
    from fp4lab.kernels import flash, launch

    _MEMO.clear()
    flash._forward_constants.cache_clear()
    flash._SPLITS.clear()
    launch._COMPILED.clear()


def check_recipe(recipe: AttentionRecipe) -> None:
    """Raise NotImplementedError for a recipe mechanism the kernels do not run yet."""
    from fp4lab.kernels.flash import check_direct_p, check_p

    missing = []
    if recipe.smooth_q and not _bf16_exact(recipe.q):
        missing.append(
            f"smooth_q with q={getattr(recipe.q, 'name', None)} (Q minus its tile means is "
            "fp32, which the kernel would read rounded to bf16; smooth_q needs a q format)"
        )
    if recipe.block_axis("p") != -1:
        missing.append("p blocked along the queries (block_axes; the kernel blocks P along keys)")
    parts = recipe.leakage_fix_parts  # not P_AND_V only with leakage_fix (the recipe checks)
    if parts is LeakageParts.V:
        missing.append("leakage_fix_parts='v' (V's half of the fix runs on the simulation only)")
    if parts is LeakageParts.P and recipe.p_quant is not PQuant.DIRECT:
        missing.append(
            f"leakage_fix_parts='p' with p_quant={recipe.p_quant.value} (the kernels run P's "
            "half of the fix on Direct-P only)"
        )
    missing += _untransformed_gaps(recipe, ("q", "k", "v"), tiles_2d=True)
    if missing:
        raise NotImplementedError(
            f"recipe {recipe.name!r}: the Triton kernels do not run {', '.join(missing)} yet; "
            "use backend='reference' (no silent fallback)"
        )
    if recipe.p_quant is PQuant.DIRECT:
        check_direct_p(recipe.p)
    else:
        check_p(recipe.p, recipe.p_lift)


def _bf16_exact(spec) -> bool:
    """Whether a whole-tensor operand's stored values are bf16-exact whatever its input (fp32
    Q - mean included): a block format's codes times scales, a cast of at most bf16's bits."""
    if isinstance(spec, FloatFormat):
        return spec.mbits <= 7 and spec.emin - spec.mbits >= -133 and spec.emax <= 127
    return spec is not None


def _untransformed_gaps(
    recipe: AttentionRecipe, fields, tiles_2d: bool = False, rotations: bool = False
) -> list[str]:
    """The whole-tensor operands among `fields` in a block format the kernels' quantizer path
    does not take (a Hadamard transform or 2-D blocks; with `tiles_2d` the forward's 2-D
    tiles with one FP32 scale each, `_tile_factored`, are taken; with `rotations` a Hadamard
    transform, whose pairing the caller checks, `_rotation_gaps`), each named."""
    missing = []
    for field in fields:
        spec = getattr(recipe, field)
        if not isinstance(spec, QuantSpec):
            continue
        two_d = spec.block is not None and len(spec.block) == 2
        if spec.hadamard and not rotations:
            missing.append(f"{field} in {spec.name} (Hadamard or 2-D blocks)")
        elif two_d and not (tiles_2d and _tile_factored(spec)):
            missing.append(f"{field} in {spec.name} (Hadamard or 2-D blocks)")
    return missing


def _rotation(recipe: AttentionRecipe, field: str):
    """Operand `field`'s Hadamard transform as (size, seed), or None."""
    spec = getattr(recipe, field)
    if not isinstance(spec, QuantSpec) or spec.hadamard is None:
        return None
    return spec.hadamard, spec.hadamard_seed


def _rotation_gaps(recipe: AttentionRecipe) -> list[str]:
    """What keeps the backward's Hadamard transforms from running, each named. The kernels
    multiply each product's operands as rotated, (A H)^ (H^T B)^, which is the simulation's
    A^ B^ (each dequantized back, A^ = (A H)^ H^T) only where both operands of the product are
    rotated by the same matrix along its reduction axis, and nothing else reads them."""
    missing = []
    for product in Product:
        if not product.backward:
            continue
        a, b = product.fields
        ra, rb = _rotation(recipe, a), _rotation(recipe, b)
        if ra is None and rb is None:
            continue
        if recipe.backward is not BackwardMode.FLASH:
            missing.append(f"a Hadamard transform on {a}/{b} with backward="
                           f"{recipe.backward.value} (the forward's operands are not rotated)")
            continue
        if ra != rb:
            missing.append(f"{a} and {b} with different Hadamard transforms ((size, seed) {ra} "
                           f"and {rb}; {product.value} needs both rotated by one matrix)")
        for f in (a, b):
            if _rotation(recipe, f) is not None and recipe.block_axis(f) != operand(f).axis:
                missing.append(f"{f} rotated along another axis than {product.value}'s "
                               "reduction axis (block_axes)")
    if _rotation(recipe, "dv_p") is not None and recipe.ds_p is DsP.DV_OPERAND:
        missing.append("ds_p=dv_operand with dv_p rotated (dS would take the rotated P^)")
    if _rotation(recipe, "dp_do") is not None and recipe.delta is DeltaSource.QUANTIZED_DO:
        missing.append("delta=quantized_do with dp_do rotated (D would take the rotated dO^)")
    return missing


def check_rotated_extents(recipe: AttentionRecipe, sq: int, sk: int, d: int, dv: int) -> None:
    """ValueError where a whole-tensor backward operand's Hadamard transform does not tile the
    extent it runs along (its product's reduction axis: the queries, the keys, head_dim)."""
    sizes = {Extent.HEAD_DIM: ("head_dim", d), Extent.V_DIM: ("v's head_dim", dv)}
    for field in _WHOLE_OPERANDS:
        rotation, op = _rotation(recipe, field), operand(field)
        if rotation is None:
            continue
        if op.along is Extent.SEQ:
            name, size = ("Sq (queries)", sq) if op.seq is Seq.QUERY else ("Sk (keys)", sk)
        else:
            name, size = sizes[op.along]
        if size % rotation[0]:
            raise ValueError(
                f"{name}={size} is not a multiple of {rotation[0]}, the Hadamard size of "
                f"operand {field!r} of recipe {recipe.name!r}: its transform runs in whole "
                "groups along the product's reduction axis"
            )


def _tile_factored(spec: QuantSpec) -> bool:
    """Whether `spec` has 2-D tiles with one FP32 scale each and codes exact in bf16 (FP8
    E4M3 per 128 x 256 tile, FlashAttention-3's paper): where a tile spans the whole head_dim
    and whole kernel tiles of rows (`tile_geometry_gap`), its scale is a per-tile factor."""
    if spec.block is None or len(spec.block) != 2 or spec.scale != FP32:
        return False
    if spec.tensor_scale or spec.hadamard or spec.stochastic or spec.scale_rule.alpha_grid:
        return False
    return _bf16_exact(spec.element)


def tile_geometry_gap(recipe: AttentionRecipe, field: str, rows: int, width: int) -> str | None:
    """What keeps operand `field`'s 2-D tiles from being per-tile factors of kernel tiles of
    `rows` rows (block_m for Q, block_n for K, V) over a head_dim of `width`, or None: each
    tile must span the whole head_dim and a whole number of kernel tiles along the sequence.
    A (r, c) tile is r sequence rows by c head columns for Q, K and V alike (the simulation
    lays 2-D tiles on the natural layout, `fp4lab.analysis.quantizers._block_quantize`)."""
    spec = getattr(recipe, field)
    along, across = spec.block
    if across < width or along % rows:
        return (
            f"{field} in {spec.name} with {along}-row tiles {across} wide over kernel tiles of "
            f"{rows} rows and head_dim {width} (a tile must span the whole head_dim and a "
            "whole number of kernel tiles)"
        )
    return None


def check_tile_scales(recipe: AttentionRecipe, block_m: int, block_n: int, d: int, dv: int):
    """Raise NotImplementedError naming the forward operands whose 2-D tile scales do not line
    up with the kernel's tiles (`tile_geometry_gap`)."""
    widths = dict(q=(block_m, d), k=(block_n, d), v=(block_n, dv))
    gaps = [
        tile_geometry_gap(recipe, f, *widths[f])
        for f in ("q", "k", "v")
        if isinstance(getattr(recipe, f), QuantSpec) and _tile_factored(getattr(recipe, f))
    ]
    gaps = [g for g in gaps if g is not None]
    if gaps:
        raise NotImplementedError(
            f"recipe {recipe.name!r}: the Triton kernels do not run {', '.join(gaps)} yet; "
            "use backend='reference' (no silent fallback)"
        )


def _check_call(q, k, v, trace, attn_mask) -> None:
    if trace is not None:
        from fp4lab.kernels.trace import check_trace

        check_trace(trace)
    if attn_mask is not None:
        raise NotImplementedError("attn_mask: the Triton kernels take only the causal mask yet")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dtype not in (torch.bfloat16, torch.float16):
            got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name}: the Triton backend runs bf16 or fp16 tensors, got {got}")
        if x.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, heads, seq, head_dim), got {tuple(x.shape)}"
            )
        if not _kernel_device(x):
            raise ValueError(
                f"{name} is on {x.device}: the Triton kernels run on a CUDA device "
                "(or under TRITON_INTERPRET=1); use backend='reference' elsewhere"
            )
    if q.shape[1] % k.shape[1] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"q, k, v shapes do not agree: {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )


def _noise(x: torch.Tensor, recipe: AttentionRecipe, field: str, key: int | None):
    """The uniforms whole-tensor operand `field` (x: (B, heads, S, E)) rounds stochastically
    with, as the simulation draws them (`fp4lab.formats.streams`, from the pass's key `key`);
    None for a format that draws nothing. On a GPU they come from one Triton kernel
    (`fp4lab.kernels.random.stream_uniforms`, bit for bit the torch reference's, which runs
    some 120 passes over int64 buffers of the whole tensor); elsewhere from torch."""
    spec = getattr(recipe, field)
    if not (isinstance(spec, QuantSpec) and spec.stochastic):
        return None
    if key is None:
        raise ValueError(
            f"key: operand {field!r} rounds stochastically ({spec.name}) and needs the pass's "
            "key (fp4lab.formats.streams.pass_key)"
        )
    keys = stream_keys(key, operand(field).stream)
    if x.device.type == "cuda":  # one Triton kernel, the same bits (`kernels.random`)
        from fp4lab.kernels.random import stream_uniforms

        return stream_uniforms(keys, x.shape, x.device)
    return tensor_uniforms(keys, x.shape, x.device)


def _operand(
    x: torch.Tensor, recipe: AttentionRecipe, field: str, groups: int, key=None, rows=None,
    amax=None,
):
    """(store, factor): the quantized operand as exact bf16 values and the fp32 factor they
    are multiplied by, one per (batch, head of x), or with tensor_scope=tile one per tile of
    `rows` rows of each (batch, head): (B, H, n tiles); a stochastic format rounds with the
    uniforms of its stream under the pass's key `key` (`_noise`), as the simulation does. The
    route through the fused passes is chosen once per recipe and field (`_operand_route`).
    `amax`: the quantizer's first-pass buffer (`_operands`), or None: it makes its own."""
    spec, route, axis, inverse = _memo("route", recipe, field, lambda: _operand_route(recipe,
                                                                                      field))
    scope = _Scope.of(x, recipe, groups, rows)
    store_dtype = _store_dtype(x)
    if route is _Route.PLAIN:
        return x.to(store_dtype).contiguous(), _ones(scope.factor_shape, x.device)
    if route is _Route.CAST:
        return (cast_to_format(x, spec).to(store_dtype).contiguous(),
                _ones(scope.factor_shape, x.device))  # fmt: skip
    if route is _Route.TILE:
        return _tile_operand(x, recipe, field, rows)
    from fp4lab.kernels.quantize import (
        StoredScale,
        fake_quantize,
        fake_quantize_factored,
        fake_quantize_stored,
    )

    view = scope.view(x)
    where = dict(axis=axis, batch_dims=scope.batch_dims)
    if route is _Route.ONE:  # codes times block scales in one fused pass
        store = scope.back(fake_quantize(view, spec, amax=amax, **where)).to(store_dtype)
        return store.contiguous(), _ones(scope.factor_shape, x.device)
    if route is _Route.FIXED:  # a fixed power-of-two scale: the codes are the values over it
        values, _ = fake_quantize_stored(view, spec, StoredScale.ONE, out_dtype=store_dtype,
                                         **where)  # fmt: skip
        return scope.back(values).contiguous(), _filled(scope.factor_shape, spec.fixed_scale,
                                                        x.device)
    noise = _noise(x, recipe, field, key)
    if noise is not None:
        noise = scope.view(noise)
    if route is _Route.FACTORED:  # codes times block scales, the tensor scale as the factor
        values, decode = fake_quantize_factored(view, spec, noise=noise, amax=amax, **where)
        return scope.back(values).to(store_dtype).contiguous(), scope.factor(decode)
    if route in (_Route.CODES, _Route.POWER):  # the slow path's arithmetic in one pass
        power = route is _Route.POWER
        stored = StoredScale.POWER if power else StoredScale.ONE
        values, scales = fake_quantize_stored(
            view, spec, stored, noise=noise, out_dtype=store_dtype, amax=amax, **where
        )
        if power:  # fl32(1 / M_e), as the slow path's ones / M_e rounds it
            return scope.back(values).contiguous(), _filled(scope.factor_shape, inverse, x.device)
        return scope.back(values).contiguous(), scope.factor(scales)
    return _quantized_operand(view, spec, scope, noise, where, store_dtype)


def _operands(jobs: dict, recipe: AttentionRecipe, key=None) -> dict:
    """`_operand` of each field -> (x, groups, rows) of `jobs`, the quantizers' first-pass
    buffers cut from one zeroed buffer (`_first_passes`): one allocation and fill where each
    quantizer made its own. The same bits: each pass reads only its own zeroed slice."""
    signature = tuple([(f, tuple(x.shape), g, r) for f, (x, g, r) in jobs.items()])
    slices, total = _memo("first passes", recipe, signature,
                          lambda: _first_passes(recipe, signature))
    buffer = None
    if total:
        device = next(iter(jobs.values()))[0].device
        buffer = torch.zeros(total, dtype=torch.int32, device=device)
    return {
        field: _operand(x, recipe, field, groups, key, rows,
                        None if field not in slices else buffer[slices[field]])
        for field, (x, groups, rows) in jobs.items()
    }  # fmt: skip


def _first_passes(recipe: AttentionRecipe, signature: tuple) -> tuple[dict, int]:
    """({field: its slice}, elements) of one int32 buffer for the first passes of the
    operands of `signature` ((field, shape, groups, rows) each): each slice
    `fp4lab.kernels.quantize.first_pass_elements` long, starting 16-byte aligned as a buffer
    of its own would (`quantize._aligned`); fields whose quantizer needs none are left out."""
    from fp4lab.kernels.quantize import _aligned

    slices, total = {}, 0
    for field, shape, groups, rows in signature:
        n = _first_pass(shape, recipe, field, groups, rows)
        if n:
            slices[field], total = slice(total, total + n), _aligned(total + n)
    return slices, total


def _first_pass(shape: tuple, recipe: AttentionRecipe, field: str, groups: int, rows) -> int:
    """The int32 elements operand `field` (x of `shape`)'s quantizer accumulates its first
    pass into (`_operand`'s fused passes; 0 for the others, which make their own where they
    need it)."""
    from fp4lab.kernels.quantize import first_pass_elements

    spec, route, axis, _ = _memo("route", recipe, field, lambda: _operand_route(recipe, field))
    if route not in (_Route.ONE, _Route.FACTORED, _Route.CODES, _Route.POWER):
        return 0
    scope = _Scope(shape, *_Scope.scoping(recipe, groups, rows))
    return first_pass_elements(scope.view_shape, spec, axis=axis, batch_dims=scope.batch_dims)


class _Route(enum.Enum):
    """How `_operand` makes an operand's (store, factor): which of its passes takes the spec."""

    PLAIN = "plain"  # unquantized: x in the store dtype
    CAST = "cast"  # a FloatFormat: `cast_to_format`
    TILE = "tile"  # 2-D tiles with one FP32 scale each, `_tile_factored`
    ONE = "one"  # `_one_pass`
    FIXED = "fixed"  # `_fixed_pass`
    FACTORED = "factored"  # `_factored_pass`
    CODES = "codes"  # `_codes_pass`
    POWER = "power"  # `_power_pass`
    SLOW = "slow"  # `_quantized_operand`


def _operand_route(recipe: AttentionRecipe, field: str) -> tuple:
    """(spec, route, block axis, 1/M_e) of operand `field`: the pass predicates in `_operand`'s
    order of trial (each a pure function of the spec), the axis its blocks run along, and
    an alpha grid's fl32(1 / M_e) (POWER's factor; None elsewhere)."""
    spec = getattr(recipe, field)
    axis, inverse = None, None
    if spec is None:
        route = _Route.PLAIN
    elif isinstance(spec, FloatFormat):
        route = _Route.CAST
    elif _tile_factored(spec):
        route = _Route.TILE
    else:
        axis = recipe.block_axis(field)
        if _one_pass(spec):
            route = _Route.ONE
        elif _fixed_pass(spec):
            route = _Route.FIXED
        elif _factored_pass(spec):
            route = _Route.FACTORED
        elif _codes_pass(spec) or _power_pass(spec):
            route = _Route.POWER if spec.scale_rule.alpha_grid else _Route.CODES
            if route is _Route.POWER:
                inverse = (torch.ones(()) / spec.element.max).item()
        else:
            route = _Route.SLOW
    return spec, route, axis, inverse


def _quantized_operand(view, spec: QuantSpec, scope: _Scope, noise, where: dict, store_dtype):
    """`_operand`'s slow path, for the block formats no fused pass takes: the codes and scales
    of the fused quantizer, then torch, each scale kept in the values where bf16 holds it and
    moved to the factor where it does not (the fused `_codes_pass` and `_power_pass` give its
    bits for their formats)."""
    from fp4lab.kernels.quantize import quantize

    ones = _ones(scope.factor_shape, view.device)
    qt = quantize(view, spec, noise=noise, **where)
    codes, scales = qt.element_values(), qt.expanded_scales()
    factor = ones
    if spec.scale_rule.alpha_grid:  # s = 2^E / M_e: keep 2^E, the 1/M_e goes to the factor
        scales = torch.where(
            scales > 0, torch.exp2(torch.round(torch.log2(scales * spec.element.max))), 0.0
        )
        factor = factor / spec.element.max
    elif spec.scale == FP32:  # one FP32 scale per tensor (or head, or tile): keep the codes
        factor = factor * scope.factor(qt.scales)
        scales = torch.ones_like(scales)
    if qt.tensor_scale is not None:
        factor = factor * scope.factor(qt.tensor_scale)
    store = scope.back(codes * scales).to(store_dtype)
    return store.contiguous(), factor


_DTYPE_FORMATS = {torch.bfloat16: BF16, torch.float16: FP16}


def cast_to_format(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """`round_to_format(x.float(), fmt)` (saturating), in x's dtype when x's own dtype is fmt:
    then every value of x already lies on fmt's grid and the rounding only turns +-inf into
    +-max, which a clamp does in one pass (NaN stays NaN, -0 stays -0: the same bits, tested
    on every bf16 and fp16 pattern) instead of the reference's float64 rounding; float32
    through the reference otherwise."""
    if _DTYPE_FORMATS.get(x.dtype) == fmt:
        return x.clamp(-fmt.max, fmt.max)
    return round_to_format(x.float(), fmt)


def _tile_operand(x: torch.Tensor, recipe: AttentionRecipe, field: str, rows: int):
    """(store, factor) of an operand in 2-D tiles with one FP32 scale each (`_tile_factored`):
    the E4M3 codes as bf16 values and each kernel tile's scale, (B, H, n tiles), quantized
    by `fp4lab.formats.quantize` itself over the whole tensor on its natural layout (axis -1,
    whatever the operand's block axis), as the simulation does."""
    from fp4lab.formats import quantize as quantize_reference

    gap = tile_geometry_gap(recipe, field, rows, x.shape[-1])
    if gap is not None:
        raise NotImplementedError(f"recipe {recipe.name!r}: the Triton kernels do not run {gap}")
    qt = quantize_reference(x.float(), getattr(recipe, field), axis=-1)
    factor = qt.expanded_scales()[:, :, ::rows, 0].float().contiguous()  # (B, H, n tiles)
    return qt.element_values().to(_store_dtype(x)).contiguous(), factor


class _Scope:
    """A whole-tensor operand x (B, H, S, E) as the fused quantizer takes it for the recipe's
    tensor scope (`TensorScope`), as `fp4lab.analysis.quantizers.quantize_field` cuts it:
    whole; (B, Hkv, G, S, E) per (batch, KV head), a query-side tensor's `groups` heads
    sharing it; (B, H, n tiles, rows, E) per tile, the last tile padded with zero rows."""

    def __init__(self, shape, batch_dims: int, groups: int, rows: int | None):
        self.shape, self.batch_dims, self.groups, self.rows = shape, batch_dims, groups, rows
        b, h, n = shape[:3]
        self.factor_shape = (b, h) if rows is None else (b, h, -(-n // rows))

    @classmethod
    def of(cls, x: torch.Tensor, recipe: AttentionRecipe, groups: int, rows: int | None):
        return cls(x.shape, *cls.scoping(recipe, groups, rows))

    @staticmethod
    def scoping(recipe: AttentionRecipe, groups: int, rows: int | None) -> tuple:
        """(batch_dims, groups, rows) of the recipe's tensor scope."""
        if recipe.tensor_scope is TensorScope.TILE:
            if rows is None:
                raise ValueError(
                    f"rows: recipe {recipe.name!r} takes its tensor scales per tile "
                    "(tensor_scope=tile) and needs the tile's rows"
                )
            return 3, 1, rows
        per_head = recipe.tensor_scope is TensorScope.HEAD
        return (2 if per_head else 0), groups, None

    @property
    def view_shape(self) -> tuple:
        """The shape of `view`'s result."""
        b, h, n, e = self.shape
        if self.rows is not None:
            return (b, h, -(-n // self.rows), self.rows, e)
        if self.batch_dims == 2:
            return (b, h // self.groups, self.groups, n, e)
        return (b, h, n, e)

    def view(self, x: torch.Tensor) -> torch.Tensor:
        b, h, n, e = self.shape
        if self.rows is not None:
            pad = -n % self.rows
            return F.pad(x, (0, 0, 0, pad)).reshape(b, h, -1, self.rows, e)  # (B, H, nT, rows, E)
        if self.batch_dims == 2:
            return x.reshape(b, h // self.groups, self.groups, n, e)  # (B, Hkv, G, S, E)
        return x

    def back(self, y: torch.Tensor) -> torch.Tensor:
        """A result of the view's shape as x's (B, H, S, E), padding rows cut."""
        b, h, n, e = self.shape
        return y.reshape(b, h, -1, e)[:, :, :n]

    def factor(self, scale: torch.Tensor) -> torch.Tensor:
        """A tensor scale (or FP32 scale) of the view as one value per entry of the factor."""
        if self.rows is None:
            return _per_head(scale, *self.shape[:2], self.groups)
        if scale.numel() == 1:
            return scale.reshape(()).float().expand(self.factor_shape)
        return scale.reshape(self.factor_shape).float()


def _one_pass(spec: QuantSpec) -> bool:
    """Whether `_operand` stores `spec`'s dequantized values whole (no tensor scale, no alpha
    grid's 1/M_e, no FP32 scale kept apart as a factor): then the fused `fake_quantize` in
    the store dtype gives its bits in one pass."""
    if spec.tensor_scale or spec.scale_rule.alpha_grid or spec.scale == FP32 or spec.hadamard:
        return False
    return not spec.stochastic and spec.block is not None


def _fixed_pass(spec: QuantSpec) -> bool:
    """Whether `_operand` takes a format with one fixed power-of-two scale (FP8 x4, the
    fp4-fa4 backward's) from the fused `fake_quantize_stored` (`StoredScale.ONE`): its values
    over the scale are the codes exactly, in x's 16-bit dtype too (at most 7 mantissa bits, no
    value below bf16's normal range), the slow path's bits in one pass instead of five, the
    scale the factor."""
    s = spec.fixed_scale
    if s is None or spec.block is not None or spec.tensor_scale or spec.hadamard:
        return False
    if spec.stochastic or s <= 0 or math.frexp(s)[0] != 0.5:
        return False
    el = spec.element
    smallest = el.emin - el.mbits + math.log2(s)
    return el.mbits <= 7 and smallest >= -126 and el.max * max(s, 1.0) < 3.0e38


def _factored_pass(spec: QuantSpec) -> bool:
    """Whether `_operand` takes a tensor-scaled `spec` from the fused
    `fake_quantize_factored` (one pass after the tensor amax): the elements times their block
    scales in bf16 hold every product exactly (E2M1 times E4M3: at most 6 significant bits),
    so they are the slow path's bits, and the tensor scale becomes the factor. A stochastic
    format (nvfp4_sr) rounds with the slow path's uniforms, handed to the same kernel: they
    choose which grid value an element takes, not whether the product is exact."""
    if not spec.tensor_scale or spec.scale_rule.alpha_grid or spec.scale == FP32:
        return False
    if spec.hadamard or spec.correction is not Correction.NONE or spec.block is None:
        return False
    el, sc = spec.element, spec.scale
    digits = (el.mbits + 1) + (sc.mbits + 1)  # significant bits of a product, at most
    smallest = (el.emin - el.mbits) + (sc.emin - sc.mbits)  # log2 of the smallest product
    return digits <= 8 and smallest >= -126 and el.max * sc.max < 3.0e38


def _codes_pass(spec: QuantSpec) -> bool:
    """Whether `_operand` takes `spec`, one FP32 scale per tensor of the scope (fa3_fp8's per
    head, fp8_per_tensor's per tensor), from the fused `fake_quantize_stored` with
    `StoredScale.ONE`: one pass after the amax instead of the slow path's six. The same bits:
    the slow path stores decode(encode(v)) times 1, rounded once from float32 into the store
    dtype, and the FP32 scales as the factor; the kernel rounds the same v (the quantize
    kernel's arithmetic, with the same uniforms where the format is stochastic), decode(encode(
    v)) is v for every value on the grid (NaN: the NaN code's +NaN, or +0 in a format without
    NaN, as `FloatFormat.decode`), its one rounding into bf16 is torch's (to nearest even, by
    the instruction torch's CUDA cast uses; the interpreter stores float32), and its scales
    are `quantize`'s, written by the same kernel. Refused: blocks (the
    slow path's factor takes one FP32 scale per tensor of the scope), a tensor scale, an alpha
    grid, a Hadamard transform, MS-EDEN, and element formats the kernels do not encode (where
    the slow path's `quantize` raises)."""
    if spec.block is not None or spec.scale != FP32 or spec.tensor_scale:
        return False
    if spec.scale_rule.alpha_grid or spec.hadamard or spec.correction is not Correction.NONE:
        return False
    return _encodable(spec.element)


def _power_pass(spec: QuantSpec) -> bool:
    """Whether `_operand` takes an alpha-grid `spec` (block scales s = fl(2^E / M_e), the
    MXFP4 P/V route's V) from the fused `fake_quantize_stored` with `StoredScale.POWER`: the
    slow path stores the codes times exp2(round(log2(s M_e))) where s > 0 (else 0), rounded
    once from float32 into the store dtype, with 1/M_e as the factor; the kernel multiplies
    the same codes (`_codes_pass`'s argument) by its own 2^E where s > 0, in one rounding into
    the store dtype. These are the same number: the kernel's E is at least -126 (a smaller
    amax flushes the block, s = 0), and s M_e = 2^E (1 + delta), s rounded once (normal:
    |delta| <= 2^-24; subnormal: at most M_e 2^(-150 - E)) and the product once (2^-23), so
    with M_e 2^(-150 - E) <= 2^-8 for the smallest E, log2 lands within 2^-7 of E and rounds
    to it, and exp2 of an integer E in float32's range is 2^E (checked on every E of the
    format, tests/kernels/test_operands.py). Refused where that bound fails (a format whose
    s underflows: the slow path stores 0, the kernel 2^E) and as `_codes_pass` refuses."""
    if not spec.scale_rule.alpha_grid or spec.block is None or spec.tensor_scale:
        return False
    if spec.hadamard or spec.correction is not Correction.NONE or not _encodable(spec.element):
        return False
    lo, hi = _alpha_exponents(spec)
    return math.log2(spec.element.max) - 150 - lo <= -8 and hi <= 127


def _alpha_exponents(spec: QuantSpec) -> tuple[int, int]:
    """The smallest and largest E of an alpha-grid scale 2^E / M_e the quantizer gives: the
    scale format's powers of two, E at least -126 (a smaller amax flushes its block)."""
    lo = math.floor(math.log2(spec.scale.min_subnormal))
    return max(lo, -126), math.floor(math.log2(spec.scale.max))


def _encodable(fmt: FloatFormat) -> bool:
    """Whether the fused quantizer encodes `fmt` (`fp4lab.kernels.quantize.encodes`)."""
    from fp4lab.kernels.quantize import encodes

    return encodes(fmt)


def _fp8_pv(recipe: AttentionRecipe, block_n: int | None = None) -> bool:
    """Whether P V runs on the FP8 tensor cores: P cast to E4M3 and V's values E4M3 codes
    (an E4M3 cast, or E4M3 with one FP32 or fixed scale per tensor), on a GPU, with key tiles
    of at least 32 (an FP8 matrix instruction's depth; narrower tiles take the bf16 tensor
    cores, which hold E4M3 values exactly)."""
    if block_n is not None and block_n < 32:
        return False
    v = recipe.v
    e4m3_v = v == FP8_E4M3FN or (
        isinstance(v, QuantSpec) and v.element == FP8_E4M3FN and v.block is None and v.scale == FP32
    )
    return recipe.p == FP8_E4M3FN and e4m3_v and not _interpreted()


def _key_major_fp8(v: torch.Tensor) -> torch.Tensor:
    """V (B, Hkv, Sk, Dv) as float8_e4m3fn stored with the keys contiguous (the layout FP8
    matrix instructions take their B operand in), viewed back as (B, Hkv, Sk, Dv): cast in
    torch (exact: V^'s values lie on E4M3's grid), transposed by `layout.key_major`."""
    from fp4lab.kernels.layout import key_major

    return key_major(v.to(torch.float8_e4m3fn).contiguous())


def _per_head(scale: torch.Tensor, b: int, h: int, groups: int) -> torch.Tensor:
    """A tensor or per-(batch, group) scale as one value per (batch, head)."""
    if scale.numel() == 1:
        return scale.reshape(()).float().expand(b, h)
    # each (batch, group) value repeated for its heads by a broadcast, not repeat_interleave
    # (whose CUDA path costs more host time: 67 us a call under cProfile on the H200's host)
    per_group = scale.reshape(b, h // groups, 1).float()
    return per_group.expand(b, h // groups, groups).reshape(b, h).contiguous()


def prepare(q, k, v, recipe: AttentionRecipe, block_m: int, block_n: int):
    """(q, k, v, factors) as the kernel reads them with tiles of `block_m` queries and
    `block_n` keys: Q and K rotated (`incoherent`) and K smoothed as the recipe says, each
    operand quantized (`_operand`), V key-major E4M3 where P V runs on the FP8 tensor cores.
    Not for smooth_q, whose kernel also takes the mean scores: `prepare_forward`."""
    if recipe.smooth_q:
        raise NotImplementedError(
            f"recipe {recipe.name!r}: with smooth_q the kernel also takes the mean scores; "
            "use prepare_forward"
        )
    ops = prepare_forward(q, k, v, recipe, block_m, block_n)
    return ops["q"], ops["k"], ops["v"], ops["factors"]


def prepare_forward(
    q, k, v, recipe: AttentionRecipe, block_m: int, block_n: int, scale: float | None = None
) -> dict:
    """The forward kernel's operands as `attention` hands them to it, for timing and testing
    the kernel alone: q, k, v and factors as `prepare` gives them and "mean_scores", smooth_q's
    correction of the scores (`smooth_q`'s Q - M is the Q quantized, `mean_scores` of its
    means against the smoothed K, at `scale`, default 1/sqrt(head_dim)), None without it."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k = incoherent(q, k, recipe)
    ops = _forward_operands(q, smooth_k(k, recipe), v, recipe, block_m, block_n, scale)
    return dict(q=ops.q, k=ops.k, v=ops.v_kernel, factors=ops.factors,
                mean_scores=ops.mean_scores)  # fmt: skip


def _forward_operands(q, k, v, recipe, block_m: int, block_n: int, scale: float, key=None):
    """The forward's operands from Q and K already rotated and K smoothed (the steps
    `attention` runs outside the autograd Function): smooth_q's split of Q (`q_src`, its
    means `q_mean`, the kernel's `mean_scores`), the quantized operands and factors
    (`quantize_operands`, stochastic formats under the pass key `key`), and `v_kernel`, V^
    as the kernel reads it (key-major E4M3 where P V runs on the FP8 tensor cores)."""
    q_src, q_mean = smooth_q(q, recipe, block_m)  # Q - M quantized, M K^T added in fp32
    qs, ks, vs, factors = quantize_operands(q_src, k, v, recipe, key, (block_m, block_n))
    return SimpleNamespace(
        q=qs, k=ks, v=vs, factors=factors, q_src=q_src, q_mean=q_mean,
        mean_scores=None if q_mean is None else mean_scores(q_mean, k, scale),
        v_kernel=_key_major_fp8(vs) if _fp8_pv(recipe, block_n) else vs,
    )  # fmt: skip


def incoherent(q, k, recipe: AttentionRecipe):
    """(Q H, K H) with incoherent processing: the simulation's own transform, bit for bit
    (`fp4lab.recipes.transforms.incoherent_qk`), run outside the autograd Function as torch ops;
    a head_dim other than a power of two is a ValueError, as there."""
    if not recipe.incoherent_processing:
        return q, k
    from fp4lab.recipes.transforms import incoherent_qk

    d = q.shape[-1]
    if d & (d - 1) or d < 2:
        raise ValueError(
            f"head_dim={d}: recipe {recipe.name!r} rotates Q and K by a Hadamard matrix, "
            "which needs a power of two"
        )
    return incoherent_qk(q, k, recipe)


def smooth_k(k, recipe: AttentionRecipe):
    """K minus the mean the recipe subtracts (differentiable: the backend runs it outside its
    autograd Function, as the simulation does, so K's gradient takes its Jacobian in torch)."""
    if recipe.smooth_k is SmoothK.PER_HEAD:
        return k - k.mean(dim=-2, keepdim=True)
    if recipe.smooth_k is SmoothK.GLOBAL:
        return k - k.mean(dim=(0, 1, 2), keepdim=True)
    return k


def smooth_q(q: torch.Tensor, recipe: AttentionRecipe, block_m: int):
    """(Q - M, M) with smooth_q: q (B, H, Sq, D) in fp32 minus each query tile's mean M, and
    the means (B, H, n_q, D) fp32, each the tile's sum over block_m rows (padding rows
    counting as zeros) divided by block_m, in the simulation's fp32 arithmetic and order
    (`fp4lab.analysis.flash._smooth_q`); (q, None) without smooth_q."""
    if not recipe.smooth_q:
        return q, None
    B, H, Sq, D = q.shape
    n_q = -(-Sq // block_m)
    qw = q.float()
    padded = qw if n_q * block_m == Sq else F.pad(qw, (0, 0, 0, n_q * block_m - Sq))
    tiles = padded.reshape(B, H, n_q, block_m, D)  # (B, H, n_q, bm, D)
    mean = tiles.sum(dim=-2, keepdim=True) / block_m  # (B, H, n_q, 1, D)
    rows = mean.expand_as(tiles).reshape(B, H, n_q * block_m, D)[:, :, :Sq]
    return qw - rows, mean.squeeze(-2)


def mean_scores(q_mean: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """smooth_q's correction of the scores as the kernels add it, in log2 units: (B, H, n_q,
    Sk) fp32, scale log2(e) times M_i . k_j for each query tile's mean M_i (B, H, n_q, D) and
    each key of k (B, Hkv, Sk, D; the unquantized, smoothed K, as the simulation's
    ``k_plain``). The dot products in float64 rounded once to fp32: the simulation's fp32
    matmul within its rounding, and no TF32 setting can shorten it."""
    from fp4lab.kernels.flash import LOG2E

    B, H, n_q, D = q_mean.shape
    Hk, Sk = k.shape[1], k.shape[2]
    means = q_mean.reshape(B, Hk, H // Hk * n_q, D).double()  # (B, Hkv, G n_q, D)
    dots = (means @ k.double().transpose(-1, -2)).float()  # (B, Hkv, G n_q, Sk)
    return (dots * (scale * LOG2E)).reshape(B, H, n_q, Sk).contiguous()


def quantize_operands(q, k, v, recipe: AttentionRecipe, key: int | None = None, tiles=None):
    """(q, k, v, (qf, kf, vf)): the forward's Q^, K^, V^ as stored values and factors (`key`:
    the forward's pass key, for stochastic formats; `tiles`: the kernel's (block_m, block_n),
    which a recipe with tensor_scope=tile takes its tensor scales over: per query tile of Q,
    per key tile of K and V)."""
    g = q.shape[1] // k.shape[1]
    bm, bn = tiles if tiles is not None else (None, None)
    ops = _operands(dict(q=(q, g, bm), k=(k, 1, bn), v=(v, 1, bn)), recipe, key)
    (qs, qf), (ks, kf), (vs, vf) = ops["q"], ops["k"], ops["v"]
    if any(f.ndim == 3 for f in (qf, kf, vf)):  # per-tile factors: per-head ones over tiles
        n_q, n_k = -(-q.shape[2] // bm), -(-k.shape[2] // bn)
        qf, kf, vf = (
            f if f.ndim == 3 else f[:, :, None].expand(*f.shape, n).contiguous()
            for f, n in ((qf, n_q), (kf, n_k), (vf, n_k))
        )
    return qs, ks, vs, (qf, kf, vf)


def p_quantizer(recipe: AttentionRecipe):
    """The kernel's `PQuantizer` of the recipe's P: its `p` format or Direct-P (made once per
    recipe, `_memo`)."""
    return _memo("p", recipe, None, lambda: _p_quantizer(recipe))


def _p_quantizer(recipe: AttentionRecipe):
    from fp4lab.kernels.flash import PQuantizer

    if recipe.p_quant is PQuant.DIRECT:
        return PQuantizer.direct(recipe.p, recipe.p_min_exponent, recipe.direct_p_affine,
                                 recipe.direct_p_affine_groups, recipe.p_scale_shift)
    if recipe.p_quant is PQuant.ROW_SCALED:
        return PQuantizer.row_scaled(recipe.p, recipe.p_lift)
    return PQuantizer.of(recipe.p, recipe.p_lift)


_REFERENCES = {
    RowReference.RUNNING_MAX: "running", RowReference.LAZY_MAX: "running",
    RowReference.ANCHOR: "anchor", RowReference.ZERO: "zero",
}  # fmt: skip


def forward_options(recipe: AttentionRecipe, causal: bool, v: torch.Tensor) -> dict:
    """The recipe's mechanisms as `attention_forward`'s keyword arguments (v: the unquantized
    V, which the leakage fix multiplies P's diagonal blocks by)."""
    lazy = recipe.lazy_rescale_log2 if recipe.row_reference is RowReference.LAZY_MAX else None
    leak = recipe.leakage_fix and causal
    return dict(
        leakage_block=recipe.leakage_block if leak else 0,
        v_plain=v.to(_store_dtype(v)).contiguous() if leak else None,
        leakage_parts=recipe.leakage_fix_parts.value,
        reverse=recipe.kv_order is KVOrder.REVERSE,
        lazy_log2=lazy,
        row_sum_quantized=recipe.row_sum is RowSum.QUANTIZED_P,
        reference=_REFERENCES[recipe.row_reference],
        anchor_keys=recipe.anchor_keys or 0,
        anchor_margin=recipe.anchor_margin or 0.0,
    )


# -- the backward ------------------------------------------------------------------------------
_TILE_OPERANDS = ("dv_p", "dq_ds", "dk_ds")  # quantized in registers, tile by tile
_WHOLE_OPERANDS = ("dv_do", "dp_do", "dp_v", "dq_k", "dk_q")  # whole tensors, before the kernels


def check_backward(
    recipe: AttentionRecipe, block_m: int | None = None, block_n: int | None = None
) -> None:
    """Raise NotImplementedError for a backward mechanism the Triton backward does not run,
    naming it, before anything runs (no silent fallback); ValueError for blocks of P or dS
    that do not tile `block_m` x `block_n` (when given)."""
    missing = _untransformed_gaps(recipe, _WHOLE_OPERANDS, rotations=True)
    missing += _rotation_gaps(recipe)
    if recipe.tensor_scope is TensorScope.TILE and recipe.backward is BackwardMode.FLASH:
        missing.append(
            "tensor_scope=tile with backward=flash (its own dO, V, K, Q quantized per tile)"
        )
    if (recipe.leakage_fix_parts is not LeakageParts.P_AND_V
            and recipe.backward is BackwardMode.FORWARD_EXACT):
        missing.append(
            f"leakage_fix_parts={recipe.leakage_fix_parts.value!r} in the exact gradient of "
            "the forward (its replay of P^ takes the whole fix)"
        )
    if missing:
        raise NotImplementedError(
            f"recipe {recipe.name!r}: the Triton backward does not run {', '.join(missing)} "
            "yet; use backend='reference' (no silent fallback)"
        )
    quantizers = backward_quantizers(recipe)
    if block_m is not None and block_n is not None:
        from fp4lab.kernels.flash_bwd import check_tiles

        check_tiles(block_m, block_n, **dict(zip(_TILE_OPERANDS, quantizers, strict=True)))


def backward_quantizers(recipe: AttentionRecipe):
    """The in-register quantizers (P in dV, dS in dQ, dS in dK) as `TileQuantizer`s; with the
    straight-through backward (and forward_exact's replay), P in dV takes the forward's
    quantizer, along the keys (two-level P, mode 6, straight through: each row of the
    backward's normalized P scaled to M_e M_s, as the simulation's `quantize_p`). Made once
    per recipe (`_memo`)."""
    return _memo("backward", recipe, None, lambda: _backward_quantizers(recipe))


def _backward_quantizers(recipe: AttentionRecipe):
    from fp4lab.kernels.flash_bwd import TileQuantizer

    if recipe.backward is not BackwardMode.FLASH:  # straight through, or the forward's own P^
        replay = recipe.backward is BackwardMode.FORWARD_EXACT
        if replay and recipe.p_quant is PQuant.ROW_SCALED:
            raise NotImplementedError(
                f"recipe {recipe.name!r}: the Triton backward does not replay two-level P "
                "(p_quant=row_scaled) in dV yet; use backend='reference' (no silent fallback)"
            )
        dv_p = TileQuantizer(p_quantizer(recipe), along_keys=True)
    else:
        dv_p = TileQuantizer.of(
            recipe.dv_p, recipe.dv_p_lift, "dv_p", recipe.block_axis("dv_p") == -1
        )
    dq_ds, dk_ds = (
        TileQuantizer.of(getattr(recipe, f), recipe.ds_lift, f, recipe.block_axis(f) == -1)
        for f in ("dq_ds", "dk_ds")
    )
    return dv_p, dq_ds, dk_ds


def backward_operands(do, saved: dict, recipe: AttentionRecipe, keys=(None, None), block_m=None):
    """The backward's whole-tensor operands quantized as the recipe says (`_operand`), from
    what the forward saved (`saved`: q, k (smoothed), v as given; the forward's stored Q^,
    K^, V^ and their factors; its output o and lse; Attn-QAT's O' or None; smooth_q's tile
    means q_mean or None, and the softmax scale). `keys`: the (forward, backward) pass keys
    of a stochastic recipe (`fp4lab.formats.streams`). With smooth_q the forward's Q^ is
    Q - M quantized: scores rebuilt from it add M K^T (`mean_scores`), and a dK taking it
    (straight through) takes Q^ + M, as the simulation does. `block_m`: the query tiles
    dO's tensor scales are taken over with tensor_scope=tile (as the simulation's)."""
    from fp4lab.kernels.flash_bwd import BackwardOperands

    q, k, v = saved["q"], saved["k"], saved["v"]
    q_hat, k_hat, v_hat = saved["q_hat"], saved["k_hat"], saved["v_hat"]
    g = q.shape[1] // k.shape[1]
    fwd_key, key = keys
    do = do.contiguous()
    jobs = dict(dv_do=(do, g, block_m), dp_do=(do, g, block_m))
    if recipe.backward is BackwardMode.FLASH:
        if recipe.backward_v is not BackwardV.FORWARD:
            jobs["dp_v"] = (v, 1, None)
        elif recipe.dp_v is not None:  # V^ as the forward represented it, quantized again
            jobs["dp_v"] = (_dequantized(v, recipe, fwd_key), 1, None)
        jobs.update(dq_k=(k, 1, None), dk_q=(q, g, None))
    ops = _operands(jobs, recipe, key)
    do_dv, do_dp = ops["dv_do"], ops["dp_do"]
    if recipe.backward is BackwardMode.FLASH:
        v_dp, k_dq, q_dk = ops.get("dp_v", v_hat), ops["dq_k"], ops["dk_q"]
    else:  # straight through the forward's quantizers: its Q^, K^, V^
        v_dp, k_dq, q_dk = v_hat, k_hat, q_hat
    q_mean, shift = saved.get("q_mean"), None
    if recipe.backward_p is BackwardP.QUANTIZED_QK:
        scores_q, scores_k = q_hat, k_hat
        if q_mean is not None:
            shift = mean_scores(q_mean, k, saved["scale"])
    else:
        scores_q, scores_k = _plain(q), _plain(k)
    plain_do = _plain(do)
    if recipe.delta is DeltaSource.QUANTIZED_DO:
        o, do_delta = saved["o"], do_dp
    elif recipe.delta is DeltaSource.UNQUANTIZED_P_OUTPUT:
        o, do_delta = saved["o_prime"], plain_do
    else:
        o, do_delta = saved["o"], plain_do
    return BackwardOperands(
        q=scores_q, k=scores_k, do_dv=do_dv, do_dp=do_dp, v_dp=v_dp, k_dq=k_dq, q_dk=q_dk,
        o=o.to(_store_dtype(o)), do_delta=do_delta, lse=saved["lse"], mean_scores=shift,
        q_dk_mean=q_mean if recipe.backward is not BackwardMode.FLASH else None,
    )  # fmt: skip


def _plain(x: torch.Tensor):
    """An unquantized operand as (store, factor)."""
    return x.to(_store_dtype(x)).contiguous(), _ones(tuple(x.shape[:2]), x.device)


def _dequantized(v: torch.Tensor, recipe: AttentionRecipe, key: int | None) -> torch.Tensor:
    """The forward's V^ in float32, as the simulation holds it (`fake_quantize`'s bits; `key`:
    the forward's pass key, for a stochastic V)."""
    spec = recipe.v
    if spec is None:
        return v.float()
    if isinstance(spec, FloatFormat):
        return cast_to_format(v, spec).float()
    from fp4lab.kernels.quantize import fake_quantize

    per_head = recipe.tensor_scope is TensorScope.HEAD
    where = dict(axis=recipe.block_axis("v"), batch_dims=2 if per_head else 0)
    view = v.float().unsqueeze(2) if per_head else v.float()  # (B, Hkv, 1, Sk, Dv) per head
    noise = _noise(v, recipe, "v", key)
    if noise is not None:
        noise = noise.reshape(view.shape)
    return fake_quantize(view, spec, noise=noise, **where).reshape(v.shape)


# The kernels' launch configuration, (num_warps, num_stages) for the forward and for the
# backward's kernels: it changes no number (the tiles do; these are not the tiles), only how
# fast a call runs. None takes `launch_options`' default; a benchmark sweeps it here.
LAUNCH: dict[str, tuple[int, int] | None] = {"forward": None, "backward": None}


def launch_options(kind: str, block_m: int) -> dict:
    """num_warps and num_stages of the `kind` ("forward" or "backward") kernels at query tiles of
    `block_m` rows: `LAUNCH[kind]` where set, else the best measured on the H200
    (benchmarks/RESULTS.md, 2026-12-02, B4 H16 S4096 D128): 8 warps for 128-row tiles (at 128 x
    128 the forward 2.0x faster than at 4 warps and 2 stages, forward plus backward 2.0x to
    2.7x), 4 below (8 warps there were slower); 3 stages, but 2 for the backward's 128-row
    tiles (at head_dim 128 those fit only one, to which `flash.launch_fitting` drops, as it
    drops any depth that does not fit). At 64 x 64
    and 4 warps fa4fp4_causal's forward plus backward ran at 0.39x / 0.45x SDPA (non-causal /
    causal) with the backward at 3 stages, 0.34x / 0.41x at 2 (RESULTS.md, session 21)."""
    if kind not in LAUNCH:
        raise ValueError(f"kind must be one of {', '.join(LAUNCH)}; got {kind!r}")
    if LAUNCH[kind] is not None:
        warps, stages = LAUNCH[kind]
    else:
        warps = 8 if block_m >= 128 else 4
        stages = 2 if kind == "backward" and block_m >= 128 else 3
    return dict(num_warps=warps, num_stages=stages)


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, recipe, causal, scale, block_m, block_n, generator, trace):
        from fp4lab.kernels.flash import TraceBuffers, attention_forward

        fwd_key = pass_key(generator) if recipe.stochastic else None  # as the simulation's
        ops = _forward_operands(q, k, v, recipe, block_m, block_n, scale, fwd_key)
        qs, ks, vs, factors = ops.q, ops.k, ops.v, ops.factors
        q_src, q_mean, shift, vs_kernel = ops.q_src, ops.q_mean, ops.mean_scores, ops.v_kernel
        grads = any(ctx.needs_input_grad[:3])
        o_prime = m_ref = None  # Attn-QAT's O', for D; the row references, for the replay
        if grads and recipe.delta is DeltaSource.UNQUANTIZED_P_OUTPUT:
            o_prime = qs.new_empty(*q.shape[:3], v.shape[-1])
        if grads and recipe.backward is BackwardMode.FORWARD_EXACT:
            n_k = -(-k.shape[2] // block_n)
            m_ref = torch.zeros(*q.shape[:3], n_k, dtype=torch.float32, device=q.device)
        bufs = None
        if trace is not None:  # the instrumented kernel (TRACE), its statistics into bufs
            bufs = TraceBuffers.empty(*q.shape[:3], k.shape[2], block_m, block_n, q.device)
        pq = p_quantizer(recipe)
        tiles = dict(causal=causal, scale=scale, block_m=block_m, block_n=block_n)
        o, lse = attention_forward(
            qs, ks, vs_kernel, factors, pq, lse_log2=True, o_prime=o_prime, m_ref=m_ref,
            mean_scores=shift, trace=bufs, out_dtype=None if bufs is None else torch.float32,
            sr_key=_stream(fwd_key, "p"), **tiles, **forward_options(recipe, causal, v),
            **launch_options("forward", block_m),
        )  # fmt: skip
        if trace is not None:
            from fp4lab.kernels.flash import PQuantizer
            from fp4lab.kernels.trace import record_forward

            (qp, qpf), (kp, kpf), (vp, vpf) = (_plain(x) for x in (q, k, v))
            exact = attention_forward(  # exact attention, for out_err and lse_err
                qp, kp, vp, (qpf, kpf, vpf), PQuantizer(MODE=0), out_dtype=torch.float32,
                **tiles, **launch_options("forward", block_m),
            )  # fmt: skip
            smoothed = None if q_mean is None else (q_src, q_mean)
            cfg = dict(**tiles, mode=pq.MODE)
            ctx.trace_call = record_forward(
                trace, recipe, (q, k, v), bufs, (o, lse), exact, cfg, smoothed
            )
        out = o.to(q.dtype)
        if grads:  # the outputs as returned (in q's dtype): D reads them so, as the simulation
            o_prime = out if o_prime is None else o_prime.to(q.dtype)
            m_ref = lse if m_ref is None else m_ref
            ctx.save_for_backward(q, k, v, qs, ks, vs, *factors, out, o_prime, lse, m_ref, q_mean)
            ctx.call = (recipe, causal, scale, block_m, block_n, generator, fwd_key)
            ctx.traced = trace is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        from fp4lab.kernels.flash_bwd import attention_backward, trace_buffers

        q, k, v, qs, ks, vs, qf, kf, vf, out, o_prime, lse, m_ref, q_mean = ctx.saved_tensors
        recipe, causal, scale, block_m, block_n, generator, fwd_key = ctx.call
        key = pass_key(generator) if recipe.stochastic else None  # after the forward's
        replay = recipe.backward is BackwardMode.FORWARD_EXACT
        saved = dict(
            q=q, k=k, v=v, q_hat=(qs, qf), k_hat=(ks, kf), v_hat=(vs, vf), o=out, lse=lse,
            o_prime=o_prime, q_mean=q_mean, scale=scale,
        )  # fmt: skip
        bufs = None
        if ctx.traced:  # the instrumented kernels (TRACE), their statistics into bufs
            bufs = trace_buffers(*q.shape[:3], k.shape[2], block_m, block_n, q.device)
        quantizers = backward_quantizers(recipe)
        dq, dk, dv = attention_backward(
            backward_operands(do, saved, recipe, (fwd_key, key), block_m), *quantizers,
            causal=causal,
            sr_keys=backward_stream_keys(recipe, fwd_key, key), trace=bufs,
            scale=scale, block_m=block_m, block_n=block_n, ds_from_dv=recipe.ds_p is DsP.DV_OPERAND,
            m_ref=m_ref if replay else None,
            leakage_block=recipe.leakage_block if replay and recipe.leakage_fix and causal else 0,
            **launch_options("backward", block_m),
        )  # fmt: skip
        if bufs is not None:
            from fp4lab.kernels.trace import record_backward

            modes = dict(zip(("dv", "dq", "dk"), (tq.pq.MODE for tq in quantizers), strict=True))
            tiles = dict(causal=causal, block_m=block_m, block_n=block_n)
            smoothed = None if q_mean is None else (smooth_q(q, recipe, block_m)[0], q_mean)
            record_backward(
                ctx.trace_call, recipe, (q, k, v, do), bufs, lse, modes, tiles, smoothed
            )
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
        return (*grads, None, None, None, None, None, None, None)  # recipe ... trace


def _stream(key: int | None, field: str) -> int | None:
    """The stream key of operand `field` under a pass key, or a tuple of them under stacked
    samples' keys (None without one)."""
    return None if key is None else stream_keys(key, operand(field).stream)


def backward_stream_keys(recipe: AttentionRecipe, fwd_key: int | None, key: int | None):
    """The stream keys of the in-register quantizers (P in dV, dS in dQ, dS in dK), as the
    simulation draws them: P in dV from the backward's dv_p stream, or its p stream
    (straight through: the forward's quantizer in the backward's pass), or the forward's p
    stream (forward_exact replays the forward's own P^)."""
    if recipe.backward is BackwardMode.FORWARD_EXACT:
        dv = _stream(fwd_key, "p")
    elif recipe.backward is BackwardMode.STRAIGHT_THROUGH:
        dv = _stream(key, "p")
    else:
        dv = _stream(key, "dv_p")
    return dv, _stream(key, "dq_ds"), _stream(key, "dk_ds")


def attention(
    q,
    k,
    v,
    recipe="exact",
    *,
    causal=False,
    scale=None,
    trace=None,
    generator=None,
    block_m=None,
    block_n=None,
    attn_mask=None,
    dropout_p=0.0,
):
    """Attention with `recipe` on the Triton kernels (arguments as `fp4lab.attention`)."""
    recipe = _resolved(recipe)
    _check_call(q, k, v, trace, attn_mask)
    if dropout_p:
        raise NotImplementedError("dropout_p: the Triton kernels have no dropout yet")
    _memo("recipe checked", recipe, None, lambda: check_recipe(recipe) or True)
    if trace is not None and recipe.stochastic:
        raise NotImplementedError(
            f"trace: recipe {recipe.name!r} rounds stochastically, and the Triton backend's "
            "trace computes the operands' columns on the host without the kernels' draws; "
            "use backend='reference'"
        )
    gen = as_generators(generator)
    if gen is None and recipe.stochastic:
        raise ValueError(
            f"generator: recipe {recipe.name!r} rounds stochastically; pass a torch.Generator "
            "or an int seed (fp4lab never draws from torch's global random state)"
        )
    if isinstance(gen, tuple) and q.shape[0] % len(gen):
        raise ValueError(
            f"generator: {len(gen)} generators (stacked samples) must split the batch of "
            f"{q.shape[0]} into equal chunks"
        )
    block_m, block_n = recipe.tiles(block_m, block_n)
    grads = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    extents = (q.shape[2], k.shape[2], q.shape[-1], v.shape[-1])
    _memo("tiles checked", recipe, (block_m, block_n, extents, grads),
          lambda: _check_signature(recipe, block_m, block_n, extents, grads))
    if grads and trace is not None:
        rotated = [f for f in _TILE_OPERANDS if _rotation(recipe, f) is not None]
        if rotated:
            raise NotImplementedError(
                f"trace: the instrumented backward does not count the rotated operands "
                f"{', '.join(rotated)} of recipe {recipe.name!r}; use backend='reference'"
            )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    q, k = incoherent(q, k, recipe)
    k = smooth_k(k, recipe)
    return _TritonAttention.apply(
        q, k, v, recipe, bool(causal), scale, block_m, block_n, gen, trace
    )


def _check_signature(recipe: AttentionRecipe, block_m: int, block_n: int, extents: tuple,
                     grads: bool) -> bool:
    """`attention`'s checks of the recipe against the tiles and the extents (Sq, Sk, d, dv):
    each a pure function of them, run once per recipe and signature (`_memo`; one that raises
    is run again by the next call)."""
    sq, sk, d, dv = extents
    check_tiling(recipe, d, dv, block_m, block_n)  # as the simulation's
    check_tile_scales(recipe, block_m, block_n, d, dv)
    if grads:
        check_backward(recipe, block_m, block_n)
        check_rotated_extents(recipe, sq, sk, d, dv)
    return True


_RECIPE_KINDS = (AttentionRecipe, QuantSpec, FloatFormat)


def _resolved(recipe) -> AttentionRecipe:
    """`resolve_recipe(recipe)`, where a registered format's name (a recipe of it on every
    operand, built anew by each resolution) gives one recipe per registered object, so that
    what is kept per recipe (`_memo`) serves its every call."""
    if not isinstance(recipe, str):
        return resolve_recipe(recipe)
    from fp4lab.formats.registry import get

    try:
        obj = get(recipe, _RECIPE_KINDS)
    except (TypeError, ValueError):
        return resolve_recipe(recipe)  # its own message
    if isinstance(obj, AttentionRecipe):
        return obj
    return _memo("uniform", obj, recipe, lambda: resolve_recipe(recipe))
