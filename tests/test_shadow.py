"""Recipe shadowing: the recorded SQNR / overflow / underflow equal an independent computation (ml_dtypes casts
with hand-built scales) on the layer's real operands, and training is bit-for-bit unchanged."""

from __future__ import annotations

import copy
import math

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn as nn

from fp8train.nn.linear import Fp8Linear
from fp8train.training.shadow import RecipeShadow

pytestmark = pytest.mark.usefixtures("single_thread")


def _sqnr_rowwise_e4m3_pow2(x: np.ndarray) -> float:
    """Per-row scale 2^ceil(log2(amax / 448)), ml_dtypes E4M3 cast, SQNR over the tensor (float64)."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    scale = np.exp2(np.ceil(np.log2(amax / 448.0)))
    deq = (x / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * scale
    return 10 * math.log10((x.astype(np.float64) ** 2).sum() / ((x - deq) ** 2).sum())


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))


def test_shadow_measures_real_operands_against_reference():
    model = _model()
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    shadow = RecipeShadow(layers, ["rowwise", "current", "mxfp8"])
    x = torch.randn(32, 64)
    captured = {}
    model[2].register_forward_hook(lambda m, i, o: captured.update(input=i[0].detach().clone()))
    out = model(x)
    out.register_hook(lambda g: captured.update(grad=g.detach().clone()))
    shadow.arm()
    out = model(x)
    out.register_hook(lambda g: captured.update(grad=g.detach().clone()))
    out.pow(2).sum().backward()
    records = shadow.collect()
    assert set(records) == {"0", "2"} and set(records["2"]) == {"rowwise", "current", "mxfp8"}
    rowwise = records["2"]["rowwise"]
    assert rowwise["input"]["sqnr_db"] == pytest.approx(_sqnr_rowwise_e4m3_pow2(captured["input"].numpy()),
                                                         rel=1e-9)
    assert rowwise["weight"]["sqnr_db"] == pytest.approx(_sqnr_rowwise_e4m3_pow2(model[2].weight.detach().numpy()),
                                                          rel=1e-9)
    assert rowwise["grad_output"]["sqnr_db"] == pytest.approx(_sqnr_rowwise_e4m3_pow2(captured["grad"].numpy()),
                                                               rel=1e-9)
    assert records["0"]["current"]["input"]["overflow_frac"] == 0.0  # current scaling never clips
    assert shadow.collect() == {}  # disarmed: nothing recorded after the armed step


def test_training_is_unchanged_by_shadowing():
    torch.manual_seed(0)
    plain = Fp8Linear(64, 64, recipe="current")
    shadowed = copy.deepcopy(plain)
    shadow = RecipeShadow([("layer", shadowed)], ["rowwise", "block", "mxfp8"])
    shadow.arm()
    x = torch.randn(16, 64)
    for layer in (plain, shadowed):
        layer(x).sum().backward()
    assert torch.equal(plain.weight.grad, shadowed.weight.grad)
    assert set(shadow.collect()["layer"]["mxfp8"]) == {"input", "weight", "grad_output"}


def test_unknown_or_delayed_shadow_recipe_refused():
    with pytest.raises(ValueError, match="cannot be shadowed"):
        RecipeShadow([], ["delayed"])
