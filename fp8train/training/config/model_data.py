"""Config sections of what is trained on what: the model architecture and the data."""

from __future__ import annotations

import math
from dataclasses import dataclass

from fp8train.training.config.base import Section, require

__all__ = ["ModelConfig", "DataConfig", "HF_ONLY_SOURCE_KEYS", "DECODER_ONLY_FIELDS", "MOE_FIELDS",
           "check_hf_model_fields", "drop_decoder_fields"]

HF_ONLY_SOURCE_KEYS = ("hf_config", "hf_path")
# ModelConfig fields that describe fp8train's Decoder and mean nothing for a Hugging Face model.
DECODER_ONLY_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "tie_embeddings",
                       "norm_eps", "rope_theta", "n_experts", "top_k", "n_shared_experts", "moe_every",
                       "moe_ffn_hidden", "aux_loss_coef")
# The Decoder's mixture-of-experts fields: with model.n_experts = 0 (dense) they are left out of the config hash,
# so a dense run's hash is the one it had before these fields existed (its checkpoints still resume).
MOE_FIELDS = ("top_k", "n_shared_experts", "moe_every", "moe_ffn_hidden", "aux_loss_coef")


def check_hf_model_fields(model_cfg, defaults) -> None:
    """Refuse Decoder architecture fields set together with an HF model (they would be silently ignored)."""
    key = "hf_path" if model_cfg.hf_path else "hf_config"
    if model_cfg.hf_path and model_cfg.hf_config:
        raise ValueError("config model.hf_path and model.hf_config are both set: give one (hf_path = pretrained "
                         "weights and their config.json; hf_config = an architecture, random init)")
    changed = [name for name in DECODER_ONLY_FIELDS if getattr(model_cfg, name) != getattr(defaults, name)]
    if changed:
        raise ValueError(f"config model.{changed[0]}={getattr(model_cfg, changed[0])!r} does not apply to a Hugging "
                         f"Face model (model.{key}): its architecture comes from config.json; remove "
                         f"{', '.join('model.' + n for n in changed)}")


def drop_decoder_fields(config: dict) -> dict:
    """A plain config dict (as sent to wandb) without the Decoder-only model fields when the model is an HF
    model: they were not used, so they are not recorded as if they were."""
    model = config.get("model", {})
    if model.get("hf_path") or model.get("hf_config"):
        # vocab_size at its default (256, byte-level text for the Decoder) is unused too: the HF model's
        # vocabulary is its config.json's (recorded under model_config); a value set on purpose (a nanoGPT .bin
        # checks its token ids against it) is kept
        unused = DECODER_ONLY_FIELDS + (("vocab_size",) if model.get("vocab_size") == ModelConfig.vocab_size else ())
        config = {**config, "model": {k: v for k, v in model.items() if k not in unused}}
    return config


@dataclass
class ModelConfig(Section):
    _section = "model"
    n_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 128
    """Residual stream width."""
    n_heads: int = 4
    """Query heads; head_dim = d_model / n_heads (must be even for RoPE)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 = n_heads (plain multi-head)."""
    seq_len: int = 128
    """Training context length in tokens."""
    vocab_size: int = 256
    """Vocabulary size; 256 = byte-level text. For a nanoGPT .bin corpus, set it above the largest token id."""
    ffn_hidden: int = 0
    """SwiGLU hidden width; 0 = auto: 8/3 * d_model rounded up to a multiple of 16 (FP8-eligible)."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    n_experts: int = 0
    """Mixture of experts: routed experts per MoE block; 0 = a dense model (every block a SwiGLU MLP)."""
    top_k: int = 2
    """MoE: experts each token is routed to (dropless token choice), 1 <= top_k <= n_experts."""
    n_shared_experts: int = 0
    """MoE: experts every token runs besides its routed ones (one SwiGLU n_shared_experts times as wide)."""
    moe_every: int = 1
    """MoE: every moe_every-th block is an MoE block (blocks moe_every-1, 2*moe_every-1, ...); 1 = all."""
    moe_ffn_hidden: int = 0
    """MoE: SwiGLU hidden width of each expert; 0 = the dense width (model.ffn_hidden's rule) / top_k."""
    aux_loss_coef: float = 0.01
    """MoE: weight of the load-balancing loss n_experts * sum_e f_e * p_e (one per MoE block, summed) added to
    the training loss; the validation loss is the language-model loss alone."""
    hf_config: str = ""
    """Local Hugging Face config.json (or its folder) to build a transformers causal LM instead; "" = ours."""
    hf_path: str = ""
    """Local Hugging Face model folder (config.json + safetensors) to fine-tune from its weights; "" = none."""

    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def ffn_dim(self) -> int:
        return self.ffn_hidden or 16 * -(-(8 * self.d_model // 3) // 16)

    def expert_dim(self) -> int:
        return self.moe_ffn_hidden or 16 * -(-(self.ffn_dim() // self.top_k) // 16)

    def is_moe_block(self, layer_idx: int) -> bool:
        return self.n_experts > 0 and (layer_idx + 1) % self.moe_every == 0

    def _check_moe(self) -> None:
        # ranges always (a typo is refused even in a dense config); relations only when there are experts
        self._at_least("n_experts", 0, "must be >= 0 (0 = dense)")
        require(self.n_experts <= 256, "model.n_experts", self.n_experts, "must be <= 256")
        self._at_least("top_k", 1)
        self._at_least("n_shared_experts", 0, "must be >= 0 (0 = no shared expert)")
        self._at_least("moe_every", 1, "must be >= 1 (1 = every block)")
        self._at_least("moe_ffn_hidden", 0, "must be >= 0 (0 = auto)")
        require(self.aux_loss_coef >= 0 and math.isfinite(self.aux_loss_coef), "model.aux_loss_coef",
                self.aux_loss_coef, "must be a finite number >= 0 (0 = no load-balancing loss)")
        if self.n_experts == 0:
            return
        require(self.top_k <= self.n_experts, "model.top_k", self.top_k,
                f"must be in [1, model.n_experts={self.n_experts}]")
        require(self.moe_every <= self.n_layers, "model.moe_every", self.moe_every,
                f"must be in [1, model.n_layers={self.n_layers}] (else no block would be MoE)")

    def _check(self) -> None:
        self._check_moe()
        for name in ("n_layers", "d_model", "n_heads"):
            self._at_least(name, 1)
        # the deepest published decoders have ~100 layers; 100000 built for minutes before any check could run
        require(self.n_layers <= 1024, "model.n_layers", self.n_layers, "must be <= 1024")
        self._at_least("n_kv_heads", 0, "must be >= 0 (0 = n_heads)")
        self._at_least("seq_len", 2, "must be >= 2 (inputs and shifted targets)")
        self._at_least("vocab_size", 2)
        self._at_least("ffn_hidden", 0, "must be >= 0 (0 = auto)")
        require(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        require(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        require(self.d_model % self.n_heads == 0, "model.d_model", self.d_model,
                 f"must be divisible by model.n_heads={self.n_heads}")
        head_dim = self.d_model // self.n_heads
        require(head_dim % 2 == 0, "model.n_heads", self.n_heads,
                 f"head_dim = d_model / n_heads = {head_dim} must be even (RoPE rotates channel pairs)")
        require(self.n_heads % self.kv_heads() == 0, "model.n_kv_heads", self.n_kv_heads,
                 f"must divide model.n_heads={self.n_heads}")
        if self.hf_path or self.hf_config:  # Decoder fields would be ignored by an HF model: refuse them
            check_hf_model_fields(self, type(self)())


@dataclass
class DataConfig(Section):
    _section = "data"
    path: str = ""
    """Text file, folder of text files (recursive), or nanoGPT uint16 .bin; "" = built-in corpus (Python stdlib).
    Text only: data files (.jsonl, .parquet, ...) go to data.hf_dataset."""
    val_fraction: float = 0.05
    """Share held out for validation: by file for folders and the built-in corpus, else the tail of the tokens."""
    split_seed: int = 0
    """Salt of the file-level train/validation split (a hash of each file's relative path)."""
    max_bytes: int = 32_000_000
    """Cap on text corpora: files are read in sorted order until this many bytes; 0 = no cap. Not for .bin."""
    tokenizer: str = ""
    """Local Hugging Face tokenizer folder (tokenizer.json): text is tokenized with it, once, and cached. "" =
    model.hf_path's own tokenizer (refused if it has none), else bytes; "bytes" = byte-level text on purpose."""
    hf_dataset: str = ""
    """Local `datasets` dataset saved with save_to_disk, or local .jsonl/.json/.parquet/.csv files (a file or a
    glob); its text is data.text_field. Replaces data.path (which reads text only)."""
    text_field: str = "text"
    """Column of data.hf_dataset that holds the text."""

    def _check(self) -> None:
        require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        self._at_least("max_bytes", 0, "must be >= 0 (0 = no cap)")
        require(bool(self.text_field), "data.text_field", self.text_field, "a column name of data.hf_dataset")
        require(not (self.hf_dataset and self.path), "data.hf_dataset", self.hf_dataset,
                 f"replaces data.path (set to {self.path!r}): give one of them")
