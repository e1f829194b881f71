"""A run directory: where a run's files live, whether a directory may be written into, and who works in it.

- the names of the files a run keeps (config.yaml, metrics.jsonl, telemetry.jsonl, summary.json, checkpoints/);
- a run or validation directory is created only where nothing is (absent, or empty), continued only where a run
  is (`dir_state`); anything else is refused before a byte is written;
- nothing in it is written through a symlink (`refuse_symlinks_in`): a link planted in a run directory could make
  fp8train overwrite a file outside it;
- one process at a time works in a directory (`DirLock`, an flock held for the run's life): a second one is
  refused with the holder's PID, and the lock of a process that was killed is free again (the kernel drops an
  flock with its process), so it is taken over and said so;
- a write failure of the environment leaves summary.json saying "failed" and why, when the directory still takes
  it (`record_write_failure`).
Every file in it is written and read through fp8train.training.storage.files (atomic, strict JSON, torn-line
safe).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from fp8train.training.storage.files import refuse_symlink, write_error, write_json_atomic

__all__ = [
    "CONFIG_FILE", "METRICS_FILE", "TELEMETRY_FILE", "SUMMARY_FILE", "CHECKPOINTS_DIR", "TRACKERS_FILE", "LOCK_FILE",
    "refuse_symlinks_in", "dir_state", "DirLock", "LockBusy", "is_locked", "live_holder", "died_holding",
    "record_write_failure", "refuse_run_directory_as_hf_folder",
]

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TELEMETRY_FILE = "telemetry.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
TRACKERS_FILE = "trackers.json"  # tracker run ids (wandb), so a resumed run continues the same tracker run
LOCK_FILE = ".fp8train.lock"


def refuse_symlinks_in(directory: str | os.PathLike) -> None:
    """Raise if any entry fp8train writes in `directory` (its top level, and checkpoints/ two levels down) is a
    symbolic link. Checked before a run writes anything. (Links that trackers such as wandb make inside their
    own folders are theirs and not looked at.)"""
    directory = Path(directory)
    if not directory.is_dir():
        return
    entries = list(directory.iterdir())
    ckpt = directory / CHECKPOINTS_DIR
    if ckpt.is_dir() and not ckpt.is_symlink():
        for sub in ckpt.iterdir():
            entries.append(sub)
            if sub.is_dir() and not sub.is_symlink():
                entries += list(sub.iterdir())
    for entry in entries:
        if entry.is_symlink():
            raise ValueError(f"{entry} is a symbolic link (to {os.readlink(entry)}); fp8train does not write "
                             "through links in a run directory (remove the link; nothing was changed)")


# ------------------------------------------------------------------------------------------------------------
# What a directory holds, and who works in it


def dir_state(directory: str | os.PathLike, marker: str) -> str:
    """"absent" | "empty" | "run" (holds `marker`, e.g. config.yaml or plan.json) | "other" (anything else:
    a file, or a folder with contents that are not a run; never to be written into)."""
    directory = Path(directory)
    if not directory.exists() and not directory.is_symlink():
        return "absent"
    if not directory.is_dir():
        return "other"
    if (directory / marker).is_file():
        return "run"
    names = [p.name for p in directory.iterdir()]
    return "empty" if all(n == LOCK_FILE for n in names) else "other"


# The lock file of a working run holds this much blank space after its record (DirLock.free_reserve): enough for
# summary.json and its temp file on any filesystem's block size.
LOCK_RESERVE_BYTES = 64 << 10


class LockBusy(ValueError):
    """Another live process holds the lock (the message names it)."""


class DirLock:
    """An exclusive lock on a run or validation directory for as long as it is held (`with DirLock(d):` or
    acquire/release). The lock is an flock on `<dir>/.fp8train.lock`, which also records the holder's PID, host
    and start time: a second process is refused with that PID; the kernel drops the flock of a process that
    dies (even by kill -9), so its leftover file is a stale lock, taken over with a message. The file is never
    deleted (deleting a locked file lets two processes lock two different files of the same name).

    With `claim_file`, the same lock claims a folder that may not exist yet (a command's --out): the lock file is
    `claim_file` beside it, deleted on release while still locked, and a process that locked a deleted one (it
    opened it before the deletion) sees so and locks the file now at that path instead."""

    def __init__(self, directory: str | os.PathLike, what: str = "run directory", log=None,
                 claim_file: str | os.PathLike | None = None):
        self.directory, self.what, self.log = Path(directory), what, log
        # claim_file: the lock sits beside the folder instead of in it (an output claimed before it exists,
        # `claim_output_path`); such a file is removed on release, which the inode check in acquire makes safe
        self.path = self.directory / LOCK_FILE if claim_file is None else Path(claim_file)
        self._removed_on_release = claim_file is not None
        self._fd: int | None = None
        self._record = b""

    def acquire(self) -> "DirLock":
        while True:
            refuse_symlink(self.path)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _lock_holder(fd)
                os.close(fd)
                raise LockBusy(f"{self.what} {self.directory} is in use by another fp8train process "
                                 f"(PID {holder.get('pid', '?')} on {holder.get('host', '?')}, since "
                                 f"{holder.get('since', '?')}); wait for it to finish or stop it (nothing was "
                                 "changed)") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # locked a claim file its holder removed on release: lock the one now there (or a new one)
        stale = _lock_holder(fd)
        if stale.get("pid") is not None and self.log is not None:
            self.log(f"{self.what} {self.directory}: took over the lock of PID {stale['pid']}, which is no "
                     "longer running (killed?)")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self._record = (json.dumps(record) + "\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, self._record, 0)
        self._fd = fd
        if self._removed_on_release:  # a short-lived claim: no reserve (its folder has no summary to write)
            return self
        try:  # blanks after the record (JSON ignores them): disk space held back for free_reserve
            disk = os.fstatvfs(fd)
            # at most half of what is free (a nearly full disk keeps room for the run), whole 4 KiB blocks
            reserve = min(LOCK_RESERVE_BYTES, disk.f_bavail * disk.f_frsize // 2) // 4096 * 4096
            if reserve:
                os.pwrite(fd, b" " * reserve, len(self._record))
        except OSError:
            pass  # no reserve: the run goes on as it would have
        return self

    def free_reserve(self) -> None:
        """Give back the lock file's reserve to the filesystem, so that after a full disk stopped the run, its
        summary.json saying so still has room (the record of the holder stays)."""
        if self._fd is not None:
            try:
                os.ftruncate(self._fd, len(self._record))
            except OSError:
                pass

    def release(self) -> None:
        if self._fd is None:
            return
        if self._removed_on_release:  # removed while still locked: a waiting process sees it gone (_same_file)
            try:
                self.path.unlink()
            except OSError:
                pass
        try:
            os.ftruncate(self._fd, 0)  # released cleanly: no holder recorded
        except OSError:
            pass  # read-only now, or full: the flock still goes with the close
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "DirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def is_locked(directory: str | os.PathLike) -> bool:
    """Whether a live process holds `directory`'s DirLock now (this one included): a run directory without a
    summary.json is running when it is locked, and was killed or stopped when not (the kernel drops a dead
    process's flock). Only tries the lock (shared, not waiting), never takes it over."""
    return live_holder(Path(directory) / LOCK_FILE) is not None


def live_holder(lock_file: str | os.PathLike) -> dict | None:
    """The record (pid, host, since) of the live process that holds the lock file `lock_file` (a DirLock's, or an
    output's claim file); None when none does: absent, or left by a process that died. Only tries the lock (shared,
    not waiting), never takes it over."""
    try:
        fd = os.open(lock_file, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _lock_holder(fd)
    finally:
        os.close(fd)  # closing drops the shared lock when it was taken
    return None


def died_holding(directory: str | os.PathLike) -> bool:
    """Whether a process died holding `directory`'s DirLock (killed): its record is still in the lock file, which
    every release empties, and no live process holds the lock. A run killed after it took its folder and before
    its first file there leaves only this."""
    try:
        fd = os.open(Path(directory) / LOCK_FILE, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False  # a live holder: running, not killed
    try:
        return _lock_holder(fd).get("pid") is not None
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path` (not unlinked or replaced since it was opened)."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _lock_holder(fd: int) -> dict:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError):
        return {}
    return record if isinstance(record, dict) else {}


def record_write_failure(run_dir: str | os.PathLike, err: OSError, summary: dict | None = None) -> bool:
    """After a write failure of the environment, leave summary.json with status "failed" and the one-line reason
    if the run directory still takes it (a full disk often does once the failed write's temp files are gone).
    Returns whether it was written."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return False
    record = {**(summary or {}), "status": "failed", "reason": write_error(err) or str(err)}
    try:
        write_json_atomic(run_dir / SUMMARY_FILE, record)
    except OSError:
        return False
    return True


def refuse_run_directory_as_hf_folder(path: str, key: str) -> None:
    """An fp8train run directory (config.yaml and checkpoints/, no config.json) given where a Hugging Face folder
    is wanted (config ``key``) is refused, saying how to write one from it. Checked before anything else is said
    about the folder (its tokenizer, its weights): the folder is the wrong kind, and that comes first."""
    folder = Path(os.path.expanduser(path))
    if folder.is_dir() and not (folder / "config.json").is_file() and (folder / CONFIG_FILE).is_file() \
            and (folder / CHECKPOINTS_DIR).is_dir():
        raise ValueError(f"{key}: {path!r} is an fp8train run directory, not a Hugging Face folder; write one from "
                         f"it with `fp8train export {path} --format hf --out DIR` and give DIR")
