"""The grouped FP8 calls fp8train would make for its experts on an H100/H200 (sm90) and a B200 (sm100), planned on
this CPU (nn/scaled_grouped_mm_rules.py) and replayed on meta tensors, so torch's own meta checks
(`torch._meta_registrations._meta_grouped_mm_common`) judge every planned call; the fallbacks whose rule those
checks state are shown to be refused by them when forced. The expected kinds come from the rules G1-G6 of the
planner's docstring, written out here, not from the planner."""

from __future__ import annotations

import pytest
import torch

from fp8train.nn.recipes import RECIPE_NAMES, recipe
from fp8train.nn.scaled_grouped_mm_rules import grouped_gemm_call, grouped_gemm_calls

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
