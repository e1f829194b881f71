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

Kernels (``kernel=``, all bit-identical, each checked against ml_dtypes by the tests):

- ``eager``: torch ops run one by one, torch's own float8 cast. No compile; the default.
- ``compiled_cast``: the same chain (amax -> scale -> divide -> clamp -> float8 cast) through torch.compile,
  fused into a couple of passes. Fast where inductor vectorizes the float8 cast (avx512 CPUs, GPUs).
- ``compiled_select``: torch.compile of a cast written with compare-and-select arithmetic
  (``arithmetic_codec.round_and_encode``), for CPUs where the compiled float8 cast stays a scalar routine.
- ``native``: fp8train's C kernel (``fp8train.numerics.native_cast``, built with the system C compiler on first
  use): amax, scale and cast in one op and one pass per tile row, for fp32/bf16 CPU tensors (contiguous or a
  transposed 2-D view); anything else, or a machine where it does not build, runs ``eager`` (same bytes).
Which one is fastest differs per machine: ``fp8train.numerics.kernel_probe`` measures them once and caches the
answer per machine and torch version (``kernel="auto"`` in Fp8Linear and the config key ``fp8.quantize_kernel``).
Inside a region that torch.compile is already tracing (``train.compile``), the chosen math is traced inline.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field
from typing import Optional

import torch

from fp8train.numerics import native_cast
from fp8train.numerics.arithmetic_codec import decode_arithmetic, round_and_encode
from fp8train.numerics.formats import FORMATS, Fp8Format, get_format
from fp8train.numerics.scaling import (GRANULARITIES, SCALE_CAPS, amax_of, as_blocks, check_amax_floor,
                                       check_amax_range, check_input, check_layout, check_margin,
                                       compact_block_scale, compute_amax, expand_scale, format_scale, fp32_exact,
                                       max_scale, scale_from_amax, scale_rule, scale_shape_of)

__all__ = [
    "Fp8Tensor", "quantize", "compute_amax", "scale_from_amax", "expand_scale", "cast_to_fp8", "decode_fp8",
    "quant_error", "convert_dialect", "GRANULARITIES", "QUANT_KERNELS", "max_scale", "scale_rule", "native_quantize",
    "eager_division_options",
]

QUANT_KERNELS = ("eager", "compiled_cast", "compiled_select", "native")



# ------------------------------------------------------------------------------------------------------------
# The quantized tensor
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Fp8Tensor:
    data: torch.Tensor  # float8, shaped like the source tensor
    scale: torch.Tensor  # fp32 dequantization scale (shape: see the module docstring)
    fmt: Fp8Format
    granularity: str = "tensor"
    block: tuple[int, int] = (1, 128)
    axis: int = -1
    amax: Optional[torch.Tensor] = None  # the amax the scale was made from (None when the scale was given)
    values: Optional[torch.Tensor] = field(default=None, repr=False)  # data as fp32, when the kernel kept it
    dequantized: Optional[torch.Tensor] = field(default=None, repr=False)  # data * scale in fp32, when kept
    values_bf16: Optional[torch.Tensor] = field(default=None, repr=False)  # data as bf16, when the kernel kept it

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def unscaled(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The FP8 values without the scale, exactly, in ``dtype`` (FP8 values are exact in bf16 and fp32)."""
        if dtype == torch.bfloat16 and self.values_bf16 is not None:
            return self.values_bf16
        values = self.values if self.values is not None else decode_fp8(self.data, self.fmt)
        return values if values.dtype == dtype else values.to(dtype)

    def expanded_scale(self) -> torch.Tensor:
        return expand_scale(self.scale, self.data.shape, self.granularity, self.block, self.axis)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale`` in ``dtype``. The product is taken in float64 when that is asked for (exact: an FP8
        value has at most 4 significant bits, a scale 24), else in float32 and then rounded to ``dtype``."""
        if dtype == torch.float32 and self.dequantized is not None:
            return self.dequantized
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        return (self.unscaled(compute) * self.expanded_scale().to(compute)).to(dtype)

    def without_values(self) -> "Fp8Tensor":
        """The same tensor minus the copies of its values (what to keep around, e.g. for backward)."""
        return Fp8Tensor(self.data, self.scale, self.fmt, self.granularity, self.block, self.axis, self.amax)


# ------------------------------------------------------------------------------------------------------------
# Argument checks (the shared ones live in fp8train.numerics.scaling)
# ------------------------------------------------------------------------------------------------------------

def _check_kernel(kernel: str) -> None:
    if kernel not in QUANT_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(QUANT_KERNELS)}, got {kernel!r} "
                         "('auto' is resolved by fp8train.numerics.kernel_probe.resolve_kernel)")


# ------------------------------------------------------------------------------------------------------------
# The cast: scale, clamp, round to the FP8 grid, assemble the byte
# ------------------------------------------------------------------------------------------------------------
def _divide(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in fp32 (a fresh tensor). A float64 x is divided in float64 first: its values may lie beyond
    fp32's range while x / scale does not. bf16/fp16 inputs are widened first (a 0-d fp32 scale would not
    promote them, and the division must not round to bf16)."""
    if x.dtype == torch.float32:
        return x / scale
    if x.dtype == torch.float64:
        return (x / scale).float()
    return x.float().div_(scale)


def _cast_kernel(x, scale_b, fmt: Fp8Format, saturate: bool, torch_cast: bool, keep_values: bool):
    """(float8 data, fp32 grid values or None) for x / scale. NaN stays NaN. Out-of-range: clip (saturate) or
    inf/NaN by the format's rule; an input inf saturates to max, like the OCP saturating conversion.

    ``torch_cast`` uses torch's own float8 cast; otherwise the grid rounding and byte assembly are written out with
    compare-and-select arithmetic (``arithmetic_codec.round_and_encode``). Both give the same bits.
    """
    y = _divide(x, scale_b)
    # past max + half the top spacing a value rounds beyond max: clipped, or inf/NaN when not saturating.
    # Exactly at it is a tie, and ties go to even: down to max when max's last mantissa bit is 0 (e4m3fn's
    # 1.110b * 2^8: 464 -> 448), up past max otherwise (e5m2, the fnuz formats).
    limit = fmt.max + fmt.step_at_max / 2
    max_is_even = (fmt.max / fmt.step_at_max) % 2 == 0
    overflow = None if saturate else (y.abs() > limit if max_is_even else y.abs() >= limit)
    if torch.compiler.is_compiling():
        # inductor's clamp can flip a NaN's sign bit; eager keeps it, and so must the bytes: put it back
        y = torch.where(torch.isnan(y), y, y.clamp(-fmt.max, fmt.max))
    else:
        y = y.clamp_(-fmt.max, fmt.max)  # in place: y is fresh
    if torch_cast:
        if overflow is not None:  # in fp32, then one cast (inductor has no select on float8 tensors)
            special = math.inf if fmt.has_inf else math.nan
            y = torch.where(overflow, y.sign() * special, y)
        data = y.to(fmt.torch_dtype)
        return data, (data.float() if keep_values else None)
    nan = torch.isnan(y)
    y = torch.where(nan, 0.0, y)
    grid, codes = round_and_encode(y, fmt)
    if overflow is not None and fmt.has_inf:
        inf_code = (0x7F >> fmt.mantissa_bits) << fmt.mantissa_bits  # exponent all ones, mantissa 0
        codes = torch.where(overflow, (codes & 0x80) | inf_code, codes)
        grid = torch.where(overflow, grid.sign() * math.inf, grid)
    elif overflow is not None:
        codes = torch.where(overflow, fmt.nan_codes[0], codes)
        grid = torch.where(overflow, math.nan, grid)
    codes = torch.where(nan, fmt.nan_codes[0], codes)
    grid = torch.where(nan, math.nan, grid) if keep_values else None
    # Bytes as uint8: the float8 view is taken outside the compiled region.
    return codes.to(torch.uint8), grid


def _quantize_impl(x, scale, fmt: Fp8Format, granularity: str, br: int, bc: int, axis: int, margin: int,
                   pow2: bool, saturate: bool, keep_values: bool, torch_cast: bool):
    """amax -> scale -> cast in one function, so torch.compile fuses it into a couple of passes."""
    amax = None
    source = as_blocks(x, br, bc) if granularity == "block" else x  # blocks: padded tiles; quantize() crops
    if scale is None:
        amax = amax_of(source, granularity, axis)
        scale = format_scale(amax, fmt, margin, pow2)
    elif granularity == "block":
        scale = scale.reshape(*scale.shape[:-1], 1, scale.shape[-1], 1)  # (.., Rb, Cb) -> tile dims
    data, grid = _cast_kernel(source, scale, fmt, saturate, torch_cast, keep_values)
    if granularity == "block":
        scale = compact_block_scale(scale)
        amax = None if amax is None else compact_block_scale(amax)
    return data, scale, amax, grid


def _untile(tiles: torch.Tensor, shape, br: int, bc: int) -> torch.Tensor:
    """(*lead, Rb, br, Cb, bc) padded tiles -> ``shape``, dropping the padding.

    Done outside the compiled region on purpose: with the crop fused into the kernel, inductor (torch 2.13, CPU)
    generated the output loop over full blocks only and never wrote the ragged last block (garbage bytes for
    e.g. a (96, 300) tensor with 1x128 blocks)."""
    rows, cols = (1, shape[0]) if len(shape) == 1 else shape[-2:]
    lead = tiles.shape[:-4]
    flat = tiles.reshape(*lead, tiles.shape[-4] * br, tiles.shape[-2] * bc)
    if flat.shape[-2] != rows or flat.shape[-1] != cols:
        flat = flat[..., :rows, :cols].contiguous()
    if torch.compiler.is_compiling():
        # a view of the tiles would alias an intermediate of the traced graph when saved for backward, which
        # dynamo cannot lift out of an autograd.Function; inductor fuses the copy into the cast
        return flat.reshape(shape).clone()
    return flat.reshape(shape)


_compiled: dict = {}
_DIVISION_FLAG = "eager_numerics.division_rounding"


def eager_division_options() -> dict:
    """torch.compile options that make inductor's fp32 division IEEE round-to-nearest, as eager's is.

    Triton lowers an fp32 `x / y` to an approximate division (div.full) unless inductor is told to emit div_rn:
    with a scale that is not a power of two, a quotient one ulp off can round to the neighbouring FP8 code, so
    compiled and eager quantization would differ in a few bytes. The switch is inductor's
    `eager_numerics.division_rounding` (torch 2.11 and 2.13); a torch without it gets no option (and no promise).
    The C++ (CPU) backend divides exactly either way."""
    import torch._inductor.config as inductor_config

    return {_DIVISION_FLAG: True} if _DIVISION_FLAG in inductor_config.get_config_copy() else {}


def _run(fn, key, *args, compiled: bool):
    """``fn(*args)``, through torch.compile when ``compiled`` (and not already inside a traced region, where the
    math is traced inline into the caller's graph)."""
    if not compiled or torch.compiler.is_compiling():
        return fn(*args)
    compiled_fn = _compiled.get((fn.__name__, key))
    if compiled_fn is None:
        import torch._dynamo as dynamo  # here, not at the top: importing dynamo costs every process ~1.7 s at start

        # One compiled function per static configuration (format, granularity, options), each on its OWN copy
        # of the code object: dynamo keeps its cache per code object, and sharing one across formats made it
        # treat the format's integer fields (bias, mantissa bits) as symbolic after the second format, which
        # broke the graph into slow pieces. Shapes may still go dynamic within one configuration.
        dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{len(_compiled)}")
        clone = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        compiled_fn = _compiled[(fn.__name__, key)] = torch.compile(clone, dynamic=None,
                                                                    options=eager_division_options())
    return compiled_fn(*args)


def decode_fp8(data: torch.Tensor, fmt=None, kernel: str = "eager", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """FP8 tensor -> its values in fp32 (or `dtype`, bf16: also exact). ``kernel``: 'eager' uses torch's cast;
    'native' a 256-entry table; the compiled kernels decode the bytes with integer ops (torch's own float8 ->
    fp32 cast is a slow scalar routine on CPU)."""
    fmt = get_format(fmt) if fmt is not None else _format_of(data.dtype)
    _check_kernel(kernel)
    if kernel == "native" and not torch.compiler.is_compiling() and native_cast.decodable(data, dtype) \
            and native_cast.available():  # a 256-entry table, vectorized
        return native_cast.decode(data, fmt.name, dtype)
    if kernel in ("eager", "native") or data.numel() == 0:
        return (data if data.dtype == fmt.torch_dtype else data.view(fmt.torch_dtype)).to(dtype)
    values = _run(decode_arithmetic, fmt.name, data, fmt, compiled=True)
    return values if dtype == torch.float32 else values.to(dtype)


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
             keep_values=False, validate_scale: bool = True, kernel: str = "eager",
             keep_dequantized: bool = False) -> Fp8Tensor:
    """Quantize ``x`` to FP8. ``scale`` (a dequant scale, shaped per the granularity) skips the amax.

    ``keep_values`` also keeps the fp32 copy of the FP8 values the kernel produced (saves a decode when the
    caller feeds them straight into a GEMM); ``torch.bfloat16`` keeps a bf16 copy instead (``.values_bf16``:
    the same values, exact, as ``values.to(torch.bfloat16)`` gives them), a tuple of dtypes keeps each; the native
    kernel writes them in the same pass as the bytes. ``validate_scale=False`` skips checking that a given scale is finite
    and positive, a host sync per call on a GPU: for scales from ``scale_from_amax``, which guarantees both.
    ``kernel``: one of QUANT_KERNELS (see the module docstring); all give the same bits.
    ``keep_dequantized`` also keeps ``data * scale`` in fp32 (``.dequantized``: what an emulated GEMM whose scales
    vary along its contracted dim reads); the native kernel writes it in the same pass, instead of the values.
    A block larger than the tensor is one block over the whole tensor (it is recorded at the tensor's size).
    """
    check_input(x)
    fmt = get_format(fmt)
    _check_kernel(kernel)
    margin = check_margin(margin)
    br, bc = check_layout(granularity, block, axis, x.dim())
    if granularity == "row":
        axis = axis % max(x.dim(), 1)
    if granularity == "block":  # never pad past the tensor: a huge block once tried to allocate terabytes
        rows, cols = (1, x.shape[0]) if x.dim() == 1 else x.shape[-2:]
        br, bc = max(min(br, rows), 1), max(min(bc, cols), 1)
    if scale is not None:
        if not (isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.device == x.device):
            scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        scale = _check_scale_shape(scale, x.shape, granularity, br, bc, axis)
        if validate_scale and not bool((torch.isfinite(scale) & (scale > 0)).all()):
            raise ValueError("scale must be finite and > 0 everywhere (it is a dequantization scale)")
    keep_fp32, keep_bf16 = _value_copies(keep_values)
    if x.numel() == 0:
        empty = _quantize_empty(x, fmt, granularity, br, bc, axis, scale, keep_fp32 or keep_bf16)
        return _split_values(empty, keep_fp32, keep_bf16)
    if scale is None and x.dtype == torch.float64:  # what fp32 scales cannot hold, above and below: an error
        check_amax_range(x.detach().abs().amax(), fmt, margin)
        check_amax_floor(x.detach(), fmt, granularity, br, bc, axis, margin, bool(pow2))
    if kernel == "native":
        quantized = native_quantize(x, fmt, granularity, br, bc, axis, margin, bool(pow2), saturate, scale,
                                    keep_values, keep_dequantized=keep_dequantized)
        if quantized is not None:
            return quantized
        kernel = "eager"  # not a case the C kernel takes: the same bytes eagerly
    keep_any = keep_fp32 or keep_bf16
    key = (fmt.name, granularity, br, bc, axis, margin, bool(pow2), bool(saturate), scale is None, keep_any, kernel)
    with torch.no_grad():  # not x.detach(): one dispatched op less per call
        data, scale, amax, grid = _run(_quantize_impl, key, x, scale, fmt, granularity, br, bc, axis, margin,
                                       bool(pow2), bool(saturate), keep_any, kernel != "compiled_select",
                                       compiled=kernel != "eager")
    if granularity == "block":
        data = _untile(data, x.shape, br, bc)
        grid = _untile(grid, x.shape, br, bc) if grid is not None else None
    data = data if data.dtype == fmt.torch_dtype else data.view(fmt.torch_dtype)
    quantized = _split_values(Fp8Tensor(data, scale, fmt, granularity, (br, bc), axis, amax, grid), keep_fp32,
                              keep_bf16)
    if keep_dequantized:
        quantized.dequantized = quantized.dequantize(torch.float32)
    return quantized


def _value_copies(keep_values) -> tuple[bool, bool]:
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
    if granularity == "tensor":
        fits = scale.numel() == 1
    else:
        try:
            fits = torch.broadcast_shapes(scale.shape, expected) == torch.Size(expected)
        except RuntimeError:
            fits = False
    if not fits:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; granularity={granularity!r} on x of shape "
                         f"{tuple(shape)} needs {'one value' if granularity == 'tensor' else expected}")
    return scale.expand(expected) if granularity == "block" and scale.shape != torch.Size(expected) else scale


def native_quantize(x, fmt: Fp8Format, granularity: str, br: int, bc: int, axis: int, margin: int, pow2: bool,
                    saturate: bool, scale, keep_values, rule: int = native_cast.RULE_AMAX,
                    keep_dequantized: bool = False):
    """quantize() through the C kernel (one op), or None where it does not apply. The scale rule's constants
    are scaling.scale_rule's: the divisor fmt.max * 2**-margin, the cap, and whether the division is its fp32
    one (tests/test_native_cast.py checks the scales bit for bit against the eager rule and a reference)."""
    br, bc = native_cast.capped_block(x, br, bc)
    lay = native_cast.usable_layout(x, granularity, br, bc, axis)
    if lay is None or (scale is not None and tuple(scale.shape) != lay.scale_shape
                       and not (granularity == "tensor" and scale.numel() == 1 and scale.dim() <= 1 <= x.dim())):
        return None
    divisor = fmt.max * 2.0 ** -margin
    fp32_divide = not pow2 and fp32_exact(divisor) and divisor >= 1
    keep_values, keep_bf16 = _value_copies(keep_values)
    if keep_dequantized and keep_bf16:
        return None  # (not a combination any caller asks for: value * scale is not exact in bf16)
    dequantized_only = keep_dequantized and not keep_values  # the kernel's values buffer holds value * scale
    options = native_cast.CastOptions(fmt.name, granularity, br, bc, axis, rule, divisor, SCALE_CAPS[(fmt.name, pow2)],
                                      pow2, fp32_divide, math.frexp(fmt.max)[1] - 1, bool(saturate),
                                      bool(keep_values or keep_dequantized), dequantized_only, keep_bf16)
    data, scale_out, amax, values, values_bf16 = native_cast.quantize(x, scale, options)
    quantized = Fp8Tensor(data, scale if scale is not None else scale_out, fmt, granularity, (br, bc), axis,
                          None if scale is not None else amax, values if keep_values else None,
                          values_bf16=values_bf16 if keep_bf16 else None)
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


def cast_to_fp8(x: torch.Tensor, scale, fmt="e4m3fn", saturate: bool = True, granularity: str = "tensor",
                block=(1, 128), axis: int = -1) -> torch.Tensor:
    """The float8 bytes of ``x / scale`` (clamped or not): ``quantize`` with a given scale, data only."""
    return quantize(x, fmt, granularity=granularity, block=block, axis=axis, saturate=saturate,
                    scale=scale).data


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
