"""Validation loss, and the autocast context every forward of a run shares (train, evaluation, shadowing)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from fp8train.training.config import FullConfig

__all__ = ["run_autocast", "evaluate"]


def run_autocast(cfg: FullConfig, device: torch.device):
    """bf16 autocast unless `train.autocast: none` (fp32 activations)."""
    if cfg.train.autocast == "none":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


@torch.no_grad()
def evaluate(model, batches, cfg: FullConfig, accelerator) -> float:
    """Mean validation loss over the fixed batches (split across ranks, summed back). `model` is the plain
    module, not the DDP wrapper: ranks may run different numbers of batches, and a DDP forward can start a
    collective (buffer broadcast) that the other ranks would never join."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    tp = cfg.train.tp_size  # the ranks of a tensor-parallel group run the same batches (summed tp times below)
    world, rank = accelerator.num_processes // tp, accelerator.process_index // tp
    mine = list(range(rank, len(batches), world))
    if cfg.train.parallel == "fsdp2" or tp > 1:  # every forward is collective: each rank runs as many as the busiest
        mine += [None] * (-(-len(batches) // world) - len(mine))  # None: batch 0 again, not counted
    for i in mine:
        x, y = batches[0 if i is None else i]
        with run_autocast(cfg, accelerator.device):
            _, loss = model(x.to(accelerator.device), y.to(accelerator.device))
        if i is not None:  # summed on the device: one host sync per evaluation, not one per batch
            total += torch.stack([loss.detach().double(), torch.ones((), dtype=torch.float64, device=loss.device)])
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    model.train()
    return float(total[0] / total[1])
