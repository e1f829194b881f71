"""Fp8Tensor: FP8 bytes with their scale, format and layout, and the copies of their values a kernel kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from fp8train.numerics.formats import Fp8Format
from fp8train.numerics.scaling import expand_scale

__all__ = ["Fp8Tensor"]


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
    # the kernel also updated the caller's non-finite count and pending amax from `amax` (quant.quantize)
    amax_recorded: bool = field(default=False, repr=False)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def unscaled(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The FP8 values without the scale, exactly, in ``dtype`` (FP8 values are exact in bf16 and fp32)."""
        if dtype == torch.bfloat16 and self.values_bf16 is not None:
            return self.values_bf16
        values = self.values
        if values is None:  # torch's own decode (exact)
            data = self.data if self.data.dtype == self.fmt.torch_dtype else self.data.view(self.fmt.torch_dtype)
            values = data.to(torch.float32)
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
