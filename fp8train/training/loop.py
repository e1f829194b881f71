"""One training run: config in, run directory out.

    fp8train train recipes/cpu_delayed.yaml train.max_steps=100
    accelerate launch scripts/train.py --config recipes/cpu_delayed.yaml

`train()` below is the whole story, in named steps: set up (data, model with fp32 master weights, the FP8 swap,
AdamW with fp32 state, the run directory: fp8train.training.setup), resume, then per optimizer step
(fp8train.training.step): the global batch of that step (a pure function of seed and step, so every world size
and every resume sees the same tokens), sliced for this rank and into micro-batches, forward/backward under
`train.autocast`, clip, step, one FP8 scale update; then log, evaluate and checkpoint as the step counter says,
and finally the summary.

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

import torch
from tqdm.auto import tqdm

from fp8train.training.config import FullConfig, add_config_arguments, load_config
from fp8train.training.evaluation import evaluate, run_autocast
from fp8train.training.models.moe import moe_blocks, routing_snapshot
from fp8train.training.parallel.distributed import fp8_state_digest, make_accelerator
from fp8train.training.parallel.fsdp2 import all_finite, release_process_group
from fp8train.training.parallel.rank0 import on_main_process
from fp8train.training.runs import telemetry
from fp8train.training.runs.checkpoint import load_checkpoint, save_checkpoint
from fp8train.training.runs.lifetime import interrupts_held
from fp8train.training.runs.claim import holding
from fp8train.training.runs.fork import checkpoint_sha256, fork_record, load_fork
from fp8train.training.runs.run_log import (MetricsLog, counted, finish, progress_line, start_logs, summarize,
                                            summary_line, summary_on_interrupt)
from fp8train.training.runs.sharded_checkpoint import (is_sharded_checkpoint, load_sharded_checkpoint,
                                                      save_sharded_checkpoint)
from fp8train.training.setup import Run, set_up
from fp8train.training.shadow import gemm_paths
from fp8train.training.step import LoopState, is_periodic_checkpoint, optimizer_step, step_kinds
from fp8train.training.step_guard import MAX_CONSECUTIVE_SKIPS, StepGuard  # noqa: F401 (re-exported)
from fp8train.training.storage.rundir import CHECKPOINTS_DIR, TELEMETRY_FILE

__all__ = ["train", "cli_main", "add_cli_arguments", "fp8_state_digest", "make_accelerator", "summary_line",
           "MAX_CONSECUTIVE_SKIPS"]


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
    if run.resume_point.kind == "complete":
        return already_complete(run)
    with holding(run):  # the run directory's lock, released however the run ends
        state = resume(run)
        _start_guard(run, state)
        metrics = start_logs(run, state)
        if state.start_step == 0:
            log_initial_evaluation(run, state, metrics)

        # a terminal (or a notebook) gets a bar that stays after the run; a log file or a pipe gets one line per
        # logged step (log.every), where a bar's carriage returns would be noise
        show, interactive = run.is_main and show_progress, sys.stderr.isatty() or "ipykernel" in sys.modules
        progress = tqdm(total=cfg.train.max_steps, initial=state.start_step, desc=cfg.run.name, mininterval=2.0,
                        disable=not (show and interactive), dynamic_ncols=True, leave=True)
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
                if show and not interactive and step_kinds(cfg, state.done)[1]:
                    print(progress_line(cfg.run.name, cfg.train.max_steps, record), file=sys.stderr, flush=True)
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
        if moe_blocks(run.model) and run.val_batches:
            # the routing of the first validation batch by the final weights: the same tokens in every run of
            # a pair, so the validation report can count the routing decisions FP8 changed (every rank runs it)
            summary["moe"] = routing_snapshot(run.model, run.val_batches[0][0].to(run.accelerator.device),
                                              lambda: run_autocast(run.cfg, run.accelerator.device))
        finish(run, summary)
        release_process_group(run.made_process_group)
        return summary


def already_complete(run: Run) -> dict:
    """Resuming a finished run: nothing is trained, written or tracked."""
    if run.is_main:
        steps = counted(run.resume_point.summary.get("steps"), "step")
        print(f"[{run.cfg.run.name}] already complete: {steps} in {run.run_dir} "
              "(nothing changed; raise train.max_steps to train on)", file=sys.stderr)
    run.accelerator.wait_for_everyone()
    return run.resume_point.summary


# ------------------------------------------------------------------------------------------------------------
# Resume and logs
# ------------------------------------------------------------------------------------------------------------
def resume(run: Run) -> LoopState:
    """The loop's state: step 0, or everything the checkpoint to resume from holds."""
    state = LoopState()
    if run.resume_point.kind != "resume":
        if run.fork is not None:
            start_from_fork(run)
        return state
    # a sharded (DCP) checkpoint loads into any mesh: also into a plain model (train.tp_size 2 -> 1 under ddp)
    sharded = run.sharded or is_sharded_checkpoint(run.resume_point.checkpoint)
    load = load_sharded_checkpoint if sharded else load_checkpoint
    manifest = load(run.resume_point.checkpoint, run.model, run.optimizer, run.scheduler)
    counts = manifest.get("extra", {})
    run.fork_record = counts.get("fork")  # a resumed fork: what its first segment started from
    run.lr_horizon["steps"] = counts.get("lr_schedule_steps", run.cfg.train.max_steps)
    state.start_step = state.done = manifest["step"]
    state.resumed_from, state.last_checkpoint = str(run.resume_point.checkpoint), run.resume_point.checkpoint
    state.skipped_steps = counts.get("skipped_steps", 0)
    state.consecutive_skips = counts.get("consecutive_skips", 0)
    run.say(f"[{run.cfg.run.name}] resuming from {run.resume_point.checkpoint}")
    return state


def start_from_fork(run: Run) -> None:
    """train.fork_from: step 0 of this run holds the source checkpoint's weights, AdamW state and LR schedule
    (fp8train.training.runs.fork); the schedule's length is the source run's."""
    sha256 = checkpoint_sha256(run.fork.checkpoint)  # of the files as they are now, just before they are loaded
    manifest = load_fork(run.fork, run.model, run.optimizer, run.scheduler, run.cfg.train.seed)
    run.fork_record = fork_record(run.fork, sha256)
    run.lr_horizon["steps"] = manifest.get("extra", {}).get("lr_schedule_steps", run.fork.source_cfg.train.max_steps)
    run.say(f"[{run.cfg.run.name}] forked from {run.fork.checkpoint} (step {run.fork.step}; FP8 scaling state "
            f"{run.fork.fp8_state})")


def _start_guard(run: Run, state: LoopState) -> None:
    state.guard = StepGuard(run.accelerator.device, run.layers, run.cfg.train.skip_nonfinite_grads,
                            state.consecutive_skips)


def log_initial_evaluation(run: Run, state: LoopState, metrics: MetricsLog) -> None:
    """Step 0: the untrained model's validation loss, in metrics.jsonl and the trackers."""
    state.last["val_loss"] = evaluate(run.model, run.val_batches, run.cfg, run.accelerator)
    record = {"step": 0, "val_loss": state.last["val_loss"], "lr": run.scheduler.get_last_lr()[0]}
    metrics.write(record)
    run.trackers.log(record, step=0)


# ------------------------------------------------------------------------------------------------------------
# After a step: FP8 state check, telemetry, evaluation, logs
# ------------------------------------------------------------------------------------------------------------
def finish_step(run: Run, state: LoopState, record: dict, metrics: MetricsLog) -> None:
    """Complete `record` (FP8 counters and telemetry, validation loss on evaluation steps) and log it."""
    cfg, done = run.cfg, state.done
    is_eval, is_logged = step_kinds(cfg, done)
    if is_logged or is_periodic_checkpoint(cfg, done):
        run.fp8_sync.check(done)  # every rank holds the same FP8 state (raises if not); counters summed
    if run.layers and is_logged:
        record.update(telemetry.counters(run.layers))
    if state.sampled:
        stats = telemetry.collect(run.layers) | telemetry.collect_experts(run.experts)
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
def checkpoint(run: Run, state: LoopState, final: bool) -> bool:
    # SIGTERM / Ctrl-C wait until the checkpoint is whole and recorded in `state` (lifetime.interrupts_held): an
    # interrupted run's summary then names the newest checkpoint on disk, and pruning is never cut short.
    with interrupts_held():
        return _write_checkpoint(run, state, final)


def _write_checkpoint(run: Run, state: LoopState, final: bool) -> bool:
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
    extra = {**run.hashes, "lr_schedule_steps": run.lr_horizon["steps"], **state.counts(),
             **({"fork": run.fork_record} if run.fork_record else {}),
             # what sharded the checkpoint, for whoever reads it (a fork refusing it names the cause)
             "parallel": run.cfg.train.parallel, "tp_size": run.cfg.train.tp_size}
    protect = [run.resume_point.checkpoint] if run.resume_point.checkpoint is not None else []  # pruning keeps the resumed one
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
