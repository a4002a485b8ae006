"""fp4lab.kernels.random under Triton's interpreter: Philox4x32 and uniform53 in Triton give
the torch reference's words and doubles bit for bit, on Random123's known answers and on a
grid of counters, with the key as two scalars and per element.

The functions run under the interpreter whatever TRITON_INTERPRET says and whenever
fp4lab.kernels.random was first imported: `triton.jit` picks compiled or interpreted when it
decorates a function, so the test wraps the plain Python functions behind fp4lab's jitted ones
in the interpreter's `InterpretedFunction` itself."""

import importlib

import pytest
import torch

from fp4lab.formats.philox import philox4x32 as philox4x32_torch
from fp4lab.formats.philox import split_key
from fp4lab.formats.philox import uniform53 as uniform53_torch

triton = pytest.importorskip("triton")
tl = importlib.import_module("triton.language")
InterpretedFunction = importlib.import_module("triton.runtime.interpreter").InterpretedFunction
kernels = importlib.import_module("fp4lab.kernels.random")

philox4x32 = InterpretedFunction(kernels.philox4x32.fn)
uniform53 = InterpretedFunction(kernels.uniform53.fn)

MASK = 0xFFFFFFFF
BLOCK = 1024
KNOWN_ANSWERS = {  # Random123's tests/kat_vectors: rounds, counter, key, result
    "7-zeros": (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    "7-pi": (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
             (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    "10-zeros": (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    "10-ones": (10, (MASK,) * 4, (MASK, MASK), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    "10-pi": (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
}


def _words_and_uniforms(counters_ptr, keys_ptr, words_ptr, uniforms_ptr, N,
                        ROUNDS: tl.constexpr, KEYS_PER_ELEMENT: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Element i's counter is column i of the (4, N) int64 counters, its key column i of the
    (2, N) keys (or the (2,) keys, for all); its words go to column i of the (4, N) words,
    uniform53(w0, w1) and uniform53(w2, w3) to column i of the (2, N) uniforms."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < N
    c0 = tl.load(counters_ptr + i, mask=inside).to(tl.uint32)
    c1 = tl.load(counters_ptr + N + i, mask=inside).to(tl.uint32)
    c2 = tl.load(counters_ptr + 2 * N + i, mask=inside).to(tl.uint32)
    c3 = tl.load(counters_ptr + 3 * N + i, mask=inside).to(tl.uint32)
    if KEYS_PER_ELEMENT:
        k0 = tl.load(keys_ptr + i, mask=inside).to(tl.uint32)
        k1 = tl.load(keys_ptr + N + i, mask=inside).to(tl.uint32)
    else:
        k0 = tl.load(keys_ptr).to(tl.uint32)
        k1 = tl.load(keys_ptr + 1).to(tl.uint32)
    w0, w1, w2, w3 = philox4x32(c0, c1, c2, c3, k0, k1, ROUNDS)
    tl.store(words_ptr + i, w0.to(tl.int64), mask=inside)
    tl.store(words_ptr + N + i, w1.to(tl.int64), mask=inside)
    tl.store(words_ptr + 2 * N + i, w2.to(tl.int64), mask=inside)
    tl.store(words_ptr + 3 * N + i, w3.to(tl.int64), mask=inside)
    tl.store(uniforms_ptr + i, uniform53(w0, w1), mask=inside)
    tl.store(uniforms_ptr + N + i, uniform53(w2, w3), mask=inside)


words_and_uniforms_kernel = InterpretedFunction(_words_and_uniforms)


def run_triton(counters: torch.Tensor, keys: torch.Tensor, rounds: int):
    """The kernel's (4, N) words and (2, N) uniforms for (4, N) counters and (2,) or (2, N)
    keys, all int64 tensors of uint32 words."""
    n = counters.shape[1]
    words = torch.empty(4, n, dtype=torch.int64)
    uniforms = torch.empty(2, n, dtype=torch.float64)
    words_and_uniforms_kernel[(triton.cdiv(n, BLOCK),)](
        counters, keys, words, uniforms, n,
        ROUNDS=rounds, KEYS_PER_ELEMENT=keys.dim() == 2, BLOCK=BLOCK,
    )
    return words, uniforms


def run_torch(counters: torch.Tensor, keys: torch.Tensor, rounds: int):
    """The same from fp4lab.formats.philox."""
    key_words = list(keys) if keys.dim() == 2 else [int(k) for k in keys]
    w0, w1, w2, w3 = philox4x32_torch(*counters, *key_words, rounds=rounds)
    uniforms = torch.stack([uniform53_torch(w0, w1), uniform53_torch(w2, w3)])
    return torch.stack([w0, w1, w2, w3]), uniforms


def assert_same_as_torch(counters: torch.Tensor, keys: torch.Tensor, rounds: int):
    """Triton's words and uniforms equal torch's bit for bit; a failure names the first
    mismatching element, its counter and key, and both results in hex."""
    words, uniforms = run_triton(counters, keys, rounds)
    want_words, want_uniforms = run_torch(counters, keys, rounds)
    same = (words == want_words).all(0)
    same &= (uniforms.view(torch.int64) == want_uniforms.view(torch.int64)).all(0)
    if bool(same.all()):
        return
    i = int((~same).nonzero()[0])
    key = keys[:, i] if keys.dim() == 2 else keys
    raise AssertionError(
        f"{int((~same).sum())} of {same.numel()} elements differ ({rounds} rounds); first, "
        f"element {i} (block {i // BLOCK}): counter {hex_words(counters[:, i])}, key "
        f"{hex_words(key)}: triton words {hex_words(words[:, i])}, uniforms "
        f"{hex_floats(uniforms[:, i])}; torch words {hex_words(want_words[:, i])}, uniforms "
        f"{hex_floats(want_uniforms[:, i])}"
    )


def hex_words(words: torch.Tensor) -> str:
    return " ".join(f"{int(w):08x}" for w in words)


def hex_floats(values: torch.Tensor) -> str:
    return " ".join(float(v).hex() for v in values)


def grid_of_counters(n: int, seed: int) -> torch.Tensor:
    """(4, n) counters: c0 the position (as a kernel numbers its elements), the other words
    the edge words in turn, then random ones."""
    gen = torch.Generator().manual_seed(seed)
    counters = torch.randint(0, 1 << 32, (4, n), generator=gen)
    counters[0] = torch.arange(n)
    edges = torch.tensor([0, 1, 0x7FFFFFFF, 0x80000000, MASK])
    counters[1:, : len(edges) ** 3] = torch.cartesian_prod(edges, edges, edges).T
    return counters


@pytest.mark.parametrize("rounds, counter, key, result", KNOWN_ANSWERS.values(), ids=KNOWN_ANSWERS)
def test_known_answers(rounds, counter, key, result):
    words, _ = run_triton(torch.tensor(counter).reshape(4, 1), torch.tensor(key), rounds)
    assert tuple(words[:, 0].tolist()) == result
    assert_same_as_torch(torch.tensor(counter).reshape(4, 1), torch.tensor(key), rounds)


ONE_KEY_CASES = {  # rounds, the 64-bit key
    "10-zero": (10, 0),
    "10-deadbeef12345678": (10, 0xDEADBEEF_12345678),
    "10-ones": (10, (1 << 64) - 1),
    "7-12345": (7, 12345),
}


@pytest.mark.parametrize("rounds, key", ONE_KEY_CASES.values(), ids=ONE_KEY_CASES)
def test_grid_of_counters_under_one_key(rounds, key):
    """4000 elements: three full blocks and a partial one."""
    assert_same_as_torch(grid_of_counters(4000, seed=0), torch.tensor(split_key(key)), rounds)


def test_a_key_per_element():
    keys = torch.randint(0, 1 << 32, (2, 3000), generator=torch.Generator().manual_seed(1))
    keys[:, :2] = torch.tensor([[0, MASK], [MASK, 0]])
    assert_same_as_torch(grid_of_counters(3000, seed=2), keys, rounds=10)
