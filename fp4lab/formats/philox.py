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
[0, 2^32). The product p = M * c can reach 2^64 - 2^33 + 1; torch's int64 product wraps
modulo 2^64 (two's complement, on the CPU as on CUDA: the instructions it compiles to), so
its 64 bits are the unsigned product's and lo = p & (2^32 - 1), hi = (p >> 32) & (2^32 - 1)
(the arithmetic shift copies the sign bit into the upper half, which the mask clears). The
tests compare every round with Python's integers. On full-size buffers the masks are taken
once per new word: a round leaves c1 and c3 as the whole products whose low words they are,
and the next round's mask of c0 = hi ^ c1 ^ k0 (and of c2) clears those high words together
with the shift's sign bits; the last round's c1 and c3 are masked at the end. (An exact
product without wrapping, (M - 2^32) c and hi = c + (s >> 32), costs an int64 addition per
product, as slow on the CPU as the product itself.)

Counters usually come as a grid: each word varies along a few dims of the broadcast shape
(for stochastic rounding, c0 along the columns, c1 along the rows, c2 with the head, c3 with
the batch). A round's output words vary along the union of the dims of the words they mix,
so the first rounds run on the broadcast (small) words and cost what those hold; once two
of the four words span the whole shape, the remaining rounds run in place on full-size
buffers (seven of them: four words, three spares), so that no round allocates memory. On the
CPU the broadcast shape is cut into pieces of at most 2^18 elements, to bound the buffers'
size; the rounds are element-wise, so neither the grid nor the pieces change a word.
"""

from __future__ import annotations

import itertools
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
_CPU_PIECE = 1 << 18  # elements per piece of the broadcast shape on the CPU (seven int64 buffers)


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
    tensors. Returns the four output words (w0, w1, w2, w3), int64 tensors of uint32 words
    with the broadcast shape, contiguous, on c0's device.
    """
    _check_arguments(c0, c1, c2, c3, k0, k1, rounds)
    words = (c0, c1, c2, c3, k0, k1)
    shape = torch.broadcast_shapes(*(x.shape for x in words if isinstance(x, torch.Tensor)))
    limit = _CPU_PIECE if c0.device.type == "cpu" else math.prod(shape)
    if math.prod(shape) <= limit:
        return _philox_piece(words, shape, rounds)
    out = tuple(torch.empty(shape, dtype=torch.int64, device=c0.device) for _ in range(4))
    scratch = torch.empty(7, limit, dtype=torch.int64, device=c0.device)  # reused by every piece
    for index in _pieces(shape, limit):
        part, piece = [_piece_of(x, index) for x in words], out[0][index].shape
        for whole, word in zip(out, _philox_piece(part, piece, rounds, scratch), strict=True):
            whole[index] = word
    return out


def _check_arguments(c0, c1, c2, c3, k0, k1, rounds) -> None:
    for word, name in ((c0, "c0"), (c1, "c1"), (c2, "c2"), (c3, "c3")):
        _check_words(word, name)
    for word, name in ((k0, "k0"), (k1, "k1")):
        _check_words(word, name, int_allowed=True)
    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 0:
        raise ValueError(f"rounds must be a non-negative int, got {rounds!r}")


def _philox_piece(words, shape: torch.Size, rounds: int, scratch: torch.Tensor | None = None):
    """`rounds` rounds of the broadcastable words (c0, c1, c2, c3, k0, k1) over `shape`:
    broadcast rounds while at most one counter word spans the shape, then in place on
    buffers of `shape` (views of `scratch`, (7, >= numel), where given)."""
    c0, c1, c2, c3, k0, k1 = words
    n, done = math.prod(shape), 0
    while done < rounds and sum(c.numel() == n for c in (c0, c1, c2, c3)) <= 1:
        c0, c1, c2, c3 = _broadcast_round(c0, c1, c2, c3, k0, k1)
        k0, k1 = _next_keys(k0, k1)
        done += 1
    if scratch is None:
        scratch = torch.empty(7, n, dtype=torch.int64, device=c0.device)
    buffers = [b[:n].view(shape) for b in scratch]
    owned = done > 0  # words a round made may serve as buffers; the caller's may not
    counters = [
        c.view(shape) if owned and c.numel() == n and c.is_contiguous() else b.copy_(c)
        for c, b in zip((c0, c1, c2, c3), buffers, strict=False)
    ]
    w0, w1, w2, w3 = _rounds(counters, buffers[4:], k0, k1, rounds - done)
    return w0, w1, w2, w3


def _broadcast_round(c0, c1, c2, c3, k0, k1):
    """One Philox round on broadcastable words: each product on its own word's shape, each
    new word on the broadcast shape of the words it mixes."""
    p0 = c0 * PHILOX_M4x32_0  # wraps modulo 2^64: the unsigned product's bits
    hi0 = torch.bitwise_right_shift(p0, 32).bitwise_and_(_WORD_MASK)
    lo0 = p0.bitwise_and_(_WORD_MASK)
    p1 = c2 * PHILOX_M4x32_1
    hi1 = torch.bitwise_right_shift(p1, 32).bitwise_and_(_WORD_MASK)
    lo1 = p1.bitwise_and_(_WORD_MASK)
    return _xor3(hi1, c1, k0), lo1, _xor3(hi0, c3, k1), lo0


def _xor3(fresh: torch.Tensor, word: torch.Tensor, key) -> torch.Tensor:
    """fresh ^ key ^ word for broadcastable words, `fresh` (a tensor a round made) overwritten
    where the result has its shape; the key (an int, or a tensor) first."""
    out = fresh.bitwise_xor_(key) if _fits(key, fresh) else torch.bitwise_xor(fresh, key)
    return out.bitwise_xor_(word) if _fits(word, out) else torch.bitwise_xor(out, word)


def _fits(x, into: torch.Tensor) -> bool:
    """Whether x (an int or a tensor) broadcasts into `into` without growing it."""
    if not isinstance(x, torch.Tensor):
        return True
    pairs = zip(reversed(x.shape), reversed(into.shape), strict=False)
    return x.ndim <= into.ndim and all(a in (1, b) for a, b in pairs)


def _next_keys(k0, k1):
    """The next round's key words: (k0 + W0, k1 + W1) mod 2^32."""
    return (k0 + PHILOX_W32_0) & _WORD_MASK, (k1 + PHILOX_W32_1) & _WORD_MASK


def _rounds(counters: list[torch.Tensor], spares: list[torch.Tensor], k0, k1, rounds: int):
    """`rounds` Philox rounds on four equal-shape word tensors, overwriting them and the three
    equal-shape spare buffers; returns the four result words (some of those seven buffers).
    Between rounds c1 and c3 hold whole 64-bit products, masked by the next round or at the
    end (the module docstring, "How, in torch")."""
    c0, c1, c2, c3 = counters
    p0, hi0, hi1 = spares
    for _ in range(rounds):
        # -- p0 = M0 * c0 and p1 = M1 * c2 (p1 written over c0, no longer needed); the low
        #    words are the new c3 and c1, the high words (sign bits above) mix below --
        torch.mul(c0, PHILOX_M4x32_0, out=p0)
        torch.bitwise_right_shift(p0, 32, out=hi0)
        p1 = torch.mul(c2, PHILOX_M4x32_1, out=c0)
        torch.bitwise_right_shift(p1, 32, out=hi1)
        # -- the new c0 and c2, masked to 32 bits; the old c1, c2, c3 become the spares --
        hi1.bitwise_xor_(c1).bitwise_xor_(k0).bitwise_and_(_WORD_MASK)
        hi0.bitwise_xor_(c3).bitwise_xor_(k1).bitwise_and_(_WORD_MASK)
        (c0, c1, c2, c3), (p0, hi0, hi1) = (hi1, p1, hi0, p0), (c1, c2, c3)
        k0, k1 = _next_keys(k0, k1)
    if rounds:  # the last products' low words
        c1.bitwise_and_(_WORD_MASK)
        c3.bitwise_and_(_WORD_MASK)
    return c0, c1, c2, c3


def _pieces(shape: torch.Size, limit: int):
    """Index tuples (one slice per dim) cutting `shape` into row-major pieces of at most
    `limit` elements (slices of the last dim where that dim alone is longer)."""
    d, inner, k = len(shape), 1, len(shape)
    while k > 0 and inner * shape[k - 1] <= limit:
        inner, k = inner * shape[k - 1], k - 1
    if k == 0:  # the whole shape is one piece
        yield (slice(None),) * d
        return
    step = max(1, limit // inner)  # along dim k - 1; the dims after it are whole
    whole = (slice(None),) * (d - k)
    for outer in itertools.product(*(range(n) for n in shape[: k - 1])):
        head = tuple(slice(i, i + 1) for i in outer)
        for start in range(0, shape[k - 1], step):
            yield head + (slice(start, min(start + step, shape[k - 1])),) + whole


def _piece_of(x, index: tuple[slice, ...]):
    """The part of a broadcastable word (an int or a tensor) that a piece of the broadcast
    shape reads: its dims of size one stay whole."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.reshape((1,) * (len(index) - x.ndim) + tuple(x.shape))
    return x[tuple(i if n > 1 else slice(None) for i, n in zip(index, x.shape, strict=True))]


def uniform53(w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """The double ((w0 >> 5) 2^26 + (w1 >> 6)) 2^-53 in [0, 1) from two uint32 words (int64
    tensors, broadcast): w0 gives its 27 high bits as the high bits, w1 its 26 high bits below
    them; every multiple of 2^-53 in [0, 1) is equally likely. Exact, float64."""
    _check_words(w0, "w0")
    _check_words(w1, "w1")
    shape = torch.broadcast_shapes(w0.shape, w1.shape)
    u = torch.empty(shape, dtype=torch.float64, device=w0.device)
    limit = _CPU_PIECE if w0.device.type == "cpu" else max(u.numel(), 1)
    for index in _pieces(shape, limit):
        high, low = _piece_of(w0, index), _piece_of(w1, index)
        bits = torch.bitwise_right_shift(high, 5).bitwise_left_shift_(26)
        bits = torch.bitwise_or(bits, torch.bitwise_right_shift(low, 6))
        u[index].copy_(bits).mul_(2.0**-53)  # bits < 2^53: exact in float64
    return u


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
