"""Which quantize kernel is fastest here: measured once per machine and torch version, then read from a cache.

All kernels of `quant.QUANT_KERNELS` give the same bytes (the tests check each against ml_dtypes); which is
fastest depends on the machine: inductor vectorizes the float8 cast on avx512 CPUs and GPUs but leaves it a
scalar routine on avx2-only CPUs, where the compare-and-select kernel or the eager path can win. So
`resolve_kernel("auto", device)` quantizes a 4M-element tensor with each kernel (the compiled ones after their
one-time compile, which is not timed), keeps only kernels whose bytes equal the eager kernel's, and picks the
fastest median. The answer is cached in ``<cache dir>/quant_kernel.json`` keyed by machine (CPU model, flags,
cores; or GPU name) and torch version, so later runs read it in microseconds. `resolve_kernel(kernel)` with a
concrete kernel name returns it unchanged (the override, e.g. ``fp8.quantize_kernel: eager``).

On a CPU where fp8train's C kernel builds (``native``, numerics/native_cast.py) 'auto' is ``native`` without
measuring: it is bit-exact, needs no torch.compile, and beat every torch kernel on each CPU measured
(docs/benchmarks.md); the probe is for GPUs and for CPUs without a C compiler.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from fp8train.numerics import native_cast
from fp8train.numerics.quant import QUANT_KERNELS, quantize

__all__ = ["KERNEL_CHOICES", "DEFAULT_QUANTIZE_KERNEL", "resolve_kernel", "probe_kernels", "machine_key",
           "default_cache_path"]

KERNEL_CHOICES = ("auto",) + QUANT_KERNELS
# Fp8Linear's, configure_execution's and fp8.quantize_kernel's default: native on a CPU where the C kernel
# builds, else measured once per machine (tensors under Fp8Linear's QUANT_KERNEL_MIN_NUMEL always run eagerly).
DEFAULT_QUANTIZE_KERNEL = KERNEL_CHOICES[0]
PROBE_NUMEL = 1 << 22
_resolved: dict = {}  # per process: (device type, cache path) -> kernel


def default_cache_path() -> Path:
    """``$XDG_CACHE_HOME/fp8train/quant_kernel.json`` (default ``~/.cache``); read once per process."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "fp8train" / "quant_kernel.json"


def machine_key(device: torch.device | str) -> str:
    """What the measurement depends on: the processor (model, flags, cores) or GPU, and the torch version."""
    device = torch.device(device)
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        model, flags = platform.processor() or platform.machine(), ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name") and ":" in line:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = line.split(":", 1)[1].strip()
        except OSError:
            pass
        digest = hashlib.sha256(flags.encode()).hexdigest()[:12]
        hardware = f"{model} ({os.cpu_count()} cores, flags {digest}, {torch.get_num_threads()} threads)"
    return f"{device.type}: {hardware}; torch {torch.__version__}"


def resolve_kernel(kernel: str, device: torch.device | str = "cpu", cache_path: Path | None = None,
                   log=None) -> str:
    """A concrete kernel name for `kernel` (one of KERNEL_CHOICES); 'auto' probes once, then reads the cache."""
    if kernel not in KERNEL_CHOICES:
        raise ValueError(f"quantize kernel must be one of {', '.join(KERNEL_CHOICES)}; got {kernel!r}")
    if kernel != "auto":
        return kernel
    device = torch.device(device)
    if device.type == "cpu" and native_cast.available():
        return "native"  # bit-exact, no compile, and faster than every torch kernel on the CPUs measured
    path = Path(cache_path) if cache_path is not None else default_cache_path()
    key = machine_key(device)
    if (key, str(path)) in _resolved:
        return _resolved[(key, str(path))]
    cache = _read_cache(path)
    entry = cache.get(key)
    if not (isinstance(entry, dict) and entry.get("kernel") in QUANT_KERNELS):
        if log is not None:
            log(f"measuring the quantize kernels once for this machine ({key}); cached in {path}")
        entry = probe_kernels(device)
        cache[key] = entry
        _write_cache(path, cache)
    _resolved[(key, str(path))] = entry["kernel"]
    return entry["kernel"]


def probe_kernels(device: torch.device | str = "cpu", numel: int = PROBE_NUMEL, repeats: int = 5) -> dict:
    """{'kernel': fastest bit-exact kernel, 'gelem_per_s': {kernel: G elements/s or None if not exact/failed}}.

    Timed like Fp8Linear uses it: tensorwise e4m3fn with the FP8 values kept for the GEMM."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(numel // 1024, 1024, device=device, generator=g) * 3
    reference = quantize(x, "e4m3fn", keep_values=True, kernel="eager")
    speeds: dict[str, float | None] = {}
    for kernel in QUANT_KERNELS:
        if kernel == "native" and not (device.type == "cpu" and native_cast.available()):
            speeds[kernel] = None  # it would run the eager kernel: not a candidate of its own
            continue
        try:
            q = quantize(x, "e4m3fn", keep_values=True, kernel=kernel)  # compiles here, untimed
            exact = torch.equal(q.data.view(torch.uint8), reference.data.view(torch.uint8)) \
                and torch.equal(q.values, reference.values)
        except Exception:  # a machine without a working compiler: that kernel is simply not a candidate
            exact = False
        if not exact:
            speeds[kernel] = None
            continue
        times = []
        for _ in range(repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            quantize(x, "e4m3fn", keep_values=True, kernel=kernel)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        speeds[kernel] = x.numel() / statistics.median(times) / 1e9
    best = max((k for k in speeds if speeds[k] is not None), key=lambda k: speeds[k])
    return {"kernel": best, "gelem_per_s": speeds, "numel": x.numel(), "measured_at": time.time()}


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: measure again (and rewrite it)
    return data if isinstance(data, dict) else {}


def _write_cache(path: Path, cache: dict) -> None:
    """Atomic (temp file + rename); a cache that cannot be written only costs a re-measurement next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass
