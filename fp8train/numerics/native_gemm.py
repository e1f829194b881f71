"""fp8train's native bf16 x bf16 -> fp32 GEMM (native_gemm.c), built into the native kernels' library.

Why: an emulated FP8 GEMM whose result is fp32 (grad_weight for fp32 master weights) must sum the exact products
of FP8 values in fp32 and keep all 24 bits. torch 2.13's CPU GEMMs either read fp32 (4x slower than bf16 on a CPU
with AVX512-BF16) or round a bf16 GEMM's result to bf16 (aten::mm.dtype, which would keep fp32, is CUDA-only).
This kernel reads the FP8 values in bf16 (exact), multiplies them exactly and sums in fp32 with VDPBF16PS, and
writes fp32: the arithmetic of an fp32 GEMM on the same values, summed in another order.

An operand may also be FP8 bytes (a torch float8 tensor of one of fp8train's formats): the kernel reads each
byte through a 256-entry table of its bf16 value while packing, so an FP8 operand needs no decoded copy in
memory (the saved input of a backward GEMM, an operand no bf16 GEMM reads).

``fp8train::gemm_bf16`` (``mm`` here) is one op (one entry in a profile, traceable by torch.compile through its
fake impl). With K-block scales it also applies scales that vary along K (block and MX tiles): each K block's
fp32 partial sum is multiplied by the row's scale, then by the column's, and added. Its epilogue takes the outer
scales (per tensor, row or column), the bias and the rounding to a bf16 output: the same fp32 operations in the
same order as the torch ops an emulated GEMM would run after it.

Where it runs (``fast()``): a CPU whose library was built with AVX512-BF16 (``-march=native`` on such a CPU).
Elsewhere the same loops run in plain C (correct and slow): ``set_mode("on")`` uses it anyway (to test that path
on any CPU), ``"off"`` never, ``"auto"`` (the default) where it is fast.
"""

from __future__ import annotations

from typing import Optional

import torch

from fp8train.numerics import native_build, native_cast
from fp8train.numerics.formats import FORMATS
from fp8train.numerics.native_call import plain_call
from fp8train.numerics.native_layout import scale_step

__all__ = ["MODES", "set_mode", "mode", "fast", "in_use", "usable", "mm"]

MODES = ("auto", "on", "off")
_mode = "auto"
_vectorized: Optional[bool] = None  # whether the loaded library has the AVX512-BF16 loop

# VDPBF16PS reads a bf16 input below 2^-126 as zero and flushes a result there to zero; an FP8 value (never
# below 2^-16 in magnitude unless zero) and the product of two (>= 2^-32) never come near, so the emulated
# GEMMs hand this kernel FP8 values, and K-varying scales are applied to fp32 partial sums, never to inputs.


def set_mode(choice: str) -> None:
    """'auto' (use the kernel where it is fast), 'on' (wherever the native library loads: on a CPU without
    AVX512-BF16 its plain C loop, slow; a switch for testing that path), or 'off' (the fp32 GEMM, as before)."""
    global _mode
    if choice not in MODES:
        raise ValueError(f"native GEMM mode must be one of {', '.join(MODES)}; got {choice!r}")
    _mode = choice
    native_cast.note_switch()


def mode() -> str:
    return _mode


def fast() -> bool:
    """True when the native library is built here with its AVX512-BF16 loop (and not switched off by
    native_cast.set_enabled(False), which stands for a machine without a C compiler)."""
    global _vectorized
    if not native_cast.available():
        return False
    if _vectorized is None:  # asked on every emulated GEMM: the library is asked once
        _vectorized = bool(native_build.library().fp8_gemm_vectorized())
    return _vectorized


def in_use(device: torch.device | str) -> bool:
    """Whether emulated GEMMs with an fp32 result on `device` read bf16 values through this kernel."""
    if (device.type if isinstance(device, torch.device) else torch.device(device).type) != "cpu" \
            or _mode == "off" or torch.compiler.is_compiling() or not native_cast.available():
        return False
    if _mode == "on" or _vectorized:
        return True
    return fast()  # (asks the library once)


_FP8_DTYPES = {fmt.torch_dtype: name for name, fmt in FORMATS.items()}
_GEMM_DTYPES = (torch.bfloat16, *_FP8_DTYPES)  # what an operand may be: bf16 values or FP8 bytes
_tables: dict = {}


def _bf16_table(dtype: torch.dtype) -> torch.Tensor:
    """bf16 value of each of the 256 codes of FP8 dtype `dtype` (exact: FP8 values fit bf16's 8 bits), from
    torch's own float8 -> bf16 conversion."""
    table = _tables.get(dtype)
    if table is None:
        table = _tables[dtype] = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.bfloat16)
    return table


def usable(a: torch.Tensor, b: torch.Tensor, scale_a=None, scale_b=None, bias=None,
           out_dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``mm`` takes these: 2-D CPU tensors, each bf16 or FP8 (a dtype of one of fp8train's formats),
    with matching inner dims (any strides); outer scales that are one fp32 value, one per row (scale_a) or one
    per column (scale_b); an fp32 bias per column; an fp32 or bf16 output."""
    return _outer_steps(a, b, scale_a, scale_b, bias, out_dtype) is not None


def _outer_steps(a, b, scale_a, scale_b, bias, out_dtype) -> Optional[tuple[int, int]]:
    """How the C loop reads scale_a and scale_b (native_layout.scale_step), or None where ``mm`` does not take
    these operands (``usable``)."""
    if not (a.dim() == 2 and b.dim() == 2 and a.dtype in _GEMM_DTYPES and b.dtype in _GEMM_DTYPES
            and a.is_cpu and b.is_cpu and a.shape[1] == b.shape[0] and a.numel() > 0 and b.numel() > 0):
        return None
    if out_dtype not in (torch.float32, torch.bfloat16):
        return None
    for t in (scale_a, scale_b, bias):  # (a loop, not a generator: this runs on every emulated GEMM)
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
            return None
    if bias is not None and (tuple(bias.shape) != (b.shape[1],) or not bias.is_contiguous()):
        return None
    step_a, step_b = scale_step(scale_a, 0, a.shape[0]), scale_step(scale_b, 1, b.shape[1])
    return None if step_a is None or step_b is None else (step_a, step_b)


def mm(a: torch.Tensor, b: torch.Tensor, k_scales: Optional[tuple] = None, *, scale_a=None, scale_b=None,
       bias=None, out_dtype: torch.dtype = torch.float32, plain: bool = False,
       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``((a @ b) * scale_a) * scale_b + bias`` in `out_dtype` (fp32 or bf16) from a (M, K), b (K, N), each bf16 or
    FP8 bytes (their values, exact in bf16):
    the sum in fp32 (check ``usable`` first), each later step an fp32 operation, one rounding to bf16 at the end.
    ``k_scales`` = (kscale_a (M, ceil(K / k_block)), kscale_b (ceil(K / k_block), N), k_block even > 0) scales
    each K block's partial sum (row's scale first, then column's). ``plain``: the plain C loop even where the
    AVX512-BF16 one is built (the same sums; so every CPU runs both paths' packing and edges). ``out``: a
    contiguous (M, N) CPU tensor of `out_dtype` the result is written into and returned (e.g. one expert's rows of
    a grouped GEMM's output: no copy afterwards)."""
    kscale_a, kscale_b, k_block = k_scales if k_scales is not None else (None, None, 0)
    direct = plain_call(a, b, kscale_a, kscale_b, scale_a, scale_b, bias, out)  # (the dispatcher only: native_call)
    if out is not None:
        (_gemm_bf16_out_cpu if direct else gemm_bf16_out_op)(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b,
                                                             bias, plain, out)
        return out
    return (_gemm_bf16_cpu if direct else gemm_bf16_op)(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b, bias,
                                                        out_dtype, plain)


def _check_k_scales(a, b, k_block, kscale_a, kscale_b) -> None:
    """The K-block scales fit the GEMM (a misuse is an internal error)."""
    if k_block == 0:
        if kscale_a is not None or kscale_b is not None:
            raise RuntimeError("internal error: gemm_bf16 got K-block scales without a K block")
        return
    blocks = -(-a.shape[1] // k_block)
    if k_block < 0 or k_block % 2 or kscale_a is None or kscale_b is None \
            or tuple(kscale_a.shape) != (a.shape[0], blocks) or tuple(kscale_b.shape) != (blocks, b.shape[1]) \
            or kscale_a.dtype != torch.float32 or kscale_b.dtype != torch.float32:
        raise RuntimeError(f"internal error: gemm_bf16 K-block scales do not fit a {tuple(a.shape)} @ "
                           f"{tuple(b.shape)} GEMM with K block {k_block}")


def _gemm_bf16_cpu(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b, bias, out_dtype, plain):
    out = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype)
    return _gemm_bf16_into(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b, bias, plain, out)


def _gemm_bf16_out_cpu(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b, bias, plain, out):
    (m, n) = a.shape[0], b.shape[1]
    if tuple(out.shape) != (m, n) or not out.is_contiguous() or out.device.type != "cpu":
        raise RuntimeError(f"internal error: gemm_bf16_out writes a contiguous ({m}, {n}) CPU tensor, got "
                           f"{tuple(out.shape)} strides {out.stride()} on {out.device}")
    _gemm_bf16_into(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b, bias, plain, out)


def _gemm_bf16_into(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b, bias, plain, out):
    out_dtype = out.dtype
    # every argument checked (a misuse is an internal error); the outer scales' steps are how the C loop reads them
    steps = _outer_steps(a, b, scale_a, scale_b, bias, out_dtype)
    if steps is None:
        raise RuntimeError(f"internal error: gemm_bf16 does not take a {tuple(a.shape)} {a.dtype} @ {tuple(b.shape)} "
                           f"{b.dtype} GEMM with these scales, bias and output dtype {out_dtype}")
    if k_block or kscale_a is not None or kscale_b is not None:
        _check_k_scales(a, b, k_block, kscale_a, kscale_b)
    step_a, step_b = steps
    if not native_build.available():
        raise RuntimeError(f"fp8train's native GEMM cannot run here: {native_build.unavailable_reason()}")
    (m, k), n = a.shape, b.shape[1]
    # the result itself (fp32 out), or (bf16 out) the fp32 sum across cache blocks, rounded into out at the end
    acc = out if out_dtype == torch.float32 else torch.empty((m, n), dtype=torch.float32)
    if k_block:
        kscale_a, kscale_b = kscale_a.contiguous(), kscale_b.contiguous()
    table_a = None if a.dtype == torch.bfloat16 else _bf16_table(a.dtype).data_ptr()  # FP8 bytes: their values
    table_b = None if b.dtype == torch.bfloat16 else _bf16_table(b.dtype).data_ptr()
    rc = native_build.library().fp8_gemm_bf16(
        a.data_ptr(), table_a, b.data_ptr(), table_b, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        None if kscale_a is None else kscale_a.data_ptr(), None if kscale_b is None else kscale_b.data_ptr(),
        k_block, None if scale_a is None else scale_a.data_ptr(), step_a,
        None if scale_b is None else scale_b.data_ptr(), step_b,
        None if bias is None else bias.data_ptr(), acc.data_ptr(), None if out is acc else out.data_ptr(), int(plain),
        torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native bf16 GEMM returned {rc}")
    return out


def _gemm_bf16_fake(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b, bias, out_dtype, plain):
    return torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)


def _gemm_bf16_out_fake(a, b, k_block, kscale_a, kscale_b, scale_a, scale_b, bias, plain, out):
    return None


_LIB = torch.library.Library("fp8train", "FRAGMENT")
_LIB.define("gemm_bf16(Tensor a, Tensor b, int k_block, Tensor? kscale_a, Tensor? kscale_b, Tensor? scale_a, "
            "Tensor? scale_b, Tensor? bias, ScalarType out_dtype, bool plain) -> Tensor")
# the same GEMM written into a given tensor (`mm(..., out=)`)
_LIB.define("gemm_bf16_out(Tensor a, Tensor b, int k_block, Tensor? kscale_a, Tensor? kscale_b, Tensor? scale_a, "
            "Tensor? scale_b, Tensor? bias, bool plain, Tensor(a!) out) -> ()")
for _name, _cpu, _fake in (("gemm_bf16", _gemm_bf16_cpu, _gemm_bf16_fake),
                           ("gemm_bf16_out", _gemm_bf16_out_cpu, _gemm_bf16_out_fake)):
    _LIB.impl(_name, torch.library.fallthrough_kernel, "Autograd")  # reads values of a rounding: no grad
    _LIB.impl(_name, _cpu, "CPU")
    torch.library.register_fake(f"fp8train::{_name}", _fake, lib=_LIB)
gemm_bf16_op = torch.ops.fp8train.gemm_bf16.default
gemm_bf16_out_op = torch.ops.fp8train.gemm_bf16_out.default
