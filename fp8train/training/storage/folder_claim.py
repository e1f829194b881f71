"""The claim of a command that writes a set of files into a folder that already exists (`report` into a run or
validation folder): one such command at a time per folder, as `outputs.claim_output_path` does for an --out path,
but with the claim file inside the folder, `.<what>.fp8train-claim`, not beside it.

Why inside: the folder is the only place the command writes (its files are written aside within it and renamed in,
`outputs.write_output_set`), so it is the only folder that must take a new file. A claim beside it needed the parent
to be writable too: a run folder that could be written, under a parent that could not, was refused for the parent.
A folder that takes no new file is said before anything, naming the folder and what to do about it.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from fp8train.training.storage.files import temp_path, write_failure
from fp8train.training.storage.outputs import CLAIM_SUFFIX
from fp8train.training.storage.rundir import DirLock, LockBusy

__all__ = ["claim_folder", "claim_file_in"]

_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def claim_file_in(folder: str | os.PathLike, command: str) -> Path:
    """Where `command` (e.g. "report") holds its claim on `folder` while it writes there."""
    return Path(folder) / f".{command}{CLAIM_SUFFIX}"


def _refuse_unwritable(folder: Path, command: str, remedy: str) -> None:
    """ValueError naming `folder` and `remedy` when it takes no new file (read-only, forbidden), before any work;
    the probe file is made and removed at once."""
    probe = temp_path(folder / ".fp8train-probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as err:
        if err.errno in _UNWRITABLE:
            raise ValueError(f"{command} writes its files into {folder}, which cannot be written "
                             f"({os.strerror(err.errno)}); {remedy} (nothing was written)") from None
        raise write_failure(err, folder) from None
    probe.unlink(missing_ok=True)


@contextmanager
def claim_folder(folder, command: str, remedy: str, log=None, wait_s: float = 0.0):
    """Hold the existing folder `folder` for `command` (e.g. "report") writing its set of files there:
    a second process claiming it meanwhile is refused (LockBusy naming the folder and the holder's PID), after
    waiting up to `wait_s` for it; a killed holder's claim is taken over with a message. A folder that cannot
    be written is refused first, naming it and `remedy`. The claim file is removed on release."""
    folder = Path(folder)
    _refuse_unwritable(folder, command, remedy)
    say = log or (lambda message: print(f"fp8train: {message}", file=sys.stderr))
    lock = DirLock(folder, f"{command} of", log=say, claim_file=claim_file_in(folder, command))
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lock.acquire()
            break
        except LockBusy:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
        except OSError as err:  # the claim file cannot be made (a folder in its place, the disk full)
            raise write_failure(err, lock.path) from None
    try:
        yield folder
    finally:
        lock.release()
