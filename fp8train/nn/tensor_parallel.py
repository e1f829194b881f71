"""Fp8Linear under torch's tensor parallelism: a weight that is a DTensor shard, computed on the local shards.

torch.distributed.tensor.parallel's ColwiseParallel and RowwiseParallel turn a linear layer's weight into a
DTensor sharded over a tensor-parallel (TP) mesh and its input into a DTensor; they redistribute the output after
the layer. An Fp8Linear whose weight is such a DTensor (`Fp8Linear.forward` sends it here) runs its three FP8
GEMMs on the local shards and hands back a DTensor whose placement says what the local result is:

    colwise  weight (N/tp, K) Shard(0), input (M, K) replicated     -> output (M, N/tp)   Shard(-1)
             grad_input = grad_output_local @ weight_local is a partial sum: summed over TP by the input's
             redistribution in backward (the input's gradient is declared Partial)
    rowwise  weight (N, K/tp) Shard(1), input (M, K/tp) Shard(-1)   -> output (M, N)      Partial (summed by
             the style: all-reduce, or reduce-scatter under sequence parallelism)

What one process computes, the shards compute, because every FP8 scale is the one the unsharded layer would use:
- a tensorwise scale (delayed, current) needs the amax of the whole operand. A split operand (colwise: weight
  and grad_output; rowwise: input and weight) takes a MAX all-reduce of its amax over the TP group before it is
  quantized. Current scaling therefore costs one small all-reduce per quantize of a split operand. Delayed
  scaling quantizes with the stored scale, which every rank already holds (update_fp8_scales' one MAX
  all-reduce per step runs over all ranks, TP included); only the first steps, while a role still falls back to
  its own amax, reduce per quantize;
- a rowwise scale spans its row: when the row runs along the split axis (colwise grad_output, rowwise input and
  weight, and in the transposed copies the other axis), the row amaxes (one per row) are MAX all-reduced;
- block and MX tiles stay local: `check_tile_shards` refuses, before any step, a shard size that would split a
  tile, so every tile lies inside one shard.
The GEMMs' sums over a split contracted dim (rowwise output, colwise grad_input) are then added over TP in
another order than one GEMM adds them: equal up to fp32 summation order (docs/distributed.md gives the bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from fp8train.nn.recipes import OperandRole
from fp8train.numerics.names import Granularity
from fp8train.numerics.scaling import compute_amax

__all__ = ["TpLayout", "tensor_parallel_forward", "check_tile_shards", "split_axes", "keep_scaling_state_local"]


def split_axes(weight_axis: int) -> dict[str, int | None]:
    """Which axis of each 2-D operand (input (M, K), weight (N, K), grad_output (M, N)) is split over TP, for a
    weight split along `weight_axis` (0: colwise, 1: rowwise); None where the operand is whole on every rank."""
    if weight_axis == 0:
        return {OperandRole.INPUT: None, OperandRole.WEIGHT: 0, OperandRole.GRAD_OUTPUT: 1}
    return {OperandRole.INPUT: 1, OperandRole.WEIGHT: 1, OperandRole.GRAD_OUTPUT: None}


@dataclass(frozen=True)
class TpLayout:
    """How one Fp8Linear is split over its TP group (set by tensor_parallel_forward, read by its quantizers)."""

    group: object  # the TP ProcessGroup
    weight_axis: int  # 0: colwise (output features split), 1: rowwise (input features split)
    mesh: object  # the 1-D TP DeviceMesh the weight is sharded over

    def global_amax(self, quantizer, tensor: torch.Tensor, kernel: str, transposed: bool):
        """The amax the unsharded layer would scale `tensor` (this rank's part of quantizer's operand; its
        transpose when `transposed`) with, MAX-reduced over TP, or None where the local amax is already that one
        (operand not split; block tiles; rowwise scales along a whole axis; delayed scales known on the host)."""
        split = split_axes(self.weight_axis)[quantizer.role]
        if split is None:
            return None
        split = 1 - split if transposed else split  # the axis of `tensor` (the operand transposed) that is split
        r = quantizer.recipe
        if r.is_delayed:
            if quantizer.initialized_on_host:  # the stored scale, the same on every rank
                return None
            granularity = "tensor"  # the first steps' fallback: the tensor's own (whole) amax
        else:
            granularity = r.granularity_of(quantizer.role)
            # a row scale reduces along axis -1: only then is it split; tiles lie inside a shard (checked)
            if r.is_mx or granularity == Granularity.BLOCK or (granularity == Granularity.ROW and split != 1):
                return None
        amax = compute_amax(tensor, granularity, axis=-1, kernel=kernel)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
        return amax


def _layout_of(layer, weight: DTensor) -> TpLayout:
    """The layer's TpLayout, made on its first forward (and again only if its weight moved to another mesh)."""
    mesh, placements = weight.device_mesh, weight.placements
    if mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or \
            placements[0].dim not in (0, 1):
        raise RuntimeError(f"internal error: an Fp8Linear weight under tensor parallelism must be a DTensor "
                           f"sharded along dim 0 or 1 of a 1-D mesh; got {placements} on a {mesh.ndim}-D mesh")
    layout = layer.tp_layout
    if layout is None or layout.mesh is not mesh or layout.weight_axis != placements[0].dim:
        layout = layer.tp_layout = TpLayout(mesh.get_group(), placements[0].dim, mesh)
    return layout


def tensor_parallel_forward(layer, input: torch.Tensor) -> DTensor:
    """`layer`'s forward on the local shards (see the module docstring); the output as a DTensor."""
    weight = layer.weight
    layout = _layout_of(layer, weight)
    mesh = weight.device_mesh
    if not isinstance(input, DTensor):
        raise RuntimeError("internal error: an Fp8Linear with a DTensor weight needs a DTensor input (parallelize "
                           "it with torch's ColwiseParallel / RowwiseParallel, which prepare the input)")
    if layout.weight_axis == 0:
        # every rank's grad_input is a partial sum over its output features: declared Partial, it is summed over
        # TP when the input's own redistribution runs backward. An input already whole is not redistributed: a
        # Replicate -> Replicate redistribute would all-reduce this layer's Partial gradient on its way back (one
        # all-reduce per projection), where the projections sharing a gathered input (sequence parallelism) add
        # theirs locally and reduce-scatter the sum once
        if tuple(input.placements) != (Replicate(),):
            input = input.redistribute(mesh, [Replicate()])
        input_local = input.to_local(grad_placements=[Partial()])
    else:
        input_local = input.redistribute(mesh, [Shard(input.dim() - 1)]).to_local()
    weight_local = weight.to_local()
    bias = layer.bias
    if layout.weight_axis == 0:
        bias_local = bias.to_local() if isinstance(bias, DTensor) else bias
        output = layer.forward(input_local, weight_local, bias_local)
        return DTensor.from_local(output, mesh, [Shard(output.dim() - 1)], run_check=False)
    # rowwise: each rank's output is a partial sum; a bias is added once, after the sum (DTensor's own add)
    output = DTensor.from_local(layer.forward(input_local, weight_local, None), mesh, [Partial()],
                                run_check=False)
    return output if bias is None else output + bias


def check_tile_shards(name: str, layer, tp_size: int, weight_axis: int) -> None:
    """Refuse (ValueError, one line naming the layer and sizes) a split that would cut a block or MX tile: each
    tile must lie inside one shard so that its scale stays local. Row and tensor scales are reduced instead."""
    r = layer.recipe
    shapes = {OperandRole.INPUT: (None, layer.in_features), OperandRole.WEIGHT: (layer.out_features,
              layer.in_features), OperandRole.GRAD_OUTPUT: (None, layer.out_features)}
    for role, split in split_axes(weight_axis).items():
        if split is None or r.granularity_of(role) != Granularity.BLOCK:
            continue
        size = shapes[role][split]
        if size % tp_size:
            raise ValueError(f"tensor parallelism: {name} has {size} {'rows' if split == 0 else 'columns'} of "
                             f"{role}, not divisible by train.tp_size={tp_size}")
        tile = tuple(r.block_of(role))
        extents = {tile[split]}
        if r.requantize_transposed(role):  # the transposed copy's tile runs along the other axis of this one
            extents.add(tile[1 - split])
        for extent in sorted(extents):
            if (size // tp_size) % extent:
                raise ValueError(f"tensor parallelism: {name} splits {role} ({size} along dim {split}) into "
                                 f"shards of {size // tp_size}, which cuts its {extent}-wide scaling tiles "
                                 f"(tile {tile[0]}x{tile[1]}); use a train.tp_size or {role}_block whose shards "
                                 "hold whole tiles")


def keep_scaling_state_local(layer) -> None:
    """torch's parallel styles replicate a module's buffers as DTensors; an Fp8Linear's scaling state stays plain
    tensors, one copy per rank kept equal by update_fp8_scales (as under DDP), which its quantizers read and
    write in place. Call after parallelize_module."""
    for name, buffer in list(layer.named_buffers(recurse=False)):
        if isinstance(buffer, DTensor):
            setattr(layer, name, buffer.to_local())  # (a registered buffer name: Module keeps it a buffer)
