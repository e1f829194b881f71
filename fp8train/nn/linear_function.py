"""The autograd Function behind Fp8Linear: the forward GEMM from FP8 operands, and a backward that quantizes
grad_output and runs the two backward GEMMs from the saved FP8 input and the layer's cached FP8 weight.

Everything recipe-specific goes through the layer's per-role quantizers (``layer.quantizers[role]``: quantize,
quantize_transposed, saved_operand; fp8train.nn.quantizer) and its GEMM options (``layer.gemm_options``), so the
three GEMMs read top to bottom here while the scaling rules stay in one place.
Shapes: input (M, K), weight (N, K), grad_output (M, N).
"""

from __future__ import annotations

import torch

from fp8train.nn.gemm import (Fp8Operand, emulated_compute_dtype, fp8_mm, gemm_compute_dtype,
                               native_gemm_reads_bytes, tile_values_dtype)
from fp8train.nn.recipes import GemmRole, OperandRole
from fp8train.numerics.quant import Fp8Tensor

__all__ = ["Fp8LinearFunction", "WeightFp8", "to_dtype", "values_to_keep"]


class Fp8LinearFunction(torch.autograd.Function):
    """output = input @ weight.T (+ bias) from FP8 operands; backward quantizes grad_output and runs the two
    backward GEMMs from the saved FP8 input and the (cached) FP8 weight."""

    @staticmethod
    def forward(ctx, input_2d, weight, bias, weights: "WeightFp8", layer, backend, out_dtype):
        r, input_quantizer = layer.recipe, layer.quantizers[OperandRole.INPUT]
        input_fp8 = input_quantizer.quantize(input_2d, keep_values=values_to_keep(
            layer, OperandRole.INPUT, backend, out_dtype, input_2d.device, fp32_too=False))
        input_op = Fp8Operand.from_fp8_tensor(input_fp8)
        # (M, N) in out_dtype straight from the GEMM; bias fused into it where the kernel can
        output = fp8_mm(input_op, weights.op_t, backend, out_dtype=out_dtype, bias=bias, gemm=GemmRole.OUTPUT,
                        use_fast_accum=r.fast_accum_forward, **layer.gemm_options(input_2d.device))
        # Saved in FP8: bytes + scales only (the weight's operands live in the layer's cache, made once per
        # weight version). When grad_weight contracts the input's first dim across its scale layout, the saved
        # copy is the input quantized along that dim instead (recipes.requantize_transposed): one byte per element.
        input_saved = input_fp8
        ctx.input_transposed = r.requantize_transposed(OperandRole.INPUT) and weight.requires_grad
        if ctx.input_transposed:
            input_saved = input_quantizer.quantize_transposed(input_2d, keep_values=False)   # (K, M), bytes only
        input_scale = input_saved.scale
        if torch.compiler.is_compiling():  # may be a view of a traced intermediate: dynamo must own what is saved
            input_scale = input_scale.clone()
        ctx.save_for_backward(input_saved.data, input_scale, weights.fp8.data, weights.fp8.scale)
        ctx.input_block = input_saved.block if input_saved.granularity == "block" else None
        ctx.weights, ctx.layer, ctx.backend = weights, layer, backend
        ctx.input_dtype, ctx.weight_dtype = input_2d.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_data, input_scale, _, _ = ctx.saved_tensors
        layer, backend, r, weights = ctx.layer, ctx.backend, ctx.layer.recipe, ctx.weights
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_input = grad_weight = grad_bias = None
        options = layer.gemm_options(grad_output.device)
        grad_output_quantizer = layer.quantizers[OperandRole.GRAD_OUTPUT]
        # grad_weight's result is fp32 for fp32 master weights: it reads fp32 values, or bf16 ones where the
        # native bf16 -> fp32 GEMM runs (gemm.gemm_compute_dtype); grad_output's own copy serves it unless
        # grad_output is requantized along the other axis for it
        grad_weight_reads = gemm_compute_dtype(emulated_compute_dtype(grad_output.device, layer.emulated_dtype),
                                               ctx.weight_dtype, grad_output.device)
        grad_output_fp32_too = need_weight and not r.requantize_transposed(OperandRole.GRAD_OUTPUT) \
            and grad_weight_reads == torch.float32
        with torch.autocast(grad_output.device.type, enabled=False):
            grad_output_fp8 = grad_output_quantizer.quantize(grad_output, keep_values=values_to_keep(
                layer, OperandRole.GRAD_OUTPUT, backend, ctx.input_dtype, grad_output.device,
                fp32_too=grad_output_fp32_too))
            grad_output_op = Fp8Operand.from_fp8_tensor(grad_output_fp8)            # (M, N)
            if need_input:    # grad_input = grad_output @ weight          (M, N) @ (N, K)
                grad_input = fp8_mm(grad_output_op, weights.op_for_grad_input, backend, out_dtype=ctx.input_dtype,
                                    gemm=GemmRole.GRAD_INPUT, **options)
            if need_weight:   # grad_weight = grad_output.T @ input        (N, M) @ (M, K)
                grad_output_t_op = grad_output_op.t()
                if r.requantize_transposed(OperandRole.GRAD_OUTPUT):
                    grad_output_t_op = Fp8Operand.from_fp8_tensor(grad_output_quantizer.quantize_transposed(
                        grad_output, keep_values=values_to_keep(layer, OperandRole.GRAD_OUTPUT, backend,
                                                                ctx.weight_dtype, grad_output.device,
                                                                fp32_too=False)))   # (N, M), scales along N
                input_op = layer.quantizers[OperandRole.INPUT].saved_operand(
                    input_data, input_scale, ctx.input_block, values_to_keep(
                        layer, OperandRole.INPUT, backend, ctx.weight_dtype, grad_output.device,
                        fp32_too=False))  # (M, K), or (K, M)
                if ctx.input_transposed:
                    input_op = input_op.t()
                grad_weight = fp8_mm(grad_output_t_op, input_op, backend, out_dtype=ctx.weight_dtype,
                                     gemm=GemmRole.GRAD_WEIGHT, **options)
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


def values_to_keep(layer, role: str, backend: str, out_dtype: torch.dtype, device, fp32_too: bool):
    """Which copies of an operand's FP8 values its emulated GEMM (output `out_dtype`) reads, for quantize's
    ``keep_values``: none (scaled_mm; or fp8train's native GEMM, which reads the bytes: gemm.native_gemm_reads_bytes),
    fp32 (True), or where torch's bf16 GEMM reads them (gemm.gemm_compute_dtype) the bf16 copy, alone or with the
    fp32 one (``fp32_too``: grad_output's for grad_weight), both written in the quantizer's one pass."""
    if backend != "emulated":
        return False
    if layer.recipe.accumulator_bits:
        return True  # (the Hopper accumulation model reads fp32 values)
    if layer.recipe.granularity_of(role) == "block":  # the bytes (native GEMM), or value * scale in fp32 (True)
        return tile_values_dtype(device, layer.emulated_dtype) == torch.float32
    compute_dtype = emulated_compute_dtype(device, layer.emulated_dtype)
    if native_gemm_reads_bytes(compute_dtype, out_dtype, device):
        return False
    if gemm_compute_dtype(compute_dtype, out_dtype, device) != torch.bfloat16:
        return True
    return (torch.float32, torch.bfloat16) if fp32_too else torch.bfloat16


def to_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor if tensor.dtype == dtype else tensor.to(dtype)  # a no-op .to() is still a dispatched op
