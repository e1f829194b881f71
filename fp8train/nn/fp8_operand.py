"""Fp8Operand: a 2-D FP8 matrix as fp8train's GEMMs read it (bytes, scales, and cached copies of its values).

Made from a quantizer's Fp8Tensor (``Fp8Operand.from_fp8_tensor``) and read by ``fp8train.nn.gemm.fp8_mm`` and the
scaled_mm path (nn/scaled_gemm.py). What a quantizer keeps beside the bytes for its GEMM is decided once, by
``fp8train.nn.gemm_choice.operand_keeps``.
"""

from __future__ import annotations

import torch

from fp8train.numerics.names import Granularity
from fp8train.numerics.quant import decode_fp8

__all__ = ["Fp8Operand"]


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
                return self._store(key, found.t())  # (one view: kept, and returned)
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
        if q.granularity == Granularity.ROW and q.axis % 2 != 1:
            raise ValueError("Fp8Operand takes row scales shared along the last dim (axis=-1)")
        op = cls(q.data, q.scale, q.block if q.granularity == Granularity.BLOCK else None,
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
