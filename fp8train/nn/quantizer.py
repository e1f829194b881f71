"""OperandQuantizer: how an Fp8Linear makes one of its three operands (input, weight, grad_output) FP8.

A layer holds one per operand role (`Fp8Linear.quantizers[role]`), and each is the one place where the recipe's
rules for its role are applied:

- `quantize(tensor)`: the FP8 copy its GEMM reads (format, granularity and scale of the role), recording the
  amax (delayed scaling), the non-finite counter and telemetry;
- `quantize_transposed(tensor)`: the role's recipe applied to tensor.T, for a backward GEMM that contracts the
  tensor's first dim across its scales (recipes.Fp8Recipe.requantize_transposed);
- `tensorwise_scale(amax)`: the scale rule of a tensorwise recipe (also the FP8 all-gather's, fp8_all_gather.py);
- `saved_operand(data, scale, block, keep_values)` and `decode(data)`: FP8 bytes saved for backward, as a GEMM
  operand again.

Its scaling state is the layer's registered buffers `{role}_{name}` (name in SCALING_BUFFERS; Fp8Linear's
docstring says what each holds and how delayed scaling updates them), so state_dict keys, checkpoints and device
moves stay the layer's. The quantizer is a plain object, not a submodule (whose buffers would be keyed
`quantizers.{role}.{name}`), and it looks its buffers up on the layer by name at each use (`buffer(name)`):
`.to()`, `load_state_dict(assign=True)` and FSDP2 replace the tensor objects behind those names. How a tensor is
quantized (the kernel) and whether telemetry is recorded are the layer's execution settings, read from it.
"""

from __future__ import annotations

import math
import sys
import weakref

import torch
from torch.distributed.tensor import DTensor

from fp8train.nn.fp8_all_gather import Fp8GatheredWeight
from fp8train.nn.gemm import Fp8Operand
from fp8train.nn.recipes import Fp8Recipe, OperandRole
from fp8train.numerics import native_cast
from fp8train.numerics.formats import get_format
from fp8train.numerics.mx import quantize_mx
from fp8train.numerics.native_delayed import share_delayed_cast
from fp8train.numerics.quant import (Fp8Tensor, compute_amax, decode_fp8, native_quantize, quant_error, quantize,
                                     value_copies)
from fp8train.numerics.scaling import format_scale
from fp8train.numerics.names import Granularity, QuantizeKernel

__all__ = ["OperandQuantizer", "SCALING_BUFFERS", "DELAYED_SCALING_BUFFERS", "apply_keeping_scaling_dtypes"]

# The per-role scaling buffers an Fp8Linear may hold (`{role}_{name}`): a counter every recipe keeps, then
# delayed scaling's state, in the order they are registered (that of the layer's state_dict).
DELAYED_SCALING_BUFFERS = ("amax_history", "scale", "scale_amax", "pending_amax", "initialized",
                           "stale_scale_steps")
SCALING_BUFFERS = ("nonfinite_amax_count",) + DELAYED_SCALING_BUFFERS
_NO_BUFFERS: dict = {}  # (an owner without a module's buffer table: getattr finds its state)


class OperandQuantizer:
    """One operand role's FP8 quantization and scaling state for `layer` (an Fp8Linear; module docstring)."""

    def __init__(self, layer, role: OperandRole):
        self.layer = layer
        self.role = OperandRole(role)
        # The recipe's rules for this role, read once (a layer's recipe is fixed when it is built): the cast
        # path below reads attributes, not recipe methods, on every call.
        recipe = layer.recipe
        self.format = get_format(recipe.format_of(self.role))
        self.granularity = recipe.granularity_of(self.role)
        self.block = recipe.block_of(self.role)
        self.delayed, self.mx, self.tensorwise = recipe.is_delayed, recipe.is_mx, recipe.is_tensorwise
        self.margin, self.pow2 = recipe.margin, recipe.pow2_scales
        self._keys = {name: f"{self.role}_{name}" for name in SCALING_BUFFERS}  # the layer's buffer names
        self._keys_of: dict = {}  # names -> their keys (buffers())
        # a tensorwise input: a cast that layers reading the same tensor share (_shared_cast)
        self.shares_casts = self.role is OperandRole.INPUT and self.tensorwise
        # delayed scaling's native update: its pointer arrays for the group this quantizer is first of
        # (numerics/native_delayed.UpdatePlan, kept by nn/delayed_scaling.update_group)
        self.kept_update_plan = None
        self.reset()

    @property
    def recipe(self) -> Fp8Recipe:
        return self.layer.recipe

    def reset(self) -> None:
        """Forget what the host knows of the state (at init and on every state_dict load)."""
        # Host-side mirror of the `initialized` buffer (it only ever turns True between loads): once True, quantize
        # uses the stored scale without computing its own amax-based fallback.
        self.initialized_on_host = False
        self.mirror_updates = 0  # delayed updates since then (the mirror is read back at powers of two)

    def register_buffers(self, device) -> None:
        """Register this role's scaling buffers on the layer, at their initial values, on `device`."""
        layer, role, r = self.layer, self.role, self.recipe
        layer.register_buffer(f"{role}_nonfinite_amax_count", torch.zeros((), dtype=torch.int64, device=device))
        if r.is_delayed:
            layer.register_buffer(f"{role}_amax_history",
                                  torch.zeros(r.amax_history_len, dtype=torch.float32, device=device))
            layer.register_buffer(f"{role}_scale", torch.ones((), dtype=torch.float32, device=device))
            layer.register_buffer(f"{role}_scale_amax", torch.zeros((), dtype=torch.float32, device=device))
            layer.register_buffer(f"{role}_pending_amax", torch.full((), -1.0, device=device))
            layer.register_buffer(f"{role}_initialized", torch.zeros((), dtype=torch.bool, device=device))
            layer.register_buffer(f"{role}_stale_scale_steps", torch.zeros((), dtype=torch.int64, device=device))

    def buffer(self, name: str) -> torch.Tensor:
        """This role's scaling buffer `name` (one of SCALING_BUFFERS), as the layer holds it now: read from the
        module's buffer table (what getattr finds there, without nn.Module.__getattr__'s Python fallback: this
        runs several times per quantize and per layer of a delayed update)."""
        key = self._keys[name]
        found = self.layer.__dict__.get("_buffers", _NO_BUFFERS).get(key)
        return found if found is not None else getattr(self.layer, key)

    def kernel_buffer(self, name: str) -> torch.Tensor:
        """`buffer(name)` as a plain tensor for the native cast op to update in place: under tensor parallelism the
        layer's buffers are replicated DTensors, which a custom op cannot take; their local tensor is the same
        storage (this rank's value, as record_amax updates it: the delayed update's MAX all-reduce makes it the
        whole's)."""
        found = self.buffer(name)
        return found.to_local() if isinstance(found, DTensor) else found

    def buffers(self, names: tuple) -> list:
        """This role's scaling buffers `names`, as `buffer` reads each (one call for several: the delayed update
        reads five of every quantizer each step)."""
        keys = self._keys_of.get(names)
        if keys is None:
            keys = self._keys_of[names] = tuple(self._keys[name] for name in names)
        table = self.layer.__dict__.get("_buffers", _NO_BUFFERS)
        try:  # (each one in the module's table: one subscript each)
            return [table[key] for key in keys]
        except KeyError:
            return [self.buffer(name) for name in names]

    # ------------------------------------------------------------------------------------------------------
    def quantize(self, tensor: torch.Tensor, keep_values: bool = True) -> Fp8Tensor:
        """FP8 copy of a 2-D operand with the recipe's format/granularity for this role; updates scaling state."""
        if isinstance(tensor, Fp8GatheredWeight):  # FSDP2 gathered it as FP8 already (fp8_all_gather.py)
            quantized = tensor.fp8_tensor()
            self.record_amax(quantized.amax)
            return quantized  # no weight telemetry: the fp32 weight is not gathered
        sequence_gather = sys.modules.get("fp8train.nn.sequence_gather")  # (_fp8_gathered_input, inline: hot path)
        if sequence_gather is not None and isinstance(tensor, sequence_gather.Fp8GatheredInput):
            return tensor.take(self)  # sequence parallelism gathered it as FP8 (no input telemetry: not gathered)
        kernel = self.layer.kernel_for(tensor.numel())
        # a tensor-parallel shard: the amax of the whole operand where its scale spans the split (tensor_parallel.py;
        # None where the local amax is already that, e.g. delayed scales known on the host)
        layout = self.layer.tp_layout
        global_amax = None if layout is None else layout.global_amax(self, tensor, kernel, transposed=False)
        shared = self.shares_casts and kernel is QuantizeKernel.NATIVE and global_amax is None and \
            not self.layer.telemetry and not tensor.is_inference()  # (inference tensors have no version)
        if self.delayed and self.initialized_on_host and shared and layout is None:  # (TP: DTensor scales)
            quantized = _shared_cast(self, tensor, keep_values)
        elif self.delayed and self.initialized_on_host:
            # the stored scale is known before the tensor is read: cast with it and take the amax in the same
            # pass (one read of the tensor; finite and > 0 by construction: no per-call host sync); the native
            # kernel records the amax in that op too (record_amax's rule)
            quantized = _tensorwise_cast(tensor, self.format, kernel, keep_values, scale=self.buffer("scale"),
                                         nonfinite_count=self.kernel_buffer("nonfinite_amax_count"),
                                         pending_amax=self.kernel_buffer("pending_amax") if self.layer.training
                                         else None)
            if not quantized.amax_recorded:
                self.record_amax(quantized.amax)
        elif self.delayed:  # first step: the scale may be the tensor's own, so the amax comes first
            amax = compute_amax(tensor, kernel=kernel)
            self.record_amax(amax)  # (this rank's: update_fp8_scales' MAX over all ranks makes it the whole's)
            scale = self.tensorwise_scale(amax if global_amax is None else global_amax)
            quantized = quantize(tensor, self.format, scale=scale, keep_values=keep_values, validate_scale=False,
                                 kernel=kernel)
            quantized.amax = amax
        elif shared:
            quantized = _shared_cast(self, tensor, keep_values)
        elif global_amax is not None:  # current tensorwise or rowwise scales from the whole operand's amaxes
            quantized = quantize(tensor, self.format, granularity=self.granularity, axis=-1, kernel=kernel,
                                 scale=format_scale(global_amax, self.format, self.margin, self.pow2),
                                 validate_scale=False, keep_values=keep_values)
            quantized.amax = global_amax
            nonfinite = (global_amax < math.inf).logical_not()  # (amaxes are >= 0 or NaN: as below)
            self.buffer("nonfinite_amax_count").add_(nonfinite if self.tensorwise else nonfinite.any())
        else:
            # Block tiles (block, mxfp8) vary along K: where the emulated GEMMs read value * scale in fp32
            # (keep_values True: gemm_choice.operand_keeps), the C kernel writes that in the same pass instead of
            # the values; where the native GEMM reads the bytes and the tile scales, nothing more is kept.
            blocked = kernel is QuantizeKernel.NATIVE and self.granularity is Granularity.BLOCK and keep_values is True
            keep_values = False if blocked else keep_values
            if self.mx:
                quantized = quantize_mx(tensor, self.format, kernel=kernel, keep_values=keep_values,
                                        keep_dequantized=blocked)
            elif self.tensorwise:  # (the native kernel counts a non-finite amax in the same op)
                quantized = _tensorwise_cast(tensor, self.format, kernel, keep_values, margin=self.margin,
                                             pow2=self.pow2,
                                             nonfinite_count=self.kernel_buffer("nonfinite_amax_count"))
            else:  # (the native kernel counts a non-finite amax in the same op)
                quantized = quantize(tensor, self.format, granularity=self.granularity, block=self.block,
                                     margin=self.margin, pow2=self.pow2, kernel=kernel, keep_values=keep_values,
                                     keep_dequantized=blocked, nonfinite_count=self.kernel_buffer("nonfinite_amax_count"))
            if not quantized.amax_recorded:
                # one reduction, then 0-d ops: the amaxes are >= 0 or NaN, so the max is finite iff all of them
                # are, and an amax is non-finite iff it is not below inf (one comparison: isfinite is four ops)
                nonfinite = (quantized.amax < math.inf).logical_not() if self.tensorwise \
                    else (quantized.amax.amax() < math.inf).logical_not().long() if self.mx \
                    else (quantized.amax < math.inf).logical_not().any()
                self.buffer("nonfinite_amax_count").add_(nonfinite)
        if self.layer.telemetry:
            self._record_stats(tensor, quantized)
        return quantized

    def quantize_transposed(self, tensor: torch.Tensor, keep_values=True) -> Fp8Tensor:
        """This role's recipe applied to tensor.T: (C, R) FP8 bytes whose scales run along the original first
        dim, written straight in the layout its backward GEMM reads (no separate FP8 transpose). Counters and
        telemetry come from the primary quantization of the same tensor. `keep_values` as quantize's (the copy
        its GEMM reads); block tiles keep value * scale instead where the C kernel runs."""
        gathered = _fp8_gathered_input()
        if gathered is not None and isinstance(tensor, gathered):  # gathered with its transposed copy
            return tensor.take(self, transposed=True)
        kernel = self.layer.kernel_for(tensor.numel())
        # as in quantize
        blocked = kernel is QuantizeKernel.NATIVE and self.granularity is Granularity.BLOCK and keep_values is True
        keep_values = False if blocked else keep_values
        with torch.no_grad():
            tensor_t = tensor.t()
            if self.mx:
                return quantize_mx(tensor_t, self.format, kernel=kernel, keep_values=keep_values,
                                   keep_dequantized=blocked)
            layout = self.layer.tp_layout  # a tensor-parallel shard: rows that span the split (tensor_parallel.py)
            global_amax = None if layout is None else layout.global_amax(self, tensor_t, kernel, transposed=True)
            scale = None if global_amax is None else format_scale(global_amax, self.format, self.margin, self.pow2)
            return quantize(tensor_t, self.format, granularity=self.granularity, block=self.block,
                            margin=self.margin, pow2=self.pow2, keep_values=keep_values, keep_dequantized=blocked,
                            kernel=kernel, scale=scale, validate_scale=False)

    def tensorwise_scale(self, amax: torch.Tensor) -> torch.Tensor:
        """The dequant scale a tensor of this role with this `amax` is quantized with, under a tensorwise recipe:
        delayed, the stored scale once initialized, else (first step) the tensor's own; current, its own.
        fp8_all_gather uses it too, with the amax of the whole sharded weight."""
        if self.delayed and self.initialized_on_host:  # known on the host: no fallback ops to compute
            return self.buffer("scale")
        # (the recipe checked margin and pow2: the rule itself, without scale_from_amax's argument checks)
        own_scale = format_scale(torch.as_tensor(amax, dtype=torch.float32), self.format, self.margin, self.pow2)
        if not self.delayed:
            return own_scale
        return torch.where(self.buffer("initialized"), self.buffer("scale"), own_scale)

    def record_amax(self, amax: torch.Tensor) -> None:
        """Count a non-finite amax; delayed scaling in training also folds it into this step's pending amax."""
        recorded = amax.nan_to_num(nan=-1.0, posinf=-1.0)  # NaN/inf amaxes are counted, never recorded
        nonfinite = recorded < 0
        self.buffer("nonfinite_amax_count").add_(nonfinite if amax.dim() == 0 else nonfinite.any())
        if self.delayed and self.layer.training:
            pending = self.buffer("pending_amax")
            torch.maximum(pending, recorded if recorded.dim() == 0 else recorded.amax(), out=pending)

    # ------------------------------------------------------------------------------------------------------
    def decode(self, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """FP8 bytes of this role's format -> their values (fp32, or bf16: also exact)."""
        if torch.compiler.is_compiling():  # traced: the eager math, inlined (and no metadata reads on `data`)
            return decode_fp8(data, self.format, dtype=dtype)
        return decode_fp8(data, self.format, self.layer.kernel_for(data.numel()), dtype=dtype)

    def saved_operand(self, data: torch.Tensor, scale: torch.Tensor, block, keep_values) -> Fp8Operand:
        """The operand of FP8 bytes saved for backward, with what the emulated GEMM reads: the values (fp32 for
        `keep_values` True, or the dtype it names), or for block tiles value * scale in one native op (bytes,
        scale grid -> fp32) where the C kernel runs."""
        if not keep_values:
            return Fp8Operand(data, scale, block)
        if block is not None and keep_values is True and \
                self.layer.kernel_for(data.numel()) is QuantizeKernel.NATIVE and \
                native_cast.dequantizable(data, scale, Granularity.BLOCK, *block):
            return Fp8Operand(data, scale, block, dequantized=native_cast.dequantize(data, scale, Granularity.BLOCK,
                                                                                     *block))
        return Fp8Operand(data, scale, block, self.decode(data, torch.float32 if keep_values is True else keep_values))

    def _record_stats(self, tensor: torch.Tensor, quantized: Fp8Tensor) -> None:
        stats = quant_error(tensor, quantized)
        amax_now = float(quantized.amax.max()) if not torch.isnan(quantized.amax).any() else math.nan
        staleness = None
        if self.recipe.is_delayed:
            if bool(self.buffer("initialized")):
                source_amax = float(self.buffer("scale_amax"))
                staleness = amax_now / source_amax if source_amax > 0 else math.inf
            else:
                staleness = 1.0  # still on current scaling: the scale came from this very tensor
        self.layer.last_stats[self.role] = dict(
            amax=amax_now,
            scale=float(quantized.scale.float().mean()),
            overflow_frac=stats["overflow_frac"],
            underflow_frac=stats["underflow_frac"],
            sqnr_db=stats["sqnr_db"],
            staleness=staleness,
            nonfinite=not math.isfinite(amax_now),
        )

    def __repr__(self) -> str:
        return f"OperandQuantizer({self.role}, {self.format.name}, {self.recipe.granularity_of(self.role)})"


# The last input cast under current tensorwise scaling, for the next layer that reads the same tensor with the
# same rules (a transformer's q/k/v projections, its gate and up projections: one cast, not three or two):
# [key, weak reference to the tensor's storage owner, Fp8Tensor, its non-finite flag or None, weak reference to
# the quantizer that made it: a layer that runs again on the same tensor casts again, as it always did, so a
# benchmark of one layer times its cast]. A CPU cast (the native kernel's) only; the next
# input cast replaces it, so at most one input's FP8 copy is held past its layers.
_last_shared_cast: list = [None]


def _shared_cast(quantizer: OperandQuantizer, tensor: torch.Tensor, keep_values) -> Fp8Tensor:
    """`quantizer`'s tensorwise cast of `tensor`, or the same cast another layer just made of that tensor: under
    current scaling the rule reads nothing else (the same bytes, scale and amax); under delayed scaling (stored
    scales) when the two layers' stored scales have the same bits, compared in the C kernel (no host sync), as
    they are for layers that have read the same tensors since they were built or loaded. Keyed by the tensor's
    storage owner (held weakly: one that died cannot be mistaken for a new one at its address), view, dtype and
    in-place version, and the rule's format, margin, power-of-two option and the values kept; each layer counts
    a non-finite amax and (delayed, training) records the amax in its own state."""
    # a view's base and the in-place version counter: torch has no public name for either
    owner = tensor._base if tensor._base is not None else tensor
    delayed = quantizer.delayed
    key = (id(owner), tensor.storage_offset(), tensor.shape, tensor.stride(), tensor.dtype,
           tensor._version,  # (in-place writes since the cast change it: a cast of old bytes is never reused)
           quantizer.format.name, quantizer.margin, quantizer.pow2, keep_values, delayed)
    last = _last_shared_cast[0]
    count = quantizer.kernel_buffer("nonfinite_amax_count")
    pending = quantizer.kernel_buffer("pending_amax") if delayed and quantizer.layer.training else None
    if last is not None and last[0] == key and last[1]() is owner and last[4]() is not quantizer:
        if delayed:
            if share_delayed_cast(last[2].scale, last[2].amax, quantizer.buffer("scale"), count, pending):
                return last[2]
        else:
            if last[3] is None:  # whether the amax is NaN/inf, as a tensor (no host read: no sync), made once
                last[3] = (last[2].amax < math.inf).logical_not()
            count.add_(last[3])
            return last[2]
    quantized = _tensorwise_cast(tensor, quantizer.format, QuantizeKernel.NATIVE, keep_values,
                                 margin=quantizer.margin, pow2=quantizer.pow2, nonfinite_count=count,
                                 scale=quantizer.buffer("scale") if delayed else None, pending_amax=pending)
    if not quantized.amax_recorded:  # (the eager kernel ran it: a case the C kernel does not take)
        if delayed:
            quantizer.record_amax(quantized.amax)
        else:
            count.add_((quantized.amax < math.inf).logical_not())
    _last_shared_cast[0] = [key, weakref.ref(owner), quantized, None, weakref.ref(quantizer)]
    return quantized


def _tensorwise_cast(tensor: torch.Tensor, fmt, kernel, keep_values, *, margin: int = 0, pow2: bool = False,
                     scale: torch.Tensor | None = None, nonfinite_count=None, pending_amax=None) -> Fp8Tensor:
    """quant.quantize of a tensorwise operand: with `scale` (delayed scaling's, finite and > 0 by construction)
    the cast takes the amax in the same pass, else the scale comes from the amax. Where the native kernel takes the
    tensor it is called straight (quantize's argument checks are the recipe's, made once when it was built: ~5 us
    a call saved); anything else goes through quantize."""
    if kernel is QuantizeKernel.NATIVE and type(keep_values) is not tuple:
        keep_fp32, keep_bf16 = (keep_values, False) if type(keep_values) is bool else value_copies(keep_values)
        quantized = native_quantize(tensor, fmt, Granularity.TENSOR, 1, 1, -1, margin, pow2, True, scale, keep_fp32,
                                    keep_bf16, with_amax=scale is not None, nonfinite_count=nonfinite_count,
                                    pending_amax=pending_amax)
        if quantized is not None:
            return quantized
    return quantize(tensor, fmt, margin=margin, pow2=pow2, scale=scale, keep_values=keep_values,
                    validate_scale=False, kernel=kernel, with_amax=scale is not None, nonfinite_count=nonfinite_count,
                    pending_amax=pending_amax)


def _fp8_gathered_input():
    """sequence_gather.Fp8GatheredInput where that module is loaded (it imports torch.distributed.tensor, about a
    second for a process that never uses it: not imported here; no such input exists before it is loaded)."""
    module = sys.modules.get("fp8train.nn.sequence_gather")
    return None if module is None else module.Fp8GatheredInput


def apply_keeping_scaling_dtypes(module, fn, apply) -> None:
    """``apply(fn)`` (nn.Module._apply of ``module``'s class) with ``module``'s own buffers, its FP8 scaling state,
    following device moves but never dtype casts: .to(dtype), .half() and .bfloat16() cast the weights, while a
    1.5e-9 grad_output scale flushes to 0 in fp16 and bf16 would round every scale and amax history."""
    scaling_state = dict(module._buffers)  # (torch's own buffer table: these are the module's registered buffers)
    module._buffers.clear()  # (torch's buffer table, as above)
    apply(fn)
    for name, buffer in scaling_state.items():
        moved = buffer if buffer is None else fn(buffer)
        # (torch's buffer table, as above)
        module._buffers[name] = moved if moved is None or moved.dtype == buffer.dtype else buffer.to(moved.device)
