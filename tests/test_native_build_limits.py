"""The native build's bounds (numerics/native_build_guard.py) with real processes and fake compilers (small shell
scripts on PATH): a compiler that never returns is killed at the time limit and the process quantizes eagerly; a
process waiting for another's stuck build gives up naming the holder; a compiler that writes garbage and exits 0
is recorded as failed, its output never loaded again. Each child runs with limits of seconds, not the shipped
120 s, set on the module before its first use (and the 5 s after which a build or a wait is said, where the tree
has it)."""

from __future__ import annotations

import os
import platform
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8train.numerics import native_build

# A process that sets the limits (where the tree has them) and loads the kernel once; prints what it got.
CHILD = """
import importlib, sys, warnings
build = importlib.import_module("fp8train.numerics.native_build")
guard = sys.modules.get("fp8train.numerics.native_build_guard")
if guard is not None:
    guard.BUILD_TIMEOUT_S, guard.LOCK_WAIT_S = float(sys.argv[1]), float(sys.argv[2])
    guard.NOTICE_AFTER_S = float(sys.argv[3])
warnings.simplefilter("always")
print("available", build.available(), flush=True)
print("reason", build.unavailable_reason(), flush=True)
"""


def _compilers(bin_dir: Path, body: str) -> str:
    bin_dir.mkdir(exist_ok=True)
    for name in native_build.COMPILER_NAMES:
        script = bin_dir / name
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _start(cache: Path, path: str, build_s: float, lock_s: float, notice_s: float = 5.0) -> subprocess.Popen:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), PATH=path)
    return subprocess.Popen([sys.executable, "-c", CHILD, str(build_s), str(lock_s), str(notice_s)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, limit_s: float = 90) -> tuple[str, str, str, float]:
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"the process hung for {limit_s} s")
    assert proc.returncode == 0, err
    reason = next(line for line in out.splitlines() if line.startswith("reason "))[len("reason "):]
    return out, reason, err, time.monotonic() - started


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return True


def _unavailable_warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if "native FP8 cast is unavailable" in line]


@pytest.mark.slow
def test_a_hung_compiler_is_killed_at_the_limit_and_not_tried_again(tmp_path):
    calls, sleeper = tmp_path / "calls", tmp_path / "sleeper"
    # the driver starts a child that never returns, as gcc starts cc1: both are killed, not left behind
    path = _compilers(tmp_path / "bin", f"echo run >> {calls}\nsleep 300 &\necho $! > {sleeper}\nwait\n")
    out, reason, err, took = _finish(_start(tmp_path / "cache", path, build_s=3, lock_s=30))
    assert "available False" in out and took < 40, (out, err, took)
    assert "did not finish within 3 s (killed)" in reason and "recorded in" in reason, reason
    assert len(_unavailable_warnings(err)) == 1, err
    deadline = time.monotonic() + 10
    while not _gone(int(sleeper.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(int(sleeper.read_text())), "the compiler's child outlived the time limit"
    # the next process on this cache: the eager kernel at once, the compiler not run again
    out, reason, err, took = _finish(_start(tmp_path / "cache", path, build_s=3, lock_s=30))
    assert "available False" in out and "an earlier build with this compiler failed" in reason, reason
    assert "did not finish within 3 s" in reason and calls.read_text().splitlines() == ["run"]
    assert len(_unavailable_warnings(err)) == 1 and "tries again" not in err, err


@pytest.mark.slow
def test_a_process_waiting_for_a_stuck_build_gives_up_naming_the_holder(tmp_path):
    group = tmp_path / "group"
    path = _compilers(tmp_path / "bin", f"echo $$ > {group}\nsleep 120\n")
    holder = _start(tmp_path / "cache", path, build_s=100, lock_s=100)
    lock = tmp_path / "cache" / "fp8train" / "native" / "build.lock"
    try:
        deadline = time.monotonic() + 60
        while not (lock.exists() and f"pid {holder.pid} " in lock.read_text()):
            assert time.monotonic() < deadline and holder.poll() is None, "the holder never took the lock"
            time.sleep(0.1)
        out, reason, err, took = _finish(_start(tmp_path / "cache", path, build_s=100, lock_s=3, notice_s=1))
        assert "available False" in out and took < 40, (out, err)
        # after 1 s of waiting, one line naming the holder (it was silent until the limit)
        waiting = [line for line in err.splitlines() if "waiting for" in line]
        assert len(waiting) == 1 and re.fullmatch(
            re.escape(f"fp8train: waiting for the native kernels' build by pid {holder.pid} on {platform.node()} "
                      "since ") + r"\d\d:\d\d:\d\d"
            + re.escape(f" ({lock}; up to 3 s, then the eager kernels are used)"),
            waiting[0]), err
        assert err.index("waiting for") < err.index("native FP8 cast is unavailable")
        assert f"the build lock {lock} was held by pid {holder.pid} on" in reason, reason
        assert "for over 3 s" in reason and len(_unavailable_warnings(err)) == 1, err
        assert holder.poll() is None  # the holder is still stuck: the waiter did not wait for it
    finally:
        holder.kill()
        holder.communicate()
        if group.exists():  # the fake compiler's own process group (the build runs it in a new session)
            try:
                os.killpg(int(group.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_a_compiler_that_writes_garbage_and_exits_0_is_recorded_failed_not_loaded_again(tmp_path):
    calls = tmp_path / "calls"
    path = _compilers(tmp_path / "bin", f"echo run >> {calls}\nwhile [ $# -gt 0 ]; do\n"
                      "  if [ \"$1\" = -o ]; then echo 'not a library' > \"$2\"; fi\n  shift\ndone\nexit 0\n")
    out, reason, err, _ = _finish(_start(tmp_path / "cache", path, build_s=30, lock_s=30))
    assert "available False" in out and "built does not load (OSError" in reason and "recorded in" in reason
    assert "tries again" not in err and len(_unavailable_warnings(err)) == 1, err
    folder = tmp_path / "cache" / "fp8train" / "native"
    assert not list(folder.glob("*.so")) and not list(folder.glob("*.so.json"))  # the garbage is gone
    for _ in range(2):  # every later process: no build, no load of garbage, the same accurate reason
        out, reason, err, _ = _finish(_start(tmp_path / "cache", path, build_s=30, lock_s=30))
        assert "available False" in out and "an earlier build with this compiler failed" in reason, reason
        assert "built does not load" in reason and "tries again" not in err, err
    assert calls.read_text().splitlines() == ["run"]


@pytest.mark.slow
def test_a_cache_home_that_is_a_file_is_named_unusable_and_the_kernel_is_eager_with_one_warning(tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("not a folder\n")
    out, reason, err, _ = _finish(_start(cache, os.environ.get("PATH", ""), 30, 30))
    assert "available False" in out
    assert reason.startswith(f"the cache directory {cache}/fp8train/native is unusable ({cache} is a file, not a "
                             "folder"), reason
    assert ".failed.json" not in reason and "earlier build" not in reason
    assert err.count("RuntimeWarning") == 1 and "eager kernel" in err, err
    assert cache.read_text() == "not a folder\n"


@pytest.mark.slow
def test_a_build_lock_that_cannot_be_opened_is_named_and_the_kernel_is_eager(tmp_path):
    lock = tmp_path / "cache" / "fp8train" / "native" / "build.lock"
    lock.mkdir(parents=True)  # a folder where the lock file goes
    out, reason, err, _ = _finish(_start(tmp_path / "cache", os.environ.get("PATH", ""), 30, 30))
    assert "available False" in out
    assert reason == (f"the cache directory {lock.parent} is unusable: its build lock {lock} cannot be opened (Is a "
                      "directory)"), reason
    assert err.count("RuntimeWarning") == 1 and "the next process tries again" not in err, err


@pytest.mark.slow
def test_a_compiler_that_exits_at_once_leaving_an_escaped_child_is_judged_by_its_exit_not_timed_out(tmp_path):
    # the escaped child (a session of its own) would hold pipes open for 300 s; the compiler itself exits 0 at
    # once with garbage as output: a failed build said as such, in seconds, not "did not finish" at the limit
    sleeper = tmp_path / "sleeper"
    path = _compilers(tmp_path / "bin", f"setsid sleep 300 &\necho $! > {sleeper}\nwhile [ $# -gt 0 ]; do\n"
                      "  if [ \"$1\" = -o ]; then echo 'not a library' > \"$2\"; fi\n  shift\ndone\nexit 0\n")
    try:
        out, reason, err, took = _finish(_start(tmp_path / "cache", path, build_s=20, lock_s=30))
    finally:
        if sleeper.exists():
            try:
                os.kill(int(sleeper.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
    assert "available False" in out and took < 15, (out, err, took)
    assert "built does not load (OSError" in reason and "did not finish" not in reason, reason
    assert len(_unavailable_warnings(err)) == 1, err


def test_a_compiler_that_exits_0_writing_nothing_is_named_as_such(tmp_path):
    path = _compilers(tmp_path / "bin", "exit 0\n")
    out, reason, err, _ = _finish(_start(tmp_path / "cache", path, build_s=30, lock_s=30))
    assert "available False" in out and "exited 0 but wrote no library" in reason, reason
    assert "FileNotFoundError" not in reason and "FileNotFoundError" not in err, (reason, err)
    assert len(_unavailable_warnings(err)) == 1, err
    assert not list((tmp_path / "cache" / "fp8train" / "native").glob("*.tmp"))  # nothing left behind


def test_a_compiler_killed_by_a_signal_is_named_by_the_signal(tmp_path):
    path = _compilers(tmp_path / "bin", "kill -SEGV $$\n")
    out, reason, err, _ = _finish(_start(tmp_path / "cache", path, build_s=30, lock_s=30))
    assert "available False" in out and "killed by SIGSEGV" in reason and "(-11)" not in reason, reason


@pytest.mark.slow
@pytest.mark.parametrize("build_s", [3, 0])
def test_a_build_still_going_after_the_notice_time_says_so_once_and_a_fast_one_says_nothing(tmp_path, build_s):
    """A compiler that takes 3 s (for the OpenMP variant; then the pthreads variant fails at once) with the notice
    at 1 s: one line naming the compiler and the limit, before the failure's warning, once in the process although
    two variants were tried. A compiler that fails at once: no such line (only the warning)."""
    path = _compilers(tmp_path / "bin", f'case "$*" in *-fopenmp*) sleep {build_s};; esac\necho broken >&2\nexit 1\n')
    out, reason, err, took = _finish(_start(tmp_path / "cache", path, build_s=30, lock_s=60, notice_s=1))
    assert "available False" in out and "exit status 1" in reason, (out, err)
    said = [line for line in err.splitlines() if "building fp8train's native kernels" in line]
    if build_s:
        assert said == [f"fp8train: building fp8train's native kernels with {tmp_path / 'bin' / 'gcc'} (once per "
                        "machine and compiler; up to 30 s, then quantize uses its eager kernels)"], err
        assert err.index("building fp8train's") < err.index("native FP8 cast is unavailable")
    else:
        assert said == [], err
    assert len(_unavailable_warnings(err)) == 1, err
