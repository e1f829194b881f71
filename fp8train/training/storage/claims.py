"""Claims: which fp8train process writes where right now, so that no command replaces or deletes what another live
one is writing. A claim is a run directory's lock (rundir.DirLock, an flock with the holder's PID) in a claim file
`.<name>.fp8train-claim`:

- beside an output path (`export --out X`, `kv-eval --out X`: `.X.fp8train-claim` in X's folder), made by
  `outputs.claim_output_path` before the output is checked and held until its last file is written;
- inside a folder that a command writes a set of files into (`report` of a run or validation folder:
  `.report.fp8train-claim` in it), made by `claim_folder` below. Inside, not beside: that folder is the only
  place the command writes, so it is the only one that must take a new file (a run folder that could be written,
  under a parent that could not, used to be refused for the parent).

A folder is replaced whole only by a command that holds the claim beside it (`export --force`), and two rules keep
that from taking away another process's output inside it, whichever comes first:
- the replacing command looks for live claims inside the folder after it holds its own claim, when it checks --out
  and again just before and just after it moves the old folder aside (`refuse_live_claims`);
- a command claiming a path, once its own claim is made, looks for a live claim beside any folder above the path
  (`refuse_claimed_folders_above`) and, finding one, gives its claim back and is refused.
Each publishes its claim before it looks for the other's, so at least one of two racing commands sees the other.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from fp8train.training.storage.files import temp_path, write_failure
from fp8train.training.storage.rundir import DirLock, LockBusy, live_holder

__all__ = ["CLAIM_SUFFIX", "claim_file_beside", "claim_file_in", "is_claim", "live_claims", "refuse_live_claims",
           "refuse_claimed_folders_above", "claim_folder"]

CLAIM_SUFFIX = ".fp8train-claim"
_UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def _resolved_name(path: str | os.PathLike) -> Path:
    """`path` with the folders above it resolved (links followed, `..` and relative parts gone) and its own name as
    given (an output that is itself a link is refused by the output checks): one output, one name, however the
    path to it is spelled."""
    target = Path(os.path.abspath(path))
    return Path(os.path.realpath(target.parent)) / target.name


def claim_file_beside(path: str | os.PathLike) -> Path:
    """The claim file of the output `path` (a file or folder, present or not), in the folder holding it: the same
    file whether the path is given through a symbolic link to that folder or not."""
    target = _resolved_name(path)
    return target.parent / f".{target.name}{CLAIM_SUFFIX}"


def claim_file_in(folder: str | os.PathLike, command: str) -> Path:
    """Where `command` (e.g. "report") holds its claim on `folder` while it writes there."""
    return Path(folder) / f".{command}{CLAIM_SUFFIX}"


def is_claim(entry: Path) -> bool:
    return entry.name.startswith(".") and entry.name.endswith(CLAIM_SUFFIX) and entry.is_file() \
        and not entry.is_symlink()


def _held_by_another(claim_file: Path) -> dict | None:
    """The holder's record when a live process other than this one holds `claim_file`; None otherwise."""
    holder = live_holder(claim_file)
    if holder is None or (holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname()):
        return None
    return holder


def live_claims(folder: Path) -> list[tuple[Path, dict]]:
    """(claim file, holder) of every claim inside `folder` that another live process holds."""
    found = []
    for entry in sorted(folder.iterdir()):
        holder = _held_by_another(entry) if is_claim(entry) else None
        if holder is not None:
            found.append((entry, holder))
    return found


def _in_use(what: str, holder: dict, doing: str) -> LockBusy:
    return LockBusy(f"{what} is in use by another fp8train process (PID {holder.get('pid', '?')} on "
                    f"{holder.get('host', '?')}, since {holder.get('since', '?')}, {doing}); wait for it to finish "
                    "or stop it (nothing was written)")


def refuse_live_claims(folder: Path, option: str, shown: Path | None = None) -> None:
    """LockBusy when another live fp8train process is writing an output inside `folder` (its claim file is there:
    kv-eval of an export folder, say): replacing the folder would take that output away mid-write. The message
    names `shown` (the folder's own name, when `folder` is the name it was moved aside to)."""
    for entry, holder in live_claims(folder)[:1]:
        raise _in_use(f"{option} {shown or folder}", holder, f"writing {entry.name[1:-len(CLAIM_SUFFIX)]} there")


def refuse_claimed_folders_above(path: Path, option: str, including_itself: bool = False) -> None:
    """LockBusy when another live process holds the claim beside a folder above `path` (or beside `path` itself,
    with `including_itself`): that process (`export --force`) may replace the folder, and whatever is written in
    it with it. Called once the caller's own claim is made, so a replacing command that looks later sees it."""
    target = _resolved_name(path)
    folders = ([target] if including_itself else []) + list(target.parents)
    for folder in folders[:-1]:  # the filesystem root has no claim beside it
        holder = _held_by_another(claim_file_beside(folder))
        if holder is not None:
            raise _in_use(f"{option} {path}", holder, f"writing {folder}, which holds it")


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


def acquire_waiting(lock: DirLock, wait_s: float) -> None:
    """Take `lock`, retrying while another live process holds it for up to `wait_s` (then its LockBusy, naming
    the holder, goes up); a claim file that cannot be made (a folder in its place, a read-only folder, a full disk)
    is one write-failure line naming it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            lock.acquire()
            return
        except LockBusy:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.2)
        except OSError as err:
            raise write_failure(err, lock.path) from None


@contextmanager
def claim_folder(folder, command: str, remedy: str, log=None, wait_s: float = 0.0):
    """Hold the existing folder `folder` for `command` (e.g. "report") writing its set of files there: a second
    process claiming it meanwhile is refused (LockBusy naming the folder and the holder's PID), after waiting up to
    `wait_s` for it; a killed holder's claim is taken over with a message. A folder that cannot be written is
    refused first, naming it and `remedy`. The claim file is removed on release."""
    folder = Path(folder)
    _refuse_unwritable(folder, command, remedy)
    say = log or (lambda message: print(f"fp8train: {message}", file=sys.stderr))
    lock = DirLock(folder, f"{command} of", log=say, claim_file=claim_file_in(folder, command))
    acquire_waiting(lock, wait_s)
    try:
        refuse_claimed_folders_above(folder, f"{command} of", including_itself=True)
        yield folder
    finally:
        lock.release()
