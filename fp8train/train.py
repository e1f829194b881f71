"""One training run: config in, run directory out.

    fp8train train recipes/cpu_delayed.yaml train.max_steps=100
    accelerate launch scripts/train.py --config recipes/cpu_delayed.yaml

The loop below is the whole story: build data and model (fp32 master weights), swap eligible Linears to FP8,
AdamW with fp32 state, then per optimizer step: the global batch of that step (a pure function of seed and step,
so every world size and every resume sees the same tokens), sliced for this rank and into micro-batches,
forward/backward under bf16 autocast, clip, step, and one FP8 scale update per optimizer step. Evaluation,
logging and checkpoints hang off the step counter.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from .checkpoint import latest_valid_checkpoint, load_checkpoint, save_checkpoint
from .config import (FullConfig, config_hash, config_to_yaml, fp8_recipe_from_config, layer_policy_from_config,
                     load_config)
from .data import build_data
from .model import build_model, count_params

__all__ = ["train", "run_dir_of", "cli_main", "add_cli_arguments"]


# ------------------------------------------------------------------------------------------------------------
# Set-up helpers
# ------------------------------------------------------------------------------------------------------------
def run_dir_of(cfg: FullConfig) -> Path:
    return Path(cfg.run.dir) / cfg.run.name


def make_accelerator(cfg: FullConfig):
    from accelerate import Accelerator

    cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device=cuda but no CUDA GPU is visible; use train.device=auto or cpu")
    log_with = "wandb" if cfg.log.wandb != "disabled" else None
    # Autocast is applied by the loop itself (same on every backend), so accelerate runs with mixed_precision=no.
    return Accelerator(cpu=cpu, mixed_precision="no", log_with=log_with)


def _prepare_run_dir(cfg: FullConfig, run_dir: Path, is_main: bool) -> None:
    """Refuse to clobber an existing run; on resume, refuse a run made from a different config."""
    config_file = run_dir / "config.yaml"
    if config_file.exists():
        if not cfg.train.resume:
            raise FileExistsError(
                f"run directory {run_dir} already holds a run; pass train.resume=true to continue it, or choose "
                "another run.name / run.dir (nothing was changed)")
        old = load_config(str(config_file))
        if config_hash(old) != config_hash(cfg):
            raise ValueError(f"train.resume=true but {config_file} was made from a different config (the model, "
                             "data, optimizer or FP8 settings differ); use a new run.name")
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file.write_text(config_to_yaml(cfg))


def _lr_at(step: int, cfg: FullConfig) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at max_steps."""
    warmup, total = cfg.optim.warmup_steps, cfg.train.max_steps
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = cfg.optim.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _make_optimizer(model: torch.nn.Module, cfg: FullConfig) -> torch.optim.Optimizer:
    # Weight decay on matrices only (not norms, biases); params stay fp32 (master weights), so does AdamW state.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.train.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                             foreach=False)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _all_mean(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.reduce(t, reduction="mean"))


@torch.no_grad()
def evaluate(model, batches, cfg: FullConfig, accelerator) -> float:
    """Mean validation loss over the fixed batches (split across ranks, summed back)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for i, (x, y) in enumerate(batches):
        if i % accelerator.num_processes != accelerator.process_index:
            continue
        with _autocast(cfg, accelerator.device):
            _, loss = model(x.to(accelerator.device), y.to(accelerator.device))
        total += torch.tensor([float(loss), 1.0], dtype=torch.float64, device=accelerator.device)
    if accelerator.num_processes > 1:
        total = accelerator.reduce(total, reduction="sum")
    model.train()
    return float(total[0] / total[1])


def _autocast(cfg: FullConfig, device: torch.device):
    if cfg.train.autocast == "none":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


class MetricsLog:
    """metrics.jsonl, written by the main process. On resume it keeps only lines up to the resumed step, so
    the file reads as if the run had never stopped."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None):
        self.path, self.enabled = path, enabled
        if enabled and resume_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))
        elif enabled and resume_step is None:
            path.write_text("")

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------------
def train(cfg: FullConfig, accelerator=None, show_progress: bool = True) -> dict:
    """Train one run as configured; returns the summary that is also written to summary.json."""
    from . import telemetry
    from .convert import convert_to_fp8, fp8_layers
    from .linear import update_fp8_scales

    started = time.time()
    accelerator = accelerator or make_accelerator(cfg)
    is_main, world = accelerator.is_main_process, accelerator.num_processes
    device = accelerator.device
    if device.type == "cpu" and world > 1:  # several processes on one CPU: share the cores, don't oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cfg.train.batch_size % (world * cfg.train.grad_accum):
        raise ValueError(f"train.batch_size={cfg.train.batch_size} must be divisible by processes x "
                         f"train.grad_accum = {world} x {cfg.train.grad_accum}")
    run_dir = run_dir_of(cfg)
    _prepare_run_dir(cfg, run_dir, is_main)  # every rank checks, so every rank fails the same way
    data = build_data(cfg)  # bad data paths fail here, before any training
    val_batches = data.val_batches()

    # Same seed -> same initial weights in every run of a pair, whatever the recipe.
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    fp8_recipe = fp8_recipe_from_config(cfg)
    conversion = None
    if fp8_recipe is not None:
        conversion = convert_to_fp8(model, fp8_recipe, layer_policy_from_config(cfg))
        if is_main and show_progress:
            print(conversion, file=sys.stderr)
    model.to(device)
    optimizer = _make_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_at(s, cfg))
    ddp_model, optimizer = accelerator.prepare(model, optimizer)

    start_step, resumed_from = 0, None
    ckpt_dir = run_dir / "checkpoints"
    if cfg.train.resume:
        latest = latest_valid_checkpoint(ckpt_dir, log=lambda m: is_main and print(m, file=sys.stderr))
        if latest is not None:
            manifest = load_checkpoint(latest, model, optimizer, scheduler)
            start_step, resumed_from = manifest["step"], str(latest)
    metrics = MetricsLog(run_dir / "metrics.jsonl", is_main, start_step if cfg.train.resume else None)
    if cfg.log.wandb != "disabled":
        accelerator.init_trackers(cfg.log.wandb_project, config=json.loads(json.dumps(
            _plain(cfg), default=str)), init_kwargs={"wandb": {"mode": cfg.log.wandb, "dir": str(run_dir),
                                                              "name": cfg.run.name, "resume": "allow"}})

    layers = fp8_layers(model)
    micro = cfg.train.batch_size // world // cfg.train.grad_accum
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    status, reason, last = "completed", None, {}
    skipped_steps = 0
    if start_step == 0:
        last["val_loss"] = evaluate(ddp_model, val_batches, cfg, accelerator)
        metrics.write({"step": 0, "val_loss": last["val_loss"], "lr": scheduler.get_last_lr()[0]})

    progress = _progress(cfg, start_step, is_main and show_progress)
    for step in range(start_step, cfg.train.max_steps):
        t0 = time.perf_counter()
        sample_telemetry = bool(layers) and cfg.log.telemetry_every > 0 and (step + 1) % cfg.log.telemetry_every == 0
        telemetry.enable(layers, sample_telemetry)

        # This rank's slice of the global batch, then micro-batches for gradient accumulation.
        x_all, y_all = data.train_batch(step)
        rank = accelerator.process_index
        x_rank = x_all[rank * micro * cfg.train.grad_accum:(rank + 1) * micro * cfg.train.grad_accum]
        y_rank = y_all[rank * micro * cfg.train.grad_accum:(rank + 1) * micro * cfg.train.grad_accum]
        loss_sum = 0.0
        for m in range(cfg.train.grad_accum):
            x = x_rank[m * micro:(m + 1) * micro].to(device)
            y = y_rank[m * micro:(m + 1) * micro].to(device)
            last_micro = m == cfg.train.grad_accum - 1
            with (nullcontext() if last_micro else accelerator.no_sync(ddp_model)), _autocast(cfg, device):
                _, loss = ddp_model(x, y)
            accelerator.backward(loss / cfg.train.grad_accum)
            loss_sum += float(loss.detach())
        step_loss = _all_mean(accelerator, loss_sum / cfg.train.grad_accum)

        if not math.isfinite(step_loss):
            status = "diverged"
            reason = f"loss became {step_loss} at step {step + 1}"
            last["divergence_telemetry"] = telemetry.capture_step(ddp_model, layers, x, y,
                                                                  lambda: _autocast(cfg, device))
            break

        grad_norm = float(accelerator.clip_grad_norm_(ddp_model.parameters(), cfg.train.grad_clip)
                          if cfg.train.grad_clip > 0 else _grad_norm(model))
        if math.isfinite(grad_norm) or not cfg.train.skip_nonfinite_grads:
            optimizer.step()
        else:  # the guard: a step with NaN/inf gradients is skipped, counted and logged
            skipped_steps += 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        update_fp8_scales(model)  # delayed scaling: one all-reduce of all amaxes, then new scales
        seconds = time.perf_counter() - t0

        done = step + 1
        record = {"step": done, "loss": step_loss, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_step / seconds, "step_s": seconds,
                  "elapsed_s": time.time() - started}
        if layers:
            record.update(telemetry.counters(layers))
        if skipped_steps:
            record["skipped_steps"] = skipped_steps
        if sample_telemetry:
            stats = telemetry.collect(layers)
            record.update(telemetry.summarize(stats))
            telemetry.append(run_dir / "telemetry.jsonl", done, stats, is_main)
        is_eval = done % cfg.train.eval_every == 0 or done == cfg.train.max_steps
        if is_eval:
            record["val_loss"] = last["val_loss"] = evaluate(ddp_model, val_batches, cfg, accelerator)
        last["loss"] = step_loss
        if is_eval or done % cfg.log.every == 0 or done == cfg.train.max_steps:
            metrics.write(record)
            if cfg.log.wandb != "disabled":
                accelerator.log({k: v for k, v in record.items() if k != "step"}, step=done)
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.3f}", refresh=False)

        if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < cfg.train.max_steps:
            _checkpoint(accelerator, ckpt_dir, done, model, optimizer, scheduler, cfg)
    else:
        done = cfg.train.max_steps
        if cfg.checkpoint.save_final and start_step < done:
            _checkpoint(accelerator, ckpt_dir, done, model, optimizer, scheduler, cfg)
    progress.close()

    summary = {
        "status": status, "reason": reason, "steps": done if status == "completed" else step,
        "loss": last.get("loss"), "val_loss": last.get("val_loss"), "world_size": world,
        "tokens": (done if status == "completed" else step) * tokens_per_step,
        "wall_time_s": time.time() - started, "peak_memory_mb": _peak_memory_mb(device),
        "recipe": fp8_recipe.code() if fp8_recipe is not None else "none", "params": count_params(model),
        "fp8_layers": len(layers), "skipped_steps": skipped_steps, "resumed_from": resumed_from,
        "seed": cfg.train.seed, "config_hash": config_hash(cfg),
    }
    if layers:
        summary.update(telemetry.counters(layers))
    if conversion is not None:
        summary["conversion"] = {"converted": [n for n, _ in conversion.converted],
                                 "skipped": [[n, r] for n, r in conversion.skipped]}
    if "divergence_telemetry" in last:
        summary["divergence_telemetry"] = last["divergence_telemetry"]
    if is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        if show_progress:
            val = f"{summary['val_loss']:.4f}" if summary["val_loss"] is not None else "n/a"
            print(f"[{cfg.run.name}] {status}: {summary['steps']} steps, val_loss {val}, "
                  f"{summary['wall_time_s']:.1f}s, recipe {summary['recipe']}"
                  + (f" ({reason})" if reason else ""), file=sys.stderr)
    if cfg.log.wandb != "disabled":
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return summary


def _checkpoint(accelerator, ckpt_dir, step, model, optimizer, scheduler, cfg: FullConfig) -> None:
    # Replicated state (DDP): rank 0 writes, everyone waits, so no rank races ahead of a half-written checkpoint.
    if accelerator.is_main_process:
        save_checkpoint(ckpt_dir, step, model, optimizer, scheduler, extra={"config_hash": config_hash(cfg)},
                        keep_last=cfg.checkpoint.keep_last)
    accelerator.wait_for_everyone()


def _grad_norm(model) -> float:
    norms = [p.grad.detach().float().norm() for p in model.parameters() if p.grad is not None]
    return float(torch.stack(norms).norm()) if norms else 0.0


def _plain(cfg: FullConfig) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def _progress(cfg: FullConfig, start: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=cfg.train.max_steps, initial=start, desc=cfg.run.name, disable=not enabled,
                mininterval=2.0, dynamic_ncols=True, leave=False)


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def add_cli_arguments(parser) -> None:
    parser.add_argument("config", help="recipe YAML, e.g. recipes/cpu_delayed.yaml")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=100")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or conversion table")


def cli_main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, show_progress=not args.quiet)
    return 0 if summary["status"] == "completed" else 1
