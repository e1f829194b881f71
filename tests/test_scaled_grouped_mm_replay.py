"""The grouped FP8 calls fp8train would make for its experts on an H100/H200 (sm90) and a B200 (sm100), planned on
this CPU (nn/scaled_grouped_mm_rules.py) and replayed on meta tensors, so torch's own meta checks
(`torch._meta_registrations._meta_grouped_mm_common`) judge every planned call; the fallbacks whose rule those
checks state are shown to be refused by them when forced. The expected kinds come from the rules G1-G6 of the
planner's docstring, written out here, not from the planner."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8train.nn.recipes import RECIPE_NAMES, GemmRole, recipe
from fp8train.nn.scaled_grouped_mm_rules import grouped_gemm_call

pytestmark = pytest.mark.usefixtures("single_thread")

N, K = 512, 1024
SIZES = [64, 0, 160, 32, 256]     # T = 512: whole 16s and 32s, a zero-token expert
GPUS = {"sm90": ((9, 0), False), "sm100": ((10, 0), True)}
GEMMS = ("output", "grad_input", "grad_weight")
# bf16 activations (autocast), bf16 master weights: which kernel each GEMM reaches (None: the fallback)
EXPECTED_BF16_WEIGHTS = {
    "delayed": {"sm90": ["rowwise", None, None], "sm100": [None] * 3},   # e5m2 gradient (G1); sm90 only (G5)
    "current": {"sm90": ["rowwise", None, None], "sm100": [None] * 3},
    "rowwise": {"sm90": ["rowwise"] * 3, "sm100": [None] * 3},
    "block": {"sm90": [None] * 3, "sm100": [None] * 3},                   # no block form (G2)
    "mxfp8": {"sm90": [None] * 3, "sm100": ["mx_1x32"] * 3},              # sm100 with MSLK (G5)
}
OUT_SHAPES = {"output": (sum(SIZES), N), "grad_input": (sum(SIZES), K), "grad_weight": (len(SIZES), N, K)}


def grouped_gemm_calls(recipe, group_sizes, n, k, activation_dtype, weight_dtype, bias, capability, mslk=False):
    """The calls of the three GEMMs: output and grad_input in the activations' dtype, grad_weight in the weight's."""
    dtypes = {GemmRole.OUTPUT: activation_dtype, GemmRole.GRAD_INPUT: activation_dtype,
              GemmRole.GRAD_WEIGHT: weight_dtype}
    return {gemm: grouped_gemm_call(recipe, gemm, group_sizes, n, k, dtype, bias, capability, mslk)
            for gemm, dtype in dtypes.items()}


def _replay(plan):
    out = torch._scaled_grouped_mm(**plan.arguments("meta"))
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == OUT_SHAPES[plan.gemm]


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_every_planned_call_passes_torchs_meta_checks(name, gpu):
    capability, mslk = GPUS[gpu]
    plans = grouped_gemm_calls(recipe(name), SIZES, N, K, torch.bfloat16, torch.bfloat16, False, capability, mslk)
    assert [plans[g].kind for g in GEMMS] == EXPECTED_BF16_WEIGHTS[name][gpu]
    for plan in plans.values():
        if plan.kind is None:
            assert plan.reason
        else:
            _replay(plan)


@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_fp32_master_weights_and_fp32_activations_fall_back(name):
    capability, mslk = GPUS["sm90" if name == "rowwise" else "sm100"]
    plans = grouped_gemm_calls(recipe(name), SIZES, N, K, torch.bfloat16, torch.float32, False, capability, mslk)
    assert plans["grad_weight"].kind is None and "bf16 only" in plans["grad_weight"].reason
    _replay(plans["output"])
    plans = grouped_gemm_calls(recipe(name), SIZES, N, K, torch.float32, torch.float32, False, capability, mslk)
    assert all(p.kind is None for p in plans.values())


def test_shapes_the_kernel_cannot_take_fall_back_with_their_rule():
    rowwise, sm90 = recipe("rowwise"), (9, 0)
    assert "G3" in grouped_gemm_call(rowwise, "output", SIZES, N + 8, K, torch.bfloat16, False, sm90).reason
    odd = [5, 0, 131, 33]  # T = 169: grad_weight's token stride is no multiple of 16
    assert "G3" in grouped_gemm_call(rowwise, "grad_weight", odd, N, K, torch.bfloat16, False, sm90).reason
    _replay_odd = grouped_gemm_call(rowwise, "output", odd, N, K, torch.bfloat16, False, sm90)
    assert _replay_odd.kind == "rowwise"  # 2d x 3d: any group sizes
    out = torch._scaled_grouped_mm(**_replay_odd.arguments("meta"))
    assert tuple(out.shape) == (169, N)
    assert "G4" in grouped_gemm_call(rowwise, "output", SIZES, N, K, torch.bfloat16, True, sm90).reason
    mx = grouped_gemm_call(recipe("mxfp8"), "grad_weight", [48, 464], N, K, torch.bfloat16, False, (10, 0), True)
    assert "G6" in mx.reason


def _forced(plan_ok, **change):
    args = plan_ok.arguments("meta")
    args.update(change)
    return args


def test_the_rules_behind_the_fallbacks_are_torchs():
    """Each fallback whose rule torch's meta function states is refused by it when the call is forced."""
    ok = grouped_gemm_call(recipe("rowwise"), "grad_weight", SIZES, N, K, torch.bfloat16, False, (9, 0))
    torch._scaled_grouped_mm(**ok.arguments("meta"))
    e5m2 = ok.arguments("meta")["input"].to(torch.float8_e5m2)
    refusals = {
        "G1 e5m2 operand": _forced(ok, input=e5m2),
        "G4 fp32 output": _forced(ok, out_dtype=torch.float32),
        "G4 bias": _forced(ok, bias=torch.empty(N, device="meta", dtype=torch.bfloat16)),
        "G2 block-shaped scales": _forced(ok, scale_a=torch.empty(len(SIZES) * N, 4, device="meta")),
    }
    t = 169  # G3: a token stride that is no multiple of 16 bytes
    refusals["G3 stride"] = _forced(ok, input=torch.empty(N, t, dtype=torch.float8_e4m3fn, device="meta"),
                                    mat2=torch.empty(K, t, dtype=torch.float8_e4m3fn, device="meta").t())
    for rule, args in refusals.items():
        with pytest.raises(RuntimeError):
            torch._scaled_grouped_mm(**args)
        assert rule


def test_a_real_experts_step_is_planned_for_its_own_groups():
    """The group sizes of a real routed batch (skewed, one empty expert) plan and replay like the table."""
    from fp8train.nn.experts import Fp8GroupedLinear, group_sizes

    layer = Fp8GroupedLinear(4, 64, 32, recipe="rowwise")
    offs = torch.tensor([48, 48, 80, 96], dtype=torch.int32)
    x = torch.randn(96, 64, requires_grad=True)
    layer(x, offs).sum().backward()
    sizes = group_sizes(offs, 96, 4)
    plans = grouped_gemm_calls(layer.recipe, sizes, 32, 64, torch.bfloat16, torch.bfloat16, False, (9, 0))
    for plan in plans.values():
        assert plan.kind == "rowwise"
        out = torch._scaled_grouped_mm(**plan.arguments("meta"))
        assert out.shape[-1] == (32 if plan.gemm == "output" else 64)


# ---- the calls the experts layer makes: planned on this CPU (target_gpu), replayed on meta tensors -------------
def _planned_calls(name, sizes, weight_dtype=torch.bfloat16, bias=False, capability=(9, 0)):
    """A real Fp8GroupedLinear step (backend scaled_mm, bf16 autocast) planned for `capability`: the grouped
    calls it would make there, with the arguments it assembled from its own quantized operands, and the layer."""
    from fp8train.nn.experts import Fp8GroupedLinear
    from fp8train.nn.experts_scaled_gemm import GroupedCall
    from fp8train.nn.scaled_gemm import target_gpu

    torch.manual_seed(0)
    layer = Fp8GroupedLinear(len(sizes), 128, 64, bias=bias, recipe=recipe(name, backend="scaled_mm"))
    layer.to(weight_dtype)
    x = (torch.randn(sum(sizes), 128) * torch.linspace(0.5, 4, sum(sizes)).view(-1, 1)).bfloat16().requires_grad_(True)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
    plans = []
    with target_gpu(capability, plans):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x, offs)
        y.backward(torch.randn_like(y) * 1e-2)
    calls = {gemm: call for gemm, call in plans if isinstance(call, GroupedCall)}
    return calls, layer, x, y


def _meta(args):
    return {key: value.to("meta") if isinstance(value, torch.Tensor) else value for key, value in args.items()}


# which GEMMs reach the grouped kernel on sm90 (bf16 activations and master weights; rules G1-G5)
GROUPED_ON_SM90 = {"delayed": ["output"], "current": ["output"], "rowwise": list(GEMMS), "block": [], "mxfp8": []}


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_the_layers_own_grouped_calls_pass_torchs_meta_checks(name):
    from fp8train.nn.experts_scaled_gemm import call_scaled_grouped_mm

    calls, layer, _, _ = _planned_calls(name, SIZES_LAYER)
    assert sorted(calls) == sorted(GROUPED_ON_SM90[name])
    for gemm, call in calls.items():
        out = call_scaled_grouped_mm(call.plan, _meta(call.args))  # torch's own meta function judges the call
        expected = {"output": (sum(SIZES_LAYER), 64), "grad_input": (sum(SIZES_LAYER), 128),
                    "grad_weight": (len(SIZES_LAYER), 64, 128)}[gemm]
        assert out.dtype == torch.bfloat16 and tuple(out.shape) == expected
        assert layer.scaling.grouped_paths[gemm] == "scaled_grouped_mm:rowwise"
    for gemm in set(GEMMS) - set(calls):  # the others say why they run per expert
        assert layer.scaling.grouped_paths[gemm].startswith("per_expert:")


SIZES_LAYER = [48, 0, 80, 13, 115]   # T = 256: a zero-token expert, a group of 13 (2d x 3d takes any size)


def _grouped_reference(call) -> np.ndarray:
    """What torch's grouped kernel computes from these arguments, written from its documented semantics in
    float64: per group g, (rows of mat_a of g * their scales) @ (mat_b of g * its scales)."""
    a = call.args["mat_a"].float().double().numpy()
    b = call.args["mat_b"].float().double().numpy()
    sa, sb = call.args["scale_a"].double().numpy(), call.args["scale_b"].double().numpy()
    ends = call.args["offs"].tolist()
    starts = [0] + ends[:-1]
    if call.plan.gemm == "grad_weight":  # (N, T) @ (T, K) per group of T -> (E, N, K)
        n, k = a.shape[0], b.shape[1]
        return np.stack([(a[:, s:t] * sa[g * n:(g + 1) * n, None]) @ (b[s:t] * sb[None, g * k:(g + 1) * k])
                         for g, (s, t) in enumerate(zip(starts, ends))])
    return np.concatenate([(a[s:t] * sa[s:t, None]) @ (b[g] * sb[g][None, :])
                           for g, (s, t) in enumerate(zip(starts, ends))])


@pytest.mark.parametrize("name", ["current", "rowwise"])
def test_the_assembled_arguments_compute_what_the_per_expert_loop_computes(name):
    """The grouped call's arguments, evaluated by the kernel's documented semantics, give the layer's results
    (computed per expert by the fallback): right rows, right experts, right scales, zero-token expert included."""
    calls, layer, x, y = _planned_calls(name, SIZES_LAYER)
    results = {"output": y, "grad_input": x.grad, "grad_weight": layer.weight.grad}
    for gemm, call in calls.items():
        expected = _grouped_reference(call)
        got = results[gemm].detach().double().numpy()
        if gemm == "grad_weight":
            got = got.copy()
            got[SIZES_LAYER.index(0)] = 0  # (a group without tokens: the layer writes zeros)
        scale = np.abs(expected).max()
        assert np.abs(got - expected).max() <= 2 ** -7 * scale, gemm  # bf16 rounding of the results


def test_mxfp8_on_sm100_says_its_scales_are_not_assembled_and_runs_per_expert():
    calls, layer, _, _ = _planned_calls("mxfp8", SIZES_LAYER, capability=(10, 0))
    assert calls == {}
    paths = layer.scaling.grouped_paths
    assert all(paths[g] == "per_expert:mx_1x32: its per-group scale layout is not assembled"
               for g in ("output", "grad_input"))
    assert "G6" in paths["grad_weight"]  # (a group of 13 tokens: 1x32 blocks along tokens would straddle experts)
    assert all(path.startswith(("scaled_mm:", "fallback:")) for path in layer.scaling.gemm_paths.values())
