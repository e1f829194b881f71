"""FP8 all-gather of mixture-of-experts weights under FSDP2 (`fp8.all_gather: true`, recipes delayed and current).

An experts projection's weight (E, N, K) (nn/hf_experts.py, one ExpertScaling per projection) is E dense FP8
weights, each quantized with ONE scale of its own (tensorwise recipes). FSDP2 shards it along dim 0, the experts,
so every rank holds whole experts: rank r holds experts [r * ceil(E / W), ...). Each rank quantizes its experts
with their scales and all-gathers 1-byte codes; the E scales (and amaxes) ride as metadata:

    delayed: scale_e = expert e's stored weight scale (identical on every rank by update_fp8_scales);
             its first step and current scaling: from amax_e = max |W_e|, known to the rank holding e only, so
             the ranks first all-reduce (MAX) one (E,) vector (0 for experts a rank does not hold)
    codes_e = quantize(W_e, scale_e)       (elementwise given the scale: the same as quantizing the gathered W_e)

The gathered `Fp8GatheredExperts` presents itself as the fp32 (E, N, K) Parameter; the experts forward takes
`weight.unbind(0)` of it (nn/experts.py), which gives each expert an `Fp8GatheredWeight` (nn/fp8_all_gather.py)
holding its codes, scale and amax, which the expert's weight quantizer takes as it is (as an Fp8Linear's does).
Any other use of the gathered bytes raises. Transposed experts (gpt-oss, whose forward transposes the weight
first) are not wrapped: they are gathered in fp32. Rowwise and block recipes are refused by apply_fsdp2, as for
Fp8Linear (row and tile scales would have to be gathered too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from fp8train.nn.fp8_all_gather import Fp8AllGatherWeight, Fp8GatheredWeight
from fp8train.nn.hf_experts import expert_projections, is_hf_experts, scaling_of
from fp8train.nn.recipes import OperandRole
from fp8train.numerics.quant import compute_amax, quantize

__all__ = ["Fp8AllGatherExperts", "Fp8GatheredExperts", "wrap_experts_for_fp8_all_gather"]


class Fp8AllGatherExperts(Fp8AllGatherWeight):
    """An experts projection's fp32 weight (E, N, K), or its FSDP2 shard of whole experts, gathered as FP8 codes.
    Its `_quantizer` slot holds the projection's ExpertScaling (every expert's weight quantizer)."""

    def __repr__(self) -> str:
        return f"Fp8AllGatherExperts({self._weight_fp32!r})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        scaling = self._quantizer
        quantizers = [view.quantizers[OperandRole.WEIGHT] for view in scaling.experts]
        shard = self._weight_fp32.detach()
        world = mesh.size()
        rows = -(-outer_size[0] // world)  # FSDP2's padded shard: every rank's first expert is rank * rows
        first = mesh.get_local_rank() * rows if world > 1 else 0
        amax = torch.zeros(outer_size[0], dtype=torch.float32, device=shard.device)
        if shard.shape[0]:
            local = torch.stack([compute_amax(w) for w in shard.unbind(0)])
            # NaN would not survive a MAX all-reduce reliably (max(nan, x) depends on the order); inf does
            amax[first:first + shard.shape[0]] = torch.where(torch.isfinite(local), local, torch.full_like(local, float("inf")))
        if world > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scales = torch.stack([q.tensorwise_scale(a).reshape(()) for q, a in zip(quantizers, amax)])
        fmt = quantizers[0].format
        codes = torch.stack([quantize(w, fmt, scale=scales[first + i], validate_scale=False).data.view(torch.uint8)
                             for i, w in enumerate(shard.unbind(0))]) if shard.shape[0] else \
            torch.zeros(0, *outer_size[1:], dtype=torch.uint8, device=shard.device)
        if codes.shape[0] < rows:
            codes = torch.cat([codes, codes.new_zeros(rows - codes.shape[0], *codes.shape[1:])])
        return (codes,), (scales, amax)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,), (scales, amax) = all_gather_outputs, metadata
        fmt = self._quantizer.experts[0].quantizers[OperandRole.WEIGHT].format
        if out is not None:  # a re-gather into the same storage (see Fp8AllGatherWeight.fsdp_post_all_gather)
            out.set_scale(scales, amax)
            return
        return Fp8GatheredExperts(codes.view(fmt.torch_dtype), scales, amax, fmt, param_dtype), (codes,)


class Fp8GatheredExperts(Fp8GatheredWeight):
    """The all-gathered FP8 experts weight: codes (E, N, K), one dequant scale and amax per expert."""

    def __repr__(self) -> str:
        return f"Fp8GatheredExperts(shape={tuple(self.shape)}, fmt={self._fmt.name})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        self = args[0]
        if func is torch.ops.aten.unbind.int:  # the experts forward: one FP8 weight per expert, with its scale
            dim = args[1] if len(args) > 1 else (kwargs or {}).get("dim", 0)
            if dim != 0:
                raise RuntimeError("FP8-gathered experts can only be split along the experts dim (unbind(0))")
            return tuple(Fp8GatheredWeight(c, self._scale[e], self._amax[e], self._fmt, self.dtype)
                         for e, c in enumerate(self._codes.unbind(0)))
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.as_strided.default,
                    torch.ops.aten.view.default):
            codes = func(self._codes, *args[1:], **(kwargs or {}))
            return cls(codes, self._scale, self._amax, self._fmt, self.dtype)
        raise RuntimeError(f"FP8 all-gathered experts weights (fp8.all_gather=true) were used by {func}; only the "
                           "FP8 experts forward can consume them")


def wrap_experts_for_fp8_all_gather(model: nn.Module) -> int:
    """Make every FP8 experts weight of `model` with a tensorwise recipe, in (out, in) layout, all-gather as FP8
    under FSDP2 (call before fully_shard; the same storage, nothing copied). Returns how many were wrapped."""
    wrapped = 0
    for module in model.modules():
        if not is_hf_experts(module) or module.is_transposed:
            continue
        for param in expert_projections(module):
            scaling = scaling_of(module, param)
            weight = getattr(module, param)
            if scaling is None or not scaling.recipe.is_tensorwise or isinstance(weight.data, Fp8AllGatherWeight):
                continue
            setattr(module, param, nn.Parameter(Fp8AllGatherExperts(weight.data, scaling),
                                                requires_grad=weight.requires_grad))
            wrapped += 1
    return wrapped
