"""fp32 master weights, enforced at conversion: what `convert_to_fp8(..., master_weights=...)` does with a model
whose floating-point parameters are not float32 (loaded with `dtype=torch.bfloat16`, or `.to(torch.bfloat16)`).

FP8 training keeps fp32 master weights (docs/design.md): the optimizer updates them in fp32, each forward
quantizes them to FP8. A bf16 master would drop every update smaller than half a bf16 step of its weight (2^-9
relative), which is most of a fine-tune's updates, and nothing would say so. So:

- "cast" (the default): the whole model (parameters and floating buffers) is cast to float32 in place, with one
  warning line naming the dtypes found. bf16 and fp16 values are exact in fp32, so the model computes what it
  computed before; the Parameter objects are kept (`nn.Module.float()` replaces their data), so an optimizer
  built before the conversion still updates them (its state, if any, was made for the old dtype: build it after).
- "refuse": a ValueError naming the option, before anything is swapped or cast.
"""

from __future__ import annotations

import warnings
from collections import Counter

import torch
import torch.nn as nn

__all__ = ["MASTER_WEIGHT_CHOICES", "DEFAULT_MASTER_WEIGHTS", "ensure_fp32_masters", "check_master_weights_choice"]

MASTER_WEIGHT_CHOICES = ("cast", "refuse")
DEFAULT_MASTER_WEIGHTS = "cast"


def _non_fp32(model: nn.Module) -> Counter:
    return Counter(str(p.dtype).removeprefix("torch.") for p in model.parameters()
                   if p.is_floating_point() and p.dtype != torch.float32)


def check_master_weights_choice(master_weights: str) -> None:
    if master_weights not in MASTER_WEIGHT_CHOICES:
        raise ValueError(f"convert_to_fp8: master_weights={master_weights!r}; allowed: "
                         f"{', '.join(MASTER_WEIGHT_CHOICES)}")


def ensure_fp32_masters(model: nn.Module, master_weights: str = DEFAULT_MASTER_WEIGHTS, stacklevel: int = 3) -> None:
    """Leave ``model`` with float32 parameters, or refuse it (module docstring)."""
    check_master_weights_choice(master_weights)
    found = _non_fp32(model)
    if not found:
        return
    said = ", ".join(f"{count} {dtype}" for dtype, count in sorted(found.items()))
    if master_weights == "refuse":
        raise ValueError(f"convert_to_fp8: the model has {said} parameters and master_weights='refuse'; FP8 training "
                         "keeps fp32 master weights: load the model in float32 (dtype=torch.float32), or pass "
                         "master_weights='cast'")
    model.float()
    warnings.warn(f"convert_to_fp8: cast {said} parameters to float32, the master weights FP8 training keeps (load "
                  "the model with dtype=torch.float32 to skip this, or pass master_weights='refuse')",
                  stacklevel=stacklevel)
