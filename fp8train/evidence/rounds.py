"""The rounds of a validate.seeds=auto validation: which runs the next look needs, decided from the files.

Round 1 runs the first look's seeds (2) of the baseline and every candidate. After each round the verdict is
recomputed from the run files (fp8train.evidence.verdict, the looks of fp8train.evidence.sequential); a candidate
still undecided asks for the seeds of its next look, and the next round runs those seeds of the baseline and of
the undecided candidates only. It ends when every candidate is decided or at validate.max_seeds. The state is
the files alone, so a re-run after a kill recomputes the same rounds and resumes where they stopped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from fp8train.evidence.run_plan import PlannedRun
from fp8train.evidence.sequential import FIRST_LOOK
from fp8train.evidence.runner import finished_summary
from fp8train.evidence.verdict import load_validation, summarize_validation
from fp8train.training.runs.run_log import counted

__all__ = ["next_round", "run_rounds"]


def next_round(vdir: Path, runs: list[PlannedRun]) -> list[PlannedRun]:
    """The runs the next looks need, [] when every candidate is decided or all of them ended already. The
    baselines of those seeds are in it even when they ended: a candidate starts after its seed's baseline ended
    (runner), which the runner knows only of the runs it is given (an ended one it reuses)."""
    plan, found = load_validation(vdir)
    summary = summarize_validation(plan, found)
    wanted = {label: c["sequential"]["next_seeds"] for label, c in summary["candidates"].items()
              if c["sequential"] and not c["sequential"]["decided"] and c["sequential"]["next_seeds"]}
    if not wanted:
        return []
    seeds = list(plan["seeds"])
    upto = {label: set(seeds[:n]) for label, n in wanted.items()}
    baseline_seeds = set(seeds[:max(wanted.values())])
    pick = [r for r in runs if (r.seed in baseline_seeds if r.is_baseline else r.seed in upto.get(r.label, ()))]
    return pick if any(finished_summary(r.cfg, r.data_fingerprint) is None for r in pick) else []


def run_rounds(runs: list[PlannedRun], vdir: Path, run_round: Callable[[list[PlannedRun]], None], log) -> int:
    """Run rounds until no look needs a run; returns the number of rounds run. A round whose runs were all tried
    already (a run that cannot end, e.g. its baseline failed) ends the loop: the verdict then says why."""
    tried: set[str] = set()
    rounds = 0
    while True:
        todo = next_round(vdir, runs)
        unfinished = {r.key for r in todo if finished_summary(r.cfg, r.data_fingerprint) is None}
        if not unfinished or unfinished <= tried:
            return rounds
        rounds += 1
        seeds = sorted({r.seed for r in todo})  # the first n of the plan: the look at n seeds (2, 3, ...)
        # numbered by its look, not by this process's count: a validation resumed after a kill goes on at round 3
        log(f"[validate] round {len(seeds) - FIRST_LOOK + 1}: {counted(len(unfinished), 'run')} to make, seeds "
            f"{seeds}, "
            f"{', '.join(sorted({r.label for r in todo}))}")
        tried |= unfinished
        run_round(todo)
