"""`fp4lab.kernels.launch`: which launches go through `triton.jit` and which call the
compiled kernel directly, on a stand-in kernel (no GPU: the key and the arguments are what
is checked here). Every interpreted attention test builds the key of each forward and
backward launch too, and the GPU tests run every kernel through it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from fp4lab.kernels import launch  # noqa: E402


class _Kernel:
    """A stand-in JITFunction: parameters (x, n, scale, BLOCK, FLAG=False); `kernel[grid]`
    records a jit launch and returns a stand-in compiled kernel recording direct ones."""

    def __init__(self):
        self.params = [SimpleNamespace(name=n, default=d) for n, d in (
            ("x", None), ("n", None), ("scale", None), ("BLOCK", None), ("FLAG", False))]
        self.jit, self.direct = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.jit.append((grid, args, kwargs))
            return _Compiled(self)

        return run


class _Compiled:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args: self.kernel.direct.append((grid, args))


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(launch, "_COMPILED", {})
    monkeypatch.delenv("FP4LAB_DIRECT_LAUNCH", raising=False)


def test_a_signature_seen_before_calls_the_compiled_kernel_with_every_parameter():
    kernel, x = _Kernel(), torch.zeros(8)
    for grid in ((1,), (2,), (3,)):
        launch.launch(kernel, grid, (x, 5, 0.5), dict(BLOCK=16), dict(num_warps=4))
    assert len(kernel.jit) == 1
    assert kernel.jit[0][2] == dict(BLOCK=16, num_warps=4)
    # the constexprs in parameter order, the one left out at its default
    # three grid dims, as the compiled kernel's launcher takes them
    assert kernel.direct == [((2, 1, 1), (x, 5, 0.5, 16, False)),
                             ((3, 1, 1), (x, 5, 0.5, 16, False))]


@pytest.mark.parametrize("change", ["int", "bool_for_int", "float", "none", "dtype", "align",
                                    "constant", "option"])
def test_anything_triton_could_specialize_on_launches_through_jit_again(change):
    kernel, x = _Kernel(), torch.zeros(64)
    args, constants, options = (x, 16, 0.5), dict(BLOCK=16), dict(num_warps=4)
    launch.launch(kernel, (1,), args, constants, options)
    other = {
        "int": ((x, 17, 0.5), constants, options),
        "bool_for_int": ((x, True, 0.5), constants, options),  # 1 and True: not the same key
        "float": ((x, 16, 0.25), constants, options),
        "none": ((x, 16, None), constants, options),
        "dtype": ((x.double(), 16, 0.5), constants, options),
        "align": ((x[1:], 16, 0.5), constants, options),  # data pointer 4 bytes past 16
        "constant": (args, dict(BLOCK=32), options),
        "option": (args, constants, dict(num_warps=8)),
    }[change]
    launch.launch(kernel, (1,), *other)
    assert len(kernel.jit) == 2 and kernel.direct == []


def test_fixed_constants_are_keyed_by_identity_not_by_value():
    kernel, x = _Kernel(), torch.zeros(8)
    plan, same_values = dict(BLOCK=16), dict(BLOCK=16)
    launch.launch(kernel, (1,), (x, 5, 0.5), plan, {}, fixed=True)
    launch.launch(kernel, (1,), (x, 5, 0.5), plan, {}, fixed=True)
    launch.launch(kernel, (1,), (x, 5, 0.5), same_values, {}, fixed=True)  # another plan
    assert len(kernel.jit) == 2 and len(kernel.direct) == 1


def test_direct_launch_off_sends_every_launch_through_jit(monkeypatch):
    monkeypatch.setenv("FP4LAB_DIRECT_LAUNCH", "0")
    kernel, x = _Kernel(), torch.zeros(8)
    for _ in range(3):
        launch.launch(kernel, (1,), (x, 5, 0.5), dict(BLOCK=16), {})
    assert len(kernel.jit) == 3 and kernel.direct == [] and launch._COMPILED == {}


def test_an_argument_triton_would_not_take_is_a_type_error():
    with pytest.raises(TypeError, match="argument of type str"):
        launch.launch(_Kernel(), (1,), (torch.zeros(8), "five", 0.5), dict(BLOCK=16), {})


def test_another_current_device_launches_through_jit(monkeypatch):
    """A compiled kernel is loaded on the device current at its first launch: with another
    device current, the launch goes through `triton.jit` (which keeps one per device)."""
    kernel, x = _Kernel(), torch.zeros(8)
    for device in (0, 0, 1, 1, 0):
        monkeypatch.setattr(launch, "_current_device", lambda device=device: device)
        launch.launch(kernel, (1,), (x, 5, 0.5), dict(BLOCK=16), {})
    assert len(kernel.jit) == 2 and len(kernel.direct) == 3


def _desc(base, block=(128, 128), layout="swizzle128"):
    """A stand-in for Gluon's TensorDescriptor: what the key reads of one."""
    return SimpleNamespace(base=base, shape=list(base.shape), strides=list(base.stride()),
                           block_shape=list(block), layout=layout)


@pytest.mark.parametrize("change", ["dtype", "block", "layout", "align"])
def test_a_tensor_descriptor_is_keyed_by_what_triton_specializes_on(change):
    """The compiled kernel takes a descriptor of any shape and strides (its tensor map is
    built at each launch) but not another dtype, block shape, shared layout or an unaligned
    base."""
    kernel, x = _Kernel(), torch.zeros(256, 128)
    launch.launch(kernel, (1,), (_desc(x), 5, 0.5), dict(BLOCK=16), {})
    launch.launch(kernel, (1,), (_desc(torch.zeros(512, 128)), 5, 0.5), dict(BLOCK=16), {})
    assert len(kernel.jit) == 1 and len(kernel.direct) == 1  # another shape: the same kernel
    other = {"dtype": _desc(x.double()), "block": _desc(x, (64, 128)),
             "layout": _desc(x, layout="swizzle64"), "align": _desc(x.view(-1)[1:129])}[change]
    launch.launch(kernel, (1,), (other, 5, 0.5), dict(BLOCK=16), {})
    assert len(kernel.jit) == 2
