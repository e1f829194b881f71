"""Every expert's token group quantized at once under the rowwise, block and MX recipes (fp8train's native kernel):
the GEMM inputs' copies (input in the forward, grad_output in the backward) and their transposed copies for the
weight gradient.

Under these recipes a token group's scales belong to tiles inside one token row (one scale per row, 1 x 128
tiles, MX's 1 x 32 blocks along K or N), so a tile never spans two tokens, let alone two experts: quantizing
every routed row in one call gives each row the bytes, scales and amaxes of its expert's own call, and each
expert's copy is its rows of the result. What OperandQuantizer.quantize records per expert (the non-finite amax
counter) is written for the experts that have tokens, on their rows of the (E,) buffer, at once.

The weight gradient reads each group transposed, quantized along its tokens: those tiles end where the group
ends, so they are made by the native grouped call (numerics/native_groups.py), one call for every group, each
group's bytes, scales and amaxes those of its own quantize_transposed. That copy records nothing, as the
per-expert one.

Both return None where they do not apply (a tensorwise or delayed role, which nn/experts_tokens.py batches;
tiles spanning rows; telemetry on; a non-contiguous tensor; another kernel; torch.compile tracing), and each
expert's quantizer runs on its own rows instead.
"""

from __future__ import annotations

import math

import torch

from fp8train.numerics import native_cast
from fp8train.numerics.fp8_tensor import Fp8Tensor
from fp8train.numerics.mx import quantize_mx
from fp8train.numerics.names import Granularity, QuantizeKernel
from fp8train.numerics.native_groups import quantize_group_transposes
from fp8train.numerics.quant import quantize, value_copies

__all__ = ["tiled_token_fp8", "tiled_token_fp8_transposed"]


def _quantizer(scaling, role: str, tensor: torch.Tensor, sizes: list[int]):
    """The role's quantizer (expert 0's: the recipe and settings are every expert's) where a one-call path
    applies to `tensor`, else None."""
    view = scaling.experts[0]
    q = view.quantizers[role]
    if (q.tensorwise or q.delayed or scaling.telemetry or not sum(sizes) or tensor.device.type != "cpu"
            or tensor.dtype not in (torch.float32, torch.bfloat16) or tensor.dim() != 2
            or not tensor.is_contiguous() or torch.compiler.is_compiling() or not native_cast.available()
            or q.granularity not in (Granularity.ROW, Granularity.BLOCK)
            or view.kernel_for(tensor[0].numel()) is not QuantizeKernel.NATIVE):
        return None
    return q


def tiled_token_fp8(scaling, role: str, tensor: torch.Tensor, sizes: list[int], keep_values) -> list | None:
    """Each expert's Fp8Tensor of its rows of `tensor` (rows sorted by expert, group sizes `sizes`; None for an
    expert without tokens) as its quantizer's `quantize(rows, keep_values)` makes it, from one call; or None."""
    q = _quantizer(scaling, role, tensor, sizes)
    if q is None or (q.granularity == Granularity.BLOCK and not q.mx and q.block[0] != 1):
        return None  # (tiles of several rows would span token groups)
    routed = sum(sizes)
    rows = tensor[:routed]
    # as OperandQuantizer.quantize: block tiles keep value * scale where a copy of fp32 values is asked for
    blocked = q.granularity is Granularity.BLOCK and keep_values is True
    keep_values = False if blocked else keep_values
    with torch.no_grad():
        if q.mx:
            fp8 = quantize_mx(rows, q.format, kernel="native", keep_values=keep_values, keep_dequantized=blocked)
        else:
            fp8 = quantize(rows, q.format, granularity=q.granularity, block=q.block, margin=q.margin, pow2=q.pow2,
                           kernel="native", keep_values=keep_values, keep_dequantized=blocked)
        present = [e for e, size in enumerate(sizes) if size]
        index = torch.tensor(present, device=tensor.device)
        lengths = torch.tensor([sizes[e] for e in present], device=tensor.device)
        # an expert's count goes up by one where any of its amaxes is not finite (amaxes are >= 0 or NaN)
        row_nonfinite = (fp8.amax < math.inf).logical_not().any(dim=-1).float()
        nonfinite = torch.segment_reduce(row_nonfinite, "max", lengths=lengths)
        getattr(scaling, f"{role}_nonfinite_amax_count").index_add_(0, index, nonfinite.long())
    out, start = [None] * len(sizes), 0
    for e in present:
        end = start + sizes[e]
        group = Fp8Tensor(fp8.data[start:end], fp8.scale[start:end], fp8.fmt, fp8.granularity, fp8.block, fp8.axis,
                          fp8.amax[start:end])
        for name in ("values", "values_bf16", "dequantized"):
            kept = getattr(fp8, name)
            if kept is not None:
                setattr(group, name, kept[start:end])
        out[e], start = group, end
    return out


def tiled_token_fp8_transposed(scaling, role: str, tensor: torch.Tensor, sizes: list[int],
                               keep_values) -> list | None:
    """Each expert's Fp8Tensor of its rows of `tensor`, transposed, as its quantizer's
    `quantize_transposed(rows, keep_values)` makes it, from one native call; or None."""
    q = _quantizer(scaling, role, tensor, sizes)
    if q is None:
        return None
    # as OperandQuantizer.quantize_transposed: block tiles keep value * scale instead of fp32 values
    blocked = q.granularity is Granularity.BLOCK and keep_values is True
    keep_fp32, keep_bf16 = value_copies(False if blocked else keep_values)
    with torch.no_grad():
        return quantize_group_transposes(tensor, sizes, q.format, q.granularity, q.block, q.margin, q.pow2, q.mx,
                                         keep_fp32, keep_bf16, blocked)
