"""Fp8Linear: an nn.Linear whose three GEMMs run on FP8 operands, with fp32 master weights.

For y = x W^T + b with input x (M, K) (leading dims flattened), weight W (N, K) and grad_output dy (M, N):

    output      = input         @ weight.T     (M, K) @ (K, N) -> (M, N)    forward
    grad_input  = grad_output   @ weight       (M, N) @ (N, K) -> (M, K)    backward
    grad_weight = grad_output.T @ input        (N, M) @ (M, K) -> (N, K)    backward

Every operand is FP8 (input and weight in E4M3; grad_output in E5M2 for the hybrid delayed/current recipes, E4M3
for rowwise/block), each with its dequantization scale, and every GEMM accumulates in fp32 (gemm.fp8_mm).
grad_bias = sum of grad_output over rows, in fp32 from the unquantized gradient, as in every FP8 recipe.
The input is saved for backward as FP8 bytes + scale (1 byte per element), never in high precision; the weight's
FP8 copy is saved too, so backward reuses exactly the operands the forward used.

Scaling state (module buffers, hence in state_dict and checkpoints):
- every recipe: `{role}_nonfinite_amax_count` (int64), incremented whenever a tensor of that role (any row or
  block of it, for rowwise/block) has a NaN/inf amax. Such a tensor is still quantized (NaN stays NaN, inf
  saturates), but its amax never becomes a scale: current scaling uses 1.0 for it (quant.scale_from_amax).
- delayed scaling, per role (input, weight, grad_output):
    `{role}_amax_history` (L,) fp32, newest at index 0, zeros before any step;
    `{role}_scale` () fp32, the dequant scale used by the NEXT steps' forward/backward;
    `{role}_scale_amax` () fp32, the amax that `scale` was computed from (for staleness telemetry);
    `{role}_pending_amax` () fp32, max |x| over this optimizer step's micro-batches, -1 when none seen yet;
    `{role}_initialized` () bool, True once a usable (finite, > 0) amax has produced `scale`.

Delayed scaling, exactly:
1. Every training-mode quantization of a role records max(pending_amax, amax) into pending_amax (so with
   gradient accumulation the step's amax is the max over its micro-batches, not the last one). A NaN/inf amax is
   not recorded; it increments the nonfinite counter instead. Eval-mode forwards do not record.
2. It quantizes with `scale` when initialized; before that (the first step, no history) with its own amax
   (current scaling).
3. `update_fp8_scales(model)`, once per optimizer step after optimizer.step(), all-reduces every pending amax of
   every layer with MAX in one collective (when torch.distributed is initialized), then per role, if anything was
   recorded (pending >= 0): rolls the history (newest at index 0, the oldest drops off), takes
   amax = history.max() ("max") or history[0] ("most_recent"), and if that amax is > 0 sets
   scale = quant.scale_from_amax(amax, fmt, margin, pow2) and initialized = True. An amax of 0 (e.g. an all-zero
   gradient) enters the history but keeps the previous scale, and leaves an uninitialized role on current
   scaling. pending_amax goes back to -1. A role that recorded nothing this step is left untouched.

Telemetry: set `layer.telemetry = True` and every following forward (input, weight) and backward (grad_output)
overwrites `layer.last_stats[role]` with amax, scale (mean over rows/blocks when not tensorwise), overflow_frac,
underflow_frac, sqnr_db (quant.quant_error), staleness (delayed only: this tensor's amax / the amax its scale was
computed from, 1.0 while on current scaling; None for other recipes) and nonfinite. Off by default: it costs
host syncs and an extra pass over each tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fp8train.nn.accumulation import HopperAccumulation
from fp8train.nn.fp8_all_gather import Fp8GatheredWeight
from fp8train.nn.gemm import Fp8Operand, fp8_mm, resolve_backend
from fp8train.numerics.mx import quantize_mx
from fp8train.numerics.quant import Fp8Tensor, compute_amax, quant_error, quantize, scale_from_amax
from fp8train.nn.recipes import ROLES, Fp8Recipe, recipe as make_recipe

__all__ = ["Fp8Linear", "update_fp8_scales"]


# Loaded scaling state must be state this module could have produced: a NaN/inf/0/negative scale would quantize
# every later step wrongly (NaN loss many steps on, or a silently different curve) with nothing pointing at the
# checkpoint it came from. So a bad value is refused at load time, naming the buffer.
_LOADED_STATE_RULES = (("scale", "finite and > 0", lambda t: torch.isfinite(t) & (t > 0)),
                       ("scale_amax", "finite and >= 0", lambda t: torch.isfinite(t) & (t >= 0)),
                       ("amax_history", "finite and >= 0", lambda t: torch.isfinite(t) & (t >= 0)))


def _refuse_bad_fp8_state(module, state_dict, prefix, *args) -> None:
    for role in ROLES:
        for suffix, allowed, ok in _LOADED_STATE_RULES:
            key = f"{prefix}{role}_{suffix}"
            value = state_dict.get(key)
            if value is not None and not bool(ok(value.float()).all()):
                shown = value.float()[~ok(value.float())].reshape(-1)[:3].tolist()
                raise ValueError(f"FP8 scaling state {key} holds {shown}; it must be {allowed} (a damaged or "
                                 "hand-edited state; nothing was loaded into this layer)")


class _Fp8LinearFunction(torch.autograd.Function):
    """output = input @ weight.T (+ bias) from FP8 operands; backward quantizes grad_output and runs the two
    backward GEMMs from the saved FP8 input and weight."""

    @staticmethod
    def forward(ctx, input_hp, weight, bias, input_fp8: Fp8Tensor, weight_fp8: Fp8Tensor, layer, backend,
                out_dtype):
        input_op = Fp8Operand.from_fp8_tensor(input_fp8)
        weight_op = Fp8Operand.from_fp8_tensor(weight_fp8)
        # (M, N) in out_dtype straight from the GEMM; bias fused into it where the kernel can
        output = fp8_mm(input_op, weight_op.t(), backend, out_dtype=out_dtype, bias=bias, gemm="output",
                        use_fast_accum=layer.recipe.fast_accum_forward, **layer._gemm_options())
        # Saved in FP8: bytes + scales only (not the fp32 copies of the values the quantizer returned). When
        # grad_weight contracts the input's first dim across its scale layout, the saved copy is the input
        # quantized along that dim instead (recipes.requantize_transposed): still one byte per element.
        input_saved = input_fp8
        ctx.input_transposed = layer.recipe.requantize_transposed("input") and weight.requires_grad
        if ctx.input_transposed:
            input_saved = layer._quantize_transposed("input", input_hp)   # (K, M)
        # The master weight only when grad_input requantizes it along its other axis (it is a Parameter: no copy)
        weight_for_backward = weight if layer.recipe.requantize_transposed("weight") else None
        ctx.save_for_backward(input_saved.data, input_saved.scale, weight_fp8.data, weight_fp8.scale,
                              weight_for_backward)
        ctx.input_block = input_saved.block if input_saved.granularity == "block" else None
        ctx.weight_block = weight_op.block
        ctx.layer, ctx.backend = layer, backend
        ctx.input_dtype, ctx.weight_dtype = input_hp.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input_data, input_scale, weight_data, weight_scale, weight = ctx.saved_tensors
        layer, backend, r = ctx.layer, ctx.backend, ctx.layer.recipe
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_input = grad_weight = grad_bias = None
        options = layer._gemm_options()
        with torch.autocast(grad_output.device.type, enabled=False):
            grad_output_fp8 = layer._quantize("grad_output", grad_output)
            grad_output_op = Fp8Operand.from_fp8_tensor(grad_output_fp8)            # (M, N)
            if need_input:    # grad_input = grad_output @ weight          (M, N) @ (N, K)
                weight_op = Fp8Operand(weight_data, weight_scale, ctx.weight_block)  # (N, K)
                if r.requantize_transposed("weight"):  # scales along K, constant along the contracted N
                    weight_op = Fp8Operand.from_fp8_tensor(layer._quantize_transposed("weight", weight)).t()
                grad_input = fp8_mm(grad_output_op, weight_op, backend, out_dtype=ctx.input_dtype,
                                    gemm="grad_input", **options)
            if need_weight:   # grad_weight = grad_output.T @ input        (N, M) @ (M, K)
                grad_output_t_op = grad_output_op.t()
                if r.requantize_transposed("grad_output"):
                    grad_output_t_op = Fp8Operand.from_fp8_tensor(
                        layer._quantize_transposed("grad_output", grad_output))   # (N, M), scales along N
                input_op = Fp8Operand(input_data, input_scale, ctx.input_block)    # (M, K), or (K, M)
                if ctx.input_transposed:
                    input_op = input_op.t()
                grad_weight = fp8_mm(grad_output_t_op, input_op, backend, out_dtype=ctx.weight_dtype,
                                     gemm="grad_weight", **options)
            if need_bias:     # grad_bias = sum over rows, fp32, from the unquantized gradient
                grad_bias = grad_output.float().sum(0).to(ctx.bias_dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class Fp8Linear(nn.Linear):
    """nn.Linear with FP8 GEMMs (see the module docstring). The weight/bias stay fp32 master Parameters."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Fp8Recipe | str = "current", device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = make_recipe(recipe) if isinstance(recipe, str) else recipe
        if self.recipe.backend == "te":
            resolve_backend("te", "cpu")  # raises: TE replaces the layer instead (backends.te.make_te_linear)
        self.telemetry = False
        self.last_stats: dict[str, dict] = {}
        # Which kernel each GEMM ran last: {"output" | "grad_input" | "grad_weight": "scaled_mm:<kind>" |
        # "fallback:<reason>" | "emulated"} (plain Python, written every call: no device sync).
        self.gemm_paths: dict[str, str] = {}
        self._accumulation = None if not self.recipe.accumulator_bits else HopperAccumulation(
            self.recipe.accumulator_bits, self.recipe.accumulator_promotion)
        self._init_scaling_state(self.weight.device)
        self.register_load_state_dict_pre_hook(_refuse_bad_fp8_state)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe | str = "current") -> "Fp8Linear":
        """An Fp8Linear that reuses `linear`'s weight and bias Parameter objects (no copy)."""
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, recipe=recipe,
                  device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new._init_scaling_state(linear.weight.device)
        new.train(linear.training)
        return new

    def _init_scaling_state(self, device) -> None:
        for role in ROLES:
            self.register_buffer(f"{role}_nonfinite_amax_count", torch.zeros((), dtype=torch.int64, device=device))
            if self.recipe.is_delayed:
                self.register_buffer(f"{role}_amax_history",
                                     torch.zeros(self.recipe.amax_history_len, dtype=torch.float32, device=device))
                self.register_buffer(f"{role}_scale", torch.ones((), dtype=torch.float32, device=device))
                self.register_buffer(f"{role}_scale_amax", torch.zeros((), dtype=torch.float32, device=device))
                self.register_buffer(f"{role}_pending_amax", torch.full((), -1.0, device=device))
                self.register_buffer(f"{role}_initialized", torch.zeros((), dtype=torch.bool, device=device))

    def _gemm_options(self) -> dict:
        return dict(record=self.gemm_paths, accumulation=self._accumulation)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.code()}"

    def _apply(self, fn, recurse=True):
        # .to(dtype), .half() and .bfloat16() cast the weights but never the scaling state: a 1.5e-9
        # grad_output scale flushes to 0 in fp16, and bf16 would round every scale and amax history. Buffers
        # still follow device moves.
        scaling_state = dict(self._buffers)
        self._buffers.clear()
        super()._apply(fn, recurse)
        for name, buffer in scaling_state.items():
            moved = buffer if buffer is None else fn(buffer)
            self._buffers[name] = moved if moved is None or moved.dtype == buffer.dtype else buffer.to(moved.device)
        return self

    # ------------------------------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device_type = input.device.type
        # Output dtype follows autocast (bf16 under torch.autocast), else the input's dtype.
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
            else input.dtype
        lead_shape = input.shape[:-1]
        input_2d = input.reshape(-1, self.in_features)  # (M, K)
        if input_2d.shape[0] == 0:
            return F.linear(input, self.weight.to(out_dtype), None if self.bias is None else self.bias.to(out_dtype))
        backend = resolve_backend(self.recipe.backend, input.device, tuple(map(self.recipe.format_of, ROLES)))
        # Our GEMMs pick their own precision; autocast must not recast them to bf16.
        with torch.autocast(device_type, enabled=False):
            input_fp8 = self._quantize("input", input_2d)
            weight_fp8 = self._quantize("weight", self.weight)
            output = _Fp8LinearFunction.apply(input_2d, self.weight, self.bias, input_fp8, weight_fp8, self,
                                              backend, out_dtype)
        return output.reshape(*lead_shape, self.out_features)

    def _quantize(self, role: str, tensor: torch.Tensor) -> Fp8Tensor:
        """FP8 copy of a 2-D operand with the recipe's format/granularity for `role`; updates scaling state."""
        r = self.recipe
        fmt = r.format_of(role)
        nonfinite_count = getattr(self, f"{role}_nonfinite_amax_count")
        if isinstance(tensor, Fp8GatheredWeight):  # FSDP2 gathered it as FP8 already (fp8_all_gather.py)
            quantized = tensor.fp8_tensor()
            self._record_amax(role, quantized.amax)
            return quantized  # no weight telemetry: the fp32 weight is not gathered
        tensor = tensor.detach()
        if r.is_delayed:
            amax = compute_amax(tensor)
            self._record_amax(role, amax)
            # the scale is finite and > 0 by construction (_tensorwise_scale): no per-call host sync
            quantized = quantize(tensor, fmt, scale=self._tensorwise_scale(role, amax), keep_values=True,
                                 validate_scale=False)
            quantized.amax = amax
        elif r.scaling == "mxfp8":
            quantized = quantize_mx(tensor, fmt, keep_values=True)
            nonfinite_count.add_((~torch.isfinite(quantized.amax)).any().long())
        else:
            quantized = quantize(tensor, fmt, granularity=r.granularity_of(role), block=r.block_of(role),
                                 axis=-1, margin=r.margin, pow2=r.pow2_scales, keep_values=True)
            nonfinite_count.add_((~torch.isfinite(quantized.amax)).any().long())
        if self.telemetry:
            self._record_stats(role, tensor, quantized)
        return quantized

    def _tensorwise_scale(self, role: str, amax: torch.Tensor) -> torch.Tensor:
        """The dequant scale a tensor of `role` with this `amax` is quantized with, under a tensorwise recipe:
        delayed, the stored scale once initialized, else (first step) the tensor's own; current, its own.
        fp8_all_gather uses it too, with the amax of the whole sharded weight."""
        r = self.recipe
        own_scale = scale_from_amax(amax, r.format_of(role), r.margin, r.pow2_scales)
        if not r.is_delayed:
            return own_scale
        return torch.where(getattr(self, f"{role}_initialized"), getattr(self, f"{role}_scale"), own_scale)

    def _record_amax(self, role: str, amax: torch.Tensor) -> None:
        """Count a non-finite amax; delayed scaling in training also folds it into this step's pending amax."""
        finite = torch.isfinite(amax)
        getattr(self, f"{role}_nonfinite_amax_count").add_((~finite).any().long())
        if self.recipe.is_delayed and self.training:
            pending = getattr(self, f"{role}_pending_amax")
            pending.copy_(torch.where(finite, torch.maximum(pending, amax), pending))

    def _quantize_transposed(self, role: str, tensor: torch.Tensor) -> Fp8Tensor:
        """`role`'s recipe applied to tensor.T: (C, R) FP8 bytes whose scales run along the original first
        dim, written straight in the layout its backward GEMM reads (no separate FP8 transpose). Counters and
        telemetry come from the primary quantization of the same tensor."""
        r = self.recipe
        tensor_t = tensor.detach().t()
        if r.scaling == "mxfp8":
            return quantize_mx(tensor_t, r.format_of(role))
        return quantize(tensor_t, r.format_of(role), granularity=r.granularity_of(role), block=r.block_of(role),
                        axis=-1, margin=r.margin, pow2=r.pow2_scales)

    def _record_stats(self, role: str, tensor: torch.Tensor, quantized: Fp8Tensor) -> None:
        stats = quant_error(tensor, quantized)
        amax_now = float(quantized.amax.max()) if not torch.isnan(quantized.amax).any() else math.nan
        staleness = None
        if self.recipe.is_delayed:
            if bool(getattr(self, f"{role}_initialized")):
                source_amax = float(getattr(self, f"{role}_scale_amax"))
                staleness = amax_now / source_amax if source_amax > 0 else math.inf
            else:
                staleness = 1.0  # still on current scaling: the scale came from this very tensor
        self.last_stats[role] = dict(
            amax=amax_now,
            scale=float(quantized.scale.float().mean()),
            overflow_frac=stats["overflow_frac"],
            underflow_frac=stats["underflow_frac"],
            sqnr_db=stats["sqnr_db"],
            staleness=staleness,
            nonfinite=not math.isfinite(amax_now),
        )

    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _update_role(self, role: str, step_amax: torch.Tensor) -> None:
        """Delayed scaling: fold this step's (all-reduced) amax into `role`'s history and scale."""
        r = self.recipe
        history = getattr(self, f"{role}_amax_history")
        recorded = step_amax >= 0  # pending stays at -1 when no micro-batch recorded an amax
        rolled = torch.cat([step_amax.reshape(1).to(history.dtype), history[:-1]])
        history.copy_(torch.where(recorded, rolled, history))
        amax = history.max() if r.amax_compute_algo == "max" else history[0]
        usable = recorded & (amax > 0)
        scale, scale_amax = getattr(self, f"{role}_scale"), getattr(self, f"{role}_scale_amax")
        scale.copy_(torch.where(usable, scale_from_amax(amax, r.format_of(role), r.margin, r.pow2_scales), scale))
        scale_amax.copy_(torch.where(usable, amax, scale_amax))
        initialized = getattr(self, f"{role}_initialized")
        initialized.copy_(initialized | usable)
        getattr(self, f"{role}_pending_amax").fill_(-1.0)


@torch.no_grad()
def update_fp8_scales(model: nn.Module, process_group=None) -> None:
    """Roll delayed-scaling histories once per optimizer step (after optimizer.step()). No-op for other recipes.

    All pending amaxes of all layers go through ONE all_reduce(MAX) when torch.distributed is initialized, so
    every data-parallel rank ends the step with identical scales.
    """
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.recipe.is_delayed]
    if not layers:
        return
    pending = torch.stack([getattr(m, f"{role}_pending_amax") for m in layers for role in ROLES])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1:
        dist.all_reduce(pending, op=dist.ReduceOp.MAX, group=process_group)
    step_amaxes = iter(pending.unbind(0))
    for layer in layers:
        for role in ROLES:
            layer._update_role(role, next(step_amaxes))
