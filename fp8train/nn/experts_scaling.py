"""ExpertScaling: the FP8 scaling state of one grouped GEMM of a mixture-of-experts layer, one slot per expert.

A grouped GEMM (nn/experts.py) multiplies each expert's tokens by that expert's weight. Every expert is scaled
as its own dense layer would be: its three operands (input = its token group, weight = its (N, K) weight,
grad_output = its token group's gradient) each get that recipe's scales from that expert's tensors only. So
each expert `e` has a view (`scaling.experts[e]`, an ExpertView) that behaves, towards fp8train's dense
machinery (OperandQuantizer, Fp8LinearFunction, delayed_scaling.update_group), exactly like an Fp8Linear whose
scaling buffers are row `e` of this module's buffers.

Buffers (registered on this module, hence in state_dict and checkpoints), with the names and meanings of
Fp8Linear's (nn/linear.py's docstring), each with a leading experts dim E:
- every recipe: `{role}_nonfinite_amax_count` (E,) int64;
- delayed scaling: `{role}_amax_history` (E, L), `{role}_scale`, `{role}_scale_amax`, `{role}_pending_amax`,
  `{role}_initialized`, `{role}_stale_scale_steps`, each (E,).

Delayed scaling runs the dense rule per expert, with one addition: an expert that receives no tokens in a step
runs none of its GEMMs, so its input and grad_output record nothing that step (pending stays -1, and
update_fp8_scales leaves that role's history and scale as they were, as for any role that recorded nothing); its
weight is still quantized in training, so the weight's history keeps one entry per step. `update_fp8_scales`
finds these modules by their `delayed_units` (the per-expert views) and folds every expert's pending amaxes
into its one all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8train.nn.delayed_scaling import refuse_bad_fp8_state
from fp8train.nn.gemm import AUTO_EMULATED_DTYPE, check_emulated_dtype
from fp8train.nn.delayed_scaling import check_scales_updated
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.linear_dispatch import NO_DISPATCH
from fp8train.nn.quantizer import OperandQuantizer, apply_keeping_scaling_dtypes
from fp8train.nn.recipes import DEFAULT_RECIPE, Fp8Recipe, GemmBackend, ROLES, recipe as make_recipe
from fp8train.numerics.cast_kernels import DEFAULT_QUANTIZE_KERNEL, KERNEL_CHOICES, check_kernel

__all__ = ["ExpertScaling", "ExpertView"]


class ExpertScaling(nn.Module):
    """Per-expert FP8 scaling state and execution settings of one grouped GEMM with `num_experts` experts."""

    def __init__(self, num_experts: int, recipe: Fp8Recipe | str = DEFAULT_RECIPE, device=None):
        super().__init__()
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
        self.recipe = make_recipe(recipe) if isinstance(recipe, str) else recipe
        if self.recipe.backend == GemmBackend.TE:
            raise ValueError("recipe backend='te' is not supported by FP8 experts (Transformer Engine replaces "
                             "nn.Linear layers only); use backend 'auto', 'emulated' or 'scaled_mm'")
        self.num_experts = num_experts
        self.telemetry = False
        self.quantize_kernel = DEFAULT_QUANTIZE_KERNEL
        self.emulated_dtype = AUTO_EMULATED_DTYPE
        # {"output" | "grad_input" | "grad_weight": kernel or fallback} of the last expert that ran each GEMM
        self.gemm_paths: dict[str, str] = {}
        # {gemm: "scaled_grouped_mm:<kind>" | "per_expert:<why the grouped kernel does not take it>"} (scaled_mm
        # backend only: nn/experts_scaled_gemm.py)
        self.grouped_paths: dict[str, str] = {}
        self.experts = [ExpertView(self, index) for index in range(num_experts)]
        # every expert's FP8 weight made in one call (nn/experts_weights.py): (key, list of WeightFp8) or None
        self.weights_fp8_cache = None
        self.scale_generation = 0  # bumped by every delayed-scale update: part of that cache's key
        self._register_buffers(torch.device("cpu") if device is None else device)
        self._pending_since_step = None  # (linear.check_scales_updated)
        self.register_load_state_dict_pre_hook(refuse_bad_fp8_state)

    def _register_buffers(self, device) -> None:
        e, r = self.num_experts, self.recipe
        for role in ROLES:
            self.register_buffer(f"{role}_nonfinite_amax_count", torch.zeros(e, dtype=torch.int64, device=device))
            if r.is_delayed:
                self.register_buffer(f"{role}_amax_history",
                                     torch.zeros(e, r.amax_history_len, dtype=torch.float32, device=device))
                self.register_buffer(f"{role}_scale", torch.ones(e, dtype=torch.float32, device=device))
                self.register_buffer(f"{role}_scale_amax", torch.zeros(e, dtype=torch.float32, device=device))
                self.register_buffer(f"{role}_pending_amax", torch.full((e,), -1.0, device=device))
                self.register_buffer(f"{role}_initialized", torch.zeros(e, dtype=torch.bool, device=device))
                self.register_buffer(f"{role}_stale_scale_steps", torch.zeros(e, dtype=torch.int64, device=device))

    # update_fp8_scales reads and writes this module's (E,) buffers whole, rows (expert, role) (delayed_scaling.py)
    stacked_delayed_state = True

    @property
    def delayed_units(self) -> list:
        """The per-expert views update_fp8_scales steps (delayed scaling only; empty otherwise)."""
        return self.experts if self.recipe.is_delayed else []

    def scales_updated(self) -> None:
        """Called by update_fp8_scales after it wrote new delayed scales: every expert's FP8 weight is remade."""
        for view in self.experts:
            view.scales_updated()
        self.scale_generation += 1
        self._pending_since_step = None

    def check_scales_updated(self) -> None:
        """The dense layer's missing-update warning, for a training forward of a delayed grouped GEMM."""
        self._pending_since_step = check_scales_updated(self._pending_since_step)

    def configure(self, *, quantize_kernel: str | None = None, emulated_dtype: str | None = None) -> None:
        """How the experts run (not what they compute), as for an Fp8Linear; linear.configure_execution(model)
        calls it for every ExpertScaling of the model."""
        if emulated_dtype is not None:
            check_emulated_dtype(emulated_dtype)
            self.emulated_dtype = emulated_dtype
        if quantize_kernel is not None:
            check_kernel(quantize_kernel, KERNEL_CHOICES, "quantize_kernel")
            self.quantize_kernel = quantize_kernel
        self.forget_weights_fp8()

    def forget_weights_fp8(self) -> None:
        """Drop every cached FP8 expert weight (the batched copies and each view's own)."""
        self.weights_fp8_cache = None
        for view in self.experts:
            view.forget_weight_fp8()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self.weights_fp8_cache = None
        for view in self.experts:
            view.reset()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        apply_keeping_scaling_dtypes(self, fn, lambda f: super(ExpertScaling, self)._apply(f, recurse))
        self.weights_fp8_cache = None
        for view in self.experts:
            view.moved()
        return self

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, recipe={self.recipe.code()}"


class ExpertView:
    """Expert `index` of an ExpertScaling, seen as a dense FP8 layer: its buffers are row `index` of the owner's
    (looked up at each use, so device moves and loads are followed), its execution settings the owner's. The
    dense layer's weight-cache, kernel and GEMM-option logic is Fp8Linear's own (the same functions), so an
    expert's tokens go through exactly the dense path. `weight` is that expert's (N, K) weight, set by the grouped
    GEMM before each use."""

    # Fp8Linear's own logic for the FP8 weight copy (made once per weight version), the quantize kernel and the
    # GEMM options: an expert is quantized and multiplied exactly as a dense layer is.
    _weight_fp8 = Fp8Linear._weight_fp8
    kernel_for = Fp8Linear.kernel_for
    forget_weight_fp8 = Fp8Linear.forget_weight_fp8
    weight_cache_allowed = True
    accumulation_model = None
    tp_layout = None  # experts are never split by tensor parallelism (docs/distributed.md)

    def __init__(self, owner: ExpertScaling, index: int):
        self._owner, self.index = owner, index
        self.recipe = owner.recipe
        self.weight = None
        self.last_stats: dict[str, dict] = {}
        if self.recipe.accumulator_bits:
            from fp8train.nn.accumulation import HopperAccumulation
            self.accumulation_model = HopperAccumulation(self.recipe.accumulator_bits,
                                                         self.recipe.accumulator_promotion)
        self.quantizers = {role: OperandQuantizer(self, role) for role in ROLES}
        self.reset()

    def reset(self) -> None:
        for quantizer in self.quantizers.values():
            quantizer.reset()
        self._weight_cache = None
        self._scale_generation = 0
        self._resolved_kernel = (None, None)  # (quantize_kernel, what it is on this device): Fp8Linear.kernel_for
        self.dispatch_table = NO_DISPATCH  # (nn/linear_dispatch.py)

    def scales_updated(self) -> None:
        self._scale_generation += 1

    def moved(self) -> None:
        """After a device move: the FP8 weight is remade and 'auto' resolved again (as Fp8Linear._apply does)."""
        self.forget_weight_fp8()
        self._resolved_kernel = (None, None)
        self.dispatch_table = NO_DISPATCH

    def weight_fp8(self, dispatch):
        """This expert's FP8 weight and its GEMM operands (Fp8Linear's cache: once per weight version)."""
        return self._weight_fp8(dispatch, self.weight)

    def __getattr__(self, name: str):
        # `{role}_{buffer}`: row `index` of the owner's buffer (a view, so in-place updates reach the owner)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._owner, name)[self.index]

    # the owner's settings, read at each use
    training = property(lambda self: self._owner.training)
    telemetry = property(lambda self: self._owner.telemetry)
    gemm_paths = property(lambda self: self._owner.gemm_paths)
    grouped_paths = property(lambda self: self._owner.grouped_paths)
    emulated_dtype = property(lambda self: self._owner.emulated_dtype)

    @property
    def quantize_kernel(self) -> str:
        return self._owner.quantize_kernel

    @quantize_kernel.setter
    def quantize_kernel(self, value: str) -> None:  # (kernel_for resolves 'auto' once and stores the result)
        self._owner.quantize_kernel = value

    def __repr__(self) -> str:
        return f"ExpertView({self.index} of {self._owner.num_experts}, {self.recipe.code()})"
