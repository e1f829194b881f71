"""FSDP2 sharding for `train.parallel: fsdp2`: torch's `fully_shard` applied by fp8train itself.

`train.parallel: fsdp2` shards every decoder block, then the root (embeddings, final norm, head), over one
data-parallel mesh of all ranks. The same code runs on CPU processes (gloo) and on GPUs (NCCL), so what CI proves
on CPU is what GPUs run. Each rank keeps 1/world of the fp32 master weights, their gradients and the AdamW
moments; FSDP2 all-gathers a block's weights just before it runs (forward, and again for backward) and
reduce-scatters (averages) its gradients afterwards, which is DDP's gradient average, sharded.

What stays the same as DDP, and why:
- each rank trains on its slice of the same global batch (a pure function of seed and step);
- FP8 scaling state lives in module buffers, which FSDP2 does not shard: every rank holds all of it, kept
  identical by `update_fp8_scales` (one all-reduce MAX of all pending amaxes per optimizer step). Each rank
  quantizes the FULL gathered weight, so its weight amax is the same everywhere;
- gradient accumulation skips the reduce-scatter on all but the last micro-batch (the loop sets FSDP2's
  `set_requires_gradient_sync` before each micro-batch: FSDP2 reads it in backward, DDP's no_sync in forward),
  as DDP's no_sync skips its all-reduce.

One difference, on purpose: gradients are SUMMED over ranks, and the loop divides each micro-batch's loss by
the number of micro-batches in the global batch (world size x train.grad_accum) instead of by grad_accum. Same
gradient (DDP halves then sums two ranks; this halves inside the backward: exact either way), but a rank's
grad_output no longer depends on how many ranks share the global batch. Delayed scaling keeps a history of
grad_output amaxes, so under DDP's convention a checkpoint resumed with another world size would mix amaxes
that differ by that factor; here 2 ranks x 1 micro-batch and 1 rank x 2 hold the same FP8 state.

With `fp8.all_gather: true` (tensorwise recipes) the Fp8Linear weights are gathered as FP8 codes
(fp8train.nn.fp8_all_gather). A world size of 1 is allowed: fp8train then makes a one-process group itself.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather  # set_custom_all_gather's interface
from torch.distributed.tensor import DTensor

from fp8train.nn.convert import fp8_layers
from fp8train.nn.experts_scaling import ExpertScaling
from fp8train.nn.fp8_all_gather_experts import wrap_experts_for_fp8_all_gather
from fp8train.nn.fp8_all_gather import check_fp8_all_gather_recipe, wrap_weight_for_fp8_all_gather
from fp8train.training.parallel.distributed import end_process_group_at_exit

__all__ = ["ensure_process_group", "release_process_group", "decoder_blocks", "apply_fsdp2",
           "grad_norm", "clip_grad_norm_tensor", "grad_norm_tensor",
           "all_finite", "per_rank_state_bytes", "local_tensor",
           "AllGatherByteCounter", "count_all_gather_bytes"]


def ensure_process_group(device: torch.device) -> bool:
    """A process group for FSDP2's mesh. Under a launcher (accelerate, torchrun) accelerate has made one; a single
    process without a launcher gets a one-rank group on an in-memory store (no port, no network). Returns
    True when it made the group here (release it with `release_process_group`)."""
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    end_process_group_at_exit()  # a run that raised never reaches release_process_group (distributed.py says why)
    return True


def release_process_group(created: bool) -> None:
    if created and dist.is_initialized():
        dist.destroy_process_group()


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, each sharded as one unit: the nn.ModuleList holding the most parameters
    (fp8train's Decoder: `layers`; Hugging Face models: `model.layers`, `transformer.h`, ...)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError("train.parallel=fsdp2 needs a model with a list of decoder blocks (an nn.ModuleList); "
                         f"{type(model).__name__} has none")
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def apply_fsdp2(model: nn.Module, device: torch.device, *, fp8_all_gather: bool = False,
                gather_dtype: torch.dtype | None = None, mesh=None) -> nn.Module:
    """Shard `model` in place with FSDP2: each decoder block, then the root. Call after the FP8 swap and before
    the optimizer is built (its parameters become DTensor shards). `gather_dtype` (FSDP2's mixed-precision
    param_dtype, e.g. bf16: weights gathered and used in bf16) is for comparisons in the bench; training keeps
    fp32 weights and bf16 autocast. `mesh`: the data-parallel axis of a (dp, tp) mesh (tensor_parallel.py);
    all ranks when None."""
    if fp8_all_gather and gather_dtype is not None:
        raise ValueError("fp8_all_gather and gather_dtype exclude each other (FP8 codes are what is gathered)")
    for _, layer in fp8_layers(model):
        # FSDP2 all-gathers into the same storage every step without bumping the tensor version: a weight FP8
        # copy cached by (version, data_ptr) would go stale after the optimizer step.
        layer.weight_cache_allowed = False
    for module in model.modules():
        if isinstance(module, ExpertScaling):  # the same for each expert's FP8 weight (nn/experts_scaling.py)
            for view in module.experts:
                view.weight_cache_allowed = False
    if fp8_all_gather:
        layers = fp8_layers(model)
        expert_scalings = [m for m in model.modules() if isinstance(m, ExpertScaling)]
        if not layers and not expert_scalings:
            check_fp8_all_gather_recipe(None)
        for scaling in expert_scalings:
            check_fp8_all_gather_recipe(scaling.recipe)  # refused as for an Fp8Linear (rowwise, block)
        for _, layer in layers:
            wrap_weight_for_fp8_all_gather(layer)  # refuses a recipe that cannot (ValueError)
        wrap_experts_for_fp8_all_gather(model)  # FP8 experts too (tensorwise, (out, in) layout)
    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=gather_dtype)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # a plain SUM, not a mean (see the module docstring); forced, or NCCL/gloo would be asked for
            # PREMUL_SUM(1.0), which gloo does not have
            module.set_force_sum_reduction_for_comms(True)
            module.set_gradient_divide_factor(1.0)
    return model


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _sum_over_ranks(value: torch.Tensor, sharded: bool) -> torch.Tensor:
    if sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


GRAD_NORM_CHUNK = 1 << 22


def grad_norm(model: nn.Module) -> float:
    """Global L2 norm of the gradients, replicated (DDP) or sharded (FSDP2: local shards, summed over ranks).

    Sums of squares in float64: then the norm, rounded to fp32, does not depend on how the gradient is split
    across ranks or summed (fp32 sums in another order differ in the last bits, the clip factor with them, and
    FP8 rounding amplifies one-ulp weight differences into visibly different runs within tens of steps). So DDP,
    FSDP2 and any world size clip by the same factor."""
    return float(grad_norm_tensor(model))


def grad_norm_tensor(model: nn.Module) -> torch.Tensor:
    """grad_norm as a () fp32 tensor on the gradients' device, without a host sync (the training loop reads it
    back on logging steps only)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=next(model.parameters()).device)
    sharded = any(isinstance(g, DTensor) for g in grads)
    squares = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    for g in grads:
        flat = local_tensor(g).detach().reshape(-1)
        own = torch.zeros((), dtype=torch.float64, device=flat.device)
        # float64 a slice at a time: at most GRAD_NORM_CHUNK elements (32 MiB) in float64 at once, never a
        # float64 copy of a whole gradient (a 2048 x 16384 one would be 256 MiB)
        for start in range(0, flat.numel(), GRAD_NORM_CHUNK):
            own = own + flat[start:start + GRAD_NORM_CHUNK].double().pow(2).sum()
        copies = _copies(g) if sharded else 1
        squares = squares + (own if copies == 1 else own / copies)
    return _sum_over_ranks(squares, sharded).sqrt().float()


def _copies(grad: torch.Tensor) -> int:
    """On how many ranks this rank's part of `grad` lives, when shards are summed over all ranks: a DTensor is
    replicated along its mesh's non-sharded dims and across the ranks its mesh leaves out (a tp submesh); a plain
    tensor beside DTensors (tensor parallelism with dp = 1: norms, embeddings) is whole on every rank. Powers of
    two divide float64 sums exactly."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not isinstance(grad, DTensor):
        return world
    mesh = grad.device_mesh
    shards = 1
    for dim, placement in enumerate(grad.placements):
        # (FSDP2 over TP shards along dp with torch's _StridedShard, which is_shard() does not count)
        if not (placement.is_replicate() or placement.is_partial()):
            shards *= mesh.size(dim)
    return world // shards


@torch.no_grad()
def clip_grad_norm_tensor(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale all gradients so their global norm is at most `max_norm` (the rule of torch.nn.utils.clip_grad_norm_,
    with grad_norm's float64 norm), decided on the device (no host sync); returns the () fp32 norm before clipping.
    A non-finite norm leaves the gradients as they are (the loop skips or stops that step).

    The factor is computed as the host rule did, bit for bit: min(1, max_norm / (norm + 1e-6)) in float64 from
    the fp32 norm, then rounded once to fp32 as a Python scalar is in `mul_`. A factor of exactly 1 (no
    clipping, or a non-finite norm) multiplies by 1.0, which changes no value."""
    norm = grad_norm_tensor(model)
    denominator = norm.double() + 1e-6
    factor = torch.full_like(denominator, max_norm).div_(denominator).clamp_(max=1.0)  # IEEE division, not reciprocal
    factor = torch.where(torch.isfinite(norm), factor, torch.ones_like(factor)).float()
    grads = [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    if grads:
        # one multi-tensor op for the whole list: torch's foreach kernels have no public name
        torch._foreach_mul_(grads, factor)
    return norm


@torch.no_grad()
def all_finite(model: nn.Module) -> bool:
    """Every parameter finite, on every rank's shard (one all-reduce, so every rank gets the same answer)."""
    params = list(model.parameters())
    sharded = any(isinstance(p, DTensor) for p in params)
    bad = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for p in params:
        bad = bad + (~torch.isfinite(local_tensor(p))).sum().float()
    return bool(_sum_over_ranks(bad, sharded) == 0)


def per_rank_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only; a parameter
    shared by two modules counted once)."""
    params = {id(p): p for p in model.parameters()}.values()

    def nbytes(t: torch.Tensor) -> int:
        local = local_tensor(t)
        return local.numel() * local.element_size()

    out = {"params": sum(nbytes(p) for p in params),
           "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
           "optimizer": sum(nbytes(v) for state in optimizer.state.values() for v in state.values()
                            if isinstance(v, torch.Tensor))}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


class AllGatherByteCounter(AllGather):
    """FSDP2's all-gather (`set_custom_all_gather`, its documented extension point), counting the bytes each
    rank receives: the size of every gathered output buffer. For measurements (fp8train bench); install with
    `count_all_gather_bytes(model)`."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.bytes += output_tensor.numel() * output_tensor.element_size()
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def count_all_gather_bytes(model: nn.Module) -> AllGatherByteCounter:
    """One counter on every FSDP2 module of `model` (each block and the root)."""
    counter = AllGatherByteCounter()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(counter)
    return counter
