"""Position-keyed random streams: the uniforms stochastic rounding inside attention takes.

What. Each pass of an attention call (the forward, then the backward) draws one 62-bit key
from the call's generator (`pass_key`). An operand's stream is keyed by a 64-bit hash of
(pass key, the operand's stream id in `fp4lab.recipes.OPERANDS`) (`stream_key`), and every
element takes its uniform from Philox4x32-10 (`fp4lab.formats.philox`) at its absolute
position: the counter (c0, c1, c2, c3) = (column // 4, row, head, batch), the row being its
sequence position (the query position for P and dS), the column its feature (the key position
for P and dS), the head the query head (a whole key-side tensor's own head); the counter's
four output words serve four consecutive columns, and the uniform is the word times 2^-32.

Why here. Both execution paths draw from this one definition: the simulation
(`fp4lab.analysis.streams`, tile by tile) and the Triton backend (`fp4lab.kernels.backend`
for whole tensors, `fp4lab.kernels.random.tile_words` in registers for P and dS), so the
same seed rounds the same way on the CPU and the GPU, whatever the batch size, head count,
tiling or chunking. Rounding up where u < frac is exactly unbiased for a fraction of at most
32 bits below the quantum, and biased by less than 2^-32 of a quantum otherwise.

Float32 uniforms. `uniforms(..., dtype=torch.float32)` gives u rounded toward zero to float32,
u' (its 24 leading bits). It takes the same decisions as u wherever it is compared with a
number f of at most 24 significant bits, such as the fraction of a float32 value: u < f
exactly where u' < f (u' <= u; and where u' < f, f lies on float32's grid above u', so it is
at least the next float32 after u', which exceeds u). Where only its bits down to 2^-r count,
r <= 24 (floor(2^r u): `sr_bits` of at most 24), u' has them all (it drops bits below 2^-24
only). So stochastic rounding of float32 values compares in float32, at half the bytes of a
float64 comparison and without converting its fractions to float64.
"""

from __future__ import annotations

import torch

from fp4lab.formats.fused_philox import fused_uniforms
from fp4lab.formats.philox import philox4x32, split_key
from fp4lab.formats.rounding import as_generator

__all__ = ["as_generators", "pass_key", "stream_key", "stream_keys", "uniforms", "tensor_uniforms"]

_MASK64 = (1 << 64) - 1
_TWO_TO_MINUS_32 = 2.0**-32
_FLOAT64_TWO_TO_52_BITS = 0x4330000000000000  # the bits of the float64 2^52
BELOW_24_BITS = ~((1 << 29) - 1)
"""A float64's bits with its 29 low mantissa bits cleared (those float32 lacks): the bits of a
word's float64 and'ed with it, the word rounded toward zero to 24 leading bits."""


def as_generators(generator):
    """A call's generator(s): a torch.Generator from a generator or an int seed (an int seed
    makes a CPU generator), a tuple of them from a list or tuple of such (samples stacked
    along the batch: generator i draws for the i-th of n equal consecutive chunks of the
    batch, as a call on that chunk alone would), or None."""
    if isinstance(generator, (tuple, list)):
        if not generator:
            raise ValueError("generator: an empty sequence of generators")
        return tuple(as_generator(g) for g in generator)
    return as_generator(generator)


def pass_key(generator) -> int | tuple[int, ...]:
    """One pass's key: an int in [0, 2^62) drawn from `generator` on its own device, or one
    from each generator of a tuple (`as_generators`)."""
    if isinstance(generator, tuple):
        return tuple(pass_key(g) for g in generator)
    return int(torch.randint(0, 1 << 62, (1,), generator=generator, device=generator.device))


def stream_key(*values: int) -> int:
    """A 64-bit hash of a sequence of ints (splitmix64's finalizer, chained): the same on
    every machine and Python version; `stream_key(pass key, stream id)` keys a stream."""
    h = 0
    for v in values:
        h = (h ^ (v & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h


def stream_keys(key: int | tuple, stream: int) -> int | tuple:
    """The key of stream `stream` under a pass key, or under each of a tuple of them."""
    if isinstance(key, tuple):
        return tuple(stream_key(k, stream) for k in key)
    return stream_key(key, stream)


def uniforms(key: int, batch, head, row, column, dtype=torch.float64) -> torch.Tensor:
    """float64 uniforms of the broadcast shape of the int64 position tensors, for the stream
    keyed by `key`. Where `column`'s last dim runs over whole aligned groups of four
    (starts at a multiple of 4 and has a multiple of 4 entries), one counter serves four
    columns; elsewhere each element takes word (column % 4) of its own counter. With
    `dtype` float32, each uniform rounded toward zero to float32 (the module docstring)."""
    return _keyed(*split_key(key), batch, head, row, column, dtype)


def _keyed(k0, k1, batch, head, row, column, dtype=torch.float64) -> torch.Tensor:
    """`uniforms` under the key words (k0, k1): ints, or int64 tensors broadcast with the
    positions (a key per element)."""
    if dtype not in (torch.float64, torch.float32):
        raise ValueError(f"dtype must be torch.float64 or torch.float32, got {dtype}")
    first = column[..., :1]
    aligned = column.shape[-1] % 4 == 0 and bool((first % 4 == 0).all())
    if aligned:  # counters (..., columns / 4), their four words side by side
        counters = (column[..., ::4] >> 2, row, head, batch)
        if dtype == torch.float32:
            fused = fused_uniforms(*counters, k0, k1)  # None where it does not apply
            return fused if fused is not None else _float32_side_by_side(
                philox4x32(*counters, k0, k1)
            )
        words = philox4x32(*counters, k0, k1)
        stacked = torch.stack(torch.broadcast_tensors(*words), dim=-1).flatten(-2)
    else:
        words = torch.broadcast_tensors(*philox4x32(column >> 2, row, head, batch, k0, k1))
        stacked = (
            torch.stack(words, dim=-1)
            .gather(-1, (column % 4).unsqueeze(-1).expand(*words[0].shape, 1))
            .squeeze(-1)
        )
    u = stacked.to(torch.float64)
    if dtype == torch.float32:  # words below 2^53: the float64 conversion is exact
        u.view(torch.int64).bitwise_and_(BELOW_24_BITS)  # toward zero, to 24 leading bits
        return u.to(torch.float32).mul_(_TWO_TO_MINUS_32)  # both exact
    return u.mul_(_TWO_TO_MINUS_32)


def _float32_side_by_side(words) -> torch.Tensor:
    """Each counter's four words (philox4x32's own contiguous buffers (..., n), overwritten)
    as float32 uniforms rounded toward zero, side by side (..., 4 n). A word w becomes a
    float64 in place, exactly: w | 0x4330000000000000 is the float64 2^52 + w (w its mantissa
    field), less 2^52; two in-place integer and float passes where torch's int64-to-float64
    conversion is slower on the CPU than the rest together. Then its 29 low mantissa bits
    are cleared (toward zero to 24 leading bits) and it is written (exactly) into its
    columns of a float32 tensor, which is scaled by 2^-32 (exact)."""
    out = torch.empty(*words[0].shape, 4, dtype=torch.float32, device=words[0].device)
    for i, w in enumerate(words):
        d = w.bitwise_or_(_FLOAT64_TWO_TO_52_BITS).view(torch.float64).sub_(2.0**52)
        d.view(torch.int64).bitwise_and_(BELOW_24_BITS)
        out[..., i].copy_(d)
    return out.flatten(-2).mul_(_TWO_TO_MINUS_32)


def tensor_uniforms(key: int | tuple, shape, device, dtype=torch.float64) -> torch.Tensor:
    """The uniforms of a whole operand (B, heads, seq, E) for the stream keyed by `key`,
    float64 on `device` (or float32 as `uniforms` makes them): element (b, h, s, e) at counter
    (e // 4, s, h, b). A tuple of n keys draws each of n equal consecutive chunks of the
    batch with its own key, the chunk's batch counted from 0 (stacked samples)."""
    b, h, s, e = shape
    width = -(-e // 4) * 4  # whole groups of four columns, cropped after
    position = [torch.arange(n, device=device) for n in (b, h, s, width)]
    position = [p.view([-1 if d == i else 1 for d in range(4)]) for i, p in enumerate(position)]
    if not isinstance(key, tuple):
        return uniforms(key, *position, dtype=dtype)[..., :e]
    chunk = b // len(key)  # each chunk of the batch under its key, its batch counted from 0
    words = torch.tensor([split_key(k) for k in key], dtype=torch.int64, device=device)
    k0, k1 = (words[:, i].repeat_interleave(chunk).view(b, 1, 1, 1) for i in (0, 1))
    return _keyed(k0, k1, position[0] % chunk, *position[1:], dtype)[..., :e]
