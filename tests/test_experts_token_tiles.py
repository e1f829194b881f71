"""Every expert's token group quantized in one call under the rowwise, block and MX recipes: the grouped native
cast of each group's transpose (numerics/native_groups.py) against each group's own quantize call (the eager
torch chain, and the native kernel for the memory layouts), and the grouped GEMM's one-call paths
(nn/experts_token_tiles.py) and one-call weights (nn/experts_weight_tiles.py) against each expert's own
quantizers, bit for bit, with groups of zero tokens, groups that are no multiple of 16 or 128, one expert, and
non-finite tokens and weights (counted per expert)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8train.nn.experts import Fp8GroupedLinear
from fp8train.numerics import native_cast
from fp8train.numerics.formats import get_format
from fp8train.numerics.mx import quantize_mx
from fp8train.numerics.native_groups import quantize_group_transposes
from fp8train.numerics.quant import quantize

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(not native_cast.available(), reason="the one-call paths run on the native kernel")]

E4M3 = get_format("e4m3fn")
# (granularity, block, mx) of each recipe's token operands, and a tile of several columns
TILINGS = [("row", (1, 128), False), ("block", (1, 128), False), ("block", (1, 32), True), ("block", (4, 64), False)]
KEEPS = [{}, {"keep_fp32": True}, {"keep_bf16": True}, {"keep_dequantized": True}]


def _same(got, want, layout: bool):
    """Bytes, scales and amaxes equal (NaN where the other has NaN); with `layout` the strides too."""
    assert got.data.shape == want.data.shape and got.block == want.block and got.granularity == want.granularity
    assert got.axis % got.data.dim() == want.axis % want.data.dim()
    assert torch.equal(got.data.view(torch.uint8), want.data.contiguous().view(torch.uint8))
    for a, b in ((got.scale, want.scale), (got.amax, want.amax)):
        assert a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(-1.0), b.nan_to_num(-1.0))
    if layout:
        assert got.data.stride() == want.data.stride() and got.scale.stride() == want.scale.stride()
        assert got.amax.stride() == want.amax.stride()


@pytest.mark.parametrize("tiling", TILINGS, ids=lambda t: f"{t[0]}{t[1]}{'mx' if t[2] else ''}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cols", [256, 100, 1])
def test_each_groups_transpose_is_its_own_call(tiling, dtype, cols):
    granularity, block, mx = tiling
    sizes = [0, 1, 300, 0, 17, 128, 256, 31, 33, 129]  # empty, one row, no multiple of 16 / 32 / 128
    torch.manual_seed(cols)
    x = (torch.randn(sum(sizes) + 3, cols) * torch.logspace(-3, 3, sum(sizes) + 3).view(-1, 1)).to(dtype)
    x[2, 0] = float("nan")  # group 2's first column: its amax and scale as the group's own call gives them
    x[40, -1] = float("inf")
    for keep in KEEPS:
        got = quantize_group_transposes(x, sizes, E4M3, granularity, block, pow2=not mx, mx=mx, **keep)
        assert len(got) == len(sizes)
        kept = torch.bfloat16 if keep.get("keep_bf16") else keep.get("keep_fp32", False)
        start = 0
        for size, group in zip(sizes, got):
            rows, start = x[start:start + size], start + size
            if size == 0:
                assert group is None
                continue
            for kernel in ("eager", "native"):
                options = dict(kernel=kernel, keep_values=kept, keep_dequantized=keep.get("keep_dequantized", False))
                want = quantize_mx(rows.t(), E4M3, **options) if mx else \
                    quantize(rows.t(), E4M3, granularity=granularity, block=block, pow2=True, **options)
                _same(group, want, layout=kernel == "native")
                for name in ("values", "values_bf16", "dequantized"):
                    a, b = getattr(group, name), getattr(want, name)
                    assert (a is None) == (b is None), name
                    if a is not None:
                        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0), b.nan_to_num(0))


@pytest.mark.parametrize("tiling", TILINGS[:3], ids=["row", "block", "mx"])
def test_threads_split_the_groups_rows_and_give_the_same_bits(tiling):
    """Over 2**19 elements the kernel runs two threads, each taking the tile rows that start in its half."""
    granularity, block, mx = tiling
    sizes = [1500, 3, 0, 700, 130]
    x = torch.randn(sum(sizes), 256).bfloat16()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = quantize_group_transposes(x, sizes, E4M3, granularity, block, mx=mx)
    finally:
        torch.set_num_threads(previous)
    start = 0
    for size, group in zip(sizes, got):
        rows, start = x[start:start + size], start + size
        if size:
            want = quantize_mx(rows.t(), E4M3, kernel="eager") if mx else \
                quantize(rows.t(), E4M3, granularity=granularity, block=block, kernel="eager")
            _same(group, want, layout=False)


def test_one_group_and_what_the_grouped_call_refuses():
    x = torch.randn(40, 64)
    (only,) = quantize_group_transposes(x, [40], E4M3, "row", (1, 128))
    _same(only, quantize(x.t(), E4M3, granularity="row", kernel="eager"), layout=False)
    assert quantize_group_transposes(x.t(), [64], E4M3, "row", (1, 128)) is None  # not contiguous
    assert quantize_group_transposes(x, [20, 30], E4M3, "row", (1, 128)) is None  # more rows than x
    assert quantize_group_transposes(x, [0, 0], E4M3, "row", (1, 128)) is None  # nothing routed
    assert quantize_group_transposes(x, [40], E4M3, "tensor", (1, 128)) is None
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # row scales: one group is one thread's work here, two threads split it in its own call
        assert quantize_group_transposes(x, [40, 0], E4M3, "row", (1, 128)) is None
        assert quantize_group_transposes(x, [20, 20], E4M3, "row", (1, 128)) is not None
        assert quantize_group_transposes(x, [40], E4M3, "block", (1, 32), mx=True) is not None
    finally:
        torch.set_num_threads(previous)


def _offs(sizes):
    return torch.tensor(np.cumsum(sizes), dtype=torch.int32)


@pytest.mark.parametrize("name", ["rowwise", "block", "mxfp8"])
@pytest.mark.parametrize("sizes", [[5, 0, 131, 33], [70]], ids=["four_experts", "one_expert"])
@pytest.mark.parametrize("emulated", ["bf16", "fp32"])
def test_one_call_token_groups_and_weights_keep_each_experts_bits(name, sizes, emulated, monkeypatch):
    """Layer 0 (contiguous tokens and weight) takes the one-call paths, layer 1 (the same values, not
    contiguous) each expert's own quantizers: outputs, both gradients and the scaling buffers are equal, over two
    steps, the second with an inf in the last expert's tokens, a NaN in the first one's gradient and a NaN in the
    last one's weight (each counted for its expert only)."""
    import fp8train.nn.experts_function as experts_function
    import fp8train.nn.experts_weights as experts_weights

    k, n = 192, 160  # N: one whole and one partial 128-row weight tile
    calls = {"forward": [], "transposed": [], "weights": []}
    real = experts_function.tiled_token_fp8, experts_function.tiled_token_fp8_transposed
    monkeypatch.setattr(experts_function, "tiled_token_fp8",
                        lambda *a: calls["forward"].append(real[0](*a)) or calls["forward"][-1])
    monkeypatch.setattr(experts_function, "tiled_token_fp8_transposed",
                        lambda *a: calls["transposed"].append(real[1](*a)) or calls["transposed"][-1])
    real_weights = experts_weights.tiled_experts_fp8
    monkeypatch.setattr(experts_weights, "tiled_experts_fp8",
                        lambda *a: calls["weights"].append(real_weights(*a)) or calls["weights"][-1])
    layers = []
    for _ in range(2):
        torch.manual_seed(0)
        layers.append(Fp8GroupedLinear(len(sizes), k, n, recipe=name))
        layers[-1].scaling.configure(emulated_dtype=emulated)
    with torch.no_grad():
        layers[0].weight.mul_(torch.linspace(0.5, 4.0, len(sizes)).view(-1, 1, 1))
        layers[1].weight.data = layers[0].weight.detach().transpose(1, 2).contiguous().transpose(1, 2)
    for step in range(2):
        x = torch.randn(sum(sizes) + 3, k) * torch.linspace(0.01, 50.0, sum(sizes) + 3).view(-1, 1)
        grad = torch.randn(sum(sizes) + 3, n) * 1e-3
        if step == 1:
            x[sum(sizes) - 1, 3] = float("inf")
            grad[0, 5] = float("nan")
        results = []
        for index, layer in enumerate(layers):
            if step == 1:
                with torch.no_grad():
                    layer.weight[-1, 2, 7] = float("nan")
            x_ = (x if index == 0 else x.t().contiguous().t()).clone().requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x_, _offs(sizes))
            y.backward(grad.bfloat16() if index == 0 else grad.bfloat16().t().contiguous().t())
            results.append((y, x_.grad, layer.weight.grad.clone()))
            layer.weight.grad = None
        for a, b in zip(*results):
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), step
        for key, value in layers[0].scaling.state_dict().items():
            assert torch.equal(value, layers[1].scaling.state_dict()[key]), (step, key)
    # (forward, backward) of layer 0 in one call each, of layer 1 per expert, every step
    assert [c is not None for c in calls["forward"]] == [True, True, False, False] * 2
    assert [c is not None for c in calls["transposed"]] == [True, True, False, False] * 2
    assert len(calls["weights"]) == 2 and all(c is not None for c in calls["weights"])  # layer 0's, each step
    counts = layers[0].scaling
    last = [0] * (len(sizes) - 1) + [1]
    first = [1] + [0] * (len(sizes) - 1)
    assert counts.input_nonfinite_amax_count.tolist() == last
    assert counts.grad_output_nonfinite_amax_count.tolist() == first
    assert counts.weight_nonfinite_amax_count.tolist() == last
