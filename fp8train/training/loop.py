"""One training run: config in, run directory out.

    fp8train train recipes/cpu_delayed.yaml train.max_steps=100
    accelerate launch scripts/train.py --config recipes/cpu_delayed.yaml

The loop below is the whole story: build data and model (fp32 master weights), swap eligible Linears to FP8,
AdamW with fp32 state, then per optimizer step: the global batch of that step (a pure function of seed and step,
so every world size and every resume sees the same tokens), sliced for this rank and into micro-batches,
forward/backward under bf16 autocast, clip, step, and one FP8 scale update per optimizer step. Evaluation,
logging and checkpoints hang off the step counter.

What a run promises (tests/test_train.py, test_multiprocess.py, test_crash_resume.py prove each):
- everything is checked before anything is written: config, data, model, and an existing run directory (never
  overwritten without train.resume=true);
- a resumed run (train.resume=true, newest checkpoint that verifies) logs exactly what the uninterrupted run
  logs, on CPU bit for bit: batches are a pure function of (seed, step) and the checkpoint holds everything else;
- it stops as "diverged" at the first non-finite loss, at a non-finite gradient that the guard
  (train.skip_nonfinite_grads) does not skip, after MAX_CONSECUTIVE_SKIPS skipped steps in a row, or before
  saving non-finite weights; summary.json names the step, the reason and the last good checkpoint, and no
  checkpoint is ever written from a diverged state;
- with several processes, every rank ends every step with the same FP8 scaling state (checked on every logged
  step: a SHA-256 of all FP8 buffers is compared across ranks), and the non-finite amax counters count the
  events of all ranks.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from fp8train.nn.linear import configure_execution
from fp8train.training.checkpoint import latest_valid_checkpoint, load_checkpoint, save_checkpoint
from fp8train.training.compile import check_compiler, compile_model
from fp8train.training.config import (FullConfig, add_config_arguments, config_hash, config_to_yaml, fp8_recipe_from_config,
                     layer_policy_from_config, load_config)
from fp8train.training.data import build_data
from fp8train.training.model import build_model, count_params

__all__ = ["train", "run_dir_of", "cli_main", "add_cli_arguments", "fp8_state_digest"]

# With train.skip_nonfinite_grads, a run whose gradients stay non-finite this many optimizer steps in a row has
# diverged (it is no longer training: every step is skipped), and stops as such.
MAX_CONSECUTIVE_SKIPS = 5


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


def _prepare_run_dir(cfg: FullConfig, run_dir: Path, accelerator) -> None:
    """Refuse to clobber an existing run; on resume, refuse a run made from a different config.

    Every rank checks before rank 0 writes (a barrier between the two), so every rank fails alike and no rank
    mistakes the config.yaml that rank 0 just wrote for an earlier run."""
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
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_atomic(config_file, config_to_yaml(cfg))
    accelerator.wait_for_everyone()


def _write_atomic(path: Path, text: str) -> None:
    """Replace `path` whole: a process killed mid-write leaves the old file, never half of the new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def _check_distributed_type(accelerator) -> None:
    kind = getattr(accelerator, "distributed_type", "")
    kind = str(getattr(kind, "value", kind)).rsplit(".", 1)[-1].upper()  # DistributedType.FSDP -> "FSDP"
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        raise ValueError(f"accelerate is configured for {kind}, which fp8train's loop does not support: it keeps "
                         "the model replicated (DDP) and checkpoints rank 0's full state; launch with "
                         "`accelerate launch --multi_gpu` (or --cpu) instead")


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
    """Mean validation loss over the fixed batches (split across ranks, summed back). `model` is the plain
    module, not the DDP wrapper: ranks may run different numbers of batches, and a DDP forward can start a
    collective (buffer broadcast) that the other ranks would never join."""
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


def _read_jsonl(path: Path) -> list[dict]:
    """The complete lines of a JSONL file; a torn last line (a process killed mid-write) is dropped."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
    return records


def _truncate_jsonl(path: Path, last_step: int) -> list[dict]:
    """Keep the lines of steps <= last_step (a resumed run rewrites what came after its checkpoint)."""
    kept = [r for r in _read_jsonl(path) if r["step"] <= last_step]
    if path.exists():
        _write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


class MetricsLog:
    """metrics.jsonl, written by the main process. On resume it keeps only lines up to the resumed step, so
    the file reads as if the run had never stopped."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None):
        self.path, self.enabled, self.kept = path, enabled, []
        if enabled and resume_step is not None:
            self.kept = _truncate_jsonl(path, resume_step)
        elif enabled:
            path.write_text("")

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")


# ------------------------------------------------------------------------------------------------------------
# FP8 state across ranks
# ------------------------------------------------------------------------------------------------------------
def fp8_state_digest(layers) -> str:
    """SHA-256 over the FP8 buffers (scales, amax histories, counters; not the per-step pending amaxes) of
    `layers` [(name, Fp8Linear)], in order: equal digests mean bit-identical FP8 scaling state."""
    names, flat = [], []
    for name, layer in layers:
        for buf_name, buf in layer.named_buffers(recurse=False):
            if not buf_name.endswith("_pending_amax"):  # per-step scratch, -1 between steps
                names.append(f"{name}.{buf_name}")
                flat.append(buf.detach().reshape(-1).view(torch.uint8))
    digest = hashlib.sha256("\n".join(names).encode())
    if flat:
        digest.update(torch.cat(flat).cpu().numpy().tobytes())  # one device-to-host copy
    return digest.hexdigest()


class Fp8StateSync:
    """Keeps the FP8 state of data-parallel ranks one state.

    Scales and amax histories are made identical by update_fp8_scales (one all-reduce MAX per step); `check()`
    proves it by comparing a digest of all FP8 buffers across ranks. The non-finite amax counters are event
    counts of each rank's own tensors, so `check()` first adds up what every rank saw since the last check:
    afterwards every rank (and every checkpoint) holds the totals of all ranks. One process: nothing to do."""

    def __init__(self, layers, accelerator):
        from fp8train.nn.recipes import ROLES

        self.layers, self.accelerator = layers, accelerator
        self.active = accelerator.num_processes > 1 and bool(layers)
        self.counters = [getattr(layer, f"{role}_nonfinite_amax_count") for _, layer in layers for role in ROLES]
        self.synced = torch.stack(self.counters).clone() if self.active else None

    def sync_counters(self) -> None:
        if not self.active:
            return
        import torch.distributed as dist

        delta = torch.stack(self.counters) - self.synced
        dist.all_reduce(delta, op=dist.ReduceOp.SUM)
        self.synced = self.synced + delta
        for counter, total in zip(self.counters, self.synced):
            counter.copy_(total)

    def check(self, step: int) -> None:
        """Sync the counters, then compare the FP8 state digests of all ranks (raises if they differ)."""
        if not self.active:
            return
        self.sync_counters()
        digest = fp8_state_digest(self.layers)
        words = torch.tensor([int(digest[i:i + 15], 16) for i in range(0, 60, 15)], dtype=torch.int64,
                             device=self.accelerator.device)
        gathered = self.accelerator.gather(words).reshape(self.accelerator.num_processes, -1)
        if not bool((gathered == gathered[0]).all()):
            raise RuntimeError(f"FP8 scaling state differs between ranks after step {step} (a bug: "
                               "update_fp8_scales must leave every rank with the same scales)")


# ------------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------------
def train(cfg: FullConfig, accelerator=None, show_progress: bool = True, should_stop=None) -> dict:
    """Train one run as configured; returns the summary that is also written to summary.json.

    ``should_stop(record) -> str | None`` is asked after every logged step (record = the metrics line); a
    reason string stops the run there with status "stopped" (validate uses it to cut a diverging candidate).
    """
    from fp8train.training import telemetry
    from fp8train.nn.convert import convert_to_fp8, fp8_layers
    from fp8train.nn.linear import update_fp8_scales

    started = time.time()
    accelerator = accelerator or make_accelerator(cfg)
    _check_distributed_type(accelerator)
    is_main, world = accelerator.is_main_process, accelerator.num_processes
    device = accelerator.device
    if device.type == "cpu" and cfg.train.threads > 0:  # tiny GEMMs: OpenMP threads cost more than they give
        torch.set_num_threads(cfg.train.threads)
    elif device.type == "cpu" and world > 1:  # several processes on one CPU: share the cores, don't oversubscribe
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cfg.train.batch_size % (world * cfg.train.grad_accum):
        raise ValueError(f"train.batch_size={cfg.train.batch_size} must be divisible by processes x "
                         f"train.grad_accum = {world} x {cfg.train.grad_accum}")
    # Everything that can fail on a user mistake fails here, before the run directory is touched.
    data = build_data(cfg)
    val_batches = data.val_batches()
    # Same seed -> same initial weights in every run of a pair, whatever the recipe.
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    fp8_recipe = fp8_recipe_from_config(cfg)
    conversion = None
    if fp8_recipe is not None:
        conversion = convert_to_fp8(model, fp8_recipe, layer_policy_from_config(cfg))
        # How the FP8 layers run (same numbers): read once here ("auto" kernel: measured once per machine).
        configure_execution(model, quantize_kernel=cfg.fp8.quantize_kernel, emulated_dtype=cfg.fp8.emulated_dtype)
    if cfg.train.compile:
        check_compiler(device)  # a missing compiler is a config error, before the run directory is touched
    run_dir = run_dir_of(cfg)
    _prepare_run_dir(cfg, run_dir, accelerator)  # every rank checks, so every rank fails the same way
    if conversion is not None and is_main and show_progress:
        print(conversion, file=sys.stderr)

    model.to(device)
    if cfg.train.compile:
        compile_model(model)
    optimizer = _make_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: _lr_at(s, cfg))
    ddp_model, optimizer = accelerator.prepare(model, optimizer)
    if ddp_model is not model and hasattr(ddp_model, "broadcast_buffers"):
        # DDP would copy rank 0's buffers over every rank's at each forward: that hides a rank whose FP8 state
        # went astray (update_fp8_scales' all-reduce keeps them equal; Fp8StateSync checks it) and overwrites
        # the non-finite amax counters of the other ranks.
        ddp_model.broadcast_buffers = False

    start_step, resumed_from, last_checkpoint, counts = 0, None, None, {}
    ckpt_dir = run_dir / "checkpoints"
    if cfg.train.resume:
        latest = latest_valid_checkpoint(ckpt_dir, log=lambda m: is_main and print(m, file=sys.stderr))
        if latest is not None:
            manifest = load_checkpoint(latest, model, optimizer, scheduler)
            start_step, resumed_from = manifest["step"], str(latest)
            last_checkpoint, counts = latest, manifest.get("extra", {})
            if is_main and show_progress:
                print(f"[{cfg.run.name}] resuming from {latest}", file=sys.stderr)
    resumed = resumed_from is not None
    metrics = MetricsLog(run_dir / "metrics.jsonl", is_main, start_step if resumed else None)
    if is_main and resumed:
        _truncate_jsonl(run_dir / "telemetry.jsonl", start_step)
    elif is_main and (run_dir / "telemetry.jsonl").exists():
        (run_dir / "telemetry.jsonl").write_text("")
    if cfg.log.wandb != "disabled":
        os.environ.setdefault("WANDB_SILENT", "true")  # our progress bar and summary line say what matters
        accelerator.init_trackers(cfg.log.wandb_project, config=json.loads(json.dumps(
            _plain(cfg), default=str)), init_kwargs={"wandb": {"mode": cfg.log.wandb, "dir": str(run_dir),
                                                              "name": cfg.run.name, "resume": "allow"}})

    layers = fp8_layers(model)
    fp8_sync = Fp8StateSync(layers, accelerator)
    micro = cfg.train.batch_size // world // cfg.train.grad_accum
    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    status, reason, last = "completed", None, {}
    for record in metrics.kept:  # a resumed run reports its last losses even if it has no step left to run
        last.update({k: record[k] for k in ("loss", "val_loss") if k in record})
    skipped_steps, consecutive_skips = counts.get("skipped_steps", 0), counts.get("consecutive_skips", 0)
    diverged_at = None
    if start_step == 0:
        last["val_loss"] = evaluate(model, val_batches, cfg, accelerator)
        metrics.write({"step": 0, "val_loss": last["val_loss"], "lr": scheduler.get_last_lr()[0]})

    progress = _progress(cfg, start_step, is_main and show_progress)
    done = start_step
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

        # Divergence: stop BEFORE the step is applied, so the weights (and every checkpoint) stay finite.
        grad_norm = math.nan
        if math.isfinite(step_loss):
            grad_norm = float(accelerator.clip_grad_norm_(ddp_model.parameters(), cfg.train.grad_clip)
                              if cfg.train.grad_clip > 0 else _grad_norm(model))
        if not math.isfinite(step_loss):
            reason = f"loss became {step_loss} at step {step + 1}"
        elif not math.isfinite(grad_norm) and not cfg.train.skip_nonfinite_grads:
            reason = (f"gradient norm became {grad_norm} at step {step + 1} (train.skip_nonfinite_grads=false, "
                      "so the step was not applied)")
        elif not math.isfinite(grad_norm) and consecutive_skips + 1 >= MAX_CONSECUTIVE_SKIPS:
            reason = (f"gradient norm non-finite for {consecutive_skips + 1} steps in a row (steps "
                      f"{step + 2 - MAX_CONSECUTIVE_SKIPS}-{step + 1}); every one was skipped")
        if reason is not None:
            status, diverged_at = "diverged", step + 1
            # Re-run this rank's last micro-batch on the plain module (no DDP hooks, so no collectives that
            # the other ranks might not join) with telemetry on: which layer broke, in which role.
            optimizer.zero_grad(set_to_none=True)
            last["divergence_telemetry"] = telemetry.capture_step(model, layers, x, y,
                                                                  lambda: _autocast(cfg, device))
            break

        if math.isfinite(grad_norm):
            optimizer.step()
            consecutive_skips = 0
        else:  # the guard: a step with NaN/inf gradients is skipped, counted and logged
            skipped_steps += 1
            consecutive_skips += 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        update_fp8_scales(model)  # delayed scaling: one all-reduce of all amaxes, then new scales
        seconds = time.perf_counter() - t0

        done = step + 1
        is_eval = done == cfg.train.max_steps or (cfg.train.eval_every > 0 and done % cfg.train.eval_every == 0)
        is_logged = is_eval or done % cfg.log.every == 0 or done == cfg.train.max_steps
        is_checkpoint = bool(cfg.checkpoint.every) and done % cfg.checkpoint.every == 0 \
            and done < cfg.train.max_steps
        if is_logged or is_checkpoint:
            fp8_sync.check(done)  # every rank holds the same FP8 state (raises if not); counters summed
        record = {"step": done, "loss": step_loss, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                  "tokens_per_s": tokens_per_step / seconds, "step_s": seconds,
                  "elapsed_s": time.time() - started, "skipped_steps": skipped_steps}
        if layers:
            record.update(telemetry.counters(layers))
        if sample_telemetry:
            stats = telemetry.collect(layers)
            record.update(telemetry.summarize(stats))
            telemetry.append(run_dir / "telemetry.jsonl", done, stats, is_main)
        if is_eval:
            record["val_loss"] = last["val_loss"] = evaluate(model, val_batches, cfg, accelerator)
        last["loss"] = step_loss
        if is_logged:
            metrics.write(record)
            if cfg.log.wandb != "disabled":
                accelerator.log({k: v for k, v in record.items() if k != "step"}, step=done)
        progress.update(1)
        progress.set_postfix(loss=f"{step_loss:.3f}", refresh=False)
        stop_reason = should_stop(record) if should_stop is not None else None
        if stop_reason:
            status, reason = "stopped", stop_reason
            break

        if is_checkpoint:
            loop_state = {"skipped_steps": skipped_steps, "consecutive_skips": consecutive_skips}
            saved = _checkpoint(accelerator, ckpt_dir, done, model, optimizer, scheduler, cfg, loop_state)
            if saved is None:
                status, diverged_at = "diverged", done
                reason = f"parameters became non-finite at step {done}; its checkpoint was not written"
                break
            last_checkpoint = saved
    else:
        done = cfg.train.max_steps
        if cfg.checkpoint.save_final and start_step < done:
            loop_state = {"skipped_steps": skipped_steps, "consecutive_skips": consecutive_skips}
            saved = _checkpoint(accelerator, ckpt_dir, done, model, optimizer, scheduler, cfg, loop_state)
            if saved is None:
                status, diverged_at = "diverged", done
                reason = f"parameters became non-finite at step {done}; the final checkpoint was not written"
            last_checkpoint = saved or last_checkpoint
    progress.close()
    if status == "diverged":
        done = diverged_at - 1  # the steps that completed before the failing one

    fp8_sync.check(done)
    summary = {
        "status": status, "reason": reason, "steps": done,
        "loss": last.get("loss"), "val_loss": last.get("val_loss"), "world_size": world,
        "tokens": done * tokens_per_step,
        "wall_time_s": time.time() - started, "peak_memory_mb": _peak_memory_mb(device),
        "recipe": fp8_recipe.code() if fp8_recipe is not None else "none", "params": count_params(model),
        "fp8_layers": len(layers), "skipped_steps": skipped_steps, "resumed_from": resumed_from,
        "seed": cfg.train.seed, "config_hash": config_hash(cfg),
        "diverged_at_step": diverged_at, "last_good_checkpoint": str(last_checkpoint) if last_checkpoint else None,
        "fp8_state_sha256": fp8_state_digest(layers) if layers else None,
    }
    if layers:
        summary.update(telemetry.counters(layers))
    if conversion is not None:
        summary["conversion"] = {"converted": [n for n, _ in conversion.converted],
                                 "skipped": [[n, r] for n, r in conversion.skipped]}
    if "divergence_telemetry" in last:
        summary["divergence_telemetry"] = last["divergence_telemetry"]
    if is_main:
        _write_atomic(run_dir / "summary.json", json.dumps(summary, indent=2, default=str))
        if show_progress:
            val = f"{summary['val_loss']:.4f}" if summary["val_loss"] is not None else "n/a"
            print(f"[{cfg.run.name}] {status}: {summary['steps']} steps, val_loss {val}, "
                  f"{summary['wall_time_s']:.1f}s, recipe {summary['recipe']}"
                  + (f" ({reason})" if reason else ""), file=sys.stderr)
    if cfg.log.wandb != "disabled":
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return summary


def _checkpoint(accelerator, ckpt_dir, step, model, optimizer, scheduler, cfg: FullConfig,
                loop_state: dict) -> Path | None:
    """Save (rank 0 writes, everyone waits, so no rank races ahead of a half-written checkpoint); its path, or
    None and nothing written when the weights are not all finite: a checkpoint is always a state worth resuming.
    `loop_state` (the skip-guard counters) rides in the manifest, so a resumed run counts on where it stopped."""
    if not _all_finite(model):
        return None
    path = ckpt_dir / f"step_{step:06d}"
    if accelerator.is_main_process:
        path = save_checkpoint(ckpt_dir, step, model, optimizer, scheduler,
                               extra={"config_hash": config_hash(cfg), **loop_state},
                               keep_last=cfg.checkpoint.keep_last)
    accelerator.wait_for_everyone()
    return path


@torch.no_grad()
def _all_finite(model) -> bool:
    # DDP keeps the parameters identical on every rank, so every rank reaches the same answer.
    return bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())


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
    add_config_arguments(parser, "recipes/cpu_delayed.yaml", "train.max_steps=100", "progress bar or conversion table")


def cli_main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    summary = train(cfg, show_progress=not args.quiet)
    return 0 if summary["status"] == "completed" else 1
