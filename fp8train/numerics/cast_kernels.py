"""Which quantize kernel runs: the names, the check, and the one rule that resolves 'auto'.

Three kernels, all bit-identical (each checked against ml_dtypes by the tests):

- ``eager``: torch ops one by one, torch's own float8 cast; the reference, and what any case the others do not
  take runs.
- ``native``: fp8train's C kernel (numerics/native_cast.c) for fp32/bf16 CPU tensors: amax, scale and cast in
  one op, one read of the tensor per tile row (and, with a known scale, the amax recorded in the same pass).
- ``compiled``: the eager chain through torch.compile, for devices without the native kernel (the GPU). On the
  CPUs measured (docs/benchmarks.md) it ran at a fifth of the native kernel's speed or less, so 'auto' never picks it
  there; the compare-and-select CPU variant and the per-machine speed probe that chose between four kernels were
  removed with it.

'auto' (the default of Fp8Linear, ``configure_execution`` and the config key ``fp8.quantize_kernel``) is
``native`` on a CPU where the C kernel builds, ``compiled`` on a GPU, ``eager`` otherwise.
"""

from __future__ import annotations

import torch

from fp8train.numerics.names import QuantizeKernel

__all__ = ["EAGER", "NATIVE", "COMPILED", "AUTO_KERNEL", "QUANT_KERNELS", "KERNEL_CHOICES", "DEFAULT_QUANTIZE_KERNEL",
           "check_kernel", "resolve_kernel"]

EAGER, NATIVE, COMPILED = QuantizeKernel.EAGER, QuantizeKernel.NATIVE, QuantizeKernel.COMPILED
QUANT_KERNELS = tuple(QuantizeKernel)
AUTO_KERNEL = "auto"  # resolved per device by resolve_kernel (not a kernel itself)
KERNEL_CHOICES = (AUTO_KERNEL,) + QUANT_KERNELS
_MERGED_KERNELS = ("compiled_cast", "compiled_select")  # earlier names of 'compiled', named in the error
DEFAULT_QUANTIZE_KERNEL = KERNEL_CHOICES[0]


def check_kernel(kernel, allowed: tuple = QUANT_KERNELS, key: str = "kernel") -> str:
    """``kernel`` when it is one of ``allowed``, else a ValueError naming ``key``, the value and the choices (the
    removed 'compiled_cast' and 'compiled_select' are named as such: 'compiled' replaces both)."""
    if kernel in allowed:
        return kernel
    hint = " ('compiled_cast' and 'compiled_select' were merged into 'compiled')" \
        if kernel in _MERGED_KERNELS else ""
    raise ValueError(f"{key} must be one of {', '.join(allowed)}; got {kernel!r}{hint}")


def resolve_kernel(kernel: str, device: torch.device | str = "cpu", native_available: bool = False) -> str:
    """A concrete kernel for ``kernel`` (one of KERNEL_CHOICES) on ``device``: a concrete name is returned as it
    is; 'auto' is native on a CPU where the C kernel is available (``native_available``), compiled on CUDA,
    else eager."""
    check_kernel(kernel, KERNEL_CHOICES, "quantize kernel")
    if kernel != AUTO_KERNEL:
        return QuantizeKernel(kernel)
    device_type = torch.device(device).type
    if device_type == "cpu":
        return NATIVE if native_available else EAGER
    return COMPILED if device_type == "cuda" else EAGER
