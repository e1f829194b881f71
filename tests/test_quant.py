"""Quantization at every granularity, checked against an independent numpy + ml_dtypes reference.

The reference (``ref_quantize`` below) is written from the documented convention only:
    amax per tensor / row / block (numpy), scale = amax / max * 2**margin in float64 then rounded once to float32,
    pow2 rounds that scale UP to a power of two, amax 0 or non-finite gives scale 1, scales are kept inside the
    normal float32 range [2^-126, float32 max] (so x / scale stays finite), then x / scale in float32, clip to
    +-max when saturating, and ml_dtypes' round-to-nearest-even cast.
Nothing here compares fp8train against its own output, except the compile test (compiled vs eager, and both vs
the reference).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fp8train.numerics.quant as fp8quant
from fp8train.numerics.formats import FORMATS
from fp8train.numerics.scaling import amax_of
from fp8train.numerics.quant import (
    Fp8Tensor,
    compute_amax,
    decode_fp8,
    expand_scale,
    quant_error,
    quantize,
    scale_from_amax,
)

from refs import ALL_FORMATS, ML_DTYPES, TORCH_DTYPES  # noqa: E402
FP32_TINY = float(np.finfo(np.float32).tiny)
FP32_MAX = float(np.finfo(np.float32).max)

# (granularity, block, axis) layouts every quantize test runs over.
LAYOUTS = [
    pytest.param("tensor", (1, 128), -1, id="tensor"),
    pytest.param("row", (1, 128), -1, id="row-1"),
    pytest.param("row", (1, 128), 0, id="row0"),
    pytest.param("block", (1, 128), -1, id="block1x128"),
    pytest.param("block", (128, 128), -1, id="block128x128"),
    pytest.param("block", (3, 5), -1, id="block3x5"),
]
pytestmark = pytest.mark.usefixtures("single_thread")

SHAPES = [pytest.param((300,), id="1d"), pytest.param((130, 257), id="2d"), pytest.param((3, 40, 50), id="3d")]


# Two implementations of the cast: torch's own float8 cast ("torch_cast": kernels eager and compiled, the same
# function; the compile test below covers the compiled graphs) and fp8train's C kernel ("native": the default
# kernel of quantize and decode_fp8 becomes native, so every case below also checks it; a case it does not take
# runs eagerly, as quantize documents).
KERNEL_PATHS = ["torch_cast", "native"]


def _default_kernel(fn, kernel: str, positional_index: int | None):
    """`fn` with `kernel` as its default kernel (a wrapper, not a patched __defaults__: that also works when `fn`
    is itself a wrapper, as under a mutation tool)."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        if positional_index is None or len(args) <= positional_index:
            kwargs.setdefault("kernel", kernel)
        return fn(*args, **kwargs)
    return call


@contextlib.contextmanager
def kernel_path(path: str):
    with pytest.MonkeyPatch.context() as mp:
        if path == "native":
            replaced = {name: _default_kernel(getattr(fp8quant, name), "native", index)
                        for name, index in (("quantize", None), ("decode_fp8", 2))}
            for module in list(sys.modules.values()):  # every module that bound these functions by name
                for name, wrapper in replaced.items():
                    if getattr(module, name, None) is wrapper.__wrapped__:
                        mp.setattr(module, name, wrapper)
        yield


@pytest.fixture(params=KERNEL_PATHS)
def kernel(request):
    with kernel_path(request.param):
        yield request.param


def fmt_max(name: str) -> float:
    return float(ml_dtypes.finfo(ML_DTYPES[name]).max)


# ------------------------------------------------------------------------------------------------------------
# The numpy + ml_dtypes reference
# ------------------------------------------------------------------------------------------------------------
def _blocks(a: np.ndarray, br: int, bc: int) -> np.ndarray:
    """(*lead, R, C) -> (*lead, Rb, br, Cb, bc), zero-padded; a 1-D array is one row."""
    if a.ndim == 1:
        a = a[None, :]
    rows, cols = a.shape[-2:]
    pad = [(0, 0)] * (a.ndim - 2) + [(0, -rows % br), (0, -cols % bc)]
    a = np.pad(a, pad)
    return a.reshape(*a.shape[:-2], a.shape[-2] // br, br, a.shape[-1] // bc, bc)


def ref_amax(x: np.ndarray, granularity: str, block=(1, 128), axis: int = -1) -> np.ndarray:
    ax = np.abs(x)
    if granularity == "tensor":
        return np.max(ax).astype(np.float32)  # np.max propagates NaN
    if granularity == "row":
        return np.max(ax, axis=axis, keepdims=True).astype(np.float32)
    return np.max(_blocks(ax, *block), axis=(-3, -1)).astype(np.float32)


def ref_scale(amax: np.ndarray, name: str, margin: int = 0, pow2: bool = False) -> np.ndarray:
    """The documented rule, element by element in Python float64 (exact for these operands: amax is float32 and
    max * 2**margin a small integer times a power of two): scale = amax / max * 2**margin, rounded once to
    float32; pow2 takes the smallest power of two >= that quotient (found with frexp, exactly); an amax that is 0,
    NaN or inf gives 1; the result is kept inside [2^-126, the cap of ref_max_scale]."""
    amax = np.asarray(amax, dtype=np.float32)
    out = np.empty(amax.shape, dtype=np.float32)
    for index, value in np.ndenumerate(amax):
        value = float(value)
        if not (math.isfinite(value) and value > 0):
            out[index] = 1.0
            continue
        quotient = value / fmt_max(name) * 2.0**margin
        if pow2:
            mantissa, exponent = math.frexp(quotient)  # quotient = mantissa * 2**exponent, 0.5 <= mantissa < 1
            quotient = math.ldexp(1.0, exponent - 1 if mantissa == 0.5 else exponent)
        out[index] = min(max(quotient, FP32_TINY), ref_max_scale(name, pow2))  # float64 -> float32: one rounding
    return out


def ref_max_scale(name: str, pow2: bool) -> float:
    """The documented cap: the largest float32 scale whose product with the format's max is finite in float32
    (a power of two with pow2), so no saturated value dequantizes to inf."""
    cap = np.float32(FP32_MAX / fmt_max(name))
    while np.float64(cap) * fmt_max(name) > FP32_MAX:
        cap = np.nextafter(cap, np.float32(0))
    return float(2.0 ** np.floor(np.log2(np.float64(cap)))) if pow2 else float(cap)


def ref_expand(scale: np.ndarray, shape, granularity: str, block=(1, 128)) -> np.ndarray:
    scale = np.asarray(scale, dtype=np.float32)
    if granularity != "block":
        return np.broadcast_to(scale, shape)
    br, bc = block
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape[-2:]
    full = np.repeat(np.repeat(scale, br, axis=-2), bc, axis=-1)[..., :rows, :cols]
    return full.reshape(shape)


def ref_quantize(x: np.ndarray, name: str, granularity="tensor", block=(1, 128), axis=-1, margin=0, pow2=False,
                 saturate=True, scale=None):
    """(uint8 codes, float32 scale) by the documented recipe."""
    x = np.asarray(x, dtype=np.float32)
    if scale is None:
        scale = ref_scale(ref_amax(x, granularity, block, axis), name, margin, pow2)
    scale = np.asarray(scale, dtype=np.float32)
    with np.errstate(all="ignore"):
        y = x / ref_expand(scale, x.shape, granularity, block)  # float32 / float32, like the kernel
    if saturate:
        y = np.clip(y, -fmt_max(name), fmt_max(name))  # NaN passes through; +-inf becomes +-max
    return y.astype(ML_DTYPES[name]).view(np.uint8), scale


def ml_decode(codes: np.ndarray, name: str) -> np.ndarray:
    return np.asarray(codes, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float32)


def codes_of(q: Fp8Tensor) -> np.ndarray:
    return q.data.view(torch.uint8).numpy()


def assert_codes_equal(actual: np.ndarray, expected: np.ndarray, name: str):
    """Byte equality, except that any NaN pattern matches any other (NaN payloads are not canonical)."""
    assert actual.shape == expected.shape
    nan_a, nan_e = np.isnan(ml_decode(actual, name)), np.isnan(ml_decode(expected, name))
    np.testing.assert_array_equal(nan_a, nan_e, err_msg=f"{name}: NaN positions differ")
    mismatch = (actual != expected) & ~nan_e
    if mismatch.any():
        idx = np.argwhere(mismatch)[:5]
        detail = [(tuple(i), hex(actual[tuple(i)]), hex(expected[tuple(i)])) for i in idx]
        raise AssertionError(f"{name}: {int(mismatch.sum())} codes differ, e.g. {detail}")


def wide_random(rng: np.random.Generator, shape, lo=-12, hi=12) -> np.ndarray:
    """float32 values with random signs, mantissas and exponents in [2^lo, 2^hi), plus some exact zeros."""
    n = int(np.prod(shape))
    values = rng.choice([-1.0, 1.0], n) * rng.uniform(1.0, 2.0, n) * np.exp2(rng.integers(lo, hi, n))
    values[rng.random(n) < 0.02] = 0.0
    return values.reshape(shape).astype(np.float32)


def check_against_reference(x: np.ndarray, name: str, **kwargs):
    q = quantize(torch.from_numpy(x), name, **kwargs)
    expected_codes, expected_scale = ref_quantize(x, name, **kwargs)
    assert q.data.dtype == TORCH_DTYPES[name]
    assert q.data.shape == x.shape
    assert_codes_equal(codes_of(q), expected_codes, name)
    assert q.scale.dtype == torch.float32
    np.testing.assert_array_equal(q.scale.numpy(), expected_scale)  # exact, shape included
    return q, expected_codes, expected_scale


# ------------------------------------------------------------------------------------------------------------
# Bytes and scales against the reference
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("granularity,block,axis", LAYOUTS)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_quantize_matches_reference(name, granularity, block, axis, shape, saturate, rng, kernel):
    x = wide_random(rng, shape)
    q, codes, scale = check_against_reference(x, name, granularity=granularity, block=block, axis=axis,
                                              saturate=saturate)
    # dequantize is data * scale: ml_dtypes-decoded bytes times the broadcast scale, in float32.
    expected = ml_decode(codes, name) * ref_expand(scale, x.shape, granularity, block)
    np.testing.assert_array_equal(q.dequantize().numpy(), expected)
    # float64 callers get the exact product (<= 4 significant bits times 24), not a float32-rounded one.
    full_scale = ref_expand(scale, x.shape, granularity, block).astype(np.float64)
    exact = ml_decode(codes, name).astype(np.float64) * full_scale
    deq64 = q.dequantize(torch.float64)
    assert deq64.dtype == torch.float64
    np.testing.assert_array_equal(deq64.numpy(), exact)
    assert torch.equal(q.dequantize(torch.bfloat16), torch.from_numpy(expected).bfloat16())
    # The scale is shaped per the contract.
    if granularity == "tensor":
        assert q.scale.shape == ()
    elif granularity == "row":
        assert q.scale.shape == tuple(1 if d == axis % len(shape) else s for d, s in enumerate(shape))
    else:
        rows, cols = (1, shape[0]) if len(shape) == 1 else shape[-2:]
        lead = shape[:-2]
        assert q.scale.shape == (*lead, -(-rows // block[0]), -(-cols // block[1]))


@pytest.mark.parametrize("margin,pow2", [(-1, False), (2, False), (0, True), (1, True), (-2, True)])
@pytest.mark.parametrize("granularity,block,axis", LAYOUTS)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_margin_and_pow2_match_reference(name, granularity, block, axis, margin, pow2, rng, kernel):
    # margin < 0 makes values overflow: clipped when saturating, inf/NaN when not. Check both.
    x = wide_random(rng, (37, 70), -6, 6)
    for saturate in (True, False):
        check_against_reference(x, name, granularity=granularity, block=block, axis=axis, margin=margin,
                                pow2=pow2, saturate=saturate)


@pytest.mark.parametrize("granularity,block,axis", LAYOUTS)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_pow2_scales_are_powers_of_two_and_never_clip(name, granularity, block, axis, rng):
    x = rng.standard_normal((64, 300)).astype(np.float32) * np.float32(37.0)
    q = quantize(torch.from_numpy(x), name, granularity=granularity, block=block, axis=axis, pow2=True,
                 saturate=False)
    scale = q.scale.numpy().astype(np.float64)
    mantissa, _ = np.frexp(scale)
    assert np.all(mantissa == 0.5), "pow2 scales must be exact powers of two"
    exact = ref_scale(ref_amax(x, granularity, block, axis), name).astype(np.float64)
    assert np.all(scale >= exact) and np.all(scale < 2 * exact)  # rounded UP, by less than 2x
    amax = ref_amax(x, granularity, block, axis).astype(np.float64)
    assert np.all(amax / scale <= fmt_max(name))
    # Nothing clipped: non-saturating output has no inf/NaN for finite input.
    assert torch.isfinite(q.dequantize()).all()


# Hand-computed scales: (format, amax, margin, pow2, scale). max is 448 / 57344 / 240 / 57344.
HAND_SCALES = [
    ("e4m3fn", 448.0, 0, False, 1.0),
    ("e4m3fn", 896.0, 0, False, 2.0),
    ("e4m3fn", 1344.0, -1, False, 1.5),            # 1344 / 448 = 3, times 2^-1
    ("e4m3fn", 112.0, 2, False, 1.0),              # 112 / 448 = 1/4, times 2^2
    ("e4m3fn", 300.0, 0, False, 0.6696428571428571),  # 300 / 448, rounded once to float32 below
    ("e4m3fn", 300.0, 0, True, 1.0),               # 0.6696 rounded up to a power of two
    ("e4m3fn", 448.0, 0, True, 1.0),               # already a power of two: not doubled
    ("e4m3fn", 449.0, 0, True, 2.0),
    ("e4m3fn", 1.0, 0, True, 2.0**-8),             # 1 / 448 = 2^-8.81 -> 2^-8
    ("e4m3fn", 1.0, 1, True, 2.0**-7),
    ("e5m2", 57344.0, 0, False, 1.0),
    ("e5m2", 3.0, 0, True, 2.0**-14),              # 3 / 57344 = 2^-14.2 -> 2^-14
    ("e5m2", 7.0, 3, False, 2.0**-10),             # 7 / (7 * 2^13) * 2^3
    ("e4m3fnuz", 240.0, 0, False, 1.0),
    ("e4m3fnuz", 60.0, 0, False, 0.25),
    ("e4m3fnuz", 61.0, 0, True, 0.5),
    ("e5m2fnuz", 57344.0 * 4, -2, False, 1.0),
    ("e4m3fn", 0.0, 0, False, 1.0),                # amax 0 never becomes a scale
    ("e4m3fn", math.inf, 0, True, 1.0),
    ("e5m2", math.nan, 1, False, 1.0),
    ("e4m3fn", 1e-40, 0, False, 2.0**-126),        # 1e-40 / 448 is below float32's normal range: clamped
    # 3e38 / 448 * 2^20 = 7e41 is past float32's max: clamped to the cap FLT_MAX / 448 (in float32, 448 times it
    # is still <= FLT_MAX: float32(FLT_MAX / 448) = 7.5955880e35, and 448 * that = FLT_MAX exactly in float64)
    ("e4m3fn", 3.0e38, 20, False, FP32_MAX / 448),
    ("e4m3fn", 3.0e38, 20, True, 2.0**119),        # pow2 cap: the largest power of two <= FLT_MAX / 448
    # 7168 + 2^-11 (fp32 0x45E00001) / 448 = 16 + 2^-20 / 7: just above 16, so pow2 rounds up to 32 (an fp32
    # quotient 16.000002 has log2 4 + 1.7e-7, which fp32 rounds down onto 4: scale 16 would clip amax)
    ("e4m3fn", 7168.0 + 2.0**-11, 0, True, 32.0),
]


@pytest.mark.parametrize("name,amax,margin,pow2,expected", HAND_SCALES)
def test_scale_from_amax_hand_computed(name, amax, margin, pow2, expected):
    got = scale_from_amax(torch.tensor(amax), name, margin, pow2)
    assert got.dtype == torch.float32 and got.item() == float(np.float32(expected))
    assert ref_scale(np.float32(amax), name, margin, pow2).item() == got.item()  # the reference agrees


@pytest.mark.parametrize("granularity,block,axis", LAYOUTS)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_margin_shifts_scale_by_power_of_two(name, granularity, block, axis):
    """Rows (and 1x128 tiles) whose amax is max * k for k = 1, 3, 5, 6: scale = k * 2**margin, exactly."""
    ks = np.array([1.0, 3.0, 5.0, 6.0], dtype=np.float32)
    x = np.zeros((4, 256), dtype=np.float32)
    x[:, 7] = ks * np.float32(fmt_max(name))       # each row's amax: max * k
    x[:, 200] = -ks * np.float32(fmt_max(name) / 2)  # second 1x128 tile of each row: max * k / 2
    if axis == 0:
        x = np.ascontiguousarray(x.T)  # per-column scales of the transposed tensor: the same amaxes
    for margin in (-3, -1, 0, 1, 4):
        scale = quantize(torch.from_numpy(x), name, granularity=granularity, block=block, axis=axis,
                         margin=margin).scale.numpy().astype(np.float64).ravel()
        if granularity == "tensor":
            expected = [6 * 2.0**margin]
        elif granularity == "row":
            expected = list(ks * 2.0**margin)
        elif block == (128, 128):  # one row of two tiles: amax 6 * max, then 6 * max / 2
            expected = [6 * 2.0**margin, 3 * 2.0**margin]
        elif block == (1, 128):
            expected = [v for k in ks for v in (k * 2.0**margin, k / 2 * 2.0**margin)]
        else:
            expected = None  # 3x5 tiles: covered against the reference above
        if expected is not None:
            assert scale.tolist() == expected, margin


@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_explicit_scale_is_honored(name, saturate, rng, kernel):
    x = wide_random(rng, (6, 256), -8, 10)
    # tensor: a Python float and a 0-d tensor; row and block: explicit per-row / per-block tensors.
    for scale in (0.75, torch.tensor(3.0)):
        q, _, _ = check_against_reference(x, name, scale=scale, saturate=saturate)
        assert q.amax is None
    row_scale = rng.uniform(0.1, 10.0, (6, 1)).astype(np.float32)
    q, _, _ = check_against_reference(x, name, granularity="row", scale=torch.from_numpy(row_scale),
                                      saturate=saturate)
    assert np.array_equal(q.scale.numpy(), row_scale)
    block_scale = rng.uniform(0.1, 10.0, (2, 4)).astype(np.float32)
    check_against_reference(x, name, granularity="block", block=(3, 64), scale=torch.from_numpy(block_scale),
                            saturate=saturate)
    # quantize with a given scale: the bytes of x / scale
    data = quantize(torch.from_numpy(x), name, granularity="row", scale=torch.from_numpy(row_scale),
                    saturate=saturate).data
    codes, _ = ref_quantize(x, name, granularity="row", scale=row_scale, saturate=saturate)
    assert data.dtype == TORCH_DTYPES[name]
    assert_codes_equal(data.view(torch.uint8).numpy(), codes, name)


@pytest.mark.parametrize("granularity,block,axis", LAYOUTS)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_keep_values_are_the_fp8_values(name, granularity, block, axis, rng, kernel):
    x = wide_random(rng, (5, 33, 140), -8, 8)
    x[0, 0, 0], x[1, 2, 3], x[4, 32, 139] = np.nan, np.inf, -np.inf
    q = quantize(torch.from_numpy(x), name, granularity=granularity, block=block, axis=axis, saturate=False,
                 keep_values=True)
    codes, _ = ref_quantize(x, name, granularity=granularity, block=block, axis=axis, saturate=False)
    assert q.values is not None and q.values.dtype == torch.float32 and q.values.shape == x.shape
    np.testing.assert_array_equal(q.values.numpy(), ml_decode(codes, name))  # NaN == NaN here
    np.testing.assert_array_equal(q.unscaled().numpy(), ml_decode(codes, name))


@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_ties_between_adjacent_codes_round_to_even(name, saturate, kernel):
    """Every midpoint between two adjacent finite FP8 values (exact in float32), and its float32 neighbours,
    through the quantizer with power-of-two scales (so x / scale is still exactly the tie)."""
    values = ml_decode(np.arange(256), name).astype(np.float64)
    grid = np.unique(values[np.isfinite(values) & (values >= 0)])
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)
    y = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    y = np.concatenate([y, -y])
    for scale in (1.0, 2.0**-12, 2.0**9):
        check_against_reference(y * np.float32(scale), name, scale=scale, saturate=saturate)


def test_amax_and_scale_helpers_match_reference(rng):
    x = wide_random(rng, (2, 33, 70))
    xt = torch.from_numpy(x)
    for granularity, block, axis in [("tensor", (1, 128), -1), ("row", (1, 128), 1), ("block", (4, 32), -1)]:
        amax = compute_amax(xt, granularity, block, axis)
        np.testing.assert_array_equal(amax.numpy(), ref_amax(x, granularity, block, axis))
        for name in ALL_FORMATS:
            for margin, pow2 in [(0, False), (1, True)]:
                np.testing.assert_array_equal(scale_from_amax(amax, name, margin, pow2).numpy(),
                                              ref_scale(amax.numpy(), name, margin, pow2))
        full = expand_scale(amax, x.shape, granularity, block, axis)
        np.testing.assert_array_equal(np.broadcast_to(full.numpy(), x.shape),
                                      ref_expand(amax.numpy(), x.shape, granularity, block))


def test_scale_from_amax_special_amax():
    """amax 0 or non-finite never becomes a scale: 1.0 instead (and never 0, inf or NaN)."""
    amax = torch.tensor([0.0, math.nan, math.inf, -math.inf, 448.0])
    assert scale_from_amax(amax, "e4m3fn").tolist() == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert scale_from_amax(amax, "e4m3fn", margin=3, pow2=True).tolist() == [1.0, 1.0, 1.0, 1.0, 8.0]


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------
X = torch.ones(4, 8)


@pytest.mark.parametrize("call,match", [
    (lambda: quantize(X, "e4m3x"), "format"),
    (lambda: quantize(X, "E5M2"), "format"),
    (lambda: quantize(torch.ones(4, 8, dtype=torch.int32), "e4m3fn"), "x must be"),
    (lambda: quantize(torch.ones(4, 8, dtype=torch.int64), "e4m3fn"), "x must be"),
    (lambda: quantize(torch.ones(4, 8, dtype=torch.bool), "e4m3fn"), "x must be"),
    (lambda: quantize(X.to(torch.float8_e4m3fn), "e4m3fn"), "x must be"),
    (lambda: quantize(X.to(torch.float8_e5m2), "e5m2"), "x must be"),
    (lambda: quantize(np.ones((4, 8), np.float32), "e4m3fn"), "x must be a torch.Tensor"),
    (lambda: quantize(X, "e4m3fn", scale=0.0), "scale"),
    (lambda: quantize(X, "e4m3fn", scale=-1.0), "scale"),
    (lambda: quantize(X, "e4m3fn", scale=math.nan), "scale"),
    (lambda: quantize(X, "e4m3fn", scale=math.inf), "scale"),
    (lambda: quantize(X, "e4m3fn", granularity="row", scale=torch.tensor([[1.0], [1.0], [0.0], [1.0]])),
     "scale"),
    (lambda: quantize(X, "e4m3fn", granularity="block", block=(0, 128)), "block"),
    (lambda: quantize(X, "e4m3fn", granularity="block", block=(1, -128)), "block"),
    (lambda: quantize(X, "e4m3fn", granularity="block", block=(1, 2, 3)), "block"),
    (lambda: quantize(X, "e4m3fn", granularity="block", block="128"), "block"),
    (lambda: quantize(X, "e4m3fn", granularity="col"), "granularity"),
    (lambda: quantize(X, "e4m3fn", granularity="channel"), "granularity"),
    (lambda: quantize(X, "e4m3fn", granularity="row", axis=2), "axis"),
    (lambda: quantize(X, "e4m3fn", granularity="row", axis=-3), "axis"),
    (lambda: compute_amax(X, "rows"), "granularity"),
    (lambda: compute_amax(torch.ones(3, dtype=torch.int8)), "x must be"),
    (lambda: scale_from_amax(torch.tensor(1.0), "fp8"), "format"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------------------------------
# Special values
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("granularity,block,axis", LAYOUTS)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_all_zero_tensor_gives_scale_one_and_zeros(name, granularity, block, axis, kernel):
    x = torch.zeros(5, 130)
    q = quantize(x, name, granularity=granularity, block=block, axis=axis)
    assert torch.all(q.scale == 1.0)
    assert torch.all(q.data.view(torch.uint8) == 0)
    assert torch.equal(q.dequantize(), x)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_zero_rows_and_blocks_get_scale_one(name, rng, kernel):
    x = rng.standard_normal((6, 20)).astype(np.float32)
    x[2] = 0.0
    x[:, 10:15] = 0.0
    q, _, _ = check_against_reference(x, name, granularity="row")
    assert q.scale[2, 0] == 1.0 and bool((q.scale[[0, 1, 3, 4, 5]] != 1.0).all())
    q, _, _ = check_against_reference(x, name, granularity="block", block=(2, 5))
    assert torch.all(q.scale[:, 2] == 1.0)


@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("granularity,block,axis", LAYOUTS)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_nan_input_stays_nan_and_never_makes_a_bad_scale(name, granularity, block, axis, saturate, rng, kernel):
    """Documented rule (quant.py, scale_from_amax): amax propagates NaN, and a non-finite amax gives scale 1.0.
    So a tensorwise NaN makes the whole tensor use scale 1; row/block NaNs only affect their own row/block."""
    x = wide_random(rng, (9, 140), -3, 3)
    x[4, 7] = np.nan
    x[0, 0] = -np.nan
    q, _, _ = check_against_reference(x, name, granularity=granularity, block=block, axis=axis, saturate=saturate)
    scale = q.scale
    assert torch.isfinite(scale).all() and (scale > 0).all()
    if granularity == "tensor":
        assert scale.item() == 1.0
    values = decode_fp8(q.data, name)
    assert torch.equal(torch.isnan(values), torch.from_numpy(np.isnan(x)))


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_inf_input(name, kernel):
    fmt = FORMATS[name]
    x = torch.tensor([math.inf, -math.inf, 1.0, -2.0, 0.5])
    # Saturating: +-inf clips to +-max (data-derived scale: the amax is inf, so the scale is 1).
    q = quantize(x, name)
    assert q.scale.item() == 1.0
    assert q.dequantize().tolist() == [fmt.max, -fmt.max, 1.0, -2.0, 0.5]
    q = quantize(x, name, scale=0.5)
    assert q.dequantize().tolist() == [fmt.max * 0.5, -fmt.max * 0.5, 1.0, -2.0, 0.5]
    # Non-saturating: inf where the format has one (sign kept), NaN otherwise.
    out = quantize(x, name, saturate=False).dequantize()
    if fmt.has_inf:
        assert out[:2].tolist() == [math.inf, -math.inf]
    else:
        assert torch.isnan(out[:2]).all()
    assert out[2:].tolist() == [1.0, -2.0, 0.5]
    for saturate in (True, False):
        check_against_reference(x.numpy(), name, saturate=saturate)
        check_against_reference(x.numpy(), name, saturate=saturate, scale=0.25)


@pytest.mark.parametrize("saturate", [True, False], ids=["sat", "nosat"])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_overflow_boundary_with_explicit_scale(name, saturate, kernel):
    """Values around max and the tie at max + half the top step (e4m3fn: 464 rounds to even 448; the others'
    tie rounds up past max), times a scale, against ml_dtypes."""
    fmt_top = fmt_max(name)
    top_step = 2.0 ** (math.floor(math.log2(fmt_top)) - FORMATS[name].mantissa_bits)
    y = np.array([fmt_top, fmt_top + top_step / 4, fmt_top + top_step / 2, fmt_top + top_step, 2 * fmt_top,
                  np.nextafter(np.float32(fmt_top + top_step / 2), np.float32(0))], dtype=np.float32)
    y = np.concatenate([y, -y])
    for scale in (1.0, 0.5, 4.0):
        check_against_reference(y * np.float32(scale), name, scale=scale, saturate=saturate)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_subnormal_inputs(name, rng, kernel):
    fmt = FORMATS[name]
    # Every multiple of a quarter of the smallest subnormal up to twice min normal (ties included), both signs.
    k = np.arange(0, 4 * 2 * 2**fmt.mantissa_bits + 1)
    y = (k * fmt.min_subnormal / 4).astype(np.float32)
    y = np.concatenate([y, -y, rng.uniform(-fmt.min_normal, fmt.min_normal, 500).astype(np.float32)])
    for saturate in (True, False):
        check_against_reference(y, name, scale=1.0, saturate=saturate)
        check_against_reference(y * np.float32(2.0**-20), name, scale=2.0**-20, saturate=saturate)
    # float32 subnormal inputs: underflow to (signed, where the format has -0) zero with scale 1.
    tiny = np.array([1e-45, -1e-45, 1e-40, -3e-39], dtype=np.float32)
    check_against_reference(tiny, name, scale=1.0)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_tiny_amax_gives_usable_scale(name, kernel):
    """An amax in float32's subnormal range still gives a finite scale > 0, nothing clips, values survive."""
    x = np.array([1e-40, -3e-41, 0.0, 7e-42], dtype=np.float32)
    q, _, _ = check_against_reference(x, name)
    assert torch.isfinite(q.scale) and q.scale > 0
    assert np.all(np.abs(x) / q.scale.item() <= fmt_max(name))


# ------------------------------------------------------------------------------------------------------------
# Error statistics
# ------------------------------------------------------------------------------------------------------------
def test_quant_error_on_hand_built_tensor():
    """e4m3fn with an explicit scale of 2: clipping starts past (448 + 32 / 2) * 2 = 928, and a value flushes to
    zero below half the smallest subnormal times the scale, 2^-10 * 2 = 2^-9."""
    x = np.array([
        1000.0, -2000.0, 5.0e4,                    # 3 clipped (> 928)
        900.0, -920.0, 896.0,                      # large but not clipped
        1.0e-3, -5.0e-4, 1.0e-6, 0.0019,           # 4 flushed to zero (< 2^-9 ~= 0.00195)
        0.0,                                       # an exact zero is not an underflow
        0.0021, 1.0, -3.3, 17.0, 0.25, 100.0, -0.7, 2.5, 64.1,
    ], dtype=np.float32)
    n = x.size
    q = quantize(torch.from_numpy(x), "e4m3fn", scale=2.0)
    stats = quant_error(torch.from_numpy(x), q)
    assert stats["overflow_frac"] == 3 / n
    assert stats["underflow_frac"] == 4 / n
    # rel_l2 and SQNR in float64 from the ml_dtypes reference dequantization.
    deq = np.clip(x / np.float32(2.0), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0
    err = x.astype(np.float64) - deq
    signal, noise = np.sum(x.astype(np.float64) ** 2), np.sum(err**2)
    assert stats["rel_l2"] == pytest.approx(math.sqrt(noise / signal), rel=1e-9)
    assert stats["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), rel=1e-9)


def test_quant_error_exact_and_nonfinite():
    x = torch.tensor([1.0, -2.0, 0.5, 0.0, 448.0])
    stats = quant_error(x, quantize(x, "e4m3fn", scale=1.0))
    assert stats["rel_l2"] == 0.0 and stats["sqnr_db"] == math.inf
    assert stats["overflow_frac"] == 0.0 and stats["underflow_frac"] == 0.0
    x = torch.tensor([1.0, math.nan, math.inf, 3.0])
    stats = quant_error(x, quantize(x, "e5m2"))
    assert stats["nonfinite_frac"] == 0.5
    assert math.isfinite(stats["rel_l2"])


@pytest.mark.parametrize("axis", [-1, 0])
def test_float64_row_floor_is_checked_on_whole_rows(axis):
    """The float64 floor check (|x| below what the smallest fp32 scale can hold) takes each row's amax over the
    whole row, not over 128-wide pieces of it: a row of 300 whose tail is 1e-300 quantizes (the tail to 0,
    within the error bound), and of two rows only the one that is tiny throughout is reported."""
    row = torch.full((300,), 1e-300, dtype=torch.float64)
    row[:10] = 448.0  # e4m3fn max: the scale is exactly 1
    tiny = torch.full((300,), 1e-300, dtype=torch.float64)
    one_row = row[None, :] if axis == -1 else row[:, None]
    q = quantize(one_row, "e4m3fn", granularity="row", axis=axis)
    assert q.dequantize(torch.float64).flatten().tolist() == [448.0] * 10 + [0.0] * 290
    two_rows = torch.stack([row, tiny]) if axis == -1 else torch.stack([row, tiny], dim=1)
    with pytest.raises(ValueError, match=r"^1 row\(s\) of x \(float64\)"):
        quantize(two_rows, "e4m3fn", granularity="row", axis=axis)


@pytest.mark.parametrize("name", ["e4m3fn", "e5m2"])
def test_quant_error_small_and_zero_signal(name):
    """A signal and a noise far below 1 (sums of squares ~0.14 and ~1e-5) still get their real rel_l2 and SQNR
    (float64 from the ml_dtypes dequantization); an all-zero tensor has rel_l2 0 and SQNR inf, not a 0/0."""
    x = np.array([0.1, -0.3, 0.2, 0.013, -0.0071], dtype=np.float32)
    stats = quant_error(torch.from_numpy(x), quantize(torch.from_numpy(x), name, scale=1.0))
    deq = x.astype(ML_DTYPES[name]).astype(np.float64)
    signal, noise = np.sum(x.astype(np.float64) ** 2), np.sum((x.astype(np.float64) - deq) ** 2)
    assert 0 < noise < signal < 1
    assert stats["rel_l2"] == pytest.approx(math.sqrt(noise / signal), rel=1e-9)
    assert stats["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), rel=1e-9)
    zeros = torch.zeros(4)
    stats = quant_error(zeros, quantize(zeros, name))
    assert stats["rel_l2"] == 0.0 and stats["sqnr_db"] == math.inf and stats["underflow_frac"] == 0.0


@pytest.mark.parametrize("narrow,wide", [("e4m3fn", "e5m2"), ("e4m3fnuz", "e5m2fnuz")])
def test_precision_versus_range(narrow, wide, rng):
    """Issue 2's illustration. Gaussian values with one outlier, tensor-scaled so the outlier lands on each
    format's max: the bulk sits in the normal range of both formats, so the error is the rounding error, which is
    proportional to the step. E5M2 has one mantissa bit fewer, so its step and its RMS error are 2x E4M3's.
    With a far larger outlier the bulk drops below E4M3's smallest subnormal while E5M2's extra exponent bit
    (~14 more binades) still holds it: range beats precision there."""
    x = rng.standard_normal(8192).astype(np.float32)
    x[123] = 50.0

    def rel_l2(name):
        deq = quantize(torch.from_numpy(x), name).dequantize().numpy().astype(np.float64)
        # Cross-check the dequantization with the reference before using it.
        codes, scale = ref_quantize(x, name)
        np.testing.assert_array_equal(deq, (ml_decode(codes, name) * scale).astype(np.float64))
        return float(np.sqrt(np.sum((deq - x) ** 2) / np.sum(x.astype(np.float64) ** 2)))

    ratio = rel_l2(wide) / rel_l2(narrow)
    assert 1.6 < ratio < 2.6, ratio
    # Range: an outlier 2^20 times the bulk.
    x[123] = 2.0**20
    tn = quant_error(torch.from_numpy(x), quantize(torch.from_numpy(x), narrow))
    tw = quant_error(torch.from_numpy(x), quantize(torch.from_numpy(x), wide))
    assert tn["underflow_frac"] > 0.5 and tw["underflow_frac"] < 0.01


# ------------------------------------------------------------------------------------------------------------
# decode_fp8 against torch's own cast
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_decode_fp8_matches_torch_cast_for_all_codes(name, kernel):
    data = torch.arange(256, dtype=torch.uint8).view(TORCH_DTYPES[name])
    with kernel_path("torch_cast"):
        expected = data.float()  # torch's float8 -> float32 conversion
    for got in (decode_fp8(data, name), decode_fp8(data)):  # explicit format, and inferred from the dtype
        assert got.dtype == torch.float32
        assert torch.equal(torch.isnan(got), torch.isnan(expected))
        ok = ~torch.isnan(expected)
        assert torch.equal(got[ok], expected[ok])
        assert torch.equal(torch.signbit(got[ok]), torch.signbit(expected[ok]))  # -0 stays -0
    np.testing.assert_array_equal(decode_fp8(data.reshape(16, 16), name).numpy().ravel(),
                                  ml_decode(np.arange(256), name))


# ------------------------------------------------------------------------------------------------------------
# torch.compile gives the eager bits (the one compile test: two compiles)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.compiled
def test_compiled_quantize_is_bit_identical_to_eager(rng):
    """Compiled (torch's cast, fused by inductor; tensorwise, block tiles, and a given scale with the amax taken
    in the same graph) against eager, for a ragged shape:
    300 columns are 2 full 1x128 blocks and a partial one. This caught an inductor miscompile that left the
    partial block unwritten when the crop back to x's shape was inside the compiled region."""
    x_np = wide_random(rng, (96, 300), -10, 10)
    x_np[5, 5], x_np[7, 9], x_np[8, 1] = np.nan, np.inf, -np.inf
    x = torch.from_numpy(x_np)
    configs = [dict(granularity="tensor", kernel="compiled"),
               dict(granularity="block", block=(1, 128), kernel="compiled")]
    name = "e4m3fn"
    compiled_out = [quantize(x, name, saturate=False, **kw) for kw in configs]
    eager_out = [quantize(x, name, saturate=False, **{**kw, "kernel": "eager"}) for kw in configs]
    for kw, qc, qe in zip(configs, compiled_out, eager_out):
        assert torch.equal(qc.data.view(torch.uint8), qe.data.view(torch.uint8)), kw
        assert torch.equal(qc.scale, qe.scale), kw
        codes, scale = ref_quantize(x_np, name, saturate=False, **{k: v for k, v in kw.items() if k != "kernel"})
        assert_codes_equal(codes_of(qc), codes, name)
        np.testing.assert_array_equal(qc.scale.numpy(), scale)
    given = quantize(x, name, scale=torch.tensor(0.03), with_amax=True, kernel="compiled", saturate=False)
    codes, _ = ref_quantize(x_np, name, saturate=False, scale=0.03)
    assert_codes_equal(codes_of(given), codes, name)
    assert torch.isnan(given.amax)  # x holds a NaN: the amax propagates it


# ------------------------------------------------------------------------------------------------------------
# Properties (hypothesis)
# ------------------------------------------------------------------------------------------------------------
SPECIALS = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-45, -1e-40, 3.0e38, -3.0e38, 448.0, 57344.0, 240.0]
finite_or_special = st.one_of(
    st.floats(width=32, allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e3, max_value=1e3, width=32),
    st.sampled_from(SPECIALS),
)


@st.composite
def quantize_cases(draw):
    name = draw(st.sampled_from(ALL_FORMATS))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=12))
    x = draw(hnp.arrays(np.float32, shape, elements=finite_or_special))
    granularity = draw(st.sampled_from(["tensor", "row", "block"]))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    block = (draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    kwargs = dict(granularity=granularity, block=block, axis=axis, margin=draw(st.integers(-1, 1)),
                  pow2=draw(st.booleans()), saturate=draw(st.booleans()))
    return name, x, kwargs


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(quantize_cases())
def test_property_quantize(case):
    name, x, kwargs = case
    fmt = FORMATS[name]
    codes, ref_s = ref_quantize(x, name, **kwargs)
    for path in KERNEL_PATHS:
        with kernel_path(path):
            q = quantize(torch.from_numpy(x), name, **kwargs)
            dequantized = q.dequantize().numpy()
        assert q.data.shape == x.shape
        scale = q.scale.numpy()
        assert np.all(np.isfinite(scale)) and np.all(scale > 0)
        # Against the reference, bytes and scales; dequantize is the float32 product data * scale.
        assert_codes_equal(codes_of(q), codes, name)
        np.testing.assert_array_equal(scale, ref_s)
        full = ref_expand(scale, x.shape, kwargs["granularity"], kwargs["block"])
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal(dequantized, ml_decode(codes_of(q), name) * full)
    # Error bounds from the format alone: in the normal range, within half a step (relative); below it, within
    # half a subnormal spacing (absolute, times the scale). Small slack for the float32 division. In float64,
    # because a value near float32 max can legitimately round up to a grid point whose product with the scale
    # is past float32 max (e.g. 3.2965e38 with a pow2 scale 2^120 -> 256 * 2^120 = 2^128).
    full = full.astype(np.float64)
    xd = x.astype(np.float64)
    with np.errstate(all="ignore"):
        y = np.abs(xd / full)
        err = np.abs(ml_decode(codes, name).astype(np.float64) * full - xd)
    finite = np.isfinite(xd)
    normal = finite & (y >= fmt.min_normal) & (y <= fmt.max)
    assert np.all(err[normal] <= (fmt.max_rel_error + 2.0**-20) * np.abs(xd[normal]))
    sub = finite & (y < fmt.min_normal)
    assert np.all(err[sub] <= (fmt.min_subnormal / 2 + 2.0**-20 * fmt.min_normal) * full[sub])
    assert np.all(np.isnan(dequantized[np.isnan(x)]))


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(ALL_FORMATS),
       hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=2, max_side=16), elements=finite_or_special))
def test_property_scales_always_usable(name, x):
    with kernel_path("torch_cast"):  # the scale does not depend on the cast path
        _check_scales_usable(name, x)


def _check_scales_usable(name, x):
    """Whatever the values (all NaN, all inf, all zero, float32 extremes), every scale is finite and > 0."""
    for granularity in ("tensor", "row", "block"):
        for pow2 in (False, True):
            q = quantize(torch.from_numpy(x), name, granularity=granularity, block=(2, 3), pow2=pow2)
            assert torch.isfinite(q.scale).all() and (q.scale > 0).all()
            assert q.data.shape == x.shape


# ------------------------------------------------------------------------------------------------------------
# Edge cases (issue 13.11): correct results or clear ValueErrors
# ------------------------------------------------------------------------------------------------------------
def test_float64_beyond_fp32_range_is_refused_not_silently_448():
    x = torch.tensor([1e300, -3.0, 2.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="beyond what an fp32"):
        quantize(x, "e4m3fn")


@pytest.mark.parametrize("big", [1e39, 3.5e38])
def test_float64_past_flt_max_is_refused(big):
    """Dequantized values are fp32: a float64 amax past FLT_MAX cannot come back, whatever the scale."""
    with pytest.raises(ValueError, match="beyond what an fp32"):
        quantize(torch.tensor([big, 1.0], dtype=torch.float64), "e5m2")


def test_float64_within_fp32_range_follows_the_rule():
    x_np = np.array([3.0e38, -1.0 - 2.0 ** -40, 5e-30, 0.0], dtype=np.float64)
    q = quantize(torch.from_numpy(x_np), "e4m3fn")
    scale = np.float32(np.float64(np.float32(3.0e38)) / 448.0)  # amax (fp32), float64 division, one rounding
    y = (x_np / np.float64(scale)).astype(np.float32)           # x / scale in float64, then fp32
    codes = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(codes_of(q), codes.view(np.uint8))
    assert q.scale.item() == scale and torch.isfinite(q.dequantize()).all()


@pytest.mark.parametrize("name", ALL_FORMATS)
@pytest.mark.parametrize("pow2", [False, True])
def test_flt_max_dequantizes_finite(name, pow2):
    x = torch.tensor([FP32_MAX, -FP32_MAX, 1.0])
    q = quantize(x, name, pow2=pow2)
    deq = q.dequantize()
    assert torch.isfinite(deq).all(), deq
    assert q.scale.item() == np.float32(ref_max_scale(name, pow2))  # the cap, not FLT_MAX / max rounded up
    assert deq[0].item() == fmt_max(name) * q.scale.item()  # clipped to max, at the largest finite multiple


@pytest.mark.parametrize("granularity, block, axis", [("tensor", (1, 128), -1), ("row", (1, 128), -1),
                                                      ("row", (1, 128), 0), ("block", (2, 3), -1)])
@pytest.mark.parametrize("shape", [(0,), (0, 5), (4, 0)])
def test_empty_tensor(granularity, block, axis, shape):
    x = torch.empty(shape)
    q = quantize(x, "e4m3fn", granularity=granularity, block=block, axis=axis, keep_values=True)
    assert q.data.shape == x.shape and q.data.dtype == torch.float8_e4m3fn and q.values.shape == x.shape
    assert (q.scale == 1).all() and q.dequantize().shape == x.shape
    expected_scale = {"tensor": (), "row": tuple(1 if d == axis % len(shape) else n for d, n in enumerate(shape))}
    if granularity in expected_scale:
        assert tuple(q.scale.shape) == expected_scale[granularity]
    assert compute_amax(x, granularity, block, axis).shape == q.scale.shape


def test_a_float64_scale_is_rounded_to_fp32_once():
    """A given float64 scale (tensor or numpy) is stored as its nearest fp32 and the bytes are what that fp32
    scale gives (1/3 is not an fp32 number, so a float64 scale kept as is would divide differently)."""
    x = np.array([1.0, -2.5, 0.3, 100.0, 7.77], dtype=np.float32)
    scale32 = np.float32(1.0 / 3.0)
    expected = (x / scale32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    for scale in (torch.tensor(1.0 / 3.0, dtype=torch.float64), np.float64(1.0 / 3.0)):
        q = quantize(torch.from_numpy(x), "e4m3fn", scale=scale)
        assert q.scale.dtype == torch.float32 and q.scale.item() == scale32
        np.testing.assert_array_equal(q.data.view(torch.uint8).numpy(), expected)


def test_empty_tensor_scale_is_on_the_tensors_device():
    """The scale of an empty tensor is made on x's device (the meta device stands in for an accelerator)."""
    q = quantize(torch.empty((0, 4), device="meta"), "e4m3fn")
    assert q.data.device.type == "meta" and q.scale.device.type == "meta"


def test_zero_dim_tensor():
    x = torch.tensor(-300.0)
    q = quantize(x, "e4m3fn")
    assert q.data.shape == () and q.scale.item() == np.float32(300.0 / 448.0)
    assert q.dequantize().item() == pytest.approx(-300.0, rel=2 ** -4)
    for granularity in ("row", "block"):
        with pytest.raises(ValueError, match="0-d tensor"):
            quantize(x, "e4m3fn", granularity=granularity)


@pytest.mark.parametrize("margin", [1.5, "1", None, True, 1000])
def test_bad_margin_is_refused(margin):
    with pytest.raises(ValueError, match="margin"):
        quantize(torch.ones(4), "e4m3fn", margin=margin)
    with pytest.raises(ValueError, match="margin"):
        scale_from_amax(torch.tensor(2.0), "e4m3fn", margin=margin)


def test_integral_float_margin_is_that_int():
    x = torch.randn(64)
    assert torch.equal(quantize(x, margin=2.0).scale, quantize(x, margin=2).scale)


def test_block_larger_than_tensor_is_one_block():
    """A huge block once tried to pad the tensor to its size (terabytes); it is one block over the tensor."""
    x = torch.randn(3, 5) * 7
    q = quantize(x, "e4m3fn", granularity="block", block=(10 ** 6, 10 ** 6), pow2=True)
    codes, scale = ref_quantize(x.numpy(), "e4m3fn", pow2=True)  # one scale for the whole tensor
    np.testing.assert_array_equal(codes_of(q), codes)
    assert q.scale.shape == (1, 1) and q.scale.item() == scale
    assert torch.equal(q.dequantize(), quantize(x, "e4m3fn", pow2=True).dequantize())


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel must be one of"):
        quantize(torch.ones(4), kernel="fast")


def test_block_larger_than_a_1d_tensor_is_one_block_of_one_row():
    """A 1-D tensor is one row: a (4, 1000) block over 10 elements is recorded as (1, 10), one scale."""
    x = torch.arange(1.0, 11.0)
    q = quantize(x, "e4m3fn", granularity="block", block=(4, 1000))
    assert q.block == (1, 10)
    assert q.scale.shape == (1, 1) and q.scale.item() == np.float32(10.0 / 448.0)


def test_a_given_scale_that_broadcasts_to_the_scale_shape_is_taken():
    """One value for all rows ((1, 1) for (4, 1)) or all blocks (() for (2, 2)) broadcasts, so it is accepted
    (blocks get it expanded); a (4,) scale for (4, 1) rows would broadcast to (4, 4) and is refused."""
    x = torch.arange(-12.0, 12.0).reshape(4, 6)
    expected = (x.numpy() / np.float32(2.0)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    q = quantize(x, "e4m3fn", granularity="row", scale=torch.tensor([[2.0]]))
    np.testing.assert_array_equal(codes_of(q), expected)
    q = quantize(x, "e4m3fn", granularity="block", block=(2, 3), scale=torch.tensor(2.0))
    np.testing.assert_array_equal(codes_of(q), expected)
    assert q.scale.tolist() == [[2.0, 2.0], [2.0, 2.0]]
    with pytest.raises(ValueError, match=r"^scale has shape \(4,\); granularity='row' on x of shape \(4, 6\) "
                                         r"needs \(4, 1\)$"):
        quantize(x, "e4m3fn", granularity="row", scale=torch.full((4,), 2.0))


def test_a_given_tensor_or_row_scale_keeps_its_own_shape():
    """Only block scales are expanded: a (1,) per-tensor scale and a (1, 1) scale for (4, 1) rows stay as given,
    and the codes are x / 2 in e4m3fn (ml_dtypes)."""
    x = torch.arange(-12.0, 12.0).reshape(4, 6)
    expected = (x.numpy() / np.float32(2.0)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    q = quantize(x, "e4m3fn", scale=torch.tensor([2.0]))
    np.testing.assert_array_equal(codes_of(q), expected)
    assert q.scale.shape == (1,) and q.scale.tolist() == [2.0]
    q = quantize(x, "e4m3fn", granularity="row", scale=torch.tensor([[2.0]]))
    np.testing.assert_array_equal(codes_of(q), expected)
    assert q.scale.shape == (1, 1) and q.scale.tolist() == [[2.0]]


def test_float64_zeros_pass_the_floor_check():
    """An amax of 0 is no lost value: an all-zero float64 tensor quantizes to zero codes with scale 1, and a zero
    row beside the row [1, -2] does too (that row: scale 2/448, codes 224 -> 0x76 and -448 -> 0xFE)."""
    q = quantize(torch.zeros(3, dtype=torch.float64), "e4m3fn")
    assert codes_of(q).tolist() == [0, 0, 0] and q.scale.item() == 1.0
    q = quantize(torch.tensor([[0.0, 0.0], [1.0, -2.0]], dtype=torch.float64), "e4m3fn", granularity="row")
    assert codes_of(q).tolist() == [[0, 0], [0x76, 0xFE]]
    assert q.scale.flatten().tolist() == [1.0, float(np.float32(2.0 / 448.0))]


def test_a_given_block_scale_grid_divides_each_block():
    """A (2, 2) grid of scales for (2, 3) blocks of a (4, 6) tensor: each block divided by its own scale."""
    x = torch.linspace(-20.0, 20.0, 24).reshape(4, 6)
    scale = torch.tensor([[1.0, 2.0], [4.0, 8.0]])
    full = np.repeat(np.repeat(scale.numpy(), 2, axis=0), 3, axis=1)
    expected = (x.numpy() / full).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    data = quantize(x, "e4m3fn", granularity="block", block=(2, 3), scale=scale).data
    np.testing.assert_array_equal(data.view(torch.uint8).numpy(), expected)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_decode_fp8_of_raw_uint8_codes_with_a_format(name):
    """Raw bytes (uint8) with an explicit format decode to that format's values (ml_dtypes), eagerly."""
    codes = torch.arange(256, dtype=torch.uint8)
    got = decode_fp8(codes, name, kernel="eager")
    expected = ml_decode(np.arange(256), name)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)
    finite = ~np.isnan(expected)
    assert np.array_equal(np.signbit(got.numpy())[finite], np.signbit(expected)[finite])


def test_without_values_keeps_everything_but_the_value_copies():
    x = torch.tensor([[1.0, -3.0], [2.0, 0.5]])
    q = quantize(x, "e5m2", granularity="row", axis=0, pow2=True, keep_values=(torch.float32, torch.bfloat16),
                 keep_dequantized=True)
    assert q.values is not None and q.values_bf16 is not None and q.dequantized is not None
    w = q.without_values()
    assert w.fmt is FORMATS["e5m2"]
    assert w.data is q.data and w.scale is q.scale and w.amax is q.amax
    assert (w.granularity, w.block, w.axis) == ("row", (1, 128), 0)
    assert w.values is None and w.values_bf16 is None and w.dequantized is None
    # power-of-two scales (amax 2 and 3 / 57344, rounded up: 2^-14 both): x / scale is 16384, -49152, 32768 and
    # 8192, all e5m2 values, so decoding the bytes in the kept format gives x back exactly
    assert q.scale.tolist() == [[2.0 ** -14, 2.0 ** -14]]
    assert w.dequantize().tolist() == [[1.0, -3.0], [2.0, 0.5]]


def test_amax_of_rows_reduces_along_the_axis_only_also_on_the_traced_path(monkeypatch):
    """amax_of's traced branch (taken while torch.compile traces, here faked) reduces a row along its axis only."""
    x = torch.tensor([[1.0, -5.0, 2.0], [-7.0, 3.0, 0.5]])
    for compiling in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
        assert amax_of(x, "row", 1).tolist() == [[5.0], [7.0]]
        assert amax_of(x, "row", 0).tolist() == [[7.0, 5.0, 2.0]]


def test_float64_block_floor_is_checked_per_block():
    """float64 blocks: a block whose |values| no fp32 scale can hold (1e-300: even 2^-126 turns them into 0) is
    a ValueError naming how many blocks; a block of 2^-130 is fine (scale 2^-126, FP8 value 2^-4, exact)."""
    x = torch.full((4, 6), 448.0, dtype=torch.float64)  # e4m3fn max: scale 1
    x[2:, 3:] = 2.0 ** -130
    q = quantize(x, "e4m3fn", granularity="block", block=(2, 3))
    assert q.scale.tolist() == [[1.0, 1.0], [1.0, 2.0 ** -126]]
    assert torch.equal(q.dequantize(torch.float64), x)
    x[2:, 3:] = 1e-300
    with pytest.raises(ValueError, match=r"^1 block\(s\) of x \(float64\) has \|values\| only up to 1e-300: "):
        quantize(x, "e4m3fn", granularity="block", block=(2, 3))



# A tensor of 2^20 elements or more takes its own eager amax (scaling.amax_of: one aminmax pass); 2^20 exactly and
# one more, with the largest magnitude negative, positive, or NaN somewhere. Reference: numpy float64 max |x|.
@pytest.mark.parametrize("numel", [1 << 20, (1 << 20) + 1])
@pytest.mark.parametrize("where", ["negative", "positive", "nan"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_amax_of_a_big_tensor_is_max_abs(numel, where, dtype):
    rng = np.random.default_rng(numel)
    values = rng.uniform(-1.0, 1.0, numel).astype(np.float32)
    spot = int(rng.integers(numel))
    values[spot] = {"negative": -7.5, "positive": 7.5, "nan": np.nan}[where]
    x = torch.from_numpy(values).to(dtype)
    reference = np.abs(x.float().numpy().astype(np.float64)).max()  # NaN anywhere makes it NaN
    for shaped in (x, x.reshape(1024, -1) if numel % 1024 == 0 else x):
        amax = compute_amax(shaped, "tensor", kernel="eager")
        assert amax.dtype == torch.float32 and amax.shape == ()
        if where == "nan":
            assert math.isnan(float(amax))
        else:
            assert float(amax) == reference == 7.5
    if where != "nan":  # and the scale the tensor-wise quantize takes from it
        q = quantize(x.float(), "e4m3fn", granularity="tensor", kernel="eager")
        assert float(q.scale) == float(np.float32(7.5 / 448.0))


@pytest.mark.parametrize("granularity,block,axis", [("tensor", (1, 128), -1), ("row", (1, 128), -1),
                                                    ("row", (1, 128), 0), ("block", (4, 32), -1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_given_scale_with_amax_casts_by_that_scale_and_returns_the_amax(kernel, granularity, block, axis, dtype,
                                                                           rng):
    """quantize(scale=s, with_amax=True) (delayed scaling's cast): the bytes of the cast by s (ml_dtypes), and the
    fp32 amax of x per tensor, row or block (numpy), NaN propagating; without with_amax a given scale returns
    no amax."""
    x_np = wide_random(rng, (70, 100), -30, 30)
    x_np[3, 7] = np.nan
    x = torch.from_numpy(x_np).to(dtype)
    scale = fp8quant.quantize(torch.from_numpy(np.nan_to_num(x_np)), "e4m3fn", granularity=granularity,
                              block=block, axis=axis).scale * 1.25
    q = fp8quant.quantize(x, "e4m3fn", granularity=granularity, block=block, axis=axis, scale=scale,
                          with_amax=True)
    codes, _ = ref_quantize(x_np, "e4m3fn", granularity=granularity, block=block, axis=axis, scale=scale.numpy())
    assert_codes_equal(codes_of(q), codes, "e4m3fn")
    assert q.amax.dtype == torch.float32
    np.testing.assert_array_equal(q.amax.numpy(), ref_amax(x_np, granularity, block, axis))
    assert fp8quant.quantize(x, "e4m3fn", granularity=granularity, block=block, axis=axis, scale=scale).amax is None
