"""The opt-in for nn.Linear subclasses (`LayerPolicy.linear_subclasses`, config `policy.linear_subclasses`).

convert_to_fp8 swaps plain nn.Linear only: a subclass may compute something else in its forward (a router's
top-k, an fp32 output, a grouped projection), and an Fp8Linear in its place would silently compute x @ W.T + b
instead. Some subclasses exist only for another reason (Falcon's `FalconLinear` writes its matmul out so that it
runs as `input @ weight.T`, a plain linear): naming their class here lets them convert like nn.Linear.

The name is a promise that needs checking, not trusting: before anything is swapped, every layer of a named class
runs once on a fixed random input, and its output must equal `F.linear(x, weight, bias)` (to fp32 rounding over a
sum of in_features products); a layer that computes anything else is refused, naming the class to remove.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["check_plain_linear"]

_ROWS = 3  # enough to tell a row-mixing forward from a row-wise one, cheap for the widest layer


def check_plain_linear(name: str, module: nn.Linear) -> None:
    """Refuse ``module`` (an nn.Linear subclass named in policy.linear_subclasses) unless its forward is linear."""
    weight = module.weight
    if weight.is_meta:  # a model built on the meta device has no values to compare; its class was named on purpose
        return
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_ROWS, module.in_features, generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        got = module(x)
        want = F.linear(x, weight, module.bias)
    # a dot product of in_features terms may round differently in another summation order: a few ulps per term
    tolerance = 8 * torch.finfo(want.dtype).eps * module.in_features * (x.abs() @ weight.abs().T).max().clamp_min(1)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or (got - want).abs().max() > tolerance:
        raise ValueError(f"policy.linear_subclasses: {name} ({type(module).__name__}) does not compute "
                         f"x @ weight.T + bias, so an Fp8Linear cannot stand in for it; remove "
                         f"{type(module).__name__!r} from policy.linear_subclasses")
