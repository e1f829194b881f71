"""FP8 weights for serving: the quantization an export writes, and the modules that run exported weights.

Weight layouts (dequant scales, `w ~= weight.float() * scale` expanded over its tile):
- per output channel: weight (out, in) float8, weight_scale float32 (out, 1), amax(|row|) / fmt.max;
- 128x128 blocks (DeepSeek-V3, `weight_block_size`): weight_scale float32 (ceil(out/128), ceil(in/128)), one
  per tile, amax(|tile|) / fmt.max (ragged edge tiles scale what they hold).

`Fp8WeightLinear` is weight-only (W8A16): bf16/fp32 activations times the exact FP8 weight values, accumulated
in fp32, then the scale. `Fp8ActivationLinear` is what a compressed-tensors FP8 checkpoint means (W8A8): the
input is quantized to E4M3 too, per token (dynamic: scale = amax(|token|) / 448 from each forward), per 1x128 group
(dynamic, with block weights), or with one static `input_scale` measured on calibration data, and dequantized
before the GEMM, as transformers' compressed-tensors path computes it on a machine without FP8 kernels.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from fp8train.numerics.formats import get_format
from fp8train.numerics.quant import Fp8Tensor, decode_fp8, quantize

__all__ = ["quantize_weight_per_channel", "quantize_weight_blocks", "expand_block_scale", "Fp8WeightLinear",
           "Fp8ActivationLinear", "fp8_weight_model", "dequantized_weight_model", "ACTIVATION_SCHEMES",
           "WEIGHT_BLOCK"]

ACTIVATION_SCHEMES = ("dynamic", "static")
WEIGHT_BLOCK = 128


def quantize_weight_per_channel(weight: torch.Tensor, fmt="e4m3fn") -> Fp8Tensor:
    """FP8 weight (out, in) with one dequant scale per output channel: scale (out, 1) = amax(|row|) / fmt.max
    (an all-zero row gets scale 1). Round-to-nearest-even, saturating (nothing can clip at this scale)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    return quantize(weight.detach().float(), fmt, granularity="row", axis=-1)


def quantize_weight_blocks(weight: torch.Tensor, fmt="e4m3fn", block: int = WEIGHT_BLOCK) -> Fp8Tensor:
    """FP8 weight (out, in) with one dequant scale per block x block tile: scale (ceil(out/b), ceil(in/b))."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    return quantize(weight.detach().float(), fmt, granularity="block", block=(block, block))


def expand_block_scale(scale: torch.Tensor, shape, block: int = WEIGHT_BLOCK) -> torch.Tensor:
    """A (ceil(out/b), ceil(in/b)) tile scale spread over every element of an (out, in) weight."""
    out_features, in_features = shape
    rows = scale.repeat_interleave(block, dim=0)[:out_features]
    return rows.repeat_interleave(block, dim=1)[:, :in_features]


def _weight_values(weight_fp8: torch.Tensor, weight_scale: torch.Tensor, fmt, block: int) -> torch.Tensor:
    values = decode_fp8(weight_fp8, fmt)  # (out, in) fp32, exact
    if not block:
        return values * weight_scale  # per output channel, (out, 1)
    return values * expand_block_scale(weight_scale, values.shape, block)


class Fp8WeightLinear(nn.Module):
    """A Linear with FP8 weights and per-output-channel scales (weight-only FP8, activations stay bf16).

    output = (input @ weight_values.T) * weight_scale.T + bias, with weight_values the exact FP8 values, the
    product accumulated in fp32 and one rounding to the output dtype (bf16 under autocast): what a W8A16 serving
    kernel computes, emulated on any device.
    """

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, fmt):
        super().__init__()
        self.fmt = get_format(fmt)
        if weight_fp8.dtype != self.fmt.torch_dtype:
            raise ValueError(f"weight dtype {weight_fp8.dtype} is not the {self.fmt.name} dtype "
                             f"{self.fmt.torch_dtype}: refusing to reinterpret FP8 bytes of another format")
        self.out_features, self.in_features = weight_fp8.shape
        if tuple(weight_scale.shape) != (self.out_features, 1) or weight_scale.dtype != torch.float32:
            raise ValueError(f"weight_scale must be float32 of shape ({self.out_features}, 1), got "
                             f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
        self.register_buffer("weight", weight_fp8)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt="e4m3fn") -> "Fp8WeightLinear":
        q = quantize_weight_per_channel(linear.weight, fmt)
        return cls(q.data, q.scale, linear.bias, fmt)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight={self.fmt.name}, " \
               "scale=per-output-channel"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = input.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        with torch.autocast(device_type, enabled=False):
            weight_values = decode_fp8(self.weight, self.fmt)  # (out, in) fp32, exact
            output = input.float() @ weight_values.t()  # (..., out) fp32 accumulation
            output = output * self.weight_scale.t()  # per-output-channel dequant
            if self.bias is not None:
                output = output + self.bias
        return output.to(out_dtype)


class Fp8ActivationLinear(nn.Module):
    """W8A8 FP8 Linear as a compressed-tensors checkpoint defines it (see the module docstring): the input
    quantized and dequantized (E4M3, per token, per 1x128 group, or with a static ``input_scale``), times the
    dequantized FP8 weight, in fp32, one rounding to the output dtype."""

    def __init__(self, weight_fp8, weight_scale, bias, input_scale=None, weight_block: int = 0):
        super().__init__()
        self.fmt = get_format("e4m3fn")
        if weight_fp8.dtype != self.fmt.torch_dtype:
            raise ValueError(f"weight dtype {weight_fp8.dtype} is not float8_e4m3fn (compressed-tensors FP8)")
        self.out_features, self.in_features = weight_fp8.shape
        self.register_buffer("weight", weight_fp8)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float().reshape(()))
        self.weight_block = weight_block  # 0: per output channel, dynamic per-token inputs; b: b x b tiles, 1 x b
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    def _input_values(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features).float()
        if self.input_scale is not None:
            q = quantize(x2d, self.fmt, scale=self.input_scale)
        elif self.weight_block:
            q = quantize(x2d, self.fmt, granularity="block", block=(1, self.weight_block))
        else:
            q = quantize(x2d, self.fmt, granularity="row", axis=-1)
        return q.dequantize(torch.float32)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = input.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        with torch.autocast(device_type, enabled=False):
            weight_values = _weight_values(self.weight, self.weight_scale, self.fmt, self.weight_block)
            output = self._input_values(input) @ weight_values.t()  # (M, out) fp32 accumulation
            if self.bias is not None:
                output = output + self.bias
        return output.reshape(*input.shape[:-1], self.out_features).to(out_dtype)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def fp8_weight_model(model: nn.Module, names, fmt="e4m3fn") -> nn.Module:
    """A copy of ``model`` whose Linears named in ``names`` hold per-channel FP8 weights (Fp8WeightLinear)."""
    model = copy.deepcopy(model)
    for name in names:
        _replace(model, name, Fp8WeightLinear.from_linear(model.get_submodule(name), fmt))
    return model.eval()


def dequantized_weight_model(model: nn.Module, names, fmt) -> nn.Module:
    """A copy holding what an export holds, as plain fp32 tensors: the dequantized per-channel FP8 weights of the
    FP8-policy Linears, every other floating tensor rounded to bf16."""
    model = copy.deepcopy(model)
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            tensor.copy_(tensor.to(torch.bfloat16))
    for name in names:
        linear = model.get_submodule(name)
        linear.weight.data = quantize_weight_per_channel(linear.weight, fmt).dequantize(torch.float32)
    return model.eval()
