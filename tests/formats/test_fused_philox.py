"""The compiled Philox uniforms (`fp4lab.formats.fused_philox`) against the eager path, bit for
bit, on random counters and keys across the whole 32-bit range; where it applies; and the
eager fallback where it cannot be built."""

import os
import random
import subprocess
import sys

import pytest
import torch

from fp4lab.formats import fused_philox, native_philox, streams
from fp4lab.formats.philox import PHILOX_M4x32_0, PHILOX_M4x32_1, philox4x32, split_key

MASK = 0xFFFFFFFF
EDGE_WORDS = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFF, 0x1000000, 0xFFFFFFFE, MASK]


def eager(c0, c1, c2, c3, k0, k1) -> torch.Tensor:
    """The eager path's float32 uniforms of the same counters."""
    return streams._float32_side_by_side(philox4x32(c0, c1, c2, c3, k0, k1))


def words(shape, rng: random.Random) -> torch.Tensor:
    """uint32 words of `shape` (int64), the edge words first, then uniform ones."""
    n = 1
    for s in shape:
        n *= s
    values = EDGE_WORDS + [rng.getrandbits(32) for _ in range(n)]
    return torch.tensor(values[:n]).view(shape)


def fused_or_skip(*args) -> torch.Tensor:
    u = fused_philox.fused_uniforms(*args)
    if u is None:
        pytest.skip("the compiled path cannot be built here (the eager path runs)")
    return u


def first_mismatch(got: torch.Tensor, want: torch.Tensor) -> str:
    bad = (got.view(torch.int32) != want.view(torch.int32)).nonzero()[0].tolist()
    return f"element {bad}: fused {got[tuple(bad)].item()!r}, eager {want[tuple(bad)].item()!r}"


@pytest.mark.parametrize("seed", range(4))
def test_fused_equals_eager_on_random_counters_and_keys(seed):
    rng = random.Random(seed)
    p, r, n = (2, 2, 8, 16)[seed], (64, 128, 32, 64)[seed], (512, 256, 256, 64)[seed]
    counters = (words((p, 1, n), rng), words((p, r, 1), rng), words((p, 1, 1), rng),
                words((p, 1, 1), rng))
    keys = [(0, 0), (MASK, MASK), (0x80000000, 1)][seed % 3] if seed < 3 else (
        rng.getrandbits(32), rng.getrandbits(32))
    got, want = fused_or_skip(*counters, *keys), eager(*counters, *keys)
    assert got.shape == want.shape == (p, r, 4 * n) and got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), first_mismatch(got, want)


def test_fused_equals_eager_on_attention_grids():
    # a block of tiles (B, Hkv, G, n, m, r, c) and a whole tensor (B, H, S, E), as drawn
    key = streams.stream_key(12345, 7)
    tiles = (torch.arange(2).view(-1, 1, 1, 1, 1, 1, 1), torch.arange(4).view(1, 2, 2, 1, 1, 1, 1),
             (3 + torch.arange(4).view(1, 1, 1, 4, 1, 1, 1)) * 64
             + torch.arange(64).view(1, 1, 1, 1, 1, 64, 1),
             (1 + torch.arange(2).view(1, 1, 1, 1, 2, 1, 1)) * 64
             + torch.arange(64).view(1, 1, 1, 1, 1, 1, 64))
    whole = [torch.arange(n).view([-1 if d == i else 1 for d in range(4)])
             for i, n in enumerate((2, 3, 1024, 64))]
    for batch, head, row, column in (tiles, whole):
        fused_philox._state["failed"] = False
        got = streams.uniforms(key, batch, head, row, column, dtype=torch.float32)
        args = (column[..., ::4] >> 2, row, head, batch, *split_key(key))
        fused_or_skip(*args)
        want = eager(*args)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), first_mismatch(got, want)


@pytest.mark.parametrize("m", [PHILOX_M4x32_0, PHILOX_M4x32_1], ids=["m0", "m1"])
def test_the_products_words_match_exact_integers(m):
    # the compiled path's arithmetic, run eagerly: the high and low words of m c, and no
    # intermediate at or past 2^63 (signed overflow), against Python's exact integers
    rng = random.Random(m)
    c = torch.tensor(EDGE_WORDS + [rng.getrandbits(32) for _ in range(4096)])
    hi, lo = fused_philox._mul_hi_lo(c, m)
    want = [v * m for v in c.tolist()]
    assert hi.tolist() == [w >> 32 for w in want] and lo.tolist() == [w & MASK for w in want]
    assert max(v * (m - (1 << 31)) for v in c.tolist()) < 1 << 63


def test_rounding_toward_zero_to_24_bits_matches_exact_integers():
    rng = random.Random(24)
    w = torch.tensor(EDGE_WORDS + [(1 << k) + d for k in range(32) for d in (-1, 0, 1)][1:]
                     + [rng.getrandbits(32) for _ in range(4096)])
    cut = [v >> max(0, v.bit_length() - 24) << max(0, v.bit_length() - 24) for v in w.tolist()]
    assert fused_philox._toward_zero_24(w).double().tolist() == [float(v) for v in cut]


@pytest.mark.parametrize(
    "case",
    ["small", "size-one rows", "one leading element", "tensor key", "c1 along the columns",
     "c2 along the rows", "one dim"],
)
def test_where_the_compiled_path_does_not_apply(case):
    p, r, n = 4, 64, 256
    c0, c1 = torch.arange(n).view(1, 1, n), torch.arange(r).view(1, r, 1)
    c2, c3 = torch.arange(p).view(p, 1, 1), torch.zeros(1, 1, 1, dtype=torch.int64)
    k0, k1 = 5, 6
    if case == "small":
        c0 = c0[..., :8]
    elif case == "size-one rows":
        c1 = c1[:, :1]
        c0 = torch.arange(p * 64 * n).view(p * 64, 1, n) % (1 << 20)
        c2 = torch.zeros(1, 1, 1, dtype=torch.int64)
    elif case == "one leading element":
        c2 = c2[:1]
        c0 = torch.arange(1 << 16).view(1, 1, -1)
    elif case == "tensor key":
        k0 = torch.tensor(5)
    elif case == "c1 along the columns":
        c1 = torch.arange(r * n).view(1, r, n)
    elif case == "c2 along the rows":
        c2 = torch.arange(p * r).view(p, r, 1)
    else:
        c0, c1, c2, c3 = (torch.arange(1 << 18) >> 2,) * 4
    assert fused_philox.fused_uniforms(c0, c1, c2, c3, k0, k1) is None


def test_a_failed_build_falls_back_to_the_eager_path_for_the_process(monkeypatch):
    monkeypatch.setitem(native_philox._state, "failed", True)  # the compiled path
    def broken(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setitem(fused_philox._state, "kernel", broken)
    monkeypatch.setitem(fused_philox._state, "failed", False)
    position = [torch.arange(n).view([-1 if d == i else 1 for d in range(4)])
                for i, n in enumerate((1, 4, 512, 128))]
    got = streams.uniforms(99, *position, dtype=torch.float32)
    assert not fused_philox.enabled()
    args = (position[3][..., ::4] >> 2, position[2], position[1], position[0], 99, 0)
    assert torch.equal(got, eager(*args))
    assert fused_philox.fused_uniforms(*args) is None  # stays off


def test_no_compiler_turns_it_off_before_compiling(monkeypatch):
    monkeypatch.setitem(native_philox._state, "failed", True)  # the compiled path
    cpp_builder = pytest.importorskip("torch._inductor.cpp_builder")

    def missing():
        raise RuntimeError("No working C++ compiler found")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    monkeypatch.setitem(fused_philox._state, "kernel", None)
    monkeypatch.setitem(fused_philox._state, "failed", False)
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("compiled anyway"))
    c0, c1 = torch.arange(256).view(1, 1, 256), torch.arange(256).view(1, 256, 1)
    c2, c3 = torch.arange(2).view(2, 1, 1), torch.zeros(1, 1, 1, dtype=torch.int64)
    assert fused_philox.fused_uniforms(c0, c1, c2, c3, 1, 2) is None
    assert not fused_philox.enabled() and fused_philox._state["kernel"] is None


def test_bad_words_are_rejected_as_on_the_eager_path():
    c0 = torch.arange(256).view(1, 1, 256)
    c1, c2 = torch.arange(256).view(1, 256, 1), torch.arange(2).view(2, 1, 1)
    c3 = torch.full((1, 1, 1), 1 << 32)
    with pytest.raises(ValueError, match="c3 must hold uint32 words"):
        fused_philox.fused_uniforms(c0, c1, c2, c3, 0, 0)


def test_the_environment_variable_turns_it_off():
    code = "from fp4lab.formats import fused_philox as f; print(f.enabled())"
    env = {**os.environ, "FP4LAB_FUSED_PHILOX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("native", [True, False], ids=["c-function", "compiled"])
def test_each_fast_path_equals_eager(native, monkeypatch):
    # fused_uniforms takes the C function first; with it off, the torch.compile'd pass
    monkeypatch.setitem(native_philox._state, "failed", not native)
    rng = random.Random(7)
    p, r, n = 8, 256, 40  # 2^16 counters and more; n not a multiple of 32 lanes
    counters = (words((p, 1, n), rng), words((p, r, 1), rng), words((p, 1, 1), rng),
                words((p, 1, 1), rng))
    keys = (rng.getrandbits(32), rng.getrandbits(32))
    if native and native_philox.grid_uniforms(*counters, *keys) is None:
        pytest.skip("the C function cannot be built here")
    got, want = fused_or_skip(*counters, *keys), eager(*counters, *keys)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), first_mismatch(got, want)
