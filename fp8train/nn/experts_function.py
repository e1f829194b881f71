"""The autograd Function behind fp8_grouped_mm (nn/experts.py): every expert's three FP8 GEMMs in one node.

For expert e with token rows x_e (T_e, K) of the input, weight W_e (N, K) and grad_output rows dy_e (T_e, N):

    output[rows e]        = x_e    @ W_e.T  (+ b_e)   forward
    grad_input[rows e]    = dy_e   @ W_e               backward
    grad_weight[e]        = dy_e.T @ x_e               backward

Each expert's GEMMs are Fp8LinearFunction's (nn/linear_function.py) step for step: the same quantizer calls
(that expert's `ExpertView.quantizers`, so its own scales) and the same LayerDispatch (nn/linear_dispatch.py:
what each operand keeps, the GEMM callables), so the bits are the dense layer's. What one node changes is where
the results go: each GEMM writes straight into its rows of one preallocated output, grad_input or grad_weight
(fp8_mm's `into`), so no concatenation, split, unbind or stack runs, and an expert without tokens costs nothing
but the zeros of its grad_weight (and grad_bias) slice. Rows past the last group (routed to no expert) are zero in every result.
Under the tensorwise recipes every expert's token group of a GEMM input is quantized in one pass
(nn/experts_tokens.py: the same bytes and scales); under row, block and MX scales every routed row in one call,
and the copies quantized along the tokens for grad_weight in one grouped call (nn/experts_token_tiles.py). With
backend scaled_mm, a GEMM that torch's grouped FP8 kernel takes (nn/experts_scaled_gemm.py) runs as one call over
all experts instead of the per-expert GEMMs.
"""

from __future__ import annotations

import torch

from fp8train.nn.gemm import Fp8Operand
from fp8train.nn.linear_function import to_dtype
from fp8train.nn.experts_scaled_gemm import grouped_arguments, grouped_plan, run_grouped
from fp8train.nn.experts_tokens import batched_token_fp8
from fp8train.nn.experts_token_tiles import tiled_token_fp8, tiled_token_fp8_transposed
from fp8train.nn.recipes import GemmBackend, GemmRole, OperandRole
from fp8train.numerics.names import Granularity

__all__ = ["GroupedFp8Function"]


def _rows(sizes: list[int]):
    """(expert, start, end) of each expert that has tokens."""
    start = 0
    for expert, size in enumerate(sizes):
        if size:
            yield expert, start, start + size
        start += size


class GroupedFp8Function(torch.autograd.Function):
    """output (T, N) = every expert's rows through its own FP8 GEMM; backward: both gradients, the same way."""

    @staticmethod
    def forward(ctx, input, weight, bias, weights_fp8: list, scaling, sizes: list[int], dispatches: list,
                out_dtype: torch.dtype):
        routed, n, views = sum(sizes), weight.shape[1], scaling.experts
        output = torch.empty(input.shape[0], n, dtype=out_dtype, device=input.device)
        output[routed:].zero_()
        recipe, d0 = views[0].recipe, dispatches[0]  # (the execution settings are the owner's: one answer for all)
        plan = _plan(views, GemmRole.OUTPUT, sizes, weight.shape, out_dtype, bias is not None, d0.backend,
                     input.device)
        saved, blocks, transposed, input_ops = [], [], [], [None] * len(sizes)
        keep = d0.input_keeps.value
        # every group's tensorwise scale from one pass, or every group's row / tile scales from one call, where
        # that applies (nn/experts_tokens.py, nn/experts_token_tiles.py)
        inputs_fp8 = batched_token_fp8(scaling, OperandRole.INPUT, input, sizes, keep)
        if inputs_fp8 is None:
            inputs_fp8 = tiled_token_fp8(scaling, OperandRole.INPUT, input, sizes, keep)
        requantized = d0.input_transposed and weight.requires_grad
        inputs_t = tiled_token_fp8_transposed(scaling, OperandRole.INPUT, input, sizes, False) if requantized \
            else None
        for expert, start, end in _rows(sizes):
            view, weights, x_e = views[expert], weights_fp8[expert], input[start:end]
            input_quantizer = view.quantizers[OperandRole.INPUT]
            input_fp8 = input_quantizer.quantize(x_e, keep_values=keep) if inputs_fp8 is None else inputs_fp8[expert]
            input_ops[expert] = Fp8Operand.from_fp8_tensor(input_fp8)
            if plan is None:  # the per-expert GEMM, into its rows (else one grouped call below)
                dispatches[expert].output_mm(input_ops[expert], weights.op_t,
                                             bias=None if bias is None else bias[expert], into=output[start:end])
            # saved as the dense layer saves it: FP8 bytes + scales, in grad_weight's layout where that differs
            input_saved = input_fp8
            if requantized:
                input_saved = input_quantizer.quantize_transposed(x_e, keep_values=False) if inputs_t is None \
                    else inputs_t[expert]
            input_scale = input_saved.scale
            if torch.compiler.is_compiling():  # (as in Fp8LinearFunction: dynamo must own what is saved)
                input_scale = input_scale.clone()
            saved += [input_saved.data, input_scale, weights.fp8.data, weights.fp8.scale]
            blocks.append(input_saved.block if input_saved.granularity == Granularity.BLOCK else None)
            transposed.append(requantized)
        if plan is not None:
            weight_ops = [None if w is None else w.op_t for w in weights_fp8]
            _grouped_into(plan, views, input_ops, weight_ops, sizes, weight.shape, recipe.fast_accum_forward,
                          output[:routed], lambda e, start, end: dispatches[e].output_mm(
                              input_ops[e], weights_fp8[e].op_t, into=output[start:end]))
        ctx.save_for_backward(*saved)
        ctx.blocks, ctx.transposed, ctx.sizes = blocks, transposed, sizes
        ctx.weights_fp8, ctx.scaling, ctx.dispatches = weights_fp8, scaling, dispatches
        ctx.input_dtype, ctx.weight_dtype = input.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.weight_shape = weight.shape
        return output

    @staticmethod
    def backward(ctx, grad_output):
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        sizes, dispatches, device, views = ctx.sizes, ctx.dispatches, grad_output.device, ctx.scaling.experts
        d0 = dispatches[0]
        tokens, routed = grad_output.shape[0], sum(sizes)
        experts, n, k = ctx.weight_shape
        grad_input = grad_weight = grad_bias = None
        plans = {gemm: _plan(views, gemm, sizes, ctx.weight_shape, dtype, False, d0.backend, device)
                 if needed else None
                 for gemm, dtype, needed in ((GemmRole.GRAD_INPUT, ctx.input_dtype, need_input),
                                             (GemmRole.GRAD_WEIGHT, ctx.weight_dtype, need_weight))}
        if need_input:
            grad_input = torch.empty(tokens, k, dtype=ctx.input_dtype, device=device)
            grad_input[routed:].zero_()
        if need_weight:
            grad_weight = torch.empty(ctx.weight_shape, dtype=ctx.weight_dtype, device=device)
        if need_bias:
            grad_bias = torch.zeros(experts, n, dtype=torch.float32, device=device)
        saved, ops = ctx.saved_tensors, {"grad_output": {}, "grad_output_t": {}, "input": {}}
        # (grad_output's fp32 copy serves grad_weight too where that GEMM reads fp32: LayerDispatch)
        keep = (d0.grad_output_keeps_for_both if need_weight else d0.grad_output_keeps).value
        with torch.autocast(device.type, enabled=False):
            grads_fp8 = batched_token_fp8(ctx.scaling, OperandRole.GRAD_OUTPUT, grad_output, sizes, keep)
            if grads_fp8 is None:
                grads_fp8 = tiled_token_fp8(ctx.scaling, OperandRole.GRAD_OUTPUT, grad_output, sizes, keep)
            grads_t = tiled_token_fp8_transposed(ctx.scaling, OperandRole.GRAD_OUTPUT, grad_output, sizes,
                                                 d0.grad_output_t_keeps.value) \
                if need_weight and d0.grad_output_transposed else None
            for index, (expert, start, end) in enumerate(_rows(sizes)):
                input_data, input_scale = saved[4 * index], saved[4 * index + 1]
                view, weights = views[expert], ctx.weights_fp8[expert]
                d, dy_e = dispatches[expert], grad_output[start:end]
                grad_output_quantizer = view.quantizers[OperandRole.GRAD_OUTPUT]
                grad_output_fp8 = grad_output_quantizer.quantize(dy_e, keep_values=keep) if grads_fp8 is None \
                    else grads_fp8[expert]
                grad_output_op = ops["grad_output"][expert] = Fp8Operand.from_fp8_tensor(grad_output_fp8)  # (T_e, N)
                if need_input and plans[GemmRole.GRAD_INPUT] is None:
                    # grad_input rows of e = dy_e @ W_e           (T_e, N) @ (N, K)
                    d.grad_input_mm(grad_output_op, weights.op_for_grad_input, into=grad_input[start:end])
                if need_weight:   # grad_weight[e] = dy_e.T @ x_e               (N, T_e) @ (T_e, K)
                    grad_output_t_op = grad_output_op.t()
                    if d.grad_output_transposed:
                        grad_output_t_op = Fp8Operand.from_fp8_tensor(grad_output_quantizer.quantize_transposed(
                            dy_e, keep_values=d.grad_output_t_keeps.value) if grads_t is None else grads_t[expert])
                    input_op = view.quantizers[OperandRole.INPUT].saved_operand(
                        input_data, input_scale, ctx.blocks[index], d.saved_input_keeps.value)
                    if ctx.transposed[index]:
                        input_op = input_op.t()
                    ops["grad_output_t"][expert], ops["input"][expert] = grad_output_t_op, input_op
                    if plans[GemmRole.GRAD_WEIGHT] is None:
                        d.grad_weight_mm(grad_output_t_op, input_op, into=grad_weight[expert])
                if need_bias:     # fp32 sum over the expert's rows of the unquantized gradient
                    grad_bias[expert] = dy_e.sum(0, dtype=torch.float32)
            if plans[GemmRole.GRAD_INPUT] is not None:
                a_ops = [ops["grad_output"].get(e) for e in range(experts)]
                b_ops = [None if w is None else w.op_for_grad_input for w in ctx.weights_fp8]
                _grouped_into(plans[GemmRole.GRAD_INPUT], views, a_ops, b_ops, sizes, ctx.weight_shape, False,
                              grad_input[:routed], lambda e, start, end: dispatches[e].grad_input_mm(
                                  a_ops[e], b_ops[e], into=grad_input[start:end]))
            if plans[GemmRole.GRAD_WEIGHT] is not None:
                a_ops = [ops["grad_output_t"].get(e) for e in range(experts)]
                b_ops = [ops["input"].get(e) for e in range(experts)]
                _grouped_into(plans[GemmRole.GRAD_WEIGHT], views, a_ops, b_ops, sizes, ctx.weight_shape, False,
                              grad_weight, lambda e, start, end: dispatches[e].grad_weight_mm(
                                  a_ops[e], b_ops[e], into=grad_weight[e]))
        if need_weight:
            for expert, size in enumerate(sizes):
                if size == 0:  # no tokens: no GEMM ran, the gradient is zero
                    grad_weight[expert].zero_()
        if need_bias:
            grad_bias = to_dtype(grad_bias, ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


def _plan(views, gemm: str, sizes: list[int], weight_shape, out_dtype, bias: bool, backend: GemmBackend, device):
    """The grouped kernel's plan for this GEMM where it takes it (backend scaled_mm, tokens routed, the plan's
    rules: nn/experts_scaled_gemm.py), else None: the per-expert loop, and `grouped_paths[gemm]` says why."""
    if backend is not GemmBackend.SCALED_MM or not sum(sizes):
        return None
    plan = grouped_plan(views[0].recipe, gemm, sizes, weight_shape[1], weight_shape[2], out_dtype, bias, device)
    if plan.kind is None:
        views[0].grouped_paths[gemm] = f"per_expert:{plan.reason}"
        return None
    return plan


def _grouped_into(plan, views, a_ops, b_ops, sizes, weight_shape, use_fast_accum, out, per_expert) -> None:
    """One grouped call written into `out` (routed rows, or (E, N, K)); while target_gpu plans for a GPU that is
    not here, the call is recorded and `per_expert(e, start, end)` computes each expert instead."""
    _, n, k = weight_shape
    args = grouped_arguments(plan, a_ops, b_ops, sizes, n, k, use_fast_accum)
    result = run_grouped(plan, args)
    if result is None:
        for expert, start, end in _rows(sizes):
            per_expert(expert, start, end)
    else:
        out.copy_(result)
    views[0].gemm_paths[plan.gemm] = views[0].grouped_paths[plan.gemm] = f"scaled_grouped_mm:{plan.kind}"
