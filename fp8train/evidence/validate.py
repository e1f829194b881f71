"""Paired bf16-vs-FP8 validation: did FP8 hurt the model, judged against a margin declared before the runs.

    fp8train validate recipes/cpu_validate.yaml [key=value ...]
    accelerate launch --num_processes 2 -m fp8train.cli validate recipes/cpu_validate.yaml

For every seed of validate.seeds, the bf16 baseline and every candidate train from the same initial weights on the
same batches (fp8train.evidence.run_plan); validate.workers runs go at once (fp8train.evidence.runner); the verdict
bounds the mean paired gap over seeds (fp8train.evidence.stats) and the report shows it
(fp8train.evidence.report). Re-running the command skips finished runs and resumes unfinished ones; a directory
planned with another config, margin, candidate list or seed list is refused and nothing in it is touched.

Exit status: 0 PASS, 1 FAIL, 3 INCONCLUSIVE, 2 bad input (nothing is run or written).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from fp8train.evidence.completeness import source_note
from fp8train.evidence.fork_pinning import fork_config, fork_record
from fp8train.evidence.run_plan import PLAN_FILE, check_plan, fingerprint_runs, plan_runs, validation_dir, validation_plan
from fp8train.evidence.report import UNWRITABLE_REMEDY, write_validation_report
from fp8train.evidence.rounds import run_rounds
from fp8train.evidence.runner import default_workers, run_planned
from fp8train.training.config import FullConfig, add_config_arguments, load_config
from fp8train.training.runs.lifetime import interrupts_raised
from fp8train.training.runs.run_log import counted
from fp8train.training.loop import make_accelerator
from fp8train.training.parallel.rank0 import on_main_process
from fp8train.training.storage.files import read_json, write_json_atomic
from fp8train.training.storage.claims import claim_folder
from fp8train.training.storage.rundir import DirLock, SUMMARY_FILE

__all__ = ["run_validation", "resolve_workers", "verdict_lines", "EXIT_CODES", "add_cli_arguments", "cli_main"]

EXIT_CODES = {"pass": 0, "fail": 1, "inconclusive": 3, "incomplete": 3}  # incomplete: runs not ended, no decision


def resolve_workers(cfg: FullConfig, processes: int) -> int:
    """validate.workers, or its default; 1 under a multi-process launch, where every run uses all processes."""
    if processes > 1:
        if cfg.validate.workers not in (None, 1):
            raise ValueError(f"validate.workers={cfg.validate.workers} cannot be honoured under a launch of "
                             f"{processes} processes: each run already uses all of them; drop validate.workers, "
                             "or run `fp8train validate` without accelerate launch")
        return 1
    return cfg.validate.workers or default_workers(cfg)


def _check_run_dirs(runs, vdir: Path) -> None:
    for run in runs:
        path = Path(run.cfg.run.dir) / run.cfg.run.name / SUMMARY_FILE
        if path.exists() and read_json(path).get("config_hash") != run.config_hash():
            raise ValueError(f"{path} comes from a different config than {vdir / PLAN_FILE} declares; use a new "
                             "run.name (nothing was changed)")


def run_validation(cfg: FullConfig, candidates=None, accelerator=None, show_progress: bool = True, log=None,
                   write_report: bool = True) -> dict:
    """Run (or finish) the validation of ``cfg``; returns the validation summary (also summary.json).
    ``candidates`` (specs) replaces validate.candidates. Every check happens before anything is written."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cfg, fork = fork_config(cfg)  # validate.fork_from: every run starts from that checkpoint (evidence/fork_pinning.py)
    runs = plan_runs(cfg, candidates, log)
    fingerprint_runs(runs)
    plan = validation_plan(cfg, runs)
    plan["fork"] = fork_record(fork, runs)
    for run in runs:  # every run checks the pinned checkpoint before it starts and after it ends (runner)
        run.pinned_fork = fork
    vdir = validation_dir(cfg)
    check_plan(vdir, plan, runs[0].data_source)  # every rank checks (and fails alike) before rank 0 writes
    _check_run_dirs(runs, vdir)
    accelerator = accelerator or make_accelerator(cfg)
    workers = resolve_workers(cfg, accelerator.num_processes)
    lock = DirLock(vdir, "validation directory", log=log)

    def lock_and_plan() -> None:
        vdir.mkdir(parents=True, exist_ok=True)
        lock.acquire()  # for the validation's life: a second validate of this directory is refused
        try:
            if check_plan(vdir, plan, runs[0].data_source) is None:  # again, under the lock
                write_json_atomic(vdir / PLAN_FILE, plan)  # whole or not at all: a kill never leaves a torn plan
        except BaseException:
            lock.release()
            raise

    accelerator.wait_for_everyone()
    on_main_process(accelerator, lock_and_plan)
    try:
        with interrupts_raised():  # SIGTERM as well as Ctrl-C ends the runs with "interrupted" summaries
            return _run_and_report(runs, plan, vdir, workers, accelerator, show_progress, log, write_report)
    finally:
        lock.release()


REPORT_CLAIM_WAIT_S = 300.0  # a report of a large validation (plots of every run) takes minutes at most


def _run_and_report(runs, plan, vdir, workers, accelerator, show_progress, log, write_report) -> dict:
    is_main = accelerator.is_main_process
    if is_main:
        upto = "up to " if plan.get("sequential") else ""  # validate.seeds=auto runs only what the looks need
        base = plan.get("baseline_precision", "bf16")
        log(f"[validate] {vdir}: {upto}{counted(len(runs), 'run')} ({counted(len(plan['seeds']), 'seed')} x ({base} "
            f"+ {counted(len(plan['candidates']), 'candidate')})), margin {plan['margin']:g} declared in {PLAN_FILE}, "
            f"{workers} at a time")
    say = log if is_main else (lambda _: None)

    def run_some(todo) -> None:
        run_planned(todo, workers, accelerator=accelerator, log=say, show_progress=show_progress and workers == 1)

    if plan.get("sequential"):  # validate.seeds=auto: rounds of seeds until decided (fp8train.evidence.rounds)
        run_rounds(runs, vdir, run_some, say)
    else:
        run_some(runs)
    summary = {}
    if is_main and write_report:
        # a `fp8train report` of it writing now: wait for it (bounded), then write the final report over it
        with claim_folder(vdir, "report", UNWRITABLE_REMEDY, log=say, wait_s=REPORT_CLAIM_WAIT_S):
            summary = write_validation_report(vdir)
        log(f"[validate] verdict: {summary['verdict'].upper()} -> {vdir / 'report.md'}")
    accelerator.wait_for_everyone()
    return summary


def _pct(value, spec: str = "+.2%") -> str:
    return format(value, spec) if isinstance(value, float) and math.isfinite(value) else "n/a"


def verdict_lines(summary: dict) -> list[str]:
    """The verdict as a plain-text table: what the command prints at the end."""
    rows = [("candidate", "seeds", "mean gap", "95% bounds", "MDG", "verdict")]
    for label, c in summary["candidates"].items():
        rows.append((label, str(c["seeds"]), _pct(c["gap_mean"]),
                     f"[{_pct(c['gap_lower'])}, {_pct(c['gap_upper'])}]", _pct(c["mdg"], ".2%"),
                     c["verdict"].upper()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"verdict: {summary['verdict'].upper()} (margin {summary['margin']:.2%}, "
             f"{counted(len(summary['seeds']), 'paired seed')}; one-sided 95% bounds on the mean paired gap)"]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines += [f"  {label}: {c['reason']}" for label, c in summary["candidates"].items() if c["verdict"] != "pass"]
    if summary.get("fork_source_changed"):  # as report.md says it (fp8train.evidence.completeness)
        lines.append(source_note(summary["fork_source_changed"]))
    return lines


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def add_cli_arguments(parser) -> None:
    add_config_arguments(parser, "recipes/cpu_validate.yaml", "'validate.candidates=[current,\"e5=current:"
                         "input_format=e5m2\"]' validate.seeds=6", "progress bars or conversion tables")
    parser.epilog = ("exit status: 0 PASS (every candidate's upper bound <= margin), 1 FAIL (a candidate diverged "
                     "or its lower bound > margin), 3 INCONCLUSIVE (more seeds needed), 2 bad input (nothing run)")


def cli_main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    summary = run_validation(cfg, show_progress=not args.quiet)
    if not summary:  # not the main process
        return 0
    print("\n".join(verdict_lines(summary) + [f"report: {validation_dir(cfg) / 'report.md'}"]))
    return EXIT_CODES[summary["verdict"]]
