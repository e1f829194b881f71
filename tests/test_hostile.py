"""Hostile numerics: NaN, +-inf, values far beyond every FP8 max, all zeros and fp32 subnormals, in inputs and in
gradients. Whatever comes in, the scales and amax histories stay finite and positive, every non-finite amax is
counted (the `{role}_nonfinite_amax_count` buffers) and reported by telemetry, delayed scaling follows a hand-written
reference that simply leaves non-finite amaxes out, and the training loop's guard (train.skip_nonfinite_grads) skips
an optimizer step whose gradients are non-finite, counts it and logs it as skipped_steps.

Property-based (hypothesis, bounded examples, no deadline) over quantize and Fp8Linear; one short real training run.
"""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from safetensors.torch import load_file

from fp8train.training.runs import telemetry
from fp8train.training.config import load_config
from fp8train.numerics.formats import get_format
from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.numerics.quant import compute_amax, expand_scale, quantize
from fp8train.nn.recipes import RECIPE_NAMES, recipe

pytestmark = pytest.mark.usefixtures("single_thread")

FORMATS = ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"]
RECIPES = list(RECIPE_NAMES)  # every preset, mxfp8 included
NAN, INF = float("nan"), float("inf")
SPECIALS = [NAN, INF, -INF, 0.0, -0.0, 1e30, -1e30, 3e38, -3.4e38, 1e-40, -1e-45, 1.2e-38, 448.0, 57344.0, 6e4]
# Deterministic and bounded for the suite (derandomize: the same examples every run; database=None: no
# .hypothesis/ folder). FP8TRAIN_HYPOTHESIS_EXAMPLES=500 explores further with fresh random examples.
_EXPLORE = int(os.environ.get("FP8TRAIN_HYPOTHESIS_EXAMPLES", "0"))
HOSTILE = settings(max_examples=_EXPLORE or 30, derandomize=not _EXPLORE, deadline=None, database=None,
                   suppress_health_check=[HealthCheck.too_slow])

element = st.one_of(st.sampled_from(SPECIALS),
                    st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False))
hostile_matrix = st.tuples(st.integers(1, 6), st.integers(1, 40)).flatmap(
    lambda shape: arrays(np.float32, shape, elements=element))


# ------------------------------------------------------------------------------------------------------------
# quantize
# ------------------------------------------------------------------------------------------------------------
@HOSTILE
@given(x=hostile_matrix, fmt_name=st.sampled_from(FORMATS), granularity=st.sampled_from(["tensor", "row", "block"]))
def test_quantize_survives_anything(x, fmt_name, granularity):
    fmt = get_format(fmt_name)
    xt = torch.from_numpy(x)
    block = (2, 16)
    q = quantize(xt, fmt, granularity=granularity, block=block)
    assert q.data.dtype == fmt.torch_dtype and q.data.shape == xt.shape
    assert torch.isfinite(q.scale).all() and (q.scale > 0).all()  # a scale is never 0, inf or NaN
    d = q.dequantize()
    finite = torch.isfinite(xt)
    assert torch.isnan(d[torch.isnan(xt)]).all()  # NaN stays NaN (every format has a NaN code)
    assert torch.isfinite(d[~torch.isnan(xt)]).all()  # inf saturates, nothing else becomes non-finite
    assert (torch.sign(d[torch.isinf(xt)]) == torch.sign(xt[torch.isinf(xt)])).all()
    # Nothing grows: |dequantized| <= max * scale of its group, and <= |x| up to one rounding step.
    s = expand_scale(q.scale, xt.shape, granularity, block, -1).expand_as(xt)
    assert (d.abs()[finite] <= fmt.max * s[finite] * (1 + 1e-6)).all()
    if bool(finite.all()):  # every group's amax is finite: nothing clips, the usual error bound holds
        err = (d - xt).abs()
        bound = xt.abs() * fmt.max_rel_error + 0.5 * fmt.min_subnormal * s
        assert (err <= bound * (1 + 1e-5) + 1e-45).all()
    amax = compute_amax(xt, "tensor")  # NaN propagates into the amax; inf and everything else is max |x|
    if bool(torch.isnan(xt).any()):
        assert torch.isnan(amax)
    else:
        assert float(amax) == float(xt.abs().max())


@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("value", [0.0, 1e-45, 1e-40, 1.1754944e-38])
def test_all_zero_and_subnormal_tensors_get_a_usable_scale(fmt_name, value):
    fmt = get_format(fmt_name)
    q = quantize(torch.full((4, 8), value), fmt)
    assert math.isfinite(float(q.scale)) and float(q.scale) >= torch.finfo(torch.float32).tiny
    assert torch.isfinite(q.dequantize()).all() and (q.dequantize() >= 0).all()


# ------------------------------------------------------------------------------------------------------------
# Fp8Linear
# ------------------------------------------------------------------------------------------------------------
KINDS = ["normal", "nan", "inf", "-inf", "huge", "zeros", "subnormal", "mixed"]
NONFINITE_KINDS = {"nan", "inf", "-inf", "mixed"}


def hostile_tensor(kind: str, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if kind == "nan":
        x.view(-1)[seed % x.numel()] = NAN
    elif kind == "inf":
        x.view(-1)[seed % x.numel()] = INF
    elif kind == "-inf":
        x[..., 0] = -INF
    elif kind == "huge":
        x = x * 1e30  # far beyond every FP8 max, still finite in fp32
    elif kind == "zeros":
        x = torch.zeros(shape)
    elif kind == "subnormal":
        x = x * 1e-41  # fp32 subnormals
    elif kind == "mixed":
        x.view(-1)[:4] = torch.tensor([NAN, INF, -INF, 1e-42])
    return x


class DelayedReference:
    """Delayed scaling for one role, written from docs/design.md: a step's amax enters the history only if finite;
    the scale is max(history) / fmt.max once that is > 0, else the previous scale."""

    def __init__(self, fmt, length: int):
        self.fmt, self.length, self.history, self.scale = fmt, length, [], None

    def step(self, amax: float) -> None:
        if not math.isfinite(amax):
            return
        self.history = ([amax] + self.history)[: self.length]
        if max(self.history) > 0:
            self.scale = max(self.history) / self.fmt.max


def _check_state(layer: Fp8Linear) -> None:
    for name, buf in layer.named_buffers():
        if name.endswith(("_scale", "_scale_amax", "_amax_history")):
            assert torch.isfinite(buf).all(), name
        if name.endswith("_scale"):
            assert (buf > 0).all(), name
        if name.endswith("_amax_history"):
            assert (buf >= 0).all(), name
        if name.endswith("_pending_amax"):
            assert float(buf) == -1.0, name  # consumed by update_fp8_scales


@pytest.mark.parametrize("recipe_name", RECIPES)
@HOSTILE
@given(steps=st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS)), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_fp8_linear_state_stays_sane_under_hostile_inputs_and_gradients(recipe_name, steps, seed):
    overrides = {"amax_history_len": 3} if recipe_name == "delayed" else {}
    if recipe_name == "block":
        overrides = {"input_block": (1, 16), "weight_block": (16, 16), "grad_output_block": (1, 16)}
    r = recipe(recipe_name, **overrides)
    torch.manual_seed(seed)
    layer = Fp8Linear(32, 48, recipe=r)
    refs = {role: DelayedReference(get_format(r.format_of(role)), 3) for role in ("input", "grad_output")}
    expected_counts = {"input": 0, "grad_output": 0}
    layer.telemetry = True  # records the scale each operand was quantized with
    for i, (input_kind, grad_kind) in enumerate(steps):
        x = hostile_tensor(input_kind, (2, 5, 32), seed + i).requires_grad_()
        out = layer(x)
        grad_output = hostile_tensor(grad_kind, out.shape, seed + 100 + i)
        out.backward(grad_output)
        update_fp8_scales(layer)
        expected_counts["input"] += input_kind in NONFINITE_KINDS
        expected_counts["grad_output"] += grad_kind in NONFINITE_KINDS
        if input_kind not in NONFINITE_KINDS:
            assert torch.isfinite(out).all(), (input_kind, "forward output")
            # Finite operands give finite gradients unless a backward GEMM's result times its operand scales can
            # pass the fp32 max: 1e30 inputs times 1e30 gradients (a real overflow), or, with delayed scaling,
            # scales that a 1e30 step left in the history. The bound comes from the reference, not the layer.
            if grad_kind not in NONFINITE_KINDS and not _gradients_may_overflow(r, refs, x, grad_output, layer):
                assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
        for role, tensor in (("input", x), ("grad_output", grad_output)):
            refs[role].step(float(tensor.detach().abs().amax()))
        _check_state(layer)
        layer.weight.grad = None
        if layer.bias is not None:
            layer.bias.grad = None
    for role, count in expected_counts.items():
        assert int(getattr(layer, f"{role}_nonfinite_amax_count")) == count, role
    assert int(layer.weight_nonfinite_amax_count) == 0
    if r.is_delayed:
        for role, ref in refs.items():
            history = getattr(layer, f"{role}_amax_history").tolist()
            assert history[: len(ref.history)] == pytest.approx(ref.history, rel=1e-6)
            assert all(h == 0 for h in history[len(ref.history):])
            assert bool(getattr(layer, f"{role}_initialized")) == (ref.scale is not None)
            if ref.scale is not None:
                assert float(getattr(layer, f"{role}_scale")) == pytest.approx(ref.scale, rel=1e-6)


FP32_MAX = float(torch.finfo(torch.float32).max)


def _scale_upper_bound(tensor: torch.Tensor, fmt, ref: DelayedReference | None) -> float:
    """An upper bound (float64) on every scale this step's operand was quantized with, from the documented rule:
    delayed scaling uses the reference's scale once it has one; otherwise (and for the dynamic recipes) a scale is
    amax / max, at most doubled by pow2 rounding, where any row's or block's amax is at most the tensor's."""
    if ref is not None and ref.scale is not None:
        return ref.scale
    amax = float(tensor.detach().abs().amax())
    return 2 * amax / fmt.max if math.isfinite(amax) and amax > 0 else 1.0


def _gradients_may_overflow(r, refs: dict, x, grad_output, layer: Fp8Linear) -> bool:
    """True when a backward GEMM, |sum| <= (contracted length) * max_a * max_b in FP8 units, can pass the fp32 max
    once its scales are applied one after the other (gemm._apply_outer_scales)."""
    delayed = r.is_delayed
    fmt_x, fmt_w, fmt_dy = (get_format(r.format_of(role)) for role in ("input", "weight", "grad_output"))
    s_x = _scale_upper_bound(x, fmt_x, refs["input"] if delayed else None)
    s_dy = _scale_upper_bound(grad_output, fmt_dy, refs["grad_output"] if delayed else None)
    s_w = _scale_upper_bound(layer.weight, fmt_w, None)
    rows = x.numel() // x.shape[-1]
    grad_weight_bound = rows * fmt_dy.max * fmt_x.max * s_dy           # grad_output.T @ input, M terms
    grad_input_bound = layer.out_features * fmt_dy.max * fmt_w.max * s_dy  # grad_output @ weight, N terms
    return max(grad_weight_bound, grad_weight_bound * s_x, grad_input_bound, grad_input_bound * s_w) > FP32_MAX


def test_scale_product_overflow_keeps_zeros_finite():
    """After one 1e30 step, delayed scaling keeps huge scales for amax_history_len steps: normal tensors underflow
    to zero (expected) but grad_weight = 0 * (input_scale * grad_output_scale) = 0 * inf = NaN (not expected)."""
    torch.manual_seed(0)
    layer = Fp8Linear(32, 48, recipe=recipe("delayed", amax_history_len=3))
    for kind in ("huge", "normal"):
        layer.weight.grad = None  # the huge step's own grad_weight overflows for real (1e30 * 1e30)
        x = hostile_tensor(kind, (2, 5, 32), 0).requires_grad_()
        out = layer(x)
        out.backward(hostile_tensor(kind, out.shape, 1))
        update_fp8_scales(layer)
    assert torch.isfinite(layer.weight.grad).all()  # the normal step: zeros times huge scales stay zeros


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_telemetry_reports_nonfinite_events(recipe_name):
    layer = Fp8Linear(32, 32, recipe=recipe_name)
    layers = [("fc", layer)]
    telemetry.enable(layers, True)
    x = torch.randn(4, 32)
    x[0, 0] = NAN
    (layer(x) ** 2).sum().backward()  # grad_output = 2 * output: its NaN row flows back
    update_fp8_scales(layer)
    stats = telemetry.collect(layers)
    assert stats["fc"]["input"]["nonfinite"] is True and stats["fc"]["weight"]["nonfinite"] is False
    assert telemetry.counters(layers)["fp8/input/nonfinite_amax_events"] == 1
    assert telemetry.counters(layers)["fp8/grad_output/nonfinite_amax_events"] == 1
    assert stats["fc"]["grad_output"]["nonfinite"] is True
    summary = telemetry.summarize(stats)  # NaN statistics must not break the summary
    assert all(isinstance(v, float) for v in summary.values())
    _check_state(layer)


# ------------------------------------------------------------------------------------------------------------
# The loop's guard
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_skip_guard_skips_a_nonfinite_step_counts_and_logs_it(tmp_path, tiny):
    """One NaN in one block's output gradient at step 2 (a tensor hook): the gradients are NaN, the guard skips
    that optimizer step (weights and AdamW state unchanged), the events are counted and reported, the scales stay
    finite, and training goes on."""
    import fp8train.training.loop as train_module

    config = tiny.write(tmp_path, run={"name": "guard"}, train={"max_steps": 4, "eval_every": 0, "eval_batches": 1},
                        optim={"warmup_steps": 1}, log={"telemetry_every": 0},
                        checkpoint={"every": 1, "keep_last": 0})
    from fp8train.training.models.decoder import build_model

    def build_with_nan_gradient(model_cfg):
        model = build_model(model_cfg)
        calls = {"n": 0}

        def poison(grad):
            grad = grad.clone()
            grad.view(-1)[7] = NAN
            return grad

        def hook(module, args, output):
            if module.training:
                calls["n"] += 1
                if calls["n"] == 2:
                    output.register_hook(poison)

        model.layers[1].mlp.register_forward_hook(hook)
        return model

    summary = train_module.train(load_config(str(config)), show_progress=False, model_factory=build_with_nan_gradient)
    assert summary["status"] == "completed" and summary["skipped_steps"] == 1 and summary["steps"] == 4
    run_dir = tmp_path / "runs" / "guard"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    assert [r["skipped_steps"] for r in records] == [0, 1, 1, 1]
    # metrics.jsonl is strict JSON (fp8train.training.storage.files): the skipped step's non-finite norm is null.
    assert records[1]["grad_norm"] is None and all(math.isfinite(r["grad_norm"]) for r in records[2:])
    events = [r["fp8/grad_output/nonfinite_amax_events"] for r in records]
    assert events[0] == 0 and events[1] > 0
    assert events[1] == events[3] == summary["fp8/grad_output/nonfinite_amax_events"]
    assert all(math.isfinite(r["loss"]) for r in records)
    # The skipped step changed no weight and no optimizer state; the FP8 state moved on and stayed finite.
    ckpt = run_dir / "checkpoints"
    weights1, weights2 = (load_file(str(ckpt / f"step_00000{s}" / "model.safetensors")) for s in (1, 2))
    params = [k for k in weights1 if not any(k.endswith(b) for b in ("_count", "_history", "_scale", "_scale_amax",
                                                                      "_pending_amax", "_initialized"))]
    assert params and all(torch.equal(weights1[k], weights2[k]) for k in params)
    opt1, opt2 = (load_file(str(ckpt / f"step_00000{s}" / "optimizer.safetensors")) for s in (1, 2))
    assert all(torch.equal(opt1[k], opt2[k]) for k in opt1)
    final = load_file(str(ckpt / "step_000004" / "model.safetensors"))
    for key, value in final.items():
        if key.endswith(("_scale", "_amax_history", "_scale_amax")):
            assert torch.isfinite(value).all() and (value >= 0).all(), key
    # A run resumed after the skip counts on from where it stopped (the counters ride in the checkpoint).
    shutil.copytree(run_dir, tmp_path / "runs" / "guard2")
    shutil.rmtree(tmp_path / "runs" / "guard2" / "checkpoints" / "step_000004")
    resumed = train_module.train(load_config(str(config), ["run.name=guard2", "train.resume=true"]),
                                 show_progress=False)
    assert resumed["resumed_from"].endswith("step_000003") and resumed["skipped_steps"] == 1
    again = [json.loads(line) for line in (tmp_path / "runs" / "guard2" / "metrics.jsonl").read_text().splitlines()]
    keep = ("step", "loss", "grad_norm", "skipped_steps", "fp8/grad_output/nonfinite_amax_events")
    assert [{k: r[k] for k in keep} for r in again[1:]] == [{k: r[k] for k in keep} for r in records]


# ------------------------------------------------------------------------------------------------------------
# Below fp32's scales, loaded state and layouts that cannot be right: errors, never silent zeros or tracebacks
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt_name", FORMATS)
@pytest.mark.parametrize("tiny_value", [1e-300, 1e-60, 1e-46])
def test_float64_below_every_fp32_scale_is_refused_not_zeroed(fmt_name, tiny_value):
    """The smallest fp32 scale is 2^-126; |x| / 2^-126 below half the format's min subnormal rounds to 0 for
    every value. float64 x of that size is an error (as one beyond the largest fp32 scale is), per group too."""
    fmt = get_format(fmt_name)
    assert tiny_value / 2.0**-126 < fmt.min_subnormal / 2  # the premise, from the documented constants
    x = torch.tensor([tiny_value, -tiny_value / 3], dtype=torch.float64)
    with pytest.raises(ValueError, match="rescale x first"):
        quantize(x, fmt)
    rows = torch.tensor([[1.0, -2.0], [tiny_value, 0.0]], dtype=torch.float64)  # the second row alone is lost
    with pytest.raises(ValueError, match="1 row"):
        quantize(rows, fmt, granularity="row")
    with pytest.raises(ValueError, match="1 block"):
        quantize(rows, fmt, granularity="block", block=(1, 2))


@pytest.mark.parametrize("fmt_name", FORMATS)
def test_float64_small_but_representable_still_quantizes(fmt_name):
    fmt = get_format(fmt_name)
    value = 2.0**-126 * fmt.min_subnormal * 4  # four min subnormals under the smallest scale: exact in FP8
    q = quantize(torch.tensor([value, 0.0], dtype=torch.float64), fmt)
    assert q.dequantize(torch.float64).tolist() == [value, 0.0]
    assert quantize(torch.zeros(3, dtype=torch.float64), fmt).dequantize().abs().sum() == 0  # zeros are fine


@pytest.mark.parametrize("counter", ["input_nonfinite_amax_count", "grad_output_nonfinite_amax_count",
                                     "weight_stale_scale_steps"])
def test_a_negative_loaded_event_counter_is_refused(counter):
    layer = Fp8Linear(16, 16, recipe="delayed")
    state = layer.state_dict()
    state[counter] = torch.tensor(-5, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"{counter}.*count >= 0"):
        Fp8Linear(16, 16, recipe="delayed").load_state_dict(state)


def test_a_wrongly_shaped_scaling_buffer_is_refused_by_name():
    layer = Fp8Linear(16, 16, recipe="delayed")
    state = layer.state_dict()
    state["weight_amax_history"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"weight_amax_history has shape \(7,\).*\(1024,\)"):
        Fp8Linear(16, 16, recipe="delayed").load_state_dict(state)


@pytest.mark.parametrize("block", [(1.5, 4), (2, 4.0), ("2", 4)])
def test_a_fractional_block_is_refused(block):
    with pytest.raises(ValueError, match="block must be two positive ints"):
        quantize(torch.randn(4, 8), "e4m3fn", granularity="block", block=block)


@pytest.mark.parametrize("shape,granularity,block,scale_shape", [
    ((4, 8), "tensor", (1, 128), (3,)), ((4, 8), "row", (1, 128), (3,)), ((4, 8), "row", (1, 128), (1, 8)),
    ((4, 8), "block", (2, 4), (3, 3)), ((300,), "block", (1, 128), (4,)), ((2, 4, 300), "block", (2, 128), (3, 3)),
])
def test_a_wrongly_shaped_scale_is_a_value_error(shape, granularity, block, scale_shape):
    with pytest.raises(ValueError, match=r"scale has shape"):
        quantize(torch.randn(*shape), "e4m3fn", granularity=granularity, block=block, scale=torch.ones(scale_shape))


@pytest.mark.parametrize("shape,block", [((300,), (1, 128)), ((2, 4, 300), (2, 128)), ((3, 5, 7), (128, 128))])
def test_block_quantize_of_1d_and_3d_tensors_meets_the_bound(shape, block):
    """1-D tensors are one row of blocks, 3-D ones tile their last two dims; given the scale back, the result is
    the same bytes (checked against the rounding bound, not against itself)."""
    x = torch.randn(*shape) * 10
    q = quantize(x, "e4m3fn", granularity="block", block=block)
    s = expand_scale(q.scale, x.shape, "block", q.block, -1)
    assert ((q.dequantize() - x).abs() <= x.abs() * 0.0625 + 0.5 * 2.0**-9 * s + 1e-12).all()
    again = quantize(x, "e4m3fn", granularity="block", block=block, scale=q.scale)
    assert torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8))


def test_fp8_linear_on_the_meta_device_says_so():
    layer = Fp8Linear(16, 16, recipe="current", device="meta")
    with pytest.raises(ValueError, match="meta device"):
        layer(torch.randn(2, 16, device="meta"))


def test_a_dangling_link_in_a_data_folder_is_one_line(tmp_path, tiny, commands, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    shutil.copy(tiny.corpus, folder / "a.txt")
    (folder / "b.txt").symlink_to(tmp_path / "gone.txt")
    config = tiny.write(tmp_path, data={"path": str(folder)}, train={"max_steps": 1})
    code, _, err = commands.main(["train", str(config), "--quiet"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "b.txt" in lines[0] and "gone.txt" in lines[0], err
    assert not (tmp_path / "runs").exists()


def test_an_hf_config_with_hidden_size_not_divisible_by_heads_is_one_line(tmp_path, tiny, commands, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "arch").mkdir()
    (tmp_path / "arch" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 66, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 512, "max_position_embeddings": 64}))
    settings = tiny.config(tmp_path, train={"max_steps": 1})
    settings["model"] = {"hf_config": str(tmp_path / "arch"), "seq_len": 32}
    config = tmp_path / "hf.yaml"
    config.write_text(json.dumps(settings))  # JSON is YAML
    code, _, err = commands.main(["train", str(config), "--quiet"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "model.hf_config" in lines[0] and "66" in lines[0], err
