"""The Hopper accumulator model: truncation to a few significant bits, and the error it causes on a long-K GEMM,
measured against an fp64 GEMM of the same exact FP8 operands, with and without promotion to fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8train.nn.accumulation import HopperAccumulation, hopper_accumulated_mm, truncate_significand
from fp8train.nn.gemm import Fp8Operand, fp8_mm
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.recipes import recipe

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("value, bits, expected", [
    (1.0 + 2.0 ** -13, 14, 1.0 + 2.0 ** -13),    # 14 significant bits: 1 + 13 fraction bits survive
    (1.0 + 2.0 ** -14, 14, 1.0),                 # the 15th bit is dropped (truncation, not rounding)
    (-(3.0 - 2.0 ** -20), 14, -(3.0 - 2.0 ** -12)),  # toward zero for negatives too
    (2.0 ** -130, 14, 2.0 ** -130),              # subnormal with a single bit
])
def test_truncate_significand(value, bits, expected):
    assert truncate_significand(torch.tensor([value]), bits).item() == expected


def _long_k_operands(k=8192, m=16, n=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    # positive activations (post-ReLU/SwiGLU-like) make the running sum grow: the case DeepSeek-V3 describes
    a = torch.rand(m, k, generator=g).to(torch.float8_e4m3fn)
    b = (torch.randn(k, n, generator=g) * 0.5 + 0.5).to(torch.float8_e4m3fn)
    return Fp8Operand(a, torch.tensor(1.0)), Fp8Operand(b, torch.tensor(1.0))


def test_promotion_removes_most_of_the_narrow_accumulator_error():
    a, b = _long_k_operands()
    exact = a.data.double() @ b.data.double()  # FP8 values are exact in fp64
    rel = lambda out: float((out.double() - exact).norm() / exact.norm())  # noqa: E731
    fp32 = rel(fp8_mm(a, b, "emulated", compute_dtype=torch.float32))  # pinned: fp32 inputs and accumulator
    never = rel(fp8_mm(a, b, "emulated", accumulation=HopperAccumulation(14, promotion_interval=0)))
    every_128 = rel(fp8_mm(a, b, "emulated", accumulation=HopperAccumulation(14, promotion_interval=128)))
    # 14 bits truncated 256 times over K = 8192: a visible, biased error (~2^-14 per step, growing with K)
    assert never > 1e-3
    assert every_128 < never / 10  # promotion every 128 products removes most of it
    assert fp32 < every_128 / 10   # and fp32 accumulation is far better still
    # truncation only ever moves partial sums toward zero: the narrow result is smaller for positive sums
    positive = exact > 0
    narrow = fp8_mm(a, b, "emulated", accumulation=HopperAccumulation(14, 0)).double()
    assert bool((narrow[positive] <= exact[positive]).all())


def test_full_precision_model_matches_fp32():
    a, b = _long_k_operands(k=512)
    modelled = hopper_accumulated_mm(a.dequantize(), b.dequantize(), HopperAccumulation(24, 0))
    exact = (a.data.double() @ b.data.double())
    np.testing.assert_allclose(modelled.double().numpy(), exact.numpy(), rtol=1e-6)


def test_recipe_option_reaches_the_layer():
    layer = Fp8Linear(256, 64, recipe=recipe("current", accumulator_bits=14, accumulator_promotion=0))
    exact = Fp8Linear(256, 64, recipe="current")
    exact.load_state_dict(layer.state_dict())
    x = torch.rand(32, 256)
    assert "acc14p0" in layer.recipe.code()
    assert not torch.equal(layer(x), exact(x))


@pytest.mark.parametrize("kwargs, match", [(dict(accumulator_bits=1), "accumulator_bits"),
                                           (dict(accumulator_promotion=100), "multiple of 32")])
def test_bad_accumulation_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        recipe("current", **kwargs)
