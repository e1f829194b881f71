"""Claiming a run directory for one training run: the checks every rank makes before anything is written, the
lock the main process holds for the run's life, and the hashes that tie checkpoints to their data and config.

- `check_run_dir` (every rank, before any write): the directory is absent, empty, or holds a run (config.yaml);
  anything else (a validation directory, someone's files) is refused untouched, and so is a symbolic link among
  the files a run writes;
- `check_resume_origin` (every rank): the checkpoint a run resumes from was written on the same data and from
  the same experiment (its manifest's data fingerprint and resume hash);
- `check_backend_device`: an FP8 GEMM backend that cannot run on the run's device is refused before the first
  forward (which would fail only after config.yaml was written);
- `claim_run_dir` (main process; the other ranks are told of a failure): create the directory, take its lock,
  re-check under the lock what was decided without it (another process may have started in between), and write
  what must be written first (config.yaml);
- `holding(run)`: the lock is released however the run ends, and a write failure of the environment (full disk,
  read-only, forbidden) leaves a summary.json with status "failed" where the folder still takes it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from fp8train.nn.gemm import resolve_backend
from fp8train.nn.recipes import GemmBackend, ROLES
from fp8train.training.runs.checkpoint import MANIFEST, check_checkpoint_origin
from fp8train.training.config import config_hash
from fp8train.training.storage.outputs import probe_writable
from fp8train.training.parallel.rank0 import on_main_process
from fp8train.training.runs.resume import resume_hash
from fp8train.training.storage.files import read_json, write_error
from fp8train.training.storage.rundir import CONFIG_FILE, dir_state, DirLock, record_write_failure, refuse_symlinks_in

__all__ = ["run_hashes", "check_run_dir", "check_resume_origin", "check_backend_device", "claim_run_dir",
           "holding"]


def run_hashes(cfg, data) -> dict:
    """What a summary and every checkpoint manifest record about the run's identity: `config_hash` (config and
    data fingerprint), `resume_hash` (the same without the keys a resume may change) and the fingerprint."""
    return {"config_hash": config_hash(cfg, data_fingerprint=data.fingerprint),
            "resume_hash": resume_hash(cfg, data.fingerprint),
            "data_fingerprint": data.fingerprint}


def check_run_dir(run_dir: Path) -> str:
    """The directory's state ("absent" | "empty" | "run"); ValueError for anything else, and for a directory that
    cannot be made where run.dir points (a file such as /dev/null, /proc), or that is itself a symbolic link (a
    run folder planted as a link, in a validation directory say, would have the run written into its target)."""
    if run_dir.is_symlink():
        raise ValueError(f"run directory {run_dir} (run.dir/run.name) is a symbolic link (to {os.readlink(run_dir)}); "
                         "fp8train does not write through links (remove it or choose another run.name; nothing was "
                         "changed)")
    state = dir_state(run_dir, CONFIG_FILE)
    if state == "absent":
        try:
            probe_writable(run_dir, "run directory (run.dir/run.name)")
        except ValueError as err:
            raise ValueError(f"run.dir={run_dir.parent}: {err}") from None
    if state == "other":
        found = sorted(p.name for p in run_dir.iterdir())[:5] if run_dir.is_dir() else []
        raise ValueError(f"{run_dir} exists and is not a run directory (no {CONFIG_FILE}; it holds "
                         f"{', '.join(found) or 'a file'}): fp8train writes only into an absent or empty folder, "
                         "or continues a run; choose another run.name or run.dir (nothing was changed)")
    refuse_symlinks_in(run_dir)
    return state


def check_resume_origin(checkpoint: Path, cfg, data) -> None:
    """The checkpoint to resume from was made on `data` (TextData) and from the same experiment as `cfg`."""
    manifest = read_json(checkpoint / MANIFEST)
    check_checkpoint_origin(checkpoint, manifest, run_hashes(cfg, data)["resume_hash"], data.fingerprint,
                            data.source, hash_key="resume_hash")


def check_backend_device(fp8_recipe, device) -> None:
    """The GEMM backend resolves on `device` (nn.gemm's rule), as a config error naming fp8.backend."""
    if fp8_recipe is None or fp8_recipe.backend == GemmBackend.TE:  # te: the layer swap itself checks (and refuses)
        return
    formats = tuple(fp8_recipe.format_of(role) for role in ROLES)
    try:
        resolve_backend(fp8_recipe.backend, device, formats)
    except (RuntimeError, ValueError) as err:
        raise ValueError(f"config fp8.backend={fp8_recipe.backend!r} cannot run on {device}: {err}") from None


def claim_run_dir(run_dir: Path, accelerator, expected_state: str, first_writes: Callable[[], None],
                  log) -> DirLock | None:
    """Create `run_dir`, lock it, check it is still as planned and do `first_writes` (main process). Returns the
    held lock on the main process, None elsewhere; every rank raises if the main process could not claim it."""
    lock = DirLock(run_dir, "run directory", log=log)

    def claim() -> DirLock:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock.acquire()
        try:
            now = check_run_dir(run_dir)
            if (now == "run") != (expected_state == "run"):  # another process made (or removed) a run meanwhile
                raise ValueError(f"run directory {run_dir} changed while this run was being set up (another "
                                 "process wrote it); run the command again (nothing was changed)")
            first_writes()
        except BaseException:
            lock.release()
            raise
        return lock

    return on_main_process(accelerator, claim)


@contextmanager
def holding(run):
    """For the body of a run: its lock released at the end, whatever the end; on a write failure of the
    environment, summary.json says "failed" and why (main process, if the folder takes it), then it re-raises."""
    try:
        yield
    except OSError as err:
        if run.is_main and write_error(err) is not None:
            summary = {"steps": None, "config_hash": run.hashes["config_hash"]}
            if not record_write_failure(run.run_dir, err, summary) and run.lock is not None:
                run.lock.free_reserve()  # a full disk: the lock file's reserve makes room for the summary
                record_write_failure(run.run_dir, err, summary)
        raise
    finally:
        if run.lock is not None:
            run.lock.release()
