"""Fp8Linear: an nn.Linear whose three GEMMs run on FP8 operands, with fp32 master weights.

For y = x W^T + b with input x (M, K) (leading dims flattened), weight W (N, K) and grad_output dy (M, N):

    output      = input         @ weight.T     (M, K) @ (K, N) -> (M, N)    forward
    grad_input  = grad_output   @ weight       (M, N) @ (N, K) -> (M, K)    backward
    grad_weight = grad_output.T @ input        (N, M) @ (M, K) -> (N, K)    backward

Every operand is FP8 (input and weight in E4M3; grad_output in E5M2 for the hybrid delayed/current recipes, E4M3
for rowwise/block), each with its dequantization scale, and every GEMM accumulates in fp32 (gemm.fp8_mm).
grad_bias = sum of grad_output over rows, in fp32 from the unquantized gradient, as in every FP8 recipe.
The input is saved for backward as FP8 bytes + scale (1 byte per element), never in high precision; the weight's
FP8 copy is saved too, so backward reuses exactly the operands the forward used - except where a backward GEMM
contracts an operand's first dim across its scales (rowwise, mxfp8, non-square block tiles): that operand is
quantized again along the other axis for that GEMM (recipes.Fp8Recipe.requantize_transposed), and the input is
then saved in that form only, so every GEMM's scales factor out or tile K as the FP8 kernels need.

The weight's FP8 copy (bytes, scale, and its values in the GEMM's compute dtype) is made once per weight version
and reused by every micro-batch and by backward: it is remade when the weight changes in place (optimizer step,
checkpoint load: tensor._version; and any torch.optim optimizer's step, counted by a global step hook that the
first forward caching a weight registers (never an import or a layer's construction: nn/delayed_scaling.py),
because fused AdamW updates weights in place without bumping their version), when it is replaced, when delayed
scales are updated, and when the layer switches between train and eval. An fp32 (or bf16) copy of FP8 values exists
only where a GEMM reads it.

Scaling state (module buffers, hence in state_dict and checkpoints), one role's owned by `layer.quantizers[role]`
(an OperandQuantizer, nn/quantizer.py: that role's quantize, quantize_transposed and scale rule):
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

   A loop that never calls it (transformers' Trainer without `fp8train.Fp8ScalingCallback`, a hand-written
   loop) would silently train with current scaling while pending_amax only grows: the first training forward
   that finds amaxes pending from before an optimizer step (any torch.optim optimizer's step since the layer's
   first pending record, with no update in between) warns, once per process, saying what to call.

- delayed scaling, per role: `{role}_stale_scale_steps` (int64), the number of optimizer steps whose amax was
  above 0 but below `scale * fmt.min_normal`: the step's largest value, and so all of it, quantized below the
  smallest normal (mostly to zero) because an earlier, much larger amax (an outlier) still set the scale.
  `recipe.amax_outlier_factor` (opt-in; 0 = off) keeps such a single outlier from setting the scale: with "max",
  when the largest history entry exceeds the factor times the second largest (and that is > 0), the scale comes
  from the second largest. Two outliers in the window are trusted.

Execution options (same results, different speed): `layer.quantize_kernel` ('auto' or one of
cast_kernels.QUANT_KERNELS; default 'auto': native (the C kernel) on a CPU where it builds, at every size, compiled
on a GPU, else eager; 'native' where it does not build runs eager; tensors under QUANT_KERNEL_MIN_NUMEL elements
never run the compiled kernel, which does not pay) and
`layer.emulated_dtype` ('auto' | 'fp32' | 'bf16', gemm_choice.emulated_compute_dtype). `configure_execution(model,
...)` sets both on every Fp8Linear. What follows from them and the recipe (the backend, what each operand keeps, the
GEMM each of the three runs) is resolved once per device and dtypes and kept on the layer (nn/linear_dispatch.py).

Telemetry: set `layer.telemetry = True` and every following forward (input, weight) and backward (grad_output)
overwrites `layer.last_stats[role]` with amax, scale (mean over rows/blocks when not tensorwise), overflow_frac,
underflow_frac, sqnr_db (quant.quant_error), staleness (delayed only: this tensor's amax / the amax its scale was
computed from, 1.0 while on current scaling; None for other recipes) and nonfinite. Off by default: it costs
host syncs and an extra pass over each tensor.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8train.nn.accumulation import HopperAccumulation
from fp8train.nn.fp8_all_gather import Fp8GatheredWeight
from fp8train.nn import delayed_scaling
from fp8train.nn.delayed_scaling import (MISSING_UPDATE_WARNING, check_scales_updated, refuse_bad_fp8_state,
                                         update_fp8_scales)
from fp8train.nn.fp8_operand import Fp8Operand
from fp8train.nn.gemm_choice import AUTO_EMULATED_DTYPE, Keep, check_emulated_dtype, resolve_backend
from fp8train.nn.linear_dispatch import NO_DISPATCH, dispatch_for
from fp8train.nn.linear_function import Fp8LinearFunction, WeightFp8, to_dtype
from fp8train.nn.quantizer import SCALING_BUFFERS, OperandQuantizer, apply_keeping_scaling_dtypes
from fp8train.nn.recipes import DEFAULT_RECIPE, ROLES, Fp8Recipe, GemmBackend, OperandRole, recipe as make_recipe
from fp8train.numerics import native_cast
from fp8train.numerics.names import Granularity, QuantizeKernel
from fp8train.numerics.cast_kernels import DEFAULT_QUANTIZE_KERNEL, KERNEL_CHOICES, check_kernel, resolve_kernel

__all__ = ["Fp8Linear", "update_fp8_scales", "configure_execution", "SCALING_BUFFERS", "is_scaling_buffer",
           "MISSING_UPDATE_WARNING", "check_scales_updated"]


def is_scaling_buffer(key: str) -> bool:
    """True for a state_dict key naming an Fp8Linear scaling buffer (`...q_proj.input_amax_history`)."""
    last = key.rpartition(".")[2]
    return any(last == f"{role}_{name}" for role in ROLES for name in SCALING_BUFFERS)

# Below this a compiled kernel (a call costs ~50-100 us) gains less than its one-time compile (5-25 s per
# configuration on CPU) costs in a typical run: smaller tensors always run eagerly, and 'auto' never measures.
QUANT_KERNEL_MIN_NUMEL = 1 << 20


# ------------------------------------------------------------------------------------------------------------
# The layer (its autograd Function: nn/linear_function.py)
# ------------------------------------------------------------------------------------------------------------
class Fp8Linear(nn.Linear):
    """nn.Linear with FP8 GEMMs (see the module docstring). The weight/bias stay fp32 master Parameters."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 recipe: Fp8Recipe | str = DEFAULT_RECIPE, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = make_recipe(recipe) if isinstance(recipe, str) else recipe
        if self.recipe.backend == GemmBackend.TE:
            resolve_backend(GemmBackend.TE, "cpu")  # raises: TE replaces the layer instead (backends.te.make_te_linear)
        self.telemetry = False
        self.last_stats: dict[str, dict] = {}
        # Which kernel each GEMM ran last: {"output" | "grad_input" | "grad_weight": "scaled_mm:<kind>" |
        # "fallback:<reason>" | "emulated"} (plain Python, written every call: no device sync).
        self.gemm_paths: dict[str, str] = {}
        self.accumulation_model = None if not self.recipe.accumulator_bits else HopperAccumulation(
            self.recipe.accumulator_bits, self.recipe.accumulator_promotion)
        self.quantize_kernel = DEFAULT_QUANTIZE_KERNEL  # same bytes whichever kernel runs
        self._resolved_kernel = (None, None)  # (quantize_kernel, what it is on this layer's device): kernel_for
        self.emulated_dtype = AUTO_EMULATED_DTYPE
        # One per operand role, each owning that role's scaling buffers (registered on this layer: nn/quantizer.py)
        self.quantizers = {role: OperandQuantizer(self, role) for role in ROLES}
        self._delayed = self.recipe.is_delayed  # (read on every forward)
        self._init_scaling_state(self.weight.device)
        self.register_load_state_dict_pre_hook(refuse_bad_fp8_state)

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Fp8Recipe | str = DEFAULT_RECIPE) -> "Fp8Linear":
        """An Fp8Linear that reuses `linear`'s weight and bias Parameter objects (no copy)."""
        new = cls.from_parameters(linear.weight, linear.bias, recipe)
        new.train(linear.training)
        return new

    @classmethod
    def from_parameters(cls, weight: nn.Parameter, bias: nn.Parameter | None,
                        recipe: Fp8Recipe | str = DEFAULT_RECIPE) -> "Fp8Linear":
        """An Fp8Linear holding these Parameter objects (weight (out, in)), its scaling state on their device."""
        new = cls(weight.shape[1], weight.shape[0], bias=bias is not None, recipe=recipe, device="meta")
        new.weight = weight
        new.bias = bias
        new._init_scaling_state(weight.device)
        return new

    def _init_scaling_state(self, device) -> None:
        for quantizer in self.quantizers.values():
            quantizer.register_buffers(device)
        self._reset_caches()

    def _reset_caches(self) -> None:
        for quantizer in self.quantizers.values():
            quantizer.reset()
        self._scale_generation = 0  # bumped by every delayed-scale update: part of the weight cache's key
        self._weight_cache = None
        self.dispatch_table = NO_DISPATCH  # what the GEMMs run, per device and dtypes (nn/linear_dispatch.py)
        # The optimizer-step count when this step's first amax was recorded (delayed scaling): a later forward
        # that sees another count with amaxes still pending ran past an optimizer step without update_fp8_scales.
        self._pending_since_step = None
        # False when something refills the weight's storage in place without a version bump, so the cache key
        # cannot see the change: FSDP2's all-gather into a block's unsharded weights (set by fsdp2.apply_fsdp2).
        self.weight_cache_allowed = getattr(self, "weight_cache_allowed", True)

    # A layer born from a transformers Conv1D (GPT-2) computes with its weight in the nn.Linear layout (out, in),
    # but its state_dict holds it in Conv1D's (in, out), the model's own layout: transformers' save_pretrained,
    # a Trainer checkpoint or fp8train's checkpoints of the converted model are then read by the plain model's
    # from_pretrained as they should be (a square attn.c_proj would otherwise load silently transposed).
    conv1d_layout = False
    # How this layer's weight is split over a tensor-parallel group (nn/tensor_parallel.TpLayout, set by its first
    # forward on a DTensor weight): its quantizers reduce the amaxes of split operands over that group. None: whole.
    tp_layout = None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = f"{prefix}weight"
        if self.conv1d_layout and key in destination:
            destination[key] = destination[key].t() if keep_vars else destination[key].t().contiguous()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        key = f"{prefix}weight"
        # Conv1D's (in, out) comes back to (out, in). A rectangular (out, in) weight is a checkpoint written before
        # state dicts held Conv1D's layout and loads as it is; a square one cannot tell, and is read as (in, out).
        if self.conv1d_layout and key in state_dict and tuple(state_dict[key].shape) == \
                (self.in_features, self.out_features):
            state_dict[key] = state_dict[key].t()
        self._reset_caches()
        for role in ROLES:  # checkpoints from before the stale-scale counter load with it at 0
            key = f"{prefix}{role}_stale_scale_steps"
            if self.recipe.is_delayed and key not in state_dict:
                state_dict[key] = torch.zeros((), dtype=torch.int64)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.code()}"

    def _apply(self, fn, recurse=True):
        apply_keeping_scaling_dtypes(self, fn, lambda f: super(Fp8Linear, self)._apply(f, recurse))
        self._resolved_kernel = (None, None)  # 'auto' depends on the device
        self.dispatch_table = NO_DISPATCH
        return self

    # ------------------------------------------------------------------------------------------------------
    def forward(self, input: torch.Tensor, weight: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        """output = input @ weight.T + bias in FP8. ``weight`` and ``bias``: this rank's shards, given by
        tensor_parallel_forward; None (a plain call): the layer's own."""
        if weight is None:
            weight, bias = self.weight, self.bias
            # A DTensor weight is a tensor-parallel shard (torch's Colwise/RowwiseParallel): local GEMMs. Looked up
            # without importing torch.distributed.tensor (about a second for a process that never uses it): no
            # DTensor exists before that module is loaded. Inline: this runs on every forward.
            dtensor = sys.modules.get("torch.distributed.tensor")
            if dtensor is not None and isinstance(weight, dtensor.DTensor):
                from fp8train.nn.tensor_parallel import tensor_parallel_forward  # loaded with DTensor already

                return tensor_parallel_forward(self, input)
        if weight.is_meta or input.is_meta:  # shapes only: no amax, no scale, nothing to quantize
            raise ValueError("Fp8Linear on the meta device cannot run its FP8 GEMMs (scaling needs real values): "
                             "materialize it first, e.g. model.to_empty(device=...) and then load a state_dict")
        device_type = input.device.type
        # Output dtype follows autocast (bf16 under torch.autocast), else the input's dtype.
        out_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) \
            else input.dtype
        in_features, out_features = weight.shape[1], weight.shape[0]
        input_2d = input if input.dim() == 2 else input.reshape(-1, in_features)  # (M, K)
        if input_2d.shape[0] == 0:
            return F.linear(input, weight.to(out_dtype), None if bias is None else bias.to(out_dtype))
        if self._delayed and self.training and not torch.compiler.is_compiling():  # (a missing update warns)
            pending_since = check_scales_updated(self._pending_since_step)
            if pending_since != self._pending_since_step:  # (a plain value: as in scales_updated)
                object.__setattr__(self, "_pending_since_step", pending_since)
        dispatch = dispatch_for(self, input.device, out_dtype, input.dtype, weight.dtype)
        # Our GEMMs pick their own precision; autocast must not recast them to bf16.
        with torch.autocast(device_type, enabled=False):
            weights = self._weight_fp8(dispatch, weight)
            output = Fp8LinearFunction.apply(input_2d, weight, bias, weights, self, dispatch, out_dtype)
        return output if input.dim() == 2 else output.reshape(*input.shape[:-1], out_features)

    def kernel_for(self, numel: int) -> QuantizeKernel:
        """The quantize kernel this layer runs on a tensor of `numel` elements (`quantize_kernel`, resolved)."""
        if torch.compiler.is_compiling():
            return QuantizeKernel.EAGER  # (a traced model inlines the math into its own graph anyway)
        asked, kernel = self._resolved_kernel
        if asked is not self.quantize_kernel:  # 'auto': native on a CPU where it builds, compiled on a GPU, else eager
            kernel = resolve_kernel(self.quantize_kernel, self.weight.device, native_cast.available())
            self._resolved_kernel = (self.quantize_kernel, kernel)
        if kernel is QuantizeKernel.NATIVE:
            return kernel  # at every size (quant.quantize runs eager where the C kernel cannot)
        return QuantizeKernel.EAGER if numel < QUANT_KERNEL_MIN_NUMEL else kernel

    def _weight_fp8(self, dispatch, weight: torch.Tensor) -> WeightFp8:
        """The FP8 copy of `weight` (the layer's, or this rank's shard of it) and its GEMM operands, made once per
        weight version (see the module docstring); `dispatch` says what it keeps (linear_dispatch.LayerDispatch)."""
        # FSDP2 refills the unsharded weight by all-gather (no version bump) or hands over an FP8-gathered one:
        # then there is nothing to cache across forwards. (FSDP2's class exists only once torch.distributed.fsdp
        # is imported, ~1.4 s that a run without it does not pay for this check.)
        fsdp = sys.modules.get("torch.distributed.fsdp")
        cacheable = self.weight_cache_allowed and not isinstance(weight, Fp8GatheredWeight) \
            and not (fsdp is not None and isinstance(self, fsdp.FSDPModule)) \
            and not torch.compiler.is_compiling()  # (a traced graph re-derives it anyway)
        if cacheable and delayed_scaling.step_hook is None:  # (fused AdamW writes weights without a version bump:
            delayed_scaling.watch_optimizer_steps()             # the optimizer steps are part of the key too)
        # tensor._version: torch's in-place write counter, the one signal an in-place update of the weight gives;
        # a tensor-parallel shard's own counter does not see an in-place write through its DTensor parameter,
        # whose counter does (self.weight; the same tensor as `weight` otherwise)
        key = (weight._version, self.weight._version, delayed_scaling.optimizer_steps, weight.data_ptr(),
               self.training, self._scale_generation, dispatch.backend, self.emulated_dtype,
               self.quantize_kernel) if cacheable else None
        cached = self._weight_cache
        if cached is not None and key is not None and cached.key == key and not self.telemetry:
            return cached
        keep = dispatch.weight_keeps
        weight_quantizer = self.quantizers[OperandRole.WEIGHT]
        # Only the dtype the GEMMs read is kept (block-scaled weights are dequantized in fp32): bf16 values written
        # by the quantize itself (the same bits as narrowing its fp32 ones, one op and one copy less)
        keep_values = torch.bfloat16 if keep is Keep.FP32 and dispatch.compute_dtype == torch.bfloat16 and \
            weight_quantizer.granularity is not Granularity.BLOCK else keep.value
        with torch.no_grad():
            weight_fp8 = weight_quantizer.quantize(weight, keep_values=keep_values)
            if weight_fp8.values is not None and weight_fp8.granularity != Granularity.BLOCK:
                weight_fp8.values = to_dtype(weight_fp8.values, dispatch.compute_dtype)
            weight_op = Fp8Operand.from_fp8_tensor(weight_fp8)
            if dispatch.weight_transposed:  # scales along K, constant along the contracted N
                weight_op_grad = Fp8Operand.from_fp8_tensor(
                    weight_quantizer.quantize_transposed(weight, keep_values=keep.value)).t()
            else:
                weight_op_grad = weight_op
            # block tiles that the GEMMs read as value * scale in fp32 (Keep.FP32: no native GEMM on them)
            tiles_dequantized = keep is Keep.FP32 and weight_quantizer.granularity is Granularity.BLOCK
            for op in {id(weight_op): weight_op, id(weight_op_grad): weight_op_grad}.values():
                if tiles_dequantized and op.block is not None:
                    op.dequantize(torch.float32)  # tiles vary along K: the GEMMs read the dequantized weight
            weights = WeightFp8(key, weight_fp8, weight_op.t(), weight_op_grad)
        if key is not None:  # (never while compiling: compiled graphs re-derive and fuse it)
            object.__setattr__(self, "_weight_cache", weights)  # (a plain value: as in scales_updated)
        return weights

    def configure(self, quantize_kernel: str, emulated_dtype: str) -> None:
        """Set how this layer runs (configure_execution checked both values)."""
        self.quantize_kernel, self.emulated_dtype = quantize_kernel, emulated_dtype
        self._resolved_kernel = (None, None)
        self.dispatch_table = NO_DISPATCH
        self.forget_weight_fp8()  # ('auto' may now resolve otherwise: gemm.set_cpu_bf16_gemm)

    def forget_weight_fp8(self) -> None:
        """Drop the cached FP8 copy of the weight: the next forward quantizes the weight again."""
        self._weight_cache = None

    def scales_updated(self) -> None:
        """Called by update_fp8_scales once it has written new delayed scales: the weight's FP8 copy is remade
        with them, and the check for a missing update starts over."""
        # (plain values, not parameters, buffers or modules: set past nn.Module.__setattr__'s checks, ~2 us each,
        # as this runs for every delayed layer at every optimizer step)
        object.__setattr__(self, "_scale_generation", self._scale_generation + 1)
        object.__setattr__(self, "_pending_since_step", None)


def configure_execution(model: nn.Module, *, quantize_kernel: str = DEFAULT_QUANTIZE_KERNEL,
                        emulated_dtype: str = AUTO_EMULATED_DTYPE) -> int:
    """Set how every Fp8Linear in `model` runs (not what it computes): the quantize kernel (one of
    cast_kernels.KERNEL_CHOICES; 'auto' is resolved per layer device, cast_kernels.resolve_kernel) and the
    emulated GEMMs' input dtype ('auto', 'fp32', 'bf16'), and the same on every grouped layer's per-expert scaling
    state. Returns the number of layers (and experts states) set. Read once, at set-up."""
    check_kernel(quantize_kernel, KERNEL_CHOICES, "quantize_kernel")
    check_emulated_dtype(emulated_dtype)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    for layer in layers:
        layer.configure(quantize_kernel, emulated_dtype)
    experts = [m for m in model.modules() if hasattr(m, "delayed_units")]  # (nn/experts_scaling.py)
    for scaling in experts:
        scaling.configure(quantize_kernel=quantize_kernel, emulated_dtype=emulated_dtype)
    return len(layers) + len(experts)
