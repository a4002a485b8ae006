"""Is a recipe's gradient unbiased? Averages over stochastic-rounding draws against a reference.

What. `gradient_bias(q, k, v, do, recipe, samples=N, seed=s, reference=...)` runs the
recipe's forward and backward N times, each with its own stochastic-rounding generator
(seeds derived from `s` by numpy's `SeedSequence` and recorded), and compares the mean
gradient with a reference gradient g of the same inputs, one of two:

- ``reference="exact"``: the exact float64 gradient of exact attention
  (`compare.exact_reference`). The bias then mixes two sources: the forward's deterministic
  rounding error (Q, K, V, P rounded to nearest make the forward itself a different
  function) and the backward's own bias.
- ``reference="forward"``: the exact gradient of the recipe's own quantized forward, straight
  through its quantizers (`AttentionRecipe.with_exact_backward`, `BackwardMode.FORWARD_EXACT`:
  dV from the forward's own P^ tiles, nothing quantized in the backward), on the same draws
  as the sample's forward. This isolates the backward: "the stochastic-rounding backward is
  unbiased" is the claim that the bias against this reference is zero. It is computed in
  the inputs' working precision (float32 rounding, ~1e-7 relative, lies far below what N
  samples resolve).

Why. Stochastic rounding is meant to make each quantized product an unbiased estimate of
the exact one, so that the errors of many steps average out. Quartet II (arXiv 2601.22813)
tests this by averaging N independently randomised quantized products: the error of the
average falls as 1/N in mean squared error without a floor when the estimator is unbiased,
and flattens at the squared bias when it is not. Here the same test is applied to the
whole attention backward, per tensor and per tile.

Statistics. For sample i's gradient g_i of a tensor (dQ, dK or dV) and the reference g_i^*
(the same for every sample unless the recipe's forward rounds stochastically), d_i =
g_i - g_i^* and g = mean_i g_i^* (written g below):
- the per-sample relative bias along the reference, x_i = <d_i, g_i^*> / <g_i^*, g_i^*>
  (negative when quantization shrinks the gradient, as flushing, clipping or rounding toward
  zero do; it is minus Quartet II's magnitude misalignment);
- ``rel_bias`` = mean_i x_i, ``se`` = std_i(x_i) / sqrt(N) (sample standard deviation),
  ``t`` = rel_bias / se and ``p_value``, two-sided under Student's t with N - 1 degrees of
  freedom: the x_i are independent draws, so for an unbiased recipe t follows that law
  (approximately; x_i is a sum over many elements);
- ``rel_err_mean`` = ||mean_i d_i|| / ||g||, the error of the N-sample average, and
  ``rel_noise`` = sqrt(sum of per-element variances / N) / ||g||, what that error would be
  from noise alone; an unbiased recipe has rel_err_mean close to rel_noise;
- per tile (dQ: batch, head, query tile; dK, dV: batch, kv head, key tile) the same
  rel_bias, se, t and p_value with the inner products taken over the tile;
- the convergence curve: for n = 1, 2, 4, ..., N, ``rel_mse`` = ||mean_{i<n} d_i||^2 /
  ||g||^2 and ``noise_only`` = (sum of per-element variances) / n / ||g||^2, the 1/n line
  an unbiased recipe follows.

A deterministic recipe (no stochastic rounding) gives the same gradient on every draw, so
its bias is its error: it runs once, ``se`` is 0, ``t`` is +-inf where the bias is nonzero,
and the result's `note` says so. Its differences from the exact gradient are the recipe's
deterministic error, not a sampling effect.

The result's `reference` and `note` say what the bias is measured against.

Batches. On a GPU one sample is too small a call to fill it, so there the samples run
`batch` at a time, stacked along the batch dimension with one generator each (`attention`'s
list of generators): every sample draws exactly the bits it would draw alone, so the batched
run gives the looped run's numbers (bit for bit on the CPU, where the tests compare them; on
a GPU a larger matmul may sum in another order). `attend` runs another backend's attention
(`fp4lab.gradient_bias(..., backend="triton")` passes the Triton kernels'); the CPU reference
runs one sample a call, as it always did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from scipy import stats

from fp4lab.analysis.compare import exact_reference, forward_backward
from fp4lab.recipes import AttentionRecipe, resolve_recipe

__all__ = ["GradientBias", "gradient_bias", "derive_seeds"]

GRADIENTS = ("dq", "dk", "dv")


@dataclass(frozen=True)
class GradientBias:
    """What `gradient_bias` found (see the module docstring for every column).

    Attributes:
        recipe: the recipe's name.
        stochastic: whether the recipe rounds stochastically.
        samples: the number of draws run (1 for a deterministic recipe).
        seed: the seed given; `seeds` the generator seed of each draw.
        reference: "exact" or "forward": what the bias is measured against.
        tensors: one row per gradient (dq, dk, dv).
        tiles: one row per gradient and tile: dQ's query tiles (block_m rows of one batch
            and query head), dK's and dV's key tiles (block_n rows of one batch and KV head).
        convergence: one row per gradient and n (1, 2, 4, ..., samples).
        note: how to read the result.
    """

    recipe: str
    stochastic: bool
    samples: int
    seed: int
    seeds: tuple[int, ...]
    reference: str
    tensors: pd.DataFrame
    tiles: pd.DataFrame
    convergence: pd.DataFrame
    note: str


def derive_seeds(seed: int, samples: int) -> tuple[int, ...]:
    """`samples` independent 32-bit generator seeds from `seed` (numpy's SeedSequence)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    return tuple(
        int(s) for s in np.random.SeedSequence(seed).generate_state(samples, dtype=np.uint32)
    )


def gradient_bias(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    recipe: AttentionRecipe | str,
    *,
    samples: int = 32,
    seed: int = 0,
    causal: bool = False,
    scale: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    reference: str = "exact",
    attend=None,
    batch: int | None = None,
) -> GradientBias:
    """Mean gradient of `recipe` over `samples` stochastic-rounding draws against a reference
    gradient: per-tensor and per-tile bias, standard error and t-statistic, and the error of
    the n-sample average as n grows (Quartet II's test; see the module docstring).

    Args:
        q, k, v, do: as for `compare.compare` (the recipe runs in their dtype).
        recipe: an `AttentionRecipe` or a registered name.
        samples: number of draws N (at least 2 for a stochastic recipe; a deterministic
            recipe runs once whatever N is).
        seed: the seed the draws' generator seeds are derived from (`derive_seeds`).
        causal, scale, block_m, block_n: as for `attention`.
        reference: "exact" (exact float64 attention) or "forward" (the exact gradient of the
            recipe's own quantized forward); see the module docstring.
        attend: the attention function the recipe (and the "forward" reference) runs on,
            with `fp4lab.attention`'s signature; None: the simulation path.
        batch: samples per call, stacked along the batch (see the module docstring); None
            chooses: one on the CPU with the simulation path, else as many as keep the
            stacked q within 2^28 elements.
    """
    recipe = resolve_recipe(recipe)
    if reference not in REFERENCES:
        raise ValueError(
            f"reference must be one of {', '.join(map(repr, REFERENCES))}, got {reference!r}"
        )
    block_m, block_n = recipe.tiles(block_m, block_n)
    n = _check_samples(samples, recipe)
    seeds = derive_seeds(seed, n)
    options = dict(causal=causal, scale=scale, block_m=block_m, block_n=block_n)
    per_call = _batch(batch, n, q, attend)
    refs = _references(q, k, v, do, recipe, reference, options, attend)
    acc = {
        name: _Accumulator(
            q.shape[-2] if name == "dq" else k.shape[-2], block_m if name == "dq" else block_n
        )
        for name in GRADIENTS
    }
    for start in range(0, n, per_call):
        chunk = seeds[start : start + per_call]
        generator = (list(chunk) if len(chunk) > 1 else chunk[0]) if recipe.stochastic else None
        grads = _stacked(q, k, v, do, len(chunk), recipe, generator, options, attend)
        for j in range(len(chunk)):
            sample = [g[j] for g in grads]
            for name, g, r in zip(GRADIENTS, sample, refs(generator, j), strict=True):
                acc[name].add(g, r, record=_is_checkpoint(start + j + 1, n))
    return GradientBias(
        recipe=recipe.name,
        stochastic=recipe.stochastic,
        samples=n,
        seed=seed,
        seeds=seeds,
        reference=reference,
        tensors=pd.DataFrame([{"tensor": name, **a.tensor_stats()} for name, a in acc.items()]),
        tiles=_stack({name: a.tile_stats() for name, a in acc.items()}, _TILE_COLUMNS),
        convergence=_stack({name: a.curve() for name, a in acc.items()}, _CURVE_COLUMNS),
        note=_note(recipe, n, reference),
    )


REFERENCES = ("exact", "forward")


def _batch(batch, n: int, q: torch.Tensor, attend) -> int:
    """Samples per call: `batch`, or the default the module docstring gives."""
    if batch is None:
        if attend is None and q.device.type == "cpu":
            return 1
        return max(1, min(n, _STACK_ELEMENTS // max(q.numel(), 1)))
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive int or None, got {batch!r}")
    return min(batch, n)


_STACK_ELEMENTS = 1 << 28  # the stacked q of one call, at most (batch's default)


def _stacked(q, k, v, do, m: int, recipe, generator, options: dict, attend):
    """(dQ, dK, dV) of m samples stacked along the batch, each split back: a list of m
    (B, ...) gradients per tensor; one call to `forward_backward`."""
    stack = (q, k, v, do)
    if m > 1:
        stack = [x.repeat(m, *([1] * (x.ndim - 1))) for x in stack]  # (m B, H, S, E)
    grads = forward_backward(*stack, recipe, trace=None, generator=generator, attend=attend,
                             **options)[1:]  # fmt: skip
    return [list(g.chunk(m)) for g in grads]


def _references(q, k, v, do, recipe: AttentionRecipe, reference: str, options: dict, attend):
    """A function of a call's generator(s) and a sample's place j among them giving that
    sample's reference (dQ, dK, dV): fixed (computed once) unless the recipe's forward rounds
    stochastically, then computed per call (stacked as the call is) and kept for its samples."""
    if reference == "exact":
        fixed = exact_reference(q, k, v, do, **options)[1:]
        return lambda generator, j: fixed
    forward = recipe.with_exact_backward()
    if not forward.stochastic:
        fixed = [g[0] for g in _stacked(q, k, v, do, 1, forward, None, options, attend)]
        return lambda generator, j: fixed
    cache = {}

    def run(generator, j):
        key = tuple(generator) if isinstance(generator, list) else (generator,)
        if key not in cache:
            cache.clear()
            cache[key] = _stacked(q, k, v, do, len(key), forward, generator, options, attend)
        return [g[j] for g in cache[key]]

    return run


_TILE_COLUMNS = ["tensor", "batch", "head", "tile", "rel_bias", "se", "t", "p_value"]
_CURVE_COLUMNS = ["tensor", "n", "rel_mse", "noise_only"]


def _stack(frames: dict[str, pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    """One frame of the per-gradient frames, with a `tensor` column."""
    stacked = pd.concat([f.assign(tensor=name) for name, f in frames.items()], ignore_index=True)
    return stacked.reindex(columns=columns)


def _check_samples(samples, recipe: AttentionRecipe) -> int:
    """The number of draws to run: `samples` for a stochastic recipe, 1 otherwise."""
    least = 2 if recipe.stochastic else 1
    if not isinstance(samples, int) or isinstance(samples, bool) or samples < least:
        kind = "stochastic" if recipe.stochastic else "deterministic"
        raise ValueError(
            f"samples must be an int of at least {least} for {kind} recipe {recipe.name!r}, got "
            f"{samples!r}"
        )
    return samples if recipe.stochastic else 1


def _note(recipe: AttentionRecipe, n: int, reference: str) -> str:
    against = {
        "exact": "bias against exact float64 attention (the forward's rounding error included)",
        "forward": "bias against the exact gradient of the recipe's own quantized forward "
        "(the backward's alone)",
    }[reference]
    if recipe.stochastic:
        return (
            f"{against}; {n} stochastic-rounding draws; t follows Student's t with {n - 1} "
            "degrees of freedom when the recipe is unbiased"
        )
    return (
        f"{against}; deterministic recipe: every draw gives the same gradient, so the bias is "
        "the error itself and one sample suffices (se = 0, t = +-inf where the bias is nonzero)"
    )


def _is_checkpoint(i: int, n: int) -> bool:
    """n-sample averages recorded for the convergence curve: powers of two and n itself."""
    return i == n or (i & (i - 1)) == 0


class _Accumulator:
    """Running sums of one gradient's draws against their references, d_i = g_i - g_i^*
    (float64): sum d_i, sum d_i^2, sum g_i^*, the per-sample projections x_i per tensor and
    per tile, and the curve's checkpoints."""

    def __init__(self, rows: int, tile_rows: int):
        self.n_tiles = -(-rows // tile_rows)
        self.pad, self.tile_rows = self.n_tiles * tile_rows - rows, tile_rows
        self.sum = self.sum_sq = self.sum_ref = None
        self.x, self.x_tiles, self.points = [], [], []

    def tiled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, S, D) -> (B, H, nT, tile_rows * D), zero padded."""
        b, h, _, d = x.shape
        return torch.nn.functional.pad(x, (0, 0, 0, self.pad)).reshape(
            b, h, self.n_tiles, self.tile_rows * d
        )

    def add(self, g: torch.Tensor, ref: torch.Tensor, record: bool) -> None:
        ref = ref.detach().to(torch.float64)
        d = g.detach().to(torch.float64) - ref
        if self.sum is None:
            self.sum, self.sum_sq, self.sum_ref = (torch.zeros_like(ref) for _ in range(3))
        self.sum += d
        self.sum_sq += d.square()
        self.sum_ref += ref
        norm_sq = ref.square().sum().item()
        self.x.append((d * ref).sum().item() / norm_sq if norm_sq > 0 else math.nan)
        ref_tiles = self.tiled(ref)
        self.x_tiles.append(
            (self.tiled(d) * ref_tiles).sum(-1) / ref_tiles.square().sum(-1)
        )  # NaN where g = 0
        if record:
            n = len(self.x)
            self.points.append((n, (self.sum / n).square().sum().item() / self.norm_sq))

    @property
    def norm_sq(self) -> float:
        """||g||^2 of the mean reference g."""
        return (self.sum_ref / len(self.x)).square().sum().item()

    def _variance_sum(self) -> float:
        """Sum over elements of the per-element sample variance (0 for a single draw)."""
        n = len(self.x)
        if n < 2:
            return 0.0
        return ((self.sum_sq - self.sum.square() / n) / (n - 1)).clamp(min=0).sum().item()

    def tensor_stats(self) -> dict:
        n = len(self.x)
        mean_err = ((self.sum / n).square().sum().item() / self.norm_sq) ** 0.5
        stats_ = _t_test(torch.tensor(self.x, dtype=torch.float64))
        return {
            **{k: v.item() for k, v in stats_.items()},
            "rel_err_mean": mean_err,
            "rel_noise": (self._variance_sum() / n / self.norm_sq) ** 0.5,
            "samples": n,
        }

    def tile_stats(self) -> pd.DataFrame:
        x = torch.stack(self.x_tiles).cpu()  # (N, B, H, nT); scipy's t test runs on the host
        stats_ = _t_test(x)
        b, h, nt = x.shape[1:]
        grid = torch.meshgrid(torch.arange(b), torch.arange(h), torch.arange(nt), indexing="ij")
        columns = {"batch": grid[0], "head": grid[1], "tile": grid[2], **stats_}
        return pd.DataFrame({k: v.flatten().numpy() for k, v in columns.items()})

    def curve(self) -> pd.DataFrame:
        noise = self._variance_sum() / self.norm_sq
        rows = [{"n": n, "rel_mse": mse, "noise_only": noise / n} for n, mse in self.points]
        return pd.DataFrame(rows)


def _t_test(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean over dim 0, its standard error, t = mean / se and the two-sided p-value under
    Student's t with N - 1 degrees of freedom (se = 0 for a single draw: t = +-inf or NaN)."""
    n = x.shape[0]
    mean = x.mean(0)
    se = x.std(0) / math.sqrt(n) if n > 1 else torch.zeros_like(mean)
    t = torch.where(se > 0, mean / se, torch.where(mean == 0, math.nan, math.inf * mean.sign()))
    p = (
        2 * stats.t.sf(t.abs().numpy(), df=max(n - 1, 1))
        if n > 1
        else torch.where(mean == 0, 1.0, 0.0).numpy()
    )
    return {"rel_bias": mean, "se": se, "t": t, "p_value": torch.as_tensor(p, dtype=torch.float64)}
