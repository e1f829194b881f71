"""validate.fork_from: every paired run, bf16 and each candidate, starts from one checkpoint of the user's run.

    fp8train validate recipes/cpu_validate.yaml validate.fork_from=runs/my_bf16_run train.max_steps=100

The checkpoint (a run directory's newest valid one, or the checkpoint folder given) is resolved once, and every
run of the plan gets train.fork_from=<that checkpoint> (fp8train.training.runs.fork: weights, AdamW state and the
source's LR schedule go on for train.max_steps steps; a seed varies only what is random after the fork, the data
order and dropout). plan.json records the checkpoint, its step, the sha256 of its files and, per candidate,
whether its FP8 scaling state starts fresh or comes from the checkpoint (an FP8 source of the same recipe). A
re-run whose checkpoint changed, or is missing, is refused before anything runs: the runs already made started
from the recorded one.
"""

from __future__ import annotations

from pathlib import Path

from fp8train.evidence.pairs import PLAN_FILE, PlannedRun, derive_config, validation_dir
from fp8train.training.config import FullConfig
from fp8train.training.runs.fork import checkpoint_sha256, fp8_state_origin, open_fork, resolve_fork_checkpoint
from fp8train.training.storage.files import read_json

__all__ = ["fork_config", "fork_record", "check_fork_unchanged"]

KEY = "validate.fork_from"


def _planned_fork(vdir: Path) -> dict | None:
    try:
        return read_json(vdir / PLAN_FILE).get("fork") if (vdir / PLAN_FILE).is_file() else None
    except ValueError:
        return None  # a damaged plan: check_plan decides what to do with it


def fork_config(cfg: FullConfig) -> tuple[FullConfig, dict | None]:
    """(cfg with train.fork_from set to the resolved checkpoint, the plan's fork record without the per-candidate
    part), or (cfg, None) without validate.fork_from. ValueError for a checkpoint that is missing, broken, from
    another model or optimizer, or another than the one plan.json recorded."""
    if not cfg.validate.fork_from:
        return cfg, None
    planned = _planned_fork(validation_dir(cfg))
    try:
        checkpoint = resolve_fork_checkpoint(cfg.validate.fork_from, KEY)
    except ValueError as err:
        if planned:
            raise ValueError(f"{validation_dir(cfg) / PLAN_FILE} was planned from the fork checkpoint "
                             f"{planned['checkpoint']} (sha256 {planned['sha256'][:12]}), which cannot be used now: "
                             f"{err}. Its runs started from that checkpoint; restore it, or use a new run.name "
                             "(nothing was changed)") from None
        raise
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
