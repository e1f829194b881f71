"""Whether a run starts, resumes or is already complete, decided before anything is written.

`train.resume`:
- `false` (default): start a new run; a run directory that already holds a run is refused (nothing is changed);
- `true`: continue the run in the directory from its newest checkpoint that verifies; refused when there is no
  run or no valid checkpoint to continue from (use `auto`);
- `auto`: resume if there is a checkpoint to resume from, else start (what `fp8train validate` uses).

A resumed run must be the same experiment. Its config may differ from the stored config.yaml only in
`RESUMABLE_KEYS` (the schedule: how long to train and how often to evaluate; the micro-batch split) and in the keys that never change
what is trained (`HASH_EXCLUDE`: run name and folder, train.resume, log.*, checkpoint.*, validate.*); any other
difference is refused with the key, the stored value and the new one. `train.fork_from` is compared by where it
leads (the checkpoint the forked run recorded it started from, or that checkpoint's run), not by its spelling: a
link, an absolute path or a relative one from another folder naming the same source resumes. `train.max_steps`
may grow (or shrink, not below the checkpoint's step). The learning-rate schedule stays the one the run started with: warmup and cosine
decay over the first run's `train.max_steps` (stored in every checkpoint as `lr_schedule_steps`), then the final
rate `optim.min_lr_ratio * train.lr` for the steps a larger `train.max_steps` adds. So a resume from any
checkpoint of a run reproduces that run, and extending a finished run continues at its final rate.

A run whose summary.json says "completed" at `train.max_steps` steps (with its final checkpoint present, when
one is saved) is already complete: resuming it changes nothing and says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from fp8train.training.runs.sharded_checkpoint import latest_loadable_checkpoint
from fp8train.training.config import HASH_EXCLUDE, config_hash, load_config
from fp8train.training.storage.files import read_json
from fp8train.training.storage.rundir import CHECKPOINTS_DIR, CONFIG_FILE, SUMMARY_FILE

__all__ = ["RESUMABLE_KEYS", "ResumePoint", "find_resume_point", "config_differences", "resume_hash"]

FORK_KEY = "train.fork_from"  # compared by where it leads, not by its spelling (_same_fork_source)

# Keys that only say how long to train and how often to evaluate: they may change when a run is resumed. And
# train.grad_accum: the global batch (train.batch_size) is fixed, so resuming on another number of processes
# with the same micro-batches means another accumulation count (2 ranks x 1 = 1 rank x 2).
RESUMABLE_KEYS = ("train.max_steps", "train.eval_every", "train.grad_accum", "train.tp_size",
                  "train.sequence_parallel")


def resume_hash(cfg, data_fingerprint: dict | None = None) -> str:
    """The config hash that a checkpoint to resume from must match: config_hash without RESUMABLE_KEYS (stored
    in every checkpoint's manifest as extra.resume_hash; extra.config_hash is the full hash, as in summary.json),
    with the data's content fingerprint (claim.run_hashes passes it)."""
    return config_hash(cfg, HASH_EXCLUDE + RESUMABLE_KEYS, data_fingerprint=data_fingerprint)


@dataclass(frozen=True)
class ResumePoint:
    kind: str  # "start" | "resume" | "complete"
    checkpoint: Optional[Path] = None  # the checkpoint to resume from
    summary: Optional[dict] = None  # the stored summary of a complete run


def _leaves(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix.rstrip("."): node}
    out = {}
    for key, value in node.items():
        out.update(_leaves(value, f"{prefix}{key}."))
    return out


def config_differences(old, new, ignore=HASH_EXCLUDE + RESUMABLE_KEYS) -> list[tuple[str, object, object]]:
    """(dotted key, old value, new value) for every leaf that differs, except keys under `ignore`."""
    old_leaves = _leaves(OmegaConf.to_container(OmegaConf.structured(old)))
    new_leaves = _leaves(OmegaConf.to_container(OmegaConf.structured(new)))
    ignored = lambda key: any(key == i or key.startswith(i + ".") for i in ignore)  # noqa: E731
    keys = sorted(set(old_leaves) | set(new_leaves))
    return [(k, old_leaves.get(k), new_leaves.get(k)) for k in keys
            if not ignored(k) and old_leaves.get(k) != new_leaves.get(k)]


def _forked_from(run_dir: Path) -> str | None:
    """The checkpoint a forked run started from, as it recorded it (summary.json, else its newest checkpoint's
    manifest that says): a resolved path, whatever spelling train.fork_from had."""
    records = [run_dir / SUMMARY_FILE] + sorted((run_dir / CHECKPOINTS_DIR).glob("step_*/manifest.json"),
                                                reverse=True)
    for path in records:
        try:
            data = read_json(path)
        except (OSError, ValueError):
            continue  # a damaged or half-pruned record: another one says it
        fork = data.get("fork") if path.name == SUMMARY_FILE else (data.get("extra") or {}).get("fork")
        if isinstance(fork, dict) and isinstance(fork.get("checkpoint"), str):
            return fork["checkpoint"]
    return None


def _same_fork_source(stored: str, given: str, forked_from: str | None) -> bool:
    """Whether train.fork_from `given` now names the source a run forked from with `stored`, however spelled:
    through a symbolic link or without, absolute or relative (also from another folder than the first run's).
    The checkpoint the run recorded it started from (`forked_from`) decides: `given` resolves to it or to its
    run directory. Without that record, both are resolved from here and compared."""
    if stored == given or not stored or not given:
        return stored == given
    now = Path(os.path.realpath(given))
    if forked_from:
        start = Path(os.path.realpath(forked_from))
        return now in (start, start.parent.parent)
    return now == Path(os.path.realpath(stored))


def _check_same_experiment(cfg, config_file: Path) -> None:
    stored = load_config(str(config_file))
    diffs = config_differences(stored, cfg)
    if any(key == FORK_KEY for key, _, _ in diffs) and _same_fork_source(
            stored.train.fork_from, cfg.train.fork_from, _forked_from(config_file.parent)):
        # the same source spelled another way: the run keeps the spelling it forked with, so its config.yaml and
        # the hashes its checkpoints record stay its own
        cfg.train.fork_from = stored.train.fork_from
        diffs = [d for d in diffs if d[0] != FORK_KEY]
    if diffs:
        detail = "; ".join(f"{k}: {old!r} (run) -> {new!r} (now)" for k, old, new in diffs[:5])
        more = f" and {len(diffs) - 5} more" if len(diffs) > 5 else ""
        raise ValueError(f"train.resume={_word(cfg.train.resume)} but {config_file} was made from a different "
                         f"experiment: {detail}{more}. Only {', '.join(RESUMABLE_KEYS)} and run/log/checkpoint "
                         "keys may change on resume; use a new run.name (nothing was changed)")


def _word(resume) -> str:
    return str(resume).lower()


def _complete_summary(cfg, run_dir: Path, checkpoint: Optional[Path]) -> Optional[dict]:
    path = run_dir / SUMMARY_FILE
    if not path.exists():
        return None
    summary = read_json(path)
    if summary.get("status") != "completed" or summary.get("steps") != cfg.train.max_steps:
        return None
    final_saved = checkpoint is not None and checkpoint.name == f"step_{cfg.train.max_steps:06d}"
    return summary if final_saved or not cfg.checkpoint.save_final else None


def find_resume_point(cfg, run_dir: Path, log: Callable[[str], None]) -> ResumePoint:
    """Start, resume or complete (see the module docstring); ValueError / FileExistsError for what is refused."""
    config_file, resume = run_dir / CONFIG_FILE, cfg.train.resume
    if config_file.exists() and resume is False:
        raise FileExistsError(
            f"run directory {run_dir} already holds a run; pass train.resume=true to continue it (or auto), or "
            "choose another run.name / run.dir (nothing was changed)")
    if resume is False:
        return ResumePoint("start")
    checkpoint = None
    if config_file.exists():
        _check_same_experiment(cfg, config_file)
        checkpoint = latest_loadable_checkpoint(run_dir / CHECKPOINTS_DIR, log=log)  # DDP or sharded (fsdp2)
        summary = _complete_summary(cfg, run_dir, checkpoint)
        if summary is not None:
            return ResumePoint("complete", checkpoint, summary)
    if checkpoint is None and resume is True:
        raise ValueError(f"train.resume=true but {run_dir} holds no valid checkpoint to resume from; use "
                         "train.resume=auto to start the run when there is none (nothing was changed)")
    if checkpoint is None:
        return ResumePoint("start")
    step = int(checkpoint.name.rsplit("_", 1)[-1])
    if step > cfg.train.max_steps:
        raise ValueError(f"train.max_steps={cfg.train.max_steps} is below the step of the checkpoint to resume "
                         f"from ({checkpoint}, step {step}); give train.max_steps >= {step}")
    return ResumePoint("resume", checkpoint)
