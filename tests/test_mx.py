"""MXFP8: E8M0 scales and E4M3 elements against an independent reference (numpy float64 + ml_dtypes casts, scales
built by hand from the OCP MX v1.0 rule), the recipe's operand axes, and a trained mxfp8 layer."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.nn.linear import Fp8Linear
from fp8train.numerics.mx import e8m0_codes, mx_scale_from_amax, quantize_mx

pytestmark = pytest.mark.usefixtures("single_thread")

EMAX = {"e4m3fn": 8, "e5m2": 15}  # exponent of 448 = 1.75 * 2^8 and 57344 = 1.75 * 2^15
ML = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
MAX = {"e4m3fn": 448.0, "e5m2": 57344.0}


def reference_mx(x: np.ndarray, fmt: str):
    """(element bytes, E8M0 bytes, fp64 dequantized) per the OCP MX rule, one 32-block of a row at a time."""
    rows, cols = x.shape
    codes = np.zeros((rows, cols), np.uint8)
    scale_bytes = np.zeros((rows, -(-cols // 32)), np.uint8)
    deq = np.zeros((rows, cols))
    for r in range(rows):
        for c0 in range(0, cols, 32):
            block = x[r, c0:c0 + 32].astype(np.float64)
            amax = np.abs(block).max()
            if amax > 0 and np.isfinite(amax):
                shared = math.floor(math.log2(amax)) - EMAX[fmt]      # exact: amax is an fp32 value
                shared = min(max(shared, -127), 127)
            else:
                shared = 0                                              # fp8train: scale 1 for amax 0/NaN/inf
            scale = 2.0 ** shared
            scale_bytes[r, c0 // 32] = np.array(scale, dtype=ml_dtypes.float8_e8m0fnu).view(np.uint8)
            elems = np.clip(block / scale, -MAX[fmt], MAX[fmt]).astype(ML[fmt])   # RNE, clamped
            codes[r, c0:c0 + 32] = elems.view(np.uint8)
            deq[r, c0:c0 + 32] = elems.astype(np.float64) * scale
    return codes, scale_bytes, deq


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("kind", ["gaussian", "wide", "ragged", "zeros_and_tiny"])
def test_quantize_mx_bit_exact_against_reference(fmt, kind, rng):
    if kind == "gaussian":
        x = rng.standard_normal((8, 128))
    elif kind == "wide":  # blocks 2^-100 .. 2^100 apart, and values on binade edges and ties
        x = rng.standard_normal((8, 64)) * np.exp2(rng.integers(-100, 100, (8, 1)))
        x[0, :4] = [448.0, 464.0, 480.0, 2.0 ** 9]
    elif kind == "ragged":
        x = rng.standard_normal((5, 80)) * 3
    else:
        x = rng.standard_normal((4, 64)) * 2.0 ** -140  # below 2^-127 * min subnormal: shared exp clamps
        x[1] = 0.0
    x = x.astype(np.float32)
    q = quantize_mx(torch.from_numpy(x), fmt)
    codes, scale_bytes, deq = reference_mx(x, fmt)
    np.testing.assert_array_equal(q.data.view(torch.uint8).numpy(), codes)
    np.testing.assert_array_equal(e8m0_codes(q.scale).numpy(), scale_bytes)
    np.testing.assert_array_equal(q.dequantize().double().numpy(), deq)


def test_e8m0_scale_rule_hand_values():
    amax = torch.tensor([448.0, 511.0, 512.0, 1.0, 0.0, float("nan"), 2.0 ** -130, 3.0e38])
    got = mx_scale_from_amax(amax, "e4m3fn")
    want = [2.0 ** 0, 2.0 ** 0, 2.0 ** 1, 2.0 ** -8, 1.0, 1.0, 2.0 ** -127, 2.0 ** (127 - 8)]
    assert got.tolist() == want
    assert e8m0_codes(got).tolist() == [127, 127, 128, 119, 127, 127, 0, 246]


def test_mxfp8_layer_uses_blocks_along_each_gemms_contracted_dim(rng):
    """Forward, grad_input and grad_weight against fp64 GEMMs of reference-MX operands blocked along K, N, M."""
    m, k, n = 64, 96, 128
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    dy = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
    layer = Fp8Linear(k, n, bias=False, recipe="mxfp8")
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
    x_t = torch.from_numpy(x).requires_grad_(True)
    y = layer(x_t)
    y.backward(torch.from_numpy(dy))
    mx = lambda a: reference_mx(a, "e4m3fn")[2]  # noqa: E731  blocks of 32 along the last dim
    expected = {
        "output": mx(x) @ mx(w).T,                 # contracted K: x and w blocked along K
        "grad_input": mx(dy) @ mx(w.T).T,          # contracted N: w blocked along N
        "grad_weight": mx(dy.T) @ mx(x.T).T,       # contracted M: dy and x blocked along M
    }
    got = {"output": y.detach(), "grad_input": x_t.grad, "grad_weight": layer.weight.grad}
    for gemm, want in expected.items():
        err = np.abs(got[gemm].double().numpy() - want).max()
        assert err <= 1e-5 * np.abs(want).max(), gemm  # exact operands; fp32 accumulation order only
    assert layer.gemm_paths == {g: "emulated" for g in expected}
