"""Philox4x32 and its 53-bit uniforms in Triton: the generator of `fp4lab.formats.philox`.

These are device functions for fp4lab's kernels to call, the same function as the torch
reference, word for word: the module docstring of `fp4lab.formats.philox` gives the
definition (Salmon et al. 2011, Random123's `philox4x32_10`) and why fp4lab draws its random
bits from a counter keyed by a seed rather than from a stream. A kernel that numbers its
elements as the reference does gets the same bits, and so rounds the same way, as the
simulation path on any device.

In Triton a word is a uint32 tensor, so the arithmetic is the definition itself: `tl.umulhi`
gives the high word of a 32 x 32 bit product and the wrapping uint32 product its low word;
the round keys are bumped by wrapping uint32 additions. The constants are the reference's.
The tests run these functions under Triton's interpreter and compare them with the torch
implementation bit for bit. This module needs triton; `fp4lab.kernels` does not import it.
"""

import triton
import triton.language as tl

from fp4lab.formats import philox

PHILOX_M4x32_0: tl.constexpr = tl.constexpr(philox.PHILOX_M4x32_0)
PHILOX_M4x32_1: tl.constexpr = tl.constexpr(philox.PHILOX_M4x32_1)
PHILOX_W32_0: tl.constexpr = tl.constexpr(philox.PHILOX_W32_0)
PHILOX_W32_1: tl.constexpr = tl.constexpr(philox.PHILOX_W32_1)
TWO_TO_MINUS_53: tl.constexpr = tl.constexpr(2.0**-53)  # exact in float32, as Triton keeps it


@triton.jit
def philox4x32(c0, c1, c2, c3, k0, k1, ROUNDS: tl.constexpr):
    """Philox4x32 with ROUNDS rounds of the counter (c0, c1, c2, c3) under the key (k0, k1):
    uint32 tensors or scalars, broadcast. Returns the four output words, uint32."""
    tl.static_assert(c0.dtype == tl.uint32, "philox4x32: counter word c0 must be uint32")
    tl.static_assert(c1.dtype == tl.uint32, "philox4x32: counter word c1 must be uint32")
    tl.static_assert(c2.dtype == tl.uint32, "philox4x32: counter word c2 must be uint32")
    tl.static_assert(c3.dtype == tl.uint32, "philox4x32: counter word c3 must be uint32")
    tl.static_assert(k0.dtype == tl.uint32, "philox4x32: key word k0 must be uint32")
    tl.static_assert(k1.dtype == tl.uint32, "philox4x32: key word k1 must be uint32")
    for _ in tl.static_range(ROUNDS):
        hi0 = tl.umulhi(c0, PHILOX_M4x32_0)
        lo0 = tl.mul(c0, PHILOX_M4x32_0, sanitize_overflow=False)
        hi1 = tl.umulhi(c2, PHILOX_M4x32_1)
        lo1 = tl.mul(c2, PHILOX_M4x32_1, sanitize_overflow=False)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = tl.add(k0, PHILOX_W32_0, sanitize_overflow=False)
        k1 = tl.add(k1, PHILOX_W32_1, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def uniform53(w0, w1):
    """The float64 ((w0 >> 5) 2^26 + (w1 >> 6)) 2^-53 in [0, 1) from two uint32 words: the 27
    high bits of w0 above the 26 high bits of w1, as `fp4lab.formats.philox.uniform53`."""
    bits = ((w0 >> 5).to(tl.uint64) << 26) | (w1 >> 6).to(tl.uint64)
    return bits.to(tl.float64) * TWO_TO_MINUS_53  # bits < 2^53: exact


@triton.jit
def tile_words(k0, k1, batch, head, rows, col0, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The uint32 words of a (ROWS, COLS) tile of a stream keyed (k0, k1) (uint32), as
    `fp4lab.formats.streams.uniforms` draws them: element (r, c) of the tile, at row rows[r]
    and column col0 + c (col0 a multiple of 4), takes word c % 4 of Philox4x32-10 at the
    counter (column // 4, row, head, batch). One counter serves four columns: the words of
    a (ROWS, COLS / 4) grid of counters are interleaved along the columns."""
    zeros = tl.zeros([ROWS, COLS // 4], dtype=tl.uint32)
    c0 = zeros + (col0 // 4 + tl.arange(0, COLS // 4)).to(tl.uint32)[None, :]
    c1 = zeros + rows.to(tl.uint32)[:, None]
    c2 = zeros + tl.cast(head, tl.uint32)  # an int argument of 1 is a constexpr
    c3 = zeros + tl.cast(batch, tl.uint32)
    w0, w1, w2, w3 = philox4x32(c0, c1, c2, c3, k0, k1, 10)
    # join's new axis is the last: (ROWS, COLS / 4, 2, 2) holds word 2 i + j at [..., i, j]
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (ROWS, COLS))


TWO_TO_MINUS_32: tl.constexpr = tl.constexpr(2.0**-32)


@triton.jit
def _stream_uniforms_kernel(
    Out, K0, K1, chunk, H, S, E, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """One (ROWS, COLS) tile of one (batch, head) of a whole operand's uniforms, float64: word
    e % 4 of Philox4x32-10 at the counter (e // 4, s, h, b mod chunk) under the key of
    sample b // chunk (K0, K1: int64 words, one per sample), times 2^-32."""
    bh, rb, cb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, h = bh // H, bh % H
    sample = b // chunk
    k0 = tl.load(K0 + sample).to(tl.uint32)
    k1 = tl.load(K1 + sample).to(tl.uint32)
    rows = rb * ROWS + tl.arange(0, ROWS)
    cols = cb * COLS + tl.arange(0, COLS)
    words = tile_words(k0, k1, b - sample * chunk, h, rows, cb * COLS, ROWS, COLS)
    offs = (bh * S + rows[:, None]).to(tl.int64) * E + cols[None, :]
    inside = (rows[:, None] < S) & (cols[None, :] < E)
    tl.store(Out + offs, words.to(tl.float64) * TWO_TO_MINUS_32, mask=inside)


def stream_uniforms(keys, shape, device):
    """`fp4lab.formats.streams.tensor_uniforms` in one Triton kernel, bit for bit: the float64
    uniforms of a whole operand (B, heads, seq, E) for the stream keyed by `keys` (a 64-bit
    key, or a tuple of n keys, each drawing one of n equal consecutive chunks of the batch, its
    batch counted from 0), element (b, h, s, e) at counter (e // 4, s, h, b). The torch
    reference runs Philox's ten rounds as some 120 elementwise passes over int64 buffers of
    the whole tensor; this writes each uniform once."""
    import torch

    b, h, s, e = shape
    keys = keys if isinstance(keys, tuple) else (keys,)
    if b % len(keys):
        raise ValueError(f"keys: {len(keys)} keys do not split a batch of {b} into equal chunks")
    words = torch.tensor([philox.split_key(k) for k in keys], dtype=torch.int64, device=device)
    out = torch.empty(shape, dtype=torch.float64, device=device)
    if out.numel() == 0:
        return out
    cols = min(128, max(4, triton.next_power_of_2(e)))
    rows = max(1, min(64, 4096 // cols))
    grid = (b * h, triton.cdiv(s, rows), triton.cdiv(e, cols))
    _stream_uniforms_kernel[grid](out, words[:, 0].contiguous(), words[:, 1].contiguous(),
                                  b // len(keys), h, s, e, ROWS=rows, COLS=cols)  # fmt: skip
    return out
