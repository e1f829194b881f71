"""One optimizer step of the training loop, and which steps read anything back from the device.

`optimizer_step` trains step `step` -> `step + 1`: this rank's slice of the step's global batch (a pure function
of seed and step) in micro-batches, forward/backward under `train.autocast`, the gradient norm and clip, the
device-side skip/divergence decision (step_guard.StepGuard; optim.AdamW's found_inf), the AdamW step and one FP8
scale update. Only a sync step (`is_sync_step`: logged, evaluation, checkpoint or telemetry steps, and the last)
reads the loss and gradient norm back, for every step since the previous one; the others make no host sync.
`LoopState` is what changes from step to step, shared with fp8train.training.loop.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8train.nn.linear import update_fp8_scales
from fp8train.training.config import FullConfig
from fp8train.training.evaluation import run_autocast
from fp8train.training.models.moe import moe_metrics
from fp8train.training.parallel.distributed import all_mean_tensor
from fp8train.training.parallel.fsdp2 import clip_grad_norm_tensor, grad_norm_tensor
from fp8train.training.parallel.tp_mesh import reduce_partial_grads
from fp8train.training.runs import telemetry
from fp8train.training.setup import Run
from fp8train.training.step_guard import StepGuard

__all__ = ["LoopState", "optimizer_step", "is_sync_step", "step_kinds", "is_periodic_checkpoint"]


@dataclass
class LoopState:
    """What changes from step to step, and what a checkpoint carries of it (`counts`)."""

    start_step: int = 0
    done: int = 0
    status: str = "completed"
    reason: str | None = None
    diverged_at: int | None = None
    resumed_from: str | None = None
    last_checkpoint: Path | None = None
    skipped_steps: int = 0
    consecutive_skips: int = 0
    last: dict = field(default_factory=dict)  # latest loss, val_loss (and divergence telemetry)
    sampled: bool = False  # this step's FP8 telemetry was recorded (log.telemetry_every)
    guard: StepGuard | None = None  # the device-side skip/divergence decision (step_guard.py)
    window_seconds: float = 0.0  # host time of the steps since the last sync point (for tokens_per_s)
    window_steps: int = 0

    def counts(self) -> dict:
        return {"skipped_steps": self.skipped_steps, "consecutive_skips": self.consecutive_skips}


def optimizer_step(run: Run, state: LoopState, step: int) -> dict | None:
    """Train step `step` -> `step + 1`. Returns its metrics record on a sync step, {} on the others (which make
    no host sync), or None when the run diverged (state says where and why)."""
    cfg, t0 = run.cfg, time.perf_counter()
    every = cfg.log.telemetry_every
    state.sampled = (bool(run.layers) or bool(run.experts) or run.shadow is not None) and every > 0 and \
        (step + 1) % every == 0
    telemetry.enable(run.layers, state.sampled)
    telemetry.enable_experts(run.experts, state.sampled)
    if run.shadow is not None:
        run.shadow.arm(state.sampled)
    state.guard.begin_step()
    step_loss = _forward_backward(run, step)
    found_inf = state.guard.decide(step, step_loss, _clip_grad_norm(run))
    synced = is_sync_step(cfg, step + 1, state.sampled)
    # Divergence: stop BEFORE the step is applied, so the weights (and every checkpoint) stay finite. Between
    # sync points the device does the same: a diverged step and every one after it change nothing.
    last = _account_steps(run, state) if synced else None
    if synced and last is None:
        return None
    _unwrapped(run.optimizer).found_inf = found_inf  # 1.0: skipped (non-finite gradients) or diverged
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    state.guard.freeze_fp8_state()
    update_fp8_scales(run.model)  # delayed scaling: one all-reduce of all amaxes, then new scales
    state.done = step + 1
    state.window_seconds += time.perf_counter() - t0
    state.window_steps += 1
    return _record(run, state, *last) if synced else {}


def _account_steps(run: Run, state: LoopState) -> tuple[float, float] | None:
    """A sync point: the steps since the last one, read back in one host sync and counted as the host always
    counted them (skips, consecutive skips, divergence at the exact step); (loss, grad norm) of the newest, or
    None when one of them diverged."""
    counted = state.guard.account(state.skipped_steps, state.consecutive_skips)
    state.skipped_steps, state.consecutive_skips = counted.skipped_steps, counted.consecutive_skips
    if counted.last is not None:
        state.last["loss"] = counted.last[0]
    if counted.reason is not None:
        _stop_diverged(run, state, counted.diverged_step, counted.reason)
        return None
    return counted.last


def _stop_diverged(run: Run, state: LoopState, step: int, reason: str) -> None:
    """Step `step` diverged: the run ends there, in the state that step began with (the device froze it)."""
    state.status, state.reason, state.diverged_at, state.done = "diverged", reason, step + 1, step
    state.guard.freeze_fp8_state()  # the current step's forward/backward counted nothing, if it came later
    # Re-run this rank's last micro-batch of that step on the plain module (no DDP hooks, so no collectives
    # that the other ranks might not join) with telemetry on: which layer broke, in which role.
    run.optimizer.zero_grad(set_to_none=True)
    x, y = list(_micro_batches(run, step))[-1]
    state.last["divergence_telemetry"] = telemetry.capture_step(
        run.model, run.layers, x, y, lambda: run_autocast(run.cfg, run.accelerator.device))


def _record(run: Run, state: LoopState, step_loss: float, grad_norm: float) -> dict:
    """The metrics line of a sync step; throughput over the steps since the previous one (their host time: on
    CUDA the steps between syncs are only queued, the sync waits for all of them)."""
    cfg, seconds = run.cfg, state.window_seconds / max(state.window_steps, 1)
    state.window_seconds, state.window_steps = 0.0, 0
    return {"step": state.done, "loss": step_loss, "lr": run.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
            "tokens_per_s": cfg.train.batch_size * cfg.model.seq_len / seconds, "step_s": seconds,
            "elapsed_s": time.time() - run.started, "skipped_steps": state.skipped_steps, **moe_metrics(run.model)}


def _unwrapped(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer holds the AdamW


def _micro_batches(run: Run, step: int):
    """This rank's slice of step `step`'s global batch, as (x, y) micro-batches on the device."""
    cfg, accelerator, device = run.cfg, run.accelerator, run.accelerator.device
    accum = cfg.train.grad_accum
    dp_rank, dp_size = run.data_parallel  # a tensor-parallel group shares one slice
    micro = cfg.train.batch_size // dp_size // accum
    x_all, y_all = run.data.train_batch(step)
    rank_rows = slice(dp_rank * micro * accum, (dp_rank + 1) * micro * accum)
    x_rank, y_rank = x_all[rank_rows], y_all[rank_rows]
    for m in range(accum):
        rows = slice(m * micro, (m + 1) * micro)
        yield _to_device(x_rank[rows], device), _to_device(y_rank[rows], device)


def _to_device(tokens: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A blocking host-to-GPU copy waits for all queued GPU work (a host sync each micro-batch): copy from pinned
    # memory without blocking (the pinned block is not reused before its copy has run).
    if device.type == "cuda":
        return tokens.pin_memory().to(device, non_blocking=True)
    return tokens.to(device)


def _forward_backward(run: Run, step: int) -> torch.Tensor:
    """Forward/backward of this rank's micro-batches (gradient accumulation); the loss averaged over
    micro-batches and ranks, a () float64 tensor on the device (no host sync)."""
    cfg, accelerator, device = run.cfg, run.accelerator, run.accelerator.device
    accum = cfg.train.grad_accum
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for m, (x, y) in enumerate(_micro_batches(run, step)):
        if cfg.train.parallel == "fsdp2":  # FSDP2 decides in backward (DDP in forward): reduce-scatter the last
            run.model.set_requires_gradient_sync(m == accum - 1)  # micro-batch's only
            sync = nullcontext()
        elif run.sharded:  # tensor parallelism with dp = 1: no DDP wrapper, nothing to hold back
            sync = nullcontext()
        else:
            sync = nullcontext() if m == accum - 1 else accelerator.no_sync(run.ddp_model)
        with sync, run_autocast(cfg, device):
            _, loss = run.ddp_model(x, y)
        # FSDP2 sums gradients over ranks (fsdp2.apply_fsdp2), so each micro-batch counts 1 / (its number in
        # the global batch): a rank's grad_output, hence its FP8 scale history, is the same at any world size.
        # (tensor parallelism: every rank of a tp group holds the whole loss of its slice: dp ranks count)
        fsdp2 = cfg.train.parallel == "fsdp2"
        accelerator.backward(loss / (accum * run.data_parallel[1] if fsdp2 else accum))
        loss_sum += loss.detach().double()  # the same float64 sum as before, without a sync per micro-batch
    # an IEEE float64 division by a device tensor, as the host's float(loss_sum) / accum was (on CUDA a Python
    # scalar divisor becomes a multiply by its reciprocal)
    return all_mean_tensor(accelerator, loss_sum / torch.full((), float(accum), dtype=torch.float64, device=device))


def _clip_grad_norm(run: Run) -> torch.Tensor:
    # One rule for DDP (replicated gradients) and FSDP2 (DTensor shards): a float64 norm that does not depend on
    # how the gradient is split, so both, at any world size, clip by the same factor (fsdp2.grad_norm).
    if run.cfg.train.tp_size > 1:
        reduce_partial_grads(run.model)  # (sequence-parallel norms: partial sums over positions)
    clip = run.cfg.train.grad_clip
    return clip_grad_norm_tensor(run.model, clip) if clip > 0 else grad_norm_tensor(run.model)


def is_periodic_checkpoint(cfg: FullConfig, done: int) -> bool:
    return bool(cfg.checkpoint.every) and done % cfg.checkpoint.every == 0 and done < cfg.train.max_steps


def step_kinds(cfg: FullConfig, done: int) -> tuple[bool, bool]:
    """(evaluation step, logged step) for the step that made `done` steps."""
    is_eval = done == cfg.train.max_steps or (cfg.train.eval_every > 0 and done % cfg.train.eval_every == 0)
    return is_eval, is_eval or done % cfg.log.every == 0 or done == cfg.train.max_steps


def is_sync_step(cfg: FullConfig, done: int, sampled: bool) -> bool:
    """The steps where the loop reads anything back from the device: logged (evaluation and last steps
    included), periodic checkpoint and telemetry steps. Every other step issues no host sync."""
    return step_kinds(cfg, done)[1] or is_periodic_checkpoint(cfg, done) or sampled
