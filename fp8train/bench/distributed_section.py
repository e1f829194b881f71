"""`fp8train bench` distributed section: what FSDP2 and FP8 all-gather buy, measured in real processes.

Two ranks (gloo on CPU; NCCL when at least two GPUs are visible) train the same model for a few optimizer steps
under each contender, one after the other in the same processes:
- `ddp`:                 torch DDP, every rank holds everything;
- `fsdp2`:               fp8train's FSDP2 (train.parallel=fsdp2): blocks, then the root, fully_shard-ed;
- `fsdp2+bf16_gather`:    for comparison, FSDP2 gathering bf16 copies of the weights (its MixedPrecisionPolicy
                          param_dtype=bf16; fp8train trains with fp32 weights, so not a training mode);
- `fsdp2+fp8_all_gather`: the same with fp8.all_gather=true (Fp8Linear weights gathered as FP8 codes).

Per contender it reports, on rank 0:
- `state_bytes`: this rank's bytes of parameters, gradients and AdamW state, counted after backward and the
  optimizer step (local shards only; fp8train.training.parallel.fsdp2.per_rank_state_bytes), and the ratio to DDP;
- `all_gather_bytes_per_step`: the bytes FSDP2's all-gathers delivered to this rank per optimizer step (every
  gathered buffer, forward and backward re-gathers included; FSDP2's own `set_custom_all_gather` hook), and for
  FP8 all-gather the ratio to the fp32 all-gather;
- `step_s`: median seconds per optimizer step (all steps after the first), and the losses, which must agree.

Models: the CPU validation decoder (2 layers, d_model 64: embeddings and head are a third of its weights, and
they are gathered in fp32 whatever the recipe) and a wider one (4 layers, d_model 256) whose Linears dominate,
as in real models.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from fp8train.bench.harness import free_port
from fp8train.nn.convert import convert_to_fp8
from fp8train.nn.linear import update_fp8_scales
from fp8train.training.parallel import fsdp2
from fp8train.training.config import fp8_recipe_from_config, layer_policy_from_config, load_config
from fp8train.training.models.decoder import build_model

__all__ = ["bench_distributed", "format_distributed", "CONTENDERS", "MODEL_SHAPES"]

CONTENDERS = ("ddp", "fsdp2", "fsdp2+bf16_gather", "fsdp2+fp8_all_gather")
# (label, config overrides): the CPU validation model, and a wider one where the FP8 Linears dominate
MODEL_SHAPES = (
    ("cpu_validate 2x64", ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "policy.min_features=64"]),
    ("wide 4x256", ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "policy.min_features=64"]),
)
WORLD = 2


def _one_contender(cfg, contender: str, device: torch.device, steps: int) -> dict:
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    convert_to_fp8(model, fp8_recipe_from_config(cfg), layer_policy_from_config(cfg))
    model.to(device)
    counter = None
    if contender == "ddp":
        wrapped = DistributedDataParallel(model, broadcast_buffers=False)
    else:
        wrapped = fsdp2.apply_fsdp2(model, device, fp8_all_gather=contender.endswith("fp8_all_gather"),
                                    gather_dtype=torch.bfloat16 if contender.endswith("bf16_gather") else None)
        counter = fsdp2.count_all_gather_bytes(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, foreach=False)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, times, state = [], [], {}
    for step in range(steps):
        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len), generator=gen)
        x_rank = x.view(world, -1, cfg.model.seq_len)[rank].to(device)
        gathered_before = counter.bytes if counter else 0
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = wrapped(x_rank, x_rank)
        (loss if contender == "ddp" else loss / world).backward()  # FSDP2 sums over ranks (fsdp2.apply_fsdp2)
        optimizer.step()
        state = fsdp2.per_rank_state_bytes(model, optimizer)  # grads still held: counted
        optimizer.zero_grad(set_to_none=True)
        update_fp8_scales(model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total)
        losses.append(float(total) / world)
        gathered = (counter.bytes - gathered_before) if counter else 0
    return {"contender": contender, "state_bytes": state, "all_gather_bytes_per_step": gathered,
            "step_s": statistics.median(times[1:] or times), "losses": losses}


def _worker(rank: int, port: int, device_type: str, steps: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    try:
        for label, overrides in MODEL_SHAPES:
            cfg = load_config(None, [*overrides, "model.seq_len=64", "train.batch_size=8", "fp8.recipe=current"])
            for contender in CONTENDERS:
                rows.append({"model": label, **_one_contender(cfg, contender, device, steps)})
    finally:
        # FSDP2's and DDP's modules hold the groups and gloo's finished work through reference cycles: collected
        # now, while the interpreter runs, not at its finalization, where a gloo worker thread releasing them can
        # abort the process ("terminate called without an active exception": training/parallel/distributed.py)
        gc.collect()
        dist.destroy_process_group()
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps(rows))


def bench_distributed(device: str = "cpu", steps: int = 4) -> dict:
    """Launch WORLD processes, measure every contender on every model shape; rows with ratios to DDP / fp32."""
    if device == "cuda" and torch.cuda.device_count() < WORLD:
        return {"skipped": f"needs {WORLD} GPUs for {WORLD} NCCL ranks, {torch.cuda.device_count()} visible"}
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(free_port(), device, steps, out_dir), nprocs=WORLD, start_method="spawn")
        rows = json.loads(Path(out_dir, "rows.json").read_text())
    by_key = {(r["model"], r["contender"]): r for r in rows}
    for r in rows:
        ddp, fp32_gather = by_key[(r["model"], "ddp")], by_key[(r["model"], "fsdp2")]
        r["state_vs_ddp"] = r["state_bytes"]["total"] / ddp["state_bytes"]["total"]
        r["all_gather_vs_fp32"] = (r["all_gather_bytes_per_step"] / fp32_gather["all_gather_bytes_per_step"]
                                   if r["contender"] != "ddp" else None)
        r["max_loss_rel_diff_vs_ddp"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ddp["losses"]))
    return {"world_size": WORLD, "backend": "nccl" if device == "cuda" else "gloo", "steps": steps,
            "recipe": "current", "rows": rows}


def format_distributed(section: dict) -> str:
    from fp8train.bench.tp_section import format_tensor_parallel

    if "skipped" in section:
        return f"\ndistributed: skipped ({section['skipped']})"
    tensor_parallel = "" if "tensor_parallel" not in section else format_tensor_parallel(section["tensor_parallel"])
    lines = [f"\ndistributed, {section['world_size']} ranks ({section['backend']}), recipe {section['recipe']}, "
             f"{section['steps']} steps; bytes per rank",
             "model              contender              params+grads+AdamW MB  x ddp   all-gather MB/step  "
             "x fp32 gather  ms/step  max loss diff vs ddp"]
    for r in section["rows"]:
        gather = "-" if r["contender"] == "ddp" else f"{r['all_gather_bytes_per_step'] / 2**20:.2f}"
        vs = "-" if r["all_gather_vs_fp32"] is None else f"{r['all_gather_vs_fp32']:.1%}"
        lines.append(f"{r['model']:<18} {r['contender']:<22} {r['state_bytes']['total'] / 2**20:>21.2f}  "
                     f"{r['state_vs_ddp']:>5.1%}  {gather:>18}  {vs:>13}  {r['step_s'] * 1e3:>7.1f}  "
                     f"{r['max_loss_rel_diff_vs_ddp']:.1e}")
    return "\n".join(lines) + tensor_parallel
