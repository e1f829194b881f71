"""Memory layout of a native cast call: which (batch, rows, cols) row-major matrix in memory a tensor is, and which
tile of it one scale covers (numerics/native_cast.c reads tensors this way). None: the C kernel does not take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from fp8train.numerics.formats import FORMATS
from fp8train.numerics.names import Granularity

__all__ = ["NativeLayout", "layout", "capped_block", "dense_kind", "scale_step", "kernel_outputs", "amax_output",
           "UNUSED_OUTPUTS", "INPUT_DTYPES", "FP8_DTYPES"]

INPUT_DTYPES = (torch.float32, torch.bfloat16)
FP8_DTYPES = tuple(f.torch_dtype for f in FORMATS.values())
_layouts: dict = {}  # (shape, strides, dtype, device, tiling) -> NativeLayout or None; a few entries per model


# ------------------------------------------------------------------------------------------------------------
# Memory layout: which (batch, rows, cols) matrix and which tile in memory a call is
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NativeLayout:
    batch: int
    rows: int  # of the row-major matrix in memory
    cols: int
    tile_rows: int  # the scale's tile in memory coordinates
    tile_cols: int
    transposed: bool  # x is the transpose of a contiguous 2-D tensor
    scale_shape: tuple  # the documented (logical) shape of the scale
    grid_rows: int  # the scale grid in memory order
    grid_cols: int


def dense_kind(x: torch.Tensor) -> Optional[str]:
    if x.is_contiguous():
        return "contiguous"
    if x.dim() == 2 and x.stride(0) == 1 and x.stride(1) == x.shape[0]:
        return "transposed"
    return None


def layout(x: torch.Tensor, granularity: str, block_rows: int = 1, block_cols: int = 1, axis: int = -1,
           dtypes: tuple = INPUT_DTYPES) -> Optional[NativeLayout]:
    """The native kernel's view of quantizing ``x`` (``axis`` normalized, blocks already capped to the tensor),
    or None when the native kernel does not take it (device, dtype, memory layout, an inner row axis).
    ``dtypes``: what x may be (fp32/bf16 to quantize; the FP8 dtypes to dequantize). Worked out once per shape,
    strides, dtype and tiling, then read from a table (the cast op and its caller both ask)."""
    key = (x.shape, x.stride(), x.dtype, x.device.type, granularity, block_rows, block_cols, axis, dtypes)
    try:
        return _layouts[key]
    except KeyError:
        pass
    if len(_layouts) > 4096:  # (shapes that keep changing: start over rather than grow without end)
        _layouts.clear()
    found = _layouts[key] = _work_out_layout(x, granularity, block_rows, block_cols, axis, dtypes)
    return found


def _work_out_layout(x, granularity, block_rows, block_cols, axis, dtypes) -> Optional[NativeLayout]:
    if x.device.type != "cpu" or x.dtype not in dtypes or x.numel() == 0:
        return None
    kind = dense_kind(x)
    if kind is None:
        return None
    shape, ndim = tuple(x.shape), x.dim()
    axis = axis % max(ndim, 1)
    if kind == "transposed":  # the memory matrix is x.T, contiguous: its rows are x's columns
        rows_l, cols_l = shape
        if granularity == Granularity.TENSOR:
            return NativeLayout(1, cols_l, rows_l, cols_l, rows_l, True, (), 1, 1)
        if granularity == Granularity.ROW:
            if axis % 2 == 1:  # one scale per row of x = per column of memory
                return NativeLayout(1, cols_l, rows_l, cols_l, 1, True, (rows_l, 1), 1, rows_l)
            return NativeLayout(1, cols_l, rows_l, 1, rows_l, True, (1, cols_l), cols_l, 1)
        grid_r, grid_c = -(-rows_l // block_rows), -(-cols_l // block_cols)
        return NativeLayout(1, cols_l, rows_l, block_cols, block_rows, True, (grid_r, grid_c), grid_c, grid_r)
    numel = x.numel()
    if granularity == Granularity.TENSOR:
        cols = shape[-1] if ndim >= 1 else 1
        if numel // max(cols, 1) < 64 and numel % 1024 == 0:  # few long rows: 1024-wide rows split over threads
            cols = 1024
        return NativeLayout(1, numel // cols, cols, numel // cols, cols, False, (), 1, 1)
    if granularity == Granularity.ROW:
        if ndim == 1 or axis == ndim - 1:
            cols = shape[-1]
            return NativeLayout(1, numel // cols, cols, 1, cols, False, shape[:-1] + (1,), numel // cols, 1)
        if axis == 0:  # one scale per column of the (shape[0], rest) matrix
            rest = numel // shape[0]
            return NativeLayout(1, shape[0], rest, shape[0], 1, False, (1,) + shape[1:], 1, rest)
        return None
    rows, cols = (1, shape[0]) if ndim == 1 else shape[-2:]
    batch = numel // (rows * cols)
    grid_r, grid_c = -(-rows // block_rows), -(-cols // block_cols)
    return NativeLayout(batch, rows, cols, block_rows, block_cols, False, shape[:-2] + (grid_r, grid_c),
                        batch * grid_r, grid_c)


def capped_block(x: torch.Tensor, block_rows: int, block_cols: int) -> tuple[int, int]:
    """A block no larger than the tensor's last two dims (as quant.quantize records it)."""
    rows, cols = (1, x.shape[0]) if x.dim() == 1 else x.shape[-2:] if x.dim() else (1, 1)
    return max(min(block_rows, rows), 1), max(min(block_cols, cols), 1)


def scale_step(scale: Optional[torch.Tensor], dim: int, size: int) -> Optional[int]:
    """How the native epilogues read an outer scale: 0 for none or one value, 1 for one per index of ``dim`` of
    a (rows, 1) / (1, cols) scale laid out densely, None for anything else (the caller applies it itself)."""
    if scale is None or scale.numel() == 1:
        return 0
    if scale.dim() == 2 and scale.shape[dim] == size and scale.shape[1 - dim] == 1 and scale.stride(dim) == 1:
        return 1
    return None


# ------------------------------------------------------------------------------------------------------------
# Outputs of a native cast call, in the layouts the kernel writes
# ------------------------------------------------------------------------------------------------------------
def kernel_outputs(x: torch.Tensor, lay: NativeLayout, fmt, with_amax: bool, keep_values: bool,
                   keep_values_bf16: bool = False, unused: Optional[tuple] = None):
    """Empty outputs (data in `fmt`'s dtype, scale, amax, values, values_bf16) in the layouts the kernel writes (transposed inputs give transposed outputs, as eager).
    ``unused``: (fp32, bf16) tensors to return for the outputs not asked for (the CPU kernel's shared empties:
    an allocation less each, never written or read); None: fresh empty ones (the fake impl: tracing needs its own)."""
    none_f32, none_bf16 = unused if unused is not None else (torch.empty(0), torch.empty(0, dtype=torch.bfloat16))
    if lay.transposed:
        shape, strides = x.shape, (1, x.shape[0])
        data = torch.empty_strided(shape, strides, dtype=fmt.torch_dtype)
        values = torch.empty_strided(shape, strides, dtype=torch.float32) if keep_values else none_f32
        values_bf16 = torch.empty_strided(shape, strides, dtype=torch.bfloat16) if keep_values_bf16 else none_bf16
    else:
        data = torch.empty(x.shape, dtype=fmt.torch_dtype)
        values = torch.empty(x.shape, dtype=torch.float32) if keep_values else none_f32
        values_bf16 = torch.empty(x.shape, dtype=torch.bfloat16) if keep_values_bf16 else none_bf16
    scale_shape = lay.scale_shape
    if lay.transposed and len(scale_shape) == 2 and lay.grid_rows > 1 and lay.grid_cols > 1:  # the grid, transposed
        scale = torch.empty_strided(scale_shape, (1, scale_shape[0]), dtype=torch.float32)
        amax = torch.empty_strided(scale_shape, (1, scale_shape[0]), dtype=torch.float32) if with_amax \
            else none_f32
    else:
        scale = torch.empty(scale_shape, dtype=torch.float32)
        amax = torch.empty(scale_shape, dtype=torch.float32) if with_amax else none_f32
    return data, scale, amax, values, values_bf16


# The CPU kernel's outputs that a call does not ask for: one shared empty tensor per dtype, returned as they are
# (their callers drop them unread: quant.native_quantize).
UNUSED_OUTPUTS = (torch.empty(0), torch.empty(0, dtype=torch.bfloat16))


def amax_output(lay: NativeLayout) -> torch.Tensor:
    """The amax-only call's output, shaped and laid out like the scale."""
    if lay.transposed and len(lay.scale_shape) == 2 and lay.grid_rows > 1 and lay.grid_cols > 1:
        return torch.empty_strided(lay.scale_shape, (1, lay.scale_shape[0]), dtype=torch.float32)
    return torch.empty(lay.scale_shape, dtype=torch.float32)
