"""A compact Llama-style decoder, in the nanoGPT spirit.

RMSNorm -> grouped-query causal attention with RoPE -> RMSNorm -> SwiGLU MLP, pre-norm residual blocks, an
optional tied output head. Every large matmul is a plain `nn.Linear` so `convert_to_fp8` can swap it; the
attention product itself goes through `F.scaled_dot_product_attention` and stays in bf16 under autocast.

Module names are a contract (the layer policy, telemetry and the KV-cache evaluation rely on them):
`embed`, `layers.{i}.attn_norm`, `layers.{i}.attn.{q,k,v,o}_proj`, `layers.{i}.mlp_norm`,
`layers.{i}.mlp.{gate,up,down}_proj`, `norm`, `lm_head`; an MoE block (model.n_experts > 0, every
model.moe_every-th block) has `layers.{i}.mlp.{router, experts.gate_up, experts.down, shared.*}` instead
(fp8train.training.models.moe). In training, the MoE blocks' load-balancing losses (summed, times
model.aux_loss_coef) are added to the loss; `last_aux_loss` keeps their sum (detached) for the metrics.

`build_model(model_cfg)` also builds a Hugging Face causal LM from a local folder when `model.hf_path`
(pretrained weights) or `model.hf_config` (architecture only) is set (fp8train.training.models.hf), wrapped so
that it has the same `forward(idx, targets) -> (logits, loss)`.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8train.training.models.hf import HFCausalLM, build_hf_model
from fp8train.training.models.loss import lm_loss
from fp8train.training.models.moe import MoE, moe_blocks

__all__ = ["Decoder", "moe_blocks", "build_model", "count_params", "vocab_rows", "check_model_for_run"]

# callable(k, v, layer_idx) -> (k, v); k and v are (B, n_kv_heads, T, head_dim)
KVTransform = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """Root-mean-square norm. Computes in fp32 whatever the input dtype: the mean of squares of a bf16
    activation loses most of its mantissa otherwise."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_fp32 * self.weight.float()).to(x.dtype)


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, (T, head_dim), fp32, in the "rotate half" layout used by Llama / HF."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float64), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hd)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + hd/2) of x (B, nh, T, hd) by position-dependent angles, in fp32."""
    x_fp32 = x.float()
    x1, x2 = x_fp32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_fp32 * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, layer_idx: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_model, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        # Hook for the FP8 KV-cache evaluation: sees K (after RoPE) and V exactly as attention would read them.
        self.kv_transform: Optional[KVTransform] = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # heads counted from the width (-1): under tensor parallelism each rank holds n_heads / tp of them
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_transform is not None:
            k, v = self.kv_transform(k, v, self.layer_idx)
        # Attention stays in the autocast dtype (bf16); FP8 is only for the projections around it.
        y = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.o_proj(y)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.kv_heads(), layer_idx)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if cfg.is_moe_block(layer_idx):
            self.mlp = MoE(cfg.d_model, cfg.n_experts, cfg.top_k, cfg.expert_dim(), cfg.n_shared_experts, SwiGLU)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """Token embedding -> n_layers blocks -> final norm -> lm_head. `cfg` is a `ModelConfig`."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_cos_sin(cfg.seq_len, cfg.d_model // cfg.n_heads, cfg.rope_theta)
        # Not persistent: derived from the config, so checkpoints do not carry (or disagree about) them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.last_aux_loss: Optional[torch.Tensor] = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2 / Llama-style init; residual projections scaled by 1/sqrt(2 n_layers) so the residual stream's
        # variance does not grow with depth (2 residual adds per block).
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)) or hasattr(module, "num_experts"):
                std = residual_std if name.endswith(("o_proj", "down_proj", "experts.down")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def _rope(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if T > self.rope_cos.shape[0]:  # longer than model.seq_len (e.g. a long-context eval): extend
            cos, sin = rope_cos_sin(T, self.cfg.d_model // self.cfg.n_heads, self.cfg.rope_theta, device)
            self.rope_cos, self.rope_sin = cos, sin
        return self.rope_cos[:T], self.rope_sin[:T]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """idx (B, T) int64 -> logits (B, T, vocab); loss = mean cross entropy in fp32 if targets given."""
        B, T = idx.shape
        cos, sin = self._rope(T, idx.device)
        x = self.embed(idx)  # (B, T, C)
        for block in self.layers:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        loss = lm_loss(logits, targets)
        moe = [m for m in self.layers if isinstance(m.mlp, MoE)]
        if moe:
            aux = torch.stack([b.mlp.aux_loss for b in moe]).sum()
            self.last_aux_loss = aux.detach()
            if loss is not None and self.training and self.cfg.aux_loss_coef > 0:
                loss = loss + self.cfg.aux_loss_coef * aux
        return logits, loss


def build_model(model_cfg, load_weights: bool = True) -> nn.Module:
    """Our Decoder, or a Hugging Face causal LM when model.hf_path (pretrained weights) or model.hf_config
    (architecture, random init) is set: its architecture then comes from config.json; model.seq_len still
    describes the data. ``load_weights=False`` skips an hf_path's weights (a checkpoint is loaded over them)."""
    if model_cfg.hf_path or model_cfg.hf_config:
        return HFCausalLM(build_hf_model(model_cfg, load_weights))
    return Decoder(model_cfg)


def tied_weight_groups(model: nn.Module) -> list[list[str]]:
    """The state_dict names that share one tensor (tied embeddings: `embed.weight` and `lm_head.weight`), one
    group per shared tensor, each in state_dict order. safetensors stores such a tensor once, under one name."""
    names_of: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
    return [names for names in names_of.values() if len(names) > 1]
def vocab_rows(model: nn.Module) -> int:
    """Rows of the input embedding: every token id the data holds must be below this."""
    inner = model.hf if isinstance(model, HFCausalLM) else model
    embedding = inner.get_input_embeddings() if hasattr(inner, "get_input_embeddings") else inner.embed
    return embedding.num_embeddings


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of parameters, each shared tensor counted once (tied embeddings)."""
    seen, total = set(), 0
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if id(p) in seen or (exclude_embeddings and id(p) in embedding_ids):
            continue
        seen.add(id(p))
        total += p.numel()
    return total


def check_model_for_run(model: nn.Module, data_vocab: int, conversion, allow_no_fp8: bool) -> None:
    """Refuse, before anything is written, a model that cannot hold the data's token ids, and an FP8 run in
    which no layer converted (it would train in high precision while its summary says FP8)."""
    rows = vocab_rows(model)
    if data_vocab > rows and hasattr(model, "hf"):  # an HF model: its vocabulary is its config.json's
        raise ValueError(f"the data has {data_vocab} token ids (its tokenizer's length; 256 for bytes) but the Hugging "
                         f"Face model's embedding has {rows} rows (vocab_size in its config.json): set data.tokenizer to a tokenizer of at most "
                         f"{rows} tokens (\"\" = the model folder's own), or train a new model from model.hf_config "
                         f"with vocab_size >= {data_vocab}")
    if data_vocab > rows:
        raise ValueError(f"the data has token ids up to {data_vocab - 1} but the model's embedding has {rows} rows; "
                         f"set model.vocab_size >= {data_vocab} (or use a Hugging Face model whose vocabulary "
                         "covers the tokenizer)")
    if conversion is not None and not conversion.converted and not allow_no_fp8:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in conversion.skipped) or "the model has no Linear"
        raise ValueError(f"fp8.recipe={conversion.recipe.name} but no layer converted to FP8 ({reasons}); change "
                         "policy.* (e.g. policy.min_features) or set policy.allow_no_fp8=true to train in high "
                         "precision anyway")
