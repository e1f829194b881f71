"""The `scaled_mm` GEMM backend: FP8 tensor-core GEMMs through torch's scaled matmul.

Which kernel takes a (M, K) @ b (K, N) and with which arguments is planned by a pure function
(fp8train.nn.scaled_mm_rules: the kinds, their scale layouts and the CUDA rules that decide them); this module
runs the plan on the device, remembers what the device refused, and falls back where nothing takes the operands.

A fallback dequantizes both operands and runs a bf16 GEMM with fp32 accumulation (fp32 on CPU): what the tensor
core computes, up to accumulation order, but not FP8 speed. Every call can report which path it took (`record`:
'scaled_mm:<kind>' or 'fallback:<reason>'), so telemetry and the bench say per GEMM whether it ran FP8.

`target_gpu(capability)` plans every scaled_mm GEMM for a GPU that is not here (e.g. (9, 0) for H100, (10, 0) for
B200) without running a kernel: `record` then says which kernel each GEMM would reach there, or why it would fall
back, and the result is computed by the fallback, rounded as that GPU's kernel rounds it (rowwise on sm89 / sm100
returns bf16 for an fp32 request), so a whole forward and backward can be planned and its numerics modelled on a
CPU.

Kernel quirks handled by retrying a smaller request once per configuration and shape (and remembering the
answer): some torch builds give rowwise/blockwise kernels a bf16 output only, and none fuses a bias into an fp32
output. What torch raises for an unsupported request: ValueError (TORCH_CHECK_VALUE: bad scale shapes, CPU
blockwise), RuntimeError (TORCH_CHECK, cuBLAS NOT_SUPPORTED for one shape), NotImplementedError (missing kernels);
out-of-memory is re-raised, never hidden.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from fp8train.nn.scaled_mm_rules import (HAS_SCALED_MM_V2, SCALED_MM_KINDS, ScaledMmCall, scaled_mm_call,
                                        scaled_mm_arguments, scaled_mm_kind)
from fp8train.numerics import native_cast

__all__ = ["scaled_mm_kind", "scaled_mm_arguments", "scaled_mm_gemm", "scaled_mm_available", "fp8_dialect_of",
           "HAS_SCALED_MM_V2", "SCALED_MM_KINDS", "check_dialect", "call_scaled_mm", "scaled_mm_call",
           "ScaledMmCall", "target_gpu", "device_capability", "planning_for_gpu"]

_KERNEL_ERRORS = (RuntimeError, ValueError, NotImplementedError)
# (device type, capability, kind, dtypes, (M, K, N), out dtype, bias fused, fast accum) -> None (works) or why not:
# cuBLAS can refuse one shape (NOT_SUPPORTED from its heuristics) and take the next, so the shape is in the key.
_kernel_answers: dict = {}
_targets: list = []  # innermost last: [(capability, plans list or None)] set by target_gpu


# ------------------------------------------------------------------------------------------------------------
# Which device, which dialect
# ------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def scaled_mm_available(device: torch.device | str) -> bool:
    """True on a CUDA device of compute capability 8.9+ (Ada, Hopper, Blackwell) whose torch has _scaled_mm, and
    on any device while `target_gpu` plans for one."""
    if _targets:
        return True
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


def planning_for_gpu() -> tuple[tuple[int, int], list | None] | None:
    """(capability, plans list or None) of the innermost `target_gpu`, or None outside one: a grouped GEMM
    (nn/experts_scaled_gemm.py) then appends its planned call and computes with the fallback, as scaled_mm_gemm
    does."""
    return _targets[-1] if _targets else None


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """The (major, minor) the plan is made for: `target_gpu`'s, a CUDA device's own, else None (the device's
    kernels decide alone, as on CPU)."""
    if _targets:
        return _targets[-1][0]
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip:
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@contextlib.contextmanager
def target_gpu(capability: tuple[int, int], plans: list | None = None):
    """Plan every scaled_mm GEMM inside for a GPU of `capability` (e.g. (9, 0)), run no FP8 kernel: `record`
    says which kernel each GEMM would reach there or why it would fall back, `plans` (when given) collects
    (gemm name, ScaledMmCall), and results come from the dequantized fallback."""
    capability = tuple(int(c) for c in capability)
    if len(capability) != 2 or capability < (8, 9):
        raise ValueError(f"target_gpu needs an FP8 GPU's compute capability (major, minor) >= (8, 9), e.g. "
                         f"(9, 0); got {capability!r}")
    _targets.append((capability, plans))
    native_cast.note_switch()  # 'auto' backends resolve to scaled_mm now (layers resolved theirs once)
    try:
        yield
    finally:
        _targets.pop()
        native_cast.note_switch()


@functools.lru_cache(maxsize=None)
def fp8_dialect_of(device_type: str, index: int = 0) -> str:
    """'fnuz' on AMD MI300-class GPUs (gfx94x: FNUZ FP8 only), 'ocp' on every other FP8 GPU."""
    if device_type == "cuda" and torch.version.hip and torch.cuda.is_available():
        arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
        return "fnuz" if arch.startswith("gfx94") else "ocp"
    return "ocp"


def check_dialect(format_names, device: torch.device | str) -> None:
    """Refuse FP8 formats that this GPU's tensor cores do not implement (FNUZ on OCP hardware and back)."""
    device = torch.device(device)
    fnuz = any(name.endswith("fnuz") for name in format_names)
    dialect = fp8_dialect_of(device.type, device.index or 0)
    if fnuz and dialect == "ocp":
        raise ValueError(f"formats {'/'.join(format_names)} are FNUZ (AMD MI300): this GPU's FP8 tensor cores use "
                         f"OCP formats; use e4m3fn/e5m2, or backend='emulated' to study FNUZ numerics")
    if not fnuz and dialect == "fnuz":
        raise ValueError(f"formats {'/'.join(format_names)} are OCP: this GPU (MI300) has FNUZ FP8 tensor cores; "
                         f"use e4m3fnuz/e5m2fnuz, or backend='emulated'")


# ------------------------------------------------------------------------------------------------------------
# The call
# ------------------------------------------------------------------------------------------------------------
def call_scaled_mm(args: dict, out_dtype: torch.dtype, bias: torch.Tensor | None, fast_accum: bool):
    """One scaled-matmul call with arguments from `scaled_mm_arguments` (F.scaled_mm where torch has it)."""
    if HAS_SCALED_MM_V2:
        swizzle = getattr(F.SwizzleType, args["swizzle"]) if args.get("swizzle") else None
        return F.scaled_mm(args["mat_a"], args["mat_b"], args["scale_a"], getattr(F.ScalingType, args["recipe_a"]),
                           args["scale_b"], getattr(F.ScalingType, args["recipe_b"]), swizzle_a=swizzle,
                           swizzle_b=swizzle, bias=bias, output_dtype=out_dtype, use_fast_accum=fast_accum)
    # torch's FP8 GEMM: no public name on the torch versions without scaled_mm_v2 (the branch above)
    return torch._scaled_mm(args["mat_a"], args["mat_b"], args["scale_a"], args["scale_b"], bias=bias,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


# ------------------------------------------------------------------------------------------------------------
# The GEMM
# ------------------------------------------------------------------------------------------------------------
def scaled_mm_gemm(a, b, *, out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None,
                   use_fast_accum: bool = False, record: dict | None = None, gemm: str = "") -> torch.Tensor:
    """`dequant(a) @ dequant(b) (+ bias)` in `out_dtype` on the FP8 kernel where one takes the operands.

    `record[gemm]` (when given) is set to 'scaled_mm:<kind>' or 'fallback:<reason>'."""
    capability = device_capability(a.data.device)
    call = scaled_mm_call(a, b, out_dtype=out_dtype, bias=bias, use_fast_accum=use_fast_accum,
                          capability=capability)
    if _targets:  # planning for a GPU that is not here: say what would run, compute with the fallback
        if _targets[-1][1] is not None:
            _targets[-1][1].append((gemm, call))
        if record is not None:
            record[gemm] = f"scaled_mm:{call.kind}" if call.kind else f"fallback:{call.reason}"
        out = _dequantized_gemm(a, b, out_dtype, bias)
        # the device's own rounding: a kernel that returns bf16 for an fp32 request (CUTLASS rowwise) is modelled
        return out.to(call.rounds_to).to(out_dtype) if call.kind and call.rounds_to != out_dtype else out
    out, reason = _run_call(call, a, b, out_dtype, bias, capability) if call.kind else (None, call.reason)
    if record is not None:
        record[gemm] = f"scaled_mm:{call.kind}" if out is not None else f"fallback:{reason}"
    return out if out is not None else _dequantized_gemm(a, b, out_dtype, bias)


def _run_call(call: ScaledMmCall, a, b, out_dtype, bias, capability):
    """(result, '') from the first request the device takes, else (None, the last refusal)."""
    reason = ""
    for request_dtype, fuse_bias in call.requests:
        key = (a.data.device.type, capability, call.kind, a.data.dtype, b.data.dtype, call.shape, request_dtype,
               fuse_bias, call.fast_accum)
        if _kernel_answers.get(key) is not None:
            reason = _kernel_answers[key]
            continue
        fused_bias = bias.to(request_dtype) if fuse_bias else None
        try:
            out = call_scaled_mm(call.args, request_dtype, fused_bias, call.fast_accum)
        except torch.OutOfMemoryError:
            raise
        except _KERNEL_ERRORS as err:  # remember, so later steps do not pay for the exception
            reason = _kernel_answers[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            continue
        _kernel_answers[key] = None
        if bias is not None and not fuse_bias:
            out = out + bias.to(out.dtype)
        return (out if out.dtype == out_dtype else out.to(out_dtype)), ""
    return None, reason


def _dequantized_gemm(a, b, out_dtype: torch.dtype, bias) -> torch.Tensor:
    """Fallback: dequantize, bf16 GEMM with fp32 accumulation on CUDA (fp32 elsewhere), in `out_dtype`."""
    cuda = a.data.is_cuda
    compute = torch.bfloat16 if cuda else torch.float32
    a_hp, b_hp = a.dequantize(compute), b.dequantize(compute)
    if cuda and out_dtype == torch.float32:
        try:  # torch >= 2.8 returns the fp32 accumulator of a bf16 GEMM without rounding it to bf16
            out = torch.mm(a_hp, b_hp, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            out = torch.mm(a_hp, b_hp).float()
    else:
        out = torch.mm(a_hp, b_hp)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out if out.dtype == out_dtype else out.to(out_dtype)
