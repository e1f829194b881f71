"""FP8 weight all-gather under FSDP2 (`fp8.all_gather: true`, tensorwise recipes `delayed` and `current`).

FSDP2 keeps each rank's shard (rows of the weight) and all-gathers the full weight before the module runs. An
`Fp8Linear` only ever uses its weight after quantizing it to FP8 with ONE per-tensor scale, so the ranks can as
well quantize their shards first and all-gather 1-byte codes instead of 4-byte fp32 values:

    rank r:   shard_r (fp32, rows of W) --amax--> all_reduce(MAX) = amax(W) --layer's rule--> scale
              shard_fp8_r = quantize(shard_r, scale)                       (elementwise given the scale)
    FSDP2:    all_gather(shard_fp8_r as uint8)  ->  W_fp8 (N, K) bytes; the scale rides as metadata
    Fp8Linear uses (W_fp8, scale) as its weight operand, without quantizing again.

Why this is the same as gathering fp32 and quantizing (bit for bit): tensorwise quantization is elementwise once
the scale is fixed, and the scale is a function of amax(W) = max over shards of amax(shard), the same on every
rank (delayed scaling: the stored scale, identical on every rank by update_fp8_scales; its first step and current
scaling: the all-reduced amax). Rowwise and block recipes are refused: their weight scales are per row / per
128x128 tile, which would have to be gathered too (and block tiles do not align with FSDP2's row shards).

Two tensor types carry this through FSDP2's extension points (`fsdp_pre_all_gather` / `fsdp_post_all_gather`,
looked up on the sharded parameter's local tensor):
- `Fp8AllGatherWeight`: the fp32 master shard, wrapped. It behaves as its fp32 tensor for everything else
  (optimizer, state dicts, FSDP2's own copies) and knows its `Fp8Linear`'s weight quantizer
  (`layer.quantizers["weight"]`, fp8train.nn.quantizer), whose format, scaling rule and state it uses.
- `Fp8GatheredWeight`: the gathered weight, an fp32-typed (N, K) tensor holding FP8 codes, scale and amax. Only
  `Fp8Linear` may use it (its weight quantizer's `quantize` takes the FP8 operand as it is, and records the amax
  as it would have); any other use raises, rather than compute with bytes read as fp32.

Bytes: 1 byte per element plus nothing per rank for the scale (metadata), against 4 for fp32.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fp8train.nn.recipes import TENSORWISE_SCALINGS, OperandRole
from fp8train.numerics.quant import Fp8Tensor, compute_amax, quantize

__all__ = ["Fp8AllGatherWeight", "Fp8GatheredWeight", "check_fp8_all_gather_recipe", "wrap_weight_for_fp8_all_gather",
           "unwrap_fp8_all_gather", "FP8_ALL_GATHER_SCALINGS"]

# Recipes whose weight has one scale per tensor: the only ones whose FP8 shards can be gathered without scales.
FP8_ALL_GATHER_SCALINGS = TENSORWISE_SCALINGS

# Ops through which FSDP2 (and the optimizer's in-place updates through DTensor) manipulate the shard while it
# must stay an Fp8AllGatherWeight: views, slices, copies and allocation "like" it. Everything else returns plain
# fp32 results (e.g. AdamW's exp_avg = zeros_like(param) is plain state, not a weight).
_KEEP_WRAPPED = {
    torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default, torch.ops.aten.as_strided.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default, torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.chunk.default, torch.ops.aten.new_zeros.default, torch.ops.aten.empty_like.default,
    torch.ops.aten.clone.default, torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default,
}


def check_fp8_all_gather_recipe(recipe) -> None:
    """Raise ValueError unless `recipe` (an Fp8Recipe, or None for bf16) can all-gather its weights in FP8."""
    if recipe is None:
        raise ValueError("fp8.all_gather=true needs an FP8 recipe (fp8.recipe is none: nothing is FP8); "
                         f"use one of {', '.join(FP8_ALL_GATHER_SCALINGS)} or set fp8.all_gather=false")
    if not recipe.is_tensorwise:
        raise ValueError(f"fp8.all_gather=true supports the tensorwise recipes {', '.join(FP8_ALL_GATHER_SCALINGS)}"
                         f"; fp8.recipe={recipe.scaling} has per-row/per-tile weight scales that would have to be "
                         "gathered too; set fp8.all_gather=false")


class Fp8AllGatherWeight(torch.Tensor):
    """An Fp8Linear's fp32 weight (or its FSDP2 shard) that FSDP2 all-gathers as FP8 codes."""

    @staticmethod
    def __new__(cls, weight_fp32: torch.Tensor, quantizer):
        # torch's way to make a tensor subclass that wraps another (no public constructor for one)
        return torch.Tensor._make_wrapper_subclass(
            cls, weight_fp32.size(), strides=weight_fp32.stride(), storage_offset=weight_fp32.storage_offset(),
            dtype=weight_fp32.dtype, layout=weight_fp32.layout, device=weight_fp32.device,
            requires_grad=weight_fp32.requires_grad)

    def __init__(self, weight_fp32: torch.Tensor, quantizer):
        self._weight_fp32 = weight_fp32
        self._quantizer = quantizer  # the layer's weight OperandQuantizer

    @property
    def weight_fp32(self) -> torch.Tensor:
        """The plain fp32 tensor this wraps (same storage)."""
        return self._weight_fp32

    def __repr__(self) -> str:
        return f"Fp8AllGatherWeight({self._weight_fp32!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        quantizer = None

        def unwrap(t: "Fp8AllGatherWeight") -> torch.Tensor:
            nonlocal quantizer
            quantizer = t._quantizer
            return t._weight_fp32

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, quantizer), out)

    def __tensor_flatten__(self):
        return ["_weight_fp32"], {"quantizer": self._quantizer}

    @staticmethod
    def __tensor_unflatten__(inner_tensors, metadata, outer_size, outer_stride):
        return Fp8AllGatherWeight(inner_tensors["_weight_fp32"], metadata["quantizer"])

    # --- FSDP2 extension points ---------------------------------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What this rank contributes to the all-gather: its shard's FP8 codes as bytes (padded to FSDP2's
        padded shard size), plus metadata (scale, amax) that is the same on every rank."""
        quantizer = self._quantizer
        shard = self._weight_fp32.detach()
        amax = compute_amax(shard) if shard.numel() else torch.zeros((), device=shard.device)
        # NaN would not survive a MAX all-reduce reliably (max(nan, x) depends on the order); inf does.
        amax = torch.where(torch.isfinite(amax), amax, torch.full_like(amax, float("inf")))
        if mesh.size() > 1:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = quantizer.tensorwise_scale(amax)
        codes = quantize(shard, quantizer.format, scale=scale, validate_scale=False).data.view(torch.uint8)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads every shard to the first one's row count
        if codes.shape[0] < rows:
            codes = torch.cat([codes, codes.new_zeros(rows - codes.shape[0], *codes.shape[1:])])
        return (codes,), (scale, amax)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (codes,), (scale, amax) = all_gather_outputs, metadata
        fmt = self._quantizer.format
        if out is not None:
            # Every gather after the first writes into the same storage, so `out` (the unsharded Parameter, which
            # autograd may have saved for backward) already holds the new codes; its scale and amax follow.
            out.set_scale(scale, amax)
            return
        gathered = Fp8GatheredWeight(codes.view(fmt.torch_dtype), scale, amax, fmt, param_dtype)
        return gathered, (codes,)


class Fp8GatheredWeight(torch.Tensor):
    """The all-gathered FP8 weight: codes (N, K), a per-tensor dequant scale and the amax it came from; it
    presents itself as a `param_dtype` (fp32) tensor of shape (N, K) so autograd and FSDP2 treat it as the
    unsharded parameter (its gradient is a plain fp32 (N, K) tensor)."""

    @staticmethod
    def __new__(cls, codes, scale, amax, fmt, param_dtype):
        # torch's way to make a tensor subclass that wraps another (no public constructor for one)
        return torch.Tensor._make_wrapper_subclass(cls, codes.size(), strides=codes.stride(), dtype=param_dtype,
                                                   device=codes.device, requires_grad=False)

    def __init__(self, codes, scale, amax, fmt, param_dtype):
        self._codes, self._scale, self._amax, self._fmt = codes, scale, amax, fmt

    def __repr__(self) -> str:
        return f"Fp8GatheredWeight(shape={tuple(self.shape)}, fmt={self._fmt.name}, scale={float(self._scale)})"

    def set_scale(self, scale: torch.Tensor, amax: torch.Tensor) -> None:
        """Write a re-gather's scale and amax in place. Same value when re-gathered for backward, so the version
        counter is left as it was: autograd may have saved this tensor."""
        # torch's only way to write into a tensor without bumping its version counter
        with torch.autograd._unsafe_preserve_version_counter((self._scale, self._amax)):
            self._scale.copy_(scale)
            self._amax.copy_(amax)

    def fp8_tensor(self) -> Fp8Tensor:
        """The weight operand as Fp8Linear's GEMMs take it (no fp32 copy of the values: gemm decodes)."""
        return Fp8Tensor(self._codes, self._scale, self._fmt, amax=self._amax)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # FSDP2 takes views of the whole unsharded tensor (as_strided to the original size, detach for the
        # Parameter); those keep the codes. Anything that would compute with the bytes is a bug: refuse it.
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.as_strided.default,
                    torch.ops.aten.view.default):
            self = args[0]
            codes = func(self._codes, *args[1:], **(kwargs or {}))
            return cls(codes, self._scale, self._amax, self._fmt, self.dtype)
        raise RuntimeError(f"an FP8 all-gathered weight (fp8.all_gather=true) was used by {func}; only Fp8Linear "
                           "can consume it (is a module other than Fp8Linear reading its weight?)")


def wrap_weight_for_fp8_all_gather(layer: nn.Module) -> None:
    """Make `layer.weight` (an Fp8Linear's fp32 master weight) all-gather as FP8 under FSDP2; call before
    fully_shard. The Parameter is replaced by one holding the same storage, so nothing is copied."""
    check_fp8_all_gather_recipe(layer.recipe)
    weight = layer.weight
    if isinstance(weight.data, Fp8AllGatherWeight):
        return
    layer.weight = nn.Parameter(Fp8AllGatherWeight(weight.data, layer.quantizers[OperandRole.WEIGHT]),
                                requires_grad=weight.requires_grad)


def unwrap_fp8_all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """The plain fp32 tensor behind an Fp8AllGatherWeight (or a DTensor of one), sharing its storage; other
    tensors are returned as they are. For state dicts: checkpoints store plain tensors."""
    # A DTensor exists only once torch.distributed.tensor is imported, which costs a process ~1.3 s: not here.
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    is_dtensor = dtensor_module is not None and isinstance(tensor, dtensor_module.DTensor)
    # DTensor's own local shard: to_local() would put an autograd op between it and the state dict
    local = tensor._local_tensor if is_dtensor else None
    if isinstance(local, Fp8AllGatherWeight):
        return dtensor_module.DTensor.from_local(local.weight_fp32, tensor.device_mesh, tensor.placements,
                                                 run_check=False, shape=tensor.shape, stride=tensor.stride())
    if isinstance(tensor, Fp8AllGatherWeight):
        return tensor.weight_fp32
    return tensor
