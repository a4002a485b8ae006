"""Comparison helpers that say what a person needs when bits differ, and the restated casts
the kernels' oracles share."""

import torch


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float32/float64 tensor as integers."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int64)


def assert_same_bits(ours: torch.Tensor, ref: torch.Tensor, inputs: torch.Tensor, what: str = ""):
    """Equal bit for bit, any NaN matching any NaN; on failure, the first mismatch in detail."""
    ours, ref = ours.reshape(-1), ref.reshape(-1).to(ours.dtype)
    same = (bits_of(ours) == bits_of(ref)) | (torch.isnan(ours) & torch.isnan(ref))
    if bool(same.all()):
        return
    bad = (~same).nonzero().flatten()
    i = int(bad[0])
    x = inputs.reshape(-1)[i].item() if inputs is not None else None
    raise AssertionError(
        f"{what}: {bad.numel()} of {same.numel()} differ; first at flat index {i}: "
        f"input {x!r} ({float(x).hex() if x is not None else ''}), ours {ours[i].item()!r} "
        f"(bits {hex(int(bits_of(ours)[i]))}), reference {ref[i].item()!r} "
        f"(bits {hex(int(bits_of(ref)[i]))})"
    )


E2M1_THRESHOLDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]  # RNE decision points of 0..6


def te_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """TE's cast_to_fp4x2 table (also PTX ``cvt.rn.satfinite.e2m1x2.f32``): code k for |x|
    in its interval, ties to the even code, saturating at 6; the sign in bit 3."""
    a = x.abs()
    mag = torch.zeros_like(a, dtype=torch.int64)
    for k, t in enumerate(E2M1_THRESHOLDS):
        tie_up = k % 2 == 1  # the code above an odd threshold index is even
        mag += ((a > t) | ((a == t) & tie_up)).to(torch.int64)
    return (mag | torch.where(x < 0, 8, 0)).to(torch.uint8)


def e4m3_satfinite(x: torch.Tensor) -> torch.Tensor:
    """``__nv_fp8_e4m3(x)`` / ``cvt.rn.satfinite.e4m3x2.f32``: nearest even, clamped to
    +-448 (NaN stays NaN), as float32; torch's own cast is the rounding."""
    return torch.clamp(x.float(), -448.0, 448.0).to(torch.float8_e4m3fn).float()


def spread(shape, seed=0, dtype=torch.float32, low=-30, high=30):
    """Gaussian rows times log-spaced row magnitudes 2^[low, high), with one zero block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x = x * torch.exp2(torch.randint(low, high, (*shape[:-1], 1), generator=gen).float())
    x[..., 0, :32] = 0
    return x.to(dtype)
