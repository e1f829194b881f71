"""Every expert's FP8 weight in one quantize call (tensorwise recipes, emulated GEMMs, fp8train's native kernel).

An expert's FP8 weight is what its dense layer would make (Fp8Linear._weight_fp8, through its ExpertView): one
tensorwise scale per expert weight. Made one expert at a time, a step pays E kernel calls, each waking the
threads for one small tensor. Viewed as (E, N * K), the experts' weights are E rows, and the native kernel's
rowwise quantization takes one amax and makes one scale per row by the same rule as for a whole tensor (or casts
each row with its given scale, taking its amax in the same pass): every expert's bytes, scale and amax are those of
its own tensorwise call, in one call. What OperandQuantizer.quantize then does per expert (a delayed amax
recorded for the step, the non-finite counter) runs on the (E,) rows of the scaling buffers at once.

The copies are made once per weight version and kept, as the dense layer keeps its copy (the same key: the
weight's in-place version, optimizer steps, storage, train/eval, delayed-scale updates and execution settings).
Every expert's weight is quantized each time (one call), also an expert that gets no tokens in that step; an
expert without tokens still runs no GEMM, so its input and grad_output record nothing (experts_scaling.py).

Rowwise, block and MX weights are made in one call too, by nn/experts_weight_tiles.py, and cached the same way.
Where this does not apply (delayed scaling with row or tile scales; telemetry on; a weight that is not one
contiguous (E, N, K) block, e.g. the transposed experts of gpt-oss; FSDP2's gathered or refilled weights; another
kernel or backend; torch.compile tracing) `batched_weights_fp8` returns None and each view makes its own copy.
"""

from __future__ import annotations

import torch

from fp8train.nn.fp8_all_gather import Fp8GatheredWeight
from fp8train.nn.gemm import Fp8Operand, emulated_compute_dtype
from fp8train.nn.delayed_scaling import optimizer_steps_seen
from fp8train.nn.experts_weight_tiles import tiled_applies, tiled_experts_fp8
from fp8train.nn.linear_function import WeightFp8
from fp8train.nn.recipes import GemmBackend, OperandRole
from fp8train.numerics import native_cast
from fp8train.numerics.names import QuantizeKernel
from fp8train.numerics.quant import Fp8Tensor, compute_amax, quantize
from fp8train.numerics.scaling import format_scale

__all__ = ["batched_weights_fp8"]


def _applies(scaling, weight: torch.Tensor, backend: GemmBackend) -> bool:
    recipe = scaling.recipe
    return ((recipe.is_tensorwise or tiled_applies(scaling)) and not recipe.accumulator_bits
            and backend is GemmBackend.EMULATED
            and not scaling.telemetry and type(weight) in (torch.Tensor, torch.nn.Parameter)
            and weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and weight.is_contiguous() and weight.numel() > 0 and not torch.compiler.is_compiling()
            and all(view.weight_cache_allowed for view in scaling.experts)
            and scaling.experts[0].kernel_for(weight[0].numel()) is QuantizeKernel.NATIVE and native_cast.available())


def batched_weights_fp8(scaling, weight: torch.Tensor, dispatch) -> list[WeightFp8] | None:
    """Each expert's WeightFp8 (its dense layer's FP8 weight and GEMM operands) from one quantize call over
    `weight` (E, N, K), or None where that does not apply (module docstring). `dispatch`: expert 0's
    LayerDispatch (every expert's choices are the same)."""
    if not _applies(scaling, weight, dispatch.backend):
        return None
    # the dense layer's cache key (nn/linear.py): in-place version, optimizer steps (fused AdamW bumps no
    # version), storage, train/eval, delayed-scale updates, execution settings
    key = (weight._version, optimizer_steps_seen(), weight.data_ptr(), scaling.training,
           scaling.scale_generation, scaling.emulated_dtype, scaling.quantize_kernel)
    cached = scaling.weights_fp8_cache
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        # row / tile scales: nn/experts_weight_tiles.py (None: each view makes its own copy, uncached here)
        weights = _quantize_experts(scaling, weight) if scaling.recipe.is_tensorwise else \
            tiled_experts_fp8(scaling, weight, dispatch, key)
    if weights is None:
        return None
    scaling.weights_fp8_cache = (key, weights)
    return weights


def _quantize_experts(scaling, weight: torch.Tensor) -> list[WeightFp8]:
    experts, n, k = weight.shape
    quantizers = [view.quantizers[OperandRole.WEIGHT] for view in scaling.experts]
    q = quantizers[0]
    rows = weight.view(experts, n * k)  # one row per expert
    compute_dtype = emulated_compute_dtype(weight.device, scaling.emulated_dtype)
    keep = torch.bfloat16 if compute_dtype == torch.bfloat16 else True  # the copy the GEMMs read (as the dense)
    options = dict(granularity="row", axis=-1, kernel="native", keep_values=keep)
    if q.delayed:
        if all(quantizer.initialized_on_host for quantizer in quantizers):  # stored scales: cast and amax, one pass
            fp8 = quantize(rows, q.format, scale=scaling.weight_scale.view(experts, 1), validate_scale=False,
                           with_amax=True, **options)
            amax = fp8.amax.view(experts)
        else:  # an expert on its first step: its own amax's scale until its stored one is initialized
            amax = compute_amax(rows, granularity="row", axis=-1, kernel="native").view(experts)
            own = format_scale(amax, q.format, q.margin, q.pow2)
            scale = torch.where(scaling.weight_initialized, scaling.weight_scale, own)
            fp8 = quantize(rows, q.format, scale=scale.view(experts, 1), validate_scale=False, **options)
        recorded = amax.nan_to_num(nan=-1.0, posinf=-1.0)  # NaN/inf amaxes are counted, never recorded
        scaling.weight_nonfinite_amax_count.add_(recorded < 0)
        if scaling.training:
            pending = scaling.weight_pending_amax
            torch.maximum(pending, recorded, out=pending)
    else:  # current scaling: each row's scale from its own amax, in the kernel
        fp8 = quantize(rows, q.format, margin=q.margin, pow2=q.pow2, **options)
        amax = fp8.amax.view(experts)
        scaling.weight_nonfinite_amax_count.add_(amax.isfinite().logical_not())
    scales = fp8.scale.view(experts)
    weights = []
    for e in range(experts):
        expert_fp8 = Fp8Tensor(fp8.data[e].view(n, k), scales[e], q.format, amax=amax[e])
        if fp8.values is not None:
            expert_fp8.values = fp8.values[e].view(n, k)
        if fp8.values_bf16 is not None:
            expert_fp8.values_bf16 = fp8.values_bf16[e].view(n, k)
        weight_op = Fp8Operand.from_fp8_tensor(expert_fp8)
        weights.append(WeightFp8(None, expert_fp8, weight_op.t(), weight_op))
    return weights
