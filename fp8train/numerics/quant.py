"""Quantization to FP8 at any granularity, and the error statistics of doing so.

Convention (as in ``torch._scaled_mm``): a scale is the DEQUANTIZATION scale, ``x ~= data.float() * scale``.
Quantizing is ``cast(clamp(x / scale, -max, max))``; current scaling picks ``scale = amax / max * 2**margin``.

Granularities, for a tensor ``x``:

- ``tensor``: one scale, shape ``()``.
- ``row``: one scale per row along ``axis`` (the dim a scale is shared along). ``x`` (M, K) with ``axis=-1`` has
  per-token scales of shape (M, 1); ``axis=0`` gives per-column scales of shape (1, K).
- ``block``: one scale per (br, bc) tile of the last two dims, shape (*lead, ceil(R/br), ceil(C/bc)). Dims that
  are not a multiple of the block are zero-padded for the amax, which leaves the amax unchanged.

The amax and the scale rule are in ``fp8train.numerics.scaling`` (re-exported here); this module casts.

Kernels (``kernel=``, all bit-identical): ``eager``, ``native`` and ``compiled``, see
``fp8train.numerics.cast_kernels``; a case the native kernel does not take runs ``eager`` (same bytes). Inside a
region that torch.compile is already tracing (``train.compile``), the eager math is traced inline.

The cast path, top to bottom: ``quantize`` checks its arguments and normalizes the layout once, then calls ONE
kernel entry: ``native_quantize`` (the C kernel's op, typed arguments) or ``torch_cast.run(quantize_impl, ...)``
(eager, or through torch.compile).
"""

from __future__ import annotations

import math

import torch

from fp8train.numerics import native_cast
from fp8train.numerics.cast_kernels import COMPILED, EAGER, NATIVE, QUANT_KERNELS, check_kernel
from fp8train.numerics.formats import FORMATS, Fp8Format, get_format
from fp8train.numerics.fp8_tensor import Fp8Tensor
from fp8train.numerics.names import Granularity
from fp8train.numerics.native_call import plain_call
from fp8train.numerics.native_layout import layout as native_layout
from fp8train.numerics.scaling import (GRANULARITIES, check_amax_floor, check_amax_range, check_input, check_layout,
                                       check_margin, compute_amax, expand_scale, max_scale, scale_from_amax,
                                       scale_rule, scale_shape_of)
from fp8train.numerics.torch_cast import eager_division_options, quantize_impl, run, untile

__all__ = [
    "Fp8Tensor", "quantize", "compute_amax", "scale_from_amax", "expand_scale", "decode_fp8",
    "quant_error", "convert_dialect", "GRANULARITIES", "QUANT_KERNELS", "max_scale", "scale_rule", "native_quantize",
    "eager_division_options", "value_copies",
]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what check_input allows


def decode_fp8(data: torch.Tensor, fmt=None, kernel: str = EAGER, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 tensor -> its values in fp32 (or `dtype`, bf16: also exact). ``kernel``: 'native' a 256-entry table
    where it takes the bytes; otherwise torch's own float8 cast (traced inline when compiled)."""
    fmt = get_format(fmt) if fmt is not None else _format_of(data.dtype)
    check_kernel(kernel)
    if kernel == NATIVE and not torch.compiler.is_compiling() and native_cast.decodable(data, dtype) \
            and native_cast.available():  # a 256-entry table, vectorized
        return native_cast.decode(data, fmt.name, dtype)
    return (data if data.dtype == fmt.torch_dtype else data.view(fmt.torch_dtype)).to(dtype)


def _format_of(dtype: torch.dtype) -> Fp8Format:
    for fmt in FORMATS.values():
        if fmt.torch_dtype == dtype:
            return fmt
    raise ValueError(f"not an FP8 dtype: {dtype}")


# ------------------------------------------------------------------------------------------------------------
# Public entry points
# ------------------------------------------------------------------------------------------------------------
def quantize(x: torch.Tensor, fmt="e4m3fn", *, granularity: str = "tensor", block=(1, 128), axis: int = -1,
             margin: int = 0, pow2: bool = False, saturate: bool = True, scale=None,
             keep_values=False, validate_scale: bool = True, kernel: str = EAGER,
             keep_dequantized: bool = False, with_amax: bool = False, nonfinite_count=None,
             pending_amax=None) -> Fp8Tensor:
    """Quantize ``x`` to FP8. ``scale`` (a dequant scale, shaped per the granularity) skips the amax.

    ``keep_values`` also keeps the fp32 copy of the FP8 values the kernel produced (saves a decode when the
    caller feeds them straight into a GEMM); ``torch.bfloat16`` keeps a bf16 copy instead (``.values_bf16``:
    the same values, exact, as ``values.to(torch.bfloat16)`` gives them), a tuple of dtypes keeps each; the native
    kernel writes them in the same pass as the bytes. ``validate_scale=False`` skips checking that a given scale is
    finite and positive, a host sync per call on a GPU: for scales from ``scale_from_amax``, which guarantees both.
    ``kernel``: one of QUANT_KERNELS (see the module docstring); all give the same bits.
    ``keep_dequantized`` also keeps ``data * scale`` in fp32 (``.dequantized``: what an emulated GEMM whose scales
    vary along its contracted dim reads); the native kernel writes it in the same pass, instead of the values.
    ``with_amax`` (with a given ``scale``: delayed scaling) also returns x's amax, taken in the same pass as the
    cast by the native and compiled kernels (``.amax``; without a scale the amax is always returned).
    A block larger than the tensor is one block over the whole tensor (it is recorded at the tensor's size).
    ``nonfinite_count`` / ``pending_amax`` (a quantizer's scaling state: one int64 / fp32 value on the CPU): where
    the native kernel runs and takes the amax, it also adds 1 to the count when an amax is NaN/inf and raises the
    pending amax to the largest finite one, in the same op, and the result's ``amax_recorded`` is True; elsewhere
    they are left to the caller (``amax_recorded`` False).
    """
    if not (isinstance(x, torch.Tensor) and x.dtype in _INPUT_DTYPES):
        check_input(x)  # (raises for anything that is not a float tensor of at least 16 bits)
    fmt = fmt if isinstance(fmt, Fp8Format) else get_format(fmt)
    if kernel not in QUANT_KERNELS:
        check_kernel(kernel)  # (raises)
    margin = margin if type(margin) is int and -256 <= margin <= 256 else check_margin(margin)
    br, bc = check_layout(granularity, block, axis, x.dim())
    if granularity == Granularity.ROW:
        axis = axis % max(x.dim(), 1)
    if granularity == Granularity.BLOCK:  # never pad past the tensor: a huge block once tried to allocate terabytes
        rows, cols = (1, x.shape[0]) if x.dim() == 1 else x.shape[-2:]
        br, bc = max(min(br, rows), 1), max(min(bc, cols), 1)
    if scale is not None:
        if not (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.device == x.device):
            scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        scale = _check_scale_shape(scale, x.shape, granularity, br, bc, axis)
        if validate_scale and not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise ValueError("scale must be finite and > 0 everywhere (it is a dequantization scale)")
    keep_fp32, keep_bf16 = (keep_values, False) if type(keep_values) is bool else value_copies(keep_values)
    if x.numel() == 0:
        empty = _quantize_empty(x, fmt, granularity, br, bc, axis, scale, keep_fp32 or keep_bf16)
        empty.amax = torch.zeros_like(empty.scale) if with_amax else empty.amax
        return _split_values(empty, keep_fp32, keep_bf16)
    if scale is None and x.dtype == torch.float64:  # what fp32 scales cannot hold, above and below: an error
        check_amax_range(x.detach().abs().amax(), fmt, margin)
        check_amax_floor(x.detach(), fmt, granularity, br, bc, axis, margin, bool(pow2))
    if kernel == NATIVE:
        quantized = native_quantize(x, fmt, granularity, br, bc, axis, margin, bool(pow2), saturate, scale,
                                    keep_fp32, keep_bf16, keep_dequantized, with_amax,
                                    nonfinite_count=nonfinite_count, pending_amax=pending_amax)
        if quantized is not None:
            return quantized
        kernel = EAGER  # not a case the C kernel takes: the same bytes eagerly
    return _torch_quantize(x, fmt, granularity, br, bc, axis, margin, bool(pow2), bool(saturate), scale,
                           keep_fp32, keep_bf16, keep_dequantized, with_amax, kernel == COMPILED)


def _torch_quantize(x, fmt: Fp8Format, granularity: str, br: int, bc: int, axis: int, margin: int, pow2: bool,
                    saturate: bool, scale, keep_fp32: bool, keep_bf16: bool, keep_dequantized: bool,
                    with_amax: bool, compiled: bool) -> Fp8Tensor:
    """quantize() through the torch chain (torch_cast.quantize_impl), op by op or through torch.compile."""
    keep_any = keep_fp32 or keep_bf16
    with_amax = with_amax and scale is not None
    key = (fmt.name, granularity, br, bc, axis, margin, pow2, saturate, scale is None, keep_any, with_amax)
    with torch.no_grad():  # not x.detach(): one dispatched op less per call
        data, scale, amax, grid = run(quantize_impl, key, x, scale, fmt, granularity, br, bc, axis, margin,
                                      pow2, saturate, keep_any, with_amax, compiled=compiled)
    if with_amax and amax.dtype != torch.float32:  # (a float64 x) fp32, as compute_amax gives it
        amax = amax.float()
    if granularity == Granularity.BLOCK:
        data = untile(data, x.shape, br, bc)
        grid = untile(grid, x.shape, br, bc) if grid is not None else None
    data = data if data.dtype == fmt.torch_dtype else data.view(fmt.torch_dtype)
    quantized = _split_values(Fp8Tensor(data, scale, fmt, granularity, (br, bc), axis, amax, grid), keep_fp32,
                              keep_bf16)
    if keep_dequantized:
        quantized.dequantized = quantized.dequantize(torch.float32)
    return quantized


def value_copies(keep_values) -> tuple[bool, bool]:
    """``keep_values`` (False, True = fp32, a dtype, or a tuple of dtypes) -> (keep fp32 values, keep bf16)."""
    if not isinstance(keep_values, (torch.dtype, tuple, list)):
        return bool(keep_values), False
    dtypes = keep_values if isinstance(keep_values, (tuple, list)) else (keep_values,)
    bad = [d for d in dtypes if d not in (torch.float32, torch.bfloat16)]
    if bad:
        raise ValueError(f"keep_values takes True/False, torch.float32, torch.bfloat16 or a tuple of them; got "
                         f"{keep_values!r}")
    return torch.float32 in dtypes, torch.bfloat16 in dtypes


def _split_values(q: Fp8Tensor, keep_fp32: bool, keep_bf16: bool) -> Fp8Tensor:
    """The eager kernels make fp32 values: the bf16 copy is converted from them (as a GEMM reading bf16 would)."""
    if keep_bf16 and q.values is not None:
        q.values_bf16 = q.values.to(torch.bfloat16)
    if not keep_fp32:
        q.values = None
    return q


def _check_scale_shape(scale: torch.Tensor, shape, granularity: str, br: int, bc: int, axis: int) -> torch.Tensor:
    """A given scale fits the granularity: one value for a tensor; for rows and blocks the documented scale shape,
    or a shape that broadcasts to it (blocks get it expanded, since their tiling reshapes the scale). Anything
    else is a ValueError naming both shapes, not a broadcasting error deep in the cast."""
    expected = scale_shape_of(shape, granularity, br, bc, axis)
    if granularity == Granularity.TENSOR:
        fits = scale.numel() == 1
    else:
        try:
            fits = torch.broadcast_shapes(scale.shape, expected) == torch.Size(expected)
        except RuntimeError:
            fits = False
    if not fits:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; granularity={granularity!r} on x of shape "
                         f"{tuple(shape)} needs {'one value' if granularity == Granularity.TENSOR else expected}")
    return scale.expand(expected) if granularity == Granularity.BLOCK and scale.shape != torch.Size(expected) else scale


def native_quantize(x, fmt: Fp8Format, granularity: str, br: int, bc: int, axis: int, margin: int, pow2: bool,
                    saturate: bool, scale, keep_fp32: bool, keep_bf16: bool, keep_dequantized: bool = False,
                    with_amax: bool = False, mx: bool = False, nonfinite_count=None, pending_amax=None):
    """quantize() through the C kernel (one op, typed arguments), or None where it does not apply (or the kernel
    is not built, or torch.compile is tracing). Arguments as quantize() normalized them (a block no larger than
    the tensor, a non-negative row axis). ``mx``: MX's power-of-two scale rule instead of the amax rule.
    ``nonfinite_count``, ``pending_amax``: as quantize's (updated where the amax is taken)."""
    if torch.compiler.is_compiling() or not native_cast.available():
        return None
    lay = native_layout(x, granularity, br, bc, axis)
    if lay is None or (scale is not None and tuple(scale.shape) != lay.scale_shape and not (
            granularity == Granularity.TENSOR and scale.numel() == 1 and scale.dim() <= 1 <= x.dim())):
        return None
    if keep_dequantized and keep_bf16:
        return None  # (not a combination any caller asks for: value * scale is not exact in bf16)
    dequantized_only = keep_dequantized and not keep_fp32  # the kernel's values buffer holds value * scale
    with_amax = scale is None or with_amax
    records = with_amax and (nonfinite_count is not None or pending_amax is not None)
    if plain_call(x, scale, nonfinite_count, pending_amax):  # (the op's CPU implementation, directly)
        data, scale_out, amax, values, values_bf16 = native_cast.quantize_laid_out(
            x, lay, scale, fmt.name, mx, bool(saturate), margin, pow2, keep_fp32 or keep_dequantized, keep_bf16,
            dequantized_only, with_amax, nonfinite_count if records else None, pending_amax if records else None)
    else:
        data, scale_out, amax, values, values_bf16 = native_cast.quantize_fp8(
            x, scale, fmt.name, granularity, br, bc, axis, margin, pow2, mx, bool(saturate),
            keep_fp32 or keep_dequantized, keep_bf16, dequantized_only, with_amax,
            nonfinite_count if records else None, pending_amax if records else None)
    quantized = Fp8Tensor(data, scale if scale is not None else scale_out, fmt, granularity, (br, bc), axis,
                          amax if with_amax else None, values if keep_fp32 else None,
                          values_bf16=values_bf16 if keep_bf16 else None, amax_recorded=records)
    if keep_dequantized:
        quantized.dequantized = values if dequantized_only else quantized.dequantize(torch.float32)
    return quantized


def _quantize_empty(x, fmt: Fp8Format, granularity: str, br: int, bc: int, axis: int, scale, keep_values: bool):
    """An empty tensor: empty data, and the scale an amax of 0 gives (1.0) in the granularity's shape."""
    shape = scale_shape_of(x.shape, granularity, br, bc, axis)
    amax = None if scale is not None else torch.zeros(shape, device=x.device)
    scale = torch.ones(shape, device=x.device) if scale is None else scale
    data = torch.empty(x.shape, dtype=fmt.torch_dtype, device=x.device)
    values = torch.empty(x.shape, device=x.device) if keep_values else None
    return Fp8Tensor(data, scale, fmt, granularity, (br, bc), axis, amax, values)


def quant_error(x: torch.Tensor, q: Fp8Tensor) -> dict:
    """How much quantizing ``x`` into ``q`` cost.

    overflow_frac: finite elements whose |x / scale| lies past max + half the top spacing (they were clipped);
    underflow_frac: finite nonzero elements that became 0; rel_l2 and sqnr_db over finite elements;
    nonfinite_frac: NaN/inf elements of x.
    """
    x = x.detach().float()
    deq = q.dequantize(torch.float32)
    scale = q.expanded_scale()
    finite = torch.isfinite(x)
    n = max(x.numel(), 1)
    limit = (q.fmt.max + q.fmt.step_at_max / 2) * scale
    overflow = (x.abs() > limit) & finite
    underflow = (x != 0) & (deq == 0) & finite
    xf = torch.where(finite, x, torch.zeros_like(x))
    err = torch.where(finite, x - torch.nan_to_num(deq, nan=0.0, posinf=0.0, neginf=0.0), torch.zeros_like(x))
    signal, noise = float(xf.double().pow(2).sum()), float(err.double().pow(2).sum())
    return {
        "overflow_frac": float(overflow.sum()) / n,
        "underflow_frac": float(underflow.sum()) / n,
        "nonfinite_frac": float((~finite).sum()) / n,
        "rel_l2": math.sqrt(noise / signal) if signal > 0 else 0.0,
        "sqnr_db": 10 * math.log10(signal / noise) if noise > 0 and signal > 0 else math.inf,
        "numel": x.numel(),
    }


def convert_dialect(q: Fp8Tensor, fmt) -> Fp8Tensor:
    """Re-encode between the OCP and FNUZ dialects (or any two FP8 formats), adjusting the scale so the
    dequantized values are kept.

    OCP e4m3fn -> e4m3fnuz is always exact with the scale doubled: FNUZ is OCP shifted down one binade and
    448 / 2 = 224 < 240. For the other directions the power-of-two factors 1, 2 and 1/2 are tried and the first
    under which every value is representable wins; if none is exact, the first that clips nothing is used and
    the few values that must round do so to nearest-even (then ``exact`` is False on the result's check).
    """
    target = get_format(fmt)
    values = q.unscaled(torch.float32)
    finite = torch.isfinite(values)
    amax = float(values[finite].abs().max()) if bool(finite.any()) else 0.0
    factors = (1.0, 2.0, 0.5) if target.max < q.fmt.max else (1.0, 0.5, 2.0)
    fitting = [f for f in factors if amax / f <= target.max]
    if not fitting:  # only possible between formats of very different range
        fitting = [2.0 ** math.ceil(math.log2(amax / target.max))]
    chosen = None
    for factor in fitting:
        moved = quantize(values / factor, target, scale=torch.ones(()), keep_values=True)
        if torch.equal(moved.values[finite], (values / factor)[finite]):
            chosen = (factor, moved)
            break
        chosen = chosen or (factor, moved)
    factor, moved = chosen
    return Fp8Tensor(moved.data, (q.scale * factor).float(), target, q.granularity, q.block, q.axis, q.amax)
