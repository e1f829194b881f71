"""convert_to_fp8's part for mixture-of-experts weights and for every other weight that feeds a GEMM.

- transformers' experts modules (nn/hf_experts.py): each 3-D projection (`gate_up_proj` / `up_proj`,
  `down_proj`) is one entry of the report, named `{module}.{param}`, converted or skipped by the layer policy
  exactly as an nn.Linear of that projection's per-expert shape (K -> N) would be: exclude patterns (seen on the
  projection's name and on the experts module's), first / last blocks, min_features, divisible_by and
  overrides. Its parameters count all E experts; its GEMM FLOPs per token count the top-k experts a token runs
  (2 x top-k x N x K).
- any other weight of two or more dims outside nn.Linear, Conv1D, experts modules and embeddings (a lookup, not
  a GEMM), e.g. gpt-oss's router (a plain Parameter of its own module): named in the report, with its reason,
  as high precision (kind 'other', FLOPs counted as one matrix-vector product per token).
- fp8train's own GroupedLinear (nn/experts.py; the built-in decoder's MoE experts): one report entry per
  module, converted or skipped by the layer policy as an nn.Linear of its per-expert shape, and swapped for an
  Fp8GroupedLinear holding the same Parameters (kind 'experts', FLOPs counted for the module's top_k).
"""

from __future__ import annotations

import re

import torch.nn as nn

from fp8train.nn.experts import Fp8GroupedLinear, GroupedLinear
from fp8train.nn.hf_experts import (attach, expert_projections, experts_top_k, is_hf_experts, projection_shape,
                                     remember_implementation, scaling_of)
from fp8train.nn.overrides import OVERRIDE_BF16, first_override
from fp8train.nn.recipes import Fp8Recipe, recipe as make_recipe

__all__ = ["choose_expert_swaps", "attach_experts", "count_other_weights", "choose_grouped_swaps", "attach_grouped",
           "is_grouped"]


class _ExpertShape:  # what LayerPolicy.skip_reason reads of a layer
    def __init__(self, in_features: int, out_features: int):
        self.in_features, self.out_features = in_features, out_features


def choose_expert_swaps(model: nn.Module, recipe: Fp8Recipe, policy, report, n_blocks: int, seen_as) -> list:
    """[(module name, module, {param: recipe or None})] for every experts module of `model`; fills `report`."""
    plans = []
    for name, module in model.named_modules():
        if not is_hf_experts(module):
            continue
        top_k = experts_top_k(module)
        if top_k is not None and not 1 <= top_k <= module.num_experts:
            raise ValueError(f"{name}: top-k = {top_k} experts per token (config) must be in [1, "
                             f"{module.num_experts}] (the experts of this module)")
        choices = {}
        for param in expert_projections(module):
            experts, n, k = projection_shape(module, param)
            full = f"{name}.{param}"
            names = seen_as(full) + seen_as(name)
            reason = "already FP8 experts" if scaling_of(module, param) is not None else \
                policy.skip_reason(names, _ExpertShape(k, n), n_blocks)
            override = first_override(policy.overrides, names) if reason is None else None
            chosen = recipe
            if override is not None and override[1] == OVERRIDE_BF16:
                reason = f"policy.overrides {override[0]!r} -> bf16"
            elif override is not None:
                chosen = make_recipe(override[1], backend=recipe.backend)
            routed = top_k if top_k is not None else 1
            shape = f"experts {experts} x {k}->{n}, top-{top_k if top_k is not None else '? (counted as 1)'}"
            if reason is None:
                via = f" {chosen.name} (policy.overrides {override[0]!r})" if override is not None else ""
                report.converted.append((full, f"{shape} (grouped GEMM){via}"))
            else:
                report.skipped.append((full, f"{reason} ({shape})"))
            report.count("experts", reason is None, experts * n * k, 2 * routed * n * k)
            choices[param] = chosen if reason is None else None
        plans.append((name, module, choices))
    return plans


def attach_experts(plans: list) -> None:
    """Apply choose_expert_swaps' choices: every module's current implementation is kept first (modules share one
    config, which the first converted module switches), then each module gets its FP8 projections."""
    for _, module, _ in plans:
        remember_implementation(module)
    for _, module, choices in plans:
        attach(module, {param: r for param, r in choices.items() if r is not None})


def choose_grouped_swaps(model: nn.Module, recipe: Fp8Recipe, policy, report, n_blocks: int, seen_as) -> list:
    """[(module name, GroupedLinear, recipe)] for every GroupedLinear the policy lets into FP8; fills `report`
    (Fp8GroupedLinear modules already there are counted as FP8, as an Fp8Linear is)."""
    swaps = []
    for name, module in model.named_modules():
        if not isinstance(module, (GroupedLinear, Fp8GroupedLinear)):
            continue
        experts, n, k = module.num_experts, module.out_features, module.in_features
        top_k = getattr(module, "top_k", None)
        shape = f"experts {experts} x {k}->{n}, top-{top_k if top_k is not None else '? (counted as 1)'}"
        reason = "already Fp8GroupedLinear" if isinstance(module, Fp8GroupedLinear) else \
            policy.skip_reason(seen_as(name), _ExpertShape(k, n), n_blocks)
        override = first_override(policy.overrides, seen_as(name)) if reason is None else None
        chosen = recipe
        if override is not None and override[1] == OVERRIDE_BF16:
            reason = f"policy.overrides {override[0]!r} -> bf16"
        elif override is not None:
            chosen = make_recipe(override[1], backend=recipe.backend)
        in_fp8 = reason is None or isinstance(module, Fp8GroupedLinear)
        if reason is None:
            via = f" {chosen.name} (policy.overrides {override[0]!r})" if override is not None else ""
            report.converted.append((name, f"{shape} (grouped GEMM){via}"))
            swaps.append((name, module, chosen))
        else:
            report.skipped.append((name, f"{reason} ({shape})"))
        report.count("experts", in_fp8, module.weight.numel(), 2 * (top_k or 1) * n * k)
    return swaps


def is_grouped(module: nn.Module) -> bool:
    """fp8train's grouped experts layer, high precision or FP8."""
    return isinstance(module, (GroupedLinear, Fp8GroupedLinear))


def attach_grouped(model: nn.Module, swaps: list) -> None:
    """Swap each planned GroupedLinear for an Fp8GroupedLinear holding the same Parameter objects (an optimizer
    built before still updates them)."""
    for name, module, chosen in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        fp8 = Fp8GroupedLinear(module.num_experts, module.in_features, module.out_features, bias=False,
                               recipe=chosen, device=module.weight.device)
        fp8.weight = module.weight  # the same Parameters (the new ones are dropped)
        if module.bias is not None:
            fp8.bias = module.bias
        fp8.top_k = module.top_k
        fp8.train(module.training)
        setattr(parent, child, fp8)


def count_other_weights(model: nn.Module, report, policy, seen_as) -> list[str]:
    """Name every >= 2-D Parameter the other kinds did not count, with why it stays in high precision; returns the
    names of the modules holding them (a router such as Qwen3-MoE's `mlp.gate`), which policy.exclude patterns
    may name too."""
    counted, owners = set(), []
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.EmbeddingBag)) or \
                type(module).__name__ == "Conv1D" or is_hf_experts(module) or \
                isinstance(module, (GroupedLinear, Fp8GroupedLinear)):
            counted.update(id(p) for p in module.parameters(recurse=False))
    for name, param in model.named_parameters():
        if param.dim() < 2 or id(param) in counted:
            continue
        owner_name = name.rpartition(".")[0]
        owner = model.get_submodule(owner_name) if owner_name else model
        owners.append(owner_name)
        what = f"a {tuple(param.shape)} weight of {type(owner).__name__}"
        pattern = next((p for p in policy.exclude_patterns for n in seen_as(owner_name) if re.search(p, n)), None)
        reason = f"excluded by pattern {pattern!r} ({what})" if pattern is not None else \
            f"{what}, not an nn.Linear or an experts module: fp8train keeps it in high precision"
        report.skipped.append((name, reason))
        report.count("other", False, param.numel(), 2 * param.numel())
    return list(dict.fromkeys(owners))
