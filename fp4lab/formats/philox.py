"""Philox4x32-10, the one counter-based random generator of fp4lab, in torch.

What. Philox4x32 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2,
3", SC 2011; the Random123 library) is a keyed bijection on 128-bit counters: four 32-bit
counter words and a 64-bit key give four 32-bit words that pass TestU01's BigCrush. Ten
rounds is Random123's default, `philox4x32_10`.

Why counter-based. A stream generator such as `torch.Generator` hands out numbers in the
order they are asked for, so an element's draw depends on everything drawn before it: on the
batch size, the head count, the tiling, the chunking and the device. Here an element's words
are a pure function of the seed (the key) and the element's position (the counter), so
stochastic rounding draws the same bits however the work is split. `fp4lab.kernels.random`
implements the same function in Triton, and the tests compare the two bit for bit: the same
seed rounds the same way on the CPU and on the GPU.

The definition (Random123's). One round maps the counter (c0, c1, c2, c3) under the round key
(k0, k1) to

    (hi(M1 * c2) ^ c1 ^ k0,  lo(M1 * c2),  hi(M0 * c0) ^ c3 ^ k1,  lo(M0 * c0)),

hi and lo being the high and low 32-bit words of the 64-bit product, M0 = 0xD2511F53 and
M1 = 0xCD9E8D57. Round r (from 0) uses the key (k0 + r W0, k1 + r W1) mod 2^32 with the Weyl
increments W0 = 0x9E3779B9 and W1 = 0xBB67AE85. `split_key` makes a 64-bit seed into (k0, k1),
low word first; `uniform53` makes two words into a double in [0, 1) on the grid of 2^-53, so
one counter gives two uniforms.

How, in torch. torch has no uint32 arithmetic, so a word is an int64 holding a value in
[0, 2^32). The product M * c can reach 2^64 - 2^33 + 1 and overflow int64; instead
s = (M - 2^32) * c is taken, which lies in (-2^62, 0] since 2^32 - M < 2^30. Then
M * c = s + 2^32 c gives lo = s & (2^32 - 1) and hi = c + (s >> 32), the shift being an
arithmetic one (a floor division): exact, with no overflow. On the CPU the rounds run over
chunks of 2^16 elements in seven preallocated buffers, in place, so that the working set
stays in cache and no round allocates memory.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "PHILOX_M4x32_0",
    "PHILOX_M4x32_1",
    "PHILOX_W32_0",
    "PHILOX_W32_1",
    "philox4x32",
    "uniform53",
    "split_key",
]

PHILOX_M4x32_0 = 0xD2511F53
"""M0, the multiplier of counter word 0 (Random123's name)."""
PHILOX_M4x32_1 = 0xCD9E8D57
"""M1, the multiplier of counter word 2."""
PHILOX_W32_0 = 0x9E3779B9
"""W0, the Weyl increment of key word 0 per round: floor(2^32 (sqrt(5) - 1) / 2), the golden
ratio's."""
PHILOX_W32_1 = 0xBB67AE85
"""W1, the Weyl increment of key word 1 per round: floor(2^32 (sqrt(3) - 1))."""

_WORD_MASK = 0xFFFFFFFF
_CPU_CHUNK = 1 << 16  # elements per chunk: seven int64 buffers of it fit the caches
_MULTIPLIERS_MINUS_2_32 = (PHILOX_M4x32_0 - (1 << 32), PHILOX_M4x32_1 - (1 << 32))  # in (-2^30, 0)


def philox4x32(
    c0: torch.Tensor,
    c1: torch.Tensor,
    c2: torch.Tensor,
    c3: torch.Tensor,
    k0: int | torch.Tensor,
    k1: int | torch.Tensor,
    rounds: int = 10,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox4x32 with `rounds` rounds of the counter (c0, c1, c2, c3) under the key (k0, k1),
    element-wise over the arguments' broadcast shape.

    Counters are int64 tensors of uint32 words (values in [0, 2^32)); keys are such ints or
    tensors. Returns the four output words (w0, w1, w2, w3), int64 tensors of uint32 words, on
    c0's device.
    """
    _check_arguments(c0, c1, c2, c3, k0, k1, rounds)
    inputs = (c0, c1, c2, c3, k0, k1)
    shape = torch.broadcast_shapes(*(x.shape for x in inputs if isinstance(x, torch.Tensor)))
    n, device = math.prod(shape), c0.device
    flat = [_flatten(x, shape) for x in inputs]
    out = [torch.empty(n, dtype=torch.int64, device=device) for _ in range(4)]
    buffers = torch.empty(7, _chunk_length(n, device), dtype=torch.int64, device=device)
    for part in _chunks(n, device):
        length = part.stop - part.start
        counters, spares = list(buffers[:4, :length]), list(buffers[4:, :length])
        for counter, word in zip(counters, flat[:4], strict=True):
            counter.copy_(_take(word, part))
        keys = _take(flat[4], part), _take(flat[5], part)
        for o, word in zip(out, _rounds(counters, spares, *keys, rounds), strict=True):
            o[part].copy_(word)
    w0, w1, w2, w3 = (o.view(shape) for o in out)
    return w0, w1, w2, w3


def _check_arguments(c0, c1, c2, c3, k0, k1, rounds) -> None:
    for word, name in ((c0, "c0"), (c1, "c1"), (c2, "c2"), (c3, "c3")):
        _check_words(word, name)
    for word, name in ((k0, "k0"), (k1, "k1")):
        _check_words(word, name, int_allowed=True)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise ValueError(f"rounds must be a non-negative int, got {rounds!r}")


def _rounds(counters: list[torch.Tensor], spares: list[torch.Tensor], k0, k1, rounds: int):
    """`rounds` Philox rounds on four equal-length word tensors, overwriting them and the three
    equal-length spare buffers; returns the four result words (some of those seven buffers)."""
    c0, c1, c2, c3 = counters
    lo0, hi0, hi1 = spares
    for _ in range(rounds):
        # -- (hi0, lo0) = M0 * c0 --
        torch.mul(c0, _MULTIPLIERS_MINUS_2_32[0], out=lo0)
        torch.bitwise_right_shift(lo0, 32, out=hi0).add_(c0)
        lo0.bitwise_and_(_WORD_MASK)
        # -- (hi1, lo1) = M1 * c2, lo1 written over c0, which is no longer needed --
        lo1 = torch.mul(c2, _MULTIPLIERS_MINUS_2_32[1], out=c0)
        torch.bitwise_right_shift(lo1, 32, out=hi1).add_(c2)
        lo1.bitwise_and_(_WORD_MASK)
        # -- the new counter; the buffers of the old c1, c2, c3 become the spares --
        hi1.bitwise_xor_(c1).bitwise_xor_(k0)
        hi0.bitwise_xor_(c3).bitwise_xor_(k1)
        (c0, c1, c2, c3), (lo0, hi0, hi1) = (hi1, lo1, hi0, lo0), (c1, c2, c3)
        k0, k1 = (k0 + PHILOX_W32_0) & _WORD_MASK, (k1 + PHILOX_W32_1) & _WORD_MASK
    return c0, c1, c2, c3


def uniform53(w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """The double ((w0 >> 5) 2^26 + (w1 >> 6)) 2^-53 in [0, 1) from two uint32 words (int64
    tensors, broadcast): w0 gives its 27 high bits as the high bits, w1 its 26 high bits below
    them; every multiple of 2^-53 in [0, 1) is equally likely. Exact, float64."""
    _check_words(w0, "w0")
    _check_words(w1, "w1")
    shape = torch.broadcast_shapes(w0.shape, w1.shape)
    high, low = _flatten(w0, shape), _flatten(w1, shape)
    u = torch.empty(shape, dtype=torch.float64, device=w0.device)
    for part in _chunks(u.numel(), w0.device):
        bits = torch.bitwise_right_shift(_take(high, part), 5).bitwise_left_shift_(26)
        bits = torch.bitwise_or(bits, torch.bitwise_right_shift(_take(low, part), 6))
        u.view(-1)[part].copy_(bits).mul_(2.0**-53)  # bits < 2^53: exact in float64
    return u


def _chunk_length(n: int, device: torch.device) -> int:
    """Elements per chunk of work: `_CPU_CHUNK` on the CPU, to work in cache; n elsewhere."""
    return min(n, _CPU_CHUNK) if device.type == "cpu" else n


def _chunks(n: int, device: torch.device) -> list[slice]:
    """range(n) in slices of `_chunk_length` elements."""
    step = max(_chunk_length(n, device), 1)
    return [slice(start, min(start + step, n)) for start in range(0, n, step)]


def _flatten(x: int | torch.Tensor, shape: torch.Size) -> int | torch.Tensor:
    """x broadcast to `shape` and flattened; an int, or a 0-d tensor for one element, stays
    whole (the operations broadcast it)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.numel() == 1:
        return x.reshape(())
    return x.expand(shape).reshape(-1)  # a view where x already has the shape, contiguous


def _take(x: int | torch.Tensor, part: slice) -> int | torch.Tensor:
    """The chunk `part` of a flattened argument (an int or a 0-d tensor is whole)."""
    return x[part] if isinstance(x, torch.Tensor) and x.dim() == 1 else x


def split_key(key: int) -> tuple[int, int]:
    """A 64-bit key (a seed, 0 <= key < 2^64) as Philox's two key words (k0 low, k1 high)."""
    if not isinstance(key, int) or isinstance(key, bool):
        raise TypeError(f"key must be an int, got {type(key).__name__}")
    if not 0 <= key < 1 << 64:
        raise ValueError(f"key must be a 64-bit word, 0 <= key < 2**64, got {key}")
    return key & _WORD_MASK, key >> 32


def _check_words(x, name: str, *, int_allowed: bool = False) -> None:
    """x is an int64 tensor (or, where allowed, an int) whose values are uint32 words."""
    if int_allowed and isinstance(x, int) and not isinstance(x, bool):
        if not 0 <= x <= _WORD_MASK:
            raise ValueError(f"{name} must be a uint32 word, 0 <= {name} < 2**32, got {x}")
        return
    if not isinstance(x, torch.Tensor) or x.dtype != torch.int64:
        what = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        kinds = "an int or an int64 tensor" if int_allowed else "an int64 tensor"
        raise TypeError(f"{name} must be {kinds} of uint32 words, got {what}")
    if x.numel() == 0:
        return
    low, high = torch.aminmax(x)
    if low < 0 or high > _WORD_MASK:
        bad = int(low) if low < 0 else int(high)
        raise ValueError(f"{name} must hold uint32 words, 0 <= {name} < 2**32, found {bad}")
