"""FP8 GEMM backends: `a @ b` for FP8 operands with dequantization scales, accumulated in fp32.

Backends
- `emulated` (any device). FP8 values are exactly representable in bf16 and fp32, and the product of two FP8
  values is exact in fp32 (at most 2 * 4 = 8 significant bits), so a GEMM over the FP8-valued operands with fp32
  accumulation reproduces an FP8 tensor-core GEMM up to accumulation order. Each emulated dtype has ONE meaning
  (`emulated_compute_dtype`, chosen with `fp8.emulated_dtype: auto|fp32|bf16`), the same on every CPU:
    * `fp32`: every GEMM runs on fp32 copies of the FP8 values with fp32 accumulation; scales and bias are applied
      to the fp32 accumulator and the result is rounded once to the output dtype. Exact up to fp32 summation
      order: against fp64 of the FP8 operands, within K * 2^-24 of the sum of |products|.
    * `bf16`: what a GPU's scaled GEMM computes, rounding where it rounds. A GEMM whose output dtype is bf16 (the
      forward and grad_input GEMMs under bf16 autocast) reads bf16 copies of the FP8 values (exact), accumulates
      in fp32, and its result is rounded to bf16 by the GEMM itself: torch has no bf16 x bf16 -> fp32 GEMM on CPU
      (aten::mm.dtype is CUDA-only in torch 2.13), so the unscaled accumulator is rounded once to bf16, then
      scales and bias are applied in fp32 and the result rounded to bf16 again. With power-of-two scales and no
      bias the second rounding is exact, so the output equals bf16(fp32 accumulator * scales), the GPU's; with
      non-power-of-two scales it can differ from the GPU's single rounding by one bf16 step, and with a bias by
      half a bf16 step of the product before the bias (more than a step of the output where the bias cancels).
      On CPU the scales, bias and output rounding after such a GEMM run as one pass of the native kernel
      (native_cast.gemm_epilogue: the same operations, the same bits). A GEMM whose output is fp32 (grad_weight
      for fp32 master weights: the GPU's FP8 wgrad GEMM writes fp32, so its 24-bit gradient is never rounded to
      8 bits; any GEMM fed fp32 activations outside autocast) keeps its fp32 sum: on a CPU with AVX512-BF16 it
      runs on fp8train's native bf16 -> fp32 GEMM (numerics.native_gemm: the FP8 bytes decoded to bf16 while it
      packs them, exact products, fp32 sums, fp32 result; the fp32 GEMM's arithmetic in another summation order,
      about 3x faster there), so the quantizer keeps no copy of the values such a GEMM reads (only the bf16 copy
      a torch bf16 GEMM reads: gemm_choice.operand_keeps); elsewhere it runs in fp32.
    * `auto`: bf16 on CUDA and on CPUs with bf16 GEMM instructions (avx512_bf16 or AMX-BF16, from
      /proc/cpuinfo), where bf16 GEMMs are several times faster than fp32; fp32 on other CPUs, where fp32 GEMMs
      are the fast ones (AMD EPYC, 2 cores, avx2 only: 77 vs ~10 GFLOP/s at 4096x1024x1024). `auto` therefore
      gives different bf16-rounding points on different CPUs; pin `fp32` for results that must not depend on
      the CPU (every exactness test does).
  Scales that are per tensor, or per row of a / per column of b (i.e. along the NON-contracted dims), factor out
  of the sum and are applied to the fp32 result: out = (a_fp8 @ b_fp8) * scale_a * scale_b. Scales that vary
  along the contracted dim (block tiles; per-row scales of an operand used transposed in a backward GEMM) do not
  factor out, so that operand is dequantized first (exact when scales are powers of two) and the GEMM runs in fp32;
  under bf16 emulation where fp8train's native GEMM runs, tiles whose K extents agree are applied instead to each
  K block's fp32 partial sum of the unscaled FP8 values (`_k_block_scales`; a GPU's blockwise FP8 GEMM does that).
- `scaled_mm` (CUDA sm89+): torch's FP8 scaled matmul (fp8train.nn.scaled_gemm): tensorwise, rowwise,
  blockwise (1x128 / 128x128, sm90) and MX (1x32 E8M0, sm100) scales, output straight in the caller's dtype, bias
  fused where the kernel takes it; a configuration no kernel takes falls back to dequantize + bf16 GEMM with fp32
  accumulation, and says why (the call is planned by a pure function: fp8train.nn.scaled_mm_rules).
- `te` is not a GEMM here: Transformer Engine replaces the whole layer (fp8train.nn.te).
- `auto`: scaled_mm on a capable CUDA GPU, else emulated.
"""


from __future__ import annotations

import torch

from fp8train.nn.accumulation import hopper_accumulated_mm
from fp8train.nn.cpu_features import cpu_has_bf16_gemm, set_cpu_bf16_gemm
from fp8train.nn.fp8_operand import Fp8Operand
from fp8train.nn.gemm_choice import (AUTO_EMULATED_DTYPE, EMULATED_DTYPE_CHOICES, EMULATED_DTYPES, GEMM_BACKENDS,
                                     check_emulated_dtype, emulated_compute_dtype, gemm_compute_dtype,
                                     resolve_backend)
from fp8train.nn.recipes import GemmBackend
from fp8train.nn.scaled_gemm import scaled_mm_available, scaled_mm_gemm
from fp8train.numerics import native_cast, native_gemm

# The GEMM itself (fp8_mm, emulated_mm) is this module's; the operand class, the backend and dtype choices and the
# CPU's capabilities live in their own modules and are named here too, as the GEMM's vocabulary.
__all__ = ["fp8_mm", "emulated_mm", "Fp8Operand", "resolve_backend", "scaled_mm_available", "emulated_compute_dtype",
           "GEMM_BACKENDS", "EMULATED_DTYPES", "AUTO_EMULATED_DTYPE", "EMULATED_DTYPE_CHOICES", "check_emulated_dtype",
           "cpu_has_bf16_gemm", "set_cpu_bf16_gemm", "gemm_compute_dtype"]


def fp8_mm(a: Fp8Operand, b: Fp8Operand, backend: str = GemmBackend.EMULATED, *,
           compute_dtype: torch.dtype | None = None, out_dtype: torch.dtype = torch.float32,
           bias: torch.Tensor | None = None, use_fast_accum: bool = False, accumulation=None,
           record: dict | None = None, gemm: str = "", into: torch.Tensor | None = None) -> torch.Tensor:
    """`dequant(a) @ dequant(b) (+ bias)` for a (M, K), b (K, N), accumulated in fp32, returned in `out_dtype`.

    backend 'scaled_mm': the FP8 kernel (`use_fast_accum` is its fast-accumulation switch; `record[gemm]` says
    which kernel or fallback ran). backend 'emulated': exact FP8 products read in `compute_dtype` where the
    output is bf16 (gemm_compute_dtype; else fp32), scales and bias applied in fp32;
    `accumulation` (an `accumulation.HopperAccumulation`) models a tensor core's narrow accumulator instead.
    `into`: a contiguous (M, N) tensor of `out_dtype` the result is written into and returned, the same bits (the
    native kernels write it directly; other paths copy into it).
    (A layer resolves this choice once per device and dtypes and calls `emulated_mm` itself: linear_dispatch.py.)"""
    if backend == GemmBackend.SCALED_MM:
        if not scaled_mm_available(a.device):
            resolve_backend(GemmBackend.SCALED_MM, a.device)  # raises with the explanation
        return _into(scaled_mm_gemm(a, b, out_dtype=out_dtype, bias=bias, use_fast_accum=use_fast_accum,
                                    record=record, gemm=gemm), into)
    if accumulation is not None:
        if record is not None:
            record[gemm] = "emulated"
        out = hopper_accumulated_mm(a.dequantize(torch.float32), b.dequantize(torch.float32), accumulation)
        if bias is not None:
            out.add_(bias if bias.dtype == torch.float32 else bias.float())
        return _into(out if out_dtype == torch.float32 else out.to(out_dtype), into)
    reads = gemm_compute_dtype(compute_dtype or emulated_compute_dtype(a.device), out_dtype, a.device)
    return emulated_mm(a, b, reads=reads, native=reads == torch.bfloat16 and native_gemm.in_use(a.device),
                       out_dtype=out_dtype, bias=bias, record=record, gemm=gemm, into=into)


def emulated_mm(a: Fp8Operand, b: Fp8Operand, *, reads: torch.dtype, native: bool, out_dtype: torch.dtype,
                bias: torch.Tensor | None = None, record: dict | None = None, gemm: str = "",
                into: torch.Tensor | None = None) -> torch.Tensor:
    """The emulated GEMM of `fp8_mm`, its choices made: `reads` the dtype its FP8 values are read in
    (gemm_compute_dtype), `native` whether fp8train's native bf16 GEMM runs (numerics.native_gemm.in_use);
    `into` as for fp8_mm."""
    if record is not None:
        record[gemm] = "emulated"
    outer_scales = a.scale_outer_rows and b.scale_outer_cols
    # scales that vary along K (block / MX tiles): each K block's fp32 partial sum of exact FP8 products is
    # scaled and added (a GPU's blockwise FP8 GEMM), instead of dequantizing and running fp32
    k_scales = _k_block_scales(a, b) if native and not outer_scales else None
    if k_scales is not None or (native and outer_scales and out_dtype == torch.float32):
        # fp8train's bf16 -> fp32 GEMM (gemm_compute_dtype said it runs here), scales and bias in its epilogue
        # where it takes them, else in the torch ops below
        scale_a, scale_b = (a.scale, b.scale) if k_scales is None else (None, None)
        a_in, b_in = a.native_input(), b.native_input()
        bias = bias if bias is None or bias.dtype == torch.float32 else bias.float()  # (exact)
        if native_gemm.usable(a_in, b_in, scale_a, scale_b, bias, out_dtype):
            return native_gemm.mm(a_in, b_in, k_scales, scale_a=scale_a, scale_b=scale_b, bias=bias,
                                  out_dtype=out_dtype, out=into)
        out = _apply_outer_scales(native_gemm.mm(a_in, b_in, k_scales), scale_a, scale_b)
    elif reads == torch.bfloat16 and outer_scales and a.scale.device.type == "cpu":
        acc = torch.mm(a.values(reads), b.values(reads))  # rounded to bf16 by the GEMM (module docstring)
        if native_cast.epilogue_usable(acc, a.scale, b.scale, bias, out_dtype):  # the ops below, one pass
            return native_cast.gemm_epilogue(acc, a.scale, b.scale, bias, out_dtype, out=into)
        out = _apply_outer_scales(acc.float(), a.scale, b.scale)
    else:
        out = _emulated_gemm(a, b, reads)
    if bias is not None:  # bias in fp32, one rounding to the output dtype below (no no-op casts: each is an op)
        out.add_(bias if bias.dtype == torch.float32 else bias.float())
    return _into(out if out_dtype == torch.float32 else out.to(out_dtype), into)


def _into(result: torch.Tensor, into: torch.Tensor | None) -> torch.Tensor:
    return result if into is None else into.copy_(result)


def _emulated_gemm(a: Fp8Operand, b: Fp8Operand, compute_dtype: torch.dtype) -> torch.Tensor:
    if a.scale_outer_rows and b.scale_outer_cols:
        out = _mm_fp32(a.values(compute_dtype), b.values(compute_dtype))
        return _apply_outer_scales(out, a.scale, b.scale)
    # A scale varies along K: dequantize that operand (exact for pow2 scales) and run the GEMM in fp32.
    a_hp = a.values(torch.float32) if a.scale_outer_rows else a.dequantize(torch.float32)
    b_hp = b.values(torch.float32) if b.scale_outer_cols else b.dequantize(torch.float32)
    out = torch.mm(a_hp, b_hp)
    return _apply_outer_scales(out, a.scale if a.scale_outer_rows else None,
                               b.scale if b.scale_outer_cols else None)


def _k_block_scales(a: Fp8Operand, b: Fp8Operand) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(scale_a (M, K blocks), scale_b (K blocks, N), K block) for native_gemm.mm when a's and b's scales are
    constant within one K block (tiles whose K extents agree; outer scales are constant along K anyway), else
    None. The tile grids are expanded along M and N only: K / block_k scales per row or column, small."""
    (m, k), n = a.shape, b.shape[1]
    k_sizes = {op.block[side] for op, side in ((a, 1), (b, 0)) if op.block is not None}
    if len(k_sizes) != 1 or (a.block is None and not a.scale_outer_rows) or \
            (b.block is None and not b.scale_outer_cols):
        return None
    k_block = k_sizes.pop()
    if k_block % 2:  # (the kernel sums k in pairs; one K block past k is one block, its partial sum the whole)
        return None
    blocks = -(-k // k_block)
    scale_a = a.scale.reshape(-1, 1).expand(m, blocks) if a.block is None else \
        a.scale.repeat_interleave(a.block[0], 0)[:m] if a.block[0] > 1 else a.scale
    scale_b = b.scale.reshape(1, -1).expand(blocks, n) if b.block is None else \
        b.scale.repeat_interleave(b.block[1], 1)[:, :n] if b.block[1] > 1 else b.scale
    if tuple(scale_a.shape) != (m, blocks) or tuple(scale_b.shape) != (blocks, n):
        return None
    return scale_a.float().contiguous(), scale_b.float().contiguous(), k_block


def _apply_outer_scales(out: torch.Tensor, scale_a: torch.Tensor | None, scale_b: torch.Tensor | None):
    # In place on the fresh fp32 GEMM result, one scale after the other: multiplying the two scales first can
    # overflow fp32 (huge scales left by an outlier step), turning exact zeros into 0 * inf = NaN.
    for scale in (scale_a, scale_b):
        if scale is not None:
            out.mul_(scale)
    return out


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """GEMM with fp32 accumulation and an fp32 result."""
    if a.dtype == torch.float32:
        return torch.mm(a, b)
    if a.is_cuda:
        try:  # torch >= 2.8 can return fp32 from a bf16 GEMM (no bf16 rounding of the accumulator)
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return torch.mm(a, b).float()
