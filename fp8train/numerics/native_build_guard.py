"""Bounds on the native build (native_build.py): a time limit on the compiler, a limit on the wait for another
process's build, and a record of a build that must not be tried again.

A compiler that never returns (a hung ``gcc`` on PATH) would otherwise hang every process that quantizes, and a
process that holds ``build.lock`` while stuck would hang every other process on the same cache. A build that timed
out, or whose output does not load (a compiler that wrote garbage and exited 0), is written to
``<library stem>.failed.json``: later processes with the same compiler and source use the eager kernel at once.
Stdlib only, like native_build.py.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

try:
    import fcntl
except ImportError:  # not POSIX: builds are not serialized across processes (each still renames a whole file)
    fcntl = None

__all__ = ["BUILD_TIMEOUT_S", "LOCK_WAIT_S", "NOTICE_AFTER_S", "notice_once", "Recorded", "CacheUnusable",
           "LockWait", "failure_path", "recorded_failure", "record_failure", "build_lock", "compile_in_group",
           "exit_status"]

BUILD_TIMEOUT_S = 120.0  # all variants together; a real build takes about a second
LOCK_WAIT_S = BUILD_TIMEOUT_S + 30.0  # a holder past this is stuck, not building
# A build (or a wait for another process's) still going after this long is said in one line: up to the limits
# above, a process would otherwise print nothing for two minutes and look hung.
NOTICE_AFTER_S = 5.0
_noticed: set = set()


def notice_once(kind: str, message: str) -> None:
    """`message` on stderr, the first time this process has one of this `kind` ("build", "wait") to say."""
    if kind not in _noticed:
        _noticed.add(kind)
        print(f"fp8train: {message}", file=sys.stderr, flush=True)


class Recorded(RuntimeError):
    """A failure written to the library's .failed.json (the message says what failed and names the file)."""


class CacheUnusable(RuntimeError):
    """The cache directory cannot be made or written (a file in its place, read-only): nothing is built."""


class LockWait(RuntimeError):
    """The build lock was not free within LOCK_WAIT_S."""


def failure_path(paths: dict) -> Path:
    """One failure record for the build of this compiler and source (whichever variant failed)."""
    first = next(iter(paths.values()))
    return first.with_name(first.name.rsplit("-", 1)[0] + ".failed.json")


def recorded_failure(paths: dict) -> Optional[str]:
    path = failure_path(paths)
    try:
        record = json.loads(path.read_text())
        return f"{record['when']} pid {record['pid']}: {record['reason']}"
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable record ({type(err).__name__})"


def record_failure(paths: dict, reason: str) -> Recorded:
    path = failure_path(paths)
    try:
        _write_whole(path, json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%S"), "pid": os.getpid(),
                                       "reason": reason}))
        where = f"recorded in {path}"
    except OSError as err:  # a read-only cache: this process still falls back, the next one tries again
        where = f"not recorded ({err.strerror})"
    return Recorded(f"{reason}; {where}")


def _write_whole(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextmanager
def build_lock(folder: Path):
    path = folder / "build.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:  # a folder in its place, a read-only cache: nothing can be built there
        raise CacheUnusable(f"the cache directory {folder} is unusable: its build lock {path} cannot be opened "
                            f"({err.strerror})") from None
    try:
        if fcntl is not None:
            started = time.monotonic()
            deadline = started + LOCK_WAIT_S
            while True:  # polled, so a stuck holder costs a bounded wait, not a hang
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when fd closes or the process dies
                    break
                except BlockingIOError:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "an unknown process"
                    if time.monotonic() - started > NOTICE_AFTER_S:
                        notice_once("wait", f"waiting for the native kernels' build by {holder} ({path}; up to "
                                            f"{LOCK_WAIT_S:g} s, then the eager kernels are used)")
                    if time.monotonic() > deadline:
                        raise LockWait(f"the build lock {path} was held by {holder} for over {LOCK_WAIT_S:.0f} s "
                                        "(a stuck build?)") from None
                    time.sleep(0.05)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {platform.node()} since {time.strftime('%H:%M:%S')}".encode(), 0)
        yield
    finally:
        os.close(fd)


def compile_in_group(command: list, deadline: float, slow_at: Optional[float] = None,
                     on_slow: Optional[Callable[[], None]] = None) -> subprocess.CompletedProcess:
    """The compiler in a process group of its own: at the deadline the group is killed whole (a driver such as
    gcc leaves cc1 and as behind otherwise); still running at `slow_at`, `on_slow()` is called (a line saying
    so). Its output goes to temporary files, not pipes, and the wait is on the
    compiler itself: a child that left the group (`setsid sleep &`) holds no pipe open, so a compiler that exited
    is judged by its exit and its output at once, not reported as hung at the limit."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        try:
            if on_slow is not None and slow_at is not None and slow_at < deadline:
                try:
                    proc.wait(timeout=max(0.0, slow_at - time.monotonic()))
                except subprocess.TimeoutExpired:
                    on_slow()
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(command, proc.returncode, out.read(), err.read())


def exit_status(returncode: int) -> str:
    """A compiler's exit as words: `exit status 1`, or the signal that killed it (`killed by SIGSEGV`)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"
