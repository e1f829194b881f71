"""The timing harness of ``fp8train bench``: paired, interleaved rounds, medians and paired ratios; the machine
description printed beside every figure (CPU model, the flags that decide the fast paths, the emulated GEMMs'
compute dtype); the glibc allocator setting; and a count of top-level aten ops (what each layer launches).
"""

from __future__ import annotations

import ctypes
import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from fp8train.nn.gemm import cpu_has_bf16_gemm, emulated_compute_dtype
from fp8train.numerics import native_gemm

__all__ = ["Timing", "side_by_side", "paired_ratio", "machine_info", "enable_malloc_reuse", "count_top_level_ops",
           "count_input_reads", "cpu_flags_summary", "free_port"]

FLAGS_OF_INTEREST = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
OP_NAMESPACES = ("aten::", "fp8train::")  # what count_top_level_ops counts as one dispatched op


def free_port() -> int:
    """A TCP port free on this machine now, for spawned ranks' rendezvous (the distributed sections)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags_summary() -> str:
    """The CPU flags that decide fp8train's fast paths, present or absent, e.g. 'avx2 fma, no avx512f ...'."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("flags")), [])
    except OSError:
        flags = []
    have = [f for f in FLAGS_OF_INTEREST if f in flags]
    missing = [f for f in FLAGS_OF_INTEREST if f not in flags]
    return " ".join(have) + (", no " + " ".join(missing) if missing else "")


def machine_info(device: str) -> dict:
    info = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "device": device, "torchao": _torchao_version(), "cpu_flags": cpu_flags_summary(),
        "cpu_bf16_gemm": cpu_has_bf16_gemm(),
        "emulated_dtype": str(emulated_compute_dtype(device)).replace("torch.", ""),
        # fp32-result and K-tiled emulated GEMMs: fp8train's native bf16 -> fp32 GEMM, or torch's fp32 GEMM
        "native_bf16_gemm": native_gemm.in_use(device) and emulated_compute_dtype(device) == torch.bfloat16,
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    gpu_memory_gb=round(props.total_memory / 2**30, 1))
    return info


def _torchao_version() -> Optional[str]:
    try:
        import importlib.metadata as md
        return md.version("torchao")
    except Exception:
        return None


def enable_malloc_reuse() -> bool:
    """Ask glibc to keep freed memory in the heap (no mmap for big blocks, no trimming), so a repeated run reuses
    pages instead of page-faulting fresh ones. True when glibc accepted it."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1  # big blocks come from the heap too, so they are kept and reused
    ok &= libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1
    ok &= libc.mallopt(M_TRIM_THRESHOLD, -1) == 1  # never give freed heap memory back
    return bool(ok)


@dataclass
class Timing:
    """Seconds per call over the timed rounds."""

    times: list

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def summary(self) -> dict:
        q1, _, q3 = quartiles(self.times)
        return {"median_s": self.median, "min_s": min(self.times), "max_s": max(self.times), "q1_s": q1,
                "q3_s": q3, "repeats": len(self.times)}


def quartiles(values: list) -> tuple[float, float, float]:
    if len(values) < 2:
        v = values[0]
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable, device: str) -> float:
    if device == "cuda":  # CUDA events: GPU time of the call, launched after everything before it finished
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(contenders: dict, device: str, warmup: int, repeats: int,
                 first_call: Optional[dict] = None) -> dict:
    """Time every contender (name -> zero-arg callable) ``repeats`` times, interleaved round by round, after
    ``warmup`` untimed calls each. ``first_call`` (a dict) receives each contender's first-call seconds (that
    is where a torch.compile happens), so the caller can report compile time apart from the timing."""
    for name, fn in contenders.items():
        seconds = time_call(fn, device)
        if first_call is not None:
            first_call[name] = seconds
        for _ in range(max(warmup - 1, 0)):
            fn()
        sync(device)
    times = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            times[name].append(time_call(fn, device))
    return {name: Timing(t) for name, t in times.items()}


def paired_ratio(timing: Timing, base: Optional[Timing]) -> dict:
    """Time ratio to the baseline: median and IQR of the per-round (paired) ratios. Pairing cancels load that
    drifts between rounds, which the ratio of the two medians would not."""
    if base is None:
        return {"ratio": None, "ratio_q1": None, "ratio_q3": None}
    paired = [a / b for a, b in zip(timing.times, base.times)]
    q1, median, q3 = quartiles(paired)
    return {"ratio": median, "ratio_q1": q1, "ratio_q3": q3}


def count_top_level_ops(fn: Callable) -> int:
    """aten (and fp8train::) ops that `fn` dispatches from Python (ops nested inside another not counted), by
    torch.profiler on CPU: what a GPU would see as launches, and what costs ~5-20 us each eagerly on a CPU."""
    from torch.profiler import ProfilerActivity, profile  # the profiler is heavy to import; only this uses it

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def is_op(event) -> bool:  # torch's ops and fp8train's own (native_cast: one op each, like an aten op)
        return event.name.startswith(OP_NAMESPACES)

    def nested(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if is_op(parent):
                return True
            parent = parent.cpu_parent
        return False

    return sum(1 for e in prof.events() if is_op(e) and not nested(e))


def count_input_reads(fn: Callable, source: torch.Tensor) -> int:
    """How many ops that `fn` dispatches read `source` (any view of its storage): the passes over that tensor,
    e.g. 1 for a cast that takes the amax in the same pass, 2 for an amax op and then a cast. Counted below
    autograd and autocast (TorchDispatchMode: the ops as they reach the kernels), by storage, not by name."""
    from torch.utils._python_dispatch import TorchDispatchMode

    storage = source.untyped_storage().data_ptr()
    reads = [0]

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            flat = list(args) + list((kwargs or {}).values())
            flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
            if not func.is_view and any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage
                                        for t in flat):  # (a view reads no data)
                reads[0] += 1
            return func(*args, **(kwargs or {}))

    with Reads():
        fn()
    return reads[0]

