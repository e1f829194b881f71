"""What a converted transformers model records about its FP8 layers, so that any save of it can be restored.

`convert_to_fp8` on a transformers model (or on a wrapper declaring `wrapped_name_prefix`, as fp8train's
HFCausalLM does) writes `config.fp8train`: per FP8 layer its recipe, and which layers hold Conv1D's (in, out)
weight layout. The config travels with every save of the model (transformers' `save_pretrained`, each `Trainer`
checkpoint, `fp8train.save_pretrained`), so `fp8train.from_pretrained` rebuilds the FP8 layers from any of them.

It also declares the FP8 scaling buffers (`*.input_amax_history`, `*.weight_scale`, ...) ignorable on load for
the model's class (`_keys_to_ignore_on_load_unexpected`, which transformers matches by regex): a plain
`AutoModelForCausalLM.from_pretrained` of such a folder, in this process, drops them without a report (they are
training state of layers the plain model does not have). A process that never converted a model of that class
has not declared them: transformers lists them there as UNEXPECTED, and loads the weights all the same.

    {"recipes": [Fp8Recipe fields, ...], "layers": {name: index into recipes}, "conv1d_layout": [name, ...],
     "experts": {"{experts module}.{projection}": index into recipes}}   (FP8 experts: nn/hf_experts.py)
"""

from __future__ import annotations

import dataclasses

import torch.nn as nn

from fp8train.nn.hf_experts import expert_projections, is_hf_experts, scaling_of
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.quantizer import SCALING_BUFFERS
from fp8train.nn.recipes import ROLES, Fp8Recipe

__all__ = ["FP8_RECORD_KEY", "SCALING_BUFFER_PATTERN", "fp8_record", "recipe_from_record", "transformers_model",
           "attach_fp8_record", "fp8_experts",
           "declare_scaling_buffers_ignorable"]

FP8_RECORD_KEY = "fp8train"
# A scaling buffer of any layer, as a state_dict key: what `nn.linear.is_scaling_buffer` accepts.
SCALING_BUFFER_PATTERN = rf"\.({'|'.join(str(r) for r in ROLES)})_({'|'.join(SCALING_BUFFERS)})$"


def fp8_record(model: nn.Module) -> dict:
    """The record of ``model``'s Fp8Linear layers (module docstring), names relative to ``model``."""
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
    experts = fp8_experts(model)
    # distinct recipes, in layer order, then the experts projections'
    recipes = list(dict.fromkeys([layer.recipe for _, layer in layers] + [s.recipe for _, s in experts]))
    return {"recipes": [dataclasses.asdict(r) for r in recipes],
            "layers": {name: recipes.index(layer.recipe) for name, layer in layers},
            "conv1d_layout": [name for name, layer in layers if getattr(layer, "conv1d_layout", False)],
            "experts": {name: recipes.index(scaling.recipe) for name, scaling in experts}}


def fp8_experts(model: nn.Module) -> list:
    """(`{experts module}.{projection}`, its ExpertScaling) for every FP8 experts projection of `model`."""
    return [(f"{name}.{param}", scaling_of(module, param)) for name, module in model.named_modules()
            if is_hf_experts(module) for param in expert_projections(module) if scaling_of(module, param) is not None]


def recipe_from_record(fields: dict) -> Fp8Recipe:
    names = {f.name for f in dataclasses.fields(Fp8Recipe)}
    return Fp8Recipe(**{k: v for k, v in fields.items() if k in names})  # JSON lists become tuples in Fp8Recipe


def transformers_model(model: nn.Module) -> nn.Module | None:
    """``model`` if it carries a transformers config, else the model its `wrapped_name_prefix` names, or None."""
    prefix = getattr(model, "wrapped_name_prefix", "")
    inner = model.get_submodule(prefix.rstrip(".")) if prefix else model
    return inner if hasattr(getattr(inner, "config", None), "to_json_string") else None


def attach_fp8_record(model: nn.Module) -> None:
    """Record ``model``'s FP8 layers in its transformers config and declare its scaling buffers ignorable on
    load (module docstring); a model without a transformers config is left as it is."""
    hf = transformers_model(model)
    if hf is None:
        return
    setattr(hf.config, FP8_RECORD_KEY, fp8_record(hf))
    declare_scaling_buffers_ignorable(type(hf), hf)


def declare_scaling_buffers_ignorable(*owners) -> None:
    """Add the scaling buffers' pattern to each owner's (a transformers model class or instance)
    `_keys_to_ignore_on_load_unexpected`."""
    for owner in owners:  # the class, for later loads; the instance, which copied it at construction
        ignored = getattr(owner, "_keys_to_ignore_on_load_unexpected", None) or []
        if SCALING_BUFFER_PATTERN not in ignored:
            updated = [*ignored, SCALING_BUFFER_PATTERN]
            # transformers' documented class hook for keys a checkpoint may hold that the model does not load
            owner._keys_to_ignore_on_load_unexpected = set(updated) if isinstance(ignored, set) else updated
