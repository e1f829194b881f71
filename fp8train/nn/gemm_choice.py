"""Which GEMM runs, and what its operands keep: the backend, the emulated GEMMs' dtypes, and one decision for the
copy of an operand's values a quantizer writes beside its FP8 bytes.

All of it is decided once per layer, device and dtypes (nn/linear_dispatch.py), not per call; the rules are
the ones nn/gemm.py's module docstring states for each backend and emulated dtype.
"""

from __future__ import annotations

from enum import Enum

import torch

from fp8train.nn.cpu_features import cpu_has_bf16_gemm
from fp8train.nn.recipes import BACKENDS, Fp8Recipe, GemmBackend, OperandRole
from fp8train.nn.scaled_gemm import check_dialect, scaled_mm_available
from fp8train.numerics import native_gemm
from fp8train.numerics.names import Granularity

__all__ = ["GEMM_BACKENDS", "EMULATED_DTYPES", "AUTO_EMULATED_DTYPE", "EMULATED_DTYPE_CHOICES", "Keep",
           "check_emulated_dtype", "emulated_compute_dtype", "gemm_compute_dtype", "operand_keeps",
           "resolve_backend"]

GEMM_BACKENDS = tuple(b for b in BACKENDS if b is not GemmBackend.TE)  # te runs through nn/te.py, not a GEMM here
EMULATED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The default emulated dtype: chosen per device (emulated_compute_dtype). The one spelling of it.
AUTO_EMULATED_DTYPE = "auto"
EMULATED_DTYPE_CHOICES = (AUTO_EMULATED_DTYPE, *EMULATED_DTYPES)


def resolve_backend(backend: str, device: torch.device | str, formats: tuple[str, ...] = ()) -> GemmBackend:
    """'auto' -> 'scaled_mm' or 'emulated' for `device`; a 'scaled_mm' request that cannot run raises.

    `formats` (the recipe's format names) lets a GPU refuse the FP8 dialect it does not implement (FNUZ on OCP
    tensor cores, OCP on MI300) with a clear error instead of a kernel failure."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {backend!r}; allowed: {', '.join(GEMM_BACKENDS)}, te")
    backend = GemmBackend(backend)
    if backend is GemmBackend.AUTO:
        backend = GemmBackend.SCALED_MM if scaled_mm_available(device) else GemmBackend.EMULATED
    if backend is GemmBackend.TE:
        raise ValueError("backend='te' replaces the layer with Transformer Engine's Linear: use "
                         "fp8train.nn.te.make_te_linear(linear, recipe); Fp8Linear runs "
                         "'auto', 'emulated' or 'scaled_mm'")
    if backend is GemmBackend.SCALED_MM:
        if formats:
            check_dialect(formats, device)
        if not scaled_mm_available(device):
            raise RuntimeError(f"backend='scaled_mm' needs a CUDA GPU with compute capability 8.9+ (Ada/Hopper or "
                               f"newer); the tensors are on {torch.device(device)}. Use backend='emulated' (exact "
                               f"FP8 numerics on any device) or backend='auto'.")
    return backend


def check_emulated_dtype(choice: str) -> None:
    """Raise ValueError unless `choice` is one of EMULATED_DTYPE_CHOICES."""
    if choice not in EMULATED_DTYPE_CHOICES:
        raise ValueError(f"emulated_dtype must be one of {', '.join(EMULATED_DTYPE_CHOICES)}; got {choice!r}")


def emulated_compute_dtype(device: torch.device | str, choice: str = AUTO_EMULATED_DTYPE) -> torch.dtype:
    """The emulated GEMMs' input dtype for GEMMs with a bf16 output: `choice` 'fp32' or 'bf16', or 'auto': bf16
    on CUDA (tensor cores, fp32 accumulation) and on CPUs with bf16 GEMM instructions, fp32 on other CPUs (exact,
    and much faster there). GEMMs with an fp32 output always run in fp32 (nn/gemm.py's module docstring)."""
    if choice != AUTO_EMULATED_DTYPE:
        check_emulated_dtype(choice)
        return EMULATED_DTYPES[choice]
    device = torch.device(device)
    return torch.bfloat16 if device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16_gemm()) \
        else torch.float32


def gemm_compute_dtype(compute_dtype: torch.dtype, out_dtype: torch.dtype,
                       device: torch.device | str | None = None) -> torch.dtype:
    """The dtype an emulated GEMM reads its FP8 values in: bf16 when the emulated dtype is bf16 and either the
    GEMM's output is bf16 or its output is fp32 and fp8train's native bf16 -> fp32 GEMM runs on `device`
    (numerics.native_gemm: fp32 sums, fp32 result); else fp32, since a GEMM whose result is kept in fp32 (or
    fp16) must not round its accumulator to 8 bits."""
    if compute_dtype != torch.bfloat16:
        return torch.float32
    if out_dtype == torch.bfloat16:
        return torch.bfloat16
    fp32_from_bf16 = out_dtype == torch.float32 and device is not None and native_gemm.in_use(device)
    return torch.bfloat16 if fp32_from_bf16 else torch.float32


class Keep(Enum):
    """What a quantized operand keeps beside its FP8 bytes and scales: the copy of its values its GEMMs read.
    The value is quantize's ``keep_values`` argument for it."""

    BYTES = False                                     # scaled_mm, or fp8train's native GEMM (it decodes the bytes)
    FP32 = True                                       # fp32 values; block tiles: value * scale in fp32
    BF16 = torch.bfloat16                             # bf16 values, for torch's bf16 GEMM
    FP32_AND_BF16 = (torch.float32, torch.bfloat16)   # both, written in one pass (grad_output read by two GEMMs)


def operand_keeps(backend: GemmBackend, recipe: Fp8Recipe, role: OperandRole, compute_dtype: torch.dtype,
                  out_dtype: torch.dtype, device: torch.device | str, fp32_too: bool = False) -> Keep:
    """What an operand of `role` keeps for an emulated GEMM with output `out_dtype` (`compute_dtype`: the
    layer's emulated dtype, resolved): the one rule behind every quantize of Fp8Linear and the grouped experts.

    - scaled_mm reads the bytes: BYTES.
    - the Hopper accumulation model reads fp32 values (input and grad_output): FP32.
    - block and MX tiles (scales vary along K): BYTES where fp8train's native GEMM reads them and sums each K block
      before applying its tile scales (bf16 emulation where it runs), else FP32 (value * scale; the GEMM runs in
      fp32).
    - the weight (other tiles): FP32, narrowed by the layer to `compute_dtype` (one copy serves both its GEMMs).
    - an fp32 result from bf16 values is the native GEMM's (it reads the bytes): BYTES; a GEMM that reads fp32
      values (gemm_compute_dtype): FP32; torch's bf16 GEMM: BF16, or FP32_AND_BF16 with `fp32_too`
      (grad_output, whose fp32 copy serves grad_weight's fp32 GEMM)."""
    if backend is not GemmBackend.EMULATED:
        return Keep.BYTES
    if role is not OperandRole.WEIGHT and recipe.accumulator_bits:
        return Keep.FP32
    if recipe.granularity_of(role) is Granularity.BLOCK:
        tiles_native = compute_dtype == torch.bfloat16 and native_gemm.in_use(device)
        return Keep.BYTES if tiles_native else Keep.FP32
    if role is OperandRole.WEIGHT:
        return Keep.FP32
    reads = gemm_compute_dtype(compute_dtype, out_dtype, device)
    if reads == torch.float32:
        return Keep.FP32
    if out_dtype == torch.float32:  # (bf16 values for an fp32 result: only where the native GEMM runs)
        return Keep.BYTES
    return Keep.FP32_AND_BF16 if fp32_too else Keep.BF16
