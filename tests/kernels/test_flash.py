"""The Triton forward (`fp4lab.kernels.flash`) against the simulation path, under Triton's
interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU) and
compiled on a GPU.

Both paths quantize Q, K, V the same way and P with the same arithmetic, tile by tile, so
they differ only by the order of their fp32 sums (tl.dot against torch's matmul, the
online softmax's rescaling against the simulation's weighted sums) and exp2 against exp:
about 1e-7 relative, which the bf16 output turns into an occasional one-ulp (2^-8)
difference, plus the rare P element that sits within that error of a rounding boundary of
its format and rounds the other way. The budget below (2e-4 relative L2) covers that and is
two to three orders of magnitude below each recipe's own error against exact attention.
Where the kernel multiplies P V on a GPU's FP8 tensor cores (P and V holding E4M3 values),
Hopper accumulates part of each product in reduced precision (as FlashAttention-3's FP8
path does), which the simulation does not model: measured 5e-4 on the H200, budget 2e-3.
"""

import zlib

import pytest
import torch

import fp4lab
from fp4lab.analysis import attention as reference_attention
from fp4lab.recipes import resolve_recipe

pytest.importorskip("triton")
from fp4lab.kernels.backend import _fp8_pv  # noqa: E402

# the interpreter evaluates masked-out lanes too (inf - inf there); the kernel discards them
pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value:RuntimeWarning", "ignore:divide by zero:RuntimeWarning"
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUDGET = 2e-4
FP8_PV_BUDGET = 2e-3  # FP8 tensor cores' reduced-precision accumulation (GPU only)
RECIPES = [
    "exact", "nvfp4", "nvfp4_1level", "mxfp4", "mxfp4_alpha_ceil", "nvfp4_ue5m3",
    "fa4fp4_causal", "fa3_fp8", "attn_qat", "fa4fp4_causal_mxfp8pv", "fp8_per_tensor",
]  # fmt: skip


def inputs(b, h, hk, sq, sk, d, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda heads, s: torch.randn(b, heads, s, d, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
    return make(h, sq), make(hk, sk), make(hk, sk)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_the_kernel_is_the_simulation_up_to_summation_order(recipe, causal):
    q, k, v = inputs(1, 2, 1, 80, 96, 32, seed=zlib.crc32(recipe.encode()) % 1000)
    tiles = dict(block_m=32, block_n=32)
    got = fp4lab.attention(q, k, v, recipe, causal=causal, backend="triton", **tiles)
    want = reference_attention(q, k, v, recipe, causal=causal, **tiles)
    exact = reference_attention(q.double(), k.double(), v.double(), causal=causal, **tiles)
    assert got.shape == want.shape and got.dtype == q.dtype
    assert torch.isfinite(got.float()).all()
    diff, own = rel(got, want), rel(want, exact)
    budget = FP8_PV_BUDGET if DEVICE == "cuda" and _fp8_pv(resolve_recipe(recipe)) else BUDGET
    assert diff <= budget, f"{recipe}: kernel vs simulation {diff:.2e} (recipe's error {own:.2e})"


@pytest.mark.parametrize("recipe", ["nvfp4", "fa4fp4_causal", "exact"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq, sk", [(80, 72), (40, 100), (64, 64)])
def test_masked_and_unmasked_key_tiles_meet_where_they_should(recipe, causal, sq, sk):
    # the kernel skips the masks on tiles of whole query rows and visible keys only: partial
    # key tiles, partial query tiles and the causal band each take the masked path
    q, k, v = inputs(1, 2, 2, sq, sk, 32, seed=sq + sk)
    tiles = dict(block_m=32, block_n=16)
    got = fp4lab.attention(q, k, v, recipe, causal=causal, backend="triton", **tiles)
    want = reference_attention(q, k, v, recipe, causal=causal, **tiles)
    budget = FP8_PV_BUDGET if DEVICE == "cuda" and _fp8_pv(resolve_recipe(recipe)) else BUDGET
    assert rel(got, want) <= budget


def test_padded_query_rows_do_not_move_a_tile_scale():
    # NVFP4 P takes a tensor scale per tile: rows past the sequence must not enter its amax
    q, k, v = inputs(1, 1, 1, 40, 64, 32, seed=3)
    got = fp4lab.attention(q, k, v, "nvfp4", backend="triton", block_m=32, block_n=32)
    want = reference_attention(q, k, v, "nvfp4", block_m=32, block_n=32)
    assert rel(got, want) <= BUDGET


@pytest.mark.parametrize(
    "recipe, what",
    [("sageattn3", "smooth_q"), ("croissattn", "stochastic"), ("fa4fp4_causal_mxfp4pv", "direct"),
     ("sageattn3_paper", "row_scaled"), ("fa4fp4_directp", "row_reference=zero")],
)  # fmt: skip
def test_what_the_kernels_do_not_run_is_refused_by_name(recipe, what):
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=4)
    with pytest.raises(NotImplementedError, match=what):
        fp4lab.attention(q, k, v, recipe, backend="triton")


def test_backward_trace_mask_and_dtype_are_refused_not_replaced():
    q, k, v = inputs(1, 1, 1, 32, 32, 32, seed=5)
    with pytest.raises(NotImplementedError, match="trace"):
        fp4lab.attention(q, k, v, backend="triton", trace=fp4lab.Trace())
    with pytest.raises(NotImplementedError, match="attn_mask"):
        mask = torch.ones(32, 32, dtype=torch.bool, device=DEVICE)
        fp4lab.attention(q, k, v, backend="triton", attn_mask=mask)
    with pytest.raises(ValueError, match="q: the Triton backend runs bf16 or fp16"):
        fp4lab.attention(q.float(), k, v, backend="triton")
    q = q.clone().requires_grad_()
    out = fp4lab.attention(q, k, v, "nvfp4", backend="triton", block_m=32, block_n=32)
    with pytest.raises(NotImplementedError, match="Triton backward"):
        out.sum().backward()
