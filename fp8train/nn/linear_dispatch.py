"""What an Fp8Linear (or one expert of a grouped layer) runs, resolved once per device and dtypes.

Everything the three GEMMs and their quantizes decide from the layer's recipe and execution settings but not from
the tensors' values — the backend, the emulated dtype, what each operand keeps beside its FP8 bytes
(gemm_choice.operand_keeps) and which GEMM function runs with which options — is worked out the first time a layer
sees a (device, output dtype, input dtype, weight dtype) and kept on the layer, so a forward reads attributes
instead of re-deriving them. It is worked out again after any change it depends on: the layer's emulated dtype,
a device move (``Fp8Linear._apply``), ``configure``, or a process-wide switch (``native_cast.switch_count``:
native_cast.set_enabled, native_gemm.set_mode, cpu_features.set_cpu_bf16_gemm, scaled_gemm.target_gpu). While
torch.compile traces, nothing is kept (the traced graph re-derives it, and records no GEMM path).
"""

from __future__ import annotations

import functools

import torch

from fp8train.nn.gemm import emulated_mm, fp8_mm
from fp8train.nn.gemm_choice import emulated_compute_dtype, gemm_compute_dtype, operand_keeps, resolve_backend
from fp8train.nn.recipes import ROLES, GemmBackend, GemmRole, OperandRole
from fp8train.numerics import native_cast, native_gemm

__all__ = ["LayerDispatch", "dispatch_for", "NO_DISPATCH"]

NO_DISPATCH = (None, {})  # a layer's empty table: (settings it was made under, {key: LayerDispatch})


class LayerDispatch:
    """One layer's choices for one (device, out_dtype, input dtype, weight dtype):

    - `backend` (resolved: emulated or scaled_mm) and `compute_dtype` (the emulated dtype, resolved);
    - what each quantize keeps (gemm_choice.Keep): `weight_keeps`, `input_keeps` (forward), `saved_input_keeps`
      (grad_weight's read of the saved input), `grad_output_keeps` / `grad_output_keeps_for_both` (when
      grad_weight reads grad_output's copy too), `grad_output_t_keeps` (grad_output requantized along N);
    - whether the input, weight and grad_output are requantized along the other axis for a backward GEMM
      (recipes.Fp8Recipe.requantize_transposed);
    - the three GEMMs as callables (a, b, bias=None) -> result in that GEMM's output dtype."""

    __slots__ = ("backend", "compute_dtype", "weight_keeps", "input_keeps", "saved_input_keeps", "grad_output_keeps",
                 "grad_output_keeps_for_both", "grad_output_t_keeps", "input_transposed", "weight_transposed",
                 "grad_output_transposed", "output_mm", "grad_input_mm", "grad_weight_mm")


def dispatch_for(layer, device: torch.device, out_dtype: torch.dtype, input_dtype: torch.dtype,
                 weight_dtype: torch.dtype) -> LayerDispatch:
    """`layer`'s LayerDispatch for these, made on first use and kept on the layer (module docstring)."""
    if torch.compiler.is_compiling():
        return _resolve(layer, device, out_dtype, input_dtype, weight_dtype, compiling=True)
    made_under, table = layer.dispatch_table
    settings = (layer.emulated_dtype, native_cast.switch_count)
    if made_under != settings:
        table = {}
        layer.dispatch_table = (settings, table)
    key = (device, out_dtype, input_dtype, weight_dtype)
    found = table.get(key)
    if found is None:
        found = table[key] = _resolve(layer, device, out_dtype, input_dtype, weight_dtype, compiling=False)
    return found


def _resolve(layer, device, out_dtype, input_dtype, weight_dtype, compiling: bool) -> LayerDispatch:
    r = layer.recipe
    d = LayerDispatch()
    d.backend = resolve_backend(r.backend, device, tuple(map(r.format_of, ROLES)))
    d.compute_dtype = emulated_compute_dtype(device, layer.emulated_dtype)
    d.input_transposed, d.weight_transposed, d.grad_output_transposed = (
        r.requantize_transposed(role) for role in (OperandRole.INPUT, OperandRole.WEIGHT, OperandRole.GRAD_OUTPUT))
    keeps = functools.partial(operand_keeps, d.backend, r, compute_dtype=d.compute_dtype, device=device)
    d.weight_keeps = keeps(OperandRole.WEIGHT, out_dtype=out_dtype)
    d.input_keeps = keeps(OperandRole.INPUT, out_dtype=out_dtype)
    d.saved_input_keeps = keeps(OperandRole.INPUT, out_dtype=weight_dtype)
    d.grad_output_keeps = keeps(OperandRole.GRAD_OUTPUT, out_dtype=input_dtype)
    # grad_weight's result is fp32 for fp32 master weights: it reads fp32 values, or bf16 ones where the native
    # bf16 -> fp32 GEMM runs; grad_output's own copy serves it unless grad_output is requantized for it
    grad_weight_reads_fp32 = gemm_compute_dtype(d.compute_dtype, weight_dtype, device) == torch.float32
    d.grad_output_keeps_for_both = keeps(OperandRole.GRAD_OUTPUT, out_dtype=input_dtype, fp32_too=True) \
        if grad_weight_reads_fp32 and not d.grad_output_transposed else d.grad_output_keeps
    d.grad_output_t_keeps = keeps(OperandRole.GRAD_OUTPUT, out_dtype=weight_dtype)
    # gemm_paths is eager-only bookkeeping: a traced graph may not mutate Python state from inside the
    # autograd.Function (dynamo would break the graph there).
    record = None if compiling else layer.gemm_paths
    d.output_mm = _gemm(layer, d, GemmRole.OUTPUT, out_dtype, device, record, r.fast_accum_forward)
    d.grad_input_mm = _gemm(layer, d, GemmRole.GRAD_INPUT, input_dtype, device, record, False)
    d.grad_weight_mm = _gemm(layer, d, GemmRole.GRAD_WEIGHT, weight_dtype, device, record, False)
    return d


def _gemm(layer, d: LayerDispatch, gemm: GemmRole, out_dtype, device, record, use_fast_accum: bool):
    """One GEMM of the layer as a callable (a, b, bias=None): emulated_mm with its choices made where it runs,
    else fp8_mm (scaled_mm, or the Hopper accumulation model)."""
    if d.backend is GemmBackend.EMULATED and layer.accumulation_model is None:
        reads = gemm_compute_dtype(d.compute_dtype, out_dtype, device)
        native = reads == torch.bfloat16 and native_gemm.in_use(device)
        return functools.partial(emulated_mm, reads=reads, native=native, out_dtype=out_dtype, record=record,
                                 gemm=gemm)
    return functools.partial(fp8_mm, backend=d.backend, compute_dtype=d.compute_dtype, out_dtype=out_dtype,
                             use_fast_accum=use_fast_accum, accumulation=layer.accumulation_model, record=record,
                             gemm=gemm)


