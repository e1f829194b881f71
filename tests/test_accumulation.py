"""The Hopper accumulator model: truncation to a few significant bits, and the error it causes on a long-K GEMM,
measured against an fp64 GEMM of the same exact FP8 operands, with and without promotion to fp32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8train.nn.accumulation import (HopperAccumulation, accumulation_error_bound, hopper_accumulated_mm,
                                      truncate_significand)
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


# ------------------------------------------------------------------------------------------------------------
# Exact partial sums against a float64 reference written from the module docstring's rule
# ------------------------------------------------------------------------------------------------------------
def _truncate_ref(x: float, bits: int) -> float:
    """x truncated toward zero to `bits` significant bits, in float64 (frexp: x = m * 2**e, 0.5 <= |m| < 1)."""
    m, e = np.frexp(x)
    return float(np.ldexp(np.trunc(np.ldexp(m, bits)), e - bits))


def _hopper_ref(a: np.ndarray, b: np.ndarray, bits: int, promotion: int, mma_k: int) -> np.ndarray:
    """The documented rule, one output element at a time in float64: groups of `mma_k` products summed exactly,
    each group added into a narrow accumulator truncated to `bits` bits, which is added into the total and
    cleared every `promotion` products (0: never); the total plus what is left in the accumulator at the end."""
    out = np.zeros((a.shape[0], b.shape[1]))
    k = a.shape[1]
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            total = narrow = 0.0
            since = 0
            for start in range(0, k, mma_k):
                group = sum(a[i, t] * b[t, j] for t in range(start, min(start + mma_k, k)))
                narrow = _truncate_ref(narrow + group, bits)
                since += min(start + mma_k, k) - start
                if promotion and since >= promotion:
                    total, narrow, since = total + narrow, 0.0, 0
            out[i, j] = total + narrow
    return out


@pytest.mark.parametrize("promotion, expected", [(0, 16.0), (1, 22.0), (2, 20.0), (4, 20.0), (8, 16.0)])
def test_promotion_interval_by_hand(promotion, expected):
    """Products 1, 1, 1, 8, 1, 1, 1, 8 (one per MMA, mma_k=1) in a 3-bit accumulator: 1, 2, 3, then 3 + 8 = 11
    = 0b1011 truncates to 0b1010 = 10. Promoting every 4 products adds 10 twice: 20. Never (or every 8): 10 + 1
    truncates back to 10 three times, then 10 + 8 = 18 = 0b10010 truncates to 16. Every 2: (1+1) + (1+8 -> 8)
    twice = 20. Every product: nothing is ever truncated, the exact 22."""
    a = torch.ones(1, 8)
    b = torch.tensor([1.0, 1, 1, 8, 1, 1, 1, 8]).reshape(8, 1)
    out = hopper_accumulated_mm(a, b, HopperAccumulation(3, promotion_interval=promotion, mma_k=1))
    assert out.item() == expected


@pytest.mark.parametrize("k", [256, 200])  # 200: a last MMA group of 8 products
@pytest.mark.parametrize("promotion", [0, 32, 64, 96, 128])
def test_partial_sums_are_exactly_the_documented_rule(k, promotion, rng):
    """E4M3 operands in [1, 2) (8 values) and (-2, -1] x [1, 2): every product has 7 significant bits at 2**-6,
    a 32-product group sum stays within 14 bits and the running sums within fp32's 24, so the modelled fp32
    arithmetic is exact and must equal the float64 reference bit for bit. 8 accumulator bits make the
    truncation bite at every step, so each promotion interval gives other sums."""
    mantissas = 1.0 + np.arange(8) / 8.0  # the E4M3 values in [1, 2)
    a = rng.choice(mantissas, size=(3, k)) * rng.choice([1.0, -1.0], size=(3, k), p=[0.8, 0.2])
    b = rng.choice(mantissas, size=(k, 2))
    acc = HopperAccumulation(8, promotion_interval=promotion)
    out = hopper_accumulated_mm(torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.float32), acc)
    expected = _hopper_ref(a, b, 8, promotion, 32)
    assert np.array_equal(out.double().numpy(), expected)
    if promotion:  # the interval matters: one group more or fewer per promotion gives other sums
        for other in {0, 32, 64, 96, 128} - {promotion}:
            assert not np.array_equal(expected, _hopper_ref(a, b, 8, other, 32)), other


@pytest.mark.parametrize("promotion", [0, 32, 128])
def test_the_layers_forward_accumulates_as_its_recipe_says(promotion, rng):
    """The recipe's accumulator_bits and accumulator_promotion both reach the layer's output GEMM. Inputs and
    weights are E4M3 values in [1, 2) and power-of-two scales, so quantizing them is exact and the output must
    equal the float64 reference of the documented rule bit for bit (8 bits: every promotion interval differs)."""
    mantissas = 1.0 + np.arange(8) / 8.0
    x = rng.choice(mantissas, size=(3, 256)) * rng.choice([1.0, -1.0], size=(3, 256), p=[0.8, 0.2])
    w = rng.choice(mantissas, size=(16, 256))
    layer = Fp8Linear(256, 16, bias=False, recipe=recipe("current", pow2_scales=True, accumulator_bits=8,
                                                         accumulator_promotion=promotion))
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(w))
        out = layer(torch.tensor(x, dtype=torch.float32))
    assert np.array_equal(out.double().numpy(), _hopper_ref(x, w.T, 8, promotion, 32))


@pytest.mark.parametrize("promotion", [128, 0], ids=["promoted", "fast-accum"])
@pytest.mark.parametrize("k", [512, 4096])
def test_accumulation_bound_holds_for_the_model_and_fails_for_a_narrower_one(promotion, k):
    """The bound test_cuda holds the GPU to: the 14-bit model (truncating, the worst direction) stays inside it
    element by element against an fp64 GEMM of the same FP8 values; a 10-bit accumulator does not, so the bound
    is tight enough to catch an accumulator narrower than the one it was derived for."""
    a, b = _long_k_operands(k=k, m=32, n=32)
    a_hp, b_hp = a.data.float(), b.data.float()
    exact = a_hp.double() @ b_hp.double()
    acc = HopperAccumulation(accumulator_bits=14, promotion_interval=promotion)
    bound = accumulation_error_bound(a_hp, b_hp, acc)
    err = (hopper_accumulated_mm(a_hp, b_hp, acc).double() - exact).abs()
    assert bool((err <= bound).all()) and float(err.max()) > 0
    narrow = HopperAccumulation(accumulator_bits=10, promotion_interval=promotion)
    assert bool((hopper_accumulated_mm(a_hp, b_hp, narrow).double() - exact).abs().gt(bound).any())
    bf16 = accumulation_error_bound(a_hp, b_hp, acc, torch.bfloat16)
    assert torch.allclose(bf16 - bound, (a_hp.double().abs() @ b_hp.double().abs()) * 2.0 ** -7)
