"""Whether a run ended in a state that makes its checkpoints unfit to build on: its summary.json says it diverged,
or was stopped by a validation's divergence guard. Export and kv-eval refuse such a source (fp8train.serving), and
so does a fork (train.fork_from / validate.fork_from): forked runs of a diverged source's last checkpoint can
skip every step on non-finite gradients and still "complete" with a huge, equal loss in bf16 and FP8.
"""

from __future__ import annotations

from pathlib import Path

from fp8train.training.storage.files import read_json
from fp8train.training.storage.rundir import SUMMARY_FILE

__all__ = ["REFUSED_STATUSES", "failed_summary", "failure_text"]

REFUSED_STATUSES = ("diverged", "stopped")  # stopped: validate's divergence guard (loss > factor x baseline)


def failed_summary(run_dir) -> dict | None:
    """``run_dir``'s summary.json when it says the run ended diverged or stopped; None else (no summary: a run
    still training, or a Hugging Face folder)."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.is_file():
        return None
    summary = read_json(path)
    return summary if isinstance(summary, dict) and summary.get("status") in REFUSED_STATUSES else None


def failure_text(run_dir, summary: dict) -> str:
    """"run D ended diverged at step 6 (after 5 steps; reason)" for a summary that failed_summary returned: the
    step it stopped at and the steps it took before it, numbered as the run's own summary line numbers them."""
    at, steps = summary.get("diverged_at_step"), summary.get("steps")
    took = f"after {steps} steps; " if at is not None and isinstance(steps, int) else ""
    return (f"run {run_dir} ended {summary['status']}" + (f" at step {at}" if at is not None else "")
            + f" ({took}{summary.get('reason') or 'no reason recorded'})")
