"""Fp8Linear: accuracy against nn.Linear and against an independent ml_dtypes reference, delayed-scaling state
(hand-computed scale sequences), gradient accumulation, non-finite handling, state_dict, autocast, telemetry."""

import math
import warnings

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn as nn

from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.nn.recipes import RECIPE_NAMES, recipe

RECIPES = RECIPE_NAMES  # every preset, mxfp8 included
ROLES = ("input", "weight", "grad_output")


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: a second OpenMP thread only adds sync

# SQNR thresholds (dB) against fp32 nn.Linear on Gaussian data. One E4M3 cast of a Gaussian gives ~31 dB;
# a GEMM of two such operands ~28 dB. E5M2 (2 mantissa bits) costs ~6 dB more on the gradients.
# mxfp8: the OCP MX rule rounds a block's E8M0 scale DOWN (2^(floor(log2 amax) - 8)), so in a block whose amax is
# just under a power of two the largest elements (up to 512 x scale) clip at 448 x scale. nn.Linear's uniform
# +-1/16 weight at K=256 is exactly that case: ~24.8 dB on the GEMMs that read the weight, ~28 dB at K=192.
OUTPUT_DB = {"delayed": 25.0, "current": 25.0, "rowwise": 25.0, "block": 25.0, "mxfp8": 22.0}
GRAD_DB = {"delayed": 20.0, "current": 20.0, "rowwise": 25.0, "block": 25.0, "mxfp8": 22.0}


def sqnr_db(actual, expected):
    expected, actual = expected.double(), actual.double()
    return 10 * math.log10(expected.pow(2).sum().item() / (actual - expected).pow(2).sum().item())


def _pair(recipe_name, in_features, out_features, bias=True, seed=0):
    torch.manual_seed(seed)
    ref = nn.Linear(in_features, out_features, bias=bias)
    fp8 = Fp8Linear(in_features, out_features, bias=bias, recipe=recipe_name)
    fp8.load_state_dict(ref.state_dict(), strict=False)
    return ref, fp8


def _fwd_bwd(layer, x, grad):
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(grad)
    return y.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("shape", [(4, 64, 256, 384), (3, 37, 192, 160)])  # (B, T, K, N); 2nd is ragged
def test_sqnr_against_nn_linear(name, shape):
    b, t, k, n = shape
    ref, fp8 = _pair(name, k, n)
    x, grad = torch.randn(b, t, k), torch.randn(b, t, n)
    expected, got = _fwd_bwd(ref, x, grad), _fwd_bwd(fp8, x, grad)
    assert got[0].shape == (b, t, n)
    assert sqnr_db(got[0], expected[0]) > OUTPUT_DB[name]
    assert sqnr_db(got[1], expected[1]) > GRAD_DB[name]  # grad_input
    assert sqnr_db(got[2], expected[2]) > GRAD_DB[name]  # grad_weight
    torch.testing.assert_close(got[3], expected[3])      # grad_bias comes from the unquantized gradient


# ---- independent reference for current scaling: ml_dtypes casts + fp64 GEMMs ---------------------------------
def _np_quantize(t, np_dtype, fmt_max):
    """Per-tensor current scaling done with numpy: scale = fp32(amax / max) (computed in fp64), fp32 divide,
    clip, then ml_dtypes' round-to-nearest-even cast. Returns (fp8 array, fp64 dequantized values)."""
    t32 = t.detach().float().numpy()
    scale = np.float32(np.float64(np.abs(t32).max()) / fmt_max)
    q = np.clip(t32 / scale, -fmt_max, fmt_max).astype(np_dtype)
    return q, q.astype(np.float64) * np.float64(scale)


@pytest.mark.parametrize("emulated", ["fp32", "bf16"])  # fp32 activations: fp32-output GEMMs in both modes
def test_current_scaling_matches_ml_dtypes_reference(emulated):
    torch.manual_seed(1)
    m, k, n = 96, 256, 160
    layer = Fp8Linear(k, n, bias=True, recipe="current")
    layer.emulated_dtype = emulated
    x = (torch.randn(m, k) * 3).requires_grad_(True)
    grad = torch.randn(m, n) * 1e-3

    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    y.backward(grad)

    x_q, x_ref = _np_quantize(x, ml_dtypes.float8_e4m3fn, 448.0)
    w_q, w_ref = _np_quantize(layer.weight, ml_dtypes.float8_e4m3fn, 448.0)
    g_q, g_ref = _np_quantize(grad, ml_dtypes.float8_e5m2, 57344.0)
    bias = layer.bias.detach().double().numpy()

    # The bytes saved for backward are exactly ml_dtypes' FP8 encodings of input and weight.
    saved_fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert len(saved_fp8) == 2
    assert np.array_equal(saved_fp8[0].view(torch.uint8).numpy(), x_q.view(np.uint8))
    assert np.array_equal(saved_fp8[1].view(torch.uint8).numpy(), w_q.view(np.uint8))

    def close(actual, expected):  # fp32 accumulation and one fp32 output rounding
        np.testing.assert_allclose(actual.detach().double().numpy(), expected, rtol=0,
                                   atol=2e-6 * np.abs(expected).max())

    close(y, x_ref @ w_ref.T + bias)                 # output = input @ weight.T
    close(x.grad, g_ref @ w_ref)                      # grad_input = grad_output @ weight
    close(layer.weight.grad, g_ref.T @ x_ref)         # grad_weight = grad_output.T @ input
    close(layer.bias.grad, grad.double().sum(0).numpy())


# (mxfp8 with the eager kernel is left out: there quantize_transposed's MX branch keeps no values, so the GEMMs
# decode the requantized weight and grad_output once more; the same results, one extra pass each)
@pytest.mark.parametrize("name, kernel", [(name, "default") for name in RECIPES] +
                         [(name, "eager") for name in RECIPES if name != "mxfp8"])
def test_emulated_gemms_read_what_the_quantizer_wrote(name, kernel, monkeypatch):
    """Every operand an emulated GEMM reads comes with its values (or, for block tiles from the C kernel, value x
    scale) from the quantizer's own pass: no GEMM decodes FP8 bytes again, in the forward or the backward, with
    the default kernel (the C one where it is built) or the eager one, fp32 or bf16 operands."""
    from fp8train.nn import fp8_operand
    from fp8train.numerics import native_cast

    if name == "mxfp8" and not native_cast.available():  # the default kernel is the eager one here (see above)
        pytest.skip(f"mxfp8's default kernel is the eager one here ({native_cast.unavailable_reason()}), whose "
                    "quantize_transposed keeps no values")
    decoded = []
    real_decode = fp8_operand.decode_fp8  # (the one decode a GEMM operand makes)
    monkeypatch.setattr(fp8_operand, "decode_fp8", lambda data, *args, **kwargs: decoded.append(tuple(data.shape))
                        or real_decode(data, *args, **kwargs))
    for emulated in ("fp32", "bf16"):
        torch.manual_seed(0)
        layer = Fp8Linear(256, 128, recipe=recipe(name, backend="emulated"))
        layer.emulated_dtype = emulated
        if kernel != "default":
            layer.quantize_kernel = kernel
        x = torch.randn(64, 256, requires_grad=True)
        layer(x).backward(torch.randn(64, 128))
        assert x.grad is not None and layer.weight.grad is not None
        assert decoded == [], (emulated, decoded)


def test_block_tiles_from_the_c_kernel_come_as_value_times_scale_only():
    """With block tiles the emulated GEMMs read value x scale, so the C kernel writes that in its one pass instead
    of the values (which nothing would read). Reference: ml_dtypes' decode of the bytes times each tile's scale,
    one fp32 rounding (a single product, as float64 then rounded)."""
    layer = Fp8Linear(256, 128, recipe=recipe("block", backend="emulated"))
    if layer.kernel_for(256 * 128) != "native":
        pytest.skip("the C quantize kernel is not built here (no compiler, or switched off)")
    quantizer = layer.quantizers["weight"]
    with torch.no_grad():
        quantized = quantizer.quantize(layer.weight, keep_values=True)
    assert quantized.values is None and quantized.dequantized is not None
    values = quantized.data.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    scale = quantized.scale.double().numpy().repeat(128, 0).repeat(128, 1)[:128, :256]
    expected = (values * scale).astype(np.float32)
    assert np.array_equal(quantized.dequantized.numpy(), expected)


def test_input_saved_in_fp8_not_high_precision():
    layer = Fp8Linear(128, 64, recipe="current")
    x = torch.randn(32, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x).sum().backward()
    big = [t for t in saved if t.numel() >= 64]
    assert big and all(t.dtype == torch.float8_e4m3fn for t in big), [(t.dtype, t.shape) for t in saved]


# ---- delayed scaling: hand-computed sequences ----------------------------------------------------------------
def _delayed_probe(**overrides):
    """16x16 layer with weight 448 * I: the weight quantizes exactly with scale 1, so y[0, 0] = 448 * x_deq."""
    layer = Fp8Linear(16, 16, bias=False, recipe=recipe("delayed", **overrides))
    with torch.no_grad():
        layer.weight.copy_(448 * torch.eye(16))
    return layer


def _step(layer, amax):
    x = torch.zeros(2, 16)
    x[0, 0] = amax
    x[1, 1] = -amax / 4
    y = layer(x)
    update_fp8_scales(layer)
    return y[0, 0].item() / 448  # the dequantized input value the forward used


AMAXES = [448, 896, 224, 112, 112, 1792]


@pytest.mark.parametrize("overrides, scales_after, x_used", [
    # history of 3, max: step 5 drops 896 out of the window (rollover)
    (dict(amax_history_len=3, amax_compute_algo="max"), [1, 2, 2, 2, 0.5, 4], [448, 448, 224, 112, 112, 224]),
    (dict(amax_history_len=3, amax_compute_algo="most_recent"), [1, 2, 0.5, 0.25, 0.25, 4],
     [448, 448, 224, 112, 112, 112]),
    # margin 1 doubles every scale; the first step (own amax, 448 -> scale 2) does not clip
    (dict(amax_history_len=3, amax_compute_algo="most_recent", margin=1), [2, 4, 1, 0.5, 0.5, 8],
     [448, 896, 224, 112, 112, 224]),
    (dict(amax_history_len=1024, amax_compute_algo="max"), [1, 2, 2, 2, 2, 4], [448, 448, 224, 112, 112, 896]),
])
def test_delayed_scale_sequence(overrides, scales_after, x_used):
    layer = _delayed_probe(**overrides)
    for amax, scale, used in zip(AMAXES, scales_after, x_used):
        assert _step(layer, amax) == used
        assert layer.input_scale.item() == scale
        assert layer.weight_scale.item() == 2.0 ** overrides.get("margin", 0)  # weight amax 448
    history = layer.input_amax_history
    if len(history) == 3:
        assert history.tolist() == [1792, 112, 112]  # newest first
    else:
        assert history[:6].tolist() == AMAXES[::-1] and history[6:].abs().sum() == 0


def test_delayed_first_step_uses_own_amax_and_non_pow2_scale():
    layer = _delayed_probe(amax_history_len=4)
    assert _step(layer, 896) == 896  # no history yet: scaled from its own amax, nothing clips
    assert layer.input_scale.item() == 2.0
    _step(layer, 300)
    assert layer.input_scale.item() == 2.0  # max(300, 896) / 448
    layer = _delayed_probe(amax_history_len=4, amax_compute_algo="most_recent")
    _step(layer, 300)
    assert layer.input_scale.item() == pytest.approx(0.6696428571428571, rel=1e-7)  # 300 / 448
    layer = _delayed_probe(amax_history_len=4, pow2_scales=True)
    _step(layer, 300)
    assert layer.input_scale.item() == 1.0  # 0.6696 rounded up to a power of two


def test_delayed_zero_amax_keeps_previous_scale():
    layer = _delayed_probe(amax_history_len=4, amax_compute_algo="most_recent")
    _step(layer, 0.0)
    assert layer.input_scale.item() == 1.0 and not layer.input_initialized.item()
    _step(layer, 896)
    _step(layer, 0.0)
    assert layer.input_scale.item() == 2.0 and layer.input_amax_history[:3].tolist() == [0, 896, 0]


@pytest.mark.parametrize("amaxes", [(896, 224), (224, 896), (224, 896, 448), (448, 448)],
                         ids=["large-then-small", "small-then-large", "largest-in-the-middle", "equal"])
def test_grad_accumulation_amax_is_max_over_micro_batches(amaxes):
    """One optimizer step of several micro-batches: the step's amax is the max over all of them, whatever their
    order (a pending amax that kept only the first or only the last micro-batch fails one of these orders)."""
    layer = _delayed_probe(amax_history_len=4, amax_compute_algo="most_recent")
    for amax in amaxes:
        x = torch.zeros(2, 16, requires_grad=True)
        with torch.no_grad():
            x[0, 0] = amax
        grad = torch.zeros(2, 16)
        grad[0, 0] = amax * 128  # e5m2 max is 57344 = 448 * 128
        layer(x).backward(grad)
    assert layer.input_pending_amax.item() == max(amaxes)
    update_fp8_scales(layer)
    assert layer.input_scale.item() == max(amaxes) / 448               # e.g. 896 / 448 = 2
    assert layer.grad_output_scale.item() == max(amaxes) * 128 / 57344  # e.g. 114688 / 57344 = 2
    assert layer.input_amax_history.tolist() == [max(amaxes), 0, 0, 0]  # one history entry per optimizer step


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_eval_forwards_leave_delayed_state_untouched(algo):
    """Eval-mode forwards quantize with the stored scales but record nothing: no pending amax, so the next
    update_fp8_scales neither rolls the history nor moves a scale, even for an eval amax 4x the training one."""
    layer = _delayed_probe(amax_history_len=4, amax_compute_algo=algo)
    _step(layer, 448)  # training step: scale 1, history [448, 0, 0, 0]
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.eval()
    with torch.no_grad():
        x = torch.zeros(2, 16)
        x[0, 0] = 1792
        y = layer(x)
    assert y[0, 0].item() == 448 * 448  # quantized with the stored scale 1: 1792 saturates at 448
    assert all(getattr(layer, f"{role}_pending_amax").item() == -1 for role in ROLES)
    update_fp8_scales(layer)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, state[key]), key

    # An eval forward between two training micro-batches does not leak into that step's amax.
    layer.train()
    x = torch.zeros(2, 16)
    x[0, 0] = 224
    layer(x)
    layer.eval()
    x[0, 0] = 1792
    layer(x)
    layer.train()
    assert layer.input_pending_amax.item() == 224
    update_fp8_scales(layer)
    assert layer.input_amax_history.tolist() == [224, 448, 0, 0]
    assert layer.input_scale.item() == {"max": 1.0, "most_recent": 0.5}[algo]


def test_eval_forward_of_a_fresh_layer_does_not_initialize_it():
    layer = _delayed_probe(amax_history_len=4)
    layer.eval()
    x = torch.zeros(2, 16)
    x[0, 0] = 896
    assert layer(x)[0, 0].item() == 896 * 448  # no stored scale yet: its own amax, as on the first step
    update_fp8_scales(layer)
    for role in ROLES:
        assert not getattr(layer, f"{role}_initialized").item(), role
        assert getattr(layer, f"{role}_amax_history").abs().sum().item() == 0, role
        assert getattr(layer, f"{role}_scale").item() == 1.0, role


# The grad_output format of each preset, from docs/design.md (not read from the recipe objects): E5M2 for the
# hybrid tensorwise recipes, E4M3 for rowwise and block.
GRAD_OUTPUT_FORMAT = {"delayed": "e5m2", "current": "e5m2", "rowwise": "e4m3fn", "block": "e4m3fn",
                      "mxfp8": "e4m3fn"}
ML_FORMAT = {"e5m2": (ml_dtypes.float8_e5m2, 57344.0), "e4m3fn": (ml_dtypes.float8_e4m3fn, 448.0)}


@pytest.mark.parametrize("name", RECIPES)
def test_grad_output_format_per_recipe(name):
    """grad_output of amax 57344 and one entry of 144: E5M2 (scale 1) rounds 144 = 1.125 * 2^7 to the even 128,
    E4M3 (scale 57344 / 448 = 128) keeps 1.125 exactly. With weight 448 * I, grad_input = 448 * grad_output as
    quantized, so the gradient shows which format the backward used. Reference: ml_dtypes' cast."""
    layer = _delayed_probe() if name == "delayed" else Fp8Linear(16, 16, bias=False, recipe=name)
    with torch.no_grad():
        layer.weight.copy_(448 * torch.eye(16))
    x = torch.ones(2, 16, requires_grad=True)
    grad = torch.zeros(2, 16)
    grad[:, 0], grad[:, 1], grad[:, 2] = 57344.0, 144.0, -3.0
    layer(x).backward(grad)
    np_dtype, fmt_max = ML_FORMAT[GRAD_OUTPUT_FORMAT[name]]
    scale = np.float32(57344.0 / fmt_max)  # a power of two for both formats: every recipe finds the same scale
    expected = (grad.numpy() / scale).astype(np_dtype).astype(np.float64) * scale * 448
    np.testing.assert_array_equal(x.grad.double().numpy(), expected)
    assert x.grad[0, 1].item() == {"e5m2": 128 * 448, "e4m3fn": 144 * 448}[GRAD_OUTPUT_FORMAT[name]]


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_does_not_poison_delayed_state(bad):
    layer = _delayed_probe(amax_history_len=4)
    _step(layer, 896)
    x = torch.ones(4, 16)
    x[2, 3] = bad
    layer(x)  # NaN/inf input: counted, not recorded
    assert layer.input_nonfinite_amax_count.item() == 1
    assert layer.input_pending_amax.item() == -1.0
    update_fp8_scales(layer)
    assert layer.input_scale.item() == 2.0 and layer.input_amax_history.tolist() == [896, 0, 0, 0]

    x = torch.ones(4, 16, requires_grad=True)
    grad = torch.ones(4, 16)
    grad[1, 1] = bad
    layer(x).backward(grad)  # NaN/inf gradient: counted, the input's amax still recorded
    update_fp8_scales(layer)
    assert layer.grad_output_nonfinite_amax_count.item() == 1
    assert torch.isfinite(layer.grad_output_amax_history).all() and torch.isfinite(layer.grad_output_scale)
    assert layer.input_amax_history.tolist() == [1, 896, 0, 0]


@pytest.mark.parametrize("name", ["current", "rowwise", "block", "mxfp8"])
def test_nonfinite_counted_for_dynamic_recipes(name):
    layer = Fp8Linear(128, 128, recipe=name)
    x = torch.randn(8, 128)
    x[3, 5] = math.inf
    x = x.requires_grad_(True)
    grad = torch.randn(8, 128)
    grad[0, 0] = math.nan
    layer(x).backward(grad)
    assert layer.input_nonfinite_amax_count.item() == 1
    assert layer.grad_output_nonfinite_amax_count.item() == 1
    assert layer.weight_nonfinite_amax_count.item() == 0


def test_update_touches_only_delayed_layers():
    """In a model that mixes recipes, update_fp8_scales rolls the delayed layer's state and leaves every buffer of
    the current-scaling layer (its non-finite counters included) and its next output exactly as they were."""
    delayed = _delayed_probe(amax_history_len=4)
    current = Fp8Linear(16, 16, recipe="current")
    model = nn.Sequential(delayed, current)
    x = torch.zeros(3, 16)
    x[0, 0], x[1, 1] = 896, -224
    model(x)
    current(torch.full((2, 16), math.nan))  # a non-finite event on the current layer: counted once
    before = {k: v.clone() for k, v in current.state_dict().items()}
    probe = torch.randn(4, 16)
    y_before = current(probe)
    update_fp8_scales(model)
    assert delayed.input_amax_history.tolist() == [896, 0, 0, 0] and delayed.input_scale.item() == 2.0
    assert current.input_nonfinite_amax_count.item() == 1
    assert current.state_dict().keys() == before.keys()
    assert all(torch.equal(current.state_dict()[k], v) for k, v in before.items())
    assert torch.equal(current(probe), y_before)


# ---- state, autocast, shapes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", RECIPES)
def test_state_dict_round_trip_is_bit_identical(name):
    torch.manual_seed(2)
    layer = Fp8Linear(128, 96, recipe=recipe(name, amax_history_len=8))
    for step in range(3):
        x = torch.randn(16, 128) * (step + 1)
        layer(x).sum().backward()
        update_fp8_scales(layer)
    state = layer.state_dict()
    fresh = Fp8Linear(128, 96, recipe=recipe(name, amax_history_len=8))
    fresh.load_state_dict(state)
    for key, value in state.items():
        assert torch.equal(fresh.state_dict()[key], value), key
    x, grad = torch.randn(16, 128) * 5, torch.randn(16, 96)
    layer.zero_grad(set_to_none=True)
    a, b = _fwd_bwd(layer, x, grad), _fwd_bwd(fresh, x, grad)
    for got, expected in zip(b, a):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("cast", ["half", "bfloat16", "to_float16", "double", "meta", "meta_half"])
def test_dtype_casts_keep_the_scaling_state_and_device_moves_take_it(cast):
    """A dtype cast changes the weights only: every scaling buffer keeps its dtype and bits, among them a
    grad_output scale of 1.5e-9 (below fp16's smallest subnormal, 2**-24: fp16 would flush it to 0) and a history
    value with 24 significant bits (bf16 keeps 8). A device move (here to meta, alone or with a cast) moves them
    with their dtypes."""
    layer = Fp8Linear(32, 16, recipe=recipe("delayed", amax_history_len=4))
    layer.grad_output_scale.fill_(1.5e-9)
    layer.input_amax_history[1] = 1.0 + 2.0 ** -23
    layer.weight_stale_scale_steps.fill_(3)
    before = {name: buf.clone() for name, buf in layer.named_buffers()}
    assert before["grad_output_scale"].dtype == torch.float32 and before["input_initialized"].dtype == torch.bool
    cast_to = {"half": lambda m: m.half(), "bfloat16": lambda m: m.bfloat16(), "double": lambda m: m.double(),
               "to_float16": lambda m: m.to(torch.float16), "meta": lambda m: m.to("meta"),
               "meta_half": lambda m: m.to("meta", torch.float16)}[cast]
    assert cast_to(layer) is layer
    weight_dtype = {"half": torch.float16, "to_float16": torch.float16, "bfloat16": torch.bfloat16,
                    "double": torch.float64, "meta": torch.float32, "meta_half": torch.float16}[cast]
    assert layer.weight.dtype == weight_dtype and layer.bias.dtype == weight_dtype
    after = dict(layer.named_buffers())
    assert set(after) == set(before)
    for name, buf in before.items():
        assert after[name].dtype == buf.dtype, name
        if cast.startswith("meta"):
            assert after[name].device.type == "meta", name
        else:
            assert torch.equal(after[name], buf), name
    if not cast.startswith("meta"):
        assert layer.grad_output_scale.item() == torch.tensor(1.5e-9).item()


def test_from_linear_reuses_parameters_and_repr():
    linear = nn.Linear(64, 32)
    layer = Fp8Linear.from_linear(linear, recipe("delayed", amax_history_len=16))
    assert layer.weight is linear.weight and layer.bias is linear.bias
    assert "recipe=delayed:e4m3/e4m3/e5m2:h16max:m0" in repr(layer)
    assert layer.input_amax_history.device == linear.weight.device and layer.input_amax_history.shape == (16,)
    assert isinstance(layer, nn.Linear)


@pytest.mark.parametrize("emulated", ["fp32", "bf16"])
@pytest.mark.parametrize("name", RECIPES)
def test_output_dtype_follows_autocast(name, emulated):
    """Under bf16 autocast the FP8 GEMMs still accumulate in fp32. emulated fp32: the output is the fp32 output
    rounded once to bf16; emulated bf16: the GEMM rounds its accumulator to bf16 before the fp32 scales and bias
    are applied (nn/gemm.py), so the output is within half a bf16 step of input @ weight.T plus one of the output
    of that. In both, the gradients (fp32 parameters, fp32 input) are the ones
    the same backward gives without autocast, bit for bit: fp32-output GEMMs never round to bf16."""
    layer = Fp8Linear(128, 64, recipe=name)
    layer.emulated_dtype = emulated
    x = torch.randn(2, 8, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 8, 64)
    y.float().sum().backward()
    grads_autocast = x.grad.clone(), layer.weight.grad.clone()
    assert grads_autocast[0].dtype == torch.float32 and grads_autocast[1].dtype == torch.float32
    x.grad, layer.weight.grad, layer.bias.grad = None, None, None
    y_fp32 = layer(x)
    assert y_fp32.dtype == torch.float32
    once = y_fp32.detach().bfloat16()
    if emulated == "fp32":
        assert torch.equal(y, once)
    else:  # the GEMM's rounding moves x @ w.T by half a bf16 step of ITS size (before the bias is added), the
        # output's rounding by half a step of the output: bf16's step at |v| is 2^(floor(log2 |v|) - 7)
        def step(v):
            return torch.exp2(torch.floor(torch.log2(v.float().abs().clamp_min(2.0 ** -126))) - 7)
        product = y_fp32.detach() - layer.bias.detach()
        assert ((y.float() - once.float()).abs() <= step(product) / 2 + step(once)).all()
        # the bias makes a second rounding that shows; tiles (block, mxfp8) vary along K, so those GEMMs run on
        # the dequantized fp32 operands in either mode (nn/gemm.py) and round once
        assert torch.equal(y, once) == layer.recipe.is_tiled
    y_fp32.sum().backward()
    assert torch.equal(grads_autocast[0], x.grad) and torch.equal(grads_autocast[1], layer.weight.grad)
    xb = x.detach().bfloat16().requires_grad_(True)
    yb = layer(xb)
    yb.sum().backward()
    assert yb.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    if emulated == "fp32":
        # A bf16 input holds values exact in fp32: the same layer on their fp32 copy, rounded once, gives the same.
        assert torch.equal(yb, layer(xb.detach().float()).bfloat16())


def test_bias_added_in_fp32():
    layer = Fp8Linear(64, 64, recipe="current")
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.fill_(1 + 2 ** -20)  # not representable in bf16; survives an fp32 add
    y = layer(torch.randn(4, 64))
    assert torch.all(y == 1 + 2 ** -20)


def test_telemetry_records_every_role():
    torch.manual_seed(3)
    for name in RECIPES:
        layer = Fp8Linear(128, 128, recipe=recipe(name, amax_history_len=4))
        layer(torch.randn(8, 128)).sum().backward()
        assert layer.last_stats == {}  # off by default
        layer.telemetry = True
        x = torch.randn(8, 128)
        layer(x).sum().backward()
        assert set(layer.last_stats) == set(ROLES)
        stats = layer.last_stats["input"]
        assert stats["amax"] == pytest.approx(x.abs().max().item())
        assert stats["sqnr_db"] > 25 and not stats["nonfinite"]
        # a scale from the tensor's own amax clips nothing, except mxfp8's rounded-down E8M0 scale (OUTPUT_DB)
        assert stats["overflow_frac"] == 0.0 if name != "mxfp8" else 0.0 < stats["overflow_frac"] < 0.05
        assert set(stats) == {"amax", "scale", "overflow_frac", "underflow_frac", "sqnr_db", "staleness",
                              "nonfinite"}
        if name == "delayed":
            assert stats["staleness"] == 1.0  # before any update: scaled from its own amax
            update_fp8_scales(layer)
            layer(x * 4).sum().backward()
            assert layer.last_stats["input"]["staleness"] == pytest.approx(4.0)
            assert layer.last_stats["input"]["overflow_frac"] > 0  # 4x the amax of the scale: clipped
        else:
            assert stats["staleness"] is None


def test_te_backend_is_not_an_fp8linear_backend():
    with pytest.raises(ValueError, match="make_te_linear"):
        Fp8Linear(64, 64, recipe=recipe("current", backend="te"))


# ---- the per-role quantizers: the layer's buffers, under the layer's own keys ------------------------------
DELAYED_BUFFERS = ["nonfinite_amax_count", "amax_history", "scale", "scale_amax", "pending_amax", "initialized",
                   "stale_scale_steps"]  # the documented list (nn/linear.py's docstring), in registration order


@pytest.mark.parametrize("name", RECIPES)
def test_quantizers_keep_the_layers_state_dict_keys(name):
    layer = Fp8Linear(32, 16, recipe=name)
    names = DELAYED_BUFFERS if name == "delayed" else DELAYED_BUFFERS[:1]
    expected = ["weight", "bias"] + [f"{role}_{b}" for role in ("input", "weight", "grad_output") for b in names]
    assert list(layer.state_dict()) == expected
    assert list(layer.quantizers) == ["input", "weight", "grad_output"]
    assert [q.role for q in layer.quantizers.values()] == ["input", "weight", "grad_output"]


def test_quantizers_follow_buffers_that_a_load_replaces():
    """load_state_dict(assign=True) puts new tensors behind the buffer names: the quantizer records into those
    (a quantizer holding the old tensors would record into orphans, and the state_dict would not see it)."""
    layer = _delayed_probe(amax_history_len=4)
    layer.load_state_dict({k: v.clone() for k, v in layer.state_dict().items()}, assign=True)
    x = torch.tensor([[3.0] + [0.5] * 15, [-7.25] + [0.0] * 15])
    layer(x).sum().backward()
    state = layer.state_dict()
    assert state["input_pending_amax"].item() == 7.25 and state["weight_pending_amax"].item() == 448.0
    assert state["grad_output_pending_amax"].item() == 1.0  # d(sum)/dy
    # current scaling until the first update: the input's scale is its own amax / 448 (E4M3's max)
    assert layer.quantizers["input"].tensorwise_scale(torch.tensor(7.25)).item() == np.float32(7.25 / 448)
    update_fp8_scales(layer)
    assert layer.quantizers["input"].tensorwise_scale(torch.tensor(1.0)).item() == np.float32(7.25 / 448)
    assert layer.state_dict()["input_amax_history"].tolist() == [7.25, 0.0, 0.0, 0.0]


# ---- the weight's FP8 copy: made once per weight version, reused, invalidated ------------------------------
def _weight_quantizations(monkeypatch, layer):
    calls = []
    for role, quantizer in layer.quantizers.items():
        def counting(tensor, keep_values=True, role=role, real=quantizer.quantize):
            calls.append(role)
            return real(tensor, keep_values)

        monkeypatch.setattr(quantizer, "quantize", counting)
    return calls


@pytest.mark.parametrize("name", RECIPES)
def test_weight_fp8_made_once_per_step_and_remade_when_the_weight_changes(name, monkeypatch):
    torch.manual_seed(4)
    layer = Fp8Linear(64, 48, recipe=recipe(name, amax_history_len=4))
    calls = _weight_quantizations(monkeypatch, layer)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(3):  # three micro-batches, one optimizer step
        layer(torch.randn(8, 64)).sum().backward()
    assert calls.count("weight") == 1 and calls.count("input") == calls.count("grad_output") == 3
    optimizer.step()
    update_fp8_scales(layer)
    x = torch.randn(8, 64)
    out = layer(x)
    assert calls.count("weight") == 2  # the step changed the weight in place
    # ... and the remade copy is exactly what a fresh layer with the same state computes
    fresh = Fp8Linear(64, 48, recipe=layer.recipe)
    fresh.load_state_dict(layer.state_dict())
    fresh.train()
    assert torch.equal(fresh(x), out)
    with torch.no_grad():
        layer.weight.mul_(2)  # any in-place change
    layer(x)
    assert calls.count("weight") == 3
    layer.load_state_dict(fresh.state_dict())  # a checkpoint load
    assert torch.equal(layer(x), fresh(x)) and calls.count("weight") == 4
    layer.eval()
    layer(x)
    assert calls.count("weight") == 5  # eval never records amaxes: its copy is not the training one


def test_delayed_weight_amax_recorded_once_per_step_under_grad_accumulation():
    layer = _delayed_probe(amax_history_len=4)
    for _ in range(2):
        layer(torch.randn(2, 16)).sum().backward()
    assert layer.weight_pending_amax.item() == 448.0
    update_fp8_scales(layer)
    assert layer.weight_amax_history[:2].tolist() == [448.0, 0.0]


# ---- stacked update: layers of different options, one call ---------------------------------------------------
def test_stacked_update_handles_groups_of_different_recipes():
    a = _delayed_probe(amax_history_len=3, amax_compute_algo="max")
    b = _delayed_probe(amax_history_len=5, amax_compute_algo="most_recent", margin=1)
    model = nn.Sequential(a, b)
    for amax in (448, 1792, 224):
        x = torch.zeros(2, 16)
        x[0, 0] = amax
        a(x), b(x)
        update_fp8_scales(model)
    assert a.input_amax_history.tolist() == [224, 1792, 448] and a.input_scale.item() == 4.0  # 1792 / 448
    assert b.input_amax_history[:3].tolist() == [224, 1792, 448] and b.input_scale.item() == 1.0  # 224/448*2


# ---- outliers in delayed scaling (issue 13.12) ---------------------------------------------------------------
def test_outlier_is_counted_and_factor_keeps_it_from_setting_the_scale():
    """One 1e30 step: with plain max, the next steps (amax 1) quantize below the smallest normal and are
    counted as stale; with amax_outlier_factor=1000 the scale comes from the second largest amax (1)."""
    used = {}
    for factor in (0.0, 1000.0):
        layer = _delayed_probe(amax_history_len=8, amax_outlier_factor=factor)
        used[factor] = [_step(layer, amax) for amax in (1.0, 1e30, 1.0, 1.0)]
        used[factor].append(layer.input_stale_scale_steps.item())
    # no factor: scale 1e30 / 448 after the outlier; 1.0 / scale = 4.5e-28 flushes to 0 (counted twice)
    assert used[0.0][2:] == [0.0, 0.0, 2]
    # factor: max(history) = 1e30 > 1000 * 1, so the scale is 1 / 448 and 1.0 comes back exactly; nothing stale
    assert used[1000.0][2:] == [pytest.approx(1.0, rel=1e-6), pytest.approx(1.0, rel=1e-6), 0]


def test_outlier_factor_with_one_nonzero_entry_takes_that_entry():
    """The first recorded step: history (896, 0, ...). The second largest is 0, so 896 is not an outlier (the
    factor compares against a second amax > 0 only): the scale is 896 / 448 = 2, not left at its initial 1."""
    layer = _delayed_probe(amax_history_len=8, amax_outlier_factor=1000.0)
    _step(layer, 896.0)
    assert layer.input_amax_history[:2].tolist() == [896.0, 0.0]
    assert layer.input_scale.item() == 2.0 and layer.input_scale_amax.item() == 896.0
    assert bool(layer.input_initialized)


def test_outlier_factor_trusts_two_outliers():
    layer = _delayed_probe(amax_history_len=8, amax_outlier_factor=1000.0)
    for amax in (1.0, 1e30, 1e30):
        _step(layer, amax)
    assert layer.input_scale.item() == pytest.approx(1e30 / 448, rel=1e-6)


@pytest.mark.parametrize("bad", [1.0, 0.5, -2, math.inf, math.nan, True, "10"])
def test_outlier_factor_validated(bad):
    with pytest.raises(ValueError, match="amax_outlier_factor"):
        recipe("delayed", amax_outlier_factor=bad)


# ---- op counts (issue 14): top-level aten ops of one forward + .float().sum().backward() ---------------------
def top_level_aten_ops(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def nested(event):
        parent = event.cpu_parent
        while parent is not None:
            if parent.name.startswith("aten::"):
                return True
            parent = parent.cpu_parent
        return False

    return sum(1 for e in prof.events() if e.name.startswith("aten::") and not nested(e))


def _fwd_bwd_512(layer):
    x = torch.randn(512, 256)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x.requires_grad_(True))
        y.float().sum().backward()
        layer.weight.grad = layer.bias.grad = x.grad = None

    return step


@pytest.mark.parametrize("name", ["current", "delayed"])
def test_fp8_linear_op_count_is_at_most_2_5x_nn_linear(name):
    torch.manual_seed(0)
    baseline = _fwd_bwd_512(nn.Linear(256, 256))
    baseline()
    layer = Fp8Linear(256, 256, recipe=name)
    step = _fwd_bwd_512(layer)
    step()
    update_fp8_scales(layer)  # steady state: delayed scales initialized
    step()  # the weight copy of this step is made here; the counted micro-batch reuses it
    reference, fp8 = top_level_aten_ops(baseline), top_level_aten_ops(step)
    # The native kernel quantizes in one op; the eager chain (no C compiler, or --native-cast=off) takes a few
    # more per operand (amax, scale, divide, clamp, cast: quant.py), hence its own budget.
    budget = 2.5 if layer.kernel_for(512 * 256) == "native" else 3.0
    assert fp8 <= budget * reference, (fp8, reference)


def test_delayed_update_ops_do_not_grow_with_layers():
    counts = []
    for n_layers in (2, 8):
        model = nn.Sequential(*[Fp8Linear(32, 32, recipe="delayed") for _ in range(n_layers)])
        # A steady step, counted after a first one: the first step of a group also builds its per-format
        # constants (cached across models, so its count would depend on which tests ran before) and reads the
        # new `initialized` flags back once.
        for _ in range(2):
            model(torch.randn(4, 32)).sum().backward()
            count = top_level_aten_ops(lambda: update_fp8_scales(model))
        counts.append(count)
    assert counts[0] == counts[1] and counts[0] <= 60, counts


def test_a_conv1d_layout_layer_reads_in_out_weights_and_keeps_old_out_in_checkpoints():
    """A layer converted from a Conv1D keeps Conv1D's (in, out) layout in its state dict. Loading: an (in, out)
    weight is transposed back, square ones included; a rectangular (out, in) weight (a checkpoint written before
    the state dict held Conv1D's layout) loads as it is."""
    square = Fp8Linear(16, 16, recipe="current")
    square.conv1d_layout = True
    w_in_out = torch.arange(256, dtype=torch.float32).reshape(16, 16)  # w_in_out[i, o]: input i to output o
    square.load_state_dict({**square.state_dict(), "weight": w_in_out})
    assert torch.equal(square.weight, w_in_out.t())  # nn.Linear's (out, in)
    assert torch.equal(square.state_dict()["weight"], w_in_out)  # and saved back as (in, out)
    wide = Fp8Linear(16, 32, bias=False, recipe="current")  # in 16, out 32
    wide.conv1d_layout = True
    w_in_out = torch.arange(512, dtype=torch.float32).reshape(16, 32)
    wide.load_state_dict({**wide.state_dict(), "weight": w_in_out})
    assert torch.equal(wide.weight, w_in_out.t())
    w_out_in = torch.arange(512, dtype=torch.float32).reshape(32, 16)  # the old layout: loads untransposed
    wide.load_state_dict({**wide.state_dict(), "weight": w_out_in})
    assert torch.equal(wide.weight, w_out_in)


def test_a_forward_after_an_optimizer_step_without_update_warns_once(monkeypatch):
    """Delayed scaling: amaxes pending across an optimizer step mean update_fp8_scales was not called; the
    warning is a RuntimeWarning naming the call to add, given once per process."""
    import fp8train.nn.delayed_scaling as delayed_scaling

    monkeypatch.setattr(delayed_scaling, "_missing_update_warned", False)
    layer = Fp8Linear(16, 16, recipe="delayed")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    layer(torch.randn(2, 16)).sum().backward()
    optimizer.step()  # no update_fp8_scales(layer) after it
    with pytest.warns(RuntimeWarning) as caught:
        layer(torch.randn(2, 16))
    ours = [w for w in caught if w.category is RuntimeWarning]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert text.startswith("Fp8Linear with delayed scaling: a forward runs with amaxes pending from an earlier "
                           "optimizer step")
    assert "Call fp8train.update_fp8_scales(model) after each optimizer.step()" in text
    assert "callbacks=[fp8train.Fp8ScalingCallback()]" in text
    optimizer.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # once per process: no second warning
        layer(torch.randn(2, 16))


@pytest.mark.parametrize("name, training", [("current", True), ("rowwise", True), ("delayed", False)])
def test_no_missing_update_warning_without_delayed_training(monkeypatch, name, training):
    """Only a delayed layer in training checks for a missing update_fp8_scales: a current/rowwise layer in
    training, or a delayed one in eval, runs forward, optimizer.step(), forward without the warning."""
    import fp8train.nn.delayed_scaling as delayed_scaling

    monkeypatch.setattr(delayed_scaling, "_missing_update_warned", False)
    layer = Fp8Linear(16, 16, recipe=name).train(training)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        layer(torch.randn(2, 16)).sum().backward()
        optimizer.step()
        layer(torch.randn(2, 16))
        optimizer.step()
        layer(torch.randn(2, 16))
    assert delayed_scaling._missing_update_warned is False


@pytest.mark.parametrize("name", RECIPES)
def test_a_layer_built_on_the_meta_device_has_every_buffer_there(name):
    """Built on meta (a model's skeleton, materialized later with to_empty), every scaling buffer is on meta
    too: none is allocated on another device."""
    layer = Fp8Linear(64, 64, recipe=name, device="meta")
    assert layer.weight.is_meta
    assert [n for n, b in layer.named_buffers() if b.device.type != "meta"] == []


def test_a_square_layer_loads_its_own_state_dict_untransposed():
    """Only a layer converted from a Conv1D reads a square weight as (in, out); a square nn.Linear's weight loads
    as it is, and a state dict without the weight (strict=False) loads the rest."""
    torch.manual_seed(0)
    source = nn.Linear(16, 16)
    layer = Fp8Linear(16, 16, recipe="current")
    layer.load_state_dict({**layer.state_dict(), **source.state_dict()})
    assert torch.equal(layer.weight, source.weight) and torch.equal(layer.bias, source.bias)
    before = layer.weight.detach().clone()
    without_weight = {k: v for k, v in layer.state_dict().items() if k != "weight"}
    layer.load_state_dict({**without_weight, "bias": torch.zeros(16)}, strict=False)
    assert torch.equal(layer.weight, before) and torch.equal(layer.bias, torch.zeros(16))


class _UnversionedSGD(torch.optim.Optimizer):
    """Writes the weights through `.data` (its own version counter), as fused AdamW does: the parameter's
    _version does not move, so only the optimizer-step count tells the weight cache that the weight changed."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


def test_weight_fp8_remade_after_every_step_of_an_optimizer_that_does_not_bump_versions():
    torch.manual_seed(5)
    layer = Fp8Linear(32, 16, recipe="current")
    optimizer = _UnversionedSGD(layer.parameters(), lr=0.5)
    x = torch.randn(4, 32)
    for _ in range(3):  # each step must be seen, not only the first one of the process
        optimizer.zero_grad()
        layer(x).sum().backward()
        version, before = layer.weight._version, layer.weight.detach().clone()
        optimizer.step()
        assert layer.weight._version == version and not torch.equal(layer.weight, before)
        fresh = Fp8Linear(32, 16, recipe="current")
        fresh.load_state_dict(layer.state_dict())
        assert torch.equal(layer(x), fresh(x))


def test_auto_quantize_kernel_is_eager_on_a_cpu_without_the_native_cast(monkeypatch):
    """quantize_kernel 'auto' where the native cast is off (a CPU without a C compiler): eager at every size
    (the compiled kernel is for GPUs), and the same output bits as the native kernel gives."""
    from fp8train.nn import linear as linear_module
    from fp8train.numerics import native_cast

    layer = Fp8Linear(16, 16)
    x = torch.randn(8, 16)
    expected = layer(x)
    monkeypatch.setattr(native_cast, "_enabled", False)
    layer._resolved_kernel = (None, None)  # (resolved again: the process switched the native kernel off)
    assert layer.quantize_kernel == "auto"
    assert layer.kernel_for(linear_module.QUANT_KERNEL_MIN_NUMEL - 1) == "eager"
    assert layer.kernel_for(1 << 24) == "eager"
    assert torch.equal(layer(x), expected)
    layer.quantize_kernel = "compiled"  # asked for by name: the compiled kernel from QUANT_KERNEL_MIN_NUMEL on
    assert layer.kernel_for(1 << 20) == "compiled" and layer.kernel_for(100) == "eager"
    assert linear_module.QUANT_KERNEL_MIN_NUMEL == 1 << 20


def test_a_delayed_layers_forward_and_backward_do_not_sync():
    """Delayed scaling quantizes with its stored scale (finite and > 0 by construction): once initialized, a
    training forward + backward reads nothing back to the host (no aten._local_scalar_dense: .item(), bool(),
    float() of a tensor; tests/test_step_syncs.py counts the same op), nor does an eval forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LocalScalarReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket.__name__ in ("_local_scalar_dense", "is_nonzero")
            return func(*args, **(kwargs or {}))

    torch.manual_seed(1)
    layer = Fp8Linear(32, 16, recipe="delayed")
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.01)
    for _ in range(2):  # scales initialized, the host mirror read back
        layer(torch.randn(8, 32)).sum().backward()
        optimizer.step()
        update_fp8_scales(layer)
    assert all(q.initialized_on_host for q in layer.quantizers.values())
    with LocalScalarReads() as reads:
        layer(torch.randn(8, 32, requires_grad=True)).sum().backward()
    assert reads.count == 0
    layer.eval()
    with LocalScalarReads() as reads:
        layer(torch.randn(8, 32))
    assert reads.count == 0


def test_is_scaling_buffer_on_real_state_dict_keys():
    """Every scaling buffer of a (nested) delayed layer's state_dict, written out here, is one; weight/bias are not."""
    from fp8train.nn.linear import is_scaling_buffer
    buffers = ["nonfinite_amax_count", "amax_history", "scale", "scale_amax", "pending_amax", "initialized",
               "stale_scale_steps"]
    expected = {f"0.{role}_{name}" for role in ("input", "weight", "grad_output") for name in buffers}
    keys = list(nn.Sequential(Fp8Linear(32, 32, recipe="delayed")).state_dict())
    assert set(keys) == expected | {"0.weight", "0.bias"}
    assert [k for k in keys if is_scaling_buffer(k)] == [k for k in keys if k in expected]
    assert is_scaling_buffer("input_scale") and is_scaling_buffer("model.layers.3.q_proj.grad_output_amax_history")
    for key in ("weight", "bias", "0.weight", "0.bias", "input_scale.x", "0.input", "0.scale", "x_scale"):
        assert not is_scaling_buffer(key), key


# ---- how a layer runs: configure_execution, and the kernel that reaches every quantize call -------------------
def test_configure_execution_sets_every_fp8_layer_and_only_those():
    from fp8train.nn.linear import configure_execution

    model = nn.Sequential(Fp8Linear(16, 16, recipe="current"), nn.Linear(16, 16), Fp8Linear(16, 8, recipe="block"))
    assert configure_execution(model, quantize_kernel="eager", emulated_dtype="fp32") == 2
    assert [(m.quantize_kernel, m.emulated_dtype) for m in (model[0], model[2])] == [("eager", "fp32")] * 2
    assert not hasattr(model[1], "quantize_kernel")
    with pytest.raises(ValueError, match="quantize_kernel must be one of auto, .*; got 'fast'"):
        configure_execution(model, quantize_kernel="fast")
    assert model[0].quantize_kernel == "eager"  # a refused call changes nothing


@pytest.mark.parametrize("name", RECIPES)
@pytest.mark.parametrize("kernel", ["native", "eager"])
def test_the_configured_kernel_reaches_every_quantize_call(name, kernel, monkeypatch):
    """Both kernels write the same bytes (tests/test_native_cast.py), so outputs cannot tell which one ran: the
    kernel each quantize call of a forward + backward was handed can. MX and the transposed copies included."""
    from fp8train.nn import quantizer as quantizer_module
    from fp8train.nn.linear import configure_execution
    from fp8train.numerics import native_cast

    if kernel == "native" and not native_cast.available():
        pytest.skip("fp8train's C kernel is not built here (no C compiler)")
    handed = []
    for fn_name in ("quantize", "quantize_mx", "native_quantize"):
        original = getattr(quantizer_module, fn_name)

        def spy(*args, _original=original, _name=fn_name, **kwargs):  # (native_quantize: the C kernel itself)
            handed.append("native" if _name == "native_quantize" else kwargs.get("kernel", "(not given)"))
            return _original(*args, **kwargs)

        monkeypatch.setattr(quantizer_module, fn_name, spy)
    layer = Fp8Linear(128, 128, recipe=name)
    configure_execution(layer, quantize_kernel=kernel)
    x = torch.randn(64, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x).float().sum().backward()
    assert len(handed) >= 3 and set(handed) == {kernel}, handed


def test_a_conv1d_layout_state_dict_holds_contiguous_tensors(tmp_path):
    """The (in, out) weight a Conv1D-layout layer saves is a contiguous copy, not a transposed view: safetensors
    (HF checkpoints) refuses non-contiguous tensors. keep_vars=True hands out the live view instead."""
    import safetensors.torch

    layer = Fp8Linear(16, 32, recipe="current")
    layer.conv1d_layout = True
    state = layer.state_dict()
    assert state["weight"].shape == (16, 32) and state["weight"].is_contiguous()
    safetensors.torch.save_file(state, tmp_path / "layer.safetensors")
    assert torch.equal(safetensors.torch.load_file(tmp_path / "layer.safetensors")["weight"], layer.weight.t())
    live = layer.state_dict(keep_vars=True)["weight"]
    assert live.data_ptr() == layer.weight.data_ptr()


def test_the_stale_scale_counters_are_int64():
    """Delayed scaling's per-role count of steps a stale scale was used for: an integer counter (a float one
    stops counting at 2**24)."""
    layer = Fp8Linear(32, 16, recipe="delayed")
    counters = {k: v for k, v in layer.state_dict().items() if k.endswith("_stale_scale_steps")}
    assert sorted(counters) == [f"{role}_stale_scale_steps" for role in ("grad_output", "input", "weight")]
    assert all(v.dtype == torch.int64 and v.shape == () for v in counters.values())


def test_importing_and_building_layers_registers_no_optimizer_hook():
    """fp8train adds no process-wide optimizer step hook by being imported or by building layers of any recipe;
    the first forward that caches an FP8 weight registers one (shared by every layer: fused AdamW writes weights
    without a version bump, so the optimizer steps are part of the weight cache's key), and only one. A fresh
    process, as the hook stays for the life of the one running the suite."""
    import subprocess
    import sys

    script = """
import torch
from torch.optim import optimizer as torch_optimizer
hooks = torch_optimizer._global_optimizer_post_hooks  # (torch's table behind register_optimizer_step_post_hook)
before = len(hooks)
import fp8train
from fp8train import Fp8Linear
from fp8train.nn.recipes import RECIPE_NAMES
layers = [Fp8Linear(32, 32, recipe=name) for name in RECIPE_NAMES]
print(len(hooks) - before)
for layer in layers:
    layer(torch.randn(4, 32)).sum().backward()
print(len(hooks) - before)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["0", "1"], out.stdout + out.stderr


@pytest.mark.parametrize("name", ["current", "block"])
def test_settings_changed_after_a_forward_take_effect_as_on_a_fresh_layer(name):
    """A layer resolves its GEMMs and what each operand keeps once per device and dtypes (nn/linear_dispatch.py):
    changing its emulated dtype, or a process-wide switch (the native GEMM's mode, the native cast), after a
    forward must give, bit for bit, what a fresh layer built under the new settings computes (forward and both
    gradients), and a fresh layer under the old settings must still agree with the first forward."""
    from fp8train.numerics import native_cast, native_gemm

    def run(layer, x, dy):
        x = x.clone().requires_grad_(True)
        layer.zero_grad()
        out = layer(x)
        out.backward(dy)
        return out.detach(), x.grad, layer.weight.grad.clone()

    torch.manual_seed(3)
    base = Fp8Linear(256, 64, recipe=recipe(name, backend="emulated"))
    x, dy = torch.randn(32, 256, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)

    def fresh(emulated):
        layer = Fp8Linear(256, 64, recipe=base.recipe)
        layer.load_state_dict(base.state_dict())
        layer.emulated_dtype = emulated
        return layer

    previous_mode = native_gemm.mode()
    try:
        # (the native bf16 GEMM on, as on a CPU with AVX512-BF16, so that bf16 emulation reads other values than
        # fp32's for every recipe: with it off, block tiles are read in fp32 under both)
        native_gemm.set_mode("on")
        layer = fresh("fp32")
        first = run(layer, x, dy)
        layer.emulated_dtype = "bf16"
        changed = run(layer, x, dy)
        for got, want in zip(changed, run(fresh("bf16"), x, dy)):
            assert torch.equal(got, want)
        if native_gemm.in_use(x.device) or not base.recipe.is_tiled:  # (without the native GEMM, tiles read fp32)
            assert not all(torch.equal(a, b) for a, b in zip(first, changed))  # (bf16 rounds where fp32 does not)
        for mode in ("off", "on"):
            native_gemm.set_mode(mode)
            for got, want in zip(run(layer, x, dy), run(fresh("bf16"), x, dy)):
                assert torch.equal(got, want), mode
        native_cast.set_enabled(False)
        for got, want in zip(run(layer, x, dy), run(fresh("bf16"), x, dy)):
            assert torch.equal(got, want)
    finally:
        native_cast.set_enabled(True)
        native_gemm.set_mode(previous_mode)
    for got, want in zip(first, run(fresh("fp32"), x, dy)):
        assert torch.equal(got, want)
