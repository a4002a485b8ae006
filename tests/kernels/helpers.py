"""What the backward kernel tests share: bf16 inputs on the device the kernels run on, one
forward and backward of a recipe, and the relative distances they are compared by."""

import torch

import fp4lab

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRADS = ("dq", "dk", "dv")


def inputs(b, h, hk, sq, sk, d, seed):
    """(q, k, v, dO) bf16 on DEVICE: q and dO with h heads of sq rows, k and v hk of sk."""
    g = torch.Generator().manual_seed(seed)
    make = lambda heads, s: torch.randn(b, heads, s, d, generator=g).to(DEVICE, torch.bfloat16)  # noqa: E731
    return make(h, sq), make(hk, sk), make(hk, sk), make(h, sq)


def run(q, k, v, do, recipe, backend_name="triton", **options):
    """The output and the gradients of q, k, v of one call of `recipe` on `backend_name`."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fp4lab.attention(*leaves, recipe, backend=backend_name, **options)
    out.backward(do)
    return dict(zip(("o", *GRADS), (out.detach(), *(x.grad for x in leaves)), strict=True))


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def rel_but_rows(a, b, rows: int) -> float:
    """rel(a, b) with the `rows` rows (sequence positions of a (B, H, S, E) gradient) that
    differ most left out of both."""
    worst = (a.float() - b.float()).abs().amax(-1).flatten().topk(rows).indices
    keep = torch.ones(a.shape[:-1], dtype=torch.bool, device=a.device).flatten()
    keep[worst] = False
    return rel(a.reshape(-1, a.shape[-1])[keep], b.reshape(-1, b.shape[-1])[keep])
