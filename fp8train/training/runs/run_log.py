"""What a run writes about itself, besides checkpoints: metrics.jsonl and telemetry.jsonl (cut back to the
resumed step on resume, so they read as if the run had never stopped), the trackers, and summary.json with the
one line a run ends with. Every file goes through fp8train.training.storage.files (atomic, strict JSON, torn-line safe).
"""

from __future__ import annotations

import resource
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from fp8train.nn.recipes import BASELINE_RECIPE
from fp8train.training.runs import telemetry
from fp8train.training.parallel.distributed import fp8_state_digest
from fp8train.training.runs.lifetime import Interrupted, interrupts_raised
from fp8train.training.models.decoder import count_params
from fp8train.training.storage.files import append_jsonl, truncate_jsonl, write_json_atomic, write_text_atomic
from fp8train.training.storage.rundir import METRICS_FILE, SUMMARY_FILE, TELEMETRY_FILE
from fp8train.training.runs.tracking import Trackers, tracked_config

__all__ = ["MetricsLog", "start_logs", "summarize", "summary_on_interrupt", "finish", "summary_line", "progress_line",
           "counted"]


class MetricsLog:
    """metrics.jsonl, written by the main process. On resume it keeps only lines up to the resumed step, so
    the file reads as if the run had never stopped."""

    def __init__(self, path: Path, enabled: bool, resume_step: int | None, log=print):
        self.path, self.enabled, self.kept = path, enabled, []
        if enabled and resume_step is not None:
            self.kept = truncate_jsonl(path, resume_step, log=log)  # a damaged line is dropped and named
        elif enabled:
            write_text_atomic(path, "")

    def write(self, record: dict) -> None:
        if self.enabled:
            append_jsonl(self.path, [record])


def start_logs(run, state) -> MetricsLog:
    """metrics.jsonl and telemetry.jsonl cut back to the resumed step (or emptied), trackers started."""
    resumed = state.resumed_from is not None
    warn = lambda message: print(f"[{run.cfg.run.name}] {message}", file=sys.stderr)  # noqa: E731
    metrics = MetricsLog(run.run_dir / METRICS_FILE, run.is_main, state.start_step if resumed else None, warn)
    telemetry_file = run.run_dir / TELEMETRY_FILE
    if run.is_main and resumed:
        truncate_jsonl(telemetry_file, state.start_step, check=telemetry.record_problem, log=warn)
    elif run.is_main and telemetry_file.exists():
        write_text_atomic(telemetry_file, "")
    for record in metrics.kept:  # a resumed run reports its last losses even if it has no step left to run
        state.last.update({k: record[k] for k in ("loss", "val_loss") if record.get(k) is not None})
    run.trackers = Trackers(run.cfg, run.run_dir, run.is_main, fresh=not resumed)
    run.trackers.store_config(tracked_config(run.cfg, run.fp8_recipe, run.conversion, run.model))
    return metrics


def summarize(run, state, collective: bool = True) -> dict:
    """The run's summary.json; `collective=False` skips the cross-rank FP8 state check (an interrupted run: the
    other ranks may be gone)."""
    cfg, layers = run.cfg, run.layers
    done = state.diverged_at - 1 if state.status == "diverged" else state.done  # steps completed before it
    if collective:
        run.fp8_sync.check(done)
    summary = {
        "status": state.status, "reason": state.reason, "steps": done,
        "loss": state.last.get("loss"), "val_loss": state.last.get("val_loss"),
        "world_size": run.accelerator.num_processes, "tokens": done * cfg.train.batch_size * cfg.model.seq_len,
        "wall_time_s": time.time() - run.started, "cpu_time_s": time.process_time() - run.cpu_started,
        "peak_memory_mb": _peak_memory_mb(run.accelerator.device),
        "recipe": run.fp8_recipe.code() if run.fp8_recipe is not None else BASELINE_RECIPE,
        "params": count_params(run.model), "fp8_layers": len(layers), "skipped_steps": state.skipped_steps,
        "resumed_from": state.resumed_from, "seed": cfg.train.seed, **run.hashes,
        "diverged_at_step": state.diverged_at,
        "last_good_checkpoint": str(state.last_checkpoint) if state.last_checkpoint else None,
        "fp8_state_sha256": fp8_state_digest(layers) if layers else None,
        "fork": run.fork_record,  # train.fork_from: the checkpoint (path, step, sha256) this run started from
    }
    if layers:
        summary.update(telemetry.counters(layers))
    if run.conversion is not None:
        summary["conversion"] = {"converted": [n for n, _ in run.conversion.converted],
                                 "skipped": [[n, r] for n, r in run.conversion.skipped]}
    if "divergence_telemetry" in state.last:
        summary["divergence_telemetry"] = state.last["divergence_telemetry"]
    return summary


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@contextmanager
def summary_on_interrupt(run, state):
    """SIGTERM or SIGINT inside the block (lifetime.interrupts_raised): summary.json says "interrupted", after
    which step, by which signal and how to continue; then the interrupt goes on and ends the process. The main
    process writes it alone, with no collective (the other ranks may have been stopped too)."""
    with interrupts_raised():
        try:
            yield
        except KeyboardInterrupt as err:
            name = signal.Signals(err.signum).name if isinstance(err, Interrupted) else "SIGINT"
            state.status = "interrupted"
            state.reason = (f"interrupted by {name} after step {state.done}; continue with train.resume=true "
                            "(fp8train validate resumes it when run again)")
            if run.is_main:
                write_json_atomic(run.run_dir / SUMMARY_FILE, summarize(run, state, collective=False))
            raise


def finish(run, summary: dict) -> None:
    """summary.json (rank 0), trackers closed, then every rank waits for the others."""
    if run.is_main:
        write_json_atomic(run.run_dir / SUMMARY_FILE, summary)
    run.trackers.finish()
    run.accelerator.wait_for_everyone()


def counted(count, noun: str, plural: str | None = None) -> str:
    """A count and its noun in the number the count takes: `1 run`, `0 runs`, `3 seeds` (`plural` for a noun
    that is not made plural by an s). Every message that prints a count of runs, seeds or steps goes through it,
    so none says "1 runs"."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def summary_line(name: str, summary: dict) -> str:
    """The one line a run ends with, e.g. `[cpu_delayed] completed: 300 steps, val_loss 2.0512, 61.0s, recipe
    delayed:e4m3/e4m3/e5m2:h1024max:m0`."""
    val = f"{summary['val_loss']:.4f}" if summary.get("val_loss") is not None else "n/a"
    reason = f" ({summary['reason']})" if summary.get("reason") else ""
    # policy.allow_no_fp8 lets an FP8 recipe convert nothing: say so rather than name a recipe nothing ran
    unused = " with 0 FP8 layers (all high precision)" if summary.get("fp8_layers") == 0 and \
        summary.get("recipe") not in (None, "none") else ""
    # a diverged run names the step it stopped at (diverged_at_step, numbered from 1) and the steps it took before
    # it (summary.json's steps), as export, kv-eval and forks refusing it do (source_status.failure_text)
    at = summary.get("diverged_at_step")
    ended = f"{summary['status']} at step {at} after" if isinstance(at, int) else f"{summary['status']}:"
    return (f"[{name}] {ended} {counted(summary['steps'], 'step')}, val_loss {val}, "
            f"{summary['wall_time_s']:.1f}s, recipe {summary['recipe']}{unused}{reason}")


def progress_line(name: str, max_steps: int, record: dict) -> str:
    """The line a logged step prints when the output is not a terminal, e.g. `[cpu_delayed] step 20/300: loss
    2.4810, val_loss 2.5120, lr 0.003, 41233 tokens/s`."""
    parts = [f"loss {record['loss']:.4f}"]
    if record.get("val_loss") is not None:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    parts.append(f"lr {record['lr']:.3g}")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{record['tokens_per_s']:.0f} tokens/s")
    return f"[{name}] step {record['step']}/{max_steps}: " + ", ".join(parts)
