"""Philox4x32 in torch: Random123's known answers, an independent pure-Python Philox as the
oracle on thousands of random counters and keys, chunking, shapes and broadcasting,
uniform53's exact values, split_key, and bad input."""

import math
import random
import re
import sys

import pytest
import torch

from fp4lab.formats.philox import philox4x32, split_key, uniform53

philox_module = sys.modules["fp4lab.formats.philox"]

MASK = 0xFFFFFFFF
EDGE_WORDS = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, MASK]


def philox_python(counter, key, rounds=10):
    """Philox4x32 on Python ints, written from Salmon et al. 2011 and Random123's philox.h;
    it shares no code or constant with fp4lab's."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2  # exact 64-bit products
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK, (p0 >> 32) ^ c3 ^ k1, p0 & MASK
        k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
    return c0, c1, c2, c3


def philox_torch(counter, key, rounds=10):
    """fp4lab's Philox on one counter, as Python ints."""
    words = philox4x32(*(torch.tensor(c) for c in counter), *key, rounds=rounds)
    return tuple(int(w) for w in words)


IMPLEMENTATIONS = {"torch": philox_torch, "python": philox_python}

# Random123's tests/kat_vectors, its philox4x32 lines: rounds, counter, key, result.
KNOWN_ANSWERS = {
    "7-zeros": (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    "7-ones": (7, (MASK,) * 4, (MASK, MASK), (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    "7-pi": (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
             (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    "10-zeros": (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    "10-ones": (10, (MASK,) * 4, (MASK, MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    "10-pi": (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
}


def hex_words(words) -> str:
    return " ".join(f"{int(w):08x}" for w in words)


def random_words(n: int, seed: int) -> torch.Tensor:
    """n uint32 words as int64: the edge words first, then uniform ones."""
    rng = random.Random(seed)
    words = EDGE_WORDS + [rng.getrandbits(32) for _ in range(n - len(EDGE_WORDS))]
    return torch.tensor(words[:n])


def assert_matches_python(words, counters, keys, rounds: int):
    """fp4lab's words (4 tensors) equal philox_python's for every element of the broadcast
    counters and keys; a failure names the first mismatching element."""
    shape = words[0].shape
    counters = [c.expand(shape).reshape(-1).tolist() for c in counters]
    keys = [k.expand(shape).reshape(-1).tolist() if torch.is_tensor(k) else [k] * len(counters[0])
            for k in keys]
    got = torch.stack([w.reshape(-1) for w in words], dim=1).tolist()
    elements = zip(got, zip(*counters, strict=True), zip(*keys, strict=True), strict=True)
    for i, (ours, counter, key) in enumerate(elements):
        want = philox_python(counter, key, rounds)
        assert tuple(ours) == want, (
            f"element {i} of {len(got)} (shape {tuple(shape)}): counter {hex_words(counter)}, "
            f"key {hex_words(key)}, {rounds} rounds: ours {hex_words(ours)}, "
            f"python {hex_words(want)}"
        )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("rounds, counter, key, result", KNOWN_ANSWERS.values(), ids=KNOWN_ANSWERS)
def test_known_answers(implementation, rounds, counter, key, result):
    got = IMPLEMENTATIONS[implementation](counter, key, rounds)
    assert got == result, f"{implementation}: {hex_words(got)}, Random123: {hex_words(result)}"


@pytest.mark.parametrize("rounds", [0, 1, 7, 10, 16])
def test_random_counters_and_keys_match_python(rounds):
    """3000 elements, each with its own counter and key (keys as tensors)."""
    counters = [random_words(3000, seed) for seed in range(4)]
    keys = [random_words(3000, seed) for seed in (4, 5)]
    assert_matches_python(philox4x32(*counters, *keys, rounds=rounds), counters, keys, rounds)


@pytest.mark.parametrize("key", [0, 0xDEADBEEF_12345678, (1 << 64) - 1])
def test_int_keys_match_python(key):
    counters = [random_words(2000, seed) for seed in range(4)]
    keys = split_key(key)
    assert_matches_python(philox4x32(*counters, *keys), counters, keys, rounds=10)


@pytest.mark.parametrize("piece", [1, 7, 1000], ids=lambda n: f"pieces-of-{n}")
def test_pieces_do_not_change_the_words(monkeypatch, piece):
    """Cut into pieces of `piece` elements (the CPU cuts at 2^18): an element's words do not
    depend on the piece it is computed in, nor on where the pieces begin and end."""
    n = 5003
    counters = [torch.arange(n), random_words(n, 1), torch.tensor(7), torch.tensor(MASK)]
    whole = torch.stack(philox4x32(*counters, 0x1234, 0xABCD))
    monkeypatch.setattr(philox_module, "_CPU_PIECE", piece)
    assert torch.equal(torch.stack(philox4x32(*counters, 0x1234, 0xABCD)), whole)
    for start, stop in [(0, 3), (995, 1010), (n - 400, n), (1, n)]:
        part = [c[start:stop] if c.dim() else c for c in counters]
        assert torch.equal(torch.stack(philox4x32(*part, 0x1234, 0xABCD)), whole[:, start:stop])
    sample = [0, 1, 999, 1000, 1001, 4999, n - 1]
    picked = [c[sample] if c.dim() else c for c in counters]
    assert_matches_python(whole[:, sample], picked, (0x1234, 0xABCD), rounds=10)


GRIDS = {  # counter words along a few dims each, as stochastic rounding's positions are
    "tiles": ((1, 1, 1, 3, 1, 7, 5), (1, 1, 1, 1, 1, 7, 1), (1, 2, 3, 1, 1, 1, 1),
              (2, 1, 1, 1, 1, 1, 1)),
    "rows-inner": ((3, 5, 1), (3, 1, 11), (1, 1, 1), (1, 1, 1)),
    "one-full": ((4, 9, 13), (1, 9, 1), (), (1, 1, 13)),
    "columns-only": ((6, 1, 1), (), (), ()),
    "empty": ((0, 3), (1, 3), (), ()),
}


@pytest.mark.parametrize("rounds", [0, 1, 2, 3, 4, 10])
@pytest.mark.parametrize("piece", [7, 1 << 18], ids=lambda n: f"pieces-of-{n}")
@pytest.mark.parametrize("grid", GRIDS)
def test_broadcast_grids_draw_what_their_materialised_counters_draw(monkeypatch, grid, piece,
                                                                   rounds):
    """Counters given as a broadcast grid (the first rounds then run on the small words) give
    the words of the same counters materialised element by element, which the Python
    Philox checks; the caller's words are left as they were."""
    shapes = GRIDS[grid]
    words = [random_words(math.prod(s), seed).long().reshape(s) for seed, s in enumerate(shapes)]
    keys = (0x9E3779B9, random_words(5, 9).reshape(5, 1, 1)[:1]) if grid == "rows-inner" else (
        0xFFFFFFFF, 0)
    before = [w.clone() for w in words]
    monkeypatch.setattr(philox_module, "_CPU_PIECE", piece)
    got = philox4x32(*words, *keys, rounds=rounds)
    shape = torch.broadcast_shapes(*shapes)
    assert all(w.shape == shape and w.is_contiguous() for w in got)
    assert all(torch.equal(w, b) for w, b in zip(words, before, strict=True))
    flat = [w.expand(shape).contiguous() for w in words]
    monkeypatch.setattr(philox_module, "_CPU_PIECE", 1 << 18)
    want = philox4x32(*flat, *keys, rounds=rounds)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"word {i}: first mismatch at {(a != b).nonzero()[:1].tolist()}"
    if math.prod(shape):
        assert_matches_python(got, flat, keys, rounds)


def test_broadcasting_and_shapes():
    c0 = random_words(12, 0).reshape(3, 4)[:, :1]  # (3, 1)
    c1 = random_words(4, 1)  # (4,)
    c2 = torch.tensor(0xFFFFFFFF)  # ()
    c3 = random_words(8, 2).reshape(4, 2).T[:1]  # (1, 4), not contiguous
    k0 = random_words(3, 3).reshape(3, 1)
    words = philox4x32(c0, c1, c2, c3, k0, 99)
    assert all(w.shape == (3, 4) and w.dtype == torch.int64 for w in words)
    assert_matches_python(words, (c0, c1, c2, c3), (k0, 99), rounds=10)


def test_empty_and_zero_dimensional_counters():
    empty = torch.zeros(0, 3, dtype=torch.int64)
    assert all(w.shape == (0, 3) for w in philox4x32(empty, empty, empty, empty, 1, 2))
    zero = torch.tensor(0)
    words = philox4x32(zero, zero, zero, zero, 0, 0)
    assert all(w.shape == () for w in words)
    assert tuple(int(w) for w in words) == KNOWN_ANSWERS["10-zeros"][3]


def test_words_are_uint32_and_use_all_32_bits():
    words = torch.stack(philox4x32(torch.arange(4096), *(torch.tensor(0),) * 3, 5, 6))
    assert words.dtype == torch.int64
    assert int(words.min()) >= 0 and int(words.max()) <= MASK
    assert float((words >> 31).double().mean()) == pytest.approx(0.5, abs=0.02)  # sd 0.004: 5 sd


# -- uniform53 --


UNIFORM53_CASES = [  # w0, w1, the double: (w0 >> 5) 2^-27 + (w1 >> 6) 2^-53
    (0, 0, 0.0),
    (31, 63, 0.0),  # the dropped low bits
    (0, 64, 2.0**-53),
    (32, 0, 2.0**-27),
    (0x80000000, 0, 0.5),
    (0x80000000, 0x80000000, 0.5 + 2.0**-28),
    (0x12345678, 0x9ABCDEF0, (0x12345678 >> 5) * 2.0**-27 + (0x9ABCDEF0 >> 6) * 2.0**-53),
    (MASK, MASK, 1.0 - 2.0**-53),  # the largest: just below 1
]


@pytest.mark.parametrize("w0, w1, value", UNIFORM53_CASES, ids=lambda v: f"{v:#x}"
                         if isinstance(v, int) else v.hex())
def test_uniform53_hand_computed(w0, w1, value):
    u = uniform53(torch.tensor(w0), torch.tensor(w1))
    assert u.dtype == torch.float64 and float(u).hex() == value.hex()


def test_uniform53_is_exact_on_random_words():
    """u 2^53 is exactly the integer (w0 >> 5) 2^26 + (w1 >> 6), on words chosen at random
    and on the edge words (every pair of them)."""
    edges = torch.tensor(EDGE_WORDS)
    w0 = torch.cat([random_words(5000, 0), edges.repeat_interleave(len(EDGE_WORDS))])
    w1 = torch.cat([random_words(5000, 1), edges.repeat(len(EDGE_WORDS))])
    u = uniform53(w0, w1)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    want = [(a >> 5) * 2**26 + (b >> 6) for a, b in zip(w0.tolist(), w1.tolist(), strict=True)]
    assert [int(x) for x in (u * 2.0**53).tolist()] == want


def test_uniform53_broadcasts_and_chunks():
    w0 = random_words(3 * 50000, 0).reshape(3, 50000)
    w1 = random_words(50000, 1)
    u = uniform53(w0, w1)
    assert u.shape == (3, 50000)
    assert torch.equal(u[2], uniform53(w0[2], w1))
    assert torch.equal(u[:, 123], uniform53(w0[:, 123], w1[123]))


# -- split_key --


@pytest.mark.parametrize("key, words", [
    (0, (0, 0)),
    (0x01234567_89ABCDEF, (0x89ABCDEF, 0x01234567)),
    ((1 << 64) - 1, (MASK, MASK)),
])
def test_split_key(key, words):
    assert split_key(key) == words


@pytest.mark.parametrize("key, error, message", [
    (-1, ValueError, "key must be a 64-bit word, 0 <= key < 2**64, got -1"),
    (1 << 64, ValueError, "key must be a 64-bit word, 0 <= key < 2**64, got 18446744073709551616"),
    (1.0, TypeError, "key must be an int, got float"),
    (True, TypeError, "key must be an int, got bool"),
], ids=["negative", "2**64", "float", "bool"])
def test_split_key_rejects(key, error, message):
    with pytest.raises(error, match=re.escape(message)):
        split_key(key)


# -- bad input --


def words(*values):
    return torch.tensor(values, dtype=torch.int64)


GOOD = (words(1, 2), words(3, 4), words(5, 6), words(7, 8), 9, 10)
BAD_PHILOX_ARGUMENTS = [  # the argument's position, its bad value, the error and its message
    pytest.param(0, words(1, -1), ValueError,
                 "c0 must hold uint32 words, 0 <= c0 < 2**32, found -1", id="c0-negative"),
    pytest.param(2, words(1 << 32), ValueError,
                 "c2 must hold uint32 words, 0 <= c2 < 2**32, found 4294967296", id="c2-2**32"),
    pytest.param(1, words(1).float(), TypeError,
                 "c1 must be an int64 tensor of uint32 words, got dtype torch.float32",
                 id="c1-float32"),
    pytest.param(3, words(1).int(), TypeError,
                 "c3 must be an int64 tensor of uint32 words, got dtype torch.int32",
                 id="c3-int32"),
    pytest.param(0, 5, TypeError, "c0 must be an int64 tensor of uint32 words, got int",
                 id="c0-int"),
    pytest.param(4, -1, ValueError, "k0 must be a uint32 word, 0 <= k0 < 2**32, got -1",
                 id="k0-negative"),
    pytest.param(5, 1 << 32, ValueError,
                 "k1 must be a uint32 word, 0 <= k1 < 2**32, got 4294967296", id="k1-2**32"),
    pytest.param(4, 1.5, TypeError,
                 "k0 must be an int or an int64 tensor of uint32 words, got float", id="k0-float"),
    pytest.param(5, True, TypeError,
                 "k1 must be an int or an int64 tensor of uint32 words, got bool", id="k1-bool"),
    pytest.param(5, words(MASK + 1), ValueError,
                 "k1 must hold uint32 words, 0 <= k1 < 2**32, found 4294967296",
                 id="k1-tensor-2**32"),
]


@pytest.mark.parametrize("position, value, error, message", BAD_PHILOX_ARGUMENTS)
def test_philox4x32_rejects(position, value, error, message):
    arguments = list(GOOD)
    arguments[position] = value
    with pytest.raises(error, match=re.escape(message)):
        philox4x32(*arguments)


@pytest.mark.parametrize("rounds", [-1, 2.0, True])
def test_philox4x32_rejects_bad_rounds(rounds):
    message = f"rounds must be a non-negative int, got {rounds!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        philox4x32(*GOOD, rounds=rounds)


@pytest.mark.parametrize("w0, w1, message", [
    (words(-5), words(0), "w0 must hold uint32 words, 0 <= w0 < 2**32, found -5"),
    (words(0), words(1 << 40), "w1 must hold uint32 words, 0 <= w1 < 2**32, found 1099511627776"),
], ids=["w0-negative", "w1-2**40"])
def test_uniform53_rejects_out_of_range_words(w0, w1, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        uniform53(w0, w1)


def test_uniform53_rejects_non_integer_words():
    message = "w1 must be an int64 tensor of uint32 words, got dtype torch.float64"
    with pytest.raises(TypeError, match=message):
        uniform53(words(0), torch.zeros(1, dtype=torch.float64))
