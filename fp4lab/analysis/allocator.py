"""glibc's malloc and the simulation's block temporaries on the CPU.

glibc serves large requests with mmap and returns freed heap memory above its trim threshold
to the system; both thresholds rise (for the rest of the process) when a large mapped chunk,
up to 32 MiB, is freed. A block's temporaries are a few MiB each and are freed and requested
again every block, so with glibc's starting thresholds each one is mapped and faulted in
anew, which costs as much as the arithmetic. `settle` allocates and frees one untouched
30 MiB buffer, which raises the thresholds to 30 and 60 MiB, so the temporaries are recycled;
`trim` hands what they left free back to the system at the end of a call: after the backward,
or after a forward that no backward follows (the raised thresholds would otherwise keep it).
Between a forward and its backward the free heap is kept, for the backward's temporaries to
reuse (trimmed, they would be faulted in anew). Larger tensors (plain attention's dense
seq x seq matrices) are served as before; elsewhere than glibc this is a harmless
allocation. Only calls on the CPU with at least `LARGE_SCORES` score entries are handled;
small calls (tests) leave malloc alone. This changes process-wide glibc state; there is no
opt-out.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

__all__ = ["settle", "trim", "LARGE_SCORES"]

# malloc thresholds `settle` sets (bytes): above every block temporary
_SETTLE_BYTES = 30 << 20
# Calls with at least this many score entries (B * H * Sq * Sk) get the allocator handling
LARGE_SCORES = 1 << 22


def _load_libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def _large_cpu_call(device: torch.device, scores: int) -> bool:
    return device.type == "cpu" and scores >= LARGE_SCORES


def settle(device: torch.device, scores: int) -> None:
    """Raise glibc's mmap and trim thresholds before a large CPU pass (see the module)."""
    if _large_cpu_call(device, scores):
        torch.empty(_SETTLE_BYTES, dtype=torch.uint8)


def trim(device: torch.device, scores: int) -> None:
    """Return the heap memory a large CPU call left free (glibc's malloc_trim)."""
    if _large_cpu_call(device, scores) and _LIBC is not None:
        _LIBC.malloc_trim(0)
