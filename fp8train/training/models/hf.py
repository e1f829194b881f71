"""Hugging Face causal LMs in fp8train: building one from a local folder, with or without its weights.

    model.hf_config: path/to/config.json (or its folder)   the architecture, random init
    model.hf_path:   path/to/folder                        config.json + safetensors weights: fine-tune from them

Nothing is downloaded (`local_files_only`). A pretrained folder is checked before anything is trained: it must
hold config.json and safetensors weights (`model.safetensors`, or shards listed in `model.safetensors.index.json`),
every parameter of the architecture must be in them with the shape config.json implies, and nothing else may be
(a tied output head is the one tensor allowed to be absent) except FP8 scaling buffers (`*_amax_history`,
`*_scale`, ...) of the model's Linear / Conv1D layers: a folder saved from a converted model (by
fp8train.save_pretrained, transformers' save_pretrained or a Trainer checkpoint) holds them, and they are dropped:
the run starts the scaling state of its own recipe. Weights load as fp32: they are the master weights. An fp8train
run directory is not such a folder: `fp8train export RUN_DIR --format hf --out DIR` writes one.

The recipe's own architecture fields (`model.d_model`, `model.n_layers`, ...) describe fp8train's Decoder, not an
HF model: a config that sets them together with an HF model is refused (see `config.model_data.check_hf_model_fields`).

`HFCausalLM` wraps such a model with fp8train's `forward(idx, targets) -> (logits, loss)`; `build_model` in
fp8train.training.models.decoder builds it (the FP8 KV-cache evaluation's attention hook for these models is
serving's: fp8train.serving.kv_hooks).
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional
from pathlib import Path

import torch
import torch.nn as nn

from fp8train.nn.convert import is_conv1d
from fp8train.nn.hf_experts import SCALING_SUFFIX, expert_projections, is_hf_experts
from fp8train.nn.linear import is_scaling_buffer
from fp8train.training.storage.rundir import refuse_run_directory_as_hf_folder
from fp8train.training.config.model_data import ModelConfig
from fp8train.training.models.loss import lm_loss

__all__ = ["HFCausalLM", "hf_config_of", "build_hf_model", "quiet_transformers"]

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _transformers():
    try:
        import transformers
    except ImportError as err:
        raise ImportError("model.hf_config / model.hf_path need Hugging Face transformers: pip install "
                          "transformers  (or fp8train[hf])") from err
    return transformers


def _config_folder(path: str, key: str) -> Path:
    folder = Path(os.path.expanduser(path))
    if not folder.exists():
        raise ValueError(f"model.{key}: {path!r} does not exist; give a local folder holding config.json"
                         + (" and safetensors weights" if key == "hf_path" else " (or the config.json itself)"))
    if folder.is_file() and key == "hf_config":
        return folder
    if not folder.is_dir():
        raise ValueError(f"model.{key}: {path!r} is not a folder")
    if not (folder / "config.json").is_file():
        refuse_run_directory_as_hf_folder(path, f"model.{key}")
        raise ValueError(f"model.{key}: folder {path!r} has no config.json")
    return folder


def hf_config_of(model_cfg):
    """The transformers config of ``model_cfg.hf_path`` or ``model_cfg.hf_config`` (checked, local only)."""
    key = "hf_path" if model_cfg.hf_path else "hf_config"
    source = _config_folder(getattr(model_cfg, key), key)
    try:
        config = _transformers().AutoConfig.from_pretrained(str(source), local_files_only=True)
    except Exception as err:  # noqa: BLE001  transformers' checks (hidden size vs heads) raise no ValueError
        raise ValueError(f"model.{key}: {str(source)!r} is not a readable transformers config: "
                         f"{' '.join(str(err).split())[:300]}") from None
    vocab = getattr(config, "vocab_size", None)
    # model.vocab_size at its default is the Decoder's byte vocabulary, unused here (the data's tokens are checked
    # against the model's embedding once they are read); set on purpose (a nanoGPT .bin's ids) it must fit
    if vocab is not None and model_cfg.vocab_size != ModelConfig.vocab_size and vocab < model_cfg.vocab_size:
        raise ValueError(f"model.{key}: its vocab_size {vocab} is smaller than model.vocab_size "
                         f"{model_cfg.vocab_size} (the data's token ids); raise vocab_size in the HF config")
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if max_pos is not None and max_pos < model_cfg.seq_len:
        raise ValueError(f"model.seq_len {model_cfg.seq_len} exceeds max_position_embeddings {max_pos} of "
                         f"model.{key}")
    return config


def build_hf_model(model_cfg, load_weights: bool = True) -> nn.Module:
    """The transformers causal LM of ``model_cfg`` in fp32. ``load_weights=False``
    builds a pretrained folder's architecture only (a caller that loads a checkpoint over it)."""
    transformers = _transformers()
    config = hf_config_of(model_cfg)
    if model_cfg.hf_path and load_weights:
        model = _load_pretrained(Path(os.path.expanduser(model_cfg.hf_path)), config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model


def _load_pretrained(folder: Path, config) -> nn.Module:
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        found = sorted(p.name for p in folder.iterdir())[:8]
        raise ValueError(f"model.hf_path: folder {str(folder)!r} has no safetensors weights ({' or '.join(WEIGHT_FILES)}"
                         f"; found {found}); for random init from an architecture use model.hf_config")
    auto = _transformers().AutoModelForCausalLM
    try:
        with quiet_transformers():  # its load report and progress bars: our checks below say what is wrong
            model, info = auto.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                               local_files_only=True, output_loading_info=True)
    except (OSError, RuntimeError, ValueError) as err:  # shape mismatches and unreadable files land here
        raise ValueError(f"model.hf_path: the weights in {str(folder)!r} do not fit its config.json: "
                         f"{' '.join(str(err).split())[:300]}") from None
    tied = _tied_names(model)
    missing = [k for k in info.get("missing_keys", []) if k not in tied]
    linears = {name for name, module in model.named_modules() if isinstance(module, nn.Linear) or is_conv1d(module)}
    linears |= {f"{name}.{param}{SCALING_SUFFIX}" for name, module in model.named_modules() if is_hf_experts(module)
                for param in expert_projections(module)}  # an experts projection's per-expert scaling state
    unexpected = [k for k in info.get("unexpected_keys", []) if not _is_saved_scaling_state(k, linears)]
    problems = {"missing": missing, "unexpected": unexpected,
                "wrong shape": [str(m[0]) if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys", [])]}
    problems = {kind: names for kind, names in problems.items() if names}
    if problems:
        said = "; ".join(f"{kind}: {len(names)} ({', '.join(sorted(names)[:3])}...)" for kind, names in problems.items())
        raise ValueError(f"model.hf_path: the weights in {str(folder)!r} are partial or do not match config.json "
                         f"({said})")
    return model


def _is_saved_scaling_state(key: str, linear_names: set) -> bool:
    """A scaling buffer of one of the model's Linear / Conv1D layers (or experts projections), saved from its
    converted form: fine-tuning starts from the master weights, and the run's own recipe starts its own scaling
    state."""
    return key.rpartition(".")[0] in linear_names and is_scaling_buffer(key)


@contextmanager
def quiet_transformers():
    """transformers' warnings and progress bars off for the block (errors still raise)."""
    logging = _transformers().utils.logging
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _tied_names(model: nn.Module) -> set:
    """Names of parameters that share their tensor with an earlier name (a tied output head)."""
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.add(name)
        seen.add(id(param))
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        tied |= {name for name, _ in model.named_parameters(remove_duplicate=False) if name.startswith("lm_head.")}
    return tied


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM with fp8train's `forward(idx, targets) -> (logits, loss)`. Its state_dict names
    carry the prefix `hf.`; Hugging Face files (save_pretrained, export) use the names without it, and layer-policy
    patterns match either (`wrapped_name_prefix`, read by fp8train.nn.convert)."""

    wrapped_name_prefix = "hf."

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        logits = self.hf(input_ids=idx, use_cache=False).logits  # (B, T, V)
        return logits, lm_loss(logits, targets)
