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
      a torch bf16 GEMM reads: native_gemm_reads_bytes); elsewhere it runs in fp32.
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

import functools

import torch

from fp8train.nn.accumulation import hopper_accumulated_mm
from fp8train.nn.scaled_gemm import check_dialect, scaled_mm_available, scaled_mm_gemm
from fp8train.nn.recipes import BACKENDS
from fp8train.numerics import native_cast, native_gemm
from fp8train.numerics.quant import decode_fp8

__all__ = ["Fp8Operand", "fp8_mm", "resolve_backend", "scaled_mm_available", "emulated_compute_dtype",
           "GEMM_BACKENDS", "EMULATED_DTYPES", "AUTO_EMULATED_DTYPE", "EMULATED_DTYPE_CHOICES", "check_emulated_dtype",
           "cpu_has_bf16_gemm", "set_cpu_bf16_gemm", "gemm_compute_dtype", "tile_values_dtype",
           "native_gemm_reads_bytes"]

GEMM_BACKENDS = tuple(b for b in BACKENDS if b != "te")  # te runs through nn/te.py, not a GEMM here
EMULATED_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The default emulated dtype: chosen per device (emulated_compute_dtype). The one spelling of it.
AUTO_EMULATED_DTYPE = "auto"
EMULATED_DTYPE_CHOICES = (AUTO_EMULATED_DTYPE, *EMULATED_DTYPES)


class Fp8Operand:
    """A 2-D FP8 matrix as a GEMM sees it: `value ~= data.float() * expand(scale)`.

    `scale` is fp32 and either 0-d (per tensor), broadcastable to `data` ((R, 1) per row, (1, C) per column), or
    a grid of tiles (ceil(R/br), ceil(C/bc)) with `block=(br, bc)`. `t()` is a free transpose: views only, and
    only of what a GEMM then reads (the bytes of a transposed operand are transposed on first access).
    The fp8 -> compute-dtype conversion is cached, so an operand used by two GEMMs is converted once.
    """

    __slots__ = ("_data", "_transposed_from", "scale", "block", "_cache")

    def __init__(self, data: torch.Tensor | None, scale: torch.Tensor, block: tuple[int, int] | None = None,
                 values: torch.Tensor | None = None, dequantized: torch.Tensor | None = None):
        assert data is None or data.dim() == 2, "Fp8Operand is 2-D; flatten leading dims first"
        self._data, self.scale, self.block = data, scale, block
        self._transposed_from: Fp8Operand | None = None  # set by t(): views of it are taken on first use
        # `values`: the FP8 values the quantizer already produced, keyed by dtype (saves a decode pass);
        # `dequantized`: values * scale in fp32, when the quantizer wrote those instead (saves that pass too).
        self._cache: dict = {} if values is None else {values.dtype: values}
        if dequantized is not None:
            self._cache[("dequantized", torch.float32)] = dequantized

    @property
    def data(self) -> torch.Tensor:
        if self._data is None:
            self._data = self._transposed_from.data.t()
        return self._data

    @property
    def device(self) -> torch.device:
        return self.scale.device

    def _cached(self, key):
        """A cached conversion, or the transpose of the source operand's (one view, taken on first use)."""
        if key not in self._cache and self._transposed_from is not None:
            found = self._transposed_from._cache.get(key)
            if found is not None:
                self._store(key, found.t())
                return found.t()
        return self._cache.get(key)

    def _store(self, key, value: torch.Tensor) -> torch.Tensor:
        # Not while torch.compile traces: the operand may come from outside the autograd.Function being traced,
        # and mutating it there breaks the graph (inductor removes the recomputation instead).
        if not torch.compiler.is_compiling():
            self._cache[key] = value
        return value

    def memo(self, key, make) -> torch.Tensor:
        """`make()`, kept on this operand under `key` (its own cache only, not its transpose source's): e.g. its
        bytes copied into the layout a kernel reads, made once per cached weight operand."""
        found = self._cache.get(key)
        return found if found is not None else self._store(key, make())

    @classmethod
    def from_fp8_tensor(cls, q, keep_values: bool = True) -> "Fp8Operand":
        """From a 2-D `quant.Fp8Tensor` (tensor scales, per-row scales along axis -1, or block tiles)."""
        if q.granularity == "row" and q.axis % 2 != 1:
            raise ValueError("Fp8Operand takes row scales shared along the last dim (axis=-1)")
        op = cls(q.data, q.scale, q.block if q.granularity == "block" else None,
                 q.values if keep_values else None, q.dequantized if keep_values else None)
        if keep_values and getattr(q, "values_bf16", None) is not None:  # written by the quantizer's same pass
            op._cache[torch.bfloat16] = q.values_bf16
        return op

    @property
    def shape(self) -> torch.Size:
        if self._data is None:
            rows, cols = self._transposed_from.shape
            return torch.Size((cols, rows))
        return self._data.shape

    def t(self) -> "Fp8Operand":
        scale = self.scale.t() if self.scale.dim() == 2 else self.scale
        out = Fp8Operand(None, scale, None if self.block is None else self.block[::-1])
        # Only what a GEMM then reads gets transposed (views are dispatched ops too, on the hot path).
        out._transposed_from = self
        return out

    def values(self, dtype: torch.dtype) -> torch.Tensor:
        """The FP8 values (unscaled) in `dtype` (exact for bf16/fp32); cached."""
        found = self._cached(dtype)
        if found is None:
            values = next((v for v in (self._cached(d) for d in (torch.float32, torch.bfloat16)) if v is not None),
                          None)
            if values is None:
                values = decode_fp8(self.data)
            found = self._store(dtype, values if values.dtype == dtype else values.to(dtype))
        return found

    def native_input(self) -> torch.Tensor:
        """What fp8train's native GEMM reads of this operand: its bf16 values where they were kept (for a bf16
        GEMM too), else the FP8 bytes themselves, which the kernel decodes while packing (no decoded copy)."""
        found = self._cached(torch.bfloat16)
        return found if found is not None else self.data

    @property
    def scale_outer_rows(self) -> bool:
        """The scale is constant along columns: it factors out when this operand is the LEFT factor."""
        return self.block is None and (self.scale.dim() == 0 or self.scale.shape[1] == 1)

    @property
    def scale_outer_cols(self) -> bool:
        """The scale is constant along rows: it factors out when this operand is the RIGHT factor."""
        return self.block is None and (self.scale.dim() == 0 or self.scale.shape[0] == 1)

    def full_scale(self) -> torch.Tensor:
        """The scale broadcastable to `data` (tile grids expanded)."""
        if self.block is None:
            return self.scale
        rows, cols = self.data.shape
        br, bc = self.block
        return self.scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """values * scale in fp32 (exact for power-of-two scales), then `dtype`; cached."""
        key = ("dequantized", dtype)
        found = self._cached(key)
        if found is None:
            found = self._dequantize_fp32()
            found = self._store(key, found if found.dtype == dtype else found.to(dtype))
        return found

    def _dequantize_fp32(self) -> torch.Tensor:
        values = self.values(torch.float32)
        if self.block is None:
            return values * self.scale
        if not values.is_contiguous() and values.t().is_contiguous():  # a transposed view: work on the original
            return self.t()._dequantize_fp32().t()
        (rows, cols), (br, bc) = values.shape, self.block
        if rows % br or cols % bc:  # ragged edge tiles: expand the scale grid to full size
            return values * self.full_scale()
        # One pass: view the values as (row tiles, br, col tiles, bc) and broadcast one scale per tile.
        tiles = values.reshape(rows // br, br, cols // bc, bc)
        return (tiles * self.scale[:, None, :, None]).reshape(rows, cols)


def resolve_backend(backend: str, device: torch.device | str, formats: tuple[str, ...] = ()) -> str:
    """'auto' -> 'scaled_mm' or 'emulated' for `device`; a 'scaled_mm' request that cannot run raises.

    `formats` (the recipe's format names) lets a GPU refuse the FP8 dialect it does not implement (FNUZ on OCP
    tensor cores, OCP on MI300) with a clear error instead of a kernel failure."""
    if backend == "auto":
        backend = "scaled_mm" if scaled_mm_available(device) else "emulated"
    if backend == "emulated":
        return backend
    if backend == "scaled_mm":
        if formats:
            check_dialect(formats, device)
        if not scaled_mm_available(device):
            raise RuntimeError(f"backend='scaled_mm' needs a CUDA GPU with compute capability 8.9+ (Ada/Hopper or "
                               f"newer); the tensors are on {torch.device(device)}. Use backend='emulated' (exact "
                               f"FP8 numerics on any device) or backend='auto'.")
        return backend
    if backend == "te":
        raise ValueError("backend='te' replaces the layer with Transformer Engine's Linear: use "
                         "fp8train.nn.te.make_te_linear(linear, recipe); Fp8Linear runs "
                         "'auto', 'emulated' or 'scaled_mm'")
    raise ValueError(f"unknown GEMM backend {backend!r}; allowed: {', '.join(GEMM_BACKENDS)}, te")


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


def check_emulated_dtype(choice: str) -> None:
    """Raise ValueError unless `choice` is one of EMULATED_DTYPE_CHOICES."""
    if choice not in EMULATED_DTYPE_CHOICES:
        raise ValueError(f"emulated_dtype must be one of {', '.join(EMULATED_DTYPE_CHOICES)}; got {choice!r}")


def emulated_compute_dtype(device: torch.device | str, choice: str = AUTO_EMULATED_DTYPE) -> torch.dtype:
    """The emulated GEMMs' input dtype for GEMMs with a bf16 output: `choice` 'fp32' or 'bf16', or 'auto': bf16
    on CUDA (tensor cores, fp32 accumulation) and on CPUs with bf16 GEMM instructions, fp32 on other CPUs (exact,
    and much faster there). GEMMs with an fp32 output always run in fp32 (module docstring)."""
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


def native_gemm_reads_bytes(compute_dtype: torch.dtype, out_dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether fp8_mm runs an emulated GEMM with outer scales and this output dtype on fp8train's native GEMM,
    which reads the FP8 bytes (no copy of the values needed): an fp32 result from bf16 values
    (gemm_compute_dtype) where the kernel runs on `device`. A bf16 result runs torch's bf16 GEMM on the bf16
    values instead. (Block and MX tiles: tile_values_dtype.)"""
    # (gemm_compute_dtype says bf16 for an fp32 result only where the kernel runs)
    return out_dtype == torch.float32 and gemm_compute_dtype(compute_dtype, out_dtype, device) == torch.bfloat16


def tile_values_dtype(device: torch.device | str, choice: str = AUTO_EMULATED_DTYPE) -> torch.dtype:
    """What an emulated GEMM reads of an operand with block or MX tiles (scales that vary along K): the bf16
    values, which fp8train's native GEMM decodes from the FP8 bytes and sums per K block before applying the tile
    scales, where that runs and the emulated dtype is bf16 (the quantizer keeps no copy); else value * scale in
    fp32, which the quantizer keeps (the GEMM then runs in fp32)."""
    bf16_tiles = emulated_compute_dtype(device, choice) == torch.bfloat16 and native_gemm.in_use(device)
    return torch.bfloat16 if bf16_tiles else torch.float32


def fp8_mm(a: Fp8Operand, b: Fp8Operand, backend: str = "emulated", *,
           compute_dtype: torch.dtype | None = None, out_dtype: torch.dtype = torch.float32,
           bias: torch.Tensor | None = None, use_fast_accum: bool = False, accumulation=None,
           record: dict | None = None, gemm: str = "", into: torch.Tensor | None = None) -> torch.Tensor:
    """`dequant(a) @ dequant(b) (+ bias)` for a (M, K), b (K, N), accumulated in fp32, returned in `out_dtype`.

    backend 'scaled_mm': the FP8 kernel (`use_fast_accum` is its fast-accumulation switch; `record[gemm]` says
    which kernel or fallback ran). backend 'emulated': exact FP8 products read in `compute_dtype` where the
    output is bf16 (gemm_compute_dtype; else fp32), scales and bias applied in fp32;
    `accumulation` (an `accumulation.HopperAccumulation`) models a tensor core's narrow accumulator instead.
    `into`: a contiguous (M, N) tensor of `out_dtype` the result is written into and returned, the same bits (the
    native kernels write it directly; other paths copy into it)."""
    if backend == "scaled_mm":
        if not scaled_mm_available(a.device):
            resolve_backend("scaled_mm", a.device)  # raises with the explanation
        return _into(scaled_mm_gemm(a, b, out_dtype=out_dtype, bias=bias, use_fast_accum=use_fast_accum,
                                    record=record, gemm=gemm), into)
    if record is not None:
        record[gemm] = "emulated"
    if accumulation is not None:
        out = hopper_accumulated_mm(a.dequantize(torch.float32), b.dequantize(torch.float32), accumulation)
    else:
        compute_dtype = gemm_compute_dtype(compute_dtype or emulated_compute_dtype(a.device), out_dtype, a.device)
        outer_scales = a.scale_outer_rows and b.scale_outer_cols
        native = compute_dtype == torch.bfloat16 and native_gemm.in_use(a.device)
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
        elif compute_dtype == torch.bfloat16 and a.device.type == "cpu" and outer_scales:
            acc = torch.mm(a.values(compute_dtype), b.values(compute_dtype))  # rounded to bf16 by the GEMM (above)
            if native_cast.epilogue_usable(acc, a.scale, b.scale, bias, out_dtype):  # the ops below, one pass
                return native_cast.gemm_epilogue(acc, a.scale, b.scale, bias, out_dtype, out=into)
            out = _apply_outer_scales(acc.float(), a.scale, b.scale)
        else:
            out = _emulated_gemm(a, b, compute_dtype)
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
