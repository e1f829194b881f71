"""OCP Microscaling (MX) quantization: FP8 elements in blocks of 32 sharing one E8M0 (power-of-two) scale.

The OCP MX specification v1.0 (section 6.3) converts a block of 32 values V_i as follows:

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem      emax_elem: exponent of the element format's largest
                                                           normal (E4M3: 448 = 1.75 * 2^8 -> 8; E5M2: 15)
    X          = 2^shared_exp                              stored as E8M0: the byte shared_exp + 127
    P_i        = quantize_to_element_format(V_i / X)       round to nearest even, clamped to +-max normal

So the block's largest value lands in the element format's top binade, [2^emax, 2^(emax+1)): for E4M3 values
in (448, 512) are clamped to 448 (the spec's rule, which TE and cuBLAS replace with rounding the scale up; here
we follow the spec). E8M0 covers 2^-127 .. 2^127 (0xFF is NaN); shared exponents are clamped into that range.
fp8train's convention for amax 0 or NaN/inf (docs/design.md) holds here too: such a block gets scale 1
(E8M0 127).
The FP8 values and the power-of-two scales are exact in fp32, so dequantization and an fp32 GEMM over them
reproduce an MX tensor core up to accumulation order.
"""

from __future__ import annotations

import math

import torch

from fp8train.numerics.formats import Fp8Format, get_format
from fp8train.numerics.names import QuantizeKernel
from fp8train.numerics.native_layout import capped_block
from fp8train.numerics.quant import Fp8Tensor, compute_amax, native_quantize, quantize, value_copies

__all__ = ["MX_BLOCK_SIZE", "E8M0_BIAS", "mx_scale_from_amax", "e8m0_codes", "quantize_mx"]

MX_BLOCK_SIZE = 32
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127  # 0x00 .. 0xFE; 0xFF is NaN


def _emax(fmt) -> int:
    """Exponent of the largest normal of the element format (448 -> 8, 57344 -> 15)."""
    return math.frexp(fmt.max)[1] - 1


def mx_scale_from_amax(amax: torch.Tensor, fmt="e4m3fn") -> torch.Tensor:
    """fp32 power-of-two scales 2^(floor(log2 amax) - emax_elem), clamped to E8M0; 1 where amax is 0 or
    non-finite."""
    fmt = get_format(fmt)
    amax = amax.float()
    _, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1): floor(log2) = e - 1
    shared_exp = (exponent - 1 - _emax(fmt)).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP)
    usable = torch.isfinite(amax) & (amax > 0)
    shared_exp = torch.where(usable, shared_exp, torch.zeros_like(shared_exp))
    # exp2 of an integer in [-127, 127] is exact in fp64 and representable in fp32 (2^-127 as a subnormal)
    return torch.exp2(shared_exp.double()).float()


def e8m0_codes(scale: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 bytes (exponent + 127) of power-of-two fp32 scales from `mx_scale_from_amax`."""
    _, exponent = torch.frexp(scale.float())
    return (exponent - 1 + E8M0_BIAS).to(torch.uint8)


def quantize_mx(x: torch.Tensor, fmt="e4m3fn", *, keep_values: bool = False, kernel: str = "eager",
                keep_dequantized: bool = False) -> Fp8Tensor:
    """MX-quantize the last dim of a 2-D `x` in blocks of 32 (a ragged last block is padded for its amax).
    ``kernel='native'``: amax, the MX scale rule and the cast in the C kernel (same bytes), where it takes x;
    ``keep_dequantized`` as in quant.quantize."""
    block = (1, MX_BLOCK_SIZE)
    if kernel == QuantizeKernel.NATIVE and x.dim() == 2 and x.numel():
        keep_fp32, keep_bf16 = (keep_values, False) if type(keep_values) is bool else value_copies(keep_values)
        br, bc = (1, MX_BLOCK_SIZE) if x.shape[1] >= MX_BLOCK_SIZE else capped_block(x, *block)  # (as quantize
        # records it: a block no larger than the tensor)
        native = native_quantize(x, fmt if isinstance(fmt, Fp8Format) else get_format(fmt), "block", br, bc, -1, 0,
                                 False, True, None, keep_fp32, keep_bf16, keep_dequantized, mx=True)
        if native is not None:
            return native
    amax = compute_amax(x, "block", block)
    scale = mx_scale_from_amax(amax, fmt)
    # Elements are clamped to +-max (saturate=True): the spec's rule for values that scale past max normal.
    q = quantize(x, fmt, granularity="block", block=block, scale=scale, keep_values=keep_values,
                 validate_scale=False, keep_dequantized=keep_dequantized)
    q.amax = amax
    return q
