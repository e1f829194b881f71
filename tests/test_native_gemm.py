"""fp8train's native bf16 x bf16 -> fp32 GEMM (numerics/native_gemm.c): bit for bit against a numpy float32
reference written from the summation order native_gemm.c documents, with and without per-K-block scales, for
both its loops (AVX512-BF16 where built, and the plain C loop every CPU has), at edge shapes and strides; then
the layers that use it: the same forward bits, and gradients within fp32's summation bound of the fp32 GEMMs.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.nn.linear import Fp8Linear
from fp8train.numerics import native_cast, native_gemm

needs_native = pytest.mark.skipif(not native_cast.available(), reason=f"no native kernel here: "
                                  f"{native_cast.unavailable_reason()}")
pytestmark = needs_native

KC = 2048  # k elements per cache block: 2 * KC_PAIRS of native_gemm.c
F32 = np.float32
LOOPS = [pytest.param(True, id="plain"),
         pytest.param(False, id="vector", marks=pytest.mark.skipif(
             not native_cast.available() or not native_gemm.fast(), reason="no AVX512-BF16 loop built here"))]


def reference(a: torch.Tensor, b: torch.Tensor, scale_a=None, scale_b=None, k_block: int = 0) -> np.ndarray:
    """c = a @ b in numpy float32, in native_gemm.c's documented order: cache blocks summed from zero and added
    to c; inside one, K blocks of pairs (2q+1 first, then 2q), each block's sum times its row's scale, then its
    column's, added in block order (without scales one K block spans the cache block)."""
    a64, b64 = a.double().numpy(), b.double().numpy()
    m, k = a64.shape
    if k % 2:  # the odd k's missing partner is a zero
        a64, b64 = np.pad(a64, ((0, 0), (0, 1))), np.pad(b64, ((0, 1), (0, 0)))
    kc = max(k_block, KC // k_block * k_block) if k_block else KC
    block = k_block or kc
    c = None
    for c0 in range(0, a64.shape[1], kc):
        t = np.zeros((m, b64.shape[1]), F32)
        for b0 in range(c0, min(c0 + kc, a64.shape[1]), block):
            s = np.zeros_like(t)
            for q in range(b0, min(b0 + block, a64.shape[1]), 2):
                # each product of two bf16 values is exact in fp32 (16 significant bits): float64, then fp32
                s = s + np.outer(a64[:, q + 1], b64[q + 1]).astype(F32)
                s = s + np.outer(a64[:, q], b64[q]).astype(F32)
            if k_block:
                blk = b0 // k_block
                t = t + (s * scale_a[:, blk, None].numpy()) * scale_b[None, blk].numpy()
            else:
                t = s
        c = t if c is None else c + t
    return c


def assert_bits_equal(got: torch.Tensor, expected: np.ndarray):
    got = got.numpy()
    assert got.dtype == F32 and got.shape == expected.shape
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), expected[~nan].view(np.uint32))


def fp8_values(shape, fmt: str, gen: torch.Generator, spread: float = 4.0) -> torch.Tensor:
    """bf16 copies of FP8 values (what the emulated GEMMs hand the kernel), from several binades."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-6, 6, shape, generator=gen).float()) * spread
    fp8 = getattr(torch, f"float8_{fmt}")
    # within the format's range: torch's cast of a value past it is NaN in some releases (2.11) and not in others
    x = x.clamp(-torch.finfo(fp8).max, torch.finfo(fp8).max)
    return x.to(fp8).to(torch.bfloat16)


SHAPES = [(1, 1, 1), (5, 7, 3), (13, 33, 70), (12, 512, 32), (25, 1030, 65), (3, 2049, 40), (40, 64, 97),
          (5, 4100, 37)]


@pytest.mark.parametrize("plain", LOOPS)
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("formats", [("e4m3fn", "e4m3fn"), ("e5m2", "e4m3fn")])
@pytest.mark.parametrize("layout", ["contiguous", "a_transposed", "b_transposed"])
def test_sums_in_the_documented_order(plain, m, k, n, formats, layout):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    a, b = fp8_values((m, k), formats[0], gen), fp8_values((k, n), formats[1], gen)
    if layout == "a_transposed":
        a = a.t().contiguous().t()
    if layout == "b_transposed":
        b = b.t().contiguous().t()
    assert_bits_equal(native_gemm.mm(a, b, plain=plain), reference(a, b))


FP8_DTYPES = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
              "e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "e5m2fnuz": ml_dtypes.float8_e5m2fnuz}


def fp8_bytes(shape, fmt: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 codes of `fmt` (every finite code: an inf times a zero makes NaN) as a torch float8 tensor, and
    their values in bf16 decoded by ml_dtypes (independent of torch's and of the kernel's table)."""
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).numpy()
    values = codes.view(FP8_DTYPES[fmt]).astype(np.float32)
    finite = np.isfinite(values)
    codes, values = np.where(finite, codes, 0).astype(np.uint8), np.where(finite, values, 0).astype(np.float32)
    return torch.from_numpy(codes).view(getattr(torch, f"float8_{fmt}")), torch.from_numpy(values).bfloat16()


@pytest.mark.parametrize("plain", LOOPS)
@pytest.mark.parametrize("m,k,n", [(5, 7, 3), (13, 34, 70), (25, 1030, 65), (3, 2049, 40)])
@pytest.mark.parametrize("formats", [("e4m3fn", "e5m2"), ("e4m3fnuz", "e5m2fnuz"), ("e5m2", None), (None, "e4m3fn")])
@pytest.mark.parametrize("layout", ["contiguous", "a_transposed", "b_transposed"])
def test_fp8_byte_operands_read_as_their_values(plain, m, k, n, formats, layout):
    """FP8 bytes (read through the kernel's table while packing) give the sums of their values in the documented
    order; None: that operand in bf16."""
    gen = torch.Generator().manual_seed(m + k + n)
    a, a_values = fp8_bytes((m, k), formats[0], gen) if formats[0] else (None, fp8_values((m, k), "e4m3fn", gen))
    b, b_values = fp8_bytes((k, n), formats[1], gen) if formats[1] else (None, fp8_values((k, n), "e4m3fn", gen))
    a, b = a if a is not None else a_values, b if b is not None else b_values
    if layout == "a_transposed":
        a = a.t().contiguous().t()
    if layout == "b_transposed":
        b = b.t().contiguous().t()
    assert_bits_equal(native_gemm.mm(a, b, plain=plain), reference(a_values, b_values))


@pytest.mark.parametrize("plain", LOOPS)
@pytest.mark.parametrize("m,k,n,k_block", [(13, 300, 45, 128), (7, 97, 33, 32), (6, 2300, 40, 32),
                                           (5, 260, 7, 128), (4, 2500, 20, 1024), (9, 2100, 35, 96)])
@pytest.mark.parametrize("pow2", [True, False])
def test_k_block_scales_in_the_documented_order(plain, m, k, n, k_block, pow2):
    gen = torch.Generator().manual_seed(k + k_block)
    a, b = fp8_values((m, k), "e4m3fn", gen), fp8_values((k, n), "e5m2", gen)
    blocks = -(-k // k_block)
    scale_a, scale_b = torch.rand(m, blocks, generator=gen) + 0.5, torch.rand(blocks, n, generator=gen) * 3 + 0.1
    if pow2:
        scale_a, scale_b = torch.exp2(scale_a.log2().round()), torch.exp2(scale_b.log2().round())
    got = native_gemm.mm(a, b, (scale_a, scale_b, k_block), plain=plain)
    assert_bits_equal(got, reference(a, b, scale_a, scale_b, k_block))
    if pow2:  # exact products and exact scalings: within fp32's summation bound of the float64 sum
        exact = sum((a[:, i * k_block:(i + 1) * k_block].double() @ b[i * k_block:(i + 1) * k_block].double())
                    * scale_a[:, i, None].double() * scale_b[None, i].double() for i in range(blocks))
        bound = sum((a[:, i * k_block:(i + 1) * k_block].double().abs() @ b[i * k_block:(i + 1) * k_block].double().abs())
                    * scale_a[:, i, None].double() * scale_b[None, i].double() for i in range(blocks))
        assert ((got.double() - exact).abs() <= k * 2.0 ** -24 * bound + 1e-30).all()


def epilogue_reference(c: np.ndarray, scale_a, scale_b, bias, out_dtype) -> np.ndarray:
    """native_gemm.c's epilogue from its documentation: times the row's scale, times the column's, plus the bias,
    each rounded in float32, then rounded to bf16 (ml_dtypes: to nearest even) for a bf16 output."""
    if scale_a is not None:
        c = c * (scale_a.numpy().reshape(-1, 1) if scale_a.numel() > 1 else scale_a.numpy().reshape(()))
    if scale_b is not None:
        c = c * (scale_b.numpy().reshape(1, -1) if scale_b.numel() > 1 else scale_b.numpy().reshape(()))
    if bias is not None:
        c = c + bias.numpy()
    return c.astype(F32) if out_dtype == torch.float32 else c.astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("plain", LOOPS)
@pytest.mark.parametrize("scales", ["none", "tensor", "row_col"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,k,n", [(25, 1030, 65), (12, 64, 32), (7, 9, 3)])
def test_the_epilogue_scales_adds_the_bias_and_rounds_once(plain, scales, with_bias, out_dtype, m, k, n):
    gen = torch.Generator().manual_seed(m + k + n)
    a, b = fp8_values((m, k), "e4m3fn", gen), fp8_values((k, n), "e5m2", gen)
    scale_a = scale_b = None
    if scales == "tensor":
        scale_a, scale_b = torch.tensor(0.37), torch.tensor(1.9)
    if scales == "row_col":
        scale_a, scale_b = torch.rand(m, 1, generator=gen) + 0.1, torch.rand(1, n, generator=gen) + 0.1
    bias = torch.randn(n, generator=gen) * 50 if with_bias else None
    got = native_gemm.mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, plain=plain)
    expected = epilogue_reference(reference(a, b), scale_a, scale_b, bias, out_dtype)
    if out_dtype == torch.float32:
        assert_bits_equal(got, expected)
    else:
        assert got.dtype == torch.bfloat16
        assert np.array_equal(got.view(torch.int16).numpy(), expected.view(np.int16))


@pytest.mark.parametrize("plain", LOOPS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_out_writes_the_same_bits_into_rows_of_a_larger_tensor(plain, out_dtype):
    """``mm(out=)`` and ``gemm_epilogue(out=)`` (one expert's rows of a grouped GEMM's output) write the
    documented sums and epilogue into exactly those rows: the rows around them keep their values."""
    gen = torch.Generator().manual_seed(5)
    a, b = fp8_values((29, 300), "e4m3fn", gen), fp8_values((300, 70), "e4m3fn", gen)
    scale_a, scale_b, bias = torch.rand(29, 1, generator=gen) + 0.1, torch.tensor(0.7), torch.randn(70, generator=gen)
    expected = epilogue_reference(reference(a, b), scale_a, scale_b, bias, out_dtype)
    big = torch.full((40, 70), 3.0, dtype=out_dtype)
    got = native_gemm.mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, plain=plain,
                         out=big[5:34])
    assert got.data_ptr() == big[5:34].data_ptr()
    int_dtype = (torch.int16, np.int16) if out_dtype == torch.bfloat16 else (torch.int32, np.int32)
    assert np.array_equal(big[5:34].view(int_dtype[0]).numpy(), expected.view(int_dtype[1]))
    assert (big[:5] == 3).all() and (big[34:] == 3).all()
    acc = torch.mm(a.bfloat16(), b.bfloat16())  # the epilogue after a bf16 GEMM, into rows likewise
    big = torch.full((40, 70), 3.0, dtype=out_dtype)
    native_cast.gemm_epilogue(acc, scale_a, scale_b, bias, out_dtype, out=big[5:34])
    assert torch.equal(big[5:34], native_cast.gemm_epilogue(acc, scale_a, scale_b, bias, out_dtype))
    assert (big[:5] == 3).all() and (big[34:] == 3).all()


def test_the_two_loops_are_the_same_bits_where_both_run():
    if not native_gemm.fast():
        pytest.skip("no AVX512-BF16 loop built here: only the plain loop runs (test_sums_in_the_documented_order)")
    gen = torch.Generator().manual_seed(7)
    a, b = fp8_values((300, 4096), "e4m3fn", gen), fp8_values((4096, 200), "e5m2", gen).t().contiguous().t()
    assert torch.equal(native_gemm.mm(a, b), native_gemm.mm(a, b, plain=True))


@pytest.mark.parametrize("plain", LOOPS)
def test_nan_and_inf_propagate_as_in_fp32(plain):
    a = torch.ones(14, 40, dtype=torch.bfloat16)
    b = torch.ones(40, 35, dtype=torch.bfloat16)
    a[3, 5] = float("nan")
    b[7, 2] = float("inf")
    b[8, 2] = -float("inf")  # inf - inf: NaN
    b[9, 4] = float("inf")
    with np.errstate(invalid="ignore"):  # (inf - inf in the reference: the NaN wanted)
        expected = reference(a, b)
    assert np.isnan(expected[3]).all() and np.isnan(expected[:, 2]).all() and np.isinf(expected[0, 4])
    assert_bits_equal(native_gemm.mm(a, b, plain=plain), expected)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_columns_and_change_no_bit(threads):
    gen = torch.Generator().manual_seed(3)
    a, b = fp8_values((64, 700), "e4m3fn", gen), fp8_values((700, 300), "e4m3fn", gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        got = native_gemm.mm(a, b)
    finally:
        torch.set_num_threads(before)
    assert_bits_equal(got, reference(a, b))


def test_bad_calls_are_internal_errors():
    a, b = torch.ones(4, 6, dtype=torch.bfloat16), torch.ones(6, 5, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="internal error: gemm_bf16 got K-block scales without a K block"):
        native_gemm.mm(a, b, (torch.ones(4, 1), torch.ones(1, 5), 0))
    with pytest.raises(RuntimeError, match=r"internal error: gemm_bf16 K-block scales do not fit a \(4, 6\) @ \(6, 5\)"):
        native_gemm.mm(a, b, (torch.ones(4, 2), torch.ones(1, 5), 4))
    with pytest.raises(RuntimeError, match="internal error"):
        native_gemm.mm(a, b, (torch.ones(4, 2), torch.ones(2, 5), 3))  # an odd K block
    with pytest.raises(RuntimeError, match="internal error: gemm_bf16 does not take"):
        native_gemm.mm(a, b, bias=torch.ones(4))  # a bias of the wrong length
    with pytest.raises(RuntimeError, match="internal error: gemm_bf16 does not take"):
        native_gemm.mm(a, b, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="native GEMM mode must be one of auto, on, off; got 'fast'"):
        native_gemm.set_mode("fast")


def test_usable_refuses_empty_mismatched_and_non_bf16_operands():
    """usable() is True only for a non-empty (M, K) @ (K, N) of bf16 or FP8 operands: an empty or mismatched
    operand, or one of another dtype (fp32, fp16, uint8 bytes without a format), is refused whatever the other
    one is."""
    bf = torch.bfloat16
    assert native_gemm.usable(torch.ones(4, 6, dtype=bf), torch.ones(6, 5, dtype=bf))
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        assert native_gemm.usable(torch.ones(4, 6).to(fp8), torch.ones(6, 5, dtype=bf))
        assert native_gemm.usable(torch.ones(4, 6, dtype=bf), torch.ones(6, 5).to(fp8))
    assert not native_gemm.usable(torch.ones(4, 6, dtype=torch.uint8), torch.ones(6, 5, dtype=bf))
    assert not native_gemm.usable(torch.ones(4, 6, dtype=torch.float16), torch.ones(6, 5, dtype=bf))
    assert not native_gemm.usable(torch.ones(0, 6, dtype=bf), torch.ones(6, 5, dtype=bf))  # empty a
    assert not native_gemm.usable(torch.ones(4, 6, dtype=bf), torch.ones(6, 0, dtype=bf))  # empty b
    assert not native_gemm.usable(torch.ones(4, 7, dtype=bf), torch.ones(6, 5, dtype=bf))  # K 7 vs 6
    assert not native_gemm.usable(torch.ones(4, 6), torch.ones(6, 5, dtype=bf))  # fp32 a
    assert not native_gemm.usable(torch.ones(6, dtype=bf), torch.ones(6, 5, dtype=bf))  # 1-D a


def test_usable_refuses_scales_and_bias_that_are_not_fp32():
    """An outer scale or a bias that is not fp32 (float64, bf16) is refused, though the same values in fp32 are
    taken."""
    bf = torch.bfloat16
    a, b = torch.ones(4, 6, dtype=bf), torch.ones(6, 5, dtype=bf)
    assert native_gemm.usable(a, b, scale_a=torch.ones(()), scale_b=torch.ones(()), bias=torch.zeros(5))
    assert not native_gemm.usable(a, b, scale_a=torch.ones((), dtype=torch.float64))
    assert not native_gemm.usable(a, b, scale_b=torch.ones((), dtype=torch.float64))
    assert not native_gemm.usable(a, b, bias=torch.zeros(5, dtype=bf))


def test_one_op_with_a_fake_impl():
    a, b = torch.ones(4, 6, dtype=torch.bfloat16), torch.ones(6, 5, dtype=torch.bfloat16)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        out = native_gemm.mm(mode.from_tensor(a), mode.from_tensor(b))
    assert out.shape == (4, 5) and out.dtype == torch.float32


# ------------------------------------------------------------------------------------------------------------
# Fp8Linear with the native GEMM on and off
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def set_gemm_mode():
    before = native_gemm.mode()
    yield native_gemm.set_mode
    native_gemm.set_mode(before)


def _step(recipe: str, gemm_mode: str, set_gemm_mode):
    set_gemm_mode(gemm_mode)
    torch.manual_seed(11)
    layer = Fp8Linear(384, 160, recipe=recipe)
    layer.emulated_dtype = "bf16"
    x = (torch.randn(256, 384) * 3).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).mean().backward()
    return y.detach(), x.grad, layer.weight.grad, x.detach(), layer.weight.detach()


@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise", "block", "mxfp8"])
def test_fp8linear_gradients_match_the_fp32_gemms_within_the_summation_bound(recipe, set_gemm_mode):
    """With the native GEMM ("on": its vector loop where built, else the plain one) against without it. The
    input is fp32 under bf16 autocast, so the output is bf16 and both gradients fp32: the tensorwise and rowwise
    recipes keep the forward's bits (a bf16 GEMM, untouched) and sum both gradients in another order; block and
    mxfp8 run all three GEMMs on it. Each fp32 result is within twice fp32's summation bound (two orders, each
    within K 2^-24 of the sum of |products|) of the other; a bf16 output also within a bf16 step."""
    y_on, gx_on, gw_on, x, w = _step(recipe, "on", set_gemm_mode)
    y_off, gx_off, gw_off, _, _ = _step(recipe, "off", set_gemm_mode)
    # |products| summed, from the unquantized operands: FP8 rounding changes a magnitude by at most 1/8 (e5m2,
    # more than e4m3's 1/16), so 1.25^2 covers both factors
    grad_y = (2 * y_off.float() / y_off.numel()).double().abs()
    x_abs, w_abs = x.double().abs(), w.double().abs()
    bounds = {"grad_weight": (gw_on, gw_off, 2 * x.shape[0] * 2.0 ** -24 * (grad_y.t() @ x_abs) * 1.25 ** 2),
              "grad_input": (gx_on, gx_off, 2 * w.shape[0] * 2.0 ** -24 * (grad_y @ w_abs) * 1.25 ** 2)}
    for name, (on, off, bound) in bounds.items():
        assert ((on.double() - off.double()).abs() <= bound + 1e-30).all(), name
    if recipe in ("delayed", "current", "rowwise"):
        assert torch.equal(y_on, y_off)
    else:  # bf16 outputs: the fp32 results may round to neighbouring bf16 values
        bound_y = 2 * x.shape[1] * 2.0 ** -24 * (x_abs @ w_abs.t()) * 1.25 ** 2
        step = y_off.double().abs() * 2.0 ** -7
        assert ((y_on.double() - y_off.double()).abs() <= bound_y + step + 1e-30).all()
    assert not torch.equal(gw_on, torch.zeros_like(gw_on))


def test_mode_off_and_native_off_keep_the_fp32_grad_weight_gemm(set_gemm_mode, monkeypatch):
    from fp8train.nn.gemm import gemm_compute_dtype
    set_gemm_mode("off")
    assert gemm_compute_dtype(torch.bfloat16, torch.float32, "cpu") == torch.float32
    set_gemm_mode("on")
    assert gemm_compute_dtype(torch.bfloat16, torch.float32, "cpu") == torch.bfloat16
    assert gemm_compute_dtype(torch.bfloat16, torch.float32, "meta") == torch.float32  # CPU only
    assert gemm_compute_dtype(torch.float32, torch.float32, "cpu") == torch.float32
    monkeypatch.setattr(native_cast, "_enabled", False)  # what a machine without a C compiler gets
    assert gemm_compute_dtype(torch.bfloat16, torch.float32, "cpu") == torch.float32


@pytest.mark.parametrize("recipe", ["delayed", "current", "rowwise", "block", "mxfp8"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_the_layer_hands_the_kernel_fp8_bytes_where_no_bf16_gemm_reads_the_values(recipe, x_dtype, set_gemm_mode,
                                                                                    monkeypatch):
    """Under bf16 emulation with the kernel on, what each native GEMM of an Fp8Linear step reads: the FP8 bytes
    (a float8 dtype), never a decoded copy, except an operand that torch's bf16 GEMM reads too (tensorwise
    scales: grad_output's one copy serves grad_input, bf16 for a bf16 input, and grad_weight): then its bf16
    values, already made. (Rowwise requantizes grad_output along M for grad_weight: bytes again.)"""
    set_gemm_mode("on")
    seen = []
    real_mm = native_gemm.mm
    monkeypatch.setattr(native_gemm, "mm", lambda a, b, *args, **kwargs: seen.append((a.dtype, b.dtype))
                        or real_mm(a, b, *args, **kwargs))
    torch.manual_seed(3)
    layer = Fp8Linear(256, 128, recipe=recipe)
    layer.emulated_dtype = "bf16"
    x = torch.randn(64, 256).to(x_dtype).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).mean().backward()
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    tiles = recipe in ("block", "mxfp8")
    # the forward (bf16 out) runs here only for tiles; grad_input only for an fp32 input or tiles; grad_weight always
    assert len(seen) == 1 + tiles + (x_dtype == torch.float32 or tiles)
    grad_output_bytes = tiles or recipe == "rowwise" or x_dtype == torch.float32
    *_, (grad_output_t, saved_input) = seen  # grad_weight = grad_output.T @ input: the last GEMM
    assert saved_input in fp8  # the saved input, never decoded
    assert (grad_output_t in fp8) == grad_output_bytes
    assert grad_output_t in fp8 + (torch.bfloat16,)
    if tiles:  # the forward and grad_input GEMMs: bytes on both sides
        assert all(a in fp8 and b in fp8 for a, b in seen)
