"""Recipe shadowing (`log.shadow_recipes`): what would other recipes do to this layer's real operands?

On every telemetry step, each shadowed layer (every Fp8Linear; in a bf16 run, every nn.Linear the layer policy
would convert) quantizes its actual input, weight and grad_output once per shadow recipe, exactly as that recipe
would for its forward / grad_input GEMM (granularity, tiles, formats, margin, power-of-two or E8M0 scales), and
records SQNR, overflow (clipped) and underflow (flushed) fractions per role. The layer's own computation is not
touched: the quantized copies are measured and dropped, so training is bit-for-bit the run it would have been.

What a shadow cannot see: delayed scaling's amax history (so 'delayed' is not a shadow recipe: 'current' is its
best case), and the second, transposed quantization that rowwise/block/mxfp8 make for the weight-gradient GEMM.
Cost: per telemetry step, per layer and recipe, three quantizations and three error passes with a few host
syncs each; nothing on other steps (a hook that returns at once when not armed).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8train.nn.convert import block_index, policy_names
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.recipes import Fp8Recipe, OperandRole, recipe
from fp8train.numerics.mx import quantize_mx
from fp8train.numerics.quant import Fp8Tensor, quant_error, quantize
from fp8train.training.config.run import SHADOW_RECIPES

__all__ = ["RecipeShadow", "shadow_quantize", "SHADOW_STAT_KEYS", "shadowed_layers", "gemm_paths"]

SHADOW_STAT_KEYS = ("sqnr_db", "overflow_frac", "underflow_frac")


def shadow_quantize(r: Fp8Recipe, role: str, tensor_2d: torch.Tensor) -> Fp8Tensor:
    """`tensor_2d` quantized as recipe `r` quantizes operand `role` for its forward / grad_input GEMM."""
    fmt = r.format_of(role)
    if r.is_mx:
        return quantize_mx(tensor_2d, fmt)
    return quantize(tensor_2d, fmt, granularity=r.granularity_of(role), block=r.block_of(role), axis=-1,
                    margin=r.margin, pow2=r.pow2_scales)


def _stats(r: Fp8Recipe, role: str, tensor_2d: torch.Tensor) -> dict:
    error = quant_error(tensor_2d, shadow_quantize(r, role, tensor_2d))
    return {key: error[key] for key in SHADOW_STAT_KEYS}


class RecipeShadow:
    """Forward hooks on `layers` [(name, nn.Linear or Fp8Linear)] that measure `recipe_names` while armed."""

    def __init__(self, layers: list[tuple[str, nn.Module]], recipe_names):
        unknown = [n for n in recipe_names if n not in SHADOW_RECIPES]
        if unknown:
            raise ValueError(f"log.shadow_recipes: {unknown} cannot be shadowed; allowed: {list(SHADOW_RECIPES)}")
        self.recipes = {name: recipe(name, backend="emulated") for name in recipe_names}
        self.armed = False
        self.records: dict[str, dict] = {}
        self._handles = [module.register_forward_hook(self._hook(name)) for name, module in layers]

    def arm(self, on: bool = True) -> None:
        """Measure on the next forwards/backwards (a telemetry step); off again after `collect`."""
        self.armed = on
        if on:
            self.records = {}

    def collect(self) -> dict:
        """{layer: {recipe: {role: {sqnr_db, overflow_frac, underflow_frac}}}} of the armed step; disarms."""
        self.armed = False
        records, self.records = self.records, {}
        return records

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()

    def _hook(self, name: str):
        def forward_hook(module, inputs, output):
            if not self.armed:
                return
            with torch.no_grad():
                input_2d = inputs[0].detach().reshape(-1, module.in_features)
                weight = module.weight.detach()
                for rname, r in self.recipes.items():
                    entry = self.records.setdefault(name, {}).setdefault(rname, {})
                    entry[OperandRole.INPUT] = _stats(r, OperandRole.INPUT, input_2d)
                    entry[OperandRole.WEIGHT] = _stats(r, OperandRole.WEIGHT, weight)
            if output.requires_grad:
                output.register_hook(self._grad_hook(name, module.out_features))
        return forward_hook

    def _grad_hook(self, name: str, out_features: int):
        def grad_hook(grad_output):
            if self.armed:
                grad_2d = grad_output.detach().reshape(-1, out_features)
                for rname, r in self.recipes.items():
                    self.records[name][rname][OperandRole.GRAD_OUTPUT] = _stats(r, OperandRole.GRAD_OUTPUT, grad_2d)
            return None  # the gradient flows on unchanged
        return grad_hook


def shadowed_layers(model: nn.Module, policy) -> list[tuple[str, nn.Module]]:
    """Every Fp8Linear of `model`; in a model without any (a bf16 run), every nn.Linear `policy` would convert."""
    fp8 = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    if fp8:
        return fp8
    names = [n for n, _ in model.named_modules()]
    blocks = [i for i in map(block_index, names) if i is not None]
    n_blocks = max(blocks) + 1 if blocks else 0
    return [(n, m) for n, m in model.named_modules()
            if type(m) is nn.Linear and n and policy.skip_reason(policy_names(model, n), m, n_blocks) is None]


def gemm_paths(layers) -> dict:
    """{layer: {gemm: kernel path}} of the last forward/backward of each Fp8Linear (see Fp8Linear.gemm_paths)."""
    return {name: dict(layer.gemm_paths) for name, layer in layers if getattr(layer, "gemm_paths", None)}
