"""Launching a Triton kernel again without binding its arguments anew.

What. `launch(kernel, grid, args, constants)` runs ``kernel[grid](*args, **constants)``: the
first time a call signature is seen, through `triton.jit` (which compiles the kernel or
finds it in its cache), and from then on by calling the compiled kernel it returned
directly, with the same arguments.

Why. Each ``kernel[grid](...)`` binds and specializes every parameter (the forward has about
110, its constexprs included), computes the cache key and checks the kernel's globals
before it launches: on the H200's host 150 us a forward launch under cProfile, against 50
for the compiled kernel's own launcher (benchmarks/gpu-runs/2026-12-03-s26, call 2,
`untraced_causal.host.txt`). The whole untraced call is bound by its host there
(benchmarks/GPU_SESSION.md, section 2), so this is time a user waits for.

How. The key holds everything Triton specializes a compiled kernel on, and more: the kernel;
the current device, on which the compiled kernel was loaded (`triton.jit` keeps one per
device); every constant (constexpr parameters and launch options such as num_warps) by
value; every scalar argument by type and value, where Triton keys an int on whether it is
1, divisible by 16 and fits 32 bits (so this key is never coarser: it may hold more entries,
never a wrong one); None arguments; each tensor's dtype, device index and whether its data
pointer is 16-byte aligned (Triton's pointer specialization). The stream is the current one at each
call, as `triton.jit` takes it. A caller whose plan fixes every scalar and constant says
so (`fixed`): its constants are then keyed by identity (the quantizers' `_BlocksPlan`),
which skips building the key by value.

Where. On a GPU. Under Triton's interpreter a launch returns no compiled kernel, so every
launch runs the interpreted function (the key is still built, so CPU tests check that every
argument is one it takes); the quantizers' interpreted launches go through
`fp4lab.kernels.quantize._run` instead. ``FP4LAB_DIRECT_LAUNCH=0`` (read at each call, so one
process can time both) sends every launch through `triton.jit`, for A/B timing and for
debugging a launch.
"""

from __future__ import annotations

import os

import torch

__all__ = ["launch", "direct", "static_key"]

_COMPILED: dict = {}  # key -> (compiled kernel, its constexpr values in order, fixed constants)
_MAX_ENTRIES = 4096


def direct() -> bool:
    """Whether launches after the first go to the compiled kernel (not FP4LAB_DIRECT_LAUNCH=0)."""
    return os.environ.get("FP4LAB_DIRECT_LAUNCH", "1") != "0"


def launch(kernel, grid: tuple, args: tuple, constants: dict, options: dict,
           fixed: bool = False, static: tuple | None = None):
    """``kernel[grid](*args, **constants, **options)``, the compiled kernel called directly
    where this signature ran before (module docstring). `args` fill the kernel's first
    parameters in order; `constants` name the rest (those left out take their defaults);
    `options` are the launch options (num_warps, num_stages, enable_fp_fusion). `fixed`: the
    caller's plan fixes every scalar argument and constant with this `constants` object,
    which is then keyed by identity. `static`: `static_key(constants, options)` where the
    caller has it already (so that it is not built twice). Returns the compiled
    kernel (None where `triton.jit` launched nothing)."""
    if not direct():
        return kernel[grid](*args, **constants, **options)
    if fixed:
        key = (kernel, _tensors(args), id(constants), _options_key(options), _current_device())
    else:
        static = static_key(constants, options) if static is None else static
        key = (kernel, _signature(args), static, _current_device())
    entry = _COMPILED.get(key)
    if entry is not None and (not fixed or entry[2] is constants):
        compiled, values, _ = entry
        compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *values)  # it takes three dims
        return compiled
    compiled = kernel[grid](*args, **constants, **options)
    if compiled is not None:
        if len(_COMPILED) >= _MAX_ENTRIES:
            _COMPILED.clear()
        rest = kernel.params[len(args):]
        values = tuple(constants[p.name] if p.name in constants else p.default for p in rest)
        _COMPILED[key] = (compiled, values, constants if fixed else None)
    return compiled


def static_key(constants: dict, options: dict) -> tuple:
    """The part of `launch`'s key a caller fixes: every constant and launch option by value."""
    return tuple(sorted(constants.items())), _options_key(options)


def _options_key(options: dict) -> tuple:
    return tuple(sorted(options.items()))


def _current_device() -> int:
    """The current CUDA device (-1 without one): a compiled kernel is loaded on the device
    current at its first launch, and `triton.jit` keeps one per device, so this key does too."""
    return torch.cuda.current_device() if torch.cuda.is_available() else -1


def _tensors(args: tuple) -> tuple:
    """The tensor arguments' keys in `_signature` (a plan fixes the rest)."""
    return tuple([k for k in _signature(args) if len(k) == 3])


def _signature(args: tuple) -> tuple:
    """Each argument as Triton could specialize on it, or finer: a tensor by dtype, device
    index and whether its data pointer is 16-byte aligned, a tensor descriptor by its base's
    and its block shape and layout, a scalar (bool, int, float) by type and value, None as
    None. One loop without a call an argument (the forward has about 45)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.device.index, a.data_ptr() % 16 == 0))
        elif a is None or isinstance(a, (bool, int, float)):
            out.append((type(a), a))
        elif hasattr(a, "block_shape") and isinstance(getattr(a, "base", None), torch.Tensor):
            # a TMA tensor descriptor (Gluon's `TensorDescriptor`, `fp4lab.kernels.gluon_fwd`):
            # Triton specializes on its dtype, block shape and shared layout; its shape and
            # strides go into the tensor map the launcher builds at every call
            b = a.base
            out.append(("desc", b.dtype, b.device.index, b.data_ptr() % 16 == 0,
                        tuple(a.block_shape), a.layout))
        else:
            raise TypeError(f"launch: argument of type {type(a).__name__} is neither a tensor, "
                            "a tensor descriptor, a scalar nor None")
    return tuple(out)
