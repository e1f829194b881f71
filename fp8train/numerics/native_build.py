"""Building and loading the native FP8 cast's C library (native_cast.c), once per machine.

On first use the system C compiler (``gcc``, else ``cc``, from PATH) builds the source shipped in the package with
``-O3 -march=native -fopenmp`` (about a second; without ``-fopenmp`` where the compiler lacks it) into
``$XDG_CACHE_HOME/fp8train/native/`` (default ``~/.cache``), under a name keyed by the source's hash, the
compiler's path and version, the flags and the CPU's flags: another CPU, compiler or fp8train version builds its
own, and later processes load the cached library in milliseconds.
A build goes to a temporary file renamed into place, so concurrent processes never load half a library.
Without a compiler, or when the build or load fails, ``available()`` is False, the reason is warned once
(``unavailable_reason()``), and fp8train quantizes with its eager kernel (same bytes, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path
from typing import Optional

__all__ = ["available", "unavailable_reason", "library", "threading_kind", "Params", "COMPILER_NAMES", "SOURCE"]

SOURCE = Path(__file__).with_name("native_cast.c")
COMPILER_NAMES = ("gcc", "cc")
_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-pthread")
# OpenMP first: the kernel's threads are then those of the process's OpenMP runtime (torch's own libgomp.so.1
# where torch uses GNU OpenMP), not threads of its own competing with torch's spinning ones. A compiler without
# OpenMP (a bare clang) builds the pthreads variant instead.
_VARIANTS = (("openmp", ("-fopenmp",)), ("pthreads", ()))
_ABI_VERSION = 3


class Params(ctypes.Structure):
    """fp8_params in native_cast.c (its size is checked against the library's)."""
    _fields_ = [(name, ctypes.c_int32) for name in ("mantissa_bits", "bias", "special", "saturate", "max_is_even",
                                                     "rule", "pow2", "fp32_divide", "mx_emax", "dequantize")] + \
               [("max_bits", ctypes.c_uint32), ("limit_bits", ctypes.c_uint32), ("divisor", ctypes.c_double),
                ("cap", ctypes.c_double), ("tiny", ctypes.c_double), ("lut", ctypes.c_float * 256)]


# ------------------------------------------------------------------------------------------------------------
# Build and load (once per process; the result, good or bad, is kept)
# ------------------------------------------------------------------------------------------------------------
_state: dict = {}  # "lib": the loaded library, or "reason": why there is none


def available() -> bool:
    """Whether the native kernel is built and loaded (builds it on the first call; never raises)."""
    if not _state:
        try:
            _state["lib"] = _load()
        except Exception as err:  # no compiler, a failed build, a library that does not load: use eager
            _state["reason"] = f"{type(err).__name__}: {err}"
            warnings.warn(f"fp8train: the native FP8 cast is unavailable ({_state['reason']}); quantize uses its "
                          "eager kernel (same bytes, slower). Install gcc to enable it.", RuntimeWarning,
                          stacklevel=2)
    return "lib" in _state


def unavailable_reason() -> Optional[str]:
    """Why the native kernel is not in use (None when it is, or before the first ``available()``)."""
    return _state.get("reason")


def library() -> ctypes.CDLL:
    """The loaded library (call ``available()`` first)."""
    return _state["lib"]


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fp8train" / "native"


def _find_compiler() -> str:
    for name in COMPILER_NAMES:
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(f"no C compiler on PATH (looked for {', '.join(COMPILER_NAMES)})")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> ctypes.CDLL:
    compiler = _find_compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), compiler.encode(), version.encode(),
                                     " ".join(_FLAGS).encode(), _cpu_flags().encode(),
                                     platform.machine().encode()])).hexdigest()[:20]
    paths = {name: _cache_dir() / f"native_cast-{key}-{name}.so" for name, _ in _VARIANTS}
    path = next((p for p in paths.values() if p.exists()), None)  # built by an earlier process
    failures = []
    for name, extra in _VARIANTS if path is None else ():
        try:
            path = _build(compiler, (*_FLAGS, *extra), paths[name])
            break
        except RuntimeError as err:
            failures.append(f"{name}: {err}")
    if path is None:
        raise RuntimeError("; ".join(failures))
    lib = ctypes.CDLL(str(path))
    if lib.fp8_abi_version() != _ABI_VERSION or lib.fp8_params_size() != ctypes.sizeof(Params):
        raise RuntimeError(f"{path} does not match this fp8train (ABI {lib.fp8_abi_version()})")
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    lib.fp8_quantize.argtypes = [ctypes.POINTER(Params), ptr, i32, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr,
                                 ptr, i32]
    lib.fp8_quantize.restype = ctypes.c_int
    lib.fp8_decode.argtypes = [ptr, ptr, i64, ptr, i32, i32]
    lib.fp8_decode.restype = ctypes.c_int
    lib.fp8_dequantize.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, ptr, ptr, i32]
    lib.fp8_dequantize.restype = ctypes.c_int
    return lib


def _build(compiler: str, flags: tuple, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # concurrent builders each rename a whole file
    try:
        done = subprocess.run([compiler, *flags, "-o", str(tmp), str(SOURCE), "-lm"], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[:400]}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def threading_kind() -> str:
    """How the loaded library runs its threads: "openmp" (the process's OpenMP runtime) or "pthreads"."""
    return "openmp" if library().fp8_uses_openmp() else "pthreads"
