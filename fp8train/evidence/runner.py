"""Running the plan: every run once, `validate.workers` at a time, skipping finished runs, resuming the others.

Two ways to run, chosen by `run_planned`:
- in this process, one run after another, sharing one Accelerator: with one worker, and always under
  ``accelerate launch`` with several processes (every run then uses all of them);
- in a pool of worker processes (spawned, so each starts with its own torch state), when workers > 1. On CPU each
  worker's run uses train.threads threads (or cores // workers when train.threads is 0); on CUDA each worker is
  pinned to one GPU (CUDA_VISIBLE_DEVICES, GPUs dealt out round robin).

Workers die with the validate process (even after its `kill -9`); SIGTERM or Ctrl-C of validate stops every
running run with an "interrupted" summary, and running the command again resumes them.

A candidate of seed s starts only after the baseline of seed s finished when validate.stop_on_divergence is on:
the divergence guard compares the candidate's losses with the baseline's at the same steps. Baselines go first.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8train.evidence.curves import Curve, load_curve
from fp8train.evidence.fork_pinning import check_pinned_fork, check_run_fork
from fp8train.evidence.pairing import data_problem
from fp8train.evidence.run_plan import PlannedRun
from fp8train.training.config import FullConfig, config_hash
from fp8train.training.runs.lifetime import Interrupted, die_with_parent
from fp8train.training.loop import make_accelerator, train
from fp8train.training.storage.files import read_json
from fp8train.training.storage.rundir import SUMMARY_FILE

__all__ = ["FINAL_STATUSES", "DivergenceGuard", "finished_summary", "default_workers", "run_planned"]

FINAL_STATUSES = ("completed", "stopped", "diverged")  # re-running a run that ended so gives the same result


class DivergenceGuard:
    """train()'s should_stop for a candidate: non-finite loss, or (when enabled) a loss above factor x the
    baseline's at the same step (validation loss on evaluation steps, training loss on logged steps)."""

    def __init__(self, baseline: Curve | None, factor: float, enabled: bool):
        self.baseline, self.factor, self.enabled = baseline, factor, enabled

    def __call__(self, record: dict) -> str | None:
        step = record.get("step")
        for key in ("val_loss", "loss"):
            value = record.get(key)
            if value is None:
                continue
            if not math.isfinite(value):
                return f"{key} became {value} at step {step}"
            ref = None
            if self.enabled and self.baseline is not None:
                ref = (self.baseline.val if key == "val_loss" else self.baseline.train).get(step)
            if ref is not None and math.isfinite(ref) and value > self.factor * ref:
                return f"diverged: {key} {value:.4f} > {self.factor:g} x baseline {ref:.4f} at step {step}"
        return None


def _run_path(cfg: FullConfig) -> Path:
    return Path(cfg.run.dir) / cfg.run.name


def finished_summary(cfg: FullConfig, data_fingerprint: dict | None = None) -> dict | None:
    """The run's summary if it already ended (a final status, from the same config and data); else None."""
    path = _run_path(cfg) / SUMMARY_FILE
    if not path.exists():
        return None
    summary = read_json(path)
    if summary.get("status") in FINAL_STATUSES and summary.get("config_hash") == config_hash(cfg, data_fingerprint=data_fingerprint):
        return summary
    return None


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_workers(cfg: FullConfig) -> int:
    """validate.workers when null: one run per GPU on CUDA, else cores // train.threads (all cores when
    train.threads is 0, torch's default, hence one worker)."""
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    if on_cuda:
        return max(1, torch.cuda.device_count())
    return max(1, _cpu_count() // cfg.train.threads) if cfg.train.threads > 0 else 1


# ------------------------------------------------------------------------------------------------------------
# Scheduling (shared by both ways of running)
# ------------------------------------------------------------------------------------------------------------
@dataclass
class _Schedule:
    runs: list[PlannedRun]
    wait_for_baseline: bool
    done: set = field(default_factory=set)  # keys of runs that ended
    started: set = field(default_factory=set)

    def ready(self) -> list[PlannedRun]:
        """Runs that may start now: baselines first, then candidates whose seed's baseline ended."""
        baseline_done = {r.seed for r in self.runs if r.is_baseline and r.key in self.done}
        out = [r for r in self.runs if r.key not in self.started
               and (r.is_baseline or not self.wait_for_baseline or r.seed in baseline_done)]
        return sorted(out, key=lambda r: (not r.is_baseline, self.runs.index(r)))


def _guard(run: PlannedRun, baseline_dirs: dict[int, Path]) -> DivergenceGuard | None:
    if run.is_baseline:
        return None
    v = run.cfg.validate
    baseline = load_curve(baseline_dirs[run.seed]) if v.stop_on_divergence else None
    return DivergenceGuard(baseline, v.divergence_factor, v.stop_on_divergence)


def run_planned(runs: list[PlannedRun], workers: int, accelerator=None, log=print, show_progress: bool = False):
    """Run every run of the plan that has not ended yet; ``log`` gets one line per run."""
    baseline_dirs = {r.seed: _run_path(r.cfg) for r in runs if r.is_baseline}
    schedule = _Schedule(runs, runs[0].cfg.validate.stop_on_divergence)
    total = len(runs)
    for run in runs:
        done = finished_summary(run.cfg, run.data_fingerprint)
        if done is not None:
            schedule.done.add(run.key)
            schedule.started.add(run.key)
            log(f"[validate] {run.key}: finished earlier ({done['status']}), reused")
    if len(schedule.done) == total:
        return
    if workers <= 1 or (accelerator is not None and accelerator.num_processes > 1):
        _run_in_process(schedule, baseline_dirs, accelerator, log, show_progress)
    else:
        _run_in_pool(schedule, baseline_dirs, workers, log)


def _check_paired(run: PlannedRun, summary: dict) -> None:
    """Stop the validation as soon as a run turns out to have trained on other data than planned (the data was
    rewritten while the validation ran): every later run would be unpaired too, and no verdict can use it."""
    check_run_fork(run, summary)  # validate.fork_from: it loaded the pinned checkpoint, byte for byte
    problem = data_problem(run.data_fingerprint, summary)
    if problem is not None:
        raise ValueError(f"validation stopped: {run.key} is not paired with the plan: {problem}. Restore the data "
                         f"and re-run `fp8train validate` after deleting {_run_path(run.cfg)}, or start a new "
                         "validation under another run.name")


def _describe(run: PlannedRun, summary: dict) -> str:
    val = summary.get("val_loss")
    val = f"{val:.4f}" if isinstance(val, float) else "n/a"
    wall = summary.get("wall_time_s") or 0.0
    reason = f" ({summary['reason']})" if summary.get("reason") else ""
    return f"[validate] {run.key}: {summary.get('status')}, val_loss {val}, {wall:.0f} s{reason}"


def _run_in_process(schedule: _Schedule, baseline_dirs, accelerator, log, show_progress) -> None:
    accelerator = accelerator or make_accelerator(schedule.runs[0].cfg)
    real_end_training = _reusable_accelerator(accelerator)
    try:
        while True:
            ready = schedule.ready()
            if not ready:
                return
            run = ready[0]
            schedule.started.add(run.key)
            if accelerator.is_main_process:
                log(f"[validate] {run.key}: running (seed {run.seed})")
            check_pinned_fork(run)  # validate.fork_from: the pinned checkpoint, still there and unchanged
            try:
                summary = train(run.cfg, accelerator=accelerator, show_progress=show_progress,
                                should_stop=_guard(run, baseline_dirs))
            except ValueError:  # its set-up refused the fork source: say what changed, if the source did
                check_pinned_fork(run)
                raise
            accelerator.wait_for_everyone()  # rank 0 wrote metrics.jsonl; every rank then reads the same curve
            _check_paired(run, summary)
            schedule.done.add(run.key)
            if accelerator.is_main_process:
                log(_describe(run, summary))
    finally:
        accelerator.end_training = real_end_training


def _reusable_accelerator(accelerator):
    """Let train() be called repeatedly with one Accelerator. Accelerate's end_training destroys the process
    group (the next run's collectives would fail) and init_trackers appends to, and restarts, the trackers of
    earlier runs; here end_training only finishes this run's trackers and init_trackers starts a fresh list."""
    init, real_end = accelerator.init_trackers, accelerator.end_training

    def init_trackers(*args, **kwargs):
        accelerator.trackers = []
        return init(*args, **kwargs)

    def end_training():
        for tracker in accelerator.trackers:
            tracker.finish()
        accelerator.trackers = []

    accelerator.init_trackers, accelerator.end_training = init_trackers, end_training
    return real_end


# ------------------------------------------------------------------------------------------------------------
# The worker pool
# ------------------------------------------------------------------------------------------------------------
def _worker_init(slots, threads: int, gpus: int, parent_pid: int) -> None:
    """Runs once in each spawned worker, before it imports CUDA state: die with the validate process (even when it
    is killed with SIGKILL: nothing else would ever end a worker waiting for work), take a slot, pin to a GPU or
    set threads."""
    die_with_parent(parent_pid)
    slot = slots.get()
    if gpus > 0:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(slot % gpus)
    torch.set_num_threads(threads)


def _worker_run(run: PlannedRun, baseline_dir: str | None) -> dict:
    guard = _guard(run, {run.seed: Path(baseline_dir)}) if baseline_dir else None
    try:
        check_pinned_fork(run)  # in the worker, just before its run starts: the source may change at any time
        return train(run.cfg, show_progress=False, should_stop=guard)
    except Interrupted as err:  # the run's summary says "interrupted"; the pool would only wait for more work
        os._exit(128 + err.signum)
    except ValueError as err:  # fp8train's own refusal (a deleted fork source, say): the validation raises it
        if not _raised_by_fp8train(err):  # again, so the command line says it in one line, as in-process
            raise
        try:  # a source changed after the check above: the validation's line naming it, not train.fork_from's
            check_pinned_fork(run)
        except ValueError as stopped:
            return {_REFUSED: str(stopped)}
        return {_REFUSED: str(err)}


_REFUSED = "refused"
_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def _raised_by_fp8train(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _PACKAGE_DIR in Path(tb.tb_frame.f_code.co_filename).resolve().parents


def _stop_workers(workers: list, grace_s: float = 30.0) -> None:
    """SIGTERM to each worker (a run in it writes summary.json "interrupted"), then SIGKILL to any still alive after
    `grace_s`: a worker that has taken a signal as its run's interrupt drops later ones as repeats, so one that
    missed its interrupt (seen once, in a pool broken while a run was starting) would otherwise train on unseen."""
    for worker in workers:
        worker.terminate()
    deadline = time.monotonic() + grace_s
    for worker in workers:
        worker.join(max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            worker.kill()
            worker.join(5)


def _start_every_worker(pool: ProcessPoolExecutor, workers: int) -> None:
    """Every worker started before the first run. The pool otherwise starts one per submit(), after waking the
    thread that watches its workers, which can then wait on a list without the new one (CPython 3.11): that
    worker killed from outside (kill -9, the OOM killer) went unseen until another run ended, minutes later. A
    result arriving makes that thread list the workers again, so waiting for one call per worker is enough."""
    for started in [pool.submit(os.getpid) for _ in range(workers)]:
        started.result()


def _run_in_pool(schedule: _Schedule, baseline_dirs, workers: int, log) -> None:
    cfg = schedule.runs[0].cfg
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    gpus = torch.cuda.device_count() if on_cuda else 0
    threads = cfg.train.threads or max(1, _cpu_count() // workers)
    context = multiprocessing.get_context("spawn")
    slots = context.Queue()
    for slot in range(workers):
        slots.put(slot)
    log(f"[validate] {workers} workers" + (f", one GPU each of {gpus}" if gpus else f", {threads} thread(s) each"))
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_init,
                             initargs=(slots, threads, gpus, os.getpid())) as pool:
        running, broken = {}, False
        try:
            try:
                _start_every_worker(pool, workers)
            except BrokenProcessPool:
                broken = True
                raise ValueError("validation stopped: a worker process ended abruptly as it started (killed: by a "
                                 "signal, or by the system for memory?); no run had started, and re-running "
                                 "`fp8train validate` starts them") from None
            while True:
                for run in schedule.ready()[:workers - len(running)]:
                    schedule.started.add(run.key)
                    base = None if run.is_baseline else str(baseline_dirs[run.seed])
                    running[pool.submit(_worker_run, run, base)] = run
                    log(f"[validate] {run.key}: running (seed {run.seed})")
                if not running:
                    return
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    run = running.pop(future)
                    try:
                        summary = future.result()  # a run's exception ends the validation here, as in-process
                    except BrokenProcessPool:  # a worker killed from outside (kill -9, the OOM killer): said as
                        broken = True  # (the pool ends no other worker: each would train on with no one to tell)
                        raise ValueError(  # the other "validation stopped" lines, not as an internal error
                            f"validation stopped: a worker process ended abruptly while {run.key} was running "
                            "(killed: by a signal, or by the system for memory?); the runs made so far are kept, "
                            "those still going were stopped (interrupted), and re-running `fp8train validate` "
                            "resumes the rest") from None
                    if _REFUSED in summary:
                        raise ValueError(summary[_REFUSED])
                    _check_paired(run, summary)
                    schedule.done.add(run.key)
                    log(_describe(run, summary))
        except BaseException as err:
            for future in running:
                future.cancel()
            # SIGTERM / Ctrl-C of validate, or a worker killed: the runs still going stop and say "interrupted"
            if isinstance(err, KeyboardInterrupt) or broken:
                _stop_workers(multiprocessing.active_children())  # this process's children: the pool's workers
            raise
