"""Whether a validation's planned runs have all ended, for `fp8train report`: a report of one still running, killed,
or stopped (its fork source deleted, say) headlines INCOMPLETE, not the verdict of the seeds it happens to hold.

INCONCLUSIVE means the runs ended and more seeds would decide; INCOMPLETE means runs the plan needs have not ended:
running (a process holds the folder), unfinished (killed, or interrupted: no summary.json, or one that says
"interrupted"), or missing (never started). Under validate.seeds=auto a seed past a candidate's decision is not
needed, so only the runs an undecided candidate still needs count as missing. A forked validation whose pinned
source is deleted, replaced or edited cannot be finished at all: the report names the source and says so. One
whose runs have all ended keeps its verdict (every run checked that it started from the pinned bytes) with a note
that the source changed after the runs read it, so that `validate` of it again is refused (source_note): the report
written at the end of `validate` checks the source once more, after the last run's own check.
"""

from __future__ import annotations

from pathlib import Path

from fp8train.evidence.fork_pinning import source_problem
from fp8train.evidence.run_plan import BASELINE
from fp8train.evidence.verdict import RunData
from fp8train.training.runs.fork import source_config_problem

__all__ = ["INCOMPLETE", "incompleteness", "fork_source_problem", "headline_detail", "source_note"]

INCOMPLETE = "incomplete"
_UNFINISHED = ("unfinished", "interrupted")


def _undecided(summary: dict) -> set[str]:
    """validate.seeds=auto: the candidates whose looks have not decided yet (they still need seeds)."""
    return {label for label, c in summary["candidates"].items() if not (c.get("sequential") or {}).get("decided")}


def incompleteness(plan: dict, summary: dict, runs: dict[str, dict[int, RunData]]) -> dict | None:
    """{"running": n, "unfinished": n, "missing": n, "planned": n} of the runs the plan still needs, or None
    when every one has ended."""
    undecided = _undecided(summary) if plan.get("sequential") else set(summary["candidates"])
    counts = {"running": 0, "unfinished": 0, "missing": 0}
    for label, by_seed in runs.items():
        for run in by_seed.values():
            status = run.status
            if status == "running":
                counts["running"] += 1
            elif status in _UNFINISHED:
                counts["unfinished"] += 1
            elif status == "missing" and (undecided if label == BASELINE else label in undecided):
                counts["missing"] += 1
    if not any(counts.values()):
        return None
    return {**counts, "planned": sum(len(by_seed) for by_seed in runs.values())}


def fork_source_problem(plan: dict) -> str | None:
    """For a forked plan: why its pinned source can no longer start a run (deleted, replaced, its config.yaml
    edited), or None."""
    fork = plan.get("fork")
    if not fork:
        return None
    problem = source_problem(fork)
    return problem if problem is not None else source_config_problem(Path(fork["checkpoint"]))


def headline_detail(incomplete: dict, so_far: str) -> str:
    """The words after "Verdict: INCOMPLETE": what has not ended, the verdict so far, and whether it can end."""
    parts = [f"{incomplete[what]} {what}" for what in ("running", "unfinished", "missing") if incomplete[what]]
    text = (f"runs not ended: {', '.join(parts)}, of {incomplete['planned']} planned; no verdict until they end; "
            f"the runs that ended give {so_far.upper()} so far")
    source = incomplete.get("cannot_finish")
    if source is not None:
        text += (f". It cannot be finished: {source}; restore the source and re-run `fp8train validate`, or start "
                 "a new validation under another run.name")
    return text


def source_note(problem: str) -> str:
    """The line under the verdict of a finished forked validation whose source changed after its runs read it."""
    return (f"Note: {problem}, after the runs read it. Every run started from the pinned checkpoint, so the verdict "
            "stands; but `fp8train validate` of this validation again is refused until the source is restored.")
