"""FP8 experts (nn/experts.py): every recipe's grouped GEMM against an independent reference written from the
documented per-expert rule (ml_dtypes casts and the OCP MX rule in numpy, GEMMs in float64), bit for bit against
each expert's tokens through the dense Fp8Linear, and the per-expert delayed-scaling state step by step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8train.nn.experts import ExpertScaling, Fp8GroupedLinear, fp8_grouped_mm
from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.nn.recipes import RECIPE_NAMES, recipe
from fp8train.numerics import native_cast
from test_mx import reference_mx
from test_quant import ml_decode, ref_expand, ref_quantize

pytestmark = pytest.mark.usefixtures("single_thread")

K, N = 256, 160              # N: one whole and one partial 128-row weight tile
SIZES = [5, 0, 131, 33]      # a zero-token expert, groups that are no multiple of 16 or 128
FORMATS = {"delayed": ("e4m3fn", "e4m3fn", "e5m2"), "current": ("e4m3fn", "e4m3fn", "e5m2")}
FORMATS.update({name: ("e4m3fn",) * 3 for name in ("rowwise", "block", "mxfp8")})


def _offs(sizes):
    return torch.tensor(np.cumsum(sizes), dtype=torch.int32)


def _layer(name, sizes, emulated="fp32", bias=True, seed=0):
    torch.manual_seed(seed)
    layer = Fp8GroupedLinear(len(sizes), K, N, bias=bias, recipe=name)
    with torch.no_grad():
        layer.weight.mul_(torch.linspace(0.5, 4.0, len(sizes)).view(-1, 1, 1))  # each expert its own range
        if bias:
            layer.bias.normal_()
    layer.scaling.configure(emulated_dtype=emulated)
    x = torch.randn(sum(sizes), K) * torch.linspace(0.1, 8.0, sum(sizes)).view(-1, 1)  # rows of every range
    grad = torch.randn(sum(sizes), N) * 1e-3
    return layer, x.requires_grad_(True), grad


# ---- the documented rule, written independently: (quantized values in float64) of one operand ---------------
def _ref_operand(t: np.ndarray, name: str, role: int, along_rows: bool = False) -> np.ndarray:
    """Dequantized FP8 copy of a 2-D float32 operand by the recipe's rule for role (0 input, 1 weight,
    2 grad_output); `along_rows`: the scales run down the columns instead (the operand requantized for a GEMM
    that contracts its first dim), computed as the rule on t.T and transposed back."""
    if along_rows:
        return _ref_operand(np.ascontiguousarray(t.T), name, role).T
    fmt = FORMATS[name][role]
    if name == "mxfp8":
        return reference_mx(t, fmt)[2]
    granularity = {"delayed": "tensor", "current": "tensor", "rowwise": "row", "block": "block"}[name]
    block = (128, 128) if role == 1 else (1, 128)
    pow2 = name in ("rowwise", "block")
    codes, scale = ref_quantize(t, fmt, granularity=granularity, block=block, pow2=pow2)
    return ml_decode(codes, fmt).astype(np.float64) * ref_expand(scale, t.shape, granularity, block)


def _ref_expert(name, x, w, b, g):
    """output, grad_input, grad_weight of one expert in float64 from its operands' reference FP8 copies."""
    transposed = name in ("rowwise", "mxfp8")  # per-row / 1x32 scales: requantized for the backward GEMMs
    tiles_t = name in ("rowwise", "block", "mxfp8")  # 1xN tiles of input and grad_output likewise
    x_q, w_q, g_q = (_ref_operand(t, name, r) for r, t in enumerate((x, w, g)))
    w_for_grad_input = _ref_operand(w, name, 1, along_rows=True) if transposed else w_q
    x_for_grad_weight = _ref_operand(x, name, 0, along_rows=True) if tiles_t else x_q
    g_for_grad_weight = _ref_operand(g, name, 2, along_rows=True) if tiles_t else g_q
    out = x_q @ w_q.T + b
    grad_input = g_q @ w_for_grad_input
    grad_weight = g_for_grad_weight.T @ x_for_grad_weight
    # fp32 accumulation of exact FP8 products: each result within (terms + 2) ulps of the sum of |products|
    bounds = (np.abs(x_q) @ np.abs(w_q.T) * (K + 2) + np.abs(b),
              np.abs(g_q) @ np.abs(w_for_grad_input) * (N + 2),
              np.abs(g_for_grad_weight.T) @ np.abs(x_for_grad_weight) * (x.shape[0] + 2))
    return (out, grad_input, grad_weight), tuple(bound * 2.0 ** -24 + 1e-30 for bound in bounds)


def _assert_within(actual: torch.Tensor, expected: np.ndarray, bound: np.ndarray, what: str):
    err = np.abs(actual.detach().double().numpy() - expected)
    assert (err <= bound).all(), f"{what}: max error {err.max():.3g} past the fp32 accumulation bound"


@pytest.mark.parametrize("emulated", ["fp32", "bf16"])
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_grouped_gemms_match_the_per_expert_reference(name, emulated):
    layer, x, grad = _layer(name, SIZES, emulated)
    y = layer(x, _offs(SIZES))
    y.backward(grad)
    assert y.dtype == torch.float32 and y.shape == (sum(SIZES), N)
    x_np, g_np = x.detach().numpy(), grad.numpy()
    start = 0
    for e, size in enumerate(SIZES):
        rows = slice(start, start + size)
        start += size
        if size == 0:
            assert torch.equal(layer.weight.grad[e], torch.zeros(N, K))  # no tokens, no gradient
            assert torch.equal(layer.bias.grad[e], torch.zeros(N))
            continue
        w, b = layer.weight[e].detach().numpy(), layer.bias[e].detach().double().numpy()
        expected, bounds = _ref_expert(name, x_np[rows], w, b, g_np[rows])
        _assert_within(y[rows], expected[0], bounds[0], f"expert {e} output")
        _assert_within(x.grad[rows], expected[1], bounds[1], f"expert {e} grad_input")
        _assert_within(layer.weight.grad[e], expected[2], bounds[2], f"expert {e} grad_weight")
        g_rows = g_np[rows].astype(np.float64)  # grad_bias: an fp32 sum of the unquantized gradient
        _assert_within(layer.bias.grad[e], g_rows.sum(0), np.abs(g_rows).sum(0) * (size + 2) * 2.0 ** -24,
                       f"expert {e} grad_bias")


def _ref_codes(t: np.ndarray, name: str, role: int) -> np.ndarray:
    """The reference's FP8 codes (uint8) of a 2-D float32 operand by the recipe's rule for `role`."""
    fmt = FORMATS[name][role]
    if name == "mxfp8":
        return reference_mx(t, fmt)[0]
    granularity = {"delayed": "tensor", "current": "tensor", "rowwise": "row", "block": "block"}[name]
    return ref_quantize(t, fmt, granularity=granularity, block=(128, 128) if role == 1 else (1, 128),
                        pow2=name in ("rowwise", "block"))[0]


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_saved_fp8_bytes_are_the_references_codes(name):
    """The FP8 bytes saved for backward (each expert's input, in the layout grad_weight reads, and its weight) are
    the reference's codes exactly: one scale set per expert, never one across the group."""
    sizes = [7, 0, 40]
    layer, x, _ = _layer(name, sizes, bias=False)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x, _offs(sizes))
    fp8 = [t.view(torch.uint8).numpy() for t in saved if t.dtype == torch.float8_e4m3fn]
    assert len(fp8) == 4  # input and weight of each of the two experts with tokens
    transposed = name in ("rowwise", "block", "mxfp8")  # saved as grad_weight reads it: scales along tokens
    for (e, rows), (input_codes, weight_codes) in zip([(0, slice(0, 7)), (2, slice(7, 47))],
                                                      [fp8[:2], fp8[2:]]):
        x_e = x.detach().numpy()[rows]
        expected_input = _ref_codes(np.ascontiguousarray(x_e.T), name, 0) if transposed else _ref_codes(x_e, name, 0)
        np.testing.assert_array_equal(input_codes, expected_input)
        np.testing.assert_array_equal(weight_codes, _ref_codes(layer.weight[e].detach().numpy(), name, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_each_expert_equals_the_dense_layer_bit_for_bit(name, dtype):
    layer, x, grad = _layer(name, SIZES, "bf16")
    x = x.detach().to(dtype).requires_grad_(True)
    y = layer(x, _offs(SIZES))
    y.backward(grad.to(dtype))
    start = 0
    for e, size in enumerate(SIZES):
        if size == 0:
            continue
        dense = Fp8Linear(K, N, recipe=name)
        dense.emulated_dtype = "bf16"
        with torch.no_grad():
            dense.weight.copy_(layer.weight[e])
            dense.bias.copy_(layer.bias[e])
        x_e = x.detach()[start:start + size].clone().requires_grad_(True)
        y_e = dense(x_e)
        y_e.backward(grad.to(dtype)[start:start + size])
        assert torch.equal(y_e, y[start:start + size])
        assert torch.equal(x_e.grad, x.grad[start:start + size])
        assert torch.equal(dense.weight.grad, layer.weight.grad[e])
        assert torch.equal(dense.bias.grad, layer.bias.grad[e])
        start += size


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_one_expert_and_rows_routed_nowhere(name):
    layer, x, grad = _layer(name, [37])
    y = layer(x, _offs([37]))
    dense = Fp8Linear(K, N, recipe=name)
    dense.emulated_dtype = "fp32"
    with torch.no_grad():
        dense.weight.copy_(layer.weight[0])
        dense.bias.copy_(layer.bias[0])
    assert torch.equal(y, dense(x.detach()))
    # rows past offs[-1] belong to no expert: zero output, zero gradient
    layer2, x2, _ = _layer(name, [10, 20])
    y2 = layer2(x2, torch.tensor([10, 25], dtype=torch.int32))
    assert torch.equal(y2[25:], torch.zeros(5, N))
    y2.sum().backward()
    assert torch.equal(x2.grad[25:], torch.zeros(5, K))


def test_no_tokens_at_all():
    layer = Fp8GroupedLinear(3, K, N, recipe="current")
    x = torch.zeros(0, K, requires_grad=True)
    y = layer(x, torch.zeros(3, dtype=torch.int32))
    assert y.shape == (0, N)


# ---- delayed scaling, per expert ---------------------------------------------------------------------------
def test_delayed_history_per_expert_and_the_zero_token_rule():
    torch.manual_seed(0)
    layer = Fp8GroupedLinear(3, K, N, recipe=recipe("delayed", amax_history_len=4))
    s = layer.scaling
    x1 = torch.randn(9, K)
    x1[4:] *= 10                      # expert 2's tokens ten times larger
    y = layer(x1, _offs([4, 0, 5]))   # expert 1 gets no tokens
    y.sum().backward()
    update_fp8_scales(layer)
    amax_in = [float(x1[:4].abs().max()), None, float(x1[4:].abs().max())]
    assert s.input_amax_history[0].tolist() == [amax_in[0], 0, 0, 0]
    assert s.input_amax_history[2].tolist() == [amax_in[2], 0, 0, 0]
    assert s.input_amax_history[1].tolist() == [0, 0, 0, 0]           # recorded nothing
    assert s.input_initialized.tolist() == [True, False, True]
    assert s.grad_output_initialized.tolist() == [True, False, True]
    assert s.grad_output_amax_history[1].tolist() == [0, 0, 0, 0]
    assert s.weight_initialized.tolist() == [True, True, True]         # every weight is quantized
    for e in range(3):
        assert float(s.weight_amax_history[e, 0]) == float(layer.weight[e].detach().abs().max())
    assert s.input_pending_amax.tolist() == [-1, -1, -1]
    # the scale is the documented rule on each expert's own history: amax / 448 in float64, rounded to fp32
    for e in (0, 2):
        assert float(s.input_scale[e]) == float(np.float32(np.float64(np.float32(amax_in[e])) / 448.0))
    # step 2: expert 1 gets tokens now and is still on current scaling; expert 0 uses its stored scale
    x2 = torch.randn(6, K) * 3
    layer(x2, _offs([3, 3, 0])).sum().backward()
    update_fp8_scales(layer)
    assert s.input_amax_history[0, :2].tolist() == [float(x2[:3].abs().max()), amax_in[0]]
    assert s.input_amax_history[1, :2].tolist() == [float(x2[3:].abs().max()), 0]
    assert s.input_amax_history[2, :2].tolist() == [amax_in[2], 0]     # no tokens: history not rolled


def test_delayed_experts_and_dense_layers_update_together_and_warn_when_not_updated():
    model = torch.nn.ModuleDict(dict(dense=Fp8Linear(K, N, recipe="delayed"),
                                     experts=Fp8GroupedLinear(2, K, N, recipe="delayed")))
    x = torch.randn(8, K)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (model["dense"](x).sum() + model["experts"](x, _offs([3, 5])).sum()).backward()
    opt.step()
    update_fp8_scales(model)
    assert bool(model["dense"].input_initialized)
    assert model["experts"].scaling.input_initialized.tolist() == [True, True]
    model["experts"](x, _offs([3, 5])).sum().backward()
    opt.step()  # no update_fp8_scales: the next forward of the experts warns (once per process)
    import fp8train.nn.delayed_scaling as delayed_scaling
    delayed_scaling._missing_update_warned = False
    with pytest.warns(RuntimeWarning, match="update_fp8_scales"):
        model["experts"](x, _offs([3, 5]))


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_scaling_state_round_trips_and_bad_state_is_refused(name):
    layer, x, _ = _layer(name, [4, 4])
    layer(x, _offs([4, 4])).sum().backward()
    update_fp8_scales(layer)
    state = layer.state_dict()
    assert state["scaling.input_nonfinite_amax_count"].shape == (2,)
    fresh = Fp8GroupedLinear(2, K, N, bias=True, recipe=name)
    fresh.load_state_dict(state)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, state[key]), key
    if name == "delayed":
        assert state["scaling.input_amax_history"].shape == (2, 1024)
        bad = dict(state)
        bad["scaling.weight_scale"] = torch.tensor([1.0, float("nan")])
        with pytest.raises(ValueError, match="weight_scale"):
            fresh.load_state_dict(bad)


# ---- bad input: one line each ------------------------------------------------------------------------------
@pytest.mark.parametrize("offs, match", [
    (torch.tensor([4, 2, 8], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([-1, 2, 8], dtype=torch.int32), "non-decreasing"),
    (torch.tensor([4, 6, 9], dtype=torch.int32), "past the token count 8"),
    (torch.tensor([4, 6, 8], dtype=torch.int64), "int32"),
    (torch.tensor([4, 8], dtype=torch.int32), "one per expert"),
])
def test_bad_offsets_are_refused(offs, match):
    layer = Fp8GroupedLinear(3, K, N, recipe="current")
    with pytest.raises(ValueError, match=match) as info:
        layer(torch.randn(8, K), offs)
    assert "\n" not in str(info.value)


def test_bad_operands_and_recipes_are_refused():
    scaling = ExpertScaling(2, "current")
    w = torch.randn(2, N, K)
    offs = _offs([2, 2])
    cases = [(torch.randn(4, K).to(torch.float64), w, None, "input dtype"),
             (torch.randn(4, K + 1), w, None, "last dim"),
             (torch.randn(4, K), w, torch.zeros(2, N, dtype=torch.bfloat16), "bias must be"),
             (torch.randn(4, K), torch.randn(3, N, K), None, "holds 2 experts")]
    for x, weight, bias, match in cases:
        with pytest.raises(ValueError, match=match) as info:
            fp8_grouped_mm(x, weight, offs, scaling, bias)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="backend='te'"):
        ExpertScaling(2, recipe("current", backend="te"))
    with pytest.raises(ValueError, match="num_experts"):
        ExpertScaling(0, "current")
    on_gpu = ExpertScaling(2, recipe("current", backend="scaled_mm"))
    with pytest.raises(ValueError, match="scaled_mm"):
        fp8_grouped_mm(torch.randn(4, K), w, offs, on_gpu)


def test_the_bench_section_is_reachable_and_its_routing_is_skewed():
    from fp8train.bench.experts_section import EXPERTS_SHAPE, skewed_group_sizes
    from fp8train.bench.options import OPTIONAL_SECTIONS, SECTIONS, parse_list

    assert parse_list("experts", SECTIONS + OPTIONAL_SECTIONS, "--sections") == ("experts",)
    assert "experts" not in SECTIONS  # (not in the default run)
    experts, _, _, tokens = EXPERTS_SHAPE
    sizes = skewed_group_sizes(experts, tokens)
    assert sum(sizes) == tokens and len(sizes) == experts
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 20 * sizes[-1] > 0


def test_one_all_reduce_carries_every_experts_pending_amax(monkeypatch):
    """update_fp8_scales: the dense layer's and every expert's pending amaxes travel in ONE all-reduce (a real
    collective of torch's in-process 'fake' backend, world size 2; the call is counted, then made)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model = torch.nn.ModuleDict(dict(dense=Fp8Linear(K, N, recipe="delayed"),
                                     a=Fp8GroupedLinear(3, K, N, recipe="delayed"),
                                     b=Fp8GroupedLinear(2, K, N, recipe="delayed")))
    x = torch.randn(8, K)
    (model["dense"](x).sum() + model["a"](x, _offs([3, 0, 5])).sum() + model["b"](x, _offs([8, 0])).sum()).backward()
    calls = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **kw: calls.append(t.numel()) or real(t, *a, **kw))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        update_fp8_scales(model)
    finally:
        dist.destroy_process_group()
    assert calls == [3 * (1 + 3 + 2)]  # one collective: (dense + 5 experts) x 3 roles
    assert model["a"].scaling.input_initialized.tolist() == [True, False, True]


def test_configure_execution_reaches_the_experts():
    from fp8train.nn.linear import configure_execution

    model = torch.nn.ModuleDict(dict(dense=Fp8Linear(K, N), experts=Fp8GroupedLinear(2, K, N)))
    assert configure_execution(model, emulated_dtype="fp32") == 2
    assert model["experts"].scaling.emulated_dtype == "fp32"
    with pytest.raises(ValueError, match="quantize_kernel"):
        model["experts"].scaling.configure(quantize_kernel="fast")


@pytest.mark.skipif(not native_cast.available(), reason="the one-pass paths run on fp8train's native cast kernel")
@pytest.mark.parametrize("name", ["delayed", "current"])
def test_one_pass_over_all_experts_keeps_each_experts_bits(name, monkeypatch):
    """Tensorwise weights are quantized in one call over (E, N * K) (nn/experts_weights.py) and every token group
    in one pass (nn/experts_tokens.py): outputs, gradients and the scaling buffers equal those of each expert's
    own quantizer (taken for operands that are no single contiguous block: the same values through transposed
    copies), over three steps (delayed: first step on own scales, then stored ones), the last with a NaN in one
    expert's weight and an inf in another expert's tokens (counted, never recorded)."""
    import fp8train.nn.experts_function as experts_function
    import fp8train.nn.experts_weights as experts_weights

    sizes = [5, 0, 131, 33]
    layers = [_layer(name, sizes, "bf16", seed=1)[0] for _ in range(2)]
    with torch.no_grad():
        layers[1].weight.data = layers[0].weight.detach().transpose(1, 2).contiguous().transpose(1, 2)
    assert not layers[1].weight.is_contiguous()
    weight_calls, token_calls = [], []
    real_weights, real_tokens = experts_weights._quantize_experts, experts_function.batched_token_fp8
    monkeypatch.setattr(experts_weights, "_quantize_experts", lambda *a: weight_calls.append(1) or real_weights(*a))
    monkeypatch.setattr(experts_function, "batched_token_fp8",
                        lambda *a: token_calls.append(real_tokens(*a)) or token_calls[-1])
    for step in range(3):
        x = torch.randn(sum(sizes), K) * (step + 1)
        grad = torch.randn(sum(sizes), N) * 1e-3
        if step == 2:
            x[140, 7] = float("inf")  # expert 3's tokens
        results = []
        for index, layer in enumerate(layers):
            if step == 2:
                with torch.no_grad():
                    layer.weight[2, 1, 2] = float("nan")
            # layer 1: the same values, not contiguous: each expert's own quantizer runs
            x_ = (x if index == 0 else x.t().contiguous().t()).clone().requires_grad_(True)
            y = layer(x_, _offs(sizes))
            y.backward(grad if index == 0 else grad.t().contiguous().t())
            results.append((y, x_.grad, layer.weight.grad.clone()))
            layer.weight.grad = None
            update_fp8_scales(layer)
        for a, b in zip(*results):  # the same bits, NaN where the other has NaN
            assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)), step
        for key, value in layers[0].scaling.state_dict().items():
            assert torch.equal(value, layers[1].scaling.state_dict()[key]), (step, key)
    # the contiguous layer only, once per weight version: every step for delayed (new scales), for current only
    # again after the weight changed (step 2); its tokens every step, forward and backward
    assert len(weight_calls) == (3 if name == "delayed" else 2)
    # (forward, backward) of layer 0 in one pass each, of layer 1 per expert
    assert [t is not None for t in token_calls] == [True, True, False, False] * 3
    assert layers[0].scaling.weight_nonfinite_amax_count.tolist() == [0, 0, 1, 0]
    assert layers[0].scaling.input_nonfinite_amax_count.tolist() == [0, 0, 0, 1]
