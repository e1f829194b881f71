"""The K/V hook of the FP8 KV-cache evaluation for Hugging Face causal LMs.

fp8train's own Decoder gives every attention layer a `kv_transform` attribute. A transformers model gets the same
from `enable_kv_hook`: every attention module gets `kv_transform` (None by default) and the model's attention
implementation is wrapped so that, when set, it sees K (after RoPE) and V, (B, n_kv_heads, T, head_dim), and
returns what a cache would hold. With the hook unset the wrapped implementation is the original one, so logits are
unchanged. Training never installs it: kv_transform.kv_transforms does, on the model it evaluates.
"""

from __future__ import annotations

import importlib

import torch.nn as nn

__all__ = ["enable_kv_hook", "hf_kv_shape"]

_KV_ATTENTION = "fp8train_kv"


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "layer_idx")]


def enable_kv_hook(model: nn.Module) -> None:
    """Give every attention module a `kv_transform` (None) and route attention through a wrapper that applies
    it to K and V before calling the model's own attention implementation."""
    import transformers  # only a transformers model reaches here (it has _can_set_attn_implementation)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modules = _attention_modules(model)
    # transformers keeps the attention kernel it chose only here (no public accessor)
    base = model.config._attn_implementation or "eager"
    if not modules or base.startswith(_KV_ATTENTION) or not getattr(model, "_can_set_attn_implementation",
                                                                     lambda: False)():
        return
    name = f"{_KV_ATTENTION}_{base}"
    base_attention = ALL_ATTENTION_FUNCTIONS[base] if base != "eager" else _eager_attention(model)

    def kv_hooked_attention(module, query, key, value, attention_mask, **kwargs):
        transform = getattr(module, "kv_transform", None)
        if transform is not None:
            key, value = transform(key, value, module.layer_idx)
            key, value = key.to(query.dtype), value.to(query.dtype)
        return base_attention(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register(name, kv_hooked_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(name)
    for module in modules:
        module.kv_transform = None


def _eager_attention(model: nn.Module):
    modeling = importlib.import_module(type(model).__module__)
    return modeling.eager_attention_forward


def hf_kv_shape(model: nn.Module) -> dict:
    """n_layers, n_kv_heads and head_dim of an HF causal LM (what its KV cache holds per token)."""
    config = model.config
    n_heads = getattr(config, "num_attention_heads", None) or config.n_head
    n_layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    n_kv = getattr(config, "num_key_value_heads", None) or n_heads
    head_dim = getattr(config, "head_dim", None) or hidden // n_heads
    return {"n_layers": int(n_layers), "n_kv_heads": int(n_kv), "head_dim": int(head_dim)}

