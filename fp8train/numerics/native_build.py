"""Building and loading the native FP8 cast's C library (native_cast.c), once per machine.

On first use the system C compiler (``gcc``, else ``cc``, from PATH) builds the source shipped in the package with
``-O3 -march=native -fopenmp`` (about a second; without ``-fopenmp`` where the compiler lacks it) into
``$XDG_CACHE_HOME/fp8train/native/`` (default ``~/.cache``). Later processes load the cached library in
milliseconds. The cache, file by file:

- ``native_cast-<family>-<source>-<variant>.so``: ``family`` hashes what the machine gives (the compiler's resolved
  path, size and mtime, the flags, the CPU's flags), ``source`` what fp8train gives (native_cast.c, the ABI and
  this cache's layout). Another CPU, compiler or fp8train version builds its own. The compiler is identified by
  its file, not by running ``gcc --version``: loading a cached library forks nothing.
- ``<library>.json`` beside it: its size and sha256, written at build. A library is loaded only after its bytes
  match that record: a truncated or altered file (a full disk, a copy cut short) would otherwise crash the
  process with SIGBUS inside ``dlopen``; instead it is rebuilt with a one-line warning saying what was wrong.
- ``build.lock``: builders take it (``flock``), so of the ranks or test workers that start at once one compiles
  and the others load its result; a builder that gets the lock first looks again for a good library.
- ``builds.log``: one line per build (when, which process, which file, how long).
- ``<library stem>.failed.json``: a build that did not finish within 120 s (a hung compiler) or whose output does
  not load (a compiler that writes garbage and exits 0). Later processes of the same compiler and
  source use the eager kernel at once, with one warning naming this file, instead of hanging or loading it again;
  deleting it (or another compiler) tries again. A compiler that exits non-zero is not recorded (it fails fast).

The compiler runs in its own process group, killed whole at the time limit. A process that waits for
``build.lock`` longer than 150 s (the build limit and a margin) gives up with a warning naming the
holder (its pid and host, written in the lock file) and uses the eager kernel. A build, or a wait for one, still
going after 5 s says so in one line on stderr (once per process), so that the process does not look hung.

A build is written to a temporary file named by pid and a random suffix, fsync'd with its record, then renamed into
place and the folder fsync'd: a crash leaves either no library or a whole one. Under the lock, builds of this
machine's family for another source (other fp8train versions) unused for a week are deleted, as are temporary
files of builders that died. The week keeps two installed versions used in
turn from deleting each other's library on every start.

Without a compiler, or when the build or load fails, ``available()`` is False, the reason is warned once
(``unavailable_reason()``), and fp8train quantizes with its eager kernel (same bytes, slower). A cache directory
that cannot be made (a file named like a folder of its path, say XDG_CACHE_HOME) is said so, naming it, before any
record in it is looked for: nothing is built, nothing recorded.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import secrets
import shutil
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

from fp8train.numerics import native_build_guard as guard

__all__ = ["available", "unavailable_reason", "library", "threading_kind", "Params", "COMPILER_NAMES", "SOURCES",
           "HEADERS", "cache_dir", "BUILD_LOG"]

# one library from these: the casts (native_cast.c) and the bf16 -> fp32 GEMM (native_gemm.c); the header holds
# what both use (threads, bf16 rounding). Every byte of all three goes into the library's name, so an edit rebuilds it.
SOURCES = (Path(__file__).with_name("native_cast.c"), Path(__file__).with_name("native_gemm.c"))
HEADERS = (Path(__file__).with_name("native_common.h"),)
COMPILER_NAMES = ("gcc", "cc")
BUILD_LOG = "builds.log"
# -ffp-contract=off: every product and sum rounded on its own, as torch's separate ops round them (bit equality)
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")
# OpenMP first: the kernel's threads are then those of the process's OpenMP runtime (torch's own libgomp.so.1
# where torch uses GNU OpenMP), not threads of its own competing with torch's spinning ones. A compiler without
# OpenMP (a bare clang) builds the pthreads variant instead.
_VARIANTS = (("openmp", ("-fopenmp",)), ("pthreads", ()))
# 5: fp8_gemm_bf16; 6: its FP8-byte operands; 7: fp8_quantize records amaxes; 8: shared delayed casts; 9: the update;
# 10: the update reads each row's pending amax where no reduced vector is given
_ABI_VERSION = 10
_CACHE_LAYOUT = 2  # 2: family-source names, a size+sha256 record per library, the build lock
_PRUNE_UNUSED_S = 7 * 24 * 3600  # another version's build, unused this long, is deleted at the next build
_ORPHAN_TMP_S = 600  # a temporary file this old belongs to a builder that died


class Params(ctypes.Structure):
    """fp8_params in native_cast.c (its size is checked against the library's)."""
    _fields_ = [(name, ctypes.c_int32) for name in ("mantissa_bits", "bias", "special", "saturate", "max_is_even",
                                                     "rule", "pow2", "fp32_divide", "mx_emax", "dequantize")] + \
               [("max_bits", ctypes.c_uint32), ("limit_bits", ctypes.c_uint32), ("divisor", ctypes.c_double),
                ("cap", ctypes.c_double), ("tiny", ctypes.c_double), ("lut", ctypes.c_float * 256)]


# ------------------------------------------------------------------------------------------------------------
# The process's state: loaded once (the result, good or bad, is kept), by one thread
# ------------------------------------------------------------------------------------------------------------
_state: dict = {}  # "lib": the loaded library, or "reason": why there is none
_load_lock = threading.Lock()


def _new_lock_in_child() -> None:  # a fork while another thread held the lock must not leave the child blocked
    global _load_lock
    _load_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on the first call; never raises; thread-safe)."""
    if not _state:
        with _load_lock:
            if not _state:  # another thread may have loaded it while this one waited
                result = _load_or_reason()
                if "reason" in result:
                    warnings.warn(f"fp8train: the native FP8 cast is unavailable ({result['reason']}); quantize "
                                  f"uses its eager kernel (same bytes, slower). {result['hint']}", RuntimeWarning,
                                  stacklevel=2)
                _state.update(result)
    return "lib" in _state


def unavailable_reason() -> Optional[str]:
    """Why the native kernel is not in use (None when it is, or before the first ``available()``)."""
    return _state.get("reason")


def library() -> ctypes.CDLL:
    """The loaded library (call ``available()`` first)."""
    return _state["lib"]


def threading_kind() -> str:
    """How the loaded library runs its threads: "openmp" (the process's OpenMP runtime) or "pthreads"."""
    return "openmp" if library().fp8_uses_openmp() else "pthreads"


def cache_dir() -> Path:
    """Where libraries are built: ``$XDG_CACHE_HOME/fp8train/native`` (default ``~/.cache/fp8train/native``)."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fp8train" / "native"


def _load_or_reason() -> dict:
    try:
        compiler = _find_compiler()
    except FileNotFoundError as err:
        return {"reason": f"{type(err).__name__}: {err}", "hint": "Install gcc (or a C compiler named cc) to "
                "enable it."}
    try:
        return {"lib": _load(compiler)}
    except guard.Recorded as err:  # a hung build or one that does not load: later processes do not try it again
        return {"reason": str(err), "hint": "Later processes with this compiler use the eager kernel without "
                "building; delete the .failed.json file named above to try again."}
    except guard.CacheUnusable as err:
        return {"reason": str(err), "hint": "Point XDG_CACHE_HOME at a writable folder to build and cache it."}
    except guard.LockWait as err:
        return {"reason": str(err), "hint": "The next process tries again."}
    except Exception as err:  # a failed build: say what failed, no install advice
        return {"reason": f"{type(err).__name__}: {err}", "hint": "A failed build is not cached: the next process "
                "tries again."}


def _find_compiler() -> str:
    for name in COMPILER_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(f"no C compiler on PATH (looked for {', '.join(COMPILER_NAMES)})")


# ------------------------------------------------------------------------------------------------------------
# Names: what the machine gives (family) and what fp8train gives (source)
# ------------------------------------------------------------------------------------------------------------
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_identity(compiler: str) -> str:
    """The compiler's file (resolved through symlinks such as gcc -> gcc-12) with its size and mtime: an upgrade or
    a switch of alternatives changes it, and reading it forks no ``--version``."""
    real = os.path.realpath(compiler)
    st = os.stat(real)
    return f"{compiler} -> {real} size {st.st_size} mtime_ns {st.st_mtime_ns}"


def _digest(*parts: str | bytes, length: int = 12) -> str:
    return hashlib.sha256(b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)).hexdigest()[:length]


def _library_paths(compiler: str) -> tuple[str, dict]:
    """(family, {variant: path}) of this machine's and this fp8train's library."""
    family = _digest(_compiler_identity(compiler), " ".join(_FLAGS), _cpu_flags(), platform.machine())
    source = _digest(*(path.read_bytes() for path in (*SOURCES, *HEADERS)), str(_ABI_VERSION), str(_CACHE_LAYOUT))
    folder = cache_dir()
    return family, {name: folder / f"native_cast-{family}-{source}-{name}.so" for name, _ in _VARIANTS}


def _record_path(library_path: Path) -> Path:
    return library_path.with_name(library_path.name + ".json")


# ------------------------------------------------------------------------------------------------------------
# Verify, build, prune, load
# ------------------------------------------------------------------------------------------------------------
def _problem(path: Path) -> Optional[str]:
    """None when ``path`` holds the bytes its build recorded (size and sha256), else what is wrong with it."""
    try:
        record = json.loads(_record_path(path).read_text())
        size, digest = int(record["size"]), str(record["sha256"])
    except FileNotFoundError:
        return "no build record beside it"
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"its build record {_record_path(path).name} is unreadable ({type(err).__name__})"
    try:
        data = path.read_bytes()
    except OSError as err:
        return f"unreadable ({err.strerror})"
    if len(data) != size:
        return f"{len(data)} bytes where the build wrote {size}"
    if hashlib.sha256(data).hexdigest() != digest:
        return "its sha256 differs from the one recorded at build"
    return None


def _good_library(paths: dict) -> tuple[Optional[Path], list]:
    """(the first variant whose file checks out, or None; [(path, problem)] of those present that do not)."""
    damaged = []
    for path in paths.values():
        if path.exists():
            problem = _problem(path)
            if problem is None:
                return path, damaged
            damaged.append((path, problem))
    return None, damaged


def _load(compiler: str) -> ctypes.CDLL:
    family, paths = _library_paths(compiler)
    path, _ = _good_library(paths)  # the common case: built by an earlier process, no lock needed
    if path is None:
        folder = _usable_cache_dir()  # before any record is read there: a file in its place is no failed build
        _raise_if_failed_before(paths)
        with guard.build_lock(folder):
            path, damaged = _good_library(paths)  # built by another process while this one waited?
            if path is None:
                _raise_if_failed_before(paths)
                for bad, problem in damaged:
                    warnings.warn(f"fp8train: the cached native library {bad} is damaged ({problem}); rebuilding "
                                  "it", RuntimeWarning, stacklevel=4)
                    bad.unlink(missing_ok=True)
                    _record_path(bad).unlink(missing_ok=True)
                path = _build_a_variant(compiler, paths)
                _prune(folder, family, set(paths.values()))
    try:
        os.utime(_record_path(path))  # "last used", which pruning reads
    except OSError:
        pass  # a read-only cache still loads
    try:
        return _bind(ctypes.CDLL(str(path)), path)
    except (OSError, RuntimeError, AttributeError) as err:  # garbage the compiler wrote, a foreign library
        path.unlink(missing_ok=True)  # not loaded again: the failure record below says why it is gone
        _record_path(path).unlink(missing_ok=True)
        raise guard.record_failure(paths, f"the library {compiler} built does not load ({type(err).__name__}: "
                                     f"{' '.join(str(err).split())[:300]})") from None


def _usable_cache_dir() -> Path:
    """cache_dir(), made if missing; guard.CacheUnusable naming it when it cannot be (a file where a folder of
    its path should be, a read-only or forbidden folder)."""
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker is not None else (err.strerror or str(err))
        raise guard.CacheUnusable(f"the cache directory {folder} is unusable ({why}; it is "
                                  "$XDG_CACHE_HOME/fp8train/native, default ~/.cache)") from None
    return folder


def _raise_if_failed_before(paths: dict) -> None:
    earlier = guard.recorded_failure(paths)
    if earlier is not None:
        raise guard.Recorded(f"an earlier build with this compiler failed ({earlier}); see "
                             f"{guard.failure_path(paths)}")


def _build_a_variant(compiler: str, paths: dict) -> Path:
    started = time.monotonic()
    failures, deadline, slow_at = [], started + guard.BUILD_TIMEOUT_S, started + guard.NOTICE_AFTER_S
    for name, extra in _VARIANTS:
        try:
            return _build(compiler, (*_FLAGS, *extra), paths[name], deadline, slow_at)
        except subprocess.TimeoutExpired:
            raise guard.record_failure(paths, f"the C compiler {compiler} did not finish within "
                                              f"{guard.BUILD_TIMEOUT_S:g} s (killed)") from None
        except RuntimeError as err:
            failures.append(f"{name}: {err}")
    raise RuntimeError("; ".join(failures))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _slow_build_notice(compiler: str) -> None:
    guard.notice_once("build", f"building fp8train's native kernels with {compiler} (once per machine and compiler; "
                               f"up to {guard.BUILD_TIMEOUT_S:g} s, then quantize uses its eager kernels)")


def _build(compiler: str, flags: tuple, path: Path, deadline: float, slow_at: float) -> Path:
    started = time.monotonic()
    unique = f"{os.getpid()}.{secrets.token_hex(4)}"  # pids repeat across containers sharing a cache
    tmp = path.with_name(f".{path.name}.{unique}.tmp")
    record_tmp = path.with_name(f".{path.name}.json.{unique}.tmp")
    try:
        done = guard.compile_in_group([compiler, *flags, "-o", str(tmp), *map(str, SOURCES), "-lm"], deadline,
                                      slow_at, lambda: _slow_build_notice(compiler))
        if done.returncode != 0:
            raise RuntimeError(f"the C compiler {compiler} failed ({guard.exit_status(done.returncode)}): "
                               f"{done.stderr.strip()[:400]}")
        if not tmp.is_file():  # (a wrapper or a stub that reports success and does nothing)
            raise RuntimeError(f"the C compiler {compiler} exited 0 but wrote no library (asked for {tmp.name})")
        data = tmp.read_bytes()
        _fsync(tmp)
        record_tmp.write_text(json.dumps({"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                          "compiler": _compiler_identity(compiler), "flags": list(flags)}))
        _fsync(record_tmp)
        os.replace(record_tmp, _record_path(path))  # the record first: a library is never there without one
        os.replace(tmp, path)
        _fsync(path.parent)  # the renames themselves survive a crash
    finally:
        tmp.unlink(missing_ok=True)
        record_tmp.unlink(missing_ok=True)
    with open(path.parent / BUILD_LOG, "a") as log:
        log.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} pid {os.getpid()} built {path.name} ({len(data)} bytes, "
                  f"{time.monotonic() - started:.1f} s) with {compiler}\n")
    return path


def _prune(folder: Path, family: str, keep: set) -> None:
    """Delete this family's builds for other sources (unused for a week),
    and dead builders' temporary files (called under the build lock, so no builder of this fp8train is writing
    them)."""
    now = time.time()
    ours = set(folder.glob(f"native_cast-{family}-*.so"))
    ours |= {p.with_suffix("") for p in folder.glob(f"native_cast-{family}-*.so.json")}  # records left alone
    for old in ours - keep:
        record = _record_path(old)
        try:
            last_used = max((p.stat().st_mtime for p in (old, record) if p.exists()), default=0.0)
        except OSError:
            continue
        if now - last_used > _PRUNE_UNUSED_S:
            old.unlink(missing_ok=True)
            record.unlink(missing_ok=True)
    for tmp in folder.glob(".native_cast-*.tmp"):
        try:
            if now - tmp.stat().st_mtime > _ORPHAN_TMP_S:
                tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _bind(lib: ctypes.CDLL, path: Path) -> ctypes.CDLL:
    if lib.fp8_abi_version() != _ABI_VERSION or lib.fp8_params_size() != ctypes.sizeof(Params):
        raise RuntimeError(f"{path} does not match this fp8train (ABI {lib.fp8_abi_version()})")
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    lib.fp8_quantize.argtypes = [ctypes.POINTER(Params), ptr, i32, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr,
                                 ptr, ptr, ptr, ptr, i32]
    lib.fp8_quantize.restype = ctypes.c_int
    lib.fp8_decode.argtypes = [ptr, ptr, i64, ptr, i32, i32]
    lib.fp8_decode.restype = ctypes.c_int
    lib.fp8_dequantize.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, i32]
    lib.fp8_dequantize.restype = ctypes.c_int
    lib.fp8_gemm_epilogue.argtypes = [ptr, i64, i64, ptr, i64, ptr, i64, ptr, ptr, i32, i32]
    lib.fp8_gemm_epilogue.restype = ctypes.c_int
    lib.fp8_gemm_bf16.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr, i64, ptr, i64,
                                  ptr, ptr, ptr, i32, i32]
    lib.fp8_gemm_bf16.restype = ctypes.c_int
    lib.fp8_gemm_vectorized.restype = ctypes.c_int
    lib.fp8_share_delayed_cast.argtypes = [ptr, ptr, ptr, ptr, ptr]
    lib.fp8_share_delayed_cast.restype = ctypes.c_int
    lib.fp8_delayed_update.argtypes = [i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i32, i32,
                                       ctypes.c_float, ptr]
    lib.fp8_delayed_update.restype = ctypes.c_int
    return lib
