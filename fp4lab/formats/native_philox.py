"""Philox4x32-10's float32 uniforms from a small C function built at first use, on the CPU.

What. `grid_uniforms(c0, c1, c2, c3, k0, k1)` takes the counter grid `fused_philox` forms,
c0 (P, 1, n), c1 (P, r, 1), c2 and c3 (P, 1, 1), and gives its float32 uniforms (P, r, 4 n):
Philox4x32-10 (`fp4lab.formats.philox`) of each counter, each of its four words rounded
toward zero to 24 significant bits and scaled by 2^-32, side by side. The same bits as the
eager path and the compiled one; None where it cannot run (then `fused_philox` runs the
compiled path).

Why. Inductor's code for the compiled path multiplies in int64 lanes (a 64 x 64-bit product
where Philox needs 32 x 32 -> 64) and writes the four words side by side in scalar loops:
about 1.2 ms for 2^18 counters on 2 cores. Written in C on uint32 words, the compiler's
vectorised widening product does the rounds and the words are interleaved in registers:
about 0.5 ms.

How. The C source below is compiled once per machine with the C++ compiler inductor uses
(``-O3 -march=native -fopenmp``), into a cache directory keyed by the source, the flags, the
compiler and this CPU's model and feature flags (a library built for another CPU's
instructions is never loaded; ``FP4LAB_NATIVE_CACHE``, default a per-user folder of the temp
directory), and loaded with ctypes; it runs on `torch.get_num_threads()` OpenMP threads.
Unsigned 32-bit arithmetic wraps by definition in C, so the words are Philox's exactly; the
only float operations are the conversion of an integer of at most 24 significant bits to
float32 and the scaling by 2^-32, both exact. Any failure to build or load turns it off for
the process; ``FP4LAB_NATIVE_PHILOX=0`` turns it off too.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile

import torch

__all__ = ["grid_uniforms", "enabled"]

_SOURCE = r"""
#include <stdint.h>
#define LANES 32
/* out (P, r, 4 n): the four words of counter (c0[p, j], c1[p, i], c2[p], c3[p]) at
   out[p, i, 4 j .. 4 j + 3], rounded toward zero to 24 bits, times 2^-32 */
extern "C" void philox_uniforms(const int64_t *c0, const int64_t *c1, const int64_t *c2,
                                const int64_t *c3, int64_t P, int64_t r, int64_t n,
                                uint32_t k0, uint32_t k1, int threads, float *out) {
  #pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
  for (int64_t p = 0; p < P; p++)
    for (int64_t i = 0; i < r; i++) {
      float *o = out + (p * r + i) * 4 * n;
      uint32_t b1 = (uint32_t)c1[p * r + i], b2 = (uint32_t)c2[p], b3 = (uint32_t)c3[p];
      const int64_t *a0 = c0 + p * n;
      for (int64_t j0 = 0; j0 < n; j0 += LANES) {
        int64_t m = n - j0 < LANES ? n - j0 : LANES;
        uint32_t x0[LANES], x1[LANES], x2[LANES], x3[LANES];
        for (int l = 0; l < LANES; l++) {
          x0[l] = (uint32_t)a0[j0 + (l < m ? l : 0)];
          x1[l] = b1; x2[l] = b2; x3[l] = b3;
        }
        uint32_t y0 = k0, y1 = k1;
        #pragma GCC unroll 1
        for (int round = 0; round < 10; round++) {
          for (int l = 0; l < LANES; l++) {
            uint64_t m0 = (uint64_t)x0[l] * 0xD2511F53u, m1 = (uint64_t)x2[l] * 0xCD9E8D57u;
            uint32_t n0 = (uint32_t)(m1 >> 32) ^ x1[l] ^ y0;
            uint32_t n2 = (uint32_t)(m0 >> 32) ^ x3[l] ^ y1;
            x1[l] = (uint32_t)m1; x3[l] = (uint32_t)m0; x0[l] = n0; x2[l] = n2;
          }
          y0 += 0x9E3779B9u; y1 += 0xBB67AE85u;
        }
        float f[4][LANES];
        const uint32_t *w[4] = {x0, x1, x2, x3};
        for (int q = 0; q < 4; q++)
          for (int l = 0; l < LANES; l++) {
            uint32_t v = w[q][l], s = v >> 24;  /* clear the bits below the 24 leading ones */
            s |= s >> 1; s |= s >> 2; s |= s >> 4;
            f[q][l] = (float)(v & ~s) * 0x1p-32f;
          }
        for (int l = 0; l < m; l++) {
          o[4 * (j0 + l)] = f[0][l]; o[4 * (j0 + l) + 1] = f[1][l];
          o[4 * (j0 + l) + 2] = f[2][l]; o[4 * (j0 + l) + 3] = f[3][l];
        }
      }
    }
}
"""
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-x", "c++"]
_state = {"function": None, "failed": os.environ.get("FP4LAB_NATIVE_PHILOX", "1") == "0"}


def enabled() -> bool:
    """Whether the C function may run: not turned off, and not failed in this process."""
    return not _state["failed"]


def grid_uniforms(c0, c1, c2, c3, k0: int, k1: int) -> torch.Tensor | None:
    """The float32 uniforms (P, r, 4 n) of contiguous int64 CPU counters c0 (P, 1, n),
    c1 (P, r, 1), c2, c3 (P, 1, 1) holding uint32 words, under the uint32 key words
    (k0, k1); None where the C function cannot be built or loaded."""
    if not enabled():
        return None
    if not all(c.dtype == torch.int64 and c.device.type == "cpu" and c.is_contiguous()
               for c in (c0, c1, c2, c3)):
        return None  # the C function reads raw contiguous int64 memory
    try:
        function = _function()
    except Exception:  # no compiler, a failed build, ...: the caller's path from now on
        _state["failed"] = True
        return None
    p, r, n = c0.shape[0], c1.shape[1], c0.shape[2]
    out = torch.empty(p, r, 4 * n, dtype=torch.float32)
    pointer = ctypes.c_void_p
    function(
        *(pointer(c.data_ptr()) for c in (c0, c1, c2, c3)),
        ctypes.c_int64(p), ctypes.c_int64(r), ctypes.c_int64(n),
        ctypes.c_uint32(k0), ctypes.c_uint32(k1), ctypes.c_int(torch.get_num_threads()),
        pointer(out.data_ptr()),
    )  # fmt: skip
    return out


def _function():
    """The loaded C function, built into the cache at the first call."""
    if _state["function"] is None:
        compiler = _compiler()
        key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, _cpu()]).encode()).hexdigest()
        folder = os.environ.get("FP4LAB_NATIVE_CACHE") or os.path.join(
            tempfile.gettempdir(), f"fp4lab_native_{os.getuid()}"
        )
        library = os.path.join(folder, f"philox_{key[:24]}.so")
        if not os.path.exists(library):
            _build(compiler, folder, library)
        function = ctypes.CDLL(library).philox_uniforms
        function.restype = None
        _state["function"] = function
    return _state["function"]


def _cpu() -> str:
    """This CPU's architecture, model name and feature flags (what -march=native compiles
    for), as /proc/cpuinfo lists them where it exists."""
    import platform

    lines = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    lines.append(line.strip())
                if line.strip() == "":  # the first processor's block is enough
                    break
    except OSError:
        pass
    return "\n".join(lines)


def _compiler() -> str:
    """Inductor's C++ compiler where torch can name it, else c++."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:
        return "c++"
    return get_cpp_compiler()


def _build(compiler: str, folder: str, library: str) -> None:
    """Compile the source into `library`, written under a private name and then moved into
    place (concurrent builds each finish with a whole file)."""
    os.makedirs(folder, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source, built = os.path.join(work, "philox.cpp"), os.path.join(work, "philox.so")
        with open(source, "w") as f:
            f.write(_SOURCE)
        subprocess.run(
            [compiler, *_FLAGS, source, "-o", built], check=True, capture_output=True, timeout=120
        )
        os.replace(built, library)
