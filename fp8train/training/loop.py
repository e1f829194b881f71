"""One training run: config in, run directory out.

    fp8train train recipes/cpu_delayed.yaml train.max_steps=100
    accelerate launch scripts/train.py --config recipes/cpu_delayed.yaml

`train()` below is the whole story, in named steps: set up (data, model with fp32 master weights, the FP8 swap,
AdamW with fp32 state, the run directory), resume, then per optimizer step: the global batch of that step (a
pure function of seed and step, so every world size and every resume sees the same tokens), sliced for this
rank and into micro-batches, forward/backward under `train.autocast`, clip, step, one FP8 scale update; then
log, evaluate and checkpoint as the step counter says, and finally the summary.

What a run promises (tests/test_train.py, test_multiprocess.py, test_crash_resume.py prove each):
- everything is checked before anything is written: config, launcher settings, data, model, trackers, and an
  existing run directory (never overwritten; resume rules in fp8train.training.runs.resume);
- a resumed run logs exactly what the uninterrupted run logs, on CPU bit for bit: batches are a pure function
  of (seed, step) and the checkpoint holds everything else;
- it stops as "diverged" at the first non-finite loss, at a non-finite gradient that the guard
  (train.skip_nonfinite_grads) does not skip, after MAX_CONSECUTIVE_SKIPS skipped steps in a row, or before
  saving non-finite weights; summary.json names the step, the reason and the last good checkpoint, and no
  checkpoint is ever written from a diverged state;
- a step that logs nothing syncs nothing: the skip/divergence decision is made on the device
  (fp8train.training.step_guard, optim.AdamW's found_inf) and read back at the next sync point (a logging,
  evaluation, checkpoint or telemetry step, or the last step), which reports the exact step it happened at;
- SIGTERM or Ctrl-C (SIGINT) during the steps leaves a summary.json with status "interrupted", the step it
  stopped after and by which signal (fp8train.training.runs.lifetime); the run resumes from its last checkpoint;
- with several processes, every rank ends every step with the same FP8 scaling state (checked on every logged
  step: a SHA-256 of all FP8 buffers is compared across ranks), and the non-finite amax counters count the
  events of all ranks.
"""

from __future__ import annotations

import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from fp8train.nn.linear import update_fp8_scales
from fp8train.training.runs import telemetry
from fp8train.training.shadow import gemm_paths
from fp8train.training.runs.checkpoint import load_checkpoint, save_checkpoint
from fp8train.training.runs.claim import holding
from fp8train.training.runs.fork import load_fork
from fp8train.training.parallel.rank0 import on_main_process
from fp8train.training.runs.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from fp8train.training.config import FullConfig, add_config_arguments, load_config
from fp8train.training.parallel.distributed import all_mean_tensor, fp8_state_digest, make_accelerator
from fp8train.training.evaluation import evaluate, run_autocast
from fp8train.training.parallel.fsdp2 import all_finite, clip_grad_norm_tensor, grad_norm_tensor, release_process_group
from fp8train.training.runs.run_log import MetricsLog, finish, start_logs, summarize, summary_line, summary_on_interrupt
from fp8train.training.storage.rundir import CHECKPOINTS_DIR, TELEMETRY_FILE
from fp8train.training.setup import Run, set_up
from fp8train.training.step_guard import MAX_CONSECUTIVE_SKIPS, StepGuard  # noqa: F401 (re-exported)

__all__ = ["train", "cli_main", "add_cli_arguments", "fp8_state_digest", "make_accelerator", "summary_line",
           "MAX_CONSECUTIVE_SKIPS"]


@dataclass
class _State:
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


# ------------------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------------------
def train(cfg: FullConfig, accelerator=None, show_progress: bool = True, should_stop=None,
          model_factory=None) -> dict:
    """Train one run as configured; returns the summary that is also written to summary.json.

    ``should_stop(record) -> str | None`` is asked after every step that syncs (logged, evaluation, checkpoint
    and telemetry steps; record = the metrics line); a reason string stops the run there with status "stopped"
    (validate uses it to cut a diverging candidate). ``model_factory(cfg.model) -> nn.Module`` builds the model
    before conversion (default: training.models.decoder.build_model).
    """
    run = set_up(cfg, accelerator or make_accelerator(cfg), show_progress, model_factory)
    if run.plan.kind == "complete":
        return already_complete(run)
    with holding(run):  # the run directory's lock, released however the run ends
        state = resume(run)
        _start_guard(run, state)
        metrics = start_logs(run, state)
        if state.start_step == 0:
            log_initial_evaluation(run, state, metrics)

        progress = tqdm(total=cfg.train.max_steps, initial=state.start_step, desc=cfg.run.name, mininterval=2.0,
                        disable=not (run.is_main and show_progress), dynamic_ncols=True, leave=False)
        with summary_on_interrupt(run, state):  # SIGTERM / Ctrl-C: summary.json says "interrupted", and where
            for step in range(state.start_step, cfg.train.max_steps):
                record = optimizer_step(run, state, step)
                if record is None:  # diverged; state says where and why
                    break
                progress.update(1)
                if not record:  # a step without a host sync: nothing to log, check or save
                    continue
                finish_step(run, state, record, metrics)
                progress.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
                stop_reason = should_stop(record) if should_stop is not None else None
                if stop_reason:
                    state.status, state.reason = "stopped", stop_reason
                    break
                if is_periodic_checkpoint(cfg, state.done) and not checkpoint(run, state, final=False):
                    break
            else:
                state.done = cfg.train.max_steps
                if cfg.checkpoint.save_final and state.start_step < state.done:
                    checkpoint(run, state, final=True)
        progress.close()

        summary = summarize(run, state)
        finish(run, summary)
        release_process_group(run.made_process_group)
        return summary


def already_complete(run: Run) -> dict:
    """Resuming a finished run: nothing is trained, written or tracked."""
    if run.is_main:
        print(f"[{run.cfg.run.name}] already complete: {run.plan.summary.get('steps')} steps in {run.run_dir} "
              "(nothing changed; raise train.max_steps to train on)", file=sys.stderr)
    run.accelerator.wait_for_everyone()
    return run.plan.summary


# ------------------------------------------------------------------------------------------------------------
# Resume and logs
# ------------------------------------------------------------------------------------------------------------
def resume(run: Run) -> _State:
    """The loop's state: step 0, or everything the checkpoint to resume from holds."""
    state = _State()
    if run.plan.kind != "resume":
        if run.fork is not None:
            start_from_fork(run)
        return state
    load = load_sharded_checkpoint if run.sharded else load_checkpoint
    manifest = load(run.plan.checkpoint, run.model, run.optimizer, run.scheduler)
    counts = manifest.get("extra", {})
    run.lr_horizon["steps"] = counts.get("lr_schedule_steps", run.cfg.train.max_steps)
    state.start_step = state.done = manifest["step"]
    state.resumed_from, state.last_checkpoint = str(run.plan.checkpoint), run.plan.checkpoint
    state.skipped_steps = counts.get("skipped_steps", 0)
    state.consecutive_skips = counts.get("consecutive_skips", 0)
    run.say(f"[{run.cfg.run.name}] resuming from {run.plan.checkpoint}")
    return state


def start_from_fork(run: Run) -> None:
    """train.fork_from: step 0 of this run holds the source checkpoint's weights, AdamW state and LR schedule
    (fp8train.training.runs.fork); the schedule's length is the source run's."""
    manifest = load_fork(run.fork, run.model, run.optimizer, run.scheduler, run.cfg.train.seed)
    run.lr_horizon["steps"] = manifest.get("extra", {}).get("lr_schedule_steps", run.fork.source_cfg.train.max_steps)
    run.say(f"[{run.cfg.run.name}] forked from {run.fork.checkpoint} (step {run.fork.step}; FP8 scaling state "
            f"{run.fork.fp8_state})")


def _start_guard(run: Run, state: _State) -> None:
    state.guard = StepGuard(run.accelerator.device, run.layers, run.cfg.train.skip_nonfinite_grads,
                            state.consecutive_skips)


def log_initial_evaluation(run: Run, state: _State, metrics: MetricsLog) -> None:
    """Step 0: the untrained model's validation loss, in metrics.jsonl and the trackers."""
    state.last["val_loss"] = evaluate(run.model, run.val_batches, run.cfg, run.accelerator)
    record = {"step": 0, "val_loss": state.last["val_loss"], "lr": run.scheduler.get_last_lr()[0]}
    metrics.write(record)
    run.trackers.log(record, step=0)


# ------------------------------------------------------------------------------------------------------------
# One optimizer step
# ------------------------------------------------------------------------------------------------------------
def optimizer_step(run: Run, state: _State, step: int) -> dict | None:
    """Train step `step` -> `step + 1`. Returns its metrics record on a sync step, {} on the others (which make
    no host sync), or None when the run diverged (state says where and why)."""
    cfg, t0 = run.cfg, time.perf_counter()
    every = cfg.log.telemetry_every
    state.sampled = (bool(run.layers) or run.shadow is not None) and every > 0 and (step + 1) % every == 0
    telemetry.enable(run.layers, state.sampled)
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


def _account_steps(run: Run, state: _State) -> tuple[float, float] | None:
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


def _stop_diverged(run: Run, state: _State, step: int, reason: str) -> None:
    """Step `step` diverged: the run ends there, in the state that step began with (the device froze it)."""
    state.status, state.reason, state.diverged_at, state.done = "diverged", reason, step + 1, step
    state.guard.freeze_fp8_state()  # the current step's forward/backward counted nothing, if it came later
    # Re-run this rank's last micro-batch of that step on the plain module (no DDP hooks, so no collectives
    # that the other ranks might not join) with telemetry on: which layer broke, in which role.
    run.optimizer.zero_grad(set_to_none=True)
    x, y = list(_micro_batches(run, step))[-1]
    state.last["divergence_telemetry"] = telemetry.capture_step(
        run.model, run.layers, x, y, lambda: run_autocast(run.cfg, run.accelerator.device))


def _record(run: Run, state: _State, step_loss: float, grad_norm: float) -> dict:
    """The metrics line of a sync step; throughput over the steps since the previous one (their host time: on
    CUDA the steps between syncs are only queued, the sync waits for all of them)."""
    cfg, seconds = run.cfg, state.window_seconds / max(state.window_steps, 1)
    state.window_seconds, state.window_steps = 0.0, 0
    return {"step": state.done, "loss": step_loss, "lr": run.scheduler.get_last_lr()[0], "grad_norm": grad_norm,
            "tokens_per_s": cfg.train.batch_size * cfg.model.seq_len / seconds, "step_s": seconds,
            "elapsed_s": time.time() - run.started, "skipped_steps": state.skipped_steps}


def _unwrapped(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer holds the AdamW


def _micro_batches(run: Run, step: int):
    """This rank's slice of step `step`'s global batch, as (x, y) micro-batches on the device."""
    cfg, accelerator, device = run.cfg, run.accelerator, run.accelerator.device
    accum = cfg.train.grad_accum
    micro = cfg.train.batch_size // accelerator.num_processes // accum
    x_all, y_all = run.data.train_batch(step)
    rank_rows = slice(accelerator.process_index * micro * accum, (accelerator.process_index + 1) * micro * accum)
    x_rank, y_rank = x_all[rank_rows], y_all[rank_rows]
    for m in range(accum):
        yield _to_device(x_rank[m * micro:(m + 1) * micro], device), _to_device(y_rank[m * micro:(m + 1) * micro], device)


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
        if run.sharded:  # FSDP2 decides in backward (DDP in forward): reduce-scatter the last micro-batch's only
            run.model.set_requires_gradient_sync(m == accum - 1)
            sync = nullcontext()
        else:
            sync = nullcontext() if m == accum - 1 else accelerator.no_sync(run.ddp_model)
        with sync, run_autocast(cfg, device):
            _, loss = run.ddp_model(x, y)
        # FSDP2 sums gradients over ranks (fsdp2.apply_fsdp2), so each micro-batch counts 1 / (its number in
        # the global batch): a rank's grad_output, hence its FP8 scale history, is the same at any world size.
        accelerator.backward(loss / (accum * accelerator.num_processes if run.sharded else accum))
        loss_sum += loss.detach().double()  # the same float64 sum as before, without a sync per micro-batch
    # an IEEE float64 division by a device tensor, as the host's float(loss_sum) / accum was (on CUDA a Python
    # scalar divisor becomes a multiply by its reciprocal)
    return all_mean_tensor(accelerator, loss_sum / torch.full((), float(accum), dtype=torch.float64, device=device))


def _clip_grad_norm(run: Run) -> torch.Tensor:
    # One rule for DDP (replicated gradients) and FSDP2 (DTensor shards): a float64 norm that does not depend on
    # how the gradient is split, so both, at any world size, clip by the same factor (fsdp2.grad_norm).
    clip = run.cfg.train.grad_clip
    return clip_grad_norm_tensor(run.model, clip) if clip > 0 else grad_norm_tensor(run.model)


# ------------------------------------------------------------------------------------------------------------
# After a step: FP8 state check, telemetry, evaluation, logs
# ------------------------------------------------------------------------------------------------------------
def is_periodic_checkpoint(cfg: FullConfig, done: int) -> bool:
    return bool(cfg.checkpoint.every) and done % cfg.checkpoint.every == 0 and done < cfg.train.max_steps


def _step_kinds(cfg: FullConfig, done: int) -> tuple[bool, bool]:
    """(evaluation step, logged step) for the step that made `done` steps."""
    is_eval = done == cfg.train.max_steps or (cfg.train.eval_every > 0 and done % cfg.train.eval_every == 0)
    return is_eval, is_eval or done % cfg.log.every == 0 or done == cfg.train.max_steps


def is_sync_step(cfg: FullConfig, done: int, sampled: bool) -> bool:
    """The steps where the loop reads anything back from the device: logged (evaluation and last steps
    included), periodic checkpoint and telemetry steps. Every other step issues no host sync."""
    return _step_kinds(cfg, done)[1] or is_periodic_checkpoint(cfg, done) or sampled


def finish_step(run: Run, state: _State, record: dict, metrics: MetricsLog) -> None:
    """Complete `record` (FP8 counters and telemetry, validation loss on evaluation steps) and log it."""
    cfg, done = run.cfg, state.done
    is_eval, is_logged = _step_kinds(cfg, done)
    if is_logged or is_periodic_checkpoint(cfg, done):
        run.fp8_sync.check(done)  # every rank holds the same FP8 state (raises if not); counters summed
    if run.layers and is_logged:
        record.update(telemetry.counters(run.layers))
    if state.sampled:
        stats = telemetry.collect(run.layers)
        record.update(telemetry.summarize(stats))
        extra = {"gemms": gemm_paths(run.layers)} | ({"shadow": run.shadow.collect()} if run.shadow else {})
        telemetry.append(run.run_dir / TELEMETRY_FILE, done, stats, run.is_main, extra)
    if is_eval:
        record["val_loss"] = state.last["val_loss"] = evaluate(run.model, run.val_batches, cfg, run.accelerator)
    state.last["loss"] = record["loss"]
    if is_logged:
        metrics.write(record)
        run.trackers.log(record, step=done)


# ------------------------------------------------------------------------------------------------------------
# Checkpoints
# ------------------------------------------------------------------------------------------------------------
def checkpoint(run: Run, state: _State, final: bool) -> bool:
    """Save step `state.done` (rank 0 writes, everyone waits, so no rank races ahead of a half-written
    checkpoint). Weights that are not all finite are never saved: the run is marked diverged instead and False
    returned. The manifest carries the skip-guard counters and the LR schedule's length, so a resumed run counts
    on where it stopped on the same schedule."""
    done = state.done
    if not (all_finite(run.model) if run.sharded else _all_finite(run.model)):
        which = "the final checkpoint was" if final else "its checkpoint was"
        state.status, state.diverged_at = "diverged", done
        state.reason = f"parameters became non-finite at step {done}; {which} not written"
        return False
    ckpt_dir = run.run_dir / CHECKPOINTS_DIR
    path = ckpt_dir / f"step_{done:06d}"
    extra = {**run.hashes, "lr_schedule_steps": run.lr_horizon["steps"], **state.counts()}
    protect = [run.plan.checkpoint] if run.plan.checkpoint is not None else []  # pruning keeps the resumed one
    if run.sharded:  # every rank writes its shard; collective
        path = save_sharded_checkpoint(ckpt_dir, done, run.model, run.optimizer, run.scheduler, extra=extra,
                                       keep_last=run.cfg.checkpoint.keep_last, protect=protect)
    else:  # rank 0 writes; a full disk there is raised on every rank
        saved = on_main_process(run.accelerator, lambda: save_checkpoint(
            ckpt_dir, done, run.model, run.optimizer, run.scheduler, extra=extra,
            keep_last=run.cfg.checkpoint.keep_last, protect=protect))
        path = saved or path
    run.accelerator.wait_for_everyone()
    state.last_checkpoint = path
    return True


@torch.no_grad()
def _all_finite(model) -> bool:
    # DDP keeps the parameters identical on every rank, so every rank reaches the same answer.
    return bool(torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all())


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def add_cli_arguments(parser) -> None:
    add_config_arguments(parser, "recipes/cpu_delayed.yaml", "train.max_steps=100",
                         "progress bar or conversion table (the one-line summary is still printed)")


def cli_main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    accelerator = make_accelerator(cfg)
    is_main = accelerator.is_main_process
    try:
        summary = train(cfg, accelerator, show_progress=not args.quiet)
    finally:
        accelerator.end_training()  # trackers are already closed: this ends the process group, last of all
    if is_main:
        print(summary_line(cfg.run.name, summary), file=sys.stderr)
    return 0 if summary["status"] == "completed" else 1
