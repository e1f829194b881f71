"""Layers that read the same input under tensorwise scaling share its cast (nn/quantizer._shared_cast): a
transformer's q/k/v projections, its gate and up projections. The cast is made once, each layer's result is the
same bits as with a cast of its own, each layer counts a non-finite amax (and under delayed scaling records the
amax in its own state), and anything that could change the bytes (another tensor, an in-place write, another
format or margin, another recipe, under delayed scaling another stored scale) casts again.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.nn.recipes import recipe
from fp8train.numerics import native_cast

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(not native_cast.available(), reason="the shared cast is the native kernel's")]


@pytest.fixture
def casts(monkeypatch):
    """The native quantize calls, as (shape, format) of each."""
    calls = []
    # the op (format: its 3rd argument), and its CPU implementation called directly (format: its 4th)
    for name, fmt_at in (("quantize_fp8", 2), ("quantize_laid_out", 3)):
        real = getattr(native_cast, name)
        monkeypatch.setattr(native_cast, name, lambda *args, _real=real, _at=fmt_at:
                            calls.append((tuple(args[0].shape), args[_at])) or _real(*args))
    return calls


def _layers(n, name="current", seed=0, **options):
    torch.manual_seed(seed)
    return [Fp8Linear(64, 48, recipe=recipe(name, **options)) for _ in range(n)]


def _alone(layer, x):
    """The layer's output and gradients with a cast of its own (a copy of the input: nothing to share)."""
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    return y.detach(), x.grad, layer.weight.grad


def test_siblings_cast_their_input_once_with_the_same_bits(casts):
    q, k, v = _layers(3)
    x = torch.randn(4, 32, 64)
    reference = [_alone(layer, x) for layer in (q, k, v)]
    for layer in (q, k, v):
        layer.weight.grad = None
    casts.clear()
    x = x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = [layer(x) for layer in (q, k, v)]
    inputs = [c for c in casts if c == ((128, 64), "e4m3fn")]
    assert len(inputs) == 1  # one cast of x for the three layers (the weights are cast each on their own)
    for layer, y, (y_ref, gx_ref, gw_ref) in zip((q, k, v), outputs, reference):
        grad_x, grad_w = torch.autograd.grad(y.float().sum(), (x, layer.weight))
        assert torch.equal(y, y_ref) and torch.equal(grad_x, gx_ref) and torch.equal(grad_w, gw_ref)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_each_sibling_counts_a_nonfinite_input(bad):
    layers = _layers(3)
    x = torch.randn(16, 64)
    x[3, 5] = bad
    for layer in layers:
        layer(x)
    assert [layer.input_nonfinite_amax_count.item() for layer in layers] == [1, 1, 1]
    assert [layer.weight_nonfinite_amax_count.item() for layer in layers] == [0, 0, 0]


def test_what_changes_the_bytes_casts_again(casts):
    a, b = _layers(2)
    x = torch.randn(16, 64)
    a(x)
    casts.clear()
    x.mul_(3)  # an in-place write: a new version of the same tensor
    y = b(x)
    assert ((16, 64), "e4m3fn") in casts
    assert torch.equal(y, b(x.clone()))
    casts.clear()
    b(x.clone())  # another tensor with the same values
    assert ((16, 64), "e4m3fn") in casts
    casts.clear()
    b(x[:8])  # a view of another part
    assert ((8, 64), "e4m3fn") in casts


@pytest.mark.parametrize("other", [dict(name="current", margin=1), dict(name="current", input_format="e5m2"),
                                   dict(name="delayed")])
def test_layers_with_other_rules_do_not_share(other, casts):
    first = _layers(1)[0]
    name = other.pop("name")
    second = _layers(1, name, seed=1, **other)[0]
    x = torch.randn(16, 64)
    first(x)
    casts.clear()
    y = second(x)
    assert any(shape == (16, 64) for shape, _ in casts)
    assert torch.equal(y, second(x.clone()))


def test_a_layer_run_again_on_the_same_tensor_casts_again(casts):
    """Only another layer's cast is shared: one layer timed on one input (the bench's linear section) still pays
    its cast on every call."""
    layer = _layers(1)[0]
    x = torch.randn(16, 64)
    layer(x)
    casts.clear()
    layer(x)
    assert ((16, 64), "e4m3fn") in casts


def _trained_delayed(n, steps=2):
    """n delayed layers that have read the same inputs since they were built: their stored input scales agree."""
    layers = _layers(n, "delayed")
    for _ in range(steps):
        x = torch.randn(16, 64)
        for layer in layers:
            layer(x).float().sum().backward()
        update_fp8_scales(torch.nn.ModuleList(layers))
    for layer in layers:
        layer.weight.grad = None
    return layers


def _forget_pending(layers):
    for layer in layers:
        layer.input_pending_amax.fill_(-1.0)
        layer.weight.grad = None


def test_delayed_siblings_with_the_same_stored_scale_share_the_cast(casts):
    q, k, v = _trained_delayed(3)
    assert all(layer.quantizers["input"].initialized_on_host for layer in (q, k, v))
    assert q.input_scale.item() == k.input_scale.item() == v.input_scale.item() != 1.0
    x = torch.randn(4, 32, 64) * 3
    reference = [_alone(layer, x) for layer in (q, k, v)]
    _forget_pending((q, k, v))
    casts.clear()
    x = x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = [layer(x) for layer in (q, k, v)]
    assert len([c for c in casts if c == ((128, 64), "e4m3fn")]) == 1
    for layer, y, (y_ref, gx_ref, gw_ref) in zip((q, k, v), outputs, reference):
        grad_x, grad_w = torch.autograd.grad(y.float().sum(), (x, layer.weight))
        assert torch.equal(y, y_ref) and torch.equal(grad_x, gx_ref) and torch.equal(grad_w, gw_ref)
    # each layer recorded this step's amax of its input, as its own cast would have (max |x| in fp32)
    amax = float(x.detach().abs().max())
    assert [layer.input_pending_amax.item() for layer in (q, k, v)] == [amax] * 3
    # and the next update leaves the three with the same state as without sharing: the same scales again
    update_fp8_scales(torch.nn.ModuleList([q, k, v]))
    assert q.input_scale.item() == k.input_scale.item() == v.input_scale.item()


def test_delayed_siblings_with_other_stored_scales_cast_each(casts):
    q, k = _trained_delayed(2)
    k.input_scale.mul_(2.0)  # e.g. loaded from another checkpoint: k's cast is not q's
    x = torch.randn(16, 64)
    expected = _alone(k, x)[0]
    _forget_pending((q, k))
    casts.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q(x)
        y = k(x)
    assert len([c for c in casts if c == ((16, 64), "e4m3fn")]) == 2
    assert torch.equal(y.detach(), expected)
    assert q.input_pending_amax.item() == k.input_pending_amax.item() == float(x.abs().max())


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_each_delayed_sibling_counts_a_nonfinite_input(bad, casts):
    layers = _trained_delayed(3)
    _forget_pending(layers)
    x = torch.randn(16, 64)
    x[3, 5] = bad
    casts.clear()
    for layer in layers:
        layer(x)
    assert len([c for c in casts if c == ((16, 64), "e4m3fn")]) == 1
    assert [layer.input_nonfinite_amax_count.item() for layer in layers] == [1, 1, 1]
    assert [layer.input_pending_amax.item() for layer in layers] == [-1.0] * 3  # a NaN/inf amax is not recorded
