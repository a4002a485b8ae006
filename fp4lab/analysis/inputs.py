"""Inputs for attention studies: a documented synthetic default and loaders for real tensors.

What. `synthetic_inputs(config)` draws Q, K, V and dO (each (batch, heads, seq, head_dim))
from a small generative model of the activations a trained transformer's attention sees,
seeded, so that `fp4lab attention` has something realistic to run on with nothing
downloaded. `load_inputs(path)` reads tensors a user saved from a real model, from a `.npz`
file (read with ``allow_pickle=False``) or a `.safetensors` file: formats that hold plain
arrays and cannot run code when loaded. Pickle (``torch.save``) is never read.

Why these features. Quantization error in attention is set by dynamic range, and real
activations have more of it than Gaussians:
- channel outliers in Q and K (a few head dimensions much larger than the rest; the reason
  for FlashAttention-3's incoherent processing and SageAttention's smoothing);
- a per-token scale (some tokens' Q/K rows are larger than others);
- a mean shared by every key (softmax-invariant; SageAttention subtracts it);
- an attention sink (Xiao et al. 2023, "Efficient Streaming Language Models with Attention
  Sinks", arXiv 2309.17453): key 0 draws a large share of every query's probability, which
  is what makes casting P to FP8 flush the other probabilities ("P-cast", arXiv 2606.06521);
  the sink's value row is small, as observed for sink tokens;
- heavy-tailed V (Student t elements with a per-channel scale);
- a small dO with a heavy-tailed per-token scale (the loss is averaged over a batch's tokens,
  and some tokens matter much more than others).

The model, for query/key head h, token t and channel c (all draws independent, N = normal):
    Q[t, c] = a_c * s_q[t] * N(0, 1),           except Q[t, sink] = sink_query
    K[t, c] = a_c * s_k[t] * N(0, 1) + mu[c],   except K[0, sink] = sink_logit sqrt(D) / sink_query
    V[t, c] = b_c * StudentT(v_dof),            except V[0, :] = sink_value_scale * that
    dO[t, c] = do_scale * s_o[t] * N(0, 1)
with a_c = outlier_scale on `outlier_channels` random channels (1 elsewhere; the sink
channel is the last one and never an outlier), log s_q, log s_k ~ N(0, token_scale_sigma^2),
mu = k_mean * N(0, 1) per channel (times a_c), log b_c ~ N(0, v_channel_sigma^2),
log s_o ~ N(0, do_token_sigma^2). Every query's score with key 0 is then about `sink_logit`
above its typical score (the queries' sink-channel constant times the sink key's entry, over
sqrt(D)). The numbers are illustrative choices, not fits to a particular model; change them
in `SyntheticConfig` and they are recorded with the results.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["SyntheticConfig", "AttentionInputs", "synthetic_inputs", "load_inputs", "save_inputs"]

_NAMES = ("q", "k", "v", "do")


@dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """The generative model of `synthetic_inputs` (see the module docstring for the formulas).

    Defaults are small enough for `fp4lab attention` to run in seconds on a laptop CPU.
    """

    batch: int = 1
    heads: int = 2  # query heads
    kv_heads: int | None = None  # key/value heads (None: = heads; fewer for GQA)
    seq: int = 512  # query and key length
    head_dim: int = 64
    seed: int = 0
    outlier_channels: int = 2  # Q/K channels scaled by outlier_scale
    outlier_scale: float = 4.0
    token_scale_sigma: float = 0.3  # log-normal spread of Q/K rows' scale
    k_mean: float = 1.0  # size of the mean shared by every key
    sink_logit: float = 8.0  # score of key 0 above a query's typical score
    sink_query: float = 2.0  # every query's entry on the sink channel
    sink_value_scale: float = 0.1  # V row of the sink, relative to the others
    v_dof: int = 3  # Student t degrees of freedom of V's elements
    v_channel_sigma: float = 0.5  # log-normal spread of V's channel scales
    do_scale: float = 1e-3  # overall size of dO
    do_token_sigma: float = 1.0  # log-normal spread of dO rows' scale
    dtype: str = "float32"  # "float32" or "float64"

    def __post_init__(self) -> None:
        for name in ("batch", "heads", "seq", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        kv = self.heads if self.kv_heads is None else self.kv_heads
        if not isinstance(kv, int) or kv < 1 or self.heads % kv:
            raise ValueError(f"kv_heads must divide heads={self.heads}, got {self.kv_heads!r}")
        if self.head_dim < 2 or not 0 <= self.outlier_channels < self.head_dim:
            raise ValueError(
                f"outlier_channels must lie in [0, head_dim - 1) = [0, {self.head_dim - 1}), "
                f"got {self.outlier_channels} (head_dim {self.head_dim})"
            )
        if not isinstance(self.v_dof, int) or self.v_dof < 3:
            raise ValueError(
                f"v_dof must be an int of at least 3 (finite variance), got {self.v_dof!r}"
            )
        if self.sink_query <= 0:
            raise ValueError(f"sink_query must be positive, got {self.sink_query}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")


@dataclass(frozen=True)
class AttentionInputs:
    """Q, K, V (and dO, or None) of one attention call, (B, H, S, D) layout, plus where they
    came from (`source`: "synthetic" or the file's path) and a description to record."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor | None
    source: str
    record: dict

    def with_do(self, seed: int) -> AttentionInputs:
        """These inputs with dO drawn from N(0, 1) * 1e-3 by `seed` if the file had none."""
        if self.do is not None:
            return self
        gen = torch.Generator().manual_seed(seed)
        shape = (*self.q.shape[:-1], self.v.shape[-1])
        do = 1e-3 * torch.randn(shape, generator=gen, dtype=torch.float64).to(self.q.dtype)
        record = {
            **self.record,
            "do": f"absent from the file; drawn as 1e-3 * N(0, 1) with seed {seed}",
        }
        return dataclasses.replace(self, do=do, record=record)


def synthetic_inputs(config: SyntheticConfig | None = None, **overrides) -> AttentionInputs:
    """Q, K, V, dO from the documented generative model (module docstring), seeded.

    Give a `SyntheticConfig` or its fields as keywords (`synthetic_inputs(seq=256, seed=1)`).
    """
    config = dataclasses.replace(config or SyntheticConfig(), **overrides)
    gen = torch.Generator().manual_seed(config.seed)
    b, h, s, d = config.batch, config.heads, config.seq, config.head_dim
    hk = config.kv_heads or h
    q, k = _query_key(config, gen, (b, h, s, d), (b, hk, s, d))
    v = _values(config, gen, (b, hk, s, d))
    token = torch.exp(config.do_token_sigma * _normal(gen, b, h, s, 1))
    do = config.do_scale * token * _normal(gen, b, h, s, d)
    dtype = getattr(torch, config.dtype)
    record = {"kind": "synthetic", **dataclasses.asdict(config)}
    return AttentionInputs(q.to(dtype), k.to(dtype), v.to(dtype), do.to(dtype), "synthetic", record)


def _normal(gen: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def _query_key(config: SyntheticConfig, gen, q_shape, k_shape):
    """Q and K with outlier channels, per-token scales, a shared key mean and a sink."""
    d = config.head_dim
    sink = d - 1  # the sink channel; outliers are drawn among the others
    channel = torch.ones(d, dtype=torch.float64)
    outliers = torch.randperm(d - 1, generator=gen)[: config.outlier_channels]
    channel[outliers] = config.outlier_scale
    sigma = config.token_scale_sigma
    q = channel * torch.exp(sigma * _normal(gen, *q_shape[:3], 1)) * _normal(gen, *q_shape)
    k = channel * torch.exp(sigma * _normal(gen, *k_shape[:3], 1)) * _normal(gen, *k_shape)
    k = k + config.k_mean * channel * _normal(gen, *k_shape[:2], 1, d)  # (B, Hkv, 1, D)
    q[..., sink] = config.sink_query
    k[..., 0, sink] = config.sink_logit * math.sqrt(d) / config.sink_query
    return q, k


def _values(config: SyntheticConfig, gen, shape) -> torch.Tensor:
    """Student t elements (a normal over the root of a chi-squared with nu degrees of freedom,
    a sum of nu squared normals, over nu), channel scales, a small sink row."""
    nu = config.v_dof
    chi2 = _normal(gen, nu, *shape).square().sum(0)
    t = _normal(gen, *shape) / torch.sqrt(chi2 / nu)
    v = torch.exp(config.v_channel_sigma * _normal(gen, *shape[:2], 1, shape[-1])) * t
    v[..., 0, :] *= config.sink_value_scale
    return v


# -- files ----------------------------------------------------------------------------------------
def load_inputs(path: str | Path) -> AttentionInputs:
    """Q, K, V and optionally dO from a `.npz` or `.safetensors` file.

    The file holds arrays named ``q``, ``k``, ``v`` and optionally ``do``, in the layout of
    `F.scaled_dot_product_attention`: q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv),
    do (B, H, Sq, Dv), with H a multiple of Hkv. Floating-point arrays of any width are read;
    float64 stays float64, every other float becomes float32. Pickled objects are refused
    (``np.load(..., allow_pickle=False)``); safetensors never holds any.

    Raises:
        ValueError: an unknown extension, a missing array (named, with the ones present), a
            non-floating or object array, shapes that do not fit together (named).
        FileNotFoundError: no such file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"inputs file {str(path)!r} does not exist")
    arrays = _read_arrays(path)
    missing = [n for n in _NAMES[:3] if n not in arrays]
    if missing:
        raise ValueError(
            f"inputs file {str(path)!r} has no array named {missing[0]!r}; it needs q, k, v "
            f"(and optionally do), found {sorted(arrays) or 'none'}"
        )
    tensors = {n: _as_float_tensor(arrays[n], n, path) for n in _NAMES if n in arrays}
    _check_shapes(tensors, path)
    record = {
        "kind": "file",
        "path": str(path),
        "sha256": _sha256(path),
        "shapes": {n: list(t.shape) for n, t in tensors.items()},
    }
    return AttentionInputs(
        tensors["q"], tensors["k"], tensors["v"], tensors.get("do"), str(path), record
    )


def save_inputs(
    path: str | Path,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor | None = None,
) -> Path:
    """Write q, k, v (and do) to a `.npz` or `.safetensors` file that `load_inputs` reads.

    Tensors are detached and moved to the CPU; bfloat16 and other widths numpy lacks are
    stored as float32 in `.npz` (safetensors keeps them).
    """
    path = Path(path)
    tensors = {
        n: t.detach().cpu().contiguous()
        for n, t in zip(_NAMES, (q, k, v, do), strict=True)
        if t is not None
    }
    if path.suffix == ".npz":
        arrays = {
            n: (
                t.float() if t.dtype not in (torch.float32, torch.float64, torch.float16) else t
            ).numpy()
            for n, t in tensors.items()
        }
        np.savez(path, **arrays)
    elif path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    else:
        raise ValueError(f"path must end in .npz or .safetensors, got {str(path)!r}")
    return path


def _read_arrays(path: Path) -> dict:
    if path.suffix == ".npz":
        try:
            data = np.load(path, allow_pickle=False)
        except (OSError, EOFError, ValueError, zipfile.BadZipFile) as err:
            raise ValueError(
                f"inputs file {str(path)!r} is not a readable .npz archive: {err}"
            ) from None
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError(
                f"inputs file {str(path)!r} holds one array, not an .npz archive of q, k, v"
            )
        with data:
            return {name: _npz_array(data, name, path) for name in data.files}
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors raises its own SafetensorError
            raise ValueError(
                f"inputs file {str(path)!r} is not a readable safetensors file: {err}"
            ) from None
    raise ValueError(
        f"inputs file must end in .npz or .safetensors (never pickle), got {str(path)!r}"
    )


def _npz_array(data, name: str, path: Path) -> np.ndarray:
    try:
        return data[name]
    except ValueError:
        raise ValueError(
            f"array {name!r} of inputs file {str(path)!r} holds Python objects, which would need "
            "pickle to load; save plain numeric arrays"
        ) from None


def _as_float_tensor(x, name: str, path: Path) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if not t.dtype.is_floating_point:
        raise ValueError(
            f"array {name!r} of inputs file {str(path)!r} must be floating point, got {t.dtype}"
        )
    return t if t.dtype == torch.float64 else t.float()


def _check_shapes(t: dict[str, torch.Tensor], path: Path) -> None:
    where = f"inputs file {str(path)!r}"
    for name, x in t.items():
        if x.ndim != 4:
            raise ValueError(
                f"array {name!r} of {where} must be 4-D (batch, heads, seq, head_dim), got shape "
                f"{tuple(x.shape)}"
            )
    q, k, v = t["q"], t["k"], t["v"]
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"arrays 'k' and 'v' of {where} must agree in (batch, heads, seq), got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"arrays 'q' and 'k' of {where} must agree in batch and head_dim, got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"array 'q' of {where} has {q.shape[1]} heads, not a multiple of k's {k.shape[1]}"
        )
    want = (*q.shape[:3], v.shape[-1])
    if "do" in t and tuple(t["do"].shape) != want:
        raise ValueError(
            f"array 'do' of {where} must have shape (B, H, Sq, Dv) = {want}, got "
            f"{tuple(t['do'].shape)}"
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
