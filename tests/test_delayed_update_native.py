"""The delayed-scaling update on the CPU runs as one native call over each quantizer's own buffers
(numerics/native_delayed.py, native_cast.c fp8_delayed_update) and as torch ops elsewhere (on a GPU, for grouped
layers, for power-of-two scales, without the C kernel). Both are checked here bit for bit against the documented
step written out in numpy (float64 where the rule divides, fp32 where it stores), on states built to reach every
branch: unrecorded rows, zero amaxes, stale steps, outliers with and without the factor, the cap, the floor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.nn.recipes import ROLES, recipe
from fp8train.numerics import native_cast
from fp8train.numerics.scale_limits import max_scale

F32 = np.float32
AFTER_448 = float(np.nextafter(F32(448), F32(np.inf)))


def reference_step(step, history, scale, scale_amax, initialized, stale, fmt_max, min_normal, margin, algo,
                   factor):
    """One row of the documented update (nn/linear.py's docstring, "Delayed scaling, exactly")."""
    history = list(history)
    recorded = step >= 0
    if recorded and initialized and step > 0 and float(step) < float(scale) * min_normal:
        stale += 1
    if recorded:
        history = [step] + history[:-1]
    if algo == "most_recent":
        amax = history[0]
    else:
        ordered = sorted(history, reverse=True)
        amax = ordered[0]
        if factor and len(history) >= 2 and ordered[1] > 0:
            with np.errstate(over="ignore"):  # (an fp32 product past FLT_MAX is inf, as in torch)
                if ordered[0] > F32(ordered[1]) * F32(factor):
                    amax = ordered[1]
    if recorded and amax > 0:
        s = float(amax) / (fmt_max * 2.0 ** -margin)
        s = min(max(1.0 if s == float("inf") else s, 2.0 ** -126), max_scale(fmt_max, False))
        scale, scale_amax, initialized = F32(s), amax, True
    return history, scale, scale_amax, initialized, stale


def _layers(rng, n, **options):
    torch.manual_seed(0)
    layers = [Fp8Linear(8, 8, recipe=recipe("delayed", **options)) for _ in range(n)]
    h = layers[0].recipe.amax_history_len
    for layer in layers:
        for role in ROLES:
            # (44.8 and 448 or the float after it: a ratio of 10 within an fp32 rounding, where the outlier test
            # `largest > second * 10` is decided)
            history = rng.choice([0.0, 1e-3, 0.5, 3.0, 44.8, 448.0, AFTER_448, 5e4, 3e38], size=h).astype(F32)
            history[rng.random(h) < 0.3] = 0
            getattr(layer, f"{role}_amax_history").copy_(torch.from_numpy(history))
            getattr(layer, f"{role}_scale").fill_(float(rng.choice([1e-30, 0.01, 1.0, 3.5, 2e35])))
            getattr(layer, f"{role}_scale_amax").fill_(float(rng.choice([0.0, 1.0, 448.0])))
            getattr(layer, f"{role}_initialized").fill_(bool(rng.random() < 0.7))
            getattr(layer, f"{role}_stale_scale_steps").fill_(int(rng.integers(0, 5)))
            # -1: nothing recorded this step; 0; amaxes below the smallest normal under a scale of 1 (stale);
            # ordinary ones; one whose scale is below the fp32 floor; one past what an fp32 scale holds (the cap)
            pending = rng.choice([-1.0, 0.0, 1e-38, 1e-9, 1e-5, 2.0, 448.0, 1e4, 3.4e38])
            getattr(layer, f"{role}_pending_amax").fill_(float(pending))
    if h >= 3:  # the outlier test's edge, for certain: largest == second * 10 in fp32 (not an outlier), and above
        for layer, largest in zip(layers, (448.0, AFTER_448)):
            layer.input_amax_history.zero_()[:2] = torch.tensor([44.8, largest])
            layer.input_pending_amax.fill_(0.5)  # (recorded: the scale then shows which amax was taken)
    return layers


def _state(layers):
    return {(i, role, name): getattr(layer, f"{role}_{name}").clone()
            for i, layer in enumerate(layers) for role in ROLES
            for name in ("amax_history", "scale", "scale_amax", "initialized", "stale_scale_steps", "pending_amax")}


def _check_against_reference(layers, before):
    """Each layer's state after one update equals reference_step on its state `before` (_state), bit for bit."""
    r = layers[0].recipe
    for i, layer in enumerate(layers):
        for role in ROLES:
            fmt = layer.quantizers[role].format
            old = {name: before[(i, role, name)] for name in
                   ("amax_history", "scale", "scale_amax", "initialized", "stale_scale_steps", "pending_amax")}
            history, scale, scale_amax, initialized, stale = reference_step(
                F32(old["pending_amax"].item()), old["amax_history"].numpy(), F32(old["scale"].item()),
                F32(old["scale_amax"].item()), bool(old["initialized"].item()), int(old["stale_scale_steps"].item()),
                fmt.max, fmt.min_normal, r.margin, r.amax_compute_algo, r.amax_outlier_factor)
            got = {name: getattr(layer, f"{role}_{name}") for name in old}
            assert np.array_equal(got["amax_history"].numpy(), np.array(history, dtype=F32)), (i, role)
            assert got["scale"].numpy().view(np.uint32) == np.array(scale, F32).view(np.uint32), (i, role)
            assert got["scale_amax"].item() == scale_amax and got["initialized"].item() == initialized
            assert got["stale_scale_steps"].item() == stale and got["pending_amax"].item() == -1.0


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("options", [dict(amax_history_len=16),
                                     dict(amax_compute_algo="most_recent", amax_history_len=4),
                                     dict(amax_outlier_factor=10.0, amax_history_len=8),
                                     dict(margin=2, amax_history_len=2), dict(amax_history_len=1)])
def test_the_update_is_the_documented_step_on_either_path(native, options, monkeypatch):
    if native and not native_cast.available():
        pytest.skip("fp8train's C kernel is not built here (no C compiler)")
    monkeypatch.setattr(native_cast, "_enabled", native)  # (set_enabled would count as a process-wide switch)
    rng = np.random.default_rng(7)
    for _ in range(5):
        layers = _layers(rng, 3, **options)
        before = _state(layers)
        update_fp8_scales(torch.nn.ModuleList(layers))
        _check_against_reference(layers, before)


@pytest.mark.skipif(not native_cast.available(), reason="fp8train's C kernel is not built here (no C compiler)")
def test_the_kept_pointer_arrays_follow_buffers_that_are_replaced():
    """The native update keeps its pointer arrays from step to step (native_delayed.UpdatePlan, on the group's
    first quantizer) while every buffer is the same tensor at the same address. Buffers replaced by
    load_state_dict(assign=True), by assignment or by an in-place set_ are then read and written where they are
    now, the documented step each time, and the tensors they replaced are left as they were."""
    rng = np.random.default_rng(11)
    layers = _layers(rng, 2, amax_history_len=4)
    model = torch.nn.ModuleList(layers)
    first = layers[0].quantizers[ROLES[0]]
    replacements = {
        "none": lambda: None,
        "assign": lambda: model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True),
        "setattr": lambda: setattr(layers[1], "grad_output_scale", layers[1].grad_output_scale.clone()),
        "set_": lambda: layers[0].input_amax_history.set_(layers[0].input_amax_history.clone()),
    }
    plans = []
    for name, replace in [("none", None), *replacements.items(), ("none again", None)]:
        for layer in layers:  # a recorded amax for every row (the update sets them back to -1)
            for role in ROLES:
                getattr(layer, f"{role}_pending_amax").fill_(float(rng.choice([0.0, 1e-5, 2.0, 448.0, 1e4])))
        held = dict(model.state_dict(keep_vars=True))
        held_values = {k: v.clone() for k, v in held.items()}
        if replace is not None:
            replace()
        before = _state(layers)
        update_fp8_scales(model)
        _check_against_reference(layers, before)
        now = dict(model.state_dict(keep_vars=True))
        for key, tensor in held.items():
            if now[key] is not tensor:  # replaced: left as it was
                assert torch.equal(tensor, held_values[key]), (name, key)
        plans.append(first.kept_update_plan)
    # kept where nothing was replaced (steps 1-2 and the last two), made anew after each replacement
    assert plans[0] is plans[1] and plans[-1] is plans[-2]
    assert len({id(p) for p in plans[1:-1]}) == len(plans) - 2


def test_a_scale_saved_for_backward_then_updated_is_an_error_not_a_silent_change():
    """The native update writes the buffers in place behind autograd: it moves their version counters as torch's
    in-place ops do, so a backward that reads a scale the update changed after the forward saved it fails."""
    layer = Fp8Linear(16, 16, recipe="delayed")
    for _ in range(2):
        layer(torch.randn(4, 16)).sum().backward()
        update_fp8_scales(layer)
    y = layer(torch.randn(4, 16, requires_grad=True) * 100)
    update_fp8_scales(layer)  # (a misuse: between this forward and its backward)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
