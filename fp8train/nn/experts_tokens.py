"""Every expert's token group quantized at once (tensorwise recipes, fp8train's native kernel): input in the
forward, grad_output in the backward.

Under delayed and current scaling each expert's token group of a GEMM input gets one scale of its own, the scale
its dense layer would give that group (nn/experts.py). Made one expert at a time, that is E amax passes, E casts
and E rounds of bookkeeping per operand, each a few kernel and Python calls for a small tensor. Here the rows
are read once for their amaxes (one per row, the native kernel's rowwise amax), each group's amax is the max of
its rows' (torch.segment_reduce, NaN propagating as a tensor max does), each expert's scale follows from it by
its quantizer's rule, and one cast writes every row with its group's scale: the bytes of casting each group with
its own scale, since a cast with a given scale is elementwise. Delayed scaling with stored scales casts first and
takes the rows' amaxes in the same pass. What OperandQuantizer.quantize records per expert (the step's pending
amax, the non-finite counter) is written to the rows of the (E,) buffers of the experts that have tokens; an
expert without tokens records nothing, as before.

`batched_token_fp8` returns None where this does not apply (rowwise, block or MX scales, whose groups are not
needed for the scale; telemetry on; a non-contiguous tensor such as the expanded gradient of a sum; another
kernel), and each expert's quantizer runs on its own rows instead.
"""

from __future__ import annotations

import torch

from fp8train.numerics import native_cast
from fp8train.numerics.fp8_tensor import Fp8Tensor
from fp8train.numerics.names import QuantizeKernel
from fp8train.numerics.quant import compute_amax, quantize
from fp8train.numerics.scaling import format_scale

__all__ = ["batched_token_fp8"]


def batched_token_fp8(scaling, role: str, tensor: torch.Tensor, sizes: list[int], keep_values) -> list | None:
    """Each expert's Fp8Tensor of its rows of `tensor` (rows sorted by expert, group sizes `sizes`; None for an
    expert without tokens) quantized with its own tensorwise scale for `role`, or None (module docstring)."""
    recipe, view = scaling.recipe, scaling.experts[0]
    routed = sum(sizes)
    if not (recipe.is_tensorwise and not scaling.telemetry and routed and tensor.device.type == "cpu"
            and tensor.dtype in (torch.float32, torch.bfloat16) and tensor.dim() == 2 and tensor.is_contiguous()
            and view.kernel_for(tensor[0].numel()) is QuantizeKernel.NATIVE and native_cast.available()
            and not torch.compiler.is_compiling()):
        return None
    rows, q = tensor[:routed], view.quantizers[role]
    present = [e for e, size in enumerate(sizes) if size]
    index = torch.tensor(present, device=tensor.device)
    lengths = torch.tensor([sizes[e] for e in present], device=tensor.device)
    options = dict(granularity="row", axis=-1, kernel="native", keep_values=keep_values, validate_scale=False)
    stored = getattr(scaling, f"{role}_scale", None)
    with torch.no_grad():
        if q.delayed and all(scaling.experts[e].quantizers[role].initialized_on_host for e in present):
            # stored scales: cast first, each row's amax taken in the same pass
            scale = stored.index_select(0, index)
            fp8 = quantize(rows, q.format, scale=scale.repeat_interleave(lengths).view(-1, 1), with_amax=True,
                           **options)
            amax = torch.segment_reduce(fp8.amax.view(-1), "max", lengths=lengths)
        else:
            amax = torch.segment_reduce(compute_amax(rows, granularity="row", axis=-1, kernel="native").view(-1),
                                        "max", lengths=lengths)
            scale = format_scale(amax, q.format, q.margin, q.pow2)  # the group's own (current; a first step)
            if q.delayed:
                scale = torch.where(getattr(scaling, f"{role}_initialized").index_select(0, index),
                                    stored.index_select(0, index), scale)
            fp8 = quantize(rows, q.format, scale=scale.repeat_interleave(lengths).view(-1, 1), **options)
        _record(scaling, role, q, index, amax)
    out, start = [None] * len(sizes), 0
    for i, e in enumerate(present):
        end = start + sizes[e]
        group = Fp8Tensor(fp8.data[start:end], scale[i], q.format, amax=amax[i])
        if fp8.values is not None:
            group.values = fp8.values[start:end]
        if fp8.values_bf16 is not None:
            group.values_bf16 = fp8.values_bf16[start:end]
        out[e], start = group, end
    return out


def _record(scaling, role: str, q, index: torch.Tensor, amax: torch.Tensor) -> None:
    """OperandQuantizer's bookkeeping for the experts in `index`, on their rows of the (E,) buffers: a non-finite
    amax counted (and, delayed, never recorded), a finite one folded into the step's pending amax in training."""
    count = getattr(scaling, f"{role}_nonfinite_amax_count")
    if not q.delayed:
        count.index_add_(0, index, amax.isfinite().logical_not().long())
        return
    recorded = amax.nan_to_num(nan=-1.0, posinf=-1.0)
    count.index_add_(0, index, (recorded < 0).long())
    if scaling.training:
        pending = getattr(scaling, f"{role}_pending_amax")
        pending.index_copy_(0, index, torch.maximum(pending.index_select(0, index), recorded))
