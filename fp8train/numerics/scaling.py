"""Scales: the amax of a tensor, row or block, and the documented rule that turns an amax into a scale.

Convention (as in ``torch._scaled_mm``): a scale is the DEQUANTIZATION scale, ``x ~= data.float() * scale``; current
scaling picks ``scale = amax / max * 2**margin`` (rounded up to a power of two with ``pow2``), capped so that
``max * scale`` stays finite. An amax of 0, NaN or inf never becomes a scale (1.0 instead): the non-finite value
is counted by the caller, and the scale stays usable. ``fp8train.numerics.quant`` casts with these scales; the
argument checks shared by both live here too, so every entry point rejects bad input with the same words.
"""

from __future__ import annotations

import math
import numbers
import operator

import torch
import torch.nn.functional as F

from fp8train.numerics import native_cast
from fp8train.numerics.cast_kernels import EAGER, NATIVE
from fp8train.numerics.native_layout import capped_block, layout as native_layout
from fp8train.numerics.formats import Fp8Format, get_format
from fp8train.numerics.names import Granularity
from fp8train.numerics.scale_limits import FP32_TINY, SCALE_CAPS, fp32_exact, max_scale

__all__ = ["GRANULARITIES", "compute_amax", "scale_from_amax", "expand_scale", "max_scale", "scale_rule",
           # shared with fp8train.numerics.quant: the argument checks and the steps of the scale rule
           "SCALE_CAPS", "amax_of", "as_blocks", "check_amax_floor", "check_amax_range", "check_input",
           "check_layout", "check_margin", "compact_block_scale", "format_scale", "fp32_exact", "scale_shape_of"]

GRANULARITIES = tuple(Granularity)
_AMINMAX_MIN_NUMEL = 1 << 20


# ------------------------------------------------------------------------------------------------------------
# Argument checks (user-facing errors name the argument and what is allowed)
# ------------------------------------------------------------------------------------------------------------
def check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise ValueError(f"x must be a float32/float16/bfloat16/float64 tensor, got dtype {x.dtype}")


def check_margin(margin) -> int:
    # An int: a fractional margin (1.5) used to be truncated silently; 2.0 is accepted as 2.
    if isinstance(margin, bool) or not isinstance(margin, numbers.Real) or not float(margin).is_integer():
        raise ValueError(f"margin must be an integer number of powers of two, got {margin!r}")
    if abs(margin) > 256:
        raise ValueError(f"margin must be within [-256, 256] (fp32 scales span 2^-126..2^128), got {margin!r}")
    return int(margin)



def check_layout(granularity: str, block, axis: int, ndim: int) -> tuple[int, int]:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity != Granularity.TENSOR and ndim == 0:
        raise ValueError(f"a 0-d tensor has no rows or blocks: use granularity='tensor', not {granularity!r}")
    if granularity == Granularity.ROW and not -max(ndim, 1) <= axis < max(ndim, 1):
        raise ValueError(f"axis={axis} is out of range for a {ndim}-d tensor")
    try:  # operator.index: an int (or numpy/torch integer), never a float silently truncated (1.5 -> 1)
        if len(block) != 2:
            raise ValueError
        br, bc = operator.index(block[0]), operator.index(block[1])
    except (TypeError, ValueError, IndexError, KeyError):
        raise ValueError(f"block must be two positive ints like (1, 128), got {block!r}") from None
    if br <= 0 or bc <= 0:
        raise ValueError(f"block sizes must be positive, got {block!r}")
    return br, bc


# ------------------------------------------------------------------------------------------------------------
# amax and scales
# ------------------------------------------------------------------------------------------------------------
def as_blocks(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """View the last two dims as (Rb, br, Cb, bc) tiles, zero-padding ragged edges."""
    if x.dim() == 1:
        x = x.unsqueeze(0)
    rows, cols = x.shape[-2:]
    pad_r, pad_c = -rows % br, -cols % bc
    if pad_r or pad_c:
        x = F.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(*x.shape[:-2], (rows + pad_r) // br, br, (cols + pad_c) // bc, bc)


def amax_of(x: torch.Tensor, granularity: str, axis: int) -> torch.Tensor:
    """max |x| (fp32; float64 for a float64 x, whose amax may lie beyond fp32's range). For blocks ``x`` is the
    tiles (``as_blocks``) and the amax keeps the tile dims ((*lead, Rb, 1, Cb, 1)), so it broadcasts onto them."""
    if torch.compiler.is_compiling():  # abs + amax fuse into one pass when compiled
        dims = () if granularity == Granularity.TENSOR else (axis,) if granularity == Granularity.ROW else (-3, -1)
        amax = x.abs().amax(dim=dims, keepdim=granularity != Granularity.TENSOR)
    elif granularity == Granularity.TENSOR and x.numel() >= _AMINMAX_MIN_NUMEL:
        low, high = torch.aminmax(x)  # eagerly the fastest pass over a big tensor: no |x| temporary
        amax = torch.maximum(high, low.neg())  # NaN propagates through both
    else:  # the inf-norm is max |x| in one op, without an |x| temporary (fewer ops on small tensors)
        dims = None if granularity == Granularity.TENSOR else axis if granularity == Granularity.ROW else (-3, -1)
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32  # exact: a max, no arithmetic
        amax = torch.linalg.vector_norm(x, math.inf, dim=dims, keepdim=granularity != Granularity.TENSOR, dtype=dtype)
    return amax if amax.dtype in (torch.float32, torch.float64) else amax.float()


def format_scale(amax: torch.Tensor, fmt: Fp8Format, margin: int, pow2: bool) -> torch.Tensor:
    """scale_rule for `fmt` with its precomputed cap; arguments already checked (scale_from_amax checks them)."""
    return scale_rule(amax, fmt.max, SCALE_CAPS[(fmt.name, pow2)], margin, pow2)


def scale_rule(amax: torch.Tensor, fmt_max, cap, margin: int, pow2: bool) -> torch.Tensor:
    """The documented scale rule; ``fmt_max`` and ``cap`` (``max_scale``) may be floats or tensors broadcasting
    against ``amax`` (one row per layer and role in the stacked delayed-scaling update).

    As if computed in float64 and rounded once to fp32: fmt_max * 2**-margin is exact, so one division gives
    amax / max * 2**margin; for an fp32 amax and an fp32-exact divisor that division is done in fp32, which
    gives the same bits (a correctly rounded fp32 quotient equals the float64 quotient rounded to fp32: 53 >=
    2 * 24 + 2 bits). Power-of-2 rounding runs in float64, where log2 of a value just above a power of two
    stays above it (in fp32 it can round down onto it, and the scale would then clip amax)."""
    divisor = fmt_max * 2.0 ** -margin
    # fp32 only where the quotient cannot overflow fp32 (divisor >= 1): an overflow would read as an inf amax
    if pow2 or amax.dtype != torch.float32 or not fp32_exact(divisor) or divisor < 1:
        scale = amax.double() / divisor
    else:
        scale = amax / divisor
    if pow2:  # round UP to a power of two, so amax / scale <= max and nothing clips
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    # amax 0 / NaN / inf never becomes a scale: NaN and 0 fail amax > 0, inf makes an inf quotient (finite amaxes
    # never do: in fp32 the divisor is >= 1, else float64). Tested on amax, not the quotient, which can underflow.
    scale = torch.where(amax > 0, scale, 1.0)
    scale = scale.nan_to_num(posinf=1.0)
    if isinstance(cap, torch.Tensor):
        scale = torch.minimum(scale.clamp_min(FP32_TINY), cap)
    else:
        scale = scale.clamp(FP32_TINY, cap)
    return scale if scale.dtype == torch.float32 else scale.float()


def check_amax_range(amax: torch.Tensor, fmt: Fp8Format, margin: int) -> None:
    """float64 inputs only (a host sync): values so large that no fp32 scale can hold them are an error, not a
    silent 448 with scale 1 (amax 1e300 once became inf in fp32 and fell back to scale 1)."""
    finite = amax[torch.isfinite(amax)]
    if finite.numel() and float(finite.max()) / fmt.max * 2.0 ** margin > max_scale(fmt.max, False):
        raise ValueError(f"x (float64) has |values| up to {float(finite.max()):.3g}: beyond what an fp32 "
                         f"{fmt.name} scale can represent (amax / {fmt.max:g} * 2**margin must stay below "
                         f"{max_scale(fmt.max, False):.3g}); rescale x first")


def check_amax_floor(x: torch.Tensor, fmt: Fp8Format, granularity: str, br: int, bc: int, axis: int, margin: int,
                     pow2: bool) -> None:
    """float64 inputs only (a host sync), the mirror of `check_amax_range`: a tensor, row or block whose values
    are nonzero but so small that even the smallest fp32 scale (2^-126, where the scale rule is clamped) rounds
    every one of them to 0 is an error, not silent zeros (|x| of 1e-300 once came back as an all-zero tensor).
    fp32 inputs are not checked (as on the overflow side): what they lose this way are fp32 subnormals, within
    the documented error bound (half a min subnormal times the scale)."""
    with torch.no_grad():
        amax = amax_of(as_blocks(x, br, bc) if granularity == Granularity.BLOCK else x, granularity, axis)
        scale = format_scale(amax, fmt, margin, pow2).double()
        # an FP8 value below half the min subnormal rounds to 0 (a tie rounds to even: 0 too)
        lost = (amax > 0) & torch.isfinite(amax) & (amax / scale <= fmt.min_subnormal / 2)
    if bool(lost.any()):
        where = "x" if granularity == Granularity.TENSOR else f"{int(lost.sum())} {granularity}(s) of x"
        raise ValueError(f"{where} (float64) has |values| only up to {float(amax[lost].max()):.3g}: below what an "
                         f"fp32 {fmt.name} scale can represent (even the smallest, 2^-126, would quantize all of "
                         f"them to 0); rescale x first")


def compute_amax(x, granularity: str = Granularity.TENSOR, block=(1, 128), axis: int = -1, kernel: str = EAGER):
    """max |x| per tensor, row or block (fp32, shaped like the scale). NaN propagates into the amax.
    ``kernel='native'`` reduces in one pass of the C kernel (native_cast) where it takes x: the same values."""
    check_input(x)
    br, bc = check_layout(granularity, block, axis, x.dim())
    if x.numel() == 0:
        return torch.zeros(scale_shape_of(x.shape, granularity, br, bc, axis), device=x.device)
    if kernel == NATIVE and not torch.compiler.is_compiling() and native_cast.available():
        br, bc = capped_block(x, br, bc)
        if native_layout(x, granularity, br, bc, axis) is not None:
            return native_cast.amax(x, granularity, br, bc, axis)
    with torch.no_grad():  # not x.detach(): that is one more dispatched op per call on the hot path
        x = as_blocks(x, br, bc) if granularity == Granularity.BLOCK else x
        amax = amax_of(x, granularity, axis)
        amax = amax if amax.dtype == torch.float32 else amax.float()
    return compact_block_scale(amax) if granularity == Granularity.BLOCK else amax


def scale_from_amax(amax: torch.Tensor, fmt, margin: int = 0, pow2: bool = False) -> torch.Tensor:
    """Dequantization scale ``amax / max * 2**margin`` (fp32). amax 0 or non-finite gives 1.0, never 0/inf/NaN;
    scales are capped so that ``fmt.max * scale`` stays finite (``max_scale``)."""
    fmt = get_format(fmt)
    amax = torch.as_tensor(amax, dtype=torch.float32)
    return format_scale(amax, fmt, check_margin(margin), bool(pow2))


def expand_scale(scale: torch.Tensor, shape, granularity: str = "tensor", block=(1, 128), axis: int = -1):
    """Broadcast a compact scale back to ``shape`` (tensor and row scales broadcast as they are)."""
    if granularity != Granularity.BLOCK:
        return scale
    br, bc = int(block[0]), int(block[1])
    rows, cols = (1, shape[0]) if len(shape) == 1 else tuple(shape[-2:])
    full = scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)[..., :rows, :cols]
    return full.reshape(shape)


def compact_block_scale(tile_scale: torch.Tensor) -> torch.Tensor:
    """(*lead, Rb, 1, Cb, 1) -> (*lead, Rb, Cb): the documented block-scale shape."""
    return tile_scale.reshape(*tile_scale.shape[:-4], tile_scale.shape[-4], tile_scale.shape[-2])


def scale_shape_of(shape, granularity: str, br: int, bc: int, axis: int) -> tuple:
    if granularity == Granularity.TENSOR:
        return ()
    if granularity == Granularity.ROW:
        return tuple(1 if d == axis % len(shape) else n for d, n in enumerate(shape))
    rows, cols = (1, shape[0]) if len(shape) == 1 else tuple(shape[-2:])
    return (*shape[:-2], -(-rows // br), -(-cols // bc))
