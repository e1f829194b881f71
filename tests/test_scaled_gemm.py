"""The scaled_mm backend on CPU: which GEMMs reach torch's FP8 kernel (op traces of a real Fp8Linear fwd+bwd),
the argument layouts handed to it (held to torch's own size/stride rules and to the row-/column-major layout the
CUDA kernels need, which the CPU kernel does not enforce), the output dtype, bias, fast accumulation, fallbacks
and the FP8-dialect refusal. CPU torch runs tensorwise and rowwise scaled_mm; blockwise raises there (ValueError),
so blockwise is checked by its arguments, and its fallback by what the layer reports."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.nn import scaled_gemm
from fp8train.nn.gemm import Fp8Operand, fp8_mm, resolve_backend
from fp8train.nn import gemm, gemm_choice
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.recipes import recipe
from fp8train.nn.scaled_gemm import check_dialect, scaled_mm_arguments, scaled_mm_kind

pytestmark = pytest.mark.usefixtures("single_thread")

KERNELS = {"_scaled_mm", "_scaled_mm_v2"}


def _cpu_runs_scaled_mm() -> bool:
    """torch's CPU builds (2.10+) run tensorwise scaled_mm; CUDA builds have no CPU kernel for it."""
    one = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        scaled_gemm.call_scaled_mm(dict(mat_a=one, mat_b=one.t(), scale_a=torch.tensor(1.0), scale_b=torch.tensor(1.0),
                                        recipe_a="TensorWise", recipe_b="TensorWise"), torch.float32, None, False)
        return True
    except (NotImplementedError, RuntimeError):
        return False


needs_cpu_kernel = pytest.mark.skipif(
    not _cpu_runs_scaled_mm(), reason=f"torch {torch.__version__} has no CPU scaled_mm kernel to stand in for the GPU "
                                      f"(test_scaled_mm_replay.py checks these calls on meta tensors instead)")
M, K, N = 128, 256, 384  # whole 128-tiles, so blockwise kinds apply


class KernelTrace(TorchDispatchMode):
    """Records every aten scaled-matmul call (arguments and whether it returned) under the mode."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name not in KERNELS:
            return func(*args, **kwargs)
        named = {arg.name: arg.default_value for arg in func._schema.arguments if arg.has_default_value()}
        named.update({arg.name: value for arg, value in zip(func._schema.arguments, args)}, **kwargs)
        call = dict(name=name, args=args, kwargs=kwargs, named=named, ok=False)
        self.calls.append(call)
        out = func(*args, **kwargs)
        call["ok"] = True
        return out


@pytest.fixture(autouse=True)
def scaled_mm_on_cpu(monkeypatch):
    """torch._scaled_mm runs on CPU in this torch: let backend='scaled_mm' resolve here (users get a refusal)."""
    for module in (gemm, gemm_choice):  # (fp8_mm's check, the backend choice)
        monkeypatch.setattr(module, "scaled_mm_available", lambda device: True)
    # each test starts with no remembered kernel refusals: one remembered from an earlier test (the block
    # kernel refused for the same shape) would skip the kernel call a later test traces, so results would
    # depend on which tests ran before (a subset, as mutation testing runs, failed this way)
    monkeypatch.setattr(scaled_gemm, "_kernel_answers", {})


def _layer_fwd_bwd(name, bias=True, **overrides):
    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N, bias=bias)
    layer = Fp8Linear.from_linear(copy.deepcopy(linear), recipe(name, backend="scaled_mm", **overrides))
    x = torch.randn(M, K, requires_grad=True)
    dy = torch.randn(M, N)
    trace = KernelTrace()
    with trace:
        y = layer(x)
        y.backward(dy)
    return layer, trace, (y.detach(), x.grad, layer.weight.grad)


def _assert_cuda_layouts(call):
    """What the CUDA kernels require and CPU does not check: row-major A, column-major B, fp32 scales."""
    mat_a, mat_b = call["args"][0], call["args"][1]
    assert mat_a.stride(1) == 1 and mat_a.stride(0) >= mat_a.shape[1], mat_a.stride()
    assert mat_b.stride(0) == 1 and mat_b.stride(1) >= mat_b.shape[0], mat_b.stride()
    assert mat_a.shape[1] % 16 == 0 and mat_b.shape[0] % 16 == 0 and mat_b.shape[1] % 16 == 0


def _on_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")  # same shape, dtype and strides, no data
    if isinstance(value, (list, tuple)):
        return type(value)(_on_meta(v) for v in value)
    return value


def _v2_check(call):
    """torch's own rules for _scaled_mm_v2's arguments (shapes and scale strides per scaling type): the same call
    replayed on meta tensors runs the op's meta function (its helper's name moves between torch releases)."""
    torch.ops.aten._scaled_mm_v2(*_on_meta(tuple(call["args"])), **_on_meta(dict(call.get("kwargs", {}))))


@needs_cpu_kernel
@pytest.mark.parametrize("name, kinds", [
    ("current", ["TensorWise"] * 3),
    ("delayed", ["TensorWise"] * 3),
    ("rowwise", ["RowWise"] * 3),
])
def test_all_three_gemms_reach_the_fp8_kernel_on_cpu(name, kinds):
    layer, trace, _ = _layer_fwd_bwd(name)
    assert [c["ok"] for c in trace.calls] == [True, True, True]
    assert layer.gemm_paths == {"output": f"scaled_mm:{kinds[0].lower()}", "grad_input": f"scaled_mm:"
                                f"{kinds[1].lower()}", "grad_weight": f"scaled_mm:{kinds[2].lower()}"}
    for call in trace.calls:
        _assert_cuda_layouts(call)
        if call["name"] == "_scaled_mm_v2":
            _v2_check(call)
            recipe_a, recipe_b = call["args"][3], call["args"][6]
            assert [F.ScalingType(r).name for r in recipe_a + recipe_b] == [kinds[0]] * 2


@needs_cpu_kernel
def test_block_recipe_passes_deepseek_layouts_and_reports_the_cpu_fallback():
    layer, trace, _ = _layer_fwd_bwd("block")
    if not scaled_gemm.HAS_SCALED_MM_V2:
        pytest.skip("this torch has no torch.nn.functional.scaled_mm: blockwise falls back before any kernel call")
    names = [[F.ScalingType(r).name for r in c["args"][3] + c["args"][6]] for c in trace.calls]
    # forward and grad_input: 1x128 activations x 128x128 weight; grad_weight: 1x128 x 1x128 (both along M)
    assert names[0] == ["BlockWise1x128", "BlockWise128x128"]
    assert names[1] == ["BlockWise1x128", "BlockWise128x128"]
    assert names[-1] == ["BlockWise1x128", "BlockWise1x128"]
    for call in trace.calls:
        _assert_cuda_layouts(call)
        _v2_check(call)  # shapes and outer-dim-major strides exactly as torch states them
        assert not call["ok"]  # CPU has no blockwise kernel: it raised, and the layer fell back
    assert all(p.startswith("fallback:ValueError") for p in layer.gemm_paths.values()), layer.gemm_paths


@needs_cpu_kernel
def test_failed_kernel_configuration_is_not_retried():
    _layer_fwd_bwd("block")
    _, trace, _ = _layer_fwd_bwd("block")
    assert trace.calls == []  # the first run's ValueError is remembered per configuration


@needs_cpu_kernel
@pytest.mark.parametrize("name", ["current", "rowwise", "block", "mxfp8"])
def test_scaled_mm_path_matches_emulated_numerics(name):
    _, _, scaled = _layer_fwd_bwd(name)
    torch.manual_seed(0)
    linear = torch.nn.Linear(K, N)
    layer = Fp8Linear.from_linear(linear, recipe(name, backend="emulated"))
    x = torch.randn(M, K, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn(M, N))
    for got, want in zip(scaled, (y.detach(), x.grad, layer.weight.grad)):
        # rowwise CPU kernels return bf16: one bf16 rounding of the result; the rest agree to fp32 order
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


@needs_cpu_kernel
def test_mxfp8_reaches_the_mx_kernel_call_and_reports_the_cpu_refusal():
    layer, _, _ = _layer_fwd_bwd("mxfp8")
    # the MX kind is planned (1x32 E8M0 scales, swizzled); this CPU's torch has no MX kernel and says so
    assert all(p.startswith("fallback:ValueError") for p in layer.gemm_paths.values()), layer.gemm_paths


def _block_operands(m, k, n):
    a = Fp8Operand(torch.ones(m, k).to(torch.float8_e4m3fn), torch.ones(m, k // 128), (1, 128))
    w = Fp8Operand(torch.ones(n, k).to(torch.float8_e4m3fn), torch.ones(n // 128, k // 128), (128, 128))
    return a, w.t()


def test_a_kernel_refusal_is_remembered_per_shape_not_per_kind():
    if not scaled_gemm.HAS_SCALED_MM_V2:
        pytest.skip("blockwise falls back before any kernel call without torch.nn.functional.scaled_mm")
    scaled_gemm._kernel_answers.clear()
    traces = []
    for shape in ((128, 256, 128), (128, 256, 128), (256, 512, 256)):
        trace = KernelTrace()
        with trace:
            fp8_mm(*_block_operands(*shape), "scaled_mm", out_dtype=torch.bfloat16)
        traces.append(len(trace.calls))
    # first shape: tried (CPU refuses blockwise); again: remembered; a new shape: tried again
    assert traces[0] >= 1 and traces[1] == 0 and traces[2] >= 1, traces


@needs_cpu_kernel
def test_forward_fast_accum_and_dtype_and_bias_go_to_the_kernel():
    layer, trace, _ = _layer_fwd_bwd("current", fast_accum_forward=True)
    fast = [c["named"]["use_fast_accum"] for c in trace.calls]
    assert fast == [True, False, False]  # forward only: the backward GEMMs keep the precise accumulation
    _, trace, _ = _layer_fwd_bwd("current", fast_accum_forward=False)
    assert trace.calls[0]["named"]["use_fast_accum"] is False
    # block scales: cuBLAS refuses fast accumulation with 1x128 / 128x128 tiles, so it is never asked for
    _, trace, _ = _layer_fwd_bwd("block", fast_accum_forward=True)
    assert trace.calls and all(c["named"]["use_fast_accum"] is False for c in trace.calls)


@needs_cpu_kernel
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gemm_returns_the_callers_dtype_with_bias(out_dtype):
    g = torch.Generator().manual_seed(3)
    a = Fp8Operand((torch.randn(48, 64, generator=g) * 8).to(torch.float8_e4m3fn), torch.tensor(0.5))
    b = Fp8Operand((torch.randn(32, 64, generator=g) * 8).to(torch.float8_e4m3fn), torch.tensor(0.25)).t()
    bias = torch.randn(32, generator=g)
    trace = KernelTrace()
    with trace:
        out = fp8_mm(a, b, "scaled_mm", out_dtype=out_dtype, bias=bias)
    assert out.dtype == out_dtype
    reference = (a.data.double() * 0.5) @ (b.data.double() * 0.25) + bias.double()
    tol = (2 ** -7 if out_dtype == torch.bfloat16 else 1e-5) * reference.abs().max().item()
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=tol)
    (call,) = trace.calls
    kernel_out_dtype = call["named"]["out_dtype"]
    assert kernel_out_dtype == out_dtype  # straight from the GEMM, no conversion kernel after it
    kernel_bias = call["named"]["bias"]
    assert (kernel_bias is not None) == (out_dtype == torch.bfloat16)  # no kernel fuses bias into fp32 output


@pytest.mark.parametrize("shape, fp8_kernel", [((33, 64, 32), True), ((48, 40, 32), False), ((48, 64, 24), False)])
def test_shape_rule_is_k_and_n_multiples_of_16(shape, fp8_kernel):
    m, k, n = shape
    a = Fp8Operand(torch.ones(m, k).to(torch.float8_e4m3fn), torch.tensor(1.0))
    b = Fp8Operand(torch.ones(n, k).to(torch.float8_e4m3fn), torch.tensor(1.0)).t()
    kind, reason = scaled_mm_kind(a, b)
    assert (kind == "tensorwise") == fp8_kernel, reason


def test_one_per_tensor_scale_and_one_per_row_scale_is_the_rowwise_kernel():
    """Tensorwise needs both scales per tensor; with one of them per row (either side) the rowwise kernel runs
    (the per-tensor scale broadcast along its rows or columns)."""
    rows = Fp8Operand(torch.ones(32, 64).to(torch.float8_e4m3fn), torch.full((32, 1), 2.0))
    whole = Fp8Operand(torch.ones(32, 64).to(torch.float8_e4m3fn), torch.tensor(1.0))
    w_rows = Fp8Operand(torch.ones(48, 64).to(torch.float8_e4m3fn), torch.full((48, 1), 2.0)).t()
    w_whole = Fp8Operand(torch.ones(48, 64).to(torch.float8_e4m3fn), torch.tensor(1.0)).t()
    assert scaled_mm_kind(whole, w_whole) == ("tensorwise", "")
    assert scaled_mm_kind(rows, w_whole) == ("rowwise", "")
    assert scaled_mm_kind(whole, w_rows) == ("rowwise", "")
    assert scaled_mm_kind(rows, w_rows) == ("rowwise", "")


def test_blockwise_scale_layouts_are_outer_dim_major():
    g = torch.Generator().manual_seed(1)
    a = Fp8Operand(torch.zeros(M, K).to(torch.float8_e4m3fn), torch.rand(M, K // 128, generator=g), (1, 128))
    w = Fp8Operand(torch.zeros(N, K).to(torch.float8_e4m3fn), torch.rand(N // 128, K // 128, generator=g),
                   (128, 128))
    args = scaled_mm_arguments(a, w.t(), "blockwise_1x128_128x128")
    assert args["scale_a"].shape == (M, K // 128) and args["scale_a"].stride() == (1, M)
    l4 = -(-(K // 128) // 4) * 4
    assert args["scale_b"].shape == (l4, N // 128) and args["scale_b"].stride() == (1, l4)
    # the values: scale_b[k, n] is the scale of weight tile (n, k); padding rows are never read
    torch.testing.assert_close(args["scale_b"][:K // 128], w.scale.t())
    torch.testing.assert_close(args["scale_a"], a.scale)


def test_fnuz_refused_on_ocp_gpus_and_allowed_emulated(monkeypatch):
    fnuz = ("e4m3fnuz", "e4m3fnuz", "e5m2fnuz")
    with pytest.raises(ValueError, match="FNUZ"):
        check_dialect(fnuz, "cuda")
    check_dialect(("e4m3fn", "e4m3fn", "e5m2"), "cuda")  # OCP on an OCP GPU: fine
    with pytest.raises(ValueError) as caught:  # the message lists the formats as given, '/'-joined
        check_dialect(("e4m3fnuz", "e5m2fnuz"), "cuda")
    assert str(caught.value) == ("formats e4m3fnuz/e5m2fnuz are FNUZ (AMD MI300): this GPU's FP8 tensor cores use "
                                 "OCP formats; use e4m3fn/e5m2, or backend='emulated' to study FNUZ numerics")
    with pytest.raises(ValueError, match="FNUZ"):  # auto on a (pretended) capable OCP device: refused clearly
        resolve_backend("auto", "cpu", fnuz)
    for module in (gemm, gemm_choice):  # (fp8_mm's check, the backend choice)
        monkeypatch.setattr(module, "scaled_mm_available", lambda device: False)
    assert resolve_backend("auto", "cpu", fnuz) == "emulated"
    layer = Fp8Linear(64, 64, recipe=recipe("current", input_format="e4m3fnuz", weight_format="e4m3fnuz",
                                            grad_output_format="e5m2fnuz"))
    assert layer(torch.randn(4, 64)).shape == (4, 64)  # FNUZ numerics stay available emulated


@needs_cpu_kernel
def test_cached_weight_is_made_column_major_once_per_weight_version():
    """grad_input = grad_output @ weight reads the (N, K) weight column-major: the copy is made with the cached
    FP8 weight, not once per micro-batch."""
    layer = Fp8Linear(K, N, recipe=recipe("current", backend="scaled_mm"))
    pointers = []
    for _ in range(2):  # two micro-batches, same weight version
        trace = KernelTrace()
        with trace:
            layer(torch.randn(M, K, requires_grad=True)).sum().backward()
        mat_b = trace.calls[1]["args"][1]  # the grad_input call's weight operand
        assert mat_b.stride(0) == 1  # column-major
        pointers.append(mat_b.data_ptr())
    assert pointers[0] == pointers[1]


def test_planning_for_a_gpu_computes_the_fallback_with_its_bias():
    """Under target_gpu no kernel runs: the result is dequant(a) @ dequant(b) + bias (exact here: every product
    and sum is a small integer) and the record says which kernel the GPU would take."""
    a = Fp8Operand(torch.full((16, 32), 2.0).to(torch.float8_e4m3fn), torch.tensor(1.5))
    w = Fp8Operand(torch.full((48, 32), 0.5).to(torch.float8_e4m3fn), torch.tensor(4.0))
    bias = torch.arange(48, dtype=torch.float32)
    record = {}
    with scaled_gemm.target_gpu((9, 0)):
        out = scaled_gemm.scaled_mm_gemm(a, w.t(), bias=bias, record=record, gemm="output")
    assert record == {"output": "scaled_mm:tensorwise"}
    expected = torch.full((16, 48), 32 * (2.0 * 1.5) * (0.5 * 4.0)) + bias  # 32 products of 3 x 2 = 192, + bias
    assert out.dtype == torch.float32 and torch.equal(out, expected)


def test_a_bf16_only_kernel_output_comes_back_in_the_callers_dtype(monkeypatch):
    """Some torch builds give a kernel a bf16 output only: the fp32 request is refused, the bf16 retry runs, and
    its result is converted to the fp32 the caller asked for. The device is stood in for by a kernel that
    refuses fp32 outputs (the answer a GPU build gives), so this holds on any CPU. Values are small integers
    times powers of two: exact in bf16, so the result is exact."""
    asked = []

    def bf16_only_kernel(args, out_dtype, bias, fast_accum):
        asked.append(out_dtype)
        if out_dtype != torch.bfloat16:
            raise RuntimeError("this kernel writes bf16 only")
        a_values, b_values = args["mat_a"].float() * args["scale_a"], args["mat_b"].float() * args["scale_b"]
        return (a_values @ b_values).to(torch.bfloat16)

    monkeypatch.setattr(scaled_gemm, "call_scaled_mm", bf16_only_kernel)
    a = Fp8Operand(torch.full((16, 32), 3.0).to(torch.float8_e4m3fn), torch.tensor(0.5))
    w = Fp8Operand(torch.full((48, 32), 2.0).to(torch.float8_e4m3fn), torch.tensor(0.25))
    record = {}
    out = scaled_gemm.scaled_mm_gemm(a, w.t(), out_dtype=torch.float32, record=record, gemm="output")
    assert asked == [torch.float32, torch.bfloat16]
    assert record == {"output": "scaled_mm:tensorwise"}
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.full((16, 48), 32 * (3.0 * 0.5) * (2.0 * 0.25)))  # 32 products of 1.5 x 0.5 = 24


@pytest.mark.skipif(not scaled_gemm.HAS_SCALED_MM_V2, reason="blockwise kinds need torch.nn.functional.scaled_mm")
@pytest.mark.parametrize("capability, named", [((8, 9), "sm89"), ((10, 0), "sm100"), ((12, 1), "sm121")])
def test_blockwise_off_hopper_names_the_gpu(capability, named):
    a, w_t = _block_operands(M, K, N)
    assert scaled_mm_kind(a, w_t, capability) == (
        None, "blockwise_1x128_128x128 (DeepSeek-style 1x128 / 128x128 scales) needs sm90 (Hopper): torch runs it "
              f"on sm90 only; this GPU is {named}")
    assert scaled_mm_kind(a, w_t, (9, 0)) == ("blockwise_1x128_128x128", "")


@pytest.mark.parametrize("kind", ["blockwise_1x128_128x128", "blockwise_128x128_1x128"])
def test_padded_block_scales_are_made_on_the_operands_device(kind):
    """The padded 128x128 scale grid is built where the scales are (a GPU in real use; the meta device here, which
    holds shapes and strides but no data): made elsewhere, the copy of the scales into it would fail."""
    m = k = n = 256
    tile = (128, 128) if kind.startswith("blockwise_128x128") else (1, 128)
    a = Fp8Operand(torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta"),
                   torch.empty(m // tile[0], k // 128, device="meta"), tile)
    w_tile = (128, 128) if kind.endswith("128x128") else (1, 128)
    w = Fp8Operand(torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta"),
                   torch.empty(n // w_tile[0], k // 128, device="meta"), w_tile)
    args = scaled_mm_arguments(a, w.t(), kind)
    padded = args["scale_b"] if kind == "blockwise_1x128_128x128" else args["scale_a"]
    assert padded.device.type == "meta"
    assert padded.shape == (4, 2) and padded.stride() == (1, 4)  # K/128 = 2 rounded up to 4; 2 tiles of 128 rows


def test_swizzled_mx_scales_pad_with_code_127():
    """swizzle_scales pads a ragged (R, C) E8M0 grid to 128x4 tiles with code 127 (2^0); the real scale (r, c)
    sits in tile (r // 128, c // 4) at 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4 (cuBLAS's layout)."""
    from fp8train.nn.scaled_mm_rules import swizzle_scales
    rows, cols = 40, 5  # one row tile, two column tiles: 1024 codes, 200 real
    codes = (torch.arange(rows * cols) % 100 + 1).to(torch.uint8).reshape(rows, cols)  # 1..100: never 127
    out = swizzle_scales(codes.view(torch.float8_e8m0fnu)).view(torch.uint8)
    expected = [127] * 1024
    for r in range(rows):
        for c in range(cols):
            expected[(c // 4) * 512 + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4] = int(codes[r, c])
    assert out.tolist() == expected
    assert out.tolist().count(127) == 1024 - 200


def test_ocp_formats_refused_on_an_fnuz_gpu_with_the_formats_named(monkeypatch):
    """The other direction of the dialect check (an MI300 given OCP formats), its message exactly."""
    monkeypatch.setattr(scaled_gemm, "fp8_dialect_of", lambda device_type, index: "fnuz")
    check_dialect(("e4m3fnuz", "e5m2fnuz"), "cuda")  # FNUZ on an FNUZ GPU: fine
    with pytest.raises(ValueError) as caught:
        check_dialect(("e4m3fn", "e5m2"), "cuda")
    assert str(caught.value) == ("formats e4m3fn/e5m2 are OCP: this GPU (MI300) has FNUZ FP8 tensor cores; "
                                 "use e4m3fnuz/e5m2fnuz, or backend='emulated'")


def test_tiles_no_kernel_takes_are_named_in_the_refusal():
    """1x32 input tiles against 128x128 weight tiles: no scaled_mm kernel exists; the reason names both tiles."""
    a = Fp8Operand(torch.ones(128, 256).to(torch.float8_e4m3fn), torch.ones(128, 8), (1, 32))
    w = Fp8Operand(torch.ones(128, 256).to(torch.float8_e4m3fn), torch.ones(1, 2), (128, 128))
    assert scaled_mm_kind(a, w.t()) == (None, "scales vary along K in tiles (1, 32) x (128, 128), which no kernel "
                                              "takes")


def test_a_plan_the_kernel_takes_carries_an_empty_reason():
    """A planned call's reason is '' (the string the layer's record and the fallback message are built from)."""
    from fp8train.nn.scaled_mm_rules import scaled_mm_call

    a = Fp8Operand(torch.ones(32, 64).to(torch.float8_e4m3fn), torch.tensor(1.0))
    w = Fp8Operand(torch.ones(48, 64).to(torch.float8_e4m3fn), torch.tensor(1.0))
    plan = scaled_mm_call(a, w.t(), out_dtype=torch.bfloat16, bias=None, use_fast_accum=False)
    assert plan.kind == "tensorwise" and plan.reason == "" and plan.shape == (32, 64, 48)
