"""The torch cast chain (amax -> scale -> divide -> clamp -> float8 cast): the ``eager`` kernel, op by op, and the
``compiled`` kernel, the same function through torch.compile (fused into a couple of passes; for GPUs, where no
native kernel runs). quant.quantize calls ``run(quantize_impl, ...)`` and crops block tiles with ``untile``.
"""

from __future__ import annotations

import math
import types

import torch

from fp8train.numerics.formats import Fp8Format
from fp8train.numerics.names import Granularity
from fp8train.numerics.scaling import amax_of, as_blocks, compact_block_scale, format_scale

__all__ = ["quantize_impl", "untile", "run", "eager_division_options"]


def _divide(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in fp32 (a fresh tensor). A float64 x is divided in float64 first: its values may lie beyond
    fp32's range while x / scale does not. bf16/fp16 inputs are widened first (a 0-d fp32 scale would not
    promote them, and the division must not round to bf16)."""
    if x.dtype == torch.float32:
        return x / scale
    if x.dtype == torch.float64:
        return (x / scale).float()
    return x.float().div_(scale)


def _cast_kernel(x, scale_b, fmt: Fp8Format, saturate: bool, keep_values: bool):
    """(float8 data, fp32 values or None) for x / scale, with torch's own float8 cast. NaN stays NaN.
    Out-of-range: clip (saturate) or inf/NaN by the format's rule; an input inf saturates to max, like the OCP
    saturating conversion."""
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
    if overflow is not None:  # in fp32, then one cast (inductor has no select on float8 tensors)
        special = math.inf if fmt.has_inf else math.nan
        y = torch.where(overflow, y.sign() * special, y)
    data = y.to(fmt.torch_dtype)
    return data, (data.float() if keep_values else None)


def quantize_impl(x, scale, fmt: Fp8Format, granularity: str, br: int, bc: int, axis: int, margin: int,
                  pow2: bool, saturate: bool, keep_values: bool, with_amax: bool):
    """amax -> scale -> cast in one function, so torch.compile fuses it into a couple of passes. With a given
    ``scale`` the amax is still taken when ``with_amax`` (delayed scaling records it): in the same compiled graph,
    from the same read of x."""
    amax = None
    source = as_blocks(x, br, bc) if granularity == Granularity.BLOCK else x  # blocks: padded tiles; quantize() crops
    if scale is None or with_amax:
        amax = amax_of(source, granularity, axis)
    if scale is None:
        scale = format_scale(amax, fmt, margin, pow2)
    elif granularity == Granularity.BLOCK:
        scale = scale.reshape(*scale.shape[:-1], 1, scale.shape[-1], 1)  # (.., Rb, Cb) -> tile dims
    data, grid = _cast_kernel(source, scale, fmt, saturate, keep_values)
    if granularity == Granularity.BLOCK:
        scale = compact_block_scale(scale)
        amax = None if amax is None else compact_block_scale(amax)
    return data, scale, amax, grid


def untile(tiles: torch.Tensor, shape, br: int, bc: int) -> torch.Tensor:
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


def run(fn, key, *args, compiled: bool):
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
