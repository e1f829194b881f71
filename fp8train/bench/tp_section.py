"""`fp8train bench --sections distributed`, tensor parallelism: bytes per step of every collective, counted.

Two ranks (gloo on CPU; NCCL on two GPUs) form one tp group (train.tp_size=2, sequence parallelism) and train the
same decoder for a few optimizer steps under bf16 autocast, once per contender, in the same processes:
- `fp32 gather`: the blocks' normed inputs all-gathered in their own dtype (fp8train's RMSNorm returns fp32 under
  autocast, so the residual stream and its gathers are fp32);
- `bf16 gather`: the same gathered as bf16 (the dtype a bf16 residual stream would move; for comparison: the
  projections then quantize bf16-rounded inputs);
- `fp8 gather`: the default, the inputs quantized per rank and gathered as FP8 codes plus scales
  (fp8train.nn.sequence_gather; bit for bit the fp32 gather's numbers).
Every collective the step issues (forward, backward, the norms' partial gradients, the gradient norm, delayed
scaling's update) is counted as it runs (bench.collective_bytes) and named by what it moves; the gradient
clipping norm and loss reporting of the trainer are left out (a scalar each).
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

from fp8train.bench.collective_bytes import CollectiveBytes, CollectiveCall
from fp8train.bench.harness import free_port
from fp8train.nn.convert import convert_to_fp8
from fp8train.nn.linear import update_fp8_scales
from fp8train.nn.recipes import ScalingKind
from fp8train.training.config import fp8_recipe_from_config, layer_policy_from_config, load_config
from fp8train.training.models.decoder import build_model

__all__ = ["bench_tensor_parallel", "format_tensor_parallel", "TP_CONTENDERS", "collective_name"]

TP_CONTENDERS = ("fp32 gather", "bf16 gather", "fp8 gather")
WORLD = 2
# the FSDP section's wide model (its Linears dominate), sequences of 128 positions: 64 per rank
MODEL = ["model.n_layers=4", "model.d_model=256", "model.n_heads=4", "policy.min_features=64", "model.seq_len=128",
         "train.batch_size=4"]
BLOCK_INPUTS = "block inputs all-gather (attn, mlp)"


def collective_name(call: CollectiveCall) -> str:
    """What a collective of a tp step moves, from where it ran (fp8train's decoder under sequence_parallel_styles)."""
    in_block = ".attn" in call.module or ".mlp" in call.module
    if call.kind == "all_reduce":
        return "all-reduces (amaxes, norm weight gradients)"
    if in_block:
        return {("all_gather", False): BLOCK_INPUTS,
                ("reduce_scatter", False): "o_proj / down_proj outputs reduce-scatter",
                ("all_gather", True): "o_proj / down_proj output gradients all-gather",
                ("reduce_scatter", True): "block input gradients reduce-scatter"}[(call.kind, call.backward)]
    if call.module.endswith("lm_head") and not call.backward:
        return "final norm output all-gather (lm_head)"
    if call.kind == "all_gather" and call.backward:
        return "embedding output gradient all-gather"
    return f"{call.kind.replace('_', '-')} ({call.module or 'outside modules'}, {'backward' if call.backward else 'forward'})"


def _one_contender(cfg, contender: str, device: torch.device, steps: int, mesh) -> dict:
    from fp8train.training.parallel.tp_mesh import apply_tensor_parallel, reduce_partial_grads

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    convert_to_fp8(model, fp8_recipe_from_config(cfg), layer_policy_from_config(cfg))
    model.to(device)
    apply_tensor_parallel(model, mesh, sequence_parallel=True, fp8_gather=contender == "fp8 gather",
                          gather_dtype=torch.bfloat16 if contender == "bf16 gather" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, foreach=False)
    gen = torch.Generator().manual_seed(cfg.train.seed)
    losses, times, per_step = [], [], []
    for _ in range(steps):
        x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len), generator=gen).to(device)
        counter = CollectiveBytes()
        t0 = time.perf_counter()
        with counter:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                _, loss = model(x, x)
            loss.backward()
            reduce_partial_grads(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            update_fp8_scales(model)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        per_step.append(counter.by(collective_name))
        fp8_bytes = sum(c.nbytes for c in counter.calls if c.dtype == "uint8")  # packed FP8 codes and scales
    return {"contender": contender, "bytes_per_step": per_step[-1], "fp8_bytes_per_step": fp8_bytes,
            "step_s": statistics.median(times[1:] or times), "losses": losses}


def _worker(rank: int, port: int, device_type: str, steps: int, recipes: tuple, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank, world_size=WORLD)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    rows = []
    try:
        mesh = init_device_mesh(device_type, (WORLD,))
        for name in recipes:
            cfg = load_config(None, [*MODEL, f"fp8.recipe={name}"])
            for contender in TP_CONTENDERS:
                rows.append({"recipe": name, **_one_contender(cfg, contender, device, steps, mesh)})
    finally:
        gc.collect()  # (the groups held in reference cycles freed while the interpreter runs: distributed_section.py)
        dist.destroy_process_group()
    if rank == 0:
        Path(out_dir, "rows.json").write_text(json.dumps(rows))


def bench_tensor_parallel(device: str = "cpu", steps: int = 3,
                          recipes: tuple = (ScalingKind.CURRENT, ScalingKind.ROWWISE)) -> dict:
    """Launch WORLD processes (one tp group), measure every contender; the last step's bytes per collective."""
    if device == "cuda" and torch.cuda.device_count() < WORLD:
        return {"skipped": f"needs {WORLD} GPUs for {WORLD} NCCL ranks, {torch.cuda.device_count()} visible"}
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_worker, args=(free_port(), device, steps, recipes, out_dir), nprocs=WORLD,
                           start_method="spawn")
        rows = json.loads(Path(out_dir, "rows.json").read_text())
    by_key = {(r["recipe"], r["contender"]): r for r in rows}
    for r in rows:
        for other in ("fp32 gather", "bf16 gather"):
            reference = by_key[(r["recipe"], other)]["bytes_per_step"]
            r[f"vs_{other.replace(' ', '_')}"] = {name: b / reference[name] if reference.get(name) else None
                                                  for name, b in r["bytes_per_step"].items()}
        r["loss_equal_to_fp32_gather"] = r["losses"] == by_key[(r["recipe"], "fp32 gather")]["losses"]
    return {"world_size": WORLD, "tp_size": WORLD, "backend": "nccl" if device == "cuda" else "gloo",
            "steps": steps, "model": " ".join(MODEL), "rows": rows}


def format_tensor_parallel(section: dict) -> str:
    if "skipped" in section:
        return f"\ntensor parallelism: skipped ({section['skipped']})"
    lines = [f"\ntensor parallelism, tp {section['tp_size']} with sequence parallelism ({section['backend']}), "
             f"{section['model']}; collective bytes per optimizer step and rank (counted)"]
    for r in section["rows"]:
        lines.append(f"  recipe {r['recipe']}, {r['contender']}: {r['step_s'] * 1e3:.0f} ms/step, losses "
                     f"{'equal to' if r['loss_equal_to_fp32_gather'] else 'differ from'} the fp32 gather's; "
                     f"{r['fp8_bytes_per_step'] / 2**10:.1f} KiB as FP8 codes and scales")
        lines.append(f"    {'collective':<52} {'KiB':>10}  x fp32 gather  x bf16 gather")
        for name, nbytes in sorted(r["bytes_per_step"].items()):
            ratios = [r[key].get(name) for key in ("vs_fp32_gather", "vs_bf16_gather")]
            lines.append(f"    {name:<52} {nbytes / 2**10:>10.1f}  " + "  ".join(
                f"{'-' if x is None else f'{x:.1%}':>13}" for x in ratios))
    return "\n".join(lines)
