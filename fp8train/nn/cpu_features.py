"""What this CPU offers fp8train's emulated GEMMs: bf16 GEMM instructions or not, from /proc/cpuinfo's flags.

Read once at import (file I/O stays out of the hot path and out of traced code). ``emulated_dtype: auto``
resolves to bf16 where the instructions exist (fp8train.nn.gemm_choice.emulated_compute_dtype).
"""

from __future__ import annotations

from fp8train.numerics import native_cast

__all__ = ["cpu_has_bf16_gemm", "set_cpu_bf16_gemm"]


def _bf16_gemm_in_cpuinfo(lines) -> bool:
    """Whether /proc/cpuinfo's text (an iterable of its lines) lists bf16 GEMM instructions (avx512_bf16 or
    amx_bf16) in its first `flags` line."""
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _read_cpu_bf16_flags(path: str = "/proc/cpuinfo") -> bool:
    try:
        with open(path) as f:
            return _bf16_gemm_in_cpuinfo(f)
    except OSError:
        return False


_CPU_HAS_BF16_GEMM = _read_cpu_bf16_flags()  # read once at import (also keeps file I/O out of traced code)
_cpu_bf16_gemm_override: bool | None = None


def cpu_has_bf16_gemm() -> bool:
    """True when this CPU has bf16 GEMM instructions (avx512_bf16 or AMX-BF16), per /proc/cpuinfo's flags, unless
    `set_cpu_bf16_gemm` said otherwise for this process."""
    return _CPU_HAS_BF16_GEMM if _cpu_bf16_gemm_override is None else _cpu_bf16_gemm_override


def set_cpu_bf16_gemm(enabled: bool | None) -> None:
    """Resolve `emulated_dtype: auto` on CPU as if this CPU had (True) or lacked (False) bf16 GEMM instructions;
    None goes back to /proc/cpuinfo. Either path runs on any x86-64 CPU (bf16 GEMMs are only slower without the
    instructions), so a suite can be run under both on one machine. Set it before building layers: a layer's
    cached weight copy keeps the dtype it was made in until the weight changes."""
    global _cpu_bf16_gemm_override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_cpu_bf16_gemm takes True, False or None; got {enabled!r}")
    _cpu_bf16_gemm_override = enabled
    native_cast.note_switch()  # layers resolve their GEMM choices again (nn/linear_dispatch.py)
