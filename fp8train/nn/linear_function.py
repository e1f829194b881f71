"""The autograd Function behind Fp8Linear: the forward GEMM from FP8 operands, and a backward that quantizes
grad_output and runs the two backward GEMMs from the saved FP8 input and the layer's cached FP8 weight.

Everything recipe-specific goes through the layer's per-role quantizers (``layer.quantizers[role]``: quantize,
quantize_transposed, saved_operand; fp8train.nn.quantizer) and its dispatch (nn/linear_dispatch.py: what each
quantize keeps and the GEMMs, resolved once per device and dtypes), so the three GEMMs read top to bottom here
while the scaling rules stay in one place.
Shapes: input (M, K), weight (N, K), grad_output (M, N).
"""

from __future__ import annotations

import torch

from fp8train.nn.fp8_operand import Fp8Operand
from fp8train.nn.recipes import OperandRole
from fp8train.numerics.names import Granularity
from fp8train.numerics.quant import Fp8Tensor

__all__ = ["Fp8LinearFunction", "WeightFp8", "to_dtype"]


class Fp8LinearFunction(torch.autograd.Function):
    """output = input @ weight.T (+ bias) from FP8 operands; backward quantizes grad_output and runs the two
    backward GEMMs from the saved FP8 input and the (cached) FP8 weight. `dispatch` (linear_dispatch.LayerDispatch)
    holds what the layer resolved once for this device and these dtypes: what each quantize keeps, the GEMMs."""

    @staticmethod
    def forward(ctx, input_2d, weight, bias, weights: "WeightFp8", layer, dispatch, out_dtype):
        input_quantizer = layer.quantizers[OperandRole.INPUT]
        input_fp8 = input_quantizer.quantize(input_2d, keep_values=dispatch.input_keeps.value)
        # (M, N) in out_dtype straight from the GEMM; bias fused into it where the kernel can
        output = dispatch.output_mm(Fp8Operand.from_fp8_tensor(input_fp8), weights.op_t, bias=bias)
        # Saved in FP8: bytes + scales only (the weight's operands live in the layer's cache, made once per
        # weight version). When grad_weight contracts the input's first dim across its scale layout, the saved
        # copy is the input quantized along that dim instead (recipes.requantize_transposed): one byte per element.
        input_saved = input_fp8
        ctx.input_transposed = dispatch.input_transposed and weight.requires_grad
        if ctx.input_transposed:
            input_saved = input_quantizer.quantize_transposed(input_2d, keep_values=False)   # (K, M), bytes only
        input_scale = input_saved.scale
        if torch.compiler.is_compiling():  # may be a view of a traced intermediate: dynamo must own what is saved
            input_scale = input_scale.clone()
        ctx.save_for_backward(input_saved.data, input_scale, weights.fp8.data, weights.fp8.scale)
        ctx.input_block = input_saved.block if input_saved.granularity == Granularity.BLOCK else None
        ctx.weights, ctx.layer, ctx.dispatch = weights, layer, dispatch
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        device_type = grad_output.device.type
        if torch.is_autocast_enabled(device_type):  # a backward run inside autocast: our GEMMs pick their precision
            with torch.autocast(device_type, enabled=False):
                return _backward(ctx, grad_output)
        return _backward(ctx, grad_output)  # (autocast off already: no context to enter, ~3 us a layer)


def _backward(ctx, grad_output):
    """Fp8LinearFunction.backward with autocast off: quantize grad_output, then grad_input, grad_weight, grad_bias."""
    input_data, input_scale, _, _ = ctx.saved_tensors
    layer, d, weights = ctx.layer, ctx.dispatch, ctx.weights
    need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
    grad_input = grad_weight = grad_bias = None
    grad_output_quantizer = layer.quantizers[OperandRole.GRAD_OUTPUT]
    # (grad_output's fp32 copy serves grad_weight too where that GEMM reads fp32: LayerDispatch)
    keeps = d.grad_output_keeps_for_both if need_weight else d.grad_output_keeps
    grad_output_fp8 = grad_output_quantizer.quantize(grad_output, keep_values=keeps.value)
    grad_output_op = Fp8Operand.from_fp8_tensor(grad_output_fp8)            # (M, N)
    if need_input:    # grad_input = grad_output @ weight          (M, N) @ (N, K)
        grad_input = d.grad_input_mm(grad_output_op, weights.op_for_grad_input)
    if need_weight:   # grad_weight = grad_output.T @ input        (N, M) @ (M, K)
        grad_output_t_op = grad_output_op.t()
        if d.grad_output_transposed:   # (N, M), scales along N
            grad_output_t_op = Fp8Operand.from_fp8_tensor(grad_output_quantizer.quantize_transposed(
                grad_output, keep_values=d.grad_output_t_keeps.value))
        input_op = layer.quantizers[OperandRole.INPUT].saved_operand(
            input_data, input_scale, ctx.input_block, d.saved_input_keeps.value)  # (M, K), or (K, M)
        if ctx.input_transposed:
            input_op = input_op.t()
        grad_weight = d.grad_weight_mm(grad_output_t_op, input_op)
    if need_bias:     # grad_bias = sum over rows, fp32, from the unquantized gradient
        grad_bias = to_dtype(grad_output.sum(0, dtype=torch.float32), ctx.bias_dtype)
    return grad_input, grad_weight, grad_bias, None, None, None, None


class WeightFp8:
    """The weight's FP8 copy and the operands its GEMMs read, made once per weight version: `op_t` (K, N) for
    output = input @ weight.T, `op_for_grad_input` (N, K) for grad_input = grad_output @ weight (requantized along
    K when the recipe's scales would otherwise vary along that GEMM's contracted dim)."""

    __slots__ = ("key", "fp8", "op_t", "op_for_grad_input")

    def __init__(self, key, fp8: Fp8Tensor, op_t: Fp8Operand, op_for_grad_input: Fp8Operand):
        self.key, self.fp8, self.op_t, self.op_for_grad_input = key, fp8, op_t, op_for_grad_input


def to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)  # a no-op .to() is still a dispatched op
