"""Tensor parallelism for `train.tp_size > 1`: a 2-D (dp, tp) mesh and torch's TP styles on the decoder blocks.

The launched processes form a DeviceMesh of shape (dp, tp) = (processes / tp_size, tp_size), rank r at
(r // tp_size, r % tp_size): the tp_size ranks of one tp group are consecutive (on GPUs, one node's NVLink).
Within a tp group every block's projections are split with torch.distributed.tensor.parallel (Megatron's
layout): attention q/k/v and MLP gate/up ColwiseParallel (output features split: each rank holds its heads and
its share of the hidden units), attention o and MLP down RowwiseParallel (input features split; the partial sums
all-reduced). Everything else (embeddings, norms, lm_head) is replicated within the group. fp8train's Fp8Linear
runs underneath on the local shards with the scales of the unsharded layer (fp8train.nn.tensor_parallel).
`train.parallel` applies along dp: fsdp2 shards every block and the root over the dp axis (2-D: FSDP2 over TP,
torch's composition); ddp runs with dp = 1 only (every process in one tp group; DDP over DTensor parameters
is not what this loop wraps).

A tp group sees one batch: data slices, evaluation batches and the loss average go by the dp rank
(`data_parallel`). The model's own Attention splits its heads by the local width (view(..., -1, head_dim)).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from fp8train.nn.convert_experts import is_grouped
from fp8train.nn.hf_experts import is_hf_experts
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.sequence_gather import Fp8SequenceGather
from fp8train.nn.tensor_parallel import check_tile_shards, keep_scaling_state_local

__all__ = ["check_tensor_parallel", "data_parallel", "make_mesh", "tp_styles", "check_tp_model", "sequence_parallel_styles", "apply_tensor_parallel",
           "COLWISE", "ROWWISE", "reduce_partial_grads"]

# The projections of one block, by the name under the block: split along output (colwise) or input (rowwise)
# features. Built-in Decoder: attn.*, mlp.*; Llama-like Hugging Face models: self_attn.*, mlp.*.
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


def check_tensor_parallel(cfg, processes: int) -> None:
    """Refuse, in one line, a tp_size the launch cannot form (before anything is built or written)."""
    tp = cfg.train.tp_size
    if tp == 1:
        return
    if processes % tp:
        raise ValueError(f"train.tp_size={tp} must divide the number of processes ({processes}): the mesh is "
                         f"(processes / tp_size, tp_size)")
    if cfg.train.parallel == "ddp" and processes != tp:
        raise ValueError(f"train.tp_size={tp} with train.parallel=ddp needs processes == tp_size (got "
                         f"{processes}): for dp x tp set train.parallel=fsdp2")


def data_parallel(accelerator, tp_size: int) -> tuple[int, int]:
    """(dp rank, dp size): the ranks of one tp group share a rank here, hence one slice of each batch."""
    return accelerator.process_index // tp_size, accelerator.num_processes // tp_size


def make_mesh(device: torch.device, processes: int, tp_size: int) -> DeviceMesh:
    return init_device_mesh(device.type, (processes // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


def tp_styles(model: nn.Module) -> dict:
    """{module name: parallel style} for every block projection of `model` (named as in COLWISE / ROWWISE)."""
    styles = {}
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Linear) and leaf in COLWISE + ROWWISE:
            styles[name] = ColwiseParallel() if leaf in COLWISE else RowwiseParallel()
    if not styles:
        raise ValueError(f"train.tp_size>1 needs a model whose blocks name their projections {COLWISE + ROWWISE} "
                         f"(fp8train's Decoder, Llama-like Hugging Face models); {type(model).__name__} has none")
    return styles


def sequence_parallel_styles(model: nn.Module, fp8_gather: bool = True, gather_dtype=None) -> dict:
    """tp_styles with sequence parallelism for fp8train's Decoder (Megatron-SP, torch's styles): the residual stream
    and the norms hold T / tp positions each (the embedding's output sliced, no communication); each attention
    and MLP all-gathers its normed input once before the colwise projections (as FP8 codes and scales where its
    projections allow and `fp8_gather`: nn/sequence_gather.py; else in its own dtype, or `gather_dtype` for a
    comparison), and the rowwise
    projections reduce-scatter their partial sums back to sequence shards (the bytes of the all-reduce they
    replace); lm_head all-gathers the final norm's output. RMSNorm is per position: the same numbers."""
    sequence, whole = Shard(1), Replicate()
    styles = {"embed": PrepareModuleOutput(output_layouts=whole, desired_output_layouts=sequence),
              "norm": SequenceParallel(),
              "lm_head": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(whole,),
                                            use_local_output=True)}
    for i in range(len(model.layers)):
        block = f"layers.{i}"
        styles |= {f"{block}.attn_norm": SequenceParallel(), f"{block}.mlp_norm": SequenceParallel(),
                   # the colwise layers' partial input gradients add up and go back as ONE reduce-scatter per
                   # module, not an all-reduce per projection
                   f"{block}.attn": Fp8SequenceGather(("q_proj", "k_proj", "v_proj"), fp8_gather, gather_dtype),
                   f"{block}.mlp": Fp8SequenceGather(("gate_proj", "up_proj"), fp8_gather, gather_dtype)}
        for name in ("q_proj", "k_proj", "v_proj"):
            styles[f"{block}.attn.{name}"] = ColwiseParallel()
        for name in ("gate_proj", "up_proj"):
            styles[f"{block}.mlp.{name}"] = ColwiseParallel()
        styles[f"{block}.attn.o_proj"] = RowwiseParallel(output_layouts=sequence)
        styles[f"{block}.mlp.down_proj"] = RowwiseParallel(output_layouts=sequence)
    return styles


def _is_decoder(model: nn.Module) -> bool:
    config = getattr(model, "cfg", None)
    return config is not None and hasattr(config, "kv_heads") and not config.tie_embeddings


def _check_heads(model: nn.Module, tp: int) -> None:
    """Heads and hidden units must split evenly: each rank holds whole heads."""
    config = getattr(model, "cfg", None)
    if config is not None and hasattr(config, "kv_heads"):  # fp8train's Decoder
        sizes = {"model.n_heads": config.n_heads, "model.n_kv_heads": config.kv_heads(),
                 "the MLP's hidden size (model.ffn_hidden)": config.ffn_dim()}
    else:  # a Hugging Face model
        hf = getattr(getattr(model, "hf", model), "config", None)
        sizes = {f"config.{k}": getattr(hf, k) for k in ("num_attention_heads", "num_key_value_heads",
                                                           "intermediate_size") if getattr(hf, k, None)}
    for key, size in sizes.items():
        if size % tp:
            raise ValueError(f"train.tp_size={tp} must divide {key}={size} (each rank holds whole heads and an "
                             "equal share of the MLP)")


def _check_no_experts(model: nn.Module, tp: int) -> None:
    """Mixture-of-experts layers are refused: their experts are neither split over the tp group (TP of experts)
    nor spread over ranks (expert parallelism), and sequence parallelism has no plan for a routed MLP."""
    experts = [name for name, module in model.named_modules() if is_grouped(module) or is_hf_experts(module)]
    if experts:
        more = f" (and {len(experts) - 1} more)" if len(experts) > 1 else ""
        raise ValueError(f"train.tp_size={tp}: {experts[0]}{more} are mixture-of-experts experts, and neither tensor "
                         "parallelism of experts nor expert parallelism is supported; train MoE models with "
                         "train.tp_size=1 (ddp, or fsdp2, which shards the experts)")


def check_tp_model(model: nn.Module, tp: int) -> dict:
    """Refuse (ValueError, one line) a model that `tp` ranks cannot split: mixture-of-experts layers, heads or
    MLP not divisible, or a shard that would cut an FP8 scaling tile (naming the layer and sizes). Returns the
    styles (tp_styles)."""
    _check_no_experts(model, tp)
    _check_heads(model, tp)
    styles = tp_styles(model)
    modules = dict(model.named_modules())
    for name, style in styles.items():
        if isinstance(modules[name], Fp8Linear):
            check_tile_shards(name, modules[name], tp, 0 if isinstance(style, ColwiseParallel) else 1)
    return styles


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          fp8_gather: bool = True, gather_dtype=None) -> nn.Module:
    """Split `model`'s block projections over `tp_mesh` (in place; after the FP8 swap, before FSDP2 and the
    optimizer), after check_tp_model; with `sequence_parallel` (fp8train's Decoder without tied embeddings;
    others run without) its norms and residual stream too (sequence_parallel_styles; `fp8_gather` False gathers
    the blocks' inputs in their own dtype or `gather_dtype`, for comparisons)."""
    styles = check_tp_model(model, tp_mesh.size())
    if sequence_parallel and _is_decoder(model):
        styles = sequence_parallel_styles(model, fp8_gather, gather_dtype)
    modules = dict(model.named_modules())
    parallelize_module(model, tp_mesh, styles)
    for name in styles:
        if isinstance(modules[name], Fp8Linear):
            keep_scaling_state_local(modules[name])
    return model


@torch.no_grad()
def reduce_partial_grads(model: nn.Module) -> None:
    """Sum the gradients that are still partial over a mesh dim (sequence parallelism: a norm's weight gradient
    is each rank's sum over its own positions) into whole ones: one all-reduce each, after the last backward of
    a step and before the gradient norm, which reads local values."""
    for p in model.parameters():
        grad = p.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            p.grad = grad.redistribute(placements=[Replicate() if placement.is_partial() else placement
                                                   for placement in grad.placements])
