"""The native kernel's build cache (numerics/native_build.py) with real compilers, real files and real processes:
two processes starting at once build once, threads of one process load once, a damaged cached library is rebuilt
with a warning (never loaded), loading a cached library runs no compiler, stale builds are pruned, and the
fallback warning says what failed. Every test uses its own XDG_CACHE_HOME (never ~/.cache)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from fp8train.numerics import native_build

HAS_COMPILER = any(native_build.shutil.which(n) for n in native_build.COMPILER_NAMES)
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler on PATH to build with")

# A child process that runs the real native_build.py loaded by its file: the package's import (torch, seconds on
# a loaded 2-core machine) is not needed to build or load the library. Waits for its sibling when asked.
CHILD = """
import importlib.util, os, sys, time, warnings
spec = importlib.util.spec_from_file_location("native_build", sys.argv[1])
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
if len(sys.argv) > 2:  # a barrier: both children call available() at the same moment
    open(sys.argv[2] + "." + str(os.getpid()), "w").close()
    deadline = time.time() + 120
    while len([p for p in os.listdir(os.path.dirname(sys.argv[2])) if p.startswith("ready.")]) < 2:
        assert time.time() < deadline, "the sibling never started"
        time.sleep(0.01)
warnings.simplefilter("always")
print("available", build.available(), build.unavailable_reason(), flush=True)
"""


def _env(cache_home: Path, path: str | None = None) -> dict:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
    if path is not None:
        env["PATH"] = path
    return env


def _child(cache_home: Path, *extra: str, path: str | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, native_build.__file__, *extra], env=_env(cache_home, path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _folder(cache_home: Path) -> Path:
    return cache_home / "fp8train" / "native"


def _builds(cache_home: Path) -> list[str]:
    log = _folder(cache_home) / native_build.BUILD_LOG
    return log.read_text().splitlines() if log.exists() else []


def _fake_compilers(bin_dir: Path, body: str) -> str:
    """A shell script named like every compiler fp8train looks for; returns a PATH that finds it first."""
    bin_dir.mkdir(exist_ok=True)
    for name in native_build.COMPILER_NAMES:
        script = bin_dir / name
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def _fresh_state(monkeypatch, cache_home: Path, path: str | None = None) -> None:
    monkeypatch.setattr(native_build, "_state", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    if path is not None:
        monkeypatch.setenv("PATH", path)


# ------------------------------------------------------------------------------------------------------------
# Concurrency: processes (the file lock) and threads (the load lock)
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_compiler
def test_two_processes_starting_at_once_into_an_empty_cache_build_once(tmp_path):
    real = native_build._find_compiler()
    # the real compiler, a second slower, so the two builds would overlap without the lock
    path = _fake_compilers(tmp_path / "bin", f"sleep 1\nexec {real} \"$@\"\n")
    (tmp_path / "sync").mkdir()
    procs = [_child(tmp_path / "cache", str(tmp_path / "sync" / "ready"), path=path) for _ in range(2)]
    results = [_finish(p) for p in procs]
    for rc, out, err in results:
        assert rc == 0 and "available True None" in out, (rc, out, err)
    builds = _builds(tmp_path / "cache")
    assert len(builds) == 1, builds
    assert len(list(_folder(tmp_path / "cache").glob("*.so"))) == 1
    assert not list(_folder(tmp_path / "cache").glob(".*.tmp"))


def test_threads_of_one_process_load_once_and_warn_once(monkeypatch, tmp_path):
    calls = tmp_path / "calls"
    path = _fake_compilers(tmp_path / "bin", f"echo \"$@\" >> {calls}\necho 'fatal: no space' >&2\nexit 3\n")
    _fresh_state(monkeypatch, tmp_path / "cache", path)
    start, answers = threading.Barrier(4), []

    def worker():
        start.wait()
        answers.append(native_build.available())

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert answers == [False] * 4
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert len(calls.read_text().splitlines()) == 2  # one try per variant (openmp, pthreads), not one per thread


# ------------------------------------------------------------------------------------------------------------
# A damaged cached library is never loaded: rebuilt, with a warning that says what was wrong
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A cache holding one good build, made by a real process."""
    if not HAS_COMPILER:
        pytest.skip("no C compiler on PATH to build with")
    home = tmp_path_factory.mktemp("built") / "cache"
    rc, out, err = _finish(_child(home))
    assert rc == 0 and "available True" in out, (out, err)
    return home


def _truncate(so: Path) -> None:
    so.write_bytes(so.read_bytes()[: so.stat().st_size // 3])


def _flip_a_byte(so: Path) -> None:
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))


def _drop_the_record(so: Path) -> None:
    so.with_name(so.name + ".json").unlink()


@pytest.mark.slow
@pytest.mark.parametrize("damage, said", [(_truncate, "bytes where the build wrote"),
                                          (_flip_a_byte, "sha256 differs"),
                                          (_drop_the_record, "no build record")])
def test_a_damaged_cached_library_is_rebuilt_with_a_warning_not_loaded(built_cache, tmp_path, damage, said):
    home = tmp_path / "cache"
    subprocess.run(["cp", "-a", str(built_cache), str(home)], check=True)
    (so,) = _folder(home).glob("*.so")
    damage(so)
    rc, out, err = _finish(_child(home))
    assert rc == 0, f"the child died ({rc}): {err}"  # a truncated library loaded would be SIGBUS (-7)
    assert "available True None" in out, (out, err)
    damaged = [line for line in err.splitlines() if "is damaged" in line]
    assert len(damaged) == 1 and str(so) in damaged[0] and said in damaged[0] and "rebuilding it" in damaged[0]
    record = json.loads(so.with_name(so.name + ".json").read_text())
    assert record["size"] == so.stat().st_size and native_build._problem(so) is None
    assert len(_builds(home)) == 2  # the first build and the rebuild


# ------------------------------------------------------------------------------------------------------------
# The compiler's identity: its file, not a `--version` fork per process
# ------------------------------------------------------------------------------------------------------------
@needs_compiler
def test_a_cached_library_loads_without_running_the_compiler(monkeypatch, tmp_path):
    calls, real = tmp_path / "calls", native_build._find_compiler()
    path = _fake_compilers(tmp_path / "bin", f"echo \"$@\" >> {calls}\nexec {real} \"$@\"\n")
    _fresh_state(monkeypatch, tmp_path / "cache", path)
    assert native_build.available()
    assert len(calls.read_text().splitlines()) == 1  # the build
    monkeypatch.setattr(native_build, "_state", {})  # as a new process: loads the cached library
    assert native_build.available()
    assert len(calls.read_text().splitlines()) == 1, calls.read_text()  # no --version, no build
    _fake_compilers(tmp_path / "bin", f"# upgraded\necho \"$@\" >> {calls}\nexec {real} \"$@\"\n")
    monkeypatch.setattr(native_build, "_state", {})  # another compiler at the same path: its own build
    assert native_build.available()
    assert len(calls.read_text().splitlines()) == 2
    assert len(list(_folder(tmp_path / "cache").glob("*.so"))) == 2


# ------------------------------------------------------------------------------------------------------------
# Pruning, under the lock, at a build
# ------------------------------------------------------------------------------------------------------------
@needs_compiler
def test_a_build_prunes_stale_builds_of_its_family_only(monkeypatch, tmp_path):
    _fresh_state(monkeypatch, tmp_path / "cache")
    family, paths = native_build._library_paths(native_build._find_compiler())
    folder = _folder(tmp_path / "cache")
    folder.mkdir(parents=True)
    week_ago = time.time() - 8 * 24 * 3600

    def make(name: str, old: bool, record: bool = True) -> Path:  # a file (and its record), last used then
        files = [folder / name] + ([folder / f"{name}.json"] if record else [])
        for f in files:
            f.write_bytes(b"x")
            if old:
                os.utime(f, (week_ago, week_ago))
        return files[0]

    stale = make(f"native_cast-{family}-000000000000-openmp.so", old=True)
    recent = make(f"native_cast-{family}-111111111111-openmp.so", old=False)  # another version, in use
    other_cpu = make("native_cast-ffffffffffff-000000000000-openmp.so", old=True)
    dead_tmp = make(f".native_cast-{family}-x-openmp.so.1.abcd.tmp", old=True, record=False)
    live_tmp = make(f".native_cast-{family}-y-openmp.so.2.abcd.tmp", old=False, record=False)
    assert native_build.available()
    left = {p.name for p in folder.iterdir()}
    assert stale.name not in left and stale.name + ".json" not in left
    assert dead_tmp.name not in left
    assert {recent.name, recent.name + ".json", other_cpu.name, other_cpu.name + ".json", live_tmp.name} <= left
    assert paths["openmp"].name in left or paths["pthreads"].name in left


# ------------------------------------------------------------------------------------------------------------
# The fallback's warning says what failed
# ------------------------------------------------------------------------------------------------------------
def test_a_failing_compiler_is_named_in_the_warning_without_install_advice(monkeypatch, tmp_path):
    path = _fake_compilers(tmp_path / "bin", "echo 'fatal: no space left on device' >&2\nexit 3\n")
    _fresh_state(monkeypatch, tmp_path / "cache", path)
    with pytest.warns(RuntimeWarning) as caught:
        assert not native_build.available()
    (message,) = [str(w.message) for w in caught]
    assert (f"the C compiler {tmp_path / 'bin' / 'gcc'} failed (exit status 3): fatal: no space left on device"
            in message)
    assert "install" not in message.lower() and "\n" not in message
    assert "failed (exit status 3)" in native_build.unavailable_reason()


def test_no_compiler_at_all_says_to_install_one(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    _fresh_state(monkeypatch, tmp_path / "cache", str(tmp_path / "bin"))
    with pytest.warns(RuntimeWarning, match="no C compiler on PATH.*Install gcc"):
        assert not native_build.available()
