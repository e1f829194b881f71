"""The experts' grouped GEMMs on torch's grouped FP8 kernel, `torch._scaled_grouped_mm`, where the plan allows it.

nn/scaled_grouped_mm_rules.py decides per GEMM (output, grad_input, grad_weight) whether the kernel can take it on
the GPU at hand; this module turns the experts' FP8 operands into that call's arguments and makes the call. The
operands are the ones the per-expert loop multiplies (each expert's bytes and scales from its own quantizers,
nn/experts_function.py), laid side by side as the plan's table says:

    2d x 3d (output, grad_input): mat_a = the experts' token rows one after another (routed, K) with one scale per
        row; mat_b = the experts' right operands stacked (E, K, N), column-major, with one scale per expert and
        column (E, N). A tensorwise scale becomes that expert's rows (or columns) all equal: the kernel multiplies
        row scale x column scale into each fp32 sum, as the emulation does.
    2d x 2d (grad_weight): mat_a = (N, routed), the experts' (N, T_e) side by side, scales (E * N,); mat_b =
        (routed, K) column-major, scales (E * K,); out (E, N, K), zero for an expert without tokens.

Only the rowwise kind (float32 scales, sm90) is assembled. The MX kind (sm100) needs each group's E8M0 scales in
the kernel's padded, swizzled block layout; that is not built, so an MXFP8 plan runs the per-expert loop and says
so. Every call goes through `call_scaled_grouped_mm`, the one place torch's kernel is called, and the suite
replays it on meta tensors with arguments assembled here from a real CPU quantization
(tests/test_scaled_grouped_mm_replay.py), where torch's own meta checks judge them. None of this has run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8train.nn.recipes import GemmRole
from fp8train.nn.scaled_gemm import device_capability, planning_for_gpu
from fp8train.nn.scaled_grouped_mm_rules import GROUPED_KINDS, GroupedGemmCall, grouped_gemm_call

__all__ = ["grouped_plan", "grouped_arguments", "call_scaled_grouped_mm", "run_grouped", "GroupedCall",
           "ASSEMBLED_KINDS"]

ASSEMBLED_KINDS = GROUPED_KINDS[:1]  # the grouped kinds ("rowwise") this module builds arguments for (module docstring)


def grouped_plan(recipe, gemm: str, sizes: list[int], n: int, k: int, out_dtype: torch.dtype, bias: bool,
                 device: torch.device) -> GroupedGemmCall:
    """The plan of one grouped GEMM on `device` (a CUDA GPU), with the MX kind turned into its fallback here."""
    capability = device_capability(device) or (0, 0)
    # (mslk=True: an MX plan on sm100 is then named as such below, whether or not this torch has the MSLK kernels,
    # which is not probed: MX is not assembled either way)
    plan = grouped_gemm_call(recipe, gemm, sizes, n, k, out_dtype, bias, capability, mslk=True)
    if plan.kind is not None and plan.kind not in ASSEMBLED_KINDS:
        return GroupedGemmCall(plan.gemm, None, f"{plan.kind}: its per-group scale layout is not assembled",
                               experts=plan.experts)
    return plan


def _scale_vector(op, dim: int, length: int) -> torch.Tensor:
    """An operand's scale along its `dim` (0: one per row, 1: one per column) as a (length,) fp32 vector; a
    tensorwise scale repeated. (The plan admits only scales constant along the contracted dim.)"""
    scale = op.scale
    if scale.dim() == 0:
        return scale.reshape(1).expand(length)
    if scale.numel() != length or scale.shape[1 - dim] != 1:
        raise RuntimeError(f"internal error: a grouped GEMM operand's scale {tuple(scale.shape)} is not one per "
                           f"{'row' if dim == 0 else 'column'} of {length}")
    return scale.reshape(length)


def grouped_arguments(plan: GroupedGemmCall, a_ops: list, b_ops: list, sizes: list[int], n: int, k: int,
                      use_fast_accum: bool) -> dict:
    """The keyword arguments of the planned call from per-expert operands: `a_ops[e]` (T_e, contracted) or, for
    grad_weight, (N, T_e), None for an expert without tokens; `b_ops[e]` (contracted, cols) or, for grad_weight,
    (T_e, K); for the 2d x 3d GEMMs every expert's b (None: an expert whose weight was not quantized, no rows)."""
    experts = len(sizes)
    device = next(op for op in a_ops if op is not None).scale.device
    fp8 = next(op for op in a_ops if op is not None).data.dtype
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)
    present = [e for e in range(experts) if sizes[e]]
    if plan.gemm == GemmRole.GRAD_WEIGHT:  # (N, T) row-major @ (T, K) column-major -> (E, N, K)
        ones_n, ones_k = torch.ones(n, device=device), torch.ones(k, device=device)
        mat_a = torch.cat([a_ops[e].data for e in present], dim=1)
        mat_b = torch.cat([b_ops[e].data.t() for e in present], dim=1).t()
        scale_a = torch.cat([_scale_vector(a_ops[e], 0, n) if sizes[e] else ones_n for e in range(experts)])
        scale_b = torch.cat([_scale_vector(b_ops[e], 1, k) if sizes[e] else ones_k for e in range(experts)])
    else:  # (routed, contracted) row-major @ (E, contracted, cols) column-major -> (routed, cols)
        contracted, cols = a_ops[present[0]].shape[1], n if plan.gemm == GemmRole.OUTPUT else k
        absent = torch.zeros(cols, contracted, dtype=fp8, device=device)
        mat_a = torch.cat([a_ops[e].data for e in present])
        mat_b = torch.stack([absent if b_ops[e] is None else b_ops[e].data.t() for e in range(experts)]).transpose(1, 2)
        scale_a = torch.cat([_scale_vector(a_ops[e], 0, sizes[e]) for e in present])
        scale_b = torch.stack([torch.ones(cols, device=device) if b_ops[e] is None else
                               _scale_vector(b_ops[e], 1, cols) for e in range(experts)])
    return dict(mat_a=mat_a, mat_b=mat_b, scale_a=scale_a.float().contiguous(),
                scale_b=scale_b.float().contiguous(), offs=offs, out_dtype=torch.bfloat16,
                use_fast_accum=use_fast_accum)


def call_scaled_grouped_mm(plan: GroupedGemmCall, args: dict) -> torch.Tensor:
    """The one call of torch's grouped FP8 kernel (the replay test calls it on meta tensors): arguments from
    `grouped_arguments`, checked against the plan's shapes and strides first (a mismatch is an internal error)."""
    for name, planned in (("mat_a", plan.mat_a), ("mat_b", plan.mat_b)):
        got = (tuple(args[name].shape), tuple(args[name].stride()))
        if got != (tuple(planned[0]), tuple(planned[1])):
            raise RuntimeError(f"internal error: grouped {plan.gemm} {name} is {got}, planned {planned}")
    for name, planned in (("scale_a", plan.scale_a), ("scale_b", plan.scale_b)):
        if tuple(args[name].shape) != tuple(planned):
            raise RuntimeError(f"internal error: grouped {plan.gemm} {name} is {tuple(args[name].shape)}, "
                               f"planned {planned}")
    # torch's grouped FP8 GEMM has no public name in torch 2.13
    return torch._scaled_grouped_mm(args["mat_a"], args["mat_b"], args["scale_a"], args["scale_b"],
                                    offs=args["offs"], out_dtype=args["out_dtype"],
                                    use_fast_accum=args["use_fast_accum"])


@dataclass(frozen=True)
class GroupedCall:
    """A grouped call planned for a GPU that is not here (scaled_gemm.target_gpu): the plan and the arguments
    the call would get (on the device the operands are on). `kind` and `reason` are the plan's."""

    plan: GroupedGemmCall
    args: dict

    @property
    def kind(self):
        return self.plan.kind

    @property
    def reason(self) -> str:
        return self.plan.reason


def run_grouped(plan: GroupedGemmCall, args: dict) -> torch.Tensor | None:
    """The grouped GEMM's bf16 result from the kernel, or None while `target_gpu` plans for a GPU that is not
    here: the call is then appended to its plans list as (gemm, GroupedCall), and the caller computes the result
    with the per-expert fallback, as scaled_mm_gemm does."""
    target = planning_for_gpu()
    if target is None:
        return call_scaled_grouped_mm(plan, args)
    if target[1] is not None:
        target[1].append((plan.gemm, GroupedCall(plan, args)))
    return None
