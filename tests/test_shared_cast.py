"""Layers that read the same input under current tensorwise scaling share its cast (nn/quantizer._shared_cast): a
transformer's q/k/v projections, its gate and up projections. The cast is made once, each layer's result is the
same bits as with a cast of its own, each layer counts a non-finite amax, and anything that could change the
bytes (another tensor, an in-place write, another format or margin, delayed scaling) casts again.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8train.nn.linear import Fp8Linear
from fp8train.nn.recipes import recipe
from fp8train.numerics import native_cast

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(not native_cast.available(), reason="the shared cast is the native kernel's")]


@pytest.fixture
def casts(monkeypatch):
    """The native quantize calls, as (shape, format) of each."""
    calls = []
    real = native_cast.quantize_fp8
    monkeypatch.setattr(native_cast, "quantize_fp8",
                        lambda *args: calls.append((tuple(args[0].shape), args[2])) or real(*args))
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
