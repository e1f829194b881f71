"""Consecutive row groups of one matrix, each group's transpose quantized as a tensor of its own, in one native call.

A mixture-of-experts layer keeps its tokens sorted by expert: rows start_g:end_g of x (T, C) are group g's. Its
weight-gradient GEMM reads each group transposed, (C, T_g), quantized along T_g: rowwise scales (one per column
of the group, over its rows), 1 x bc tiles (bc consecutive rows of one column, a last shorter tile at the
group's end) or MX's 1 x 32 blocks. Those tiles end where the group ends, so the whole matrix cannot be
quantized as one tensor; one quantize call per group pays for waking the threads once per group, and its
bookkeeping. ``quantize_group_transposes`` makes every group's FP8 copy in one call of the C kernel
(numerics/native_cast.c, ``fp8_quantize_groups``), whose tile rows never cross a group's end and which runs, per
tile row, the amax, scale rule and cast functions a call on that group alone runs: each group's bytes, scales and
amaxes are those of ``quantize(x_g.t(), ...)`` (or ``quantize_mx``), in the same memory layouts.

It returns None where it does not apply (the kernel not built, torch.compile tracing, not a contiguous 2-D fp32 or
bf16 CPU tensor, a combination of kept copies no caller asks for, row scales over fewer groups than threads: each
group is then one tile row, which one thread runs, while its own call splits its rows over the threads), and the
caller quantizes each group itself.
"""

from __future__ import annotations

import ctypes

import torch

from fp8train.numerics import native_cast
from fp8train.numerics.formats import Fp8Format
from fp8train.numerics.fp8_tensor import Fp8Tensor
from fp8train.numerics.mx import MX_BLOCK_SIZE
from fp8train.numerics.names import Granularity
from fp8train.numerics.native_cast import RULE_AMAX, RULE_MX

__all__ = ["quantize_group_transposes"]

_bound: dict = {}  # the C entry point, with its argument types set once


def _entry():
    if "fn" not in _bound:
        fn = getattr(native_cast.library(), "fp8_quantize_groups", None)
        if fn is not None:
            i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
            fn.argtypes = [ctypes.POINTER(native_cast.Params), ptr, i32, i64, ptr, i64, i64, i64, ptr, ptr, ptr,
                           ptr, ptr, i32]
            fn.restype = ctypes.c_int
        _bound["fn"] = fn
    return _bound["fn"]


def quantize_group_transposes(x: torch.Tensor, sizes: list[int], fmt: Fp8Format, granularity: str,
                              block: tuple[int, int], margin: int = 0, pow2: bool = False, mx: bool = False,
                              keep_fp32: bool = False, keep_bf16: bool = False,
                              keep_dequantized: bool = False) -> list | None:
    """For each group g (rows of x, sizes[g] of them, one group after the other from row 0): the Fp8Tensor of
    ``quantize(x_g.t(), fmt, granularity=granularity, block=block, margin=margin, pow2=pow2)`` (``mx``:
    ``quantize_mx(x_g.t(), fmt)``), with the kept copies asked for (as quantize's); None for a group without
    rows. None where the native call does not apply (module docstring). `granularity` is "row" or "block"."""
    if torch.compiler.is_compiling() or not native_cast.available() or _entry() is None:
        return None
    if not (x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous() and x.dtype in (torch.float32,
                                                                                            torch.bfloat16)):
        return None
    if (keep_dequantized and keep_bf16) or granularity not in (Granularity.ROW, Granularity.BLOCK) or min(sizes) < 0:
        return None
    routed, cols = sum(sizes), x.shape[1]
    if routed == 0 or cols == 0 or routed > x.shape[0]:
        return None
    if granularity == Granularity.ROW and not mx and sum(1 for s in sizes if s) < torch.get_num_threads():
        return None  # (a group is one tile row here, run by one thread: a call per group splits its rows instead)
    if mx:
        granularity, block, margin, pow2 = Granularity.BLOCK, (1, MX_BLOCK_SIZE), 0, False
    # memory tiles of x: tile_r rows (tokens; 0 = the whole group) x tile_c columns
    if granularity == Granularity.ROW:
        tile_r, tile_c, axis = 0, 1, 1
    else:
        tile_r, tile_c, axis = block[1], min(block[0], cols), -1
    ntc = -(-cols // tile_c)
    grid_rows = [0 if s == 0 else 1 if tile_r == 0 else -(-s // tile_r) for s in sizes]
    dequantized_only = keep_dequantized and not keep_fp32
    rows = x[:routed]
    data = torch.empty(routed, cols, dtype=fmt.torch_dtype)
    scale = torch.empty(sum(grid_rows), ntc, dtype=torch.float32)
    amax = torch.empty_like(scale)
    values = torch.empty(routed, cols) if keep_fp32 or keep_dequantized else None
    values_bf16 = torch.empty(routed, cols, dtype=torch.bfloat16) if keep_bf16 else None
    group_rows = torch.tensor(sizes, dtype=torch.int64)
    params = native_cast.cast_params(fmt, True, RULE_MX if mx else RULE_AMAX, margin, bool(pow2), dequantized_only)
    rc = _entry()(ctypes.byref(params), rows.data_ptr(), int(x.dtype == torch.bfloat16), len(sizes),
                  group_rows.data_ptr(), cols, tile_r, tile_c, data.data_ptr(), scale.data_ptr(), amax.data_ptr(),
                  None if values is None else values.data_ptr(),
                  None if values_bf16 is None else values_bf16.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native grouped cast returned {rc}")
    out, start, grid_start = [], 0, 0
    for size, grid in zip(sizes, grid_rows):
        if size == 0:
            out.append(None)
            continue
        end, grid_end = start + size, grid_start + grid
        # the group's block as quantize records it (no larger than its (cols, size) transpose)
        recorded = block if granularity == Granularity.ROW else (min(block[0], cols), min(block[1], size))
        if mx and size >= MX_BLOCK_SIZE:
            recorded = (1, MX_BLOCK_SIZE)
        group = Fp8Tensor(_logical(data[start:end]), _logical(scale[grid_start:grid_end]), fmt, granularity,
                          recorded, axis, _logical(amax[grid_start:grid_end]),
                          _logical(values[start:end]) if keep_fp32 else None,
                          values_bf16=None if values_bf16 is None else _logical(values_bf16[start:end]))
        if keep_dequantized:
            group.dequantized = _logical(values[start:end]) if dequantized_only else group.dequantize(torch.float32)
        out.append(group)
        start, grid_start = end, grid_end
    return out


def _logical(grid: torch.Tensor) -> torch.Tensor:
    """A group's rows of an output (its bytes, values, or its scale or amax grid: tile rows x tile columns), in
    memory order -> the transpose, in the layout the call on that group alone writes (transposed strides;
    contiguous where one dim is 1, which that call sees as a contiguous tensor)."""
    if grid.shape[0] == 1 or grid.shape[1] == 1:
        return grid.reshape(grid.shape[1], grid.shape[0])
    return grid.t()
