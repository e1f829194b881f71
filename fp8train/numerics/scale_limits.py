"""The fp32 limits a scale lives within: the largest scale whose product with a format's max stays finite
(``max_scale``, per format in ``SCALE_CAPS``), and which floats fp32 holds exactly. Beside formats and below both
the scale rule (scaling.py) and the native cast (native_cast.py), which read them."""

from __future__ import annotations

import functools
import math
import struct

import torch

from fp8train.numerics.formats import FORMATS

__all__ = ["FP32_TINY", "FP32_MAX", "max_scale", "SCALE_CAPS", "fp32_exact"]

FP32_TINY = torch.finfo(torch.float32).tiny  # 2^-126: scales never go below it, so x / scale stays finite
FP32_MAX = torch.finfo(torch.float32).max


@functools.lru_cache(maxsize=None)
def max_scale(fmt_max: float, pow2: bool) -> float:
    """The largest fp32 scale with ``fmt_max * scale <= FLT_MAX`` (a power of two when ``pow2``).

    A larger scale would let a saturated value dequantize to inf: FLT_MAX with pow2 scales used to become
    256 * 2**120 = 2**128 = inf. Capped, the largest values clip to fmt.max instead and stay finite."""
    cap = struct.unpack("f", struct.pack("f", FP32_MAX / fmt_max))[0]  # nearest fp32 ...
    while cap * fmt_max > FP32_MAX:  # ... then downward until the product fits (one step at most)
        cap = struct.unpack("f", struct.pack("I", struct.unpack("I", struct.pack("f", cap))[0] - 1))[0]
    return 2.0 ** math.floor(math.log2(cap)) if pow2 else cap


# Per format, computed once at import: traced (compiled) code reads a constant instead of calling max_scale.
SCALE_CAPS = {(f.name, p): max_scale(f.max, p) for f in FORMATS.values() for p in (False, True)}


def fp32_exact(value) -> bool:
    """A float that fp32 holds exactly, in its normal range (a tensor of them: answered no)."""
    if isinstance(value, torch.Tensor):
        return False
    return FP32_TINY <= abs(value) <= FP32_MAX and struct.unpack("f", struct.pack("f", value))[0] == value
