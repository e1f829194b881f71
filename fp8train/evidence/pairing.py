"""Pairing checked, not assumed: the runs of a validation directory are compared with its plan.json before a
verdict is computed from them, by `fp8train validate` and by `fp8train report` alike.

A verdict means something only when, within every seed, the bf16 baseline and each candidate differ in the FP8
settings alone. plan.json declares that pairing before any run; afterwards three things can break it, and each is
refused here (a ValueError naming the run and what differs; nothing is written):
- a candidate override outside fp8.* / policy.* (a plan.json edited by hand): the
  candidate would be another model, other data or another schedule;
- a run trained on other data than planned (the data file was rewritten while the validation ran): its
  summary.json records the fingerprint of what it trained on, and it must be the plan's;
- a run made from another config than planned (its config.yaml does not hash to plan.json's entry), or a
  summary.json that does not belong to its config and the planned data (validate refuses such a run too);
- a run of a forked validation (validate.fork_from) whose summary.json records another checkpoint sha256 than
  the one plan.json pinned (the source was replaced while the validation ran), or records none;
- a plan.json whose margin or final window is not what its runs were planned with (edited afterwards), or a
  finished run whose metrics.jsonl does not end with the val_loss of its summary.json (another run's log).
"""

from __future__ import annotations

from pathlib import Path

from fp8train.evidence.run_plan import PLAN_FILE
from fp8train.training.config import config_hash, load_config
from fp8train.training.config.validation import check_candidate_key
from fp8train.training.data.corpus import describe_fingerprint_change
from fp8train.training.storage.rundir import CONFIG_FILE, METRICS_FILE

__all__ = ["check_pairing", "data_problem"]


def data_problem(planned: dict | None, summary: dict) -> str | None:
    """None when a finished run's summary says it trained on the planned data (fingerprint `planned`), else what
    differs."""
    recorded = summary.get("data_fingerprint")
    if not isinstance(recorded, dict):
        return "its summary.json records no data fingerprint, so what it trained on cannot be checked"
    change = describe_fingerprint_change(planned, recorded, "the data")
    if change is not None:
        return f"it trained on other data than {PLAN_FILE} declares ({change.replace(' since this run was made', '')})"
    return None


def _config_problem(run_dir: Path, planned_hash: str | None, data_fingerprint: dict | None,
                    summary: dict | None, declared: dict) -> str | None:
    config_file = run_dir / CONFIG_FILE
    if not config_file.exists():
        return f"it has a summary.json but no {CONFIG_FILE}" if summary is not None else None
    try:
        cfg = load_config(str(config_file))
    except ValueError as err:
        return f"its {CONFIG_FILE} cannot be read ({err})"
    if planned_hash is not None and config_hash(cfg) != planned_hash:
        return f"its {CONFIG_FILE} is not the config {PLAN_FILE} planned for it"
    if summary is not None and summary.get("config_hash") != config_hash(cfg, data_fingerprint=data_fingerprint):
        return f"its summary.json does not belong to its {CONFIG_FILE} and the planned data"
    for key in ("margin", "final_window"):  # declared in plan.json and in every run's config.yaml alike
        if not _same_number(declared.get(key), getattr(cfg.validate, key)):
            return (f"{PLAN_FILE} declares validate.{key}={declared.get(key)!r} but the run was planned with "
                    f"{getattr(cfg.validate, key)!r} (its {CONFIG_FILE}): {PLAN_FILE} was edited")
    return None


def _same_number(a, b) -> bool:
    return (isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool)
            and round(float(a), 12) == round(float(b), 12))


def _log_problem(run) -> str | None:
    """A finished run's metrics.jsonl ends with the validation loss its summary.json records: a log copied from
    another run (another seed's) would otherwise give a verdict from unpaired curves."""
    summary = run.summary or {}
    steps, recorded = summary.get("steps"), summary.get("val_loss")
    if summary.get("status") != "completed" or not isinstance(recorded, float) or steps not in run.curve.val:
        return None  # unfinished, or its last evaluation missing: the verdict counts it as damaged
    if run.curve.val[steps] != recorded:
        return (f"its {METRICS_FILE} gives val_loss {run.curve.val[steps]!r} at step {steps} but its summary.json "
                f"records {recorded!r}: the log is not this run's")
    return None


def _fork_problem(pinned: dict | None, summary: dict | None) -> str | None:
    """A finished run of a forked validation started from the pinned checkpoint (the sha256 it recorded)."""
    if not pinned or summary is None:
        return None
    started = summary.get("fork")
    if not isinstance(started, dict):  # every forked run records it (training/runs/fork.py fork_record)
        return "its summary.json records no fork checkpoint, so what it started from cannot be checked"
    if started.get("sha256") == pinned.get("sha256"):
        return None
    return (f"it started from the fork checkpoint {started.get('checkpoint')} with sha256 "
            f"{str(started.get('sha256'))[:12]}, not the one {PLAN_FILE} pinned ({str(pinned.get('sha256'))[:12]})")


def check_pairing(vdir: Path, plan: dict, runs: dict) -> None:
    """Raise ValueError unless every run of `runs` ({label: {seed: RunData}}) is paired as `plan` declares (see
    the module docstring). Runs not started yet, or still running, are left to the verdict (it counts them)."""
    for spec in plan.get("candidates", []):
        for override in spec.get("overrides", []):
            check_candidate_key(str(override).partition("=")[0].strip(), str(spec.get("label")))
    planned_fp, planned_runs = plan.get("data_fingerprint"), plan.get("runs", {})
    problems = []
    for label, by_seed in runs.items():
        for seed, run in by_seed.items():
            key = f"{label}/seed{seed}"
            problem = _fork_problem(plan.get("fork"), run.summary)
            problem = problem or (data_problem(planned_fp, run.summary) if run.summary is not None else None)
            problem = problem or _config_problem(run.dir, (planned_runs.get(key) or {}).get("config_hash"),
                                                 planned_fp, run.summary, plan) or _log_problem(run)
            if problem is not None:
                problems.append(f"runs/{key}: {problem}")
    if problems:
        raise ValueError(f"{vdir}: its runs are not paired as {PLAN_FILE} declares, so no verdict is computed "
                         f"(nothing was written): {'; '.join(problems)}. Restore what changed and re-run "
                         "`fp8train validate` (delete the affected run folders to re-train them), or start a new "
                         "validation under another run.name")
