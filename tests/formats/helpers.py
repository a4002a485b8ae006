"""Comparison helpers that say what a person needs when bits differ."""

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
