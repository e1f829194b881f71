"""Every expert's FP8 weight in one call under the rowwise, block and MX recipes (emulated GEMMs, fp8train's native
kernel): the tiled counterpart of nn/experts_weights.py's tensorwise one.

An expert's FP8 weight is what its dense layer makes (Fp8Linear._weight_fp8): its (N, K) weight quantized with
the role's scales (one per output channel, 128 x 128 tiles, MX's 1 x 32 blocks along K), and, where the recipe
requantizes the weight for grad_input (rowwise, MX: scales along K would vary along that GEMM's contracted N),
its transpose quantized along N. None of those tiles spans two experts: the (E, N, K) weight quantized as one
batch of E matrices (block tiles), or as E * N rows (row and MX scales), gives each expert the bytes, scales and
amaxes of its own call, and the transposed copies come from one native grouped call over the E groups of N rows
(numerics/native_groups.py). The non-finite amax counter is kept per expert, as its quantizer keeps it.

Where the GEMM reads the values in bf16 they are kept in bf16 straight away (the dense layer keeps fp32 values
and converts them: the same values, exact in bf16), so no fp32 copy of the weight is written.
"""

from __future__ import annotations

import math

import torch

from fp8train.nn.gemm import Fp8Operand
from fp8train.nn.gemm_choice import Keep
from fp8train.nn.linear_function import WeightFp8
from fp8train.nn.recipes import OperandRole
from fp8train.numerics.fp8_tensor import Fp8Tensor
from fp8train.numerics.mx import quantize_mx
from fp8train.numerics.names import Granularity
from fp8train.numerics.native_groups import quantize_group_transposes
from fp8train.numerics.quant import quantize

__all__ = ["tiled_applies", "tiled_experts_fp8"]


def tiled_applies(scaling) -> bool:
    """Whether the weight's recipe role takes this path (row or block scales, current scaling)."""
    q = scaling.experts[0].quantizers[OperandRole.WEIGHT]
    return not (q.tensorwise or q.delayed) and q.granularity in (Granularity.ROW, Granularity.BLOCK)


def tiled_experts_fp8(scaling, weight: torch.Tensor, dispatch, key) -> list[WeightFp8] | None:
    """Each expert's WeightFp8 (what its view's _weight_fp8 makes, `key` as its cache key) from one quantize
    call over `weight` (E, N, K) (and one grouped call for the transposed copies), or None where the grouped call
    does not take the weight."""
    experts, n, k = weight.shape
    q = scaling.experts[0].quantizers[OperandRole.WEIGHT]
    keep, blocked = dispatch.weight_keeps, q.granularity is Granularity.BLOCK
    if keep not in (Keep.BYTES, Keep.FP32, Keep.BF16):
        return None
    tiles = blocked and not q.mx  # a batch of E (N, K) matrices; row and MX scales: E * N rows
    # the copy the GEMMs read, as OperandQuantizer.quantize keeps it: block tiles keep value * scale where fp32
    # values are asked for; row scales keep bf16 values straight away where the GEMMs read bf16 (docstring)
    dequantized = blocked and keep is Keep.FP32
    keep_values = False if dequantized else torch.bfloat16 if (
        keep is Keep.FP32 and not blocked and dispatch.compute_dtype == torch.bfloat16) else keep.value
    transposed = None
    if dispatch.weight_transposed:
        keep_fp32, keep_bf16 = (False, True) if keep_values is torch.bfloat16 else (keep_values is True, False)
        transposed = quantize_group_transposes(weight.view(experts * n, k), [n] * experts, q.format, q.granularity,
                                               q.block, q.margin, q.pow2, q.mx, keep_fp32, keep_bf16, dequantized)
        if transposed is None:
            return None
    if q.mx:
        fp8 = quantize_mx(weight.view(experts * n, k), q.format, kernel="native", keep_values=keep_values,
                          keep_dequantized=dequantized)
    else:
        source = weight if tiles else weight.view(experts * n, k)
        fp8 = quantize(source, q.format, granularity=q.granularity, block=q.block, margin=q.margin, pow2=q.pow2,
                       kernel="native", keep_values=keep_values, keep_dequantized=dequantized)
    amax = fp8.amax.view(experts, -1)
    nonfinite = (amax < math.inf).logical_not().any(dim=1)  # (amaxes are >= 0 or NaN)
    scaling.weight_nonfinite_amax_count.add_(nonfinite)
    grid = fp8.scale.shape[-2:] if tiles else (n, -1)
    weights = []
    for e in range(experts):
        part = (lambda t: t[e]) if tiles else (lambda t: t.view(experts, n, -1)[e])
        expert_fp8 = Fp8Tensor(part(fp8.data), fp8.scale.view(experts, *grid)[e], fp8.fmt, fp8.granularity,
                               fp8.block, fp8.axis, fp8.amax.view(experts, *grid)[e])
        expert_fp8.values = part(fp8.values_bf16 if keep_values is torch.bfloat16 else fp8.values) \
            if keep_values is not False else None
        if dequantized:
            expert_fp8.dequantized = part(fp8.dequantized)
        weight_op = Fp8Operand.from_fp8_tensor(expert_fp8)
        grad_op = weight_op if transposed is None else Fp8Operand.from_fp8_tensor(transposed[e]).t()
        weights.append(WeightFp8(key, expert_fp8, weight_op.t(), grad_op))
    return weights
