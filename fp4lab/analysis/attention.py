"""Attention with every operand of its six products quantized: the simulation path.

What. `attention(q, k, v, recipe)` computes scaled dot-product attention the way a
FlashAttention kernel does, in plain torch, with each operand of S = Q K^T, O = P V and of the
backward's dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q quantized as an
`AttentionRecipe` says, and it can record what quantization did, tile by tile (`Trace`).
It is an autograd Function, so it drops into a model in place of
`F.scaled_dot_product_attention` (and `patch_sdpa` does exactly that without editing the
model).

Why a tiled simulation. The numbers a low-precision attention kernel produces depend on its
tiling: P tiles are exp(S - m) with m the running row maximum of the online softmax, so a
tile's values, and therefore what quantization flushes or clips, depend on the tiles before
it; block scales of P and dS are chosen per tile; the backward rebuilds P from the forward's
log-sum-exp. A dense reference would miss all of that. Here the forward is FlashAttention-2's
Algorithm 1 and the backward its Algorithm 2 (Dao 2023, arXiv 2307.08691), vectorised over
batch, heads and query tiles and run in blocks of query tiles by key tiles of a bounded size
(`_BLOCK_ELEMENTS`), so memory grows with seq x block_n, never seq^2. Inside a block the
running maximum each key tile sees, m_j = max(m, rowmax S_1, ..., rowmax S_j), is a
cumulative maximum: the same values the kernel's loop holds, so P tiles, their quantization
and every statistic are the same whatever the blocking (tested); only the order in which
P^ V^ is summed differs (a weighted sum with weights exp(m_j - m_end) instead of repeated
rescaling), at float rounding level.

How it differs from a kernel. Arithmetic runs in the working precision (float64 for float64
inputs, float32 otherwise) with torch's matmul, so accumulation order is not the kernel's;
Q, K, V and dO are quantized once as whole tensors (as a kernel receives them), P and dS
tile by tile. See `AttentionRecipe` for the per-operand rules and `Trace` for what is
measured.

Caveats. Quantized operands that a real kernel would keep as codes are kept dequantized
(values exact, storage not); NaN spreads as far as the recipe's blocks carry it (a NaN
in one element of a block-scaled operand poisons its block, and with a per-tile tensor scale
its whole tile), while with unquantized operands it reaches exactly the rows that SDPA's
reaches.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fp4lab.analysis.trace import exact_count, operand_stats, prefix, product_stats
from fp4lab.formats import (
    FloatFormat,
    QuantSpec,
    Rounding,
    as_generator,
    hadamard_matrix,
    quantize_blocks,
    round_to_format,
)
from fp4lab.recipes import (
    AttentionRecipe,
    BackwardMode,
    BackwardP,
    DeltaSource,
    PQuant,
    Product,
    RowSum,
    Trace,
    TraceCall,
    resolve_recipe,
)

__all__ = ["attention", "patch_sdpa", "quantize_operand"]

# Elements of one block's tile tensor (batch, heads, query tiles, key tiles, block_m,
# block_n): the work runs in blocks of at most this size (memory ~ 20x this in floats).
_BLOCK_ELEMENTS = 1 << 20
_LOG2E = math.log2(math.e)
# malloc thresholds `_settle_allocator` sets (bytes): above every block temporary
_SETTLE_BYTES = 30 << 20
# Calls with at least this many score entries (B * H * Sq * Sk) get the allocator handling
_LARGE_SCORES = 1 << 22
# Relative slack when judging a block scale out of its format's range: NVFP4's tensor scale
# maps the tensor amax to exactly 448 up to float32 rounding, which is not an overflow.
_SLACK = 2.0**-20


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    recipe: AttentionRecipe | str = "exact",
    *,
    causal: bool = False,
    scale: float | None = None,
    trace: Trace | None = None,
    generator: torch.Generator | int | None = None,
    block_m: int = 128,
    block_n: int = 128,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention, FlashAttention-style, with quantized operands.

    Computes softmax(scale * Q K^T + mask) V for q (B, H, Sq, D), k (B, Hkv, Sk, D) and
    v (B, Hkv, Sk, Dv) and returns (B, H, Sq, Dv) in q's dtype, like
    `F.scaled_dot_product_attention`, with a backward, so it replaces SDPA in a model. H must
    be a multiple of Hkv: query head h uses key/value head h // (H / Hkv) (grouped-query
    attention in SDPA's ``enable_gqa=True`` layout). Each operand of the six products is
    quantized as `recipe` says; with the "exact" recipe this is FlashAttention-2 itself.

    Example::

        trace = Trace()
        out = attention(q, k, v, "fa4fp4_causal", causal=True, trace=trace)
        out.backward(do)
        frame = trace.to_frame()  # one row per (product, batch, head, q tile, k tile)
        frame[frame["product"] == "dv"].pivot_table("b_flushed", "q_tile", "k_tile")

    Args:
        q, k, v: floating-point tensors of one dtype and device. float64 inputs are computed
            in float64, all others in float32 (and returned in their own dtype); model
            float32 accumulation with float32 inputs.
        recipe: an `AttentionRecipe` or a registered name: a preset ("exact", "bf16",
            "fp8_per_tensor", "fa3_fp8", "sageattn3", "attn_qat_dropin", "attn_qat",
            "fa4fp4_directp", "fa4fp4_causal", "fa4fp4_causal_mxfp4pv", "croissattn"; each
            preset's ``doc`` cites its source and assumptions), a recipe the user registered
            with `fp4lab.formats.register`, or the name of a format or QuantSpec, meaning it
            on every operand ("nvfp4").
        causal: the causal mask aligned top-left exactly as SDPA's ``is_causal``: query i
            sees keys j <= i, whatever Sq and Sk. Pairs of tiles in which no query can see
            a key are skipped, as a kernel skips them (or, inside a block, contribute
            nothing), and are absent from the trace.
        scale: softmax scale; 1 / sqrt(D) by default.
        trace: a `Trace` that records per-tile statistics of this call: the forward's now,
            the backward's when backward() runs.
        generator: torch.Generator or int seed for stochastic rounding, required when the
            recipe rounds stochastically and recorded in the trace. The forward draws one key
            from it and the backward another after it, so one seed reproduces forward and
            backward bit for bit; every tile of every operand then rounds with its own
            stream, seeded by (key, operand, batch, head, query tile, key tile), so an
            element's draw depends on its position only, not on the batch size, the number
            of heads or how fp4lab chunks the work.
        block_m, block_n: query and key tile sizes, FlashAttention's Br and Bc (positive;
            multiples of the blocks P and dS are quantized in along them). Tiles need not
            divide Sq and Sk.
        attn_mask: optional mask broadcastable to (B, H, Sq, Sk), boolean (True takes part)
            or additive float, as SDPA's; it gets no gradient.

    What runs, per query tile i and key tile j (FlashAttention-2, Algorithm 1):

        S = scale * Q^_i K^_j^T (+ mask)             Q^, K^: recipe.q, recipe.k along D
        m' = max(m, rowmax S);  P = exp(S - m')      the online softmax's running max
        P^ = recipe.p_quant of P                      recipe.p along the keys, per tile
        l = e^(m - m') l + rowsum(P or P^)            recipe.row_sum
        acc = e^(m - m') acc + P^ V^_j                V^: recipe.v along the keys
        O = acc / l,  lse = m + log l

    and the backward (Algorithm 2) rebuilds P = exp(S - lse) from the quantized or
    unquantized Q, K (recipe.backward_p), takes D = rowsum(dO * O) (recipe.delta) and runs
    dV = P^T dO, dP = dO V^T, dS = P * (dP - D), dQ = scale dS K, dK = scale dS^T Q on the
    operands recipe.backward names (each quantized along its product's reduction axis).
    Q, K, V and dO are quantized once as whole tensors, P and dS tile by tile (a tensor
    scale of theirs is per tile). Softmax-invariant rewrites (K smoothing, incoherent
    processing) are applied to q, k before, as differentiable torch operations.

    Fully masked rows (a boolean mask that excludes every key of a row, or Sk = 0) give an
    output row of zeros and zero gradients, as SDPA's CPU and flash kernels do. NaN in q or
    k reaches the rows that attend to it; NaN in v reaches every row of each query tile that
    sees its key (a masked-out zero of P times NaN is NaN in the tile's product, so with a
    causal mask a few earlier rows of that tile turn NaN too; SDPA's math backend spreads it
    further). Through quantization it also reaches the rows that share a block (or a tensor
    scale) with it; the trace counts it.

    Cost: vectorised over batch, heads and tiles, in blocks of query tiles by key tiles
    that bound memory (it grows with seq x block_n, never seq^2). On a 2-core CPU, NVFP4 on
    all six products runs forward and backward in about 2x the time of plain float32
    torch attention, 3.5x to 4x with a trace (benchmarks/RESULTS.md).

    Raises:
        TypeError: q, k, v not floating-point tensors of one dtype; a recipe of a wrong type.
        ValueError: shapes that do not agree, different devices, an unknown recipe, a
            head_dim or tile size the recipe's blocks cannot tile, a stochastic recipe
            without a generator, a bad attn_mask.
    """
    recipe = resolve_recipe(recipe)
    _check_inputs(q, k, v, attn_mask)
    _check_tiling(recipe, q.shape[-1], v.shape[-1], block_m, block_n)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    gen = _generator(recipe, generator)
    if q.shape[2] == 0:  # no queries: an empty output, still connected to the inputs' graph
        return q.new_zeros(*q.shape[:3], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
    q, k = _transform_qk(q, k, recipe)
    config = _Config(
        recipe=recipe, causal=bool(causal), scale=float(scale), block_m=block_m,
        block_n=block_n, generator=gen, trace=trace, attn_mask=attn_mask,
        seed=generator if isinstance(generator, int) and not isinstance(generator, bool) else None,
    )
    return _Attention.apply(q, k, v, config)


@contextlib.contextmanager
def patch_sdpa(recipe: AttentionRecipe | str, trace: Trace | None = None, **options):
    """Route `torch.nn.functional.scaled_dot_product_attention` through `attention`.

    Inside the ``with`` block every SDPA call (its query, key, value, attn_mask, is_causal,
    scale and enable_gqa) runs `attention` with `recipe`, recording into `trace` (one call
    index per SDPA call, so per layer); `options` (generator, block_m, block_n) are passed
    on; an int seed becomes one torch.Generator for the whole block, so successive calls
    (layers, steps) draw fresh stochastic-rounding noise from one reproducible stream. 3-D inputs (N, L, E) are treated as one head. dropout_p > 0 raises ValueError: the
    simulation has no dropout. Calls that look the function up on `torch.nn.functional`
    when they run are routed (nn.MultiheadAttention, most model code); a module that bound
    the function to its own name before the block keeps calling the original.
    """
    recipe = resolve_recipe(recipe)
    original = F.scaled_dot_product_attention
    if "generator" in options:  # one stream for all calls: an int seed would repeat its draws
        options["generator"] = as_generator(options["generator"])

    def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if dropout_p:
            raise ValueError(f"dropout_p={dropout_p}: fp4lab's attention has no dropout; set it to 0")
        if query.shape[-3] != key.shape[-3] and query.ndim == 4 and not enable_gqa:
            raise ValueError("query and key have different head counts; SDPA needs enable_gqa=True for that")
        squeeze = query.ndim == 3
        if squeeze:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            attn_mask = attn_mask.unsqueeze(1) if attn_mask is not None and attn_mask.ndim == 3 else attn_mask
        out = attention(
            query, key, value, recipe, causal=is_causal, scale=scale, trace=trace,
            attn_mask=attn_mask, **options,
        )
        return out.squeeze(1) if squeeze else out

    F.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


# -- input checks -----------------------------------------------------------------------------
def _check_inputs(q, k, v, attn_mask) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.ndim != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(x.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in (batch, heads, seq), got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of k's heads ({k.shape[1]})")
    if attn_mask is not None:
        _check_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.device)


def _check_mask(mask, shape, device) -> None:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"attn_mask must be boolean or floating point, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"attn_mask must be on q's device {device}, got {mask.device}")
    try:
        torch.broadcast_shapes(mask.shape, shape)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(mask.shape)} does not broadcast to {shape}") from None
    if mask.ndim > 4 or (mask.ndim == 4 and mask.shape[1] not in (1, shape[1])):
        raise ValueError(f"attn_mask must broadcast to (B, H, Sq, Sk) = {shape}, got {tuple(mask.shape)}")


# Each operand field: (axis its 1-D blocks run along in its tensor, what that axis spans,
# what a 2-D tile's rows span, what its columns span). Q, K, V, dO are whole tensors
# (B, H, seq, dim); P and dS are tiles (..., block_m, block_n).
_LAYOUT = {
    "q": (-1, "head_dim", "seq", "head_dim"),
    "k": (-1, "head_dim", "seq", "head_dim"),
    "p": (-1, "block_n", "block_m", "block_n"),
    "v": (-2, "seq", "seq", "v_dim"),
    "dv_p": (-2, "block_m", "block_m", "block_n"),
    "dv_do": (-2, "seq", "seq", "v_dim"),
    "dp_do": (-1, "v_dim", "seq", "v_dim"),
    "dp_v": (-1, "v_dim", "seq", "v_dim"),
    "dq_ds": (-1, "block_n", "block_m", "block_n"),
    "dq_k": (-2, "seq", "seq", "head_dim"),
    "dk_ds": (-2, "block_m", "block_m", "block_n"),
    "dk_q": (-2, "seq", "seq", "head_dim"),
}


# P and dS exist only inside the kernel: quantized tile by tile, after their prescale.
_TILE_FIELDS = {"p": "p_lift", "dv_p": "p_lift", "dq_ds": "ds_lift", "dk_ds": "ds_lift"}


def _check_tiling(recipe: AttentionRecipe, d: int, dv: int, block_m: int, block_n: int) -> None:
    """Blocks must tile head_dim (or cover it whole) and, for P and dS, the tiles."""
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if recipe.incoherent_processing and (d & (d - 1) or d < 2):
        raise ValueError(
            f"head_dim={d}: recipe {recipe.name!r} rotates Q and K by a Hadamard matrix, "
            "which needs a power of two"
        )
    sizes = {"head_dim": d, "v_dim": dv, "block_m": block_m, "block_n": block_n, "seq": None}
    for field, (_, along, rows, cols) in _LAYOUT.items():
        spec = getattr(recipe, field)
        if not isinstance(spec, QuantSpec) or spec.block is None:
            continue
        pairs = [(spec.block[0], along)] if len(spec.block) == 1 else [(spec.block[0], rows), (spec.block[1], cols)]
        for block, what in pairs:
            _check_divides(recipe, field, block, what, sizes[what])


def _check_divides(recipe, field, block, what, size) -> None:
    if size is None or size % block == 0:
        return  # a whole tensor along its sequence is padded, as fake_quantize pads it
    if what in ("head_dim", "v_dim") and block >= size:
        return  # one block covers the whole dimension (zero padding keeps its amax)
    raise ValueError(
        f"{what}={size} is not a multiple of {block}, the block size of operand {field!r} of "
        f"recipe {recipe.name!r}: its blocks cannot tile it"
    )


def _generator(recipe: AttentionRecipe, generator) -> torch.Generator | None:
    gen = as_generator(generator)
    if recipe.stochastic and gen is None:
        raise ValueError(
            f"generator: recipe {recipe.name!r} rounds stochastically; pass a torch.Generator "
            "or an int seed (fp4lab never draws from torch's global random state)"
        )
    return gen


def _transform_qk(q, k, recipe: AttentionRecipe):
    """Softmax-invariant rewrites applied before the kernel (differentiable torch ops)."""
    if recipe.incoherent_processing:  # FlashAttention-3, Sec. 3.3: (Q H)(K H)^T = Q K^T
        h = hadamard_matrix(q.shape[-1], recipe.incoherent_seed, torch.float64).to(q.device)
        q, k = (q.to(torch.float64) @ h).to(q.dtype), (k.to(torch.float64) @ h).to(k.dtype)
    if recipe.smooth_k:  # SageAttention: each row of S shifts by q_i . mean(K)
        k = k - k.mean(dim=-2, keepdim=True)
    return q, k


@dataclass(frozen=True)
class _Config:
    recipe: AttentionRecipe
    causal: bool
    scale: float
    block_m: int
    block_n: int
    generator: torch.Generator | None
    trace: Trace | None
    attn_mask: torch.Tensor | None
    seed: int | None = None  # the int seed the caller gave, if any (then the run reproduces)


# -- operand quantization ----------------------------------------------------------------------
def _is_2d(spec) -> bool:
    return isinstance(spec, QuantSpec) and spec.block is not None and len(spec.block) == 2


@dataclass
class _Quantized:
    """An operand after quantization and, when asked, `counts` for the trace: "clipped"
    (elements past the block's largest value), "blocks" (blocks holding a nonzero),
    "scale_underflow" and "scale_overflow" (such blocks whose scale left its format's range),
    as counts per tile (per_tile) or, for whole tensors, boolean tensors of the operand's
    shape (blocks marked at their first element); None entries where there are no scales."""

    values: torch.Tensor
    counts: dict | None = None


def quantize_operand(
    x: torch.Tensor,
    spec: QuantSpec | FloatFormat | None,
    *,
    axis: int,
    generator: torch.Generator | None = None,
    per_tile: bool = False,
    prescale: float = 1.0,
    flags: bool = False,
    noise: torch.Tensor | None = None,
) -> _Quantized:
    """Quantize one operand as attention does: `fake_quantize(x * prescale, spec) / prescale`.

    A FloatFormat is an element-wise cast (round to nearest even, saturating); None leaves
    x as it is; 2-D tiles lie on x's last two dims as they are (axis ignored). With
    `per_tile`, x is a batch of tiles (its last two dims) and a per-tensor scale (a spec with
    `block=None` or `tensor_scale=True`) is taken per tile, as a fused kernel must; otherwise
    over the whole of x. Stochastic rounding draws from `generator`, or uses `noise`
    (uniforms of x's shape) when given. The arithmetic is fp4lab.formats' quantize
    pipeline, step for step.
    """
    if spec is None:
        return _Quantized(x, None)
    xs = x * prescale if prescale != 1.0 else x
    if isinstance(spec, FloatFormat):
        values = round_to_format(xs, spec)
        found = None
        if flags:
            clipped = xs.abs() > spec.max
            found = {"clipped": clipped.sum((-2, -1)) if per_tile else clipped}
    else:
        values, found = _block_quantize(xs, spec, axis, generator, per_tile, flags, noise)
    if prescale != 1.0:
        values = values / prescale
    return _Quantized(values, found)


def _quantize_field(x, recipe: AttentionRecipe, field: str, draws, flags: bool, at=None) -> _Quantized:
    """Operand `field` of `recipe`, along its product's reduction axis (`_LAYOUT`); a
    stochastic spec rounds with `draws` (a `_Draws`) at the operand's position: a tile
    tensor's first (query tile, key tile) `at`, or a whole tensor."""
    spec = getattr(recipe, field)
    prescale = getattr(recipe, _TILE_FIELDS[field]) if field in _TILE_FIELDS else 1.0
    return quantize_operand(
        x, spec, axis=_LAYOUT[field][0], per_tile=field in _TILE_FIELDS, prescale=prescale,
        flags=flags, noise=draws.for_operand(field, x, at) if _stochastic(spec) else None,
    )


def _stochastic(spec) -> bool:
    return isinstance(spec, QuantSpec) and spec.rounding is Rounding.STOCHASTIC


_MASK64 = (1 << 64) - 1
_QUERY_SIDE = {"q", "dv_do", "dp_do", "dk_q"}  # whole-tensor operands tiled like the queries
# Each operand's id in the noise seeds (append only: changing one changes every draw).
_FIELD_IDS = {
    name: i for i, name in enumerate(
        ("q", "k", "v", "p", "dv_p", "dv_do", "dp_do", "dp_v", "dq_ds", "dq_k", "dk_ds", "dk_q")
    )
}


def _mix(*values: int) -> int:
    """A 64-bit hash of a sequence of ints (splitmix64's finalizer, chained): the same on
    every machine and Python version."""
    h = 0
    for v in values:
        h = (h ^ (v & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h


class _Draws:
    """Stochastic rounding's uniforms, keyed by position.

    One key of 62 bits is drawn from the call's generator (the forward draws one, the
    backward another after it). Every tile of every operand then has its own stream: a
    Philox4x64 counter-based generator (numpy's) whose key is a 64-bit hash of (key,
    operand, batch, query head or KV head, query tile, key tile); a whole-tensor operand's
    tiles are its block_m (query side) or block_n (key side) rows of one (batch, head). Two
    tiles share a stream only if their 64-bit hashes collide (torch's CPU generator would
    keep 32 bits of a seed, and streams would collide within a long run). So an element's
    draw depends on the seed, the operand and its position alone: not on how fp4lab chunks
    the work, nor on the batch size or the number of heads of the call. Draws are float64
    uniforms with 53 random bits, made on the CPU and moved to the operand's device, so
    every device rounds alike."""

    def __init__(self, generator: torch.Generator, t: _Tiling):
        device = generator.device
        self.key = int(torch.randint(0, 1 << 62, (1,), generator=generator, device=device).item())
        self.rows = {"query": t.bm, "key": t.bn}  # a whole-tensor tile's rows, by side

    def _uniforms(self, *position: int, shape) -> torch.Tensor:
        stream = np.random.Generator(np.random.Philox(key=_mix(self.key, *position)))
        return torch.from_numpy(stream.random(shape))

    def for_operand(self, field: str, x: torch.Tensor, at) -> torch.Tensor:
        """Uniforms of x's shape: x a block of tiles (B, Hkv, G, n, g, r, c) whose first
        tile is (query tile, key tile) `at`, or, when `at` is None, a whole tensor
        (B, heads, seq, E) taken in tiles of block_m (query side) or block_n rows."""
        fid = _FIELD_IDS[field]
        out = torch.empty(x.shape, dtype=torch.float64)
        if at is not None:
            i0, j0 = at
            b_, hk_, g_, n_, m_ = x.shape[:5]
            for b, hk, g, i, j in itertools.product(range(b_), range(hk_), range(g_), range(n_), range(m_)):
                out[b, hk, g, i, j] = self._uniforms(fid, b, hk * g_ + g, i0 + i, j0 + j, shape=x.shape[-2:])
        else:
            rows = self.rows["query" if field in _QUERY_SIDE else "key"]
            for b, h, i in itertools.product(range(x.shape[0]), range(x.shape[1]), range(-(-x.shape[2] // rows))):
                part = out[b, h, i * rows : (i + 1) * rows]
                part.copy_(self._uniforms(fid, b, h, i, shape=(rows, x.shape[3]))[: part.shape[0]])
        return out.to(x.device)


def _block_quantize(x, spec: QuantSpec, axis: int, generator, per_tile: bool, want_flags: bool, noise=None):
    """fp4lab.formats' quantize pipeline and its dequantization (`quantize_blocks`), with the
    second-level scale taken over the whole of x or, with per_tile, over each tile (the last
    two dims: batch_dims = x.ndim - 2)."""
    if _is_2d(spec):
        axis = -1  # 2-D tiles lie on the natural layout
    elif spec.block is None and per_tile:
        if spec.hadamard is not None:
            raise ValueError(f"spec {spec.name!r}: a per-tile scale does not combine with a Hadamard transform")
        # one scale per tile: a 2-D block covering the tile (then the flags' sums below hold)
        spec, axis = dataclasses.replace(spec, block=tuple(x.shape[-2:])), -1
    batch_dims = x.ndim - 2 if per_tile and spec.tensor_scale else 0
    b = quantize_blocks(x, spec, axis=axis, generator=generator, batch_dims=batch_dims, noise=noise)
    found = _flags(b.scaled, b.amax, b.decode, spec, b.layout, per_tile) if want_flags else None
    return b.dequantize(x.dtype), found


def _flags(scaled, amax, decode, spec: QuantSpec, layout, per_tile: bool) -> dict:
    """The trace's counts (see `_Quantized`) from the scaled elements (blocks, before
    rounding; overwritten here) and the block amax."""
    d = decode if decode is not None else torch.ones((), dtype=torch.float32)
    clipped = scaled.abs_().sub_(spec.element.max).clamp_(min=0).sign_()  # |x| > M_e s d: saturated
    ideal = amax / (spec.element.max * d)  # beyond the float32 rounding of the scale chain:
    blocks = {
        "blocks": amax > 0,
        "scale_underflow": (amax > 0) & (ideal < spec.scale.min_subnormal * (1 - _SLACK)),
        "scale_overflow": ideal > spec.scale.max * (1 + _SLACK),
    }
    if per_tile:  # a tile is the last two block dims
        return {"clipped": exact_count(clipped, (-3, -2, -1)), **{k: v.sum((-2, -1)) for k, v in blocks.items()}}
    marks = {}
    for name, flag in blocks.items():  # each block marked at its first element
        mark = torch.zeros(scaled.shape, dtype=torch.bool, device=scaled.device)
        mark[..., 0] = flag
        marks[name] = layout.from_blocks(mark)
    return {"clipped": layout.from_blocks(clipped.bool()), **marks}


# -- tiling -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tiling:
    """Shapes and tiles. Query-side tensors are kept as (B, Hkv, G, nQ, block_m, E), query
    head h = kv_head * G + g; key-side tensors as (B, Hkv, nK, block_n, E). The work runs
    in blocks of n query tiles by g key tiles, whose tile tensors are
    (B, Hkv, G, n, g, block_m, block_n)."""

    B: int
    H: int
    Hk: int
    Sq: int
    Sk: int
    bm: int
    bn: int
    causal: bool

    @property
    def G(self) -> int:
        return self.H // self.Hk

    @property
    def nQ(self) -> int:
        return -(-self.Sq // self.bm)

    @property
    def nK(self) -> int:
        return -(-self.Sk // self.bn)

    def q_tiles(self, x):  # (B, H, Sq, ...) -> (B, Hkv, G, nQ, bm, ...)
        if self.nQ * self.bm != self.Sq:  # (F.pad copies even when it pads nothing)
            x = F.pad(x, [0, 0] * (x.ndim - 3) + [0, self.nQ * self.bm - self.Sq])
        return x.reshape(self.B, self.Hk, self.G, self.nQ, self.bm, *x.shape[3:])

    def q_untile(self, t):  # (B, Hkv, G, nQ, bm, ...) -> (B, H, Sq, ...)
        return t.reshape(self.B, self.H, self.nQ * self.bm, *t.shape[5:])[:, :, : self.Sq]

    def k_tiles(self, x):  # (B, Hkv, Sk, E) -> (B, Hkv, nK, bn, E)
        if self.nK * self.bn != self.Sk:
            x = F.pad(x, (0, 0, 0, self.nK * self.bn - self.Sk))
        return x.reshape(self.B, self.Hk, self.nK, self.bn, x.shape[-1])

    def k_untile(self, t):  # (B, Hkv, nK, bn, E) -> (B, Hkv, Sk, E)
        return t.reshape(self.B, self.Hk, self.nK * self.bn, t.shape[-1])[:, :, : self.Sk]

    def blocks(self) -> list[tuple[int, int, list[tuple[int, int]]]]:
        """Chunks of query tiles [i0, i1), each with the groups of key tiles [j0, j1) it
        visits, in order; a block's tile tensor holds at most _BLOCK_ELEMENTS elements
        (or one tile pair per (batch, head)). A chunk takes every key tile at once when
        they fit, and then as many query tiles as fit."""
        tiles = max(1, _BLOCK_ELEMENTS // max(self.B * self.H * self.bm * self.bn, 1))
        group = min(tiles, max(self.nK, 1))
        step = max(1, tiles // group)
        out = []
        for i0 in range(0, self.nQ, step):
            i1 = min(i0 + step, self.nQ)
            seen = self.key_tiles_seen(i0, i1)
            out.append((i0, i1, [(j, min(j + group, seen)) for j in range(0, seen, group)]))
        return out

    def key_tiles_seen(self, i0: int, i1: int) -> int:
        """How many key tiles (a prefix) the queries of tiles [i0, i1) can see."""
        if not self.causal:
            return self.nK
        last_row = min(i1 * self.bm, self.Sq) - 1
        return min(self.nK, last_row // self.bn + 1)

    def valid(self, i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor:
        """(n, g, bm, bn) bool: in range, and not masked by causality."""
        rows = torch.arange(i0 * self.bm, i1 * self.bm, device=device).view(i1 - i0, 1, self.bm, 1)
        cols = torch.arange(j0 * self.bn, j1 * self.bn, device=device).view(1, j1 - j0, 1, self.bn)
        ok = (rows < self.Sq) & (cols < self.Sk)
        return ok & (cols <= rows) if self.causal else ok

    def visible(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """(n, g) bool (CPU): the tiles with a (query, key) pair that the lengths and the
        causal mask leave, the tiles a kernel visits; the trace records only these."""
        i = torch.arange(i0, i1).view(-1, 1)
        first_col = torch.arange(j0, j1).view(1, -1) * self.bn
        ok = (i * self.bm < self.Sq) & (first_col < self.Sk)
        if self.causal:
            ok = ok & (first_col <= torch.clamp((i + 1) * self.bm, max=self.Sq) - 1)
        return ok


class _MaskTiles:
    """attn_mask as tiles: (B|1, Hkv|1, G|1, nQ, nK, bm, bn), padded with 'masked'."""

    def __init__(self, mask: torch.Tensor, t: _Tiling):
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
        mask = mask.expand(mask.shape[0], mask.shape[1], t.Sq, t.Sk)
        heads = (t.Hk, t.G) if mask.shape[1] == t.H else (1, 1)
        fill = False if mask.dtype == torch.bool else -math.inf
        mask = F.pad(mask, (0, t.nK * t.bn - t.Sk, 0, t.nQ * t.bm - t.Sq), value=fill)
        self.tiles = mask.reshape(mask.shape[0], *heads, t.nQ, t.bm, t.nK, t.bn).transpose(-3, -2)
        self.boolean = mask.dtype == torch.bool

    def apply(self, s: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        tile = self.tiles[:, :, :, i0:i1, j0:j1]
        if self.boolean:
            return s.masked_fill(~tile, -math.inf)
        return s + tile.to(s.dtype)


# -- P quantization ------------------------------------------------------------------------------
def _quantize_p(p, s, m_row, recipe: AttentionRecipe, draws, flags: bool, at) -> _Quantized:
    """P^ from P = exp(S - m_row) as `recipe.p_quant` says (a block of tiles (..., bm, bn)
    whose first tile is `at`)."""
    if recipe.p_quant is PQuant.SPEC:
        return _quantize_field(p, recipe, "p", draws, flags, at)
    if recipe.p_quant is PQuant.ROW_SCALED:  # SageAttention3: rows' max mapped to M_e * M_s
        top = recipe.p.element.max * recipe.p.scale.max
        rowmax = p.amax(dim=-1, keepdim=True)
        r = torch.where(rowmax > 0, top / rowmax, torch.ones_like(rowmax))
        noise = draws.for_operand("p", p, at) if _stochastic(recipe.p) else None
        out = quantize_operand(p * r, recipe.p, axis=-1, per_tile=True, flags=flags, noise=noise)
        return _Quantized(out.values / r, out.counts)
    return _direct_p(s, m_row, recipe, flags)


def _direct_p(s, m_row, recipe: AttentionRecipe, flags: bool) -> _Quantized:
    """Direct-P (fp4-fa4 technical report, Sec. 4): E2M1 codes straight from the scores.

    Per block B of n keys: e_B = ceil(log2 max_j P_ij), x = (z - m) log2(e) - e_B + log2(M_e),
    q = E2M1(2^x) or E2M1(max(0, A x + B)); the represented P is 2^e_B q / M_e.
    """
    spec = recipe.p
    n, m_e = spec.block[0], spec.element.max
    z = (s - m_row.unsqueeze(-1)) * _LOG2E  # log2 P, (..., bm, bn)
    zb = z.reshape(*z.shape[:-1], -1, n)  # (..., bm, bn / n, n)
    lo, hi = math.log2(spec.scale.min_subnormal), math.log2(spec.scale.max)
    e_b = torch.ceil(zb.amax(dim=-1, keepdim=True)).clamp(lo, hi)
    x = zb - e_b + math.log2(m_e)
    u = torch.exp2(x) if recipe.direct_p_affine is None else (recipe.direct_p_affine[0] * x + recipe.direct_p_affine[1]).clamp(min=0)
    codes = round_to_format(u, spec.element)
    p_hat = (torch.exp2(e_b) * codes / m_e).reshape(z.shape)
    found = None
    if flags:  # codes past M_e; e_B clamped at the scale format's bottom (no overflow)
        nonzero = (zb.amax(dim=-1) > -math.inf).sum((-2, -1))
        under = ((e_b.squeeze(-1) == lo) & (zb.amax(dim=-1) > -math.inf)).sum((-2, -1))
        found = {
            "clipped": (u > m_e).sum((-3, -2, -1)), "blocks": nonzero, "scale_underflow": under,
            "scale_overflow": torch.zeros_like(under),
        }
    return _Quantized(p_hat, found)


# -- the online softmax -------------------------------------------------------------------------
class _Running:
    """The online softmax of a chunk of query tiles: the running row maximum m
    (B, Hkv, G, n, bm) and the sums it rescales (l, acc, ...), advanced a block of key tiles
    at a time."""

    def __init__(self, shape, dv: int, dtype, device):
        self.m = torch.full(shape, -math.inf, dtype=dtype, device=device)
        zeros = lambda *extra: torch.zeros(shape + extra, dtype=dtype, device=device)  # noqa: E731
        self.sums: dict[str, torch.Tensor] = {"l": zeros(), "acc": zeros(dv)}

    def step(self, s: torch.Tensor, consume: bool = False):
        """-- update m -- over a block of scores s (..., n, g, bm, bn), key tile by key tile:
        m_j = max(m, rowmax S_1, ..., rowmax S_j), the maximum a kernel holds after key tile j
        (a cumulative maximum gives every m_j at once, the same values as the loop). Returns
        P = exp(S_j - m_j), m_j (0 where a row has seen nothing yet) (..., n, g, bm), and the
        weights (alpha, w) that bring the old sums and each tile's terms to the block's last
        maximum m_end: alpha = exp(m - m_end), w_j = exp(m_j - m_end). With `consume`, P is
        computed in s's memory."""
        m_tiles = torch.maximum(torch.cummax(s.amax(dim=-1), dim=-2).values, self.m.unsqueeze(-2))
        m_end = m_tiles[..., -1, :]
        end = torch.where(m_end == -math.inf, 0.0, m_end)
        m_use = torch.where(m_tiles == -math.inf, 0.0, m_tiles)
        weights = (torch.exp(self.m - end), torch.exp(m_tiles - end.unsqueeze(-2)))
        self.m = m_end
        p = s.sub_(m_use.unsqueeze(-1)) if consume else s - m_use.unsqueeze(-1)
        return p.exp_(), m_use, weights

    def add(self, name: str, weights, value: torch.Tensor) -> None:
        """-- update a sum (created up front) --: sum = alpha * sum + sum_j w_j value_j, for the terms
        value (..., n, g, bm[, E]) of the block's key tiles j."""
        alpha, w = weights
        if value.ndim > w.ndim:
            alpha, w = alpha.unsqueeze(-1), w.unsqueeze(-1)
        total = (value * w.to(value.dtype)).sum(dim=4)
        self.sums[name].mul_(alpha.to(total.dtype)).add_(total)

    def finish(self, acc: str, denominator: str):
        """O = acc / l (0 for fully masked rows, as SDPA) and lse = m + log l (+inf there, so
        that the backward's exp(S - lse) is 0)."""
        denom = self.sums[denominator]
        empty = denom == 0
        out = torch.where(empty.unsqueeze(-1), 0.0, self.sums[acc] / denom.unsqueeze(-1))
        lse = torch.where(empty, math.inf, self.m + torch.log(denom))
        return out, lse


@dataclass
class _Operands:
    """Tiled operands of one call: query side (B, Hkv, G, nQ, bm, E), key side
    (B, Hkv, nK, bn, E); `stats` holds the whole-tensor operands' per-tile statistics."""

    q: torch.Tensor  # Q^ (smoothed when smooth_q), the scores' left operand
    k: torch.Tensor  # K^, the scores' right operand
    mu: torch.Tensor | None  # per-query-tile mean of Q (smooth_q), (B, Hkv, G, nQ, 1, D)
    k_plain: torch.Tensor  # unquantized K (for the mean's correction term)
    stats: dict


# Products of a block, one per tile pair (i, j) (the trace needs each tile's product):
def _pairs(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_i y_j^T for query tiles x (B, Hkv, G, n, r, c) and key tiles y (B, Hkv, g, e, c):
    (B, Hkv, G, n, g, r, e) (S = Q K^T, dP = dO V^T)."""
    return x.unsqueeze(4) @ y.transpose(-1, -2)[:, :, None, None]


def _times_key(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_ij y_j for tiles x (B, Hkv, G, n, g, r, c) and key tiles y (B, Hkv, g, c, e):
    (B, Hkv, G, n, g, r, e) (P V, dS K)."""
    return x @ y[:, :, None, None]


def _t_times_query(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x_ij^T y_i for tiles x (B, Hkv, G, n, g, r, c) and query tiles y (B, Hkv, G, n, r, e):
    (B, Hkv, G, n, g, c, e) (P^T dO, dS^T Q: each query tile's part of dV_j, dK_j)."""
    return x.transpose(-1, -2) @ y.unsqueeze(4)


def _scores(ops: _Operands, cfg: _Config, t: _Tiling, mask, i0: int, i1: int, j0: int, j1: int):
    """Scores of query tiles [i0, i1) against key tiles [j0, j1), before and after masking,
    and whether the masks left every entry (then the trace need not mask its statistics)."""
    s = _pairs(ops.q[:, :, :, i0:i1], ops.k[:, :, j0:j1]).mul_(cfg.scale)
    if ops.mu is not None:  # SageAttention2's correction term, in the working precision
        s = s + cfg.scale * _pairs(ops.mu[:, :, :, i0:i1], ops.k_plain[:, :, j0:j1])
    masked = s if mask is None else mask.apply(s, i0, i1, j0, j1)
    valid = t.valid(i0, i1, j0, j1, s.device)
    full = mask is None and bool(valid.all())
    return s, (masked if full else masked.masked_fill(~valid, -math.inf)), full


class _ZeroDraws:
    """Uniforms that are all 0, where the draws do not matter (see `_forward_flags`)."""

    def for_operand(self, field: str, x: torch.Tensor, at) -> torch.Tensor:
        return torch.zeros(x.shape, dtype=torch.float64, device=x.device)


def _hidden(t: _Tiling, i0: int, i1: int, j0: int, j1: int, device) -> torch.Tensor | None:
    """The block's tile pairs no query of theirs can see (causal), as a (n, g, 1, 1) mask on
    `device`, or None when there are none. A kernel never visits them; here their products
    are zeroed (P is 0 there, but 0 * NaN in V or dO would be NaN)."""
    hidden = ~t.visible(i0, i1, j0, j1)
    return hidden.to(device)[..., None, None] if bool(hidden.any()) else None


def _hide(x: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """x (..., n, g, r, c) with the tile pairs `hidden` marks set to 0 (in place)."""
    return x if hidden is None else x.masked_fill_(hidden, 0)


def _smooth_q(qw: torch.Tensor, t: _Tiling):
    """Q minus its mean over each query tile's rows, and that mean (B, Hkv, G, nQ, 1, D)."""
    tiles = t.q_tiles(qw)
    rows = torch.arange(t.nQ * t.bm, device=qw.device).view(t.nQ, t.bm, 1) < t.Sq
    mu = tiles.sum(dim=-2, keepdim=True) / rows.sum(dim=-2, keepdim=True)
    return qw - t.q_untile(mu.expand_as(tiles)), mu


def _whole_stats(x, quant: _Quantized, tiler) -> dict:
    """Per-tile operand statistics of a whole-tensor operand."""
    counts = None
    if quant.counts is not None:
        tile_sum = lambda f: tiler(f.to(torch.uint8)).sum((-2, -1))  # noqa: E731
        counts = {k: tile_sum(f) if f is not None else None for k, f in quant.counts.items()}
    return operand_stats(tiler(x), tiler(quant.values), counts)


def _grams(x: torch.Tensor, x_hat: torch.Tensor, tiler) -> tuple:
    """Per-tile Gram matrices of a whole-tensor operand in float64, flattened, for
    `_gram_product_stats`: (X^T X, X^^T X, X^^T X^), each (..., tiles, E * E)."""
    t, th = tiler(x).double(), tiler(x_hat).double()
    gram = lambda a, b: (a.transpose(-1, -2) @ b).flatten(-2)  # noqa: E731
    return gram(t, t), gram(th, t), gram(th, th)


def _gram_product_stats(a: tuple, b: tuple, i0: int, i1: int, j0: int, j1: int, y: torch.Tensor) -> dict:
    """``prod_err`` of every tile pair (i, j) of y^ = A^_i B^_j^T against y = A_i B_j^T
    (S = Q K^T, dP = dO V^T), in float64 from the tiles' Gram matrices (`_grams` of the
    query-side operand A and the key-side operand B), never forming y:
    ||y||^2 = <A^T A, B^T B>, <y^, y> = <A^^T A, B^^T B>, ||y^||^2 = <A^^T A^, B^^T B^>,
    ||y^ - y||^2 = ||y^||^2 - 2 <y^, y> + ||y||^2. This is the exact product of the
    quantized operands against the exact product of the unquantized ones (the simulation's
    own float32 rounding of y^, ~1e-7, is not in it), with float64 rounding: errors from
    about 1e-7 up are resolved. y (..., n, g, r, c) is read only to count NaN."""
    def inner(x, z):  # <x_i, z_j> for every pair: (B, Hkv, G, n, g)
        return x[:, :, :, i0:i1] @ z[:, :, j0:j1].transpose(-1, -2)[:, :, None]

    ref, cross, quant = (inner(x, z) for x, z in zip(a, b, strict=True))
    err2 = (quant - 2 * cross + ref).clamp_(min=0)
    err = torch.where(err2 == 0, 0.0, (err2 / ref).sqrt())
    nan = torch.zeros_like(err) if bool(torch.isfinite(err).all()) else torch.isnan(y).sum((-2, -1)).double()
    return {"prod_err": err, "prod_nan": nan}


def _masked_product_stats(y, y_ref, keep, overwrite: bool = True) -> dict:
    """product_stats over the entries `keep` leaves (all when None); y_ref is scratch
    unless `overwrite` is False."""
    if keep is None:
        return product_stats(y, y_ref, overwrite=overwrite)
    return product_stats(y.masked_fill(~keep, 0), y_ref.masked_fill(~keep, 0), overwrite=True)


def _q_block(stats: dict, i0: int, i1: int, like: torch.Tensor) -> dict:
    """Query-tile statistics (B, Hkv, G, nQ) of tiles [i0, i1), broadcast to like's
    (B, Hkv, G, n, g)."""
    return {k: v[:, :, :, i0:i1, None].expand_as(like) for k, v in stats.items()}


def _k_block(stats: dict, j0: int, j1: int, like: torch.Tensor) -> dict:
    """Key-tile statistics (B, Hkv, nK) of tiles [j0, j1), broadcast to like's shape."""
    return {k: v[:, :, None, None, j0:j1].expand_as(like) for k, v in stats.items()}


def _mask_tiles(cfg: _Config, t: _Tiling):
    return None if cfg.attn_mask is None else _MaskTiles(cfg.attn_mask, t)


# -- forward ---------------------------------------------------------------------------------------
def _forward(q, k, v, cfg: _Config, t: _Tiling, rec: TraceCall | None):
    """FlashAttention-2's forward (Algorithm 1) over query-tile chunks; returns
    (O, lse tiles, O' or None, saved tensors)."""
    recipe, work = cfg.recipe, _work_dtype(q)
    qw, kw, vw = q.to(work), k.to(work), v.to(work)
    q_src, mu = _smooth_q(qw, t) if recipe.smooth_q else (qw, None)
    tracing = rec is not None
    draws = _Draws(cfg.generator, t) if recipe.stochastic else None
    q_hat, k_hat, v_hat = (
        _quantize_field(x, recipe, field, draws, tracing) for x, field in ((q_src, "q"), (kw, "k"), (vw, "v"))
    )
    stats = {}
    if tracing:
        stats = {
            "q": _whole_stats(q_src, q_hat, t.q_tiles), "k": _whole_stats(kw, k_hat, t.k_tiles),
            "v": _whole_stats(vw, v_hat, t.k_tiles),
            "ref": tuple(x.to(rec.meta["reference_dtype"]) for x in (qw, kw, vw)),
        }
        if not recipe.smooth_q:  # the scores are Q^ K^^T: their errors come from Gram matrices
            stats["grams"] = (_grams(q_src, q_hat.values, t.q_tiles), _grams(kw, k_hat.values, t.k_tiles))
    ops = _Operands(t.q_tiles(q_hat.values), t.k_tiles(k_hat.values), mu, t.k_tiles(kw), stats)
    v_tiles = t.k_tiles(v_hat.values)
    mask = _mask_tiles(cfg, t)
    # outputs are written into tensors allocated up front: chunk results kept alive in a list
    # would pin malloc's heap above each block's temporaries and make it creep
    o = torch.empty(t.B, t.Hk, t.G, t.nQ, t.bm, v.shape[-1], dtype=work, device=q.device)
    lse = torch.empty(t.B, t.Hk, t.G, t.nQ, t.bm, dtype=work, device=q.device)
    o_prime = torch.empty_like(o) if recipe.delta is DeltaSource.UNQUANTIZED_P_OUTPUT else None
    for i0, i1, groups in t.blocks():
        pieces = _forward_chunk(ops, v_tiles, cfg, t, mask, i0, i1, groups, draws, rec)
        for whole, piece in zip((o, lse, o_prime), pieces, strict=True):
            if whole is not None:
                whole[:, :, :, i0:i1] = piece
        del pieces
    saved = (q_hat.values, k_hat.values, v_hat.values, mu)
    return t.q_untile(o), lse, (t.q_untile(o_prime) if o_prime is not None else None), saved


def _forward_chunk(ops, v_tiles, cfg: _Config, t: _Tiling, mask, i0: int, i1: int, groups, draws, rec):
    """Query tiles [i0, i1) against the key tiles they see, a group of key tiles at a time."""
    recipe, q = cfg.recipe, ops.q
    run = _Running((t.B, t.Hk, t.G, i1 - i0, t.bm), v_tiles.shape[-1], q.dtype, q.device)
    qat = recipe.delta is DeltaSource.UNQUANTIZED_P_OUTPUT  # Attn-QAT's O' = (P V^) / sum P
    extra = (("acc_prime", "acc"), ("l_prime", "l")) if qat else ()
    extra += (("l_consumed", "l"), ("l_plain", "l")) if rec is not None else ()
    run.sums.update({name: run.sums[like].clone() for name, like in extra})  # zeros
    ref = _Reference(ops, t, i0, i1, rec) if rec is not None else None
    for j0, j1 in groups:
        s_raw, s, full = _scores(ops, cfg, t, mask, i0, i1, j0, j1)
        hidden = _hidden(t, i0, i1, j0, j1, s.device)
        p, m_use, weights = run.step(s)
        p_hat = _quantize_p(p, s, m_use, recipe, draws, rec is not None, (i0, j0))
        v_j = v_tiles[:, :, j0:j1]
        pv = _hide(_times_key(p_hat.values, v_j), hidden)  # (B, Hkv, G, n, g, bm, Dv)
        consumed, plain = p_hat.values.sum(-1), p.sum(-1)
        run.add("l", weights, consumed if recipe.row_sum is RowSum.QUANTIZED_P else plain)
        run.add("acc", weights, pv)
        if qat:
            run.add("acc_prime", weights, _hide(_times_key(p, v_j), hidden))
            run.add("l_prime", weights, plain)
        if ref is not None:
            run.add("l_consumed", weights, consumed)
            run.add("l_plain", weights, plain)
            ref.block(j0, j1, (s_raw, s, full), p, p_hat, (pv, plain), m_use, (mask, hidden), cfg)
    o, lse = run.finish("acc", "l")
    o_prime = run.finish("acc_prime", "l_prime")[0] if qat else None
    if ref is not None:
        ref.finish(run, o, lse)
    return o, lse, o_prime


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _Reference:
    """The trace's side of the forward: exact attention in the reference dtype alongside,
    and the qk / pv statistics of every tile of one chunk of query tiles."""

    def __init__(self, ops: _Operands, t: _Tiling, i0: int, i1: int, rec: TraceCall):
        self.ops, self.t, self.i0, self.i1, self.rec = ops, t, i0, i1, rec
        q64, k64, v64 = ops.stats["ref"]
        self.q64, self.k64, self.v64 = t.q_tiles(q64)[:, :, :, i0:i1], t.k_tiles(k64), t.k_tiles(v64)
        shape = (t.B, t.Hk, t.G, i1 - i0, t.bm)
        self.run = _Running(shape, v64.shape[-1], q64.dtype, q64.device)
        self.log_lost = torch.full(shape + (t.nK,), -math.inf, dtype=q64.dtype, device=q64.device)

    def block(self, j0, j1, scores, p, p_hat, sums, m_use, masks, cfg) -> None:
        """Statistics of qk and pv on the chunk's query tiles x key tiles [j0, j1); the
        exact softmax's step."""
        (s_raw, s, full), ops, i0, i1, like = scores, self.ops, self.i0, self.i1, scores[1][..., 0, 0]
        (pv, plain), (mask, hidden) = sums, masks
        visible = self.t.visible(i0, i1, j0, j1)
        s_ref = _pairs(self.q64, self.k64[:, :, j0:j1]).mul_(cfg.scale)
        keep = None if full else s > -math.inf  # entries the masks leave
        qk = {**prefix(_q_block(ops.stats["q"], i0, i1, like), "a"), **prefix(_k_block(ops.stats["k"], j0, j1, like), "b")}
        if full and "grams" in ops.stats:
            qk.update(_gram_product_stats(*ops.stats["grams"], i0, i1, j0, j1, s_raw))
        else:
            qk.update(_masked_product_stats(s_raw, s_ref, keep, overwrite=False))
        self.rec.add(Product.QK, i0, j0, qk, visible)
        v64 = self.v64[:, :, j0:j1]
        p_extras = {}
        pv_stats = {**prefix(operand_stats(p, p_hat.values, p_hat.counts, extras=p_extras), "a"), **prefix(_k_block(ops.stats["v"], j0, j1, like), "b")}
        self.rec.add(Product.PV, i0, j0, {**pv_stats, **product_stats(pv, _times_key(p.to(v64.dtype), v64), overwrite=True)}, visible)
        lost = plain - p_extras["kept_mass"]  # flushed P of each row
        self.log_lost[..., j0:j1] = (m_use + torch.log(lost)).transpose(-1, -2).to(self.log_lost.dtype)
        if not full:
            s_ref = (s_ref if mask is None else mask.apply(s_ref, i0, i1, j0, j1)).masked_fill(~keep, -math.inf)
        p_ref, _, weights = self.run.step(s_ref, consume=True)
        self.run.add("l", weights, p_ref.sum(-1))
        self.run.add("acc", weights, _hide(_times_key(p_ref, v64), hidden))

    def finish(self, run: _Running, o: torch.Tensor, lse: torch.Tensor) -> None:
        """Per-query-tile statistics of the chunk, and P's lost probability mass per tile."""
        o_ref, lse_ref = self.run.finish("acc", "l")
        rows = torch.isfinite(lse_ref) & torch.isfinite(lse)  # (B, Hkv, G, n, bm)
        count = rows.sum(-1).double()
        mean = lambda x: torch.where(rows, x, 0.0).double().sum(-1) / count  # noqa: E731
        diff = torch.where(rows.unsqueeze(-1), o.to(o_ref.dtype) - o_ref, 0.0)
        ref_norm = torch.where(rows.unsqueeze(-1), o_ref, 0.0).square().sum((-2, -1)).sqrt()
        out = {
            "row_sum_err": mean(run.sums["l_consumed"] / run.sums["l_plain"] - 1),
            "lse_err": mean((lse.to(lse_ref.dtype) - lse_ref).abs()),
            "out_err": diff.square().sum((-2, -1)).sqrt() / ref_norm,
            "out_nan": torch.isnan(o).sum((-2, -1)).double(),
        }
        self.rec.add_out(self.i0, out)
        lost = torch.where(rows.unsqueeze(-1), torch.exp(self.log_lost - lse.to(self.log_lost.dtype).unsqueeze(-1)), 0.0)
        lost = lost.sum(-2) / count.unsqueeze(-1)  # (B, Hkv, G, n, nK)
        seen = self.t.key_tiles_seen(self.i0, self.i1)
        visible = self.t.visible(self.i0, self.i1, 0, seen)
        self.rec.add(Product.PV, self.i0, 0, {"p_mass_lost": lost[..., :seen]}, visible)


# -- backward --------------------------------------------------------------------------------------
@dataclass
class _BackwardOperands:
    """Tiled operands of the backward's products (see `_Operands` for the layouts)."""

    scores: _Operands  # what S = Q K^T is rebuilt from
    do_dv: torch.Tensor  # dO in dV = P^T dO, query side
    do_dp: torch.Tensor  # dO in dP = dO V^T, query side
    v_dp: torch.Tensor  # V in dP, key side
    k_dq: torch.Tensor  # K in dQ = dS K, key side
    q_dk: torch.Tensor  # Q in dK = dS^T Q, query side
    stats: dict


def _backward_operands(do, q, k, v, saved, cfg: _Config, t: _Tiling, draws, tracing: bool) -> _BackwardOperands:
    """Quantize the backward's whole-tensor operands as `recipe.backward` says."""
    recipe = cfg.recipe
    q_hat, k_hat, v_hat, mu = saved
    if recipe.backward_p is BackwardP.QUANTIZED_QK:
        scores = _Operands(t.q_tiles(q_hat), t.k_tiles(k_hat), mu, t.k_tiles(k), {})
    else:
        scores = _Operands(t.q_tiles(q), t.k_tiles(k), None, t.k_tiles(k), {})
    if recipe.backward is BackwardMode.FLASH:
        sources = {"do_dv": (do, "dv_do"), "do_dp": (do, "dp_do"), "v_dp": (v, "dp_v"), "k_dq": (k, "dq_k"), "q_dk": (q, "dk_q")}
        quant = {name: _quantize_field(x, recipe, field, draws, tracing) for name, (x, field) in sources.items()}
    else:  # straight through: the forward's Q^ (with its mean added back), K^, V^
        q_eff = q_hat if mu is None else q_hat + t.q_untile(mu.expand(*mu.shape[:4], t.bm, mu.shape[-1]))
        quant = {
            "do_dv": _Quantized(do), "do_dp": _Quantized(do),
            "v_dp": _forward_flags(v, v_hat, recipe, "v", tracing),
            "k_dq": _forward_flags(k, k_hat, recipe, "k", tracing),
            "q_dk": _forward_flags(q, q_eff, recipe, "q", tracing),
        }
    plain = {"do_dv": do, "do_dp": do, "v_dp": v, "k_dq": k, "q_dk": q}
    tiler = {"do_dv": t.q_tiles, "do_dp": t.q_tiles, "v_dp": t.k_tiles, "k_dq": t.k_tiles, "q_dk": t.q_tiles}
    stats = {name: _whole_stats(plain[name], quant[name], tiler[name]) for name in quant} if tracing else {}
    if tracing:
        stats["grams"] = (_grams(do, quant["do_dp"].values, t.q_tiles), _grams(v, quant["v_dp"].values, t.k_tiles))
    tiles = {name: tiler[name](quant[name].values) for name in quant}
    return _BackwardOperands(scores=scores, stats=stats, **tiles)


def _forward_flags(x, x_hat, recipe: AttentionRecipe, field: str, tracing: bool) -> _Quantized:
    """The forward's quantized operand, with its trace counts recomputed. The counts depend
    on the block scales and the scaled elements before rounding only, never on stochastic
    rounding's draws, so draws of zeros give the forward's counts."""
    if not tracing:
        return _Quantized(x_hat)
    counts = _quantize_field(x, recipe, field, _ZeroDraws(), True).counts
    return _Quantized(x_hat, counts)


def _backward(do, q, k, v, o, lse, o_prime, saved, cfg: _Config, t: _Tiling, rec):
    """FlashAttention-2's backward (Algorithm 2): dQ, dK, dV in the working precision."""
    work = o.dtype
    dow, qw, kw, vw = do.to(work), q.to(work), k.to(work), v.to(work)
    # DeltaSource.OUTPUT: the output as returned, in the inputs' dtype (a kernel stores O so)
    o_src = o_prime if cfg.recipe.delta is DeltaSource.UNQUANTIZED_P_OUTPUT else o.to(q.dtype).to(work)
    delta = t.q_tiles((dow * o_src).sum(-1))  # D_i = rowsum(dO_i * O_i), (B, Hkv, G, nQ, bm)
    draws = _Draws(cfg.generator, t) if cfg.recipe.stochastic else None  # after the forward's
    ops = _backward_operands(dow, qw, kw, vw, saved, cfg, t, draws, rec is not None)
    if rec is not None:
        ref = rec.meta["reference_dtype"]
        ops.stats["ref"] = (t.q_tiles(qw.to(ref)), t.k_tiles(kw.to(ref)), t.k_tiles(vw.to(ref)), t.q_tiles(dow.to(ref)))
    dk = torch.zeros(t.B, t.Hk, t.nK, t.bn, q.shape[-1], dtype=work, device=q.device)
    dv = torch.zeros(t.B, t.Hk, t.nK, t.bn, v.shape[-1], dtype=work, device=q.device)
    mask = _mask_tiles(cfg, t)
    dq = torch.zeros(t.B, t.Hk, t.G, t.nQ, t.bm, q.shape[-1], dtype=work, device=q.device)
    for i0, i1, groups in t.blocks():
        dq[:, :, :, i0:i1] = _backward_chunk(ops, cfg, t, mask, (i0, i1, groups), lse, delta, (dk, dv), draws, rec)
    return t.q_untile(dq), t.k_untile(dk), t.k_untile(dv)


def _backward_chunk(ops: _BackwardOperands, cfg: _Config, t: _Tiling, mask, chunk, lse, delta, grads, draws, rec):
    """Query tiles [i0, i1) of `chunk` (i0, i1, key-tile groups) against the key tiles they
    see; accumulates `grads` (dK, dV), returns dQ."""
    (i0, i1, groups), (dk, dv) = chunk, grads
    recipe, tracing = cfg.recipe, rec is not None
    dq = torch.zeros(t.B, t.Hk, t.G, i1 - i0, t.bm, ops.k_dq.shape[-1], dtype=dk.dtype, device=dk.device)
    lse_c = lse[:, :, :, i0:i1].unsqueeze(-2)  # (B, Hkv, G, n, 1, bm)
    delta_c = delta[:, :, :, i0:i1, None, :, None]  # (B, Hkv, G, n, 1, bm, 1)
    for j0, j1 in groups:
        _, s, full = _scores(ops.scores, cfg, t, mask, i0, i1, j0, j1)
        hidden = _hidden(t, i0, i1, j0, j1, s.device)
        p = (s - lse_c.unsqueeze(-1)).exp_()  # P rebuilt from the forward's lse
        if recipe.backward is BackwardMode.STRAIGHT_THROUGH:
            p_dv = _quantize_p(p, s, lse_c.expand(s.shape[:-1]), recipe, draws, tracing, (i0, j0))
        else:
            p_dv = _quantize_field(p, recipe, "dv_p", draws, tracing, (i0, j0))
        dv_tiles = _hide(_t_times_query(p_dv.values, ops.do_dv[:, :, :, i0:i1]), hidden)  # P_ij^T dO_i
        dv[:, :, j0:j1] += dv_tiles.sum((2, 3))
        dp = _pairs(ops.do_dp[:, :, :, i0:i1], ops.v_dp[:, :, j0:j1])
        ds = torch.sub(dp, delta_c).mul_(p)  # dS = P * (dP - D)
        ds_q = _quantize_field(ds, recipe, "dq_ds", draws, tracing, (i0, j0))
        dq_tiles = _hide(_times_key(ds_q.values, ops.k_dq[:, :, j0:j1]), hidden)  # dS_ij K_j
        dq += cfg.scale * dq_tiles.sum(4)
        ds_k = _quantize_field(ds, recipe, "dk_ds", draws, tracing, (i0, j0))
        dk_tiles = _hide(_t_times_query(ds_k.values, ops.q_dk[:, :, :, i0:i1]), hidden)  # dS_ij^T Q_i
        dk[:, :, j0:j1] += cfg.scale * dk_tiles.sum((2, 3))
        if tracing:
            tiles = {
                "p": p, "p_dv": p_dv, "dp": dp, "ds": ds, "ds_q": ds_q, "ds_k": ds_k, "dv": dv_tiles,
                "dq": dq_tiles, "dk": dk_tiles,
            }
            _backward_stats(ops, tiles, s, full, lse_c, t, (i0, i1, j0, j1), rec)
    return dq


def _backward_stats(ops: _BackwardOperands, x: dict, s, full: bool, lse_c, t: _Tiling, block, rec: TraceCall) -> None:
    """Statistics of dv, dp, dq, dk on a block of tiles. dV and dK tiles are each query
    tile's contribution P^T dO, dS^T Q (the backward sums them over the query tiles)."""
    i0, i1, j0, j1 = block
    q64, k64, v64, do64 = ops.stats["ref"]
    q64, do64, k64j, v64j = q64[:, :, :, i0:i1], do64[:, :, :, i0:i1], k64[:, :, j0:j1], v64[:, :, j0:j1]
    st, like = ops.stats, s[..., 0, 0]
    p64, ds64 = x["p"].to(q64.dtype), x["ds"].to(q64.dtype)
    rows = torch.isfinite(lse_c)  # rows that see a key, (B, Hkv, G, n, 1, bm)
    p_extras, ds_extras = {}, {}
    p_stats = operand_stats(x["p"], x["p_dv"].values, x["p_dv"].counts, extras=p_extras)
    lost = x["p"].sum(-1) - p_extras["kept_mass"]  # flushed P per row
    mass = torch.where(rows, lost, 0.0).double().sum(-1) / rows.sum(-1).double()
    keep = None if full else s > -math.inf
    dq_stats = operand_stats(x["ds"], x["ds_q"].values, x["ds_q"].counts, extras=ds_extras)
    dk_stats = operand_stats(x["ds"], x["ds_k"].values, x["ds_k"].counts, nonzero=ds_extras["nonzero"])
    records = {
        Product.DV: (p_stats, _q_block(st["do_dv"], i0, i1, like),
                     product_stats(x["dv"], _t_times_query(p64, do64), overwrite=True), {"p_mass_lost": mass}),
        Product.DP: (_q_block(st["do_dp"], i0, i1, like), _k_block(st["v_dp"], j0, j1, like),
                     _gram_product_stats(*st["grams"], i0, i1, j0, j1, x["dp"]) if full
                     else _masked_product_stats(x["dp"], _pairs(do64, v64j), keep), {}),
        Product.DQ: (dq_stats, _k_block(st["k_dq"], j0, j1, like),
                     product_stats(x["dq"], _times_key(ds64, k64j), overwrite=True), {}),
        Product.DK: (dk_stats, _q_block(st["q_dk"], i0, i1, like),
                     product_stats(x["dk"], _t_times_query(ds64, q64), overwrite=True), {}),
    }
    visible = t.visible(i0, i1, j0, j1)
    for product, (sa, sb, prod, extra) in records.items():
        rec.add(product, i0, j0, {**prefix(sa, "a"), **prefix(sb, "b"), **prod, **extra}, visible)


# -- the autograd Function ---------------------------------------------------------------------------
def _large_cpu_call(device: torch.device, t: _Tiling) -> bool:
    """Whether a call is large enough for the allocator handling below: on the CPU, with
    at least _LARGE_SCORES entries of the scores (small calls, tests, leave malloc alone)."""
    return device.type == "cpu" and t.B * t.H * t.Sq * t.Sk >= _LARGE_SCORES


def _settle_allocator(device: torch.device, t: _Tiling) -> None:
    """Let the CPU's malloc recycle the blocks' temporaries instead of faulting in fresh pages.

    glibc serves large requests with mmap and returns freed heap memory above its trim
    threshold to the system; both thresholds rise (for the rest of the process) when a
    large mapped chunk, up to 32 MiB, is freed. A block's temporaries are a few MiB each and
    are freed and requested again every block, so with glibc's starting thresholds each one
    is mapped and faulted in anew, which costs as much as the arithmetic. Allocating and
    freeing one untouched 30 MiB buffer (_SETTLE_BYTES) raises the thresholds to 30 and 60
    MiB, so they are recycled. Larger tensors (plain attention's dense seq x seq matrices)
    are served as before; elsewhere than glibc this is a harmless allocation. Only for
    large calls (`_large_cpu_call`)."""
    if _large_cpu_call(device, t):
        torch.empty(_SETTLE_BYTES, dtype=torch.uint8)


def _trim_allocator(device: torch.device, t: _Tiling) -> None:
    """Hand the heap memory the blocks' temporaries left free back to the system (glibc's
    malloc_trim), at the end of a large call's forward and backward: the raised thresholds
    of `_settle_allocator` would otherwise keep it, and the next pass would start from it
    (at seq 16384 this lowers the traced run's peak by about 40 MiB)."""
    if _large_cpu_call(device, t) and _LIBC is not None:
        _LIBC.malloc_trim(0)


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


class _Attention(torch.autograd.Function):
    """Forward and backward of `attention` (inputs already transformed by `_transform_qk`)."""

    @staticmethod
    def forward(ctx, q, k, v, cfg: _Config):
        t = _Tiling(
            B=q.shape[0], H=q.shape[1], Hk=k.shape[1], Sq=q.shape[2], Sk=k.shape[2],
            bm=cfg.block_m, bn=cfg.block_n, causal=cfg.causal,
        )
        _settle_allocator(q.device, t)
        rec = _begin_trace(cfg, t, q, v)
        o, lse, o_prime, saved = _forward(q, k, v, cfg, t, rec)
        _trim_allocator(q.device, t)
        ctx.save_for_backward(q, k, v, o, lse, o_prime, *saved)
        ctx.cfg, ctx.tiling, ctx.rec = cfg, t, rec
        return o.to(q.dtype, copy=True)  # not a view of o: a caller may modify it in place

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        _settle_allocator(do.device, ctx.tiling)
        q, k, v, o, lse, o_prime, *saved = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, o_prime, saved, ctx.cfg, ctx.tiling, ctx.rec)
        _trim_allocator(do.device, ctx.tiling)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _begin_trace(cfg: _Config, t: _Tiling, q, v) -> TraceCall | None:
    if cfg.trace is None:
        return None
    meta = {
        "reference_dtype": cfg.trace.reference_dtype or _work_dtype(q), "shape_q": tuple(q.shape), "Sk": t.Sk,
        "kv_heads": t.Hk, "v_dim": v.shape[-1], "dtype": str(q.dtype), "causal": cfg.causal,
        "scale": cfg.scale, "block_m": t.bm, "block_n": t.bn, "masked": cfg.attn_mask is not None,
        "seed": cfg.seed,  # None unless an int seed was given (a Generator may have advanced)
        "generator_initial_seed": cfg.generator.initial_seed() if cfg.generator is not None else None,
    }
    return cfg.trace.begin(cfg.recipe.name, (t.B, t.Hk, t.G, t.nQ, t.nK), meta)
