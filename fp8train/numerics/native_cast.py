"""The native FP8 cast: a small C kernel (native_cast.c) for amax, scale and cast in one op, and a table decode.

Why: on CPUs without avx512 torch's fp32 -> float8 cast and float8 -> fp32 conversion are scalar routines
(~0.1 G elements/s for a whole eager quantize on a 2-core avx2 EPYC), and the eager chain makes several
full-size passes. The C file restates the same chain (quant.py's module docstring; every byte equal, checked
against ml_dtypes by tests/test_native_cast.py) in loops gcc vectorizes, one pass per tile row.

Build: on first use with the system C compiler, cached per machine (native_build.py). Without a compiler, or
when the build or load fails, ``available()`` is False, the reason is warned once (``unavailable_reason()``),
and quantize runs its eager kernel instead (same bytes, slower).

Ops (torch.library, so each is ONE op in a profile and torch.compile can trace it, via its fake impl):
``fp8train::quantize_fp8`` (amax -> scale -> x / scale -> FP8 bytes, optionally the FP8 values in fp32 and/or
bf16, what the emulated GEMMs read, written in the same pass; with a given scale, optionally x's amax taken in the
same pass as the cast, for delayed scaling),
``fp8train::amax``, ``fp8train::decode_fp8`` (a 256-entry table) and ``fp8train::dequantize_fp8`` (bytes and
tile scales -> value * scale), and ``fp8train::gemm_epilogue`` (an emulated bf16 GEMM's accumulator
-> its scales, bias and output dtype in one pass). Inputs: fp32 or bf16 CPU tensors, contiguous or the transpose
of a contiguous 2-D tensor; ``layout()`` (native_layout.py) says whether a call is supported (None: use the eager
kernel).
"""

from __future__ import annotations

import ctypes
import math
from typing import Optional

import torch

from fp8train.numerics.formats import FORMATS, Fp8Format
from fp8train.numerics.scale_limits import SCALE_CAPS, fp32_exact
from fp8train.numerics import native_build
from fp8train.numerics.native_build import Params, library, threading_kind
from fp8train.numerics.native_call import plain_call
from fp8train.numerics.native_layout import FP8_DTYPES as _FP8_DTYPES, INPUT_DTYPES as _INPUT_DTYPES
from fp8train.numerics.native_layout import (UNUSED_OUTPUTS, NativeLayout, amax_output, capped_block, dense_kind,
                                             kernel_outputs, layout, scale_step)

__all__ = ["available", "set_enabled", "unavailable_reason", "threading_kind", "layout", "usable_layout",
           "capped_block", "NativeLayout", "quantize_fp8", "quantize_laid_out", "amax", "decode",
           "decodable", "dequantize", "dequantizable", "gemm_epilogue", "epilogue_usable", "scale_step", "cast_params"]

RULE_GIVEN, RULE_AMAX, RULE_MX = 0, 1, 2  # as in native_cast.c
_SPECIAL = {"ieee": 0, "fn": 1, "fnuz": 2}

_enabled = True
# Bumped by every process-wide execution switch (set_enabled here, native_gemm.set_mode, the CPU-feature override,
# scaled_gemm.target_gpu): a layer that resolved its GEMM and keep choices once resolves them again when it moves.
switch_count = 0


def note_switch() -> None:
    """Say that a process-wide execution switch changed (see `switch_count`)."""
    global switch_count
    switch_count += 1


def available() -> bool:
    """True when the native kernel is built and loaded here and not switched off by `set_enabled(False)`."""
    return _enabled and native_build.available()


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    if not _enabled:
        return "switched off in this process (native_cast.set_enabled(False))"
    return native_build.unavailable_reason()


def set_enabled(enabled: bool) -> None:
    """Use (True, the default) or bypass (False) the native kernel in this process. False runs every quantize,
    decode and dequantize on the eager kernels, the path of a machine without a C compiler (the same bytes,
    slower), so that path can be tested on a machine that builds the kernel."""
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"set_enabled takes True or False; got {enabled!r}")
    _enabled = enabled
    note_switch()


def usable_layout(x: torch.Tensor, granularity: str, block_rows: int, block_cols: int, axis: int,
                  dtypes: tuple = _INPUT_DTYPES) -> Optional[NativeLayout]:
    """``layout()`` with the block capped to the tensor, or None when the kernel is not built or torch.compile is
    tracing (there the eager math is traced inline and fused instead)."""
    if torch.compiler.is_compiling() or not available():
        return None
    return layout(x, granularity, *capped_block(x, block_rows, block_cols), axis, dtypes)


# ------------------------------------------------------------------------------------------------------------
# Parameters (one ctypes struct per configuration, built once)
# ------------------------------------------------------------------------------------------------------------
_params_cache: dict = {}


def _f32_bits(value: float) -> int:
    return torch.tensor(value, dtype=torch.float32).view(torch.int32).item() & 0xFFFFFFFF


def cast_params(fmt: Fp8Format, saturate: bool, rule: int, margin: int, pow2: bool,
                dequantize: bool = False) -> Params:
    """The C kernel's parameters for one configuration, built once. The scale rule's constants are
    scaling.scale_rule's: the divisor fmt.max * 2**-margin, the cap, and whether the division is its fp32 one
    (tests/test_native_cast.py checks the scales bit for bit against the eager rule and a reference)."""
    key = (fmt.name, saturate, rule, margin, pow2, dequantize)
    found = _params_cache.get(key)
    if found is None:
        divisor = fmt.max * 2.0 ** -margin
        found = Params()
        found.mantissa_bits, found.bias, found.special = fmt.mantissa_bits, fmt.bias, _SPECIAL[fmt.special]
        found.saturate, found.max_is_even = int(saturate), int((fmt.max / fmt.step_at_max) % 2 == 0)
        found.rule, found.pow2 = rule, int(pow2)
        found.fp32_divide = int(not pow2 and fp32_exact(divisor) and divisor >= 1)
        found.mx_emax = math.frexp(fmt.max)[1] - 1
        found.dequantize = int(dequantize)
        found.max_bits, found.limit_bits = _f32_bits(fmt.max), _f32_bits(fmt.max + fmt.step_at_max / 2)
        found.divisor, found.cap = divisor, SCALE_CAPS[(fmt.name, pow2)]
        found.tiny = float(torch.finfo(torch.float32).tiny)
        # raw bits: through Python floats a signaling-NaN payload (FNUZ's 0x7F800001) would come back quieted
        ctypes.memmove(found.lut, _decode_table(fmt).data_ptr(), 256 * 4)
        _params_cache[key] = found
    return found


_tables: dict = {}


def _decode_table(fmt: Fp8Format) -> torch.Tensor:
    """fp32 value of each of the 256 codes: torch's own float8 -> fp32 conversion (the eager kernel's), NaN
    payloads included, so native and eager values are the same bits."""
    table = _tables.get(fmt.name)
    if table is None:
        table = _tables[fmt.name] = torch.arange(256, dtype=torch.uint8).view(fmt.torch_dtype).float()
    return table


# ------------------------------------------------------------------------------------------------------------
# The ops
# ------------------------------------------------------------------------------------------------------------
def _layout_or_raise(x, granularity, block_rows, block_cols, axis) -> NativeLayout:
    lay = layout(x, granularity, block_rows, block_cols, axis)
    if lay is None:
        raise ValueError(f"fp8train native cast: unsupported input (dtype {x.dtype}, shape {tuple(x.shape)}, "
                         f"strides {x.stride()}, granularity {granularity}, axis {axis}); check layout() first")
    return lay


def _scale_in_memory_order(scale: torch.Tensor, lay: NativeLayout) -> torch.Tensor:
    if lay.transposed and scale.dim() == 2:
        scale = scale.t()
    return scale.float().contiguous()


# Registered with the low-level torch.library API: torch.library.custom_op wraps every call in autograd and
# dynamo-disable layers that cost ~100 us, more than the whole cast of a 512x256 tensor. The options are typed
# primitive arguments; what follows from them (the scale rule's constants, the ctypes struct, the memory layout)
# is worked out once per configuration, on the C side of the op.
_LIB = torch.library.Library("fp8train", "DEF")
_LIB.define("quantize_fp8(Tensor x, Tensor? scale, str fmt, str granularity, int block_rows, int block_cols, "
            "int axis, int margin, bool pow2, bool mx, bool saturate, bool keep_values, bool keep_values_bf16, "
            "bool dequantize, bool with_amax, Tensor(a!)? nonfinite_count=None, Tensor(b!)? pending_amax=None) "
            "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")
_LIB.define("amax(Tensor x, str granularity, int block_rows, int block_cols, int axis) -> Tensor")
_LIB.define("decode_fp8(Tensor data, str fmt, ScalarType dtype) -> Tensor")
_LIB.define("dequantize_fp8(Tensor data, Tensor scale, str granularity, int block_rows, int block_cols, "
            "int axis) -> Tensor")
_LIB.define("gemm_epilogue(Tensor acc, Tensor? scale_a, Tensor? scale_b, Tensor? bias, ScalarType out_dtype) -> Tensor")
_LIB.define("gemm_epilogue_out(Tensor acc, Tensor? scale_a, Tensor? scale_b, Tensor? bias, Tensor(a!) out) -> ()")


def _quantize_fp8_cpu(x, scale, fmt, granularity, block_rows, block_cols, axis, margin, pow2, mx, saturate,
                      keep_values, keep_values_bf16, dequantize, with_amax, nonfinite_count=None, pending_amax=None):
    """(data, scale, amax, values, values_bf16) of quantizing x, in one pass per tile row: amax per tile -> scale
    (the amax rule, or MX's with ``mx``; or the given ``scale``, whose amax is written only ``with_amax``, in the
    same pass as the cast) -> x / scale -> FP8 bytes; values (the FP8 values in fp32, or value * scale with
    ``dequantize``) only with ``keep_values``, values_bf16 (the FP8 values in bf16) only with ``keep_values_bf16``.
    A quantizer's scaling state, updated in place from the amaxes where given (one value each, on the CPU):
    ``nonfinite_count`` (int64) + 1 when any amax is NaN/inf, ``pending_amax`` (fp32) = max(itself, the largest
    finite amax, -1) - nn/quantizer.OperandQuantizer.record_amax's rule, without its four torch ops."""
    lay = layout(x, granularity, block_rows, block_cols, axis)
    if lay is None:
        _layout_or_raise(x, granularity, block_rows, block_cols, axis)  # (raises, naming the input)
    return quantize_laid_out(x, lay, scale, fmt, mx, saturate, margin, pow2, keep_values, keep_values_bf16,
                             dequantize, with_amax, nonfinite_count, pending_amax)


def quantize_laid_out(x, lay: NativeLayout, scale, fmt, mx, saturate, margin, pow2, keep_values, keep_values_bf16,
                      dequantize, with_amax, nonfinite_count, pending_amax):
    """The ``fp8train::quantize_fp8`` op's CPU implementation with x's `layout()` worked out by the caller, who
    needed it too; called directly where native_call.plain_call says the op would only call it."""
    fp8 = FORMATS[fmt]
    with_amax = scale is None or with_amax
    data, scale_out, amax, values, values_bf16 = kernel_outputs(x, lay, fp8, with_amax, keep_values,
                                                                keep_values_bf16, UNUSED_OUTPUTS)
    scale_in, rule = None, RULE_MX if mx else RULE_AMAX
    if scale is not None:
        scale_in = _scale_in_memory_order(scale, lay)
        rule = RULE_GIVEN
    params = cast_params(fp8, saturate, rule, margin, pow2, dequantize)
    count_at = pending_at = None
    for state, dtype in ((nonfinite_count, torch.int64), (pending_amax, torch.float32)):  # (no helper: hot path)
        if state is None:
            continue
        if not with_amax or state.dtype != dtype or state.numel() != 1 or state.device.type != "cpu":
            raise RuntimeError(f"internal error: quantize_fp8 records amaxes into one {dtype} CPU value, with the "
                               f"amax taken; got {state.dtype} of shape {tuple(state.shape)} on {state.device}")
        if dtype == torch.int64:
            count_at = state.data_ptr()
        else:
            pending_at = state.data_ptr()
    rc = library().fp8_quantize(
        ctypes.byref(params), x.data_ptr(), int(x.dtype == torch.bfloat16), lay.batch, lay.rows, lay.cols,
        lay.tile_rows, lay.tile_cols, None if scale_in is None else scale_in.data_ptr(), data.data_ptr(),
        scale_out.data_ptr(), amax.data_ptr() if with_amax else None, values.data_ptr() if keep_values else None,
        values_bf16.data_ptr() if keep_values_bf16 else None, count_at, pending_at, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native cast returned {rc}")
    return data, scale_out, amax, values, values_bf16


def _quantize_fp8_fake(x, scale, fmt, granularity, block_rows, block_cols, axis, margin, pow2, mx, saturate,
                       keep_values, keep_values_bf16, dequantize, with_amax, nonfinite_count=None, pending_amax=None):
    lay = _layout_or_raise(x, granularity, block_rows, block_cols, axis)
    return kernel_outputs(x, lay, FORMATS[fmt], scale is None or with_amax, keep_values, keep_values_bf16)


def _amax_cpu(x, granularity, block_rows, block_cols, axis):
    """max |x| per tensor, row or block (fp32, shaped like the scale), NaN propagating; one pass."""
    lay = layout(x, granularity, block_rows, block_cols, axis)
    if lay is None:
        _layout_or_raise(x, granularity, block_rows, block_cols, axis)  # (raises, naming the input)
    out = amax_output(lay)
    params = cast_params(FORMATS["e4m3fn"], True, RULE_GIVEN, 0, False)  # no scale is made
    rc = library().fp8_quantize(ctypes.byref(params), x.data_ptr(), int(x.dtype == torch.bfloat16), lay.batch,
                                lay.rows, lay.cols, lay.tile_rows, lay.tile_cols, None, None, None,
                                out.data_ptr(), None, None, None, None, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native amax returned {rc}")
    return out


def _amax_fake(x, granularity, block_rows, block_cols, axis):
    return amax_output(_layout_or_raise(x, granularity, block_rows, block_cols, axis))


def _decode_cpu(data, fmt, dtype):
    """FP8 bytes (contiguous, or any dense layout: the output keeps it) -> their values in fp32 or bf16 (exact),
    through a 256-entry table."""
    out = torch.empty_strided(data.shape, data.stride(), dtype=dtype)
    table = _decode_table(FORMATS[fmt])
    rc = library().fp8_decode(table.data_ptr(), data.data_ptr(), data.numel(), out.data_ptr(),
                                  int(dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native decode returned {rc}")
    return out


def _decode_fake(data, fmt, dtype):
    return torch.empty_strided(data.shape, data.stride(), dtype=dtype)


def dequantize(data: torch.Tensor, scale: torch.Tensor, granularity: str, block_rows: int, block_cols: int,
               axis: int = -1) -> torch.Tensor:
    """FP8 bytes and their scales (shaped per the granularity, as quantize made them) -> value * scale in fp32,
    through the one op (``_dequantize_cpu``); the output has the bytes' layout."""
    return dequantize_fp8(data, scale, granularity, block_rows, block_cols, axis)


def dequantizable(data: torch.Tensor, scale: torch.Tensor, granularity: str, block_rows: int, block_cols: int,
                  axis: int = -1) -> bool:
    lay = usable_layout(data, granularity, block_rows, block_cols, axis, _FP8_DTYPES)
    return lay is not None and lay.batch == 1 and tuple(scale.shape) == lay.scale_shape and \
        scale.dtype == torch.float32


def _dequantize_layout(data, granularity, block_rows, block_cols, axis) -> NativeLayout:
    lay = layout(data, granularity, block_rows, block_cols, axis, dtypes=_FP8_DTYPES)
    if lay is None:
        raise ValueError(f"fp8train native dequantize: unsupported bytes (dtype {data.dtype}, shape "
                         f"{tuple(data.shape)}, strides {data.stride()}, {granularity} {block_rows}x{block_cols})")
    return lay


def _dequantize_cpu(data, scale, granularity, block_rows, block_cols, axis):
    lay = _dequantize_layout(data, granularity, block_rows, block_cols, axis)
    out = torch.empty_strided(data.shape, data.stride(), dtype=torch.float32)
    fmt = next(f for f in FORMATS.values() if f.torch_dtype == data.dtype)
    scale_grid = _scale_in_memory_order(scale, lay)
    rc = library().fp8_dequantize(_decode_table(fmt).data_ptr(), data.data_ptr(), lay.batch, lay.rows, lay.cols,
                                      lay.tile_rows, lay.tile_cols, scale_grid.data_ptr(), out.data_ptr(),
                                      torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native dequantize returned {rc}")
    return out


def _dequantize_fake(data, scale, granularity, block_rows, block_cols, axis):
    _dequantize_layout(data, granularity, block_rows, block_cols, axis)
    return torch.empty_strided(data.shape, data.stride(), dtype=torch.float32)


def epilogue_usable(acc: torch.Tensor, scale_a, scale_b, bias, out_dtype: torch.dtype) -> bool:
    """Whether ``gemm_epilogue`` takes this: a contiguous 2-D bf16 CPU accumulator, fp32 scales that are one
    value, one per row (scale_a) or one per column (scale_b), an fp32 bias per column, a bf16 or fp32 output."""
    # (asked on every bf16 GEMM of an emulated layer: plain checks, no generator, .is_cpu not .device.type)
    if acc.dtype != torch.bfloat16 or not acc.is_cpu or acc.dim() != 2 or not acc.is_contiguous() \
            or out_dtype not in _INPUT_DTYPES or torch.compiler.is_compiling() or not available():
        return False
    rows, cols = acc.shape
    for t in (scale_a, scale_b, bias):
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
            return False
    if bias is not None and (bias.shape != (cols,) or not bias.is_contiguous()):
        return False
    return scale_step(scale_a, 0, rows) is not None and scale_step(scale_b, 1, cols) is not None


def gemm_epilogue(acc: torch.Tensor, scale_a, scale_b, bias, out_dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``((acc.float() * scale_a) * scale_b + bias).to(out_dtype)`` in one pass, the same bits as those torch ops
    (any of scale_a, scale_b, bias may be None); check ``epilogue_usable`` first. ``out``: a contiguous CPU tensor
    of acc's shape and `out_dtype` the result is written into and returned (no copy afterwards)."""
    direct = plain_call(acc, scale_a, scale_b, bias, out)  # (the dispatcher only: native_call.py)
    if out is not None:
        (_gemm_epilogue_out_cpu if direct else gemm_epilogue_out_op)(acc, scale_a, scale_b, bias, out)
        return out
    return (_gemm_epilogue_cpu if direct else gemm_epilogue_op)(acc, scale_a, scale_b, bias, out_dtype)


def _gemm_epilogue_cpu(acc, scale_a, scale_b, bias, out_dtype):
    out = torch.empty(acc.shape, dtype=out_dtype)
    _gemm_epilogue_into(acc, scale_a, scale_b, bias, out)
    return out


def _gemm_epilogue_out_cpu(acc, scale_a, scale_b, bias, out):
    if out.shape != acc.shape or not out.is_contiguous() or out.device.type != "cpu" \
            or out.dtype not in _INPUT_DTYPES:
        raise RuntimeError(f"internal error: gemm_epilogue_out writes a contiguous {tuple(acc.shape)} CPU tensor, "
                           f"got {tuple(out.shape)} {out.dtype} strides {out.stride()} on {out.device}")
    _gemm_epilogue_into(acc, scale_a, scale_b, bias, out)


def _gemm_epilogue_into(acc, scale_a, scale_b, bias, out):
    rows, cols = acc.shape
    out_dtype = out.dtype
    rc = library().fp8_gemm_epilogue(acc.data_ptr(), rows, cols, None if scale_a is None else scale_a.data_ptr(),
                                     scale_step(scale_a, 0, rows), None if scale_b is None else scale_b.data_ptr(),
                                     scale_step(scale_b, 1, cols), None if bias is None else bias.data_ptr(),
                                     out.data_ptr(), int(out_dtype == torch.bfloat16), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native GEMM epilogue returned {rc}")


def _gemm_epilogue_fake(acc, scale_a, scale_b, bias, out_dtype):
    return torch.empty(acc.shape, dtype=out_dtype)


def _gemm_epilogue_out_fake(acc, scale_a, scale_b, bias, out):
    return None


# Not differentiable (FP8 bytes, scales, amaxes, values of a rounding): autograd falls through, so the outputs
# never require grad, as eager quantize's (made under no_grad) do not.
for _name in ("quantize_fp8", "dequantize_fp8", "amax", "decode_fp8", "gemm_epilogue", "gemm_epilogue_out"):
    _LIB.impl(_name, torch.library.fallthrough_kernel, "Autograd")
_LIB.impl("quantize_fp8", _quantize_fp8_cpu, "CPU")
_LIB.impl("dequantize_fp8", _dequantize_cpu, "CPU")
torch.library.register_fake("fp8train::dequantize_fp8", _dequantize_fake, lib=_LIB)
_LIB.impl("amax", _amax_cpu, "CPU")
_LIB.impl("decode_fp8", _decode_cpu, "CPU")
_LIB.impl("gemm_epilogue", _gemm_epilogue_cpu, "CPU")
torch.library.register_fake("fp8train::gemm_epilogue", _gemm_epilogue_fake, lib=_LIB)
_LIB.impl("gemm_epilogue_out", _gemm_epilogue_out_cpu, "CPU")
torch.library.register_fake("fp8train::gemm_epilogue_out", _gemm_epilogue_out_fake, lib=_LIB)
torch.library.register_fake("fp8train::quantize_fp8", _quantize_fp8_fake, lib=_LIB)
torch.library.register_fake("fp8train::amax", _amax_fake, lib=_LIB)
torch.library.register_fake("fp8train::decode_fp8", _decode_fake, lib=_LIB)
quantize_fp8 = torch.ops.fp8train.quantize_fp8.default
amax = torch.ops.fp8train.amax.default
decode = torch.ops.fp8train.decode_fp8.default
dequantize_fp8 = torch.ops.fp8train.dequantize_fp8.default
gemm_epilogue_op = torch.ops.fp8train.gemm_epilogue.default
gemm_epilogue_out_op = torch.ops.fp8train.gemm_epilogue_out.default


def decodable(data: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``decode_fp8`` takes these bytes: CPU, dense (contiguous or a transpose), fp32/bf16 out."""
    return (data.device.type == "cpu" and data.numel() > 0 and dtype in _INPUT_DTYPES
            and dense_kind(data) is not None)
