"""GEMM backends: the emulated backend against an fp64 reference, and against torch._scaled_mm (CPU) for
tensorwise and rowwise scales, in the layouts of all three linear-layer GEMMs."""

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.nn import cpu_features, gemm, gemm_choice
from fp8train.nn.gemm import Fp8Operand, emulated_compute_dtype, fp8_mm, resolve_backend
from fp8train.nn.gemm_choice import Keep, operand_keeps
from fp8train.nn.recipes import ROLES, GemmBackend, OperandRole, recipe

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: a second OpenMP thread only adds sync


def _fp8(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 8).to(dtype)  # torch's own cast: independent of quant.py


def _pow2(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(torch.randint(-6, 6, shape, generator=g).float())


def _reference(a_data, a_scale_full, b_data, b_scale_full):
    """fp64 GEMM of the dequantized operands (FP8 values and pow2 scales are exact in fp64)."""
    return (a_data.double() * a_scale_full.double()) @ (b_data.double() * b_scale_full.double())


def _check_close(out, ref):
    assert out.dtype == torch.float32
    # fp32 accumulation over K <= 256 terms of exact products: relative error ~ K * 2^-24 of the row norm.
    tol = 1e-5 * ref.abs().max().item() + 1e-30
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=tol)


M, K, N = 48, 256, 80


@pytest.mark.parametrize("emulated", ["fp32", "bf16"])  # fp32 output: both modes must accumulate and keep fp32
@pytest.mark.parametrize("kind", ["tensor", "row_outer", "row_contracted", "block", "block_a_tensor_b",
                                  "tensor_a_block_b"])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)])
def test_emulated_matches_fp64_reference(kind, dtypes, emulated):
    a_data, b_data = _fp8((M, K), dtypes[0], 1), _fp8((K, N), dtypes[1], 2)
    if kind == "tensor":
        sa, sb = _pow2((), 3) * 0.7, _pow2((), 4) * 1.3  # non-pow2 tensor scales factor out exactly enough
        a, b = Fp8Operand(a_data, sa), Fp8Operand(b_data, sb)
        fa, fb = sa, sb
    elif kind == "row_outer":  # a per row, b per column: both along non-contracted dims
        sa, sb = _pow2((M, 1), 3), _pow2((1, N), 4)
        a, b = Fp8Operand(a_data, sa), Fp8Operand(b_data, sb)
        fa, fb = sa, sb
    elif kind == "row_contracted":  # a per column, b per row: both vary along K (backward GEMM layouts)
        sa, sb = _pow2((1, K), 3), _pow2((K, 1), 4)
        a, b = Fp8Operand(a_data, sa), Fp8Operand(b_data, sb)
        fa, fb = sa, sb
    elif kind == "block_a_tensor_b":  # only a varies along K: a is dequantized, b's scale still factors out
        sa, sb = _pow2((M, K // 128), 3), _pow2((), 4) * 1.3
        a, b = Fp8Operand(a_data, sa, (1, 128)), Fp8Operand(b_data, sb)
        fa, fb = sa.repeat_interleave(128, 1), sb
    elif kind == "tensor_a_block_b":  # only b varies along K
        sa, sb = _pow2((), 3) * 0.7, _pow2((K // 128, 1), 4)
        a, b = Fp8Operand(a_data, sa), Fp8Operand(b_data, sb, (128, 128))
        fa, fb = sa, sb.repeat_interleave(128, 0).expand(K, N)
    else:  # 1x128 tiles for a, 128x128 tiles for b (ragged N=80 < 128)
        sa, sb = _pow2((M, K // 128), 3), _pow2((K // 128, 1), 4)
        a, b = Fp8Operand(a_data, sa, (1, 128)), Fp8Operand(b_data, sb, (128, 128))
        fa = sa.repeat_interleave(128, 1)
        fb = sb.repeat_interleave(128, 0).expand(K, N)
    compute_dtype = emulated_compute_dtype("cpu", emulated)
    _check_close(fp8_mm(a, b, "emulated", compute_dtype=compute_dtype), _reference(a_data, fa, b_data, fb))


def test_transposed_operand_is_a_view_with_transposed_scales():
    """t() is free (the same bytes, no copy) and its dequantized value is the transpose of the fp64 reference
    data * scale, for per-row scales and for 1x128 tiles (which become 128x1 tiles)."""
    a_data = _fp8((M, K), E4M3, 5)
    row_scale, tile_scale = _pow2((M, 1), 6), _pow2((M, K // 128), 7)
    expected_rows = a_data.double() * row_scale.double()
    # Tile scale of element (i, j) is tile_scale[i, j // 128], indexed out by hand.
    expected_tiles = a_data.double() * tile_scale.double()[torch.arange(M)[:, None], torch.arange(K)[None, :] // 128]
    for operand, expected, block in ((Fp8Operand(a_data, row_scale), expected_rows, None),
                                     (Fp8Operand(a_data, tile_scale, (1, 128)), expected_tiles, (128, 1))):
        at = operand.t()
        assert at.shape == (K, M) and at.block == block
        assert at.data.data_ptr() == a_data.data_ptr() and not at.data.is_contiguous()  # a view
        assert torch.equal(at.dequantize().double(), expected.t())  # pow2 scales: exact
    assert Fp8Operand(a_data, row_scale).t().scale.shape == (1, M)


# The three GEMMs of Fp8Linear, as (a, b) operand builders over x (M, K), w (N, K), dy (M, N).
def _linear_gemms(x, w, dy):
    return {
        "output": (x, w.t()),        # input @ weight.T
        "grad_input": (dy, w),       # grad_output @ weight
        "grad_weight": (dy.t(), x),  # grad_output.T @ input
    }


def _int_fp8(shape, dtype, seed):
    """Small integers in FP8: every product and every partial sum over K <= 256 is an integer below 2^24, so
    any accumulation order gives the exact result and two backends must agree bit for bit."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-6, 7, shape, generator=g).float().to(dtype)


@pytest.fixture
def cpu_scaled_mm(monkeypatch):
    """torch._scaled_mm runs on CPU in this torch; pretend the device is capable so fp8_mm takes that path."""
    for module in (gemm, gemm_choice):  # (fp8_mm's check, the backend choice)
        monkeypatch.setattr(module, "scaled_mm_available", lambda device: True)


@pytest.mark.parametrize("name", ["output", "grad_input", "grad_weight"])
def test_scaled_mm_cpu_matches_exact_reference_tensorwise(name, cpu_scaled_mm):
    x = Fp8Operand(_int_fp8((64, 128), E4M3, 1), torch.tensor(0.03125))
    w = Fp8Operand(_int_fp8((96, 128), E4M3, 2), torch.tensor(0.0078125))
    dy = Fp8Operand(_int_fp8((64, 96), E5M2, 3), torch.tensor(0.25))
    a, b = _linear_gemms(x, w, dy)[name]
    reference = _reference(a.data, a.scale, b.data, b.scale)  # fp64, exact
    assert torch.equal(fp8_mm(a, b, "emulated", compute_dtype=torch.float32).double(), reference)  # pinned: fp32
    scaled = fp8_mm(a, b, "scaled_mm")
    assert scaled.dtype == torch.float32 and torch.equal(scaled.double(), reference)


def test_scaled_mm_cpu_rowwise_forward(cpu_scaled_mm):
    x = Fp8Operand(_int_fp8((64, 128), E4M3, 1), _pow2((64, 1), 4))
    w = Fp8Operand(_int_fp8((96, 128), E4M3, 2), _pow2((96, 1), 5))
    reference = _reference(x.data, x.scale, w.data.t(), w.scale.t())  # fp64, exact
    assert torch.equal(fp8_mm(x, w.t(), "emulated", compute_dtype=torch.float32).double(), reference)  # pinned
    # the result in the dtype asked for, straight from the kernel: exact in fp32, rounded once in bf16
    assert torch.equal(fp8_mm(x, w.t(), "scaled_mm").double(), reference)
    bf16 = fp8_mm(x, w.t(), "scaled_mm", out_dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, reference.to(torch.bfloat16))


def test_scaled_mm_refused_without_capable_gpu():
    a = Fp8Operand(_fp8((16, 16), E4M3, 1), torch.tensor(1.0))
    with pytest.raises(RuntimeError, match="backend='emulated'"):
        fp8_mm(a, a, "scaled_mm")
    with pytest.raises(RuntimeError, match="compute capability 8.9"):
        resolve_backend("scaled_mm", "cpu")


def test_unknown_backend_lists_the_allowed_ones():
    with pytest.raises(ValueError) as caught:
        resolve_backend("fp8", "cpu")
    assert str(caught.value) == "unknown GEMM backend 'fp8'; allowed: auto, emulated, scaled_mm, te"


@pytest.fixture
def cpu_flags_override():
    """Restores whatever --emulated-auto set for the session after a test that changes it."""
    previous = cpu_features._cpu_bf16_gemm_override
    yield cpu_features.set_cpu_bf16_gemm
    cpu_features.set_cpu_bf16_gemm(previous)


def test_backend_resolution_on_cpu(cpu_flags_override):
    assert resolve_backend("auto", "cpu") == "emulated"
    assert resolve_backend("emulated", "cpu") == "emulated"
    # auto: bf16 only on CPUs with bf16 GEMM instructions (read from /proc/cpuinfo independently here)
    cpu_flags_override(None)
    flags = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    has_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    assert emulated_compute_dtype("cpu") == (torch.bfloat16 if has_bf16 else torch.float32)
    # either CPU path can be forced on any CPU
    cpu_flags_override(True)
    assert emulated_compute_dtype("cpu") == torch.bfloat16
    cpu_flags_override(False)
    assert emulated_compute_dtype("cpu") == torch.float32
    with pytest.raises(TypeError, match="True, False or None"):
        gemm.set_cpu_bf16_gemm("bf16")
    assert emulated_compute_dtype("cuda") == torch.bfloat16
    assert emulated_compute_dtype("cpu", "fp32") == torch.float32
    assert emulated_compute_dtype("cpu", "bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="emulated_dtype must be one of auto, fp32, bf16"):
        emulated_compute_dtype("cpu", "fp16")
    with pytest.raises(ValueError, match="make_te_linear"):
        resolve_backend("te", "cpu")
    with pytest.raises(ValueError, match="allowed"):
        resolve_backend("cublas", "cpu")


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """Round to the nearest bf16, ties to even (ml_dtypes' cast, independent of torch), back in float64."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _bf16_ulp(x: np.ndarray) -> np.ndarray:
    """The bf16 spacing at |x| (8 significant bits): 2^(floor(log2|x|) - 7)."""
    return np.exp2(np.floor(np.log2(np.maximum(np.abs(x), 2.0 ** -126))) - 7)


@pytest.mark.parametrize("pow2_scales", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)])
def test_bf16_emulation_rounds_where_documented(dtypes, with_bias, pow2_scales):
    """emulated_dtype bf16, bf16 output (gemm.py's docstring): the fp32 accumulator of the exact FP8 products is
    rounded once to bf16 by the GEMM, then multiplied by scale_a and scale_b and added to the bias in fp32, and
    rounded to bf16 again. The reference applies that rule with numpy: exact sums in float64, float32 products,
    ml_dtypes' bf16 rounding. The CPU's fp32 summation order moves the accumulator by at most
    k * 2^-24 * sum|products| (the standard bound for recursive or blocked summation of k terms): only an
    accumulator that close to a bf16 rounding midpoint may round the other way, so every other element must be
    bit-equal, and those few within one bf16 ulp (times the scales) of the reference."""
    k = 64  # a short K keeps the order bound small against bf16's step, so almost every element is decided
    a_data, b_data = _fp8((M, k), dtypes[0], 11), _fp8((k, N), dtypes[1], 12)
    scale_a, scale_b = (torch.tensor(0.25), torch.tensor(2.0 ** -5)) if pow2_scales else \
        (torch.tensor(0.0371), torch.tensor(1.3))
    bias = torch.randn(N, generator=torch.Generator().manual_seed(13)) if with_bias else None
    out = fp8_mm(Fp8Operand(a_data, scale_a), Fp8Operand(b_data, scale_b), "emulated",
                 compute_dtype=torch.bfloat16, out_dtype=torch.bfloat16, bias=bias)
    assert out.dtype == torch.bfloat16

    a64, b64 = a_data.double().numpy(), b_data.double().numpy()
    exact = a64 @ b64  # FP8 products and their sums over k terms are exact in float64 (< 53 bits)
    order_error = k * 2.0 ** -24 * (np.abs(a64) @ np.abs(b64))
    accumulator = _bf16_round(exact)
    step = np.float32(accumulator) * np.float32(scale_a.item())  # float32 arithmetic, as the rule says
    step = step * np.float32(scale_b.item())
    if bias is not None:
        step = step + bias.numpy().astype(np.float32)
    expected = _bf16_round(step)

    got = out.double().numpy()
    # an accumulator this close to a midpoint between bf16 neighbours may round either way
    midpoint_distance = np.abs(np.abs(exact) - (np.abs(accumulator) + _bf16_ulp(exact) / 2 *
                                                 np.sign(np.abs(exact) - np.abs(accumulator))))
    undecided = midpoint_distance <= order_error
    assert undecided.mean() < 0.05  # the bound leaves most elements decided, or the test would be vacuous
    assert np.array_equal(got[~undecided], expected[~undecided])
    slack = _bf16_ulp(expected) * 2 + _bf16_ulp(exact) * abs(scale_a.item() * scale_b.item())
    assert np.all(np.abs(got - expected)[undecided] <= slack[undecided])


@pytest.mark.parametrize("emulated", ["fp32", "bf16"])
def test_fp32_output_is_never_rounded_to_bf16(emulated):
    """A GEMM whose result is kept in fp32 (grad_weight for fp32 master weights: the GPU's FP8 wgrad GEMM writes
    fp32) runs in fp32 in both modes: bit-equal between them, and exact for small-integer operands whose every
    partial sum fits in fp32's 24 bits while bf16's 8 bits would round it."""
    a_data, b_data = _int_fp8((32, 256), E4M3, 21), _int_fp8((256, 24), E5M2, 22)
    a, b = Fp8Operand(a_data, torch.tensor(0.5)), Fp8Operand(b_data, torch.tensor(0.125))
    exact = (a_data.double() @ b_data.double()) * 0.5 * 0.125
    assert (exact.abs() * 16 > 256).any()  # sums beyond bf16's integer range: a bf16 rounding would show
    out = fp8_mm(a, b, "emulated", compute_dtype=emulated_compute_dtype("cpu", emulated), out_dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out.double(), exact)
    assert gemm.gemm_compute_dtype(torch.bfloat16, torch.float32) == torch.float32
    assert gemm.gemm_compute_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    assert gemm.gemm_compute_dtype(torch.float32, torch.bfloat16) == torch.float32


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo on this system")
def test_bf16_gemm_detection_follows_the_cpu_flags():
    """bf16 GEMMs are detected from /proc/cpuinfo's flags: avx512_bf16 or amx_bf16 (docs/testing.md's rule)."""
    flags = next(line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("flags"))
    assert cpu_features._read_cpu_bf16_flags() is bool({"avx512_bf16", "amx_bf16"} & set(flags))


def test_bf16_gemm_detection_parses_the_flags_line():
    """avx512_bf16 or amx_bf16 (lower case, as the kernel writes them) in the first `flags` line, nothing else."""
    head = ["processor\t: 0\n", "model name\t: x\n"]
    assert cpu_features._bf16_gemm_in_cpuinfo(head + ["flags\t\t: fpu sse2 avx512f avx512_bf16 avx512_vnni\n"]) is True
    assert cpu_features._bf16_gemm_in_cpuinfo(head + ["flags\t\t: fpu sse2 amx_tile amx_bf16 amx_int8\n"]) is True
    assert cpu_features._bf16_gemm_in_cpuinfo(head + ["flags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n"]) is False
    assert cpu_features._bf16_gemm_in_cpuinfo(head + ["flags\t\t: fpu AMX_BF16 AVX512_BF16\n"]) is False
    assert cpu_features._bf16_gemm_in_cpuinfo(head) is False  # no flags line (e.g. an ARM cpuinfo)
    # only the first flags line counts (one per core, all the same on a real machine)
    assert cpu_features._bf16_gemm_in_cpuinfo(head + ["flags\t: avx2\n", "flags\t: amx_bf16\n"]) is False


def test_bf16_gemm_detection_reads_the_file_and_says_no_without_one(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_features._read_cpu_bf16_flags(str(cpuinfo)) is True
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
    assert cpu_features._read_cpu_bf16_flags(str(cpuinfo)) is False
    assert cpu_features._read_cpu_bf16_flags(str(tmp_path / "absent")) is False  # no /proc (macOS, Windows): no bf16


def test_te_backend_error_names_make_te_linear():
    with pytest.raises(ValueError) as caught:
        resolve_backend("te", "cpu")
    assert str(caught.value) == ("backend='te' replaces the layer with Transformer Engine's Linear: use "
                                 "fp8train.nn.te.make_te_linear(linear, recipe); Fp8Linear runs "
                                 "'auto', 'emulated' or 'scaled_mm'")


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def native_gemm_mode():
    """native_gemm.set_mode for one test, the session's mode restored after."""
    from fp8train.numerics import native_cast, native_gemm
    if not native_cast.available():
        pytest.skip("the native library is not available (or --native-cast off)")
    previous = native_gemm.mode()
    yield native_gemm.set_mode
    native_gemm.set_mode(previous)


def test_fp32_output_under_bf16_emulation_runs_the_native_gemm(native_gemm_mode):
    """emulated dtype bf16, fp32 output, native GEMM on: one fp8train::gemm_bf16 call (bf16 values, fp32 sums,
    scales in its epilogue), bit-equal to native_gemm.mm on the bf16 values; with the native GEMM off: torch's
    fp32 GEMM of the fp32 values, times the scales."""
    from fp8train.numerics import native_gemm
    a_data, b_data = _fp8((40, 192), E4M3, 31), _fp8((192, 24), E5M2, 32)
    scale_a, scale_b = torch.tensor(0.0371), torch.tensor(1.3)
    native_gemm_mode("on")
    with _OpCounter() as ops:
        out = fp8_mm(Fp8Operand(a_data, scale_a), Fp8Operand(b_data, scale_b), "emulated",
                     compute_dtype=torch.bfloat16, out_dtype=torch.float32)
    assert ops.counts.get("fp8train.gemm_bf16") == 1 and "aten.mm" not in ops.counts
    expected = native_gemm.mm(a_data.to(torch.bfloat16), b_data.to(torch.bfloat16), scale_a=scale_a, scale_b=scale_b)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    native_gemm_mode("off")
    with _OpCounter() as ops:
        out = fp8_mm(Fp8Operand(a_data, scale_a), Fp8Operand(b_data, scale_b), "emulated",
                     compute_dtype=torch.bfloat16, out_dtype=torch.float32)
    assert "fp8train.gemm_bf16" not in ops.counts
    assert torch.equal(out, torch.mm(a_data.float(), b_data.float()) * scale_a * scale_b)


def test_native_gemm_takes_a_bf16_bias_into_its_epilogue_as_fp32(native_gemm_mode):
    """A bf16 bias on an fp32-output native GEMM: converted to fp32 (the one _to_copy: the kernel reads the FP8
    bytes themselves) and added in the kernel's epilogue (one fp8train::gemm_bf16 call, no torch mul/add after
    it): the same bits as with an fp32 copy of the bias (bf16 -> fp32 is exact)."""
    native_gemm_mode("on")
    a_data, b_data = _fp8((40, 192), E4M3, 31), _fp8((192, 24), E5M2, 32)
    scale_a, scale_b = torch.tensor(0.0371), torch.tensor(1.3)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(33)).to(torch.bfloat16)
    runs = []
    for b in (bias.float(), bias):
        with _OpCounter() as ops:
            out = fp8_mm(Fp8Operand(a_data, scale_a), Fp8Operand(b_data, scale_b), "emulated",
                         compute_dtype=torch.bfloat16, out_dtype=torch.float32, bias=b)
        runs.append((ops.counts, out))
    (fp32_ops, fp32_out), (bf16_ops, bf16_out) = runs
    assert fp32_ops == {"fp8train.gemm_bf16": 1}  # (the kernel reads the FP8 bytes: no decoded copy)
    assert bf16_ops == {"aten._to_copy": 1, "fp8train.gemm_bf16": 1}
    assert bf16_out.dtype == torch.float32 and torch.equal(bf16_out, fp32_out)


def test_block_tiles_keep_bytes_only_where_the_native_gemm_reads_them(native_gemm_mode, cpu_flags_override):
    """Block tiles (scales along K): the native GEMM reads their bytes where the emulated dtype is bf16 ('bf16', or
    'auto' on a CPU with bf16 GEMMs) and the kernel is in use; otherwise the GEMM reads value * scale in fp32.
    The emulated dtype is resolved as the layer does (emulated_compute_dtype), whatever 'auto' is on this CPU."""
    block = recipe("block")
    native_gemm_mode("on")
    for cpu_bf16 in (False, True):
        cpu_flags_override(cpu_bf16)
        for choice, expected in (("bf16", Keep.BYTES), ("fp32", Keep.FP32),
                                 ("auto", Keep.BYTES if cpu_bf16 else Keep.FP32)):
            for role in ROLES:
                assert operand_keeps(GemmBackend.EMULATED, block, role, emulated_compute_dtype("cpu", choice),
                                     torch.bfloat16, "cpu") is expected, (choice, role)
    native_gemm_mode("off")
    for cpu_bf16 in (False, True):
        cpu_flags_override(cpu_bf16)
        assert {operand_keeps(GemmBackend.EMULATED, block, role, emulated_compute_dtype("cpu", c), torch.float32,
                              "cpu") for c in ("bf16", "fp32", "auto") for role in ROLES} == {Keep.FP32}


@pytest.mark.parametrize("compute_dtype, out_dtype, native_mode, fp32_too, expected", [
    # torch's bf16 GEMM, bf16 result: the bf16 values (and the fp32 ones beside them when asked)
    (torch.bfloat16, torch.bfloat16, "on", False, Keep.BF16),
    (torch.bfloat16, torch.bfloat16, "on", True, Keep.FP32_AND_BF16),
    (torch.bfloat16, torch.bfloat16, "off", False, Keep.BF16),
    # fp32 result from bf16 values: the native GEMM reads the bytes; without it the GEMM runs in fp32
    (torch.bfloat16, torch.float32, "on", False, Keep.BYTES),
    (torch.bfloat16, torch.float32, "off", False, Keep.FP32),
    # fp32 emulation reads fp32 values whatever the output
    (torch.float32, torch.bfloat16, "on", True, Keep.FP32),
    (torch.float32, torch.float32, "on", False, Keep.FP32),
])
def test_what_an_activation_keeps_for_its_emulated_gemm(compute_dtype, out_dtype, native_mode, fp32_too, expected,
                                                        native_gemm_mode):
    """The input and grad_output of a tensorwise recipe keep exactly the copy the docstring of gemm.py says their
    GEMM reads; the weight always keeps fp32 (the layer narrows it), scaled_mm and its bytes keep nothing."""
    native_gemm_mode(native_mode)
    current = recipe("current")
    for role in (OperandRole.INPUT, OperandRole.GRAD_OUTPUT):
        assert operand_keeps(GemmBackend.EMULATED, current, role, compute_dtype, out_dtype, "cpu",
                             fp32_too=fp32_too) is expected
    assert operand_keeps(GemmBackend.EMULATED, current, OperandRole.WEIGHT, compute_dtype, out_dtype, "cpu") \
        is Keep.FP32
    assert operand_keeps(GemmBackend.SCALED_MM, current, OperandRole.INPUT, compute_dtype, out_dtype, "cpu") \
        is Keep.BYTES
    hopper = current.replace(accumulator_bits=14)  # the accumulation model reads fp32 values
    assert operand_keeps(GemmBackend.EMULATED, hopper, OperandRole.INPUT, compute_dtype, out_dtype, "cpu") \
        is Keep.FP32


def test_native_gemm_with_a_strided_row_scale_and_fp32_bias(native_gemm_mode):
    """A per-row scale that is a strided view (not one the native epilogue reads) goes through the fallback: the
    native GEMM, then scales and the fp32 bias as torch ops: the same bits as the epilogue on a dense copy, and
    as the exact reference (small integers, power-of-two scales: every step but the bias add exact in fp32)."""
    native_gemm_mode("on")
    m, k, n = 16, 64, 8
    a_data, b_data = _int_fp8((m, k), E4M3, 41), _int_fp8((k, n), E4M3, 42)
    grid = torch.exp2(torch.randint(-3, 3, (m, 2), generator=torch.Generator().manual_seed(43)).float())
    strided_rows = grid[:, :1]  # (m, 1), stride (2, 1)
    assert strided_rows.stride() == (2, 1)
    scale_b = torch.tensor(0.5)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(44))
    a_strided, a_dense = Fp8Operand(a_data, strided_rows), Fp8Operand(a_data, strided_rows.contiguous())
    out = fp8_mm(a_strided, Fp8Operand(b_data, scale_b), "emulated", compute_dtype=torch.bfloat16,
                 out_dtype=torch.float32, bias=bias)
    dense = fp8_mm(a_dense, Fp8Operand(b_data, scale_b), "emulated", compute_dtype=torch.bfloat16,
                   out_dtype=torch.float32, bias=bias)
    exact = (a_data.double() @ b_data.double()) * strided_rows.double() * 0.5
    expected = (exact.numpy().astype(np.float32) + bias.numpy()).astype(np.float32)
    assert torch.equal(out, dense) and torch.equal(out, torch.from_numpy(expected))


@pytest.mark.parametrize("native_cast_on", [True, False])
def test_bf16_emulation_scales_the_bf16_sums_exactly(native_cast_on, request):
    """bf16 emulation on CPU (on any CPU: the compute dtype is given): the FP8 values' products summed by the
    bf16 GEMM, then both tensor scales applied in fp32, by the native epilogue or, with the native cast off, by
    torch ops. Small-integer values keep every sum exact in bf16 (|sum| <= 256), and the scales are powers of
    two, so the result must equal numpy's float64 product exactly, on either path."""
    from fp8train.numerics import native_cast

    if native_cast_on and not native_cast.available():
        pytest.skip("fp8train's C kernel is not built here")
    rng = np.random.default_rng(0)
    a_vals, b_vals = rng.integers(-2, 3, (24, 64)), rng.integers(-2, 3, (64, 40))
    a = Fp8Operand(torch.tensor(a_vals, dtype=torch.float32).to(torch.float8_e4m3fn), torch.tensor(0.5))
    b = Fp8Operand(torch.tensor(b_vals.T.copy(), dtype=torch.float32).to(torch.float8_e4m3fn),
                   torch.tensor(0.25)).t()
    expected = (a_vals.astype(np.float64) @ b_vals.astype(np.float64)) * 0.125
    native_cast.set_enabled(native_cast_on)
    try:
        out = fp8_mm(a, b, "emulated", compute_dtype=torch.bfloat16, out_dtype=torch.bfloat16)
    finally:
        native_cast.set_enabled(request.config.getoption("--native-cast") == "on")
    assert out.dtype == torch.bfloat16
    np.testing.assert_array_equal(out.double().numpy(), expected)


def test_an_operand_reads_the_bf16_copy_its_quantizer_wrote():
    """The bf16 values written in the quantizer's own pass are what the GEMMs read: no second decode or copy."""
    from fp8train.numerics.quant import quantize
    from test_quant import codes_of, ml_decode

    q = quantize(torch.randn(32, 64), "e4m3fn", keep_values=torch.bfloat16)
    assert q.values_bf16 is not None
    op = Fp8Operand.from_fp8_tensor(q)
    assert op.values(torch.bfloat16) is q.values_bf16
    assert op.native_input() is q.values_bf16
    np.testing.assert_array_equal(q.values_bf16.float().numpy(), ml_decode(codes_of(q), "e4m3fn"))  # ml_dtypes


@pytest.mark.parametrize("rowwise_side", ["a", "b"])
def test_per_row_scales_against_block_tiles_on_the_native_gemm(rowwise_side, native_gemm_mode):
    """One operand scaled per row of the GEMM's M (or per column of N), the other in 128x128 tiles: the native
    GEMM takes each K block's scales as the per-row/column scale repeated along K. Small-integer values and
    power-of-two scales keep every product and sum exact, so the result equals numpy's float64 product."""
    native_gemm_mode("on")
    rng = np.random.default_rng(1)
    m, k, n = 24, 256, 128
    a_vals, b_vals = rng.integers(-3, 4, (m, k)), rng.integers(-3, 4, (k, n))
    a_rows = 2.0 ** rng.integers(-3, 3, (m, 1))
    b_cols = 2.0 ** rng.integers(-3, 3, (1, n))
    tiles = 2.0 ** rng.integers(-3, 3, (k // 128, n // 128))  # b's (K/128, N/128) grid: b is (K, N)
    a_data = torch.tensor(a_vals, dtype=torch.float32).to(torch.float8_e4m3fn)
    b_rows_first = torch.tensor(b_vals.T.copy(), dtype=torch.float32).to(torch.float8_e4m3fn)  # (N, K), as stored
    if rowwise_side == "a":
        a = Fp8Operand(a_data, torch.tensor(a_rows, dtype=torch.float32))
        b = Fp8Operand(b_rows_first, torch.tensor(tiles.T.copy(), dtype=torch.float32), (128, 128)).t()
        expected = (a_vals * a_rows) @ (b_vals * np.kron(tiles, np.ones((128, 128))))
    else:  # a in 128x128 tiles of (M, K) needs M a multiple of 128: a (128, 256) here
        a_vals = rng.integers(-3, 4, (128, k))
        a_tiles = 2.0 ** rng.integers(-3, 3, (1, k // 128))
        a = Fp8Operand(torch.tensor(a_vals, dtype=torch.float32).to(torch.float8_e4m3fn),
                       torch.tensor(a_tiles, dtype=torch.float32), (128, 128))
        b = Fp8Operand(b_rows_first, torch.tensor(b_cols.T.copy(), dtype=torch.float32)).t()
        expected = (a_vals * np.kron(a_tiles, np.ones((128, 128)))) @ (b_vals * b_cols)
    with _OpCounter() as ops:
        out = fp8_mm(a, b, "emulated", compute_dtype=torch.bfloat16, out_dtype=torch.float32)
    assert ops.counts.get("fp8train.gemm_bf16") == 1
    np.testing.assert_array_equal(out.double().numpy(), expected)
