"""FP8 encode and decode written as plain tensor arithmetic (compare, select, multiply), no float8 dtype.

The ``compiled_select`` quantize kernel and the integer-op decode: inductor vectorizes these where it keeps
torch's own float8 casts as scalar loops. Both give the same bits as torch's casts and as ml_dtypes (tests).
"""

from __future__ import annotations

import math

import torch

from fp8train.numerics.formats import Fp8Format

__all__ = ["round_and_encode", "decode_arithmetic"]


def round_and_encode(y: torch.Tensor, fmt: Fp8Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Round finite fp32 values in [-max, max] to the nearest FP8 value (ties to even) and build their codes.

    Compare-and-select arithmetic only, so the compiler vectorizes it: float/int bitcasts become scalar loops in
    inductor's CPU code, and vectorized log2/exp2 cost more than the whole cast. With e the binade of |y| (found
    by comparing against each power of two in the format's range, floored at the smallest normal's), the FP8
    spacing there is 2^(e - m) (below the smallest normal the grid keeps that spacing: the subnormals), so
    n = round(|y| * 2^(m - e)) is the round-to-nearest-even count of spacings (scaling by a power of two is
    exact), the FP8 value is n * 2^(e - m), and its code is (e + bias - 1) * 2^m + n: exponent field and mantissa
    in one small integer, right also when rounding carries into the next binade and for subnormals.
    """
    m_bits, bias = fmt.mantissa_bits, fmt.bias
    magnitude = y.abs()
    exponent = torch.full_like(magnitude, 1.0 - bias)  # the smallest normal's binade (and the subnormals')
    inv_spacing = torch.full_like(magnitude, 2.0 ** (m_bits - 1 + bias))
    top_exponent = math.frexp(fmt.max)[1] - 1
    for k in range(2 - bias, top_exponent + 1):
        in_or_above = magnitude >= 2.0 ** k
        exponent = torch.where(in_or_above, float(k), exponent)
        inv_spacing = torch.where(in_or_above, 2.0 ** (m_bits - k), inv_spacing)
    steps = torch.round(magnitude * inv_spacing)  # torch.round: half to even
    rounded = steps / inv_spacing
    code_magnitude = (exponent + (bias - 1)) * (2.0 ** m_bits) + steps
    negative = (y < 0) | ((y == 0) & (1.0 / y < 0))  # -0.0 counts: 1 / -0.0 = -inf
    grid = torch.where(negative, -rounded, rounded)
    sign = negative if fmt.has_negative_zero else negative & (steps > 0)  # FNUZ: 0x80 is NaN, not -0
    codes = (code_magnitude + torch.where(sign, 128.0, 0.0)).to(torch.int32)
    return grid, codes


def decode_arithmetic(codes: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """fp32 values of FP8 bytes, with integer ops (torch's own float8 -> fp32 cast is slow on CPU)."""
    u = codes.view(torch.uint8).to(torch.int32)
    m_bits = fmt.mantissa_bits
    exp_field = (u >> m_bits) & ((0xFF >> (m_bits + 1)))
    man_field = u & ((1 << m_bits) - 1)
    sign = torch.where(u >= 0x80, -1.0, 1.0)
    normal = ((exp_field - fmt.bias + 127) << 23 | man_field << (23 - m_bits)).view(torch.float32)
    subnormal = man_field.float() * fmt.min_subnormal
    value = sign * torch.where(exp_field == 0, subnormal, normal)
    if fmt.special == "ieee":  # all-ones exponent: inf (mantissa 0) or NaN
        top = exp_field == (0xFF >> (m_bits + 1))
        value = torch.where(top & (man_field == 0), sign * math.inf, value)
        value = torch.where(top & (man_field != 0), math.nan, value)
    else:
        for nan_code in fmt.nan_codes:
            value = torch.where(u == nan_code, math.nan, value)
    return value
