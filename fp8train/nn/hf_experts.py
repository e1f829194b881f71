"""FP8 experts for transformers' experts interface (`transformers.integrations.moe`, transformers >= 5).

transformers 5 stores the experts of Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4-MoE, gpt-oss and others as
3-D Parameters on one module decorated by `use_experts_implementation` (`gate_up_proj` (E, 2I, H) and
`down_proj` (E, H, I); gpt-oss: transposed, (E, H, 2I) and (E, I, H), gate and up interleaved, with per-expert
biases `*_bias` (E, N)). That module's forward is looked up by name in `ALL_EXPERTS_FUNCTIONS` from
`config._experts_implementation` ("eager", "grouped_mm", ...). fp8train registers one more name,
EXPERTS_IMPLEMENTATION ("fp8train"), whose forward runs each projection as an FP8 grouped GEMM
(nn/experts.py) with that projection's per-expert scaling state (an ExpertScaling registered on the experts
module as `{param}_fp8`, e.g. `gate_up_proj_fp8`).

Conversion (`convert_to_fp8` calls `attach`) leaves the Parameters alone: same objects, fp32 master weights,
same state_dict keys and layout, so `save_pretrained` / `from_pretrained` and Trainer checkpoints round-trip;
the scaling buffers are added keys, as an Fp8Linear's are. A projection the layer policy keeps out of FP8 runs
in high precision (one GEMM per expert) inside the same forward. The router is not part of this module.
The model's config (not serialized: transformers drops `_experts_implementation` when saving) is switched to
"fp8train"; experts modules sharing that config that were not converted run the implementation they had.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8train.nn.experts import fp8_grouped_mm
from fp8train.nn.experts_scaling import ExpertScaling
from fp8train.nn.recipes import Fp8Recipe

__all__ = ["EXPERTS_IMPLEMENTATION", "is_hf_experts", "expert_projections", "attach", "remember_implementation",
           "fp8_experts_forward",
           "experts_top_k", "SCALING_SUFFIX", "scaling_of", "projection_shape"]

EXPERTS_IMPLEMENTATION = "fp8train"
SCALING_SUFFIX = "_fp8"  # the ExpertScaling of projection `gate_up_proj` is the submodule `gate_up_proj_fp8`
_TOP_K_KEYS = ("num_experts_per_tok", "experts_per_token", "moe_topk", "top_k")


def is_hf_experts(module: nn.Module) -> bool:
    """A module decorated by transformers' `use_experts_implementation` (recognised by the attributes the
    decorator sets, so this module never imports transformers for models that have none)."""
    return hasattr(module, "config") and hasattr(module, "has_gate") and hasattr(module, "is_transposed") \
        and hasattr(module, "num_experts") and all(isinstance(getattr(module, p, None), nn.Parameter)
                                                   for p in expert_projections(module))


def expert_projections(module: nn.Module) -> tuple[str, ...]:
    """The 3-D weight names of an experts module, in the order its forward uses them."""
    return ("gate_up_proj" if getattr(module, "has_gate", True) else "up_proj", "down_proj")


def projection_shape(module: nn.Module, param: str) -> tuple[int, int, int]:
    """(E, N, K) of projection `param`: out_features N and in_features K of each expert's GEMM."""
    e, a, b = getattr(module, param).shape
    return (e, b, a) if module.is_transposed else (e, a, b)


def experts_top_k(module: nn.Module) -> int | None:
    """The experts each token is routed to, from the module's config (None when the config does not say)."""
    for key in _TOP_K_KEYS:
        value = getattr(module.config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def remember_implementation(module: nn.Module) -> None:
    """Keep the implementation an experts module runs now, for when it has nothing in FP8 (before any module
    sharing its config is switched to EXPERTS_IMPLEMENTATION)."""
    # `_experts_implementation` is transformers' own switch (PreTrainedModel.set_experts_implementation writes it)
    current = module.config._experts_implementation
    if current != EXPERTS_IMPLEMENTATION and not hasattr(module, "fp8train_fallback_implementation"):
        module.fp8train_fallback_implementation = current or "eager"


def attach(module: nn.Module, recipes: dict[str, Fp8Recipe]) -> None:
    """Give each projection of an experts module named in `recipes` its per-expert FP8 state and route the
    module's config to EXPERTS_IMPLEMENTATION (projections not named stay in high precision)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    remember_implementation(module)
    if not recipes:
        return
    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, fp8_experts_forward)
    for param, recipe in recipes.items():
        weight = getattr(module, param)
        scaling = ExpertScaling(weight.shape[0], recipe, device=weight.device)
        scaling.train(module.training)
        setattr(module, param + SCALING_SUFFIX, scaling)
    # transformers' switch (as above); not serialized, so a saved config.json does not name fp8train
    module.config._experts_implementation = EXPERTS_IMPLEMENTATION


def scaling_of(module: nn.Module, param: str) -> ExpertScaling | None:
    """The per-expert FP8 state of projection `param` of an experts module (None: it runs in high precision)."""
    return getattr(module, param + SCALING_SUFFIX, None)


def _high_precision_grouped(x: torch.Tensor, weight: torch.Tensor, sizes: list[int], bias) -> torch.Tensor:
    """The same grouped GEMM for a projection kept out of FP8: one F.linear per expert with tokens."""
    outs = [F.linear(x_e, weight[e].to(x.dtype), None if bias is None else bias[e].to(x.dtype))
            for e, x_e in enumerate(x.split(sizes)) if sizes[e]]
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


def fp8_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward (hidden_states (T, H), top_k_index and top_k_weights (T, k)) with each
    converted projection an FP8 grouped GEMM. Registered as EXPERTS_IMPLEMENTATION."""
    params = expert_projections(self)
    if all(scaling_of(self, p) is None for p in params):  # not converted: what it ran before
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
        fallback = getattr(self, "fp8train_fallback_implementation", "grouped_mm")
        original = type(self).forward.__wrapped__
        return ALL_EXPERTS_FUNCTIONS.get_interface(fallback, original)(self, hidden_states, top_k_index,
                                                                        top_k_weights)
    if getattr(self, "_is_expert_parallel", False):
        raise ValueError("fp8train experts do not support transformers' expert parallelism (expert ids past "
                         "num_experts); run the experts without it")
    num_tokens, top_k = top_k_index.shape
    if top_k > self.num_experts:
        raise ValueError(f"top-k = {top_k} experts per token is more than the {self.num_experts} experts")
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)     # routed pairs sorted by expert
    tokens = order // top_k                             # the token of each sorted pair
    counts = torch.bincount(expert_ids, minlength=self.num_experts)
    offs = counts.cumsum(0).to(torch.int32)
    sizes = counts.tolist()
    hidden = hidden_states[tokens]                      # (T * k, H)
    for i, param in enumerate(params):
        weight = getattr(self, param)
        weight = weight.transpose(1, 2) if self.is_transposed else weight       # (E, N, K)
        bias = getattr(self, param + "_bias", None) if self.has_bias else None
        scaling = scaling_of(self, param)
        hidden = fp8_grouped_mm(hidden, weight, offs, scaling, bias) if scaling is not None else \
            _high_precision_grouped(hidden, weight, sizes, bias)
        if i == 0:
            hidden = self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)
    if getattr(self, "has_post_expert_norm", False):
        hidden = self.post_expert_norm(hidden)
    hidden = hidden * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(hidden.dtype)
    unsorted = torch.empty_like(hidden)
    unsorted[order] = hidden                            # back to (token, k) order; each pair written once
    # a sum over the k experts of each token, in fp32 (deterministic, as transformers' grouped path)
    final = unsorted.view(num_tokens, top_k, -1).sum(dim=1, dtype=torch.float32)
    return final.to(hidden_states.dtype)
