"""Native ops called without the dispatcher (numerics/native_call.py): only where the dispatcher would do nothing
but call the op's CPU implementation. Whatever watches or rewrites ops (a dispatch mode, a profiler, FakeTensor,
functorch) still sees every fp8train op, and both ways of calling give the same bits."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.numerics import native_cast
from fp8train.numerics.native_call import plain_call

pytestmark = pytest.mark.skipif(not native_cast.available(), reason="the native ops need fp8train's C kernel")


class OpNames(TorchDispatchMode):
    """Records the name of every op dispatched while active."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_a_plain_eager_tensor_is_called_directly_and_nothing_else_is():
    x = torch.randn(8, 8)
    assert plain_call(x) and plain_call(torch.nn.Parameter(x))
    with OpNames():
        assert not plain_call(x)
    with profile(activities=[ProfilerActivity.CPU]):
        assert not plain_call(x)
    from torch._subclasses.fake_tensor import FakeTensorMode  # (torch's FakeTensor has no public name)

    with FakeTensorMode() as mode:
        fake = mode.from_tensor(x)
    assert not plain_call(fake)
    seen = []
    torch.vmap(lambda row: seen.append(plain_call(row)) or row)(x)
    assert seen == [False]


def _step(layer, x):
    x = x.detach().clone().requires_grad_(True)
    layer.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("name", ["current", "delayed", "rowwise", "block"])
def test_a_dispatch_mode_sees_every_native_op_and_the_bits_do_not_change(name):
    """The same layer step with the ops called directly and through the dispatcher (a mode forces that), the
    mode seeing the casts and GEMM epilogues that the direct calls skipped the dispatcher for."""
    torch.manual_seed(0)
    direct, watched = Fp8Linear(64, 48, recipe=name), Fp8Linear(64, 48, recipe=name)
    watched.load_state_dict(direct.state_dict())
    x = torch.randn(32, 64)
    for _ in range(2):  # (delayed: the second step casts with the stored scale)
        expected = _step(direct, x)
        with OpNames() as mode:
            got = _step(watched, x)
        for a, b in zip(expected, got):
            assert torch.equal(a, b)
        assert mode.names.count("fp8train.quantize_fp8") >= 3, mode.names  # input, weight, grad_output
        for layer in (direct, watched):
            update_fp8_scales(layer)  # (a no-op but for delayed scaling)
            layer.forget_weight_fp8()


def test_a_profile_names_the_casts():
    layer = Fp8Linear(64, 48, recipe="current")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(layer, torch.randn(32, 64))
    assert sum(event.name == "fp8train::quantize_fp8" for event in prof.events()) >= 3
