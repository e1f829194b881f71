"""The native C kernel (numerics/native_cast.c): bytes, scales and values against ml_dtypes and the documented
scale rule (the independent reference of test_quant.py), and bit for bit against the eager kernel, for every
format over all special values, ties, the overflow boundary and subnormal edges, at every granularity; the
256-code decode; one op per call; traceable by torch.compile; and the eager fallback when there is no compiler.
"""

from __future__ import annotations

import math
import os
import stat

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.bench.harness import count_input_reads, count_top_level_ops
from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.numerics import native_build, native_cast
from fp8train.numerics.formats import get_format
from fp8train.numerics.mx import quantize_mx
from fp8train.numerics.quant import compute_amax, decode_fp8, quantize

from refs import ALL_FORMATS, ML_DTYPES, TORCH_DTYPES
from test_quant import assert_codes_equal, ml_decode, ref_quantize, ref_scale

pytestmark = pytest.mark.usefixtures("single_thread")
needs_native = pytest.mark.skipif(not native_cast.available(), reason=f"no native kernel here: "
                                  f"{native_cast.unavailable_reason()} (the fallback tests still run)")

F32 = np.float32


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(F32)


def crafted_values(name: str) -> np.ndarray:
    """Every FP8 value, the midpoints between neighbours (ties) and one fp32 ulp either side of each, the
    overflow boundary max + step/2 and its neighbours, subnormal edges, fp32 specials; both signs."""
    fmt = get_format(name)
    grid = ml_decode(np.arange(256), name)
    grid = np.unique(grid[np.isfinite(grid) & (grid >= 0)]).astype(F32)  # sorted non-negative values
    mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(F32)  # exact in fp32 (one more bit)
    limit = F32(fmt.max + fmt.step_at_max / 2)
    edges = np.array([fmt.min_subnormal / 2, fmt.min_normal, fmt.min_normal / 2, limit, fmt.max * 4,
                      np.finfo(F32).max, np.finfo(F32).tiny, 1e-45, 2.0 ** -149, 1e30], dtype=F32)
    core = np.concatenate([grid, mids, edges])
    with np.errstate(over="ignore"):  # FLT_MAX's upper neighbour is inf: wanted
        around = np.concatenate([core, np.nextafter(core, F32(np.inf)), np.nextafter(core, F32(0))])
    specials = _f32([0x7F800000, 0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x00000001, 0x007FFFFF])
    values = np.concatenate([around, specials])
    return np.concatenate([values, -values]).astype(F32)


def wide_random(rng, n: int) -> np.ndarray:
    """Random signs, mantissas and binades from far below the FP8 subnormals to far above max."""
    bits = rng.integers(0, 1 << 23, n, dtype=np.uint32) | (rng.integers(80, 175, n, dtype=np.uint32) << 23)
    bits |= rng.integers(0, 2, n, dtype=np.uint32) << 31
    return bits.view(F32)


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the calls that reach the C kernel (a case it does not take would silently run eagerly)."""
    calls = []
    for name in ("quantize_fp8", "quantize_laid_out"):  # the op, and its CPU implementation called directly
        real = getattr(native_cast, name)
        monkeypatch.setattr(native_cast, name, lambda *args, _real=real: calls.append(1) or _real(*args))
    return calls


def assert_same_as_eager(x: torch.Tensor, name: str, calls: list, **kwargs):
    """Native and eager quantize give the same bytes (NaN signs included), scale, amax and values bits."""
    before = len(calls)
    native = quantize(x, name, kernel="native", keep_values=True, **kwargs)
    assert len(calls) == before + 1, "the native kernel did not run"
    eager = quantize(x, name, kernel="eager", keep_values=True, **kwargs)
    assert torch.equal(native.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert native.data.dtype == eager.data.dtype and native.data.shape == eager.data.shape
    assert native.scale.shape == eager.scale.shape and torch.equal(native.scale, eager.scale)
    assert torch.equal(native.values.view(torch.int32), eager.values.view(torch.int32))
    if eager.amax is not None:
        assert torch.equal(torch.isnan(native.amax), torch.isnan(eager.amax))
        assert torch.equal(native.amax.nan_to_num(), eager.amax.nan_to_num())
    return native


# ------------------------------------------------------------------------------------------------------------
# The cast: every special and crafted value plus random ones, each format, saturating or not
# ------------------------------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_cast_matches_ml_dtypes_on_crafted_and_random_values(name, saturate, rng, native_calls):
    x = np.concatenate([crafted_values(name), wide_random(rng, 60_000)])
    for scale in (1.0, 0.375, 2.0 ** -20):  # the division too: x / scale in fp32, then the cast
        q = assert_same_as_eager(torch.from_numpy(x), name, native_calls, scale=torch.tensor(scale),
                                 saturate=saturate)
        expected, _ = ref_quantize(x, name, saturate=saturate, scale=np.float32(scale))
        assert_codes_equal(q.data.view(torch.uint8).numpy(), expected, name)
        np.testing.assert_array_equal(q.values.numpy(), ml_decode(expected, name))


# ------------------------------------------------------------------------------------------------------------
# Granularities, with the documented scale rule (amax -> scale) done by the kernel
# ------------------------------------------------------------------------------------------------------------
LAYOUTS = [("tensor", (1, 128), -1), ("row", (1, 128), -1), ("row", (1, 128), 0), ("block", (1, 128), -1),
           ("block", (128, 128), -1), ("block", (3, 5), -1), ("block", (1, 32), -1), ("block", (4, 64), -1)]


@needs_native
@pytest.mark.parametrize("granularity, block, axis", LAYOUTS)
# ragged tiles; lead dims (1-D: above); rows a multiple of 32 wide, whose tiles 32 or 128 wide the AVX2 loop
# casts a whole row at a time with each tile's scale (the last 128-wide tile of 320 ragged)
@pytest.mark.parametrize("shape", [(130, 257), (3, 40, 50), (70, 320), (2, 33, 96)])
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_granularities_match_reference_and_eager(name, shape, granularity, block, axis, rng, native_calls):
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))).astype(F32)
    flat = x.reshape(-1)
    flat[[3, 77, 101]] = [np.nan, np.inf, -np.inf]
    flat[rng.integers(0, flat.size, 20)] = 0.0
    for margin, pow2 in ((0, False), (0, True), (-3, False)):
        kwargs = dict(granularity=granularity, block=block, axis=axis, margin=margin, pow2=pow2)
        q = assert_same_as_eager(torch.from_numpy(x), name, native_calls, **kwargs)
        codes, scale = ref_quantize(x, name, **kwargs)
        assert_codes_equal(q.data.view(torch.uint8).numpy(), codes, name)
        np.testing.assert_array_equal(q.scale.numpy(), scale)


@needs_native
@pytest.mark.parametrize("granularity, block, axis", LAYOUTS)
@pytest.mark.parametrize("name", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("shape", [(257, 130), (256, 192)])
def test_transposed_views_and_bf16_inputs_match_eager(name, granularity, block, axis, shape, rng, native_calls):
    """What Fp8Linear hands the kernel: bf16 activations under autocast, and x.t() for the backward GEMMs."""
    base = torch.from_numpy((rng.standard_normal(shape) * 5).astype(F32))
    base[4, 9] = math.nan
    for x in (base, base.t(), base.bfloat16(), base.bfloat16().t()):
        q = assert_same_as_eager(x, name, native_calls, granularity=granularity, block=block, axis=axis, pow2=True)
        codes, scale = ref_quantize(x.float().numpy(), name, granularity=granularity, block=block, axis=axis,
                                    pow2=True)
        assert_codes_equal(q.data.view(torch.uint8).numpy(), codes, name)
        np.testing.assert_array_equal(q.scale.numpy(), scale)


@needs_native
def test_given_scales_per_row_and_block_match_eager(rng, native_calls):
    x = torch.from_numpy((rng.standard_normal((96, 300)) * 30).astype(F32))
    for granularity, block in (("row", (1, 1)), ("block", (1, 128)), ("block", (32, 64))):
        amax = compute_amax(x, granularity, block)
        scale = torch.from_numpy(ref_scale(amax.numpy(), "e4m3fn", margin=1))
        for saturate in (True, False):
            assert_same_as_eager(x, "e4m3fn", native_calls, granularity=granularity, block=block, scale=scale,
                                 saturate=saturate)


@needs_native
@pytest.mark.parametrize("cols", [200, 256])  # (256: whole rows cast at once, one scale per 32 columns)
def test_amax_and_mx_match_eager(rng, cols):
    x = torch.from_numpy((rng.standard_normal((64, cols)) * np.exp2(rng.integers(-20, 20, (64, cols)))).astype(F32))
    x[3, 5] = math.nan
    for granularity, block in (("tensor", (1, 1)), ("row", (1, 1)), ("block", (1, 32)), ("block", (16, 16))):
        native, eager = compute_amax(x, granularity, block, kernel="native"), compute_amax(x, granularity, block)
        assert native.shape == eager.shape
        assert torch.equal(native.nan_to_num(), eager.nan_to_num()) and torch.equal(native.isnan(), eager.isnan())
    for name in ("e4m3fn", "e5m2"):
        native, eager = (quantize_mx(x, name, keep_values=True, kernel=k) for k in ("native", "eager"))
        assert torch.equal(native.data.view(torch.uint8), eager.data.view(torch.uint8))
        assert torch.equal(native.scale, eager.scale) and torch.equal(native.values.isnan(), eager.values.isnan())
        assert torch.equal(native.values.nan_to_num(), eager.values.nan_to_num())


@needs_native
@pytest.mark.parametrize("block", [(1, 128), (128, 128), (3, 5)])
def test_dequantized_values_are_value_times_scale(block, rng):
    """What the block recipes' emulated GEMMs read, written by the quantize pass or by the dequantize op from
    saved bytes: data * scale per tile, one fp32 product each (numpy's float32 product as the reference)."""
    base = torch.from_numpy((rng.standard_normal((200, 300)) * 9).astype(F32))
    base[1, 2] = math.nan
    for x in (base, base.t()):
        q = quantize(x, "e4m3fn", granularity="block", block=block, pow2=False, kernel="native",
                     keep_dequantized=True)
        eager = quantize(x, "e4m3fn", granularity="block", block=block, kernel="eager", keep_dequantized=True)
        assert q.values is None and torch.equal(q.data.view(torch.uint8), eager.data.view(torch.uint8))
        with np.errstate(invalid="ignore"):
            expected = ml_decode(q.data.view(torch.uint8).numpy(), "e4m3fn") * q.expanded_scale().numpy()
        for got in (q.dequantized, native_cast.dequantize(q.data, q.scale, "block", *q.block), eager.dequantized):
            assert got.dtype == torch.float32 and got.shape == x.shape
            np.testing.assert_array_equal(got.numpy(), expected.astype(F32))
    mx = quantize_mx(base, "e5m2", kernel="native", keep_dequantized=True)
    assert torch.equal(mx.dequantized.nan_to_num(), quantize_mx(base, "e5m2").dequantize().nan_to_num())


@pytest.mark.parametrize("granularity, block, axis", LAYOUTS[:4])
@pytest.mark.parametrize("name", ALL_FORMATS)
@pytest.mark.parametrize("kernel", ["native", "eager"])
def test_bf16_values_copy_is_exact_and_written_in_the_same_pass(name, granularity, block, axis, kernel, rng,
                                                                native_calls):
    """keep_values=torch.bfloat16 (what a bf16 GEMM reads) gives the FP8 values in bf16, exactly: ml_dtypes'
    decode of the bytes, rounded to bf16 by ml_dtypes (exact, so no rounding happens), NaN where the byte is a
    NaN code and then torch's own fp32 -> bf16 NaN (0xFFFF); alone or with the fp32 copy, from one native call."""
    base = torch.from_numpy((rng.standard_normal((67, 300)) * np.exp2(rng.integers(-12, 12, (67, 300)))).astype(F32))
    base[4, 9], base[5, 1], base[6, 2] = math.nan, -math.nan, math.inf
    for x in (base, base.t(), base.bfloat16()):
        for keep in (torch.bfloat16, (torch.float32, torch.bfloat16)):
            before = len(native_calls)
            q = quantize(x, name, granularity=granularity, block=block, axis=axis, kernel=kernel, keep_values=keep)
            assert len(native_calls) == before + (kernel == "native" and native_cast.available())
            assert (q.values is not None) is isinstance(keep, tuple)
            codes = q.data.view(torch.uint8).numpy()
            with np.errstate(invalid="ignore"):
                decoded = ml_decode(codes, name)
            expected = decoded.astype(ml_dtypes.bfloat16).view(np.uint16).copy()
            expected[np.isnan(decoded)] = 0xFFFF
            got = q.values_bf16
            assert got.dtype == torch.bfloat16 and got.shape == x.shape
            np.testing.assert_array_equal(got.view(torch.int16).numpy().view(np.uint16), expected)
            plain = quantize(x, name, granularity=granularity, block=block, axis=axis, kernel=kernel)
            assert torch.equal(plain.data.view(torch.uint8), q.data.view(torch.uint8))  # the bytes do not change
            if q.values is not None:
                assert torch.equal(q.values.to(torch.bfloat16).view(torch.int16), got.view(torch.int16))


@needs_native
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 300), (1024, 640)])  # the second runs on two threads where there are two
def test_gemm_epilogue_matches_numpy_and_the_torch_ops(shape, out_dtype, rng, two_threads):
    """The emulated bf16 GEMM's epilogue, one pass: every bf16 accumulator bit pattern class (NaN, inf,
    subnormals, ties of the final rounding) times a row scale, times a column scale, plus a bias, then rounded
    to the output dtype: numpy float32 arithmetic in that order rounded by ml_dtypes (to nearest even), and the
    same bits as torch's own ops (which also fix the NaN pattern, 0xFFFF in bf16)."""
    rows, cols = shape
    acc = torch.from_numpy(rng.integers(0, 1 << 16, shape, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    row_scales = [None, torch.tensor(3.7e-3), torch.from_numpy(rng.uniform(0, 1e3, (rows, 1)).astype(F32)),
                  torch.tensor(2.0 ** -100)]
    col_scales = [None, torch.tensor(1.3e5), torch.from_numpy(rng.uniform(0, 7, (cols, 1)).astype(F32)).t()]
    for scale_a in row_scales:
        for scale_b in col_scales:
            for bias in (None, torch.from_numpy((rng.standard_normal(cols) * 100).astype(F32))):
                assert native_cast.epilogue_usable(acc, scale_a, scale_b, bias, out_dtype)
                got = native_cast.gemm_epilogue(acc, scale_a, scale_b, bias, out_dtype)
                expected = acc.float().numpy()
                with np.errstate(all="ignore"):
                    for s in (scale_a, scale_b):
                        expected = expected if s is None else expected * s.numpy()
                    expected = expected if bias is None else expected + bias.numpy()
                    expected = expected.astype(ml_dtypes.bfloat16 if out_dtype == torch.bfloat16 else F32)
                nan = np.isnan(expected.astype(F32))
                assert got.dtype == out_dtype and np.array_equal(np.isnan(got.float().numpy()), nan)
                bits = np.int16 if out_dtype == torch.bfloat16 else np.int32
                np.testing.assert_array_equal(got.view(torch.int16 if bits is np.int16 else torch.int32).numpy()[~nan],
                                              expected.view(bits)[~nan])
                torch_ops = acc.float()
                for s in (scale_a, scale_b):
                    torch_ops = torch_ops if s is None else torch_ops.mul_(s)
                torch_ops = (torch_ops if bias is None else torch_ops.add_(bias)).to(out_dtype)
                assert torch.equal(got.view(torch.int16 if bits is np.int16 else torch.int32),
                                   torch_ops.view(torch.int16 if bits is np.int16 else torch.int32))


def test_gemm_epilogue_takes_only_what_it_can():
    acc = torch.zeros(4, 6, dtype=torch.bfloat16)
    assert not native_cast.epilogue_usable(acc.float(), None, None, None, torch.bfloat16)  # an fp32 accumulator
    assert not native_cast.epilogue_usable(acc.t(), None, None, None, torch.bfloat16)  # not contiguous
    assert not native_cast.epilogue_usable(acc, torch.ones(4, 6), None, None, torch.bfloat16)  # not per row
    assert not native_cast.epilogue_usable(acc, None, torch.ones(6, 1), None, torch.bfloat16)  # not per column
    assert not native_cast.epilogue_usable(acc, None, None, torch.ones(6, dtype=torch.bfloat16), torch.bfloat16)
    assert not native_cast.epilogue_usable(acc, None, None, None, torch.float16)


def test_keep_values_refuses_other_dtypes():
    with pytest.raises(ValueError, match="keep_values takes"):
        quantize(torch.ones(4, 4), "e4m3fn", keep_values=torch.float16)


@needs_native
def test_dequantize_writes_fp32_under_a_float64_default_dtype(rng):
    """The C kernel writes fp32: its output buffer is fp32 whatever torch's default dtype is."""
    x = torch.from_numpy((rng.standard_normal((4, 6)) * 9).astype(F32))
    q = quantize(x, "e4m3fn", kernel="eager")
    expected = ml_decode(q.data.view(torch.uint8).numpy(), "e4m3fn").astype(F32) * F32(q.scale.item())
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = native_cast.dequantize(q.data, q.scale, "tensor", 1, 128)
    finally:
        torch.set_default_dtype(default)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)


@needs_native
@pytest.mark.parametrize("granularity, block, axis", [("tensor", (1, 128), -1), ("row", (1, 128), -1),
                                                      ("row", (1, 128), 0), ("block", (2, 3), -1)])
@pytest.mark.parametrize("transposed", [False, True])
def test_quantize_outputs_are_fp32_under_a_float64_default_dtype(granularity, block, axis, transposed, rng,
                                                                 native_calls):
    """Scales, amaxes and values the C kernel writes are fp32 buffers whatever torch's default dtype is
    (transposed block scale grids included): the same as eager quantize under the usual default."""
    x = torch.from_numpy((rng.standard_normal((6, 9)) * 9).astype(F32))
    x = x.t() if transposed else x
    kwargs = dict(granularity=granularity, block=block, axis=axis, keep_values=True)
    eager = quantize(x, "e4m3fn", kernel="eager", **kwargs)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        native = quantize(x, "e4m3fn", kernel="native", **kwargs)
    finally:
        torch.set_default_dtype(default)
    assert len(native_calls) == 1
    assert native.scale.dtype == native.values.dtype == native.amax.dtype == torch.float32
    assert torch.equal(native.data.view(torch.uint8), eager.data.view(torch.uint8))
    assert torch.equal(native.scale, eager.scale) and torch.equal(native.amax, eager.amax)
    assert torch.equal(native.values, eager.values)


@needs_native
def test_dequantizable_only_for_what_the_kernel_takes():
    """One 2-D matrix of FP8 bytes (batch 1) with an fp32 scale of the layout's shape; anything else is not."""
    data = torch.zeros(4, 6).to(torch.float8_e4m3fn)
    scale = torch.ones(2, 2)
    assert native_cast.dequantizable(data, scale, "block", 2, 3)
    assert not native_cast.dequantizable(data, scale.double(), "block", 2, 3)
    assert not native_cast.dequantizable(data, torch.ones(2, 3), "block", 2, 3)
    assert not native_cast.dequantizable(torch.zeros(2, 4, 6).to(torch.float8_e4m3fn), scale, "block", 2, 3)
    assert not native_cast.dequantizable(torch.zeros(4, 6), scale, "block", 2, 3)  # fp32, not FP8 bytes


def test_layout_of_one_element_and_of_empty_tensors():
    """A one-element tensor is a 1x1 matrix the kernel takes; an empty one is left to eager quantize."""
    one = native_cast.NativeLayout(1, 1, 1, 1, 1, False, (), 1, 1)
    assert native_cast.layout(torch.ones(1), "tensor") == one
    assert native_cast.layout(torch.ones(1, 1), "tensor") == one
    assert native_cast.layout(torch.ones(0), "tensor") is None
    assert native_cast.layout(torch.ones(0, 4), "row") is None


def test_layout_of_rows_and_of_a_transposed_tensor_hand_computed():
    """Per row (axis -1) a contiguous (2, 3, 5) tensor is a 6x5 memory matrix with one 1x5 tile per row: a 6x1
    scale grid. Per tensor the transpose of a contiguous 5x3 tensor is that 5x3 memory matrix, one tile: 1x1."""
    assert native_cast.layout(torch.ones(2, 3, 5), "row") == native_cast.NativeLayout(
        1, 6, 5, 1, 5, False, (2, 3, 1), 6, 1)
    assert native_cast.layout(torch.ones(7), "row") == native_cast.NativeLayout(1, 1, 7, 1, 7, False, (1,), 1, 1)
    assert native_cast.layout(torch.ones(5, 3).t(), "tensor") == native_cast.NativeLayout(
        1, 5, 3, 5, 3, True, (), 1, 1)


def test_layout_per_tensor_of_1d_and_0d_and_per_column_hand_computed():
    """Per tensor a 1-D (100,) tensor is one 1x100 memory row (100 is no multiple of 1024, so no 1024-wide split)
    and a 0-d tensor is a 1x1 matrix; per row along axis 0 a contiguous (4, 3, 5) tensor is the 4x15 memory matrix
    with one 4x1 tile per column: a 1x15 scale grid, the scale shaped (1, 3, 5)."""
    assert native_cast.layout(torch.ones(100), "tensor") == native_cast.NativeLayout(
        1, 1, 100, 1, 100, False, (), 1, 1)
    assert native_cast.layout(torch.tensor(3.0), "tensor") == native_cast.NativeLayout(
        1, 1, 1, 1, 1, False, (), 1, 1)
    assert native_cast.layout(torch.ones(4, 3, 5), "row", axis=0) == native_cast.NativeLayout(
        1, 4, 15, 4, 1, False, (1, 3, 5), 1, 15)


@needs_native
@pytest.mark.parametrize("transposed", [False, True])
def test_the_fake_impl_gives_the_real_outputs_for_blocks(transposed):
    """Under FakeTensorMode (what torch.compile traces with) quantize_fp8 of a (6, 10) tensor in 4x3 blocks has
    the real call's outputs: shapes, dtypes and strides; the scale grid is ceil(6/4) x ceil(10/3) = 2x4."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.randn(10, 6).t() if transposed else torch.randn(6, 10)
    # e4m3fn, 4x3 blocks, axis -1, margin 0, no pow2, amax rule, saturating, fp32 and bf16 values kept
    options = ("e4m3fn", "block", 4, 3, -1, 0, False, False, True, True, True, False, False)
    real = native_cast.quantize_fp8(x, None, *options)
    with FakeTensorMode() as mode:
        fake = native_cast.quantize_fp8(mode.from_tensor(x), None, *options)
    assert real[1].shape == real[2].shape == (2, 4)
    assert [(t.shape, t.dtype, t.stride()) for t in fake] == [(t.shape, t.dtype, t.stride()) for t in real]


# ------------------------------------------------------------------------------------------------------------
# Decode: all 256 codes
# ------------------------------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_decode_all_codes_matches_ml_dtypes(name, monkeypatch):
    codes = torch.arange(256, dtype=torch.uint8).view(TORCH_DTYPES[name])
    expected = np.arange(256, dtype=np.uint8).view(ML_DTYPES[name]).astype(np.float32)
    decodes, real_decode = [], native_cast.decode
    monkeypatch.setattr(native_cast, "decode", lambda *args: decodes.append(1) or real_decode(*args))
    got = decode_fp8(codes, name, kernel="native")
    assert decodes == [1], "kernel='native' did not run the C decode"
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), expected)  # NaN == NaN here
    finite = ~np.isnan(expected)
    assert np.array_equal(np.signbit(got.numpy())[finite], np.signbit(expected)[finite])  # -0 stays -0
    transposed = codes.reshape(16, 16).t()  # a transposed view: decoded in memory order, same strides out
    got_t = decode_fp8(transposed, name, kernel="native")
    assert got_t.stride() == transposed.stride()
    np.testing.assert_array_equal(got_t.numpy(), expected.reshape(16, 16).T)
    for bits_of in (got, got_t):  # and the eager conversion's bits, NaN payloads included
        source = codes if bits_of is got else transposed
        assert torch.equal(bits_of.view(torch.int32), source.float().view(torch.int32))
    bf16 = native_cast.decode(codes, name, torch.bfloat16)
    keep = torch.from_numpy(~np.isnan(expected))  # (torch itself gives NaNs different bf16 bits per code path)
    assert torch.equal(bf16.view(torch.int16)[keep], codes.float().bfloat16().view(torch.int16)[keep])
    np.testing.assert_array_equal(bf16.float().numpy(), expected)
    assert np.array_equal(np.signbit(bf16.float().numpy())[finite], np.signbit(expected)[finite])


# ------------------------------------------------------------------------------------------------------------
# Several threads (the tests above run on one): each thread's share, and the amax combined across them
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


THREADED_LAYOUTS = [("tensor", (1, 128)), ("row", (1, 128)), ("block", (1, 128)), ("block", (128, 128))]


def assert_threaded_quantize_matches_reference(name: str, rng, calls: list):
    """A tensor big enough for two threads (1M elements), NaN and inf in the second thread's half only, every
    layout: bytes and scales against the documented recipe, amax against numpy; decode against ml_dtypes."""
    x = (rng.standard_normal((1024, 1024)) * np.exp2(rng.integers(-8, 8, (1024, 1024)))).astype(F32)
    x[700, 3], x[900, 1000] = np.nan, -np.inf  # the global amax must see them wherever they fall
    finite = np.where(np.isfinite(x), x, F32(0.5))
    inputs = [torch.from_numpy(x), torch.from_numpy(finite), torch.from_numpy(finite).bfloat16()]  # bf16: autocast
    for granularity, block in THREADED_LAYOUTS:
        for data in inputs:  # with and without the specials
            q = assert_same_as_eager(data, name, calls, granularity=granularity, block=block)
            codes, scale = ref_quantize(data.float().numpy(), name, granularity=granularity, block=block)
            assert_codes_equal(q.data.view(torch.uint8).numpy(), codes, name)
            np.testing.assert_array_equal(q.scale.numpy(), scale)
    # the second half's NaN reached the combined amax; the first half alone has none
    assert math.isnan(float(compute_amax(torch.from_numpy(x), kernel="native")))
    assert math.isfinite(float(compute_amax(torch.from_numpy(x[:512]), kernel="native")))
    codes = torch.from_numpy(rng.integers(0, 256, 1 << 20, dtype=np.uint8)).view(TORCH_DTYPES[name])
    np.testing.assert_array_equal(decode_fp8(codes, name, kernel="native").numpy(),
                                  ml_decode(codes.view(torch.uint8).numpy(), name))


@needs_native
@pytest.mark.parametrize("name", ["e4m3fn", "e5m2"])
def test_threaded_quantize_and_decode_match_the_reference(name, rng, two_threads, native_calls):
    assert_threaded_quantize_matches_reference(name, rng, native_calls)


# ------------------------------------------------------------------------------------------------------------
# One op, traceable
# ------------------------------------------------------------------------------------------------------------
@needs_native
def test_each_native_call_is_one_op():
    x = torch.randn(64, 96)
    assert count_top_level_ops(lambda: quantize(x, "e4m3fn", granularity="block", keep_values=True,
                                                kernel="native")) == 1
    q = quantize(x, "e5m2", kernel="native")
    assert count_top_level_ops(lambda: decode_fp8(q.data, kernel="native")) == 1


@needs_native
@pytest.mark.compiled  # dynamo only (backend "eager"): ~3 s, most of it dynamo's first use
def test_the_op_traces_into_one_graph():
    x = torch.randn(32, 256)
    options = ("e4m3fn", "block", 1, 128, 1, 0, False, False, True, True, False, False, False)

    def fn(t):
        data, scale, _, values, _ = native_cast.quantize_fp8(t * 2, None, *options)
        return data.view(torch.uint8), scale, values

    compiled = torch.compile(fn, backend="eager", fullgraph=True)  # fullgraph: a graph break would raise
    for got, expected in zip(compiled(x), fn(x)):
        assert torch.equal(got, expected)


@needs_native
def test_outputs_never_require_grad_like_eager():
    x = torch.randn(8, 64, requires_grad=True)
    q = quantize(x, "e4m3fn", granularity="block", block=(1, 32), kernel="native", keep_values=True)
    for t in (q.data, q.scale, q.amax, q.values, compute_amax(x, kernel="native"),
              decode_fp8(q.data, kernel="native"), native_cast.dequantize(q.data, q.scale, "block", 1, 32)):
        assert not t.requires_grad


@needs_native
def test_fp8linear_uses_it_by_default():
    layer = Fp8Linear(64, 32, recipe="current")
    x = torch.randn(16, 64, requires_grad=True)
    assert layer.quantize_kernel == "auto" and layer.kernel_for(x.numel()) == "native"
    layer(x).sum().backward()
    assert torch.isfinite(x.grad).all()


@needs_native
@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise"])
def test_fp8linear_bf16_emulation_is_the_same_bits_with_and_without_the_native_passes(recipe, monkeypatch):
    """Under bf16 emulation the layer reads bf16 values written by the quantize pass and finishes each bf16 GEMM
    with the one-pass epilogue; with the native kernel switched off every step is torch's own op: the output,
    both gradients and the delayed state after a step are the same bits. (The native bf16 -> fp32 GEMM, which
    sums grad_weight in another order, is held off here: tests/test_native_gemm.py compares it.)"""
    from fp8train.nn.linear import update_fp8_scales
    from fp8train.numerics import native_gemm

    monkeypatch.setattr(native_gemm, "_mode", "off")
    results, ops = [], []
    for enabled in (True, False):
        monkeypatch.setattr(native_cast, "_enabled", enabled)
        torch.manual_seed(3)
        layer = Fp8Linear(192, 96, recipe=recipe)
        layer.emulated_dtype = "bf16"
        x = (torch.randn(160, 192) * 4).requires_grad_(True)
        for _ in range(2):  # the second step: delayed scaling runs on its history
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = layer(x)
            y.float().pow(2).mean().backward()
            update_fp8_scales(layer)
        results.append([y.detach(), x.grad, layer.weight.grad, *layer.state_dict().values()])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ops.append(count_top_level_ops(lambda: layer(x)))
    for native, eager in zip(*results):
        assert native.dtype == eager.dtype and torch.equal(native.reshape(-1).view(torch.uint8),
                                                           eager.reshape(-1).view(torch.uint8))
    assert ops[0] < ops[1]  # (the fused passes are fewer ops)


# ------------------------------------------------------------------------------------------------------------
# Build cache and the fallback without a compiler (runs also where the kernel is unavailable)
# ------------------------------------------------------------------------------------------------------------
def _fresh_native_state(monkeypatch, tmp_path, path: str):
    monkeypatch.setattr(native_build, "_state", {})
    monkeypatch.setattr(native_cast, "_enabled", True)  # the build itself is under test, even under --native-cast=off
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", path)


def test_without_a_compiler_quantize_falls_back_to_eager_and_says_why(monkeypatch, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    _fresh_native_state(monkeypatch, tmp_path, str(empty))
    x = torch.randn(40, 70)
    with pytest.warns(RuntimeWarning, match="native FP8 cast is unavailable.*no C compiler"):
        q = quantize(x, "e4m3fn", granularity="row", kernel="native", keep_values=True)
    assert not native_cast.available() and "no C compiler" in native_cast.unavailable_reason()
    eager = quantize(x, "e4m3fn", granularity="row", kernel="eager", keep_values=True)
    assert torch.equal(q.data.view(torch.uint8), eager.data.view(torch.uint8)) and torch.equal(q.scale, eager.scale)
    assert Fp8Linear(70, 8).kernel_for(x.numel()) == "eager"  # the layer's default runs eagerly, no probe


def test_a_failing_compiler_falls_back_too(monkeypatch, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in native_build.COMPILER_NAMES:  # a "gcc" that prints a version and fails every build
        script = bin_dir / name
        script.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                          "echo 'fatal: no space' >&2; exit 3\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    _fresh_native_state(monkeypatch, tmp_path, f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    with pytest.warns(RuntimeWarning, match="failed \\(exit status 3\\): fatal: no space"):
        assert not native_cast.available()
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written is left to be loaded


@needs_native
def test_build_goes_to_a_cache_keyed_by_source_compiler_and_cpu(monkeypatch, tmp_path):
    _fresh_native_state(monkeypatch, tmp_path, os.environ.get("PATH", ""))
    assert native_cast.available()
    built = list((tmp_path / "cache" / "fp8train" / "native").glob("native_cast-*.so"))
    assert len(built) == 1
    monkeypatch.setattr(native_build, "_state", {})  # a second process: loads the cached library, no build
    mtime = built[0].stat().st_mtime_ns
    assert native_cast.available() and built[0].stat().st_mtime_ns == mtime


@needs_native
def test_the_library_runs_on_the_process_openmp_runtime():
    """Built with -fopenmp, the kernel's threads are torch's own OpenMP threads: one libgomp in the process."""
    assert native_build.threading_kind() == "openmp"
    if os.path.exists("/proc/self/maps") and "libgomp" in torch.__config__.parallel_info() + open(
            "/proc/self/maps").read():
        loaded = {line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}
        assert len(loaded) == 1, loaded


@needs_native
def test_a_compiler_without_openmp_builds_the_pthreads_variant(monkeypatch, tmp_path, rng, two_threads,
                                                              native_calls):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = native_build._find_compiler()
    for name in native_build.COMPILER_NAMES:  # the real compiler, refusing -fopenmp as a bare clang would
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -fopenmp ] && "
                          f"{{ echo 'unsupported option -fopenmp' >&2; exit 1; }}; done\nexec {real} \"$@\"\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    _fresh_native_state(monkeypatch, tmp_path, f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    assert native_cast.available() and native_build.threading_kind() == "pthreads"
    built = [p.name for p in (tmp_path / "cache").rglob("*.so")]
    assert len(built) == 1 and built[0].endswith("-pthreads.so")
    assert_threaded_quantize_matches_reference("e4m3fn", rng, native_calls)


def _numpy_amax(x: np.ndarray, granularity: str, block: tuple[int, int]) -> np.ndarray:
    """max |x| per tensor, row (kept as a column) or (br, bc) tile, written from the definition."""
    a = np.abs(x.astype(np.float64))
    if granularity == "tensor":
        return np.array(a.max())
    if granularity == "row":
        return a.max(axis=-1, keepdims=True)
    (rows, cols), (br, bc) = a.shape, block
    return a.reshape(rows // br, br, cols // bc, bc).max(axis=(1, 3))


@needs_native
@pytest.mark.parametrize("granularity, block", [("tensor", (1, 128)), ("row", (1, 128)), ("block", (1, 128)),
                                                ("block", (128, 128))])
def test_compute_amax_runs_the_native_op_exactly_when_asked(granularity, block):
    """kernel='native' is one fp8train::amax op, kernel='eager' none; both give numpy's amax."""
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(5))
    expected = _numpy_amax(x.numpy(), granularity, block)
    from test_gemm import _OpCounter

    for kernel, native_ops in (("native", 1), ("eager", 0)):
        with _OpCounter() as ops:
            amax = compute_amax(x, granularity, block, kernel=kernel)
        assert ops.counts.get("fp8train.amax", 0) == native_ops, (kernel, ops.counts)
        np.testing.assert_array_equal(amax.double().numpy(), expected)


@pytest.mark.parametrize("kernel", ["eager", "native"])
def test_the_amax_of_an_empty_3d_tensor_is_shaped_like_its_scales(kernel):
    """No elements: zeros in the scale's shape, worked out by hand (leading dims kept, (0/1, 256/128) tiles)."""
    empty = torch.empty(2, 0, 256)
    assert compute_amax(empty, "block", (1, 128), kernel=kernel).shape == (2, 0, 2)
    assert compute_amax(empty, "row", kernel=kernel).shape == (2, 0, 1)
    assert compute_amax(empty, "tensor", kernel=kernel).shape == ()


# ------------------------------------------------------------------------------------------------------------
# A given scale with its amax (delayed scaling): one op, one pass
# ------------------------------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,transposed", [((300, 257), False), ((257, 300), True), ((2, 5000), False),
                                              ((4096, 256), False)])
@pytest.mark.parametrize("granularity,axis", [("tensor", -1), ("row", -1), ("row", 0)])
def test_given_scale_with_amax_is_one_call_with_the_reference_bytes_and_amax(native_calls, dtype, shape,
                                                                               transposed, granularity, axis, rng):
    """quantize(scale=..., with_amax=True): one native call; the bytes of a cast by that scale (ml_dtypes, the
    documented rule), and the amax numpy takes of |x| per tensor or row (a NaN propagates)."""
    x_np = (rng.standard_normal(shape) * 40).astype(np.float32)
    x_np[1, 3] = np.nan
    x = torch.from_numpy(x_np).to(dtype)
    x = x.t().contiguous().t() if transposed else x  # the transpose of a contiguous tensor: the other layout
    x_ref = x.float().numpy()
    scale_shape = () if granularity == "tensor" else (shape[0], 1) if axis == -1 else (1, shape[1])
    scale = torch.full(scale_shape, 0.37)
    before = len(native_calls)
    q = quantize(x, "e4m3fn", granularity=granularity, axis=axis, scale=scale, with_amax=True, kernel="native")
    assert len(native_calls) == before + 1
    codes, _ = ref_quantize(x_ref, "e4m3fn", granularity=granularity, axis=axis, scale=scale.numpy())
    assert_codes_equal(q.data.view(torch.uint8).numpy(), codes, "e4m3fn")
    with np.errstate(invalid="ignore"):
        amax = np.abs(x_ref).max(axis=None if granularity == "tensor" else axis,
                                 keepdims=granularity != "tensor")
    np.testing.assert_array_equal(q.amax.numpy(), amax)  # NaN == NaN here
    assert q.scale is scale or torch.equal(q.scale, scale)


@needs_native
def test_delayed_forward_reads_its_input_once_and_records_its_amax():
    """An Fp8Linear with delayed scaling, scales initialized: its forward reads the input with one op (the cast
    by the stored scale, amax in the same pass), and the amax it records is max |x|."""
    layer = Fp8Linear(256, 128, recipe="delayed")
    x = torch.randn(64, 256) * 3
    layer(x).sum().backward()
    update_fp8_scales(layer)
    assert count_input_reads(lambda: layer(x), x) == 1
    assert float(layer.input_pending_amax) == float(x.abs().max())
    current = Fp8Linear(256, 128, recipe="current")
    assert count_input_reads(lambda: current(x), x) == 1


def _tile_amaxes(x: np.ndarray, granularity: str, block: tuple[int, int]) -> np.ndarray:
    """max |x| per tensor, row or (br, bc) tile, NaN propagating (numpy, from the definition)."""
    with np.errstate(invalid="ignore"):
        if granularity == "tensor":
            return np.abs(x).max(keepdims=True)
        if granularity == "row":
            return np.abs(x).max(axis=1)
        br, bc = block
        return np.array([[np.abs(x[i:i + br, j:j + bc]).max() for j in range(0, x.shape[1], bc)]
                         for i in range(0, x.shape[0], br)])


@needs_native
@pytest.mark.parametrize("granularity,block,shape", [("tensor", (1, 1), (1024, 64)), ("tensor", (1, 1), (33, 70)),
                                                     ("row", (1, 1), (40, 96)), ("block", (16, 32), (48, 96))])
@pytest.mark.parametrize("bad", [None, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("pending_before", [-1.0, 0.5, 1e6])
def test_the_kernel_records_the_amaxes_as_the_quantizer_would(granularity, block, shape, bad, pending_before,
                                                              native_calls, rng):
    """quantize(..., nonfinite_count=, pending_amax=) on the native kernel: in the same op, the count + 1 exactly
    when some tile's amax is NaN/inf, the pending amax raised to the largest finite tile amax (-1 when none is
    finite: never lowered); the bytes as without them. The eager kernel leaves both to its caller."""
    x_np = (rng.standard_normal(shape) * 7).astype(np.float32)
    if bad is not None:
        x_np[5, 7] = bad
    x = torch.from_numpy(x_np)
    tiles = _tile_amaxes(x_np, granularity, block)
    finite = tiles[np.isfinite(tiles)]
    expected_pending = max(pending_before, float(finite.max()) if finite.size else -1.0)
    count, pending = torch.tensor(3, dtype=torch.int64), torch.tensor(pending_before)
    before = len(native_calls)
    q = quantize(x, "e4m3fn", granularity=granularity, block=block, kernel="native", nonfinite_count=count,
                 pending_amax=pending)
    assert len(native_calls) == before + 1 and q.amax_recorded
    assert count.item() == 3 + (bad is not None)
    assert pending.item() == np.float32(expected_pending)
    plain = quantize(x, "e4m3fn", granularity=granularity, block=block, kernel="native")
    assert torch.equal(q.data.view(torch.uint8), plain.data.view(torch.uint8)) and not plain.amax_recorded
    eager = quantize(x, "e4m3fn", granularity=granularity, block=block, kernel="eager", nonfinite_count=count,
                     pending_amax=pending)
    assert not eager.amax_recorded and count.item() == 3 + (bad is not None)
    assert pending.item() == np.float32(expected_pending)


@needs_native
@pytest.mark.parametrize("bad", [None, math.nan, math.inf])
def test_a_cast_by_a_given_scale_records_its_amax_too(bad, native_calls):
    """Delayed scaling's cast (a given scale, the amax taken in the same pass) records that amax; a cast whose
    amax is not taken has nothing to record and refuses the state (an internal error, never a silent skip)."""
    x = torch.arange(-20, 20, dtype=torch.float32).reshape(8, 5) / 4
    if bad is not None:
        x[2, 2] = bad
    count, pending = torch.tensor(0, dtype=torch.int64), torch.tensor(-1.0)
    q = quantize(x, "e4m3fn", scale=torch.tensor(0.5), with_amax=True, kernel="native", nonfinite_count=count,
                 pending_amax=pending)
    assert q.amax_recorded and count.item() == (bad is not None)
    assert pending.item() == (-1.0 if bad is not None else 5.0)
    with pytest.raises(RuntimeError, match="internal error"):
        native_cast.quantize_fp8(x, torch.tensor(0.5), "e4m3fn", "tensor", 8, 5, -1, 0, False, False, True, False,
                                 False, False, False, count)
