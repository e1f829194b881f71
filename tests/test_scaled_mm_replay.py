"""The exact scaled-matmul calls fp8train would make on an H100 (sm90) and a B200 (sm100), replayed on meta tensors.

For every recipe, a real Fp8Linear forward and backward runs on this CPU under `target_gpu(capability)`: each of
its three GEMMs is planned for that GPU (kind, argument layouts, scales, output dtype, bias, fast accumulation)
without running a kernel. Every planned call is then made for real on meta tensors with the same shapes, strides
and dtypes, so torch's own meta checks (`torch._meta_registrations`, which assume CUDA for meta tensors) judge
it, and it is held to the CUDA-only rules below, which those meta functions do not model. Each rule cites where
torch states it (torch 2.11 / 2.13 sources):

R1  Fast accumulation is refused with 1x128 and 128x128 block scales: aten/src/ATen/cuda/CUDABlas.cpp,
    get_scale_mode(): TORCH_CHECK(!use_fast_accum, "scaled_gemm doesn't support fast accum with 1x128 blockwise
    scaling") (likewise 128x128); the MX path ignores it (_scaled_mxfp8_mxfp8 passes use_fast_accum=false).
R2  Dtype pairings: "Multiplication of two Float8_e5m2 matrices is not supported" (ScaledBlas.cpp,
    _scaled_mm_cuda_v2_out); rowwise through CUTLASS (sm89, sm100: ScaledBlas.cpp _scaled_rowwise_rowwise) wants
    the second operand in e4m3fn ("For RowWise scaling the second input is required to be a float8_e4m3fn dtype",
    RowwiseScaledMM.cu).
R3  Blockwise and MX operands are float8_e4m3fn, both of them: ScaledBlasUtils.cpp check_deepseek_recipe and
    check_mxfp8_recipe ("both types must be fp8" tests type == Float8_e4m3fn; anything else is "Invalid scaling
    configuration"); blockwise scales are fp32, MX scales float8_e8m0fnu (is_blockwise_1x32_scaling).
R8  Rowwise output dtype: cuBLAS takes rowwise scales on sm9x only; elsewhere torch uses CUTLASS, which asserts
    "Only bf16 and fp16 high precision output types are supported for row-wise scaling" (ScaledBlas.cpp).
R4  K and N are multiples of 16 ("Expected trailing dimension of mat1 to be divisible by 16", "mat2 shape ... must
    be divisible by 16", _scaled_mm_cuda_v2_out); blockwise kinds need whole 128-tiles along the dims they tile.
R5  Scale shapes and strides: 1x128 (M, K/128) stride (1, M); 128x128 (L4, M/128) stride (1, L4) with L4 = K/128
    rounded up to 4 (_scaled_block1x128_block128x128, _scaled_block128x128_block1x128); MX: round_up(M, 128) *
    round_up(K/32, 4) elements, contiguous, SWIZZLE_32_4_4 ("For Blockwise scaling both scales should be
    contiguous", "scale_a must be swizzled to SWIZZLE_32_4_4 format", _scaled_mxfp8_mxfp8).
R6  Architecture: DeepSeek-style 1x128 / 128x128 scaling "only supported in CUDA for SM90" (_check_deepseek_support);
    MX GEMMs need sm100 or newer (torch/testing/_internal/common_cuda.py: PLATFORM_SUPPORTS_MX_GEMM = SM100OrLater).
R7  Bias: "Bias is not supported when out_dtype is set to Float32"; "Bias must be BFloat16 to compute BFloat16
    output" (_scaled_mm_cuda_v2_out).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from fp8train.nn.linear import Fp8Linear
from fp8train.nn.recipes import RECIPE_NAMES, recipe
from fp8train.nn.scaled_gemm import HAS_SCALED_MM_V2, call_scaled_mm, target_gpu
from fp8train.nn.scaled_mm_rules import swizzle_scales

pytestmark = [pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(not HAS_SCALED_MM_V2, reason="plans blockwise / MX calls for F.scaled_mm")]

M, K, N = 256, 512, 384  # tokens, in_features, out_features: whole 128-tiles
GPUS = {"sm90": (9, 0), "sm100": (10, 0)}
GEMMS = ("output", "grad_input", "grad_weight")
# What each recipe's GEMMs reach, from R1-R7 (not from the planner): kinds, or the fallback's reason.
EXPECTED = {
    "delayed": {"sm90": ["tensorwise"] * 3, "sm100": ["tensorwise"] * 3},
    "current": {"sm90": ["tensorwise"] * 3, "sm100": ["tensorwise"] * 3},
    "rowwise": {"sm90": ["rowwise"] * 3, "sm100": ["rowwise"] * 3},
    "block": {"sm90": ["blockwise_1x128_128x128", "blockwise_1x128_128x128", "blockwise_1x128_1x128"],
              "sm100": ["needs sm90"] * 3},
    "mxfp8": {"sm90": ["needs sm100"] * 3, "sm100": ["mx_1x32"] * 3},
}
BLOCK_RECIPES = {"BlockWise1x128", "BlockWise128x128"}


def _meta(t):
    """A meta tensor of the same shape, strides and dtype (what the kernel's checks look at)."""
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _cuda_rule_violations(args: dict, out_dtype, bias, fast_accum: bool, capability) -> list[str]:
    """R1-R7 above for one planned call (arguments already on meta)."""
    a, b, sa, sb = args["mat_a"], args["mat_b"], args["scale_a"], args["scale_b"]
    (m, k), n = a.shape, b.shape[1]
    recipes = {args["recipe_a"], args["recipe_b"]}
    problems = []
    if fast_accum and (recipes & BLOCK_RECIPES or "BlockWise1x32" in recipes):
        problems.append("R1: fast accumulation with block scales")
    if a.dtype == b.dtype == torch.float8_e5m2:
        problems.append("R2: e5m2 x e5m2")
    if recipes == {"RowWise"} and capability[0] != 9 and b.dtype != torch.float8_e4m3fn:
        problems.append("R2: CUTLASS rowwise needs an e4m3fn second operand")
    e4m3_both = a.dtype == b.dtype == torch.float8_e4m3fn
    if recipes & BLOCK_RECIPES and not (e4m3_both and sa.dtype == sb.dtype == torch.float32):
        problems.append("R3: blockwise operands must be e4m3fn x e4m3fn with fp32 scales")
    if "BlockWise1x32" in recipes and not (e4m3_both and sa.dtype == sb.dtype == torch.float8_e8m0fnu):
        problems.append("R3: MX operands must be e4m3fn x e4m3fn with e8m0 scales")
    if recipes == {"RowWise"} and capability[0] != 9 and out_dtype not in (torch.bfloat16, torch.float16):
        problems.append("R8: CUTLASS rowwise (not sm9x) gives bf16 / fp16 outputs only")
    if k % 16 or n % 16:
        problems.append("R4: K and N must be multiples of 16")
    l4 = -(-(k // 128) // 4) * 4
    for name, scale, rec, outer in (("a", sa, args["recipe_a"], m), ("b", sb, args["recipe_b"], n)):
        if rec == "BlockWise1x128" and (tuple(scale.shape) != (outer, k // 128) or scale.stride(0) != 1
                                        or (scale.shape[1] > 1 and scale.stride(1) != outer) or k % 128):
            problems.append(f"R5: scale_{name} 1x128 must be ({outer}, {k // 128}) stride (1, {outer})")
        if rec == "BlockWise128x128" and (tuple(scale.shape) != (l4, outer // 128) or scale.stride(0) != 1
                                          or (scale.shape[1] > 1 and scale.stride(1) != l4) or outer % 128):
            problems.append(f"R5: scale_{name} 128x128 must be ({l4}, {outer // 128}) stride (1, {l4})")
        if rec == "BlockWise1x32":
            numel = -(-outer // 128) * 128 * -(-(-(-k // 32)) // 4) * 4
            if scale.numel() != numel or not scale.is_contiguous() or args.get("swizzle") != "SWIZZLE_32_4_4":
                problems.append(f"R5: scale_{name} MX must hold {numel} swizzled contiguous E8M0 scales")
    if recipes & BLOCK_RECIPES and capability[0] != 9:
        problems.append("R6: 1x128 / 128x128 block scales need sm90")
    if "BlockWise1x32" in recipes and capability < (10, 0):
        problems.append("R6: MX needs sm100")
    if bias is not None and (out_dtype == torch.float32 or bias.dtype != out_dtype):
        problems.append("R7: a fused bias needs a bf16/fp16 output of its own dtype")
    return problems


def _planned_layer_calls(name: str, capability, autocast: bool, **overrides):
    torch.manual_seed(0)
    layer = Fp8Linear(K, N, bias=True, recipe=recipe(name, **{"backend": "scaled_mm", **overrides}))
    x = torch.randn(M, K, requires_grad=True)
    plans = []
    with target_gpu(capability, plans), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
        y.float().sum().backward()
    return layer, plans, y


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("name", RECIPE_NAMES)
@pytest.mark.parametrize("autocast", [True, False], ids=["bf16-autocast", "fp32"])
def test_every_gemm_call_passes_torch_meta_checks_and_cuda_rules(name, gpu, autocast):
    capability = GPUS[gpu]
    layer, plans, y = _planned_layer_calls(name, capability, autocast)
    assert [gemm for gemm, _ in plans] == list(GEMMS)
    out_dtypes = {"output": y.dtype, "grad_input": torch.float32, "grad_weight": torch.float32}
    for (gemm, plan), expected in zip(plans, EXPECTED[name][gpu]):
        path = layer.gemm_paths[gemm]
        if plan.kind is None:  # a fallback says why, without anything having run
            assert expected in plan.reason and path == f"fallback:{plan.reason}", (gemm, path)
            continue
        assert plan.kind == expected and path == f"scaled_mm:{plan.kind}", (gemm, path)
        args = {key: _meta(v) if isinstance(v, torch.Tensor) else v for key, v in plan.args.items()}
        request_dtype, fuse_bias = plan.requests[0]  # the call the GPU is asked first
        cutlass_rowwise = plan.kind == "rowwise" and capability[0] != 9  # R8: bf16 out, widened afterwards
        assert request_dtype == (torch.bfloat16 if cutlass_rowwise else out_dtypes[gemm])
        bias = _meta(layer.bias.detach().to(request_dtype)) if fuse_bias else None
        assert fuse_bias == (gemm == "output" and request_dtype == torch.bfloat16)
        out = call_scaled_mm(args, request_dtype, bias, plan.fast_accum)  # torch's meta checks raise here
        assert out.device.type == "meta" and tuple(out.shape) == plan.shape[::2] and out.dtype == request_dtype
        assert _cuda_rule_violations(args, request_dtype, bias, plan.fast_accum, capability) == [], (gemm, plan)
        # the forward asks for fast accumulation (recipe default) where the kernel takes it, never elsewhere
        assert plan.fast_accum == (gemm == "output" and plan.kind in ("tensorwise", "rowwise")), gemm


def test_block_forward_runs_fp8_with_fast_accumulation_off_on_sm90():
    assert recipe("block").fast_accum_forward  # the default asks for it; the 1x128 kernels refuse it (R1)
    layer, plans, _ = _planned_layer_calls("block", GPUS["sm90"], autocast=True)
    gemm, plan = plans[0]
    assert gemm == "output" and plan.kind == "blockwise_1x128_128x128" and plan.fast_accum is False
    assert layer.gemm_paths["output"] == "scaled_mm:blockwise_1x128_128x128"


def test_mxfp8_below_sm100_says_needs_sm100():
    layer, _, _ = _planned_layer_calls("mxfp8", (9, 0), autocast=True)
    assert all("needs sm100" in path for path in layer.gemm_paths.values()), layer.gemm_paths


def test_mx_scale_swizzle_matches_the_cublas_layout():
    """cuBLAS's 1D block-scaling-factor layout, written out element by element: scale (r, c) of an (R, C) grid
    lives in 128x4 tile (r // 128, c // 4), tiles stored row of tiles after row of tiles, and inside a tile at
    16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4 (torch's tests build the same with common_quantized.to_blocked,
    which needs torch's test-only dependencies)."""
    rows, cols = 200, 6  # ragged in both directions: padding to 256 x 8
    codes = torch.randint(100, 150, (rows, cols), dtype=torch.uint8)
    grid = codes.view(torch.float8_e8m0fnu)
    swizzled = swizzle_scales(grid).view(torch.uint8)
    col_tiles = -(-cols // 4)
    assert swizzled.numel() == 256 * 8 and swizzled.is_contiguous()
    for r in range(rows):
        for c in range(cols):
            offset = ((r // 128) * col_tiles + c // 4) * 512 + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4
            assert swizzled[offset] == codes[r, c], (r, c)


def test_swizzle_takes_fp32_power_of_two_scales_as_e8m0_codes():
    scales = torch.tensor([[2.0 ** -127, 1.0, 2.0 ** 10, 0.5]])  # E8M0 codes 0, 127, 137, 126
    swizzled = swizzle_scales(scales).view(torch.uint8)
    assert swizzled[:4].tolist() == [0, 127, 137, 126]


def test_fp32_output_never_fuses_the_bias():
    layer, plans, _ = _planned_layer_calls("current", GPUS["sm90"], autocast=False)
    assert all(not fuse for _, plan in plans for _, fuse in plan.requests)


def test_target_gpu_refuses_a_capability_without_fp8():
    with pytest.raises(ValueError, match=r"\(8, 9\)"):
        with target_gpu((8, 0)):
            pass


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("name,role", [("block", "grad_output"), ("mxfp8", "grad_output"), ("block", "input")])
def test_block_and_mx_never_plan_a_kernel_for_e5m2_operands(name, role, gpu):
    """R3: every GEMM that takes the e5m2 operand falls back at plan time, naming e4m3fn; the others still plan.
    (The recipe is built for backend 'auto', as a config would: 'scaled_mm' refuses it, see below.)"""
    layer, plans, _ = _planned_layer_calls(name, GPUS[gpu], True, backend="auto", **{f"{role}_format": "e5m2"})
    takes = {"grad_output": ("grad_input", "grad_weight"), "input": ("output", "grad_weight")}[role]
    for gemm, plan in plans:
        if gemm in takes:
            assert plan.kind is None and "e4m3fn for both operands" in plan.reason, (gemm, plan.reason)
            assert layer.gemm_paths[gemm] == f"fallback:{plan.reason}"
        elif plan.kind is not None:
            args = {key: _meta(v) if isinstance(v, torch.Tensor) else v for key, v in plan.args.items()}
            assert _cuda_rule_violations(args, plan.requests[0][0], None, plan.fast_accum, GPUS[gpu]) == []


@pytest.mark.parametrize("name", ["block", "mxfp8"])
def test_scaled_mm_backend_refuses_e5m2_with_block_or_mx_scales(name):
    with pytest.raises(ValueError, match=r"grad_output_format must be e4m3fn .*backend='scaled_mm'.*got 'e5m2'"):
        recipe(name, grad_output_format="e5m2", backend="scaled_mm")
    assert recipe(name, grad_output_format="e5m2", backend="emulated").grad_output_format == "e5m2"


def _bf16_rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(t.dtype)


@pytest.mark.parametrize("gpu", ["sm89", "sm90", "sm100"])
def test_rowwise_fp32_backward_rounds_to_bf16_where_cutlass_runs_it(gpu):
    """R8, modelled: under target_gpu, rowwise grad_input / grad_weight (fp32 GEMM outputs) are bf16-rounded on
    sm89 and sm100 (CUTLASS) and exact fp32 on sm90 (cuBLAS), compared with the plain emulation of the same layer."""
    capability = {"sm89": (8, 9), "sm90": (9, 0), "sm100": (10, 0)}[gpu]
    torch.manual_seed(0)
    layer = Fp8Linear(K, N, bias=False, recipe=recipe("rowwise", backend="auto"))
    reference = Fp8Linear(K, N, bias=False, recipe=recipe("rowwise", backend="emulated"))
    reference.load_state_dict(layer.state_dict())
    x = torch.randn(M, K)
    grads = []
    for module, planned in ((layer, True), (reference, False)):
        x_leaf = x.clone().requires_grad_(True)
        with target_gpu(capability) if planned else contextlib.nullcontext():
            module(x_leaf).sum().backward()
        grads.append((x_leaf.grad, module.weight.grad))
    (gi, gw), (gi_ref, gw_ref) = grads
    if gpu == "sm90":
        assert torch.equal(gi, gi_ref) and torch.equal(gw, gw_ref)
    else:
        assert not torch.equal(gi, gi_ref)  # the bf16 rounding shows
        assert torch.equal(gi, _bf16_rounded(gi_ref)) and torch.equal(gw, _bf16_rounded(gw_ref))
