"""FP8 grouped GEMMs for mixture-of-experts layers: each expert's tokens times that expert's weight, in FP8.

Tokens come sorted by expert, with group offsets `offs` in torch's grouped-GEMM convention: an int32 tensor (E,)
of cumulative group ends, so expert e owns rows offs[e-1]:offs[e] (offs[-1] = 0); rows past offs[E-1] belong to
no expert (their output and gradient are zero). For input x (T, K), weight W (E, N, K) and optional bias
b (E, N), with x_e, dy_e the rows of expert e:

    output_e      = x_e    @ W_e.T  (+ b_e)     (T_e, K) @ (K, N) -> (T_e, N)     forward
    grad_input_e  = dy_e   @ W_e                (T_e, N) @ (N, K) -> (T_e, K)     backward
    grad_weight_e = dy_e.T @ x_e                (N, T_e) @ (T_e, K) -> (N, K)     backward

Each expert is one dense FP8 layer (nn/linear.py) with its own scales (nn/experts_scaling.py): the three GEMMs
of expert e are exactly Fp8LinearFunction's for x_e, W_e and that expert's quantizers, so per recipe:
tensorwise (delayed, current) = one scale per expert weight and one per expert token group for each GEMM input;
rowwise = per token and per expert output channel; block = 1x128 token tiles and 128x128 weight tiles per
expert; mxfp8 = 1x32 blocks along each GEMM's contracted dim. Groups of any size work (0, odd, not a multiple of
16 or 128), as does E = 1. On CPU (and any device without a grouped FP8 kernel) the grouped GEMM is this loop
over experts; on a GPU a GEMM that torch's grouped FP8 kernel takes (nn/scaled_grouped_mm_rules.py) is one
torch._scaled_grouped_mm call (nn/experts_scaled_gemm.py; not yet run on a GPU).

The result is therefore bit for bit each expert's tokens through the dense emulated path with that expert's
scales. Autograd sees one node (nn/experts_function.py): every expert's GEMMs write straight into their rows of
one output, grad_input and grad_weight (zeros for experts that ran nothing), with no concatenation or stack.

`GroupedLinear` is the high-precision twin (same weight layout and forward signature; each expert's rows through
F.linear in the autocast dtype): the built-in decoder's MoE experts are built of it, and `convert_to_fp8` swaps
it for an Fp8GroupedLinear holding the same Parameters (nn/convert_experts.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8train.nn.experts_scaling import ExpertScaling
from fp8train.nn.experts_function import GroupedFp8Function
from fp8train.nn.experts_weights import batched_weights_fp8
from fp8train.nn.linear_dispatch import dispatch_for
from fp8train.nn.recipes import DEFAULT_RECIPE, Fp8Recipe

__all__ = ["fp8_grouped_mm", "group_sizes", "Fp8GroupedLinear", "GroupedLinear", "ExpertScaling"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def group_sizes(offs: torch.Tensor, num_tokens: int, num_experts: int) -> list[int]:
    """The token count of each expert from `offs` (checked: one line per mistake). Reads offs on the host."""
    if not isinstance(offs, torch.Tensor) or offs.dtype != torch.int32 or offs.dim() != 1:
        shown = f"{offs.dtype} tensor of shape {tuple(offs.shape)}" if isinstance(offs, torch.Tensor) else \
            type(offs).__name__
        raise ValueError(f"offs must be a 1-D int32 tensor of cumulative group ends (torch's grouped-GEMM "
                         f"convention), got a {shown}")
    if offs.numel() != num_experts:
        raise ValueError(f"offs has {offs.numel()} entries; it needs one per expert ({num_experts})")
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    bad = next((e for e, (s, t) in enumerate(zip(starts, ends)) if t < s), None)
    if bad is not None:
        raise ValueError(f"offs must be non-decreasing and >= 0; offs[{bad}] = {ends[bad]} < "
                         f"{starts[bad]} ({'offs[%d]' % (bad - 1) if bad else 'the start'})")
    if ends and ends[-1] > num_tokens:
        raise ValueError(f"offs[-1] = {ends[-1]} is past the token count {num_tokens}")
    return [t - s for s, t in zip(starts, ends)]


def _check_operands(input, weight, bias, scaling) -> None:
    if input.dim() != 2 or weight.dim() != 3:
        raise ValueError(f"fp8_grouped_mm takes input (tokens, K) and weight (experts, N, K); got input "
                         f"{tuple(input.shape)} and weight {tuple(weight.shape)}")
    if input.shape[1] != weight.shape[2]:
        raise ValueError(f"input's last dim {input.shape[1]} must equal weight's K = weight.shape[2] = "
                         f"{weight.shape[2]}")
    for name, tensor in (("input", input), ("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} dtype must be one of float32, bfloat16, float16; got {tensor.dtype}")
    if bias is not None and (bias.dtype != weight.dtype or tuple(bias.shape) != tuple(weight.shape[:2])):
        raise ValueError(f"bias must be (experts, N) = {tuple(weight.shape[:2])} in the weight's dtype "
                         f"{weight.dtype}; got {tuple(bias.shape)} {bias.dtype}")
    if scaling.num_experts != weight.shape[0]:
        raise ValueError(f"the scaling state holds {scaling.num_experts} experts, the weight {weight.shape[0]}")


def fp8_grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, scaling: ExpertScaling,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """output (T, N): rows of expert e = input rows of e @ weight[e].T (+ bias[e]) in FP8 (module docstring).

    `weight` (E, N, K) may be any view (a transposed (E, K, N) parameter: `param.transpose(1, 2)`); gradients
    reach it and `bias` through autograd. The output dtype follows autocast, else the input's dtype."""
    if input.is_meta or weight.is_meta:
        raise ValueError("fp8_grouped_mm on the meta device cannot run its FP8 GEMMs (scaling needs real values)")
    _check_operands(input, weight, bias, scaling)
    sizes = group_sizes(offs, input.shape[0], weight.shape[0])
    device_type = input.device.type
    out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
    if scaling.training and scaling.recipe.is_delayed and not torch.compiler.is_compiling():
        scaling.check_scales_updated()
    try:
        # each expert's own (the same choices; its GEMM paths recorded on its view), made once per device and dtypes
        dispatches = [dispatch_for(view, input.device, out_dtype, input.dtype, weight.dtype)
                      for view in scaling.experts]
        dispatch = dispatches[0]
    except RuntimeError as exc:  # (the recipe's backend cannot run on this device: the user's choice)
        raise ValueError(f"FP8 experts with recipe {scaling.recipe.code()!r}: {exc}") from None
    views = scaling.experts
    with torch.autocast(device_type, enabled=False):
        with torch.no_grad():  # (the gradient reaches `weight` through the Function, not through these views)
            for view, w_e in zip(views, weight.unbind(0)):
                view.weight = w_e
            # one quantize call for every expert where it applies, else each expert's own (both cached per
            # weight version, as the dense layer's copy)
            weights_fp8 = batched_weights_fp8(scaling, weight, dispatch)
            if weights_fp8 is None:
                # An expert without tokens runs no GEMM, so its input and grad_output record nothing
                # (experts_scaling.py); a delayed weight is still quantized in training, so its amax history
                # keeps step with the others.
                weights_fp8 = [view.weight_fp8(d) if size or (scaling.training and scaling.recipe.is_delayed)
                               else None for view, d, size in zip(views, dispatches, sizes)]
        return GroupedFp8Function.apply(input, weight, bias, weights_fp8, scaling, sizes, dispatches, out_dtype)


class Fp8GroupedLinear(nn.Module):
    """E experts' linear layers (weight (E, N, K), optional bias (E, N): fp32 master Parameters) run as one FP8
    grouped GEMM: forward(input (T, K) sorted by expert, offs (E,) int32) -> (T, N). The per-expert scaling state
    is the `scaling` submodule (ExpertScaling)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 recipe: Fp8Recipe | str = DEFAULT_RECIPE, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.zeros(num_experts, out_features, **factory)) if bias else None
        self.scaling = ExpertScaling(num_experts, recipe, device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = self.in_features ** -0.5  # nn.Linear's default init range, per expert
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    @property
    def recipe(self) -> Fp8Recipe:
        return self.scaling.recipe

    def forward(self, input: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return fp8_grouped_mm(input, self.weight, offs, self.scaling, self.bias)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")


class GroupedLinear(nn.Module):
    """The high-precision twin of Fp8GroupedLinear: weight (E, N, K) (and optional bias (E, N)), forward(input
    (T, K) sorted by expert, offs (E,) int32) -> (T, N), each expert's rows times its own weight in the autocast
    dtype. A model built of these runs its experts in high precision (a bf16 baseline); `convert_to_fp8` swaps
    each one the layer policy allows for an Fp8GroupedLinear holding the same Parameters, as it does nn.Linear.
    `top_k` (set by the owning MoE layer) is the number of experts a token runs, for the FLOP count."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 top_k: int | None = None, device=None, dtype=None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.top_k = top_k
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.zeros(num_experts, out_features, **factory)) if bias else None
        bound = in_features ** -0.5
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def forward(self, input: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        sizes = group_sizes(offs, input.shape[0], self.num_experts)
        routed = sum(sizes)
        biases = self.bias.unbind(0) if self.bias is not None else [None] * self.num_experts
        groups = input[:routed].split(sizes)
        outputs = [torch.nn.functional.linear(x_e, w_e, b_e)
                   for x_e, w_e, b_e, size in zip(groups, self.weight.unbind(0), biases, sizes) if size]
        device_type = input.device.type
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else input.dtype
        if routed < input.shape[0]:  # rows routed to no expert: zero, as Fp8GroupedLinear leaves them
            outputs.append(input.new_zeros(input.shape[0] - routed, self.out_features, dtype=out_dtype))
        if not outputs:
            return input.new_zeros(input.shape[0], self.out_features, dtype=out_dtype)
        return torch.cat(outputs) if len(outputs) > 1 else outputs[0]

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}")
