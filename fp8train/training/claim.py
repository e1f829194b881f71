"""Claiming a run directory for one training run: the checks every rank makes before anything is written, and
the lock the main process holds for the run's life.

- `check_run_dir` (every rank, before any write): the directory is absent, empty, or holds a run (config.yaml);
  anything else (a validation directory, someone's files) is refused untouched, and so is a symbolic link among
  the files a run writes;
- `check_resume_origin` (every rank): the checkpoint a run resumes from was written on the same data and from
  the same experiment (its manifest's data fingerprint and config hash);
- `check_backend_device`: an FP8 GEMM backend that cannot run on the run's device is refused before the first
  forward (which would fail only after config.yaml was written);
- `claim_run_dir` (main process, other ranks told of a failure): create the directory, take its lock, and
  re-check under the lock what was decided without it (a second process may have started in between).
"""

from __future__ import annotations

from pathlib import Path

from fp8train.nn.gemm import resolve_backend
from fp8train.nn.recipes import ROLES
from fp8train.training.checkpoint import check_checkpoint_origin
from fp8train.training.rank0 import on_main_process
from fp8train.training.rundir import CONFIG_FILE, DirLock, dir_state, refuse_symlinks_in

__all__ = ["check_run_dir", "check_resume_origin", "check_backend_device", "claim_run_dir"]


def check_run_dir(run_dir: Path) -> str:
    """The directory's state ("absent" | "empty" | "run"); ValueError for anything else."""
    state = dir_state(run_dir, CONFIG_FILE)
    if state == "other":
        found = sorted(p.name for p in run_dir.iterdir())[:5] if run_dir.is_dir() else []
        raise ValueError(f"{run_dir} exists and is not a run directory (no {CONFIG_FILE}; it holds "
                         f"{', '.join(found) or 'a file'}): fp8train writes only into an absent or empty folder, "
                         "or continues a run; choose another run.name or run.dir (nothing was changed)")
    refuse_symlinks_in(run_dir)
    return state


def check_resume_origin(checkpoint: Path, manifest: dict, resume_hash: str, data) -> None:
    """The checkpoint was made on `data` (TextData: its fingerprint) and from the same experiment."""
    check_checkpoint_origin(checkpoint, manifest, resume_hash, data.fingerprint, data.source)


def check_backend_device(fp8_recipe, device) -> None:
    """The GEMM backend resolves on `device` (nn.gemm's rule), as a config error naming fp8.backend."""
    if fp8_recipe is None or fp8_recipe.backend == "te":  # te: the layer swap itself checks (and refuses)
        return
    formats = tuple(fp8_recipe.format_of(role) for role in ROLES)
    try:
        resolve_backend(fp8_recipe.backend, device, formats)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"config fp8.backend={fp8_recipe.backend!r} cannot run on {device}: {err}") from None


def claim_run_dir(run_dir: Path, accelerator, expected_state: str, log) -> DirLock | None:
    """Create `run_dir`, lock it (main process) and check that it is still as planned. Returns the held lock on
    the main process, None elsewhere; every rank raises if the main process could not claim it."""
    lock = DirLock(run_dir, "run directory", log=log)

    def claim() -> DirLock:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        try:
            now = check_run_dir(run_dir)
            if (now == "run") != (expected_state == "run"):  # another process made (or removed) a run meanwhile
                raise ValueError(f"run directory {run_dir} changed while this run was being set up (another "
                                 "process wrote it); run the command again (nothing was changed)")
        except BaseException:
            lock.release()
            raise
        return lock

    return on_main_process(accelerator, claim)
