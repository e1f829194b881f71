"""validate.fork_from: every paired run, bf16 and each candidate, starts from one checkpoint of the user's run.

    fp8train validate recipes/cpu_validate.yaml validate.fork_from=runs/my_bf16_run train.max_steps=100

The checkpoint (a run directory's newest valid one, or the checkpoint folder given) is resolved once, and every
run of the plan gets train.fork_from=<that checkpoint> (fp8train.training.runs.fork: weights, AdamW state and the
source's LR schedule go on for train.max_steps steps; a seed varies only what is random after the fork, the data
order and dropout). plan.json records the checkpoint, its step, the sha256 of its files and, per candidate,
whether its FP8 scaling state starts fresh or comes from the checkpoint (an FP8 source of the same recipe). A
re-run whose checkpoint changed, or is missing, is refused before anything runs: the runs already made started
from the recorded one. The pin holds for the whole validation: every run checks the checkpoint's sha256 against
plan.json in the process that trains it, just before it starts, and its summary.json records the sha256 of what
it loaded, checked again when it ends and by `fp8train report`. A deleted, replaced or edited checkpoint ends
the validation with one line; the runs made so far are kept.

train.fork_from in a validation is refused unless it names validate.fork_from's checkpoint: it would fork every
run from whatever the path holds when that run starts, with nothing pinned.
"""

from __future__ import annotations

from pathlib import Path

from fp8train.evidence.run_plan import PLAN_FILE, PlannedRun, derive_config, validation_dir
from fp8train.training.config import FullConfig
from fp8train.training.runs.fork import (checkpoint_sha256, fp8_state_origin, open_fork, resolve_fork_checkpoint,
                                         source_config_problem)
from fp8train.training.runs.checkpoint import verify_checkpoint
from fp8train.training.storage.files import read_json

__all__ = ["fork_config", "fork_record", "check_fork_unchanged", "check_pinned_fork", "check_run_fork",
           "source_problem"]

KEY = "validate.fork_from"
_NEW_NAME = "use a new run.name (nothing was changed)"


def _planned_fork(vdir: Path) -> dict | None:
    try:
        return read_json(vdir / PLAN_FILE).get("fork") if (vdir / PLAN_FILE).is_file() else None
    except ValueError:
        return None  # a damaged plan: check_plan decides what to do with it


def _check_train_fork(cfg: FullConfig) -> None:
    """train.fork_from inside a validation: every run would fork from it with nothing pinned (no sha256 in
    plan.json, nothing checked when it is replaced). Accepted only as the same checkpoint validate.fork_from
    pins."""
    given = cfg.train.fork_from
    if not given:
        return
    if not cfg.validate.fork_from:
        raise ValueError(f"train.fork_from={given} in a validation: use validate.fork_from={given} instead (it "
                         "pins the checkpoint's sha256 in plan.json and checks it before every run; train.fork_from "
                         "would fork each run from whatever the path holds when it starts); nothing was written")
    ours = resolve_fork_checkpoint(cfg.validate.fork_from, KEY)
    theirs = resolve_fork_checkpoint(given, "train.fork_from")
    if ours != theirs:
        raise ValueError(f"train.fork_from={given} ({theirs}) and {KEY}={cfg.validate.fork_from} ({ours}) are "
                         f"different checkpoints: give {KEY} alone (train.fork_from is set for every run from it); "
                         "nothing was written")


def _elsewhere(given: str, pinned: Path) -> bool:
    """A relative validate.fork_from that, from this folder, names neither the pinned checkpoint nor its run."""
    return not Path(given).is_absolute() and Path(given).resolve() not in (pinned, pinned.parent.parent)


def _could_name(given: Path, pinned: Path) -> bool:
    """Whether the relative path ``given`` can name the pinned checkpoint or its run from some folder: the pinned
    path (resolved) ends with its parts. One through '..' is not judged (assumed so)."""
    parts = [p for p in given.parts if p != "."]
    if ".." in parts:
        return True
    return any(len(parts) <= len(target.parts) and list(target.parts[-len(parts):]) == parts
               for target in (pinned, pinned.parent.parent)) if parts else True


def _unusable(cfg: FullConfig, planned: dict, err: ValueError) -> ValueError:
    """Why the checkpoint plan.json pinned cannot be resolved now: deleted, or a relative path read elsewhere."""
    vdir, pinned = validation_dir(cfg), Path(planned["checkpoint"])
    given = Path(cfg.validate.fork_from)
    head = f"{vdir / PLAN_FILE} was planned from the fork checkpoint {pinned} (sha256 {planned['sha256'][:12]})"
    if _elsewhere(cfg.validate.fork_from, pinned) and pinned.exists() and not _could_name(given, pinned):
        return ValueError(f"{head}, but {KEY}={given} names a different source than the plan's (neither "
                          f"{pinned} nor its run {pinned.parent.parent} ends in {given}): pass {KEY}={pinned} to "
                          f"finish this validation, or {_NEW_NAME}")
    if _elsewhere(cfg.validate.fork_from, pinned) and pinned.exists():
        return ValueError(f"{head}, but the relative {KEY}={given} resolves elsewhere from {Path.cwd()} "
                          f"({given.absolute()}): run from the folder the validation was started in, or pass "
                          f"{KEY}={pinned}; nothing was changed")
    if not pinned.exists():
        return ValueError(f"{head}, which was deleted: its runs started from it; restore it, or {_NEW_NAME}")
    return ValueError(f"{head}, which cannot be used now: {err}. Its runs started from that checkpoint; restore "
                      f"it, or {_NEW_NAME}")


def fork_config(cfg: FullConfig) -> tuple[FullConfig, dict | None]:
    """(cfg with train.fork_from set to the resolved checkpoint, the plan's fork record without the per-candidate
    part), or (cfg, None) without validate.fork_from. ValueError for a checkpoint that is missing, broken, from
    another model or optimizer, written by another config.yaml than its run's now, or another than the one
    plan.json recorded; and for train.fork_from other than validate.fork_from's checkpoint."""
    _check_train_fork(cfg)
    if not cfg.validate.fork_from:
        return cfg, None
    planned = _planned_fork(validation_dir(cfg))
    try:
        checkpoint = resolve_fork_checkpoint(cfg.validate.fork_from, KEY)
    except ValueError as err:
        if planned:
            raise _unusable(cfg, planned, err) from None
        raise
    if planned and _elsewhere(cfg.validate.fork_from, Path(planned["checkpoint"])):
        raise _unusable(cfg, planned, ValueError("resolved elsewhere"))
    forked = derive_config(cfg, [f"train.fork_from={checkpoint}"])
    fork = open_fork(forked, key=KEY)
    record = {"checkpoint": str(checkpoint), "step": fork.step, "sha256": checkpoint_sha256(checkpoint),
              "source_recipe": fork.source_cfg.fp8.recipe}
    check_fork_unchanged(validation_dir(cfg), record, planned)
    return forked, record


def fork_record(record: dict | None, runs: list[PlannedRun]) -> dict | None:
    """The plan's fork record with, per run label, where its FP8 scaling state comes from."""
    if record is None:
        return None
    source_cfg = open_fork(runs[0].cfg, key=KEY).source_cfg
    states = {r.label: fp8_state_origin(r.cfg, source_cfg) if not r.is_baseline else "none" for r in runs}
    return {**record, "fp8_state": states}


def check_fork_unchanged(vdir: Path, record: dict, planned: dict | None) -> None:
    """A plan made from a fork must be finished from the same checkpoint, byte for byte."""
    if not planned:
        return
    if planned.get("checkpoint") != record["checkpoint"] and not Path(planned.get("checkpoint") or "").exists():
        raise ValueError(f"{vdir / PLAN_FILE} was planned from the fork checkpoint {planned.get('checkpoint')}, "
                         f"which was deleted (pruned by its run's checkpoint.keep_last?); {KEY} now resolves to "
                         f"{record['checkpoint']}, another one. The runs already made started from the deleted "
                         f"one: restore it, or {_NEW_NAME}")
    broken = verify_checkpoint(planned["checkpoint"]) if planned.get("checkpoint") != record["checkpoint"] else None
    if broken is not None:  # still there, but passed over when the run directory was resolved
        raise ValueError(f"{vdir / PLAN_FILE} was planned from the fork checkpoint {planned.get('checkpoint')}, "
                         f"which no longer verifies ({broken}), so {KEY} now resolves to {record['checkpoint']}. "
                         f"The runs already made started from it as it was: restore it, or {_NEW_NAME}")
    if planned.get("checkpoint") != record["checkpoint"]:
        raise ValueError(f"{vdir / PLAN_FILE} was planned from the fork checkpoint {planned.get('checkpoint')}; "
                         f"{KEY} now resolves to {record['checkpoint']} (a run directory's newest checkpoint "
                         f"changes as it trains: pass {KEY}={planned.get('checkpoint')} to finish this "
                         "validation, or use a new run.name; nothing was changed)")
    if planned.get("sha256") != record["sha256"]:
        raise ValueError(f"the fork checkpoint {record['checkpoint']} changed since {vdir / PLAN_FILE} was "
                         f"planned (sha256 {planned.get('sha256', '')[:12]} then, {record['sha256'][:12]} now): "
                         "the runs already made started from the old one; use a new run.name (nothing was "
                         "changed)")


def source_problem(pinned: dict) -> str | None:
    """None when the checkpoint plan.json pinned is there with the pinned sha256; else deleted or replaced."""
    checkpoint = Path(pinned["checkpoint"])
    if not checkpoint.exists():
        return f"the fork checkpoint {checkpoint} pinned in {PLAN_FILE} was deleted"
    try:
        now = checkpoint_sha256(checkpoint)
    except ValueError as err:
        return str(err)
    if now != pinned["sha256"]:
        return (f"the fork checkpoint {checkpoint} was replaced or edited since {PLAN_FILE} pinned it (sha256 "
                f"{pinned['sha256'][:12]} then, {now[:12]} now)")
    return None


def check_pinned_fork(run: PlannedRun) -> None:
    """Before a run of a forked validation starts (in the process that trains it): the checkpoint is still the
    pinned one. ValueError ends the validation; the runs made so far are kept."""
    if run.pinned_fork is None:
        return
    # the source's config.yaml too: an edit would otherwise surface inside the run as a train.fork_from error
    problem = source_problem(run.pinned_fork) or source_config_problem(Path(run.pinned_fork["checkpoint"]))
    if problem is not None:
        raise ValueError(f"validation stopped before {run.key}: {problem}. The runs made so far started from the "
                         "pinned checkpoint and are kept; restore the source and re-run `fp8train validate`, or "
                         "start a new validation under another run.name")


def check_run_fork(run: PlannedRun, summary: dict) -> None:
    """After a run of a forked validation: it started from the pinned checkpoint (the sha256 it recorded just
    before loading), not from one that replaced it between the check above and the load."""
    if run.pinned_fork is None:
        return
    started = (summary or {}).get("fork") or {}
    if started.get("sha256") != run.pinned_fork["sha256"]:
        raise ValueError(f"validation stopped: {run.key} started from {started.get('checkpoint')} with sha256 "
                         f"{str(started.get('sha256'))[:12]}, not the checkpoint {PLAN_FILE} pinned (sha256 "
                         f"{run.pinned_fork['sha256'][:12]}): it was replaced while the run started. No verdict "
                         "uses that run; restore the checkpoint, delete the run's folder and re-run `fp8train "
                         "validate`, or start a new validation under another run.name")
