"""Save and restore a Hugging Face model converted to FP8, scaling state included, in a Hugging Face folder.

    fp8train.save_pretrained(model, "out/")          # model: a transformers causal LM (or fp8train's HFCausalLM)
    model = fp8train.from_pretrained("out/")         # the same model: same Fp8Linear layers, recipes, buffers

The folder is a normal transformers folder: `config.json` (the model's own config plus an `fp8train` section
recording, per FP8 layer, its recipe) and `model.safetensors` holding the fp32 master weights under the Hugging
Face names, in the Hugging Face layout (a GPT-2 Conv1D weight is stored (in, out) again), plus the FP8 scaling
buffers (`*_amax_history`, `*_scale`, ...) of the converted layers. transformers' own from_pretrained reads it
as the plain model, and `model.hf_path` fine-tunes from it; `fp8train.from_pretrained` restores the FP8 layers
with their state, bit for bit. It reads transformers' own `save_pretrained` folders and `Trainer` checkpoints of a
converted model the same way: `convert_to_fp8` recorded the FP8 layers in the model's config
(fp8train.nn.fp8_record), which every save writes into config.json.

The rule for the scaling buffers, whoever saves: they are in the converted model's state_dict, so every save of
it keeps them (this one, transformers' own `save_pretrained`, a `Trainer` checkpoint, which a Trainer resuming
into the converted model restores), and every load into a plain model drops them (`model.hf_path` accepts such a
folder and starts the run's own scaling state; transformers drops them quietly in a process that converted a model
of that class, which declared them ignorable: nn/fp8_record.py). The weights of every such
save are in the model's own layout, Conv1D's (in, out) included (Fp8Linear's state_dict).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from fp8train.nn.convert import is_conv1d, fp8_from_conv1d
from fp8train.nn.fp8_record import (FP8_RECORD_KEY, attach_fp8_record, declare_scaling_buffers_ignorable,
                                    fp8_record, recipe_from_record)
from fp8train.nn.hf_experts import attach
from fp8train.nn.linear import Fp8Linear, is_scaling_buffer
from fp8train.training.storage.files import give_default_mode, write_text_atomic

__all__ = ["save_pretrained", "from_pretrained", "FP8TRAIN_SECTION", "WEIGHTS_NAME", "unwrap_hf"]

FP8TRAIN_SECTION = FP8_RECORD_KEY
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def unwrap_hf(model: nn.Module) -> nn.Module:
    """The transformers model inside fp8train's HFCausalLM wrapper (or the model itself)."""
    inner = getattr(model, "hf", model)
    if not hasattr(inner, "config") or not hasattr(inner.config, "to_json_string"):
        raise ValueError(f"{type(model).__name__} is not a Hugging Face model (no transformers config); "
                         "save_pretrained/from_pretrained are for transformers causal LMs")
    return inner


def hf_layout_state(model: nn.Module) -> dict:
    """state_dict with tied aliases once (a Conv1D-born Fp8Linear's state_dict holds Conv1D's (in, out) already)."""
    tensors, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        tensors[name] = tensor.detach().contiguous().clone()
    return tensors


def save_pretrained(model: nn.Module, folder, tokenizer=None) -> Path:
    """Write ``model`` (converted or not) to ``folder`` (see the module docstring); ``tokenizer`` (a
    transformers tokenizer) is saved beside it. Returns the folder."""
    hf = unwrap_hf(model)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads(hf.config.to_json_string(use_diff=False))
    config[FP8TRAIN_SECTION] = fp8_record(hf)  # what the model holds now (a plain model: no FP8 layers)
    tmp = folder / f".{WEIGHTS_NAME}.tmp-{os.getpid()}"
    try:
        save_file(hf_layout_state(hf), str(tmp), metadata={"format": "pt"})
        give_default_mode(tmp)  # safetensors writes 0600
        os.replace(tmp, folder / WEIGHTS_NAME)
    finally:
        tmp.unlink(missing_ok=True)
    write_text_atomic(folder / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return folder


def from_pretrained(folder, device="cpu") -> nn.Module:
    """The transformers model saved by `save_pretrained` (fp8train's or transformers' own, or a Trainer checkpoint
    of a converted model), its FP8 layers rebuilt with their recipes and scaling state (eval mode, fp32 master
    weights).

    The weights are read by transformers' own from_pretrained, so whatever layout that save wrote loads: fp8train
    writes the model's state_dict layout, transformers' save_pretrained may write the checkpoint layout of the
    architecture (for MoE models, one tensor per expert and projection, which it fuses back on load). The FP8
    scaling buffers, which transformers does not load into a plain model, are then read from the files by name."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    except ImportError as err:
        raise ImportError("from_pretrained needs Hugging Face transformers: pip install transformers") from err
    folder = Path(folder)
    if not (folder / "config.json").is_file() or not any((folder / n).is_file() for n in (WEIGHTS_NAME, INDEX_NAME)):
        raise ValueError(f"{str(folder)!r} is not a saved model folder (needs config.json and {WEIGHTS_NAME} or "
                         f"{INDEX_NAME}, as save_pretrained and Trainer checkpoints write)")
    section = json.loads((folder / "config.json").read_text()).get(FP8TRAIN_SECTION) or {}
    config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    if hasattr(config, FP8TRAIN_SECTION):
        delattr(config, FP8TRAIN_SECTION)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is not None:
        declare_scaling_buffers_ignorable(model_class)  # read below, by name: transformers need not list them
    hf, info = AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=torch.float32,
                                                    local_files_only=True, output_loading_info=True)
    unexpected = sorted(k for k in info["unexpected_keys"] if not is_scaling_buffer(k))
    if info["missing_keys"] or unexpected or info["mismatched_keys"]:
        raise ValueError(f"{str(folder)!r} does not fit its config.json: missing {sorted(info['missing_keys'])[:4]}, "
                         f"unexpected {unexpected[:4]}, wrong shape {[k for k, *_ in info['mismatched_keys']][:4]}")
    recipes = [recipe_from_record(r) for r in section.get("recipes", [])]
    for name, index in section.get("layers", {}).items():
        parent_name, _, child = name.rpartition(".")
        parent = hf.get_submodule(parent_name) if parent_name else hf
        module = getattr(parent, child)
        swap = fp8_from_conv1d if is_conv1d(module) else Fp8Linear.from_linear
        setattr(parent, child, swap(module, recipes[index]))
    projections: dict = {}  # experts module name -> {projection: recipe}
    for name, index in section.get("experts", {}).items():
        module_name, _, param = name.rpartition(".")
        projections.setdefault(module_name, {})[param] = recipes[index]
    for module_name, chosen in projections.items():
        attach(hf.get_submodule(module_name), chosen)
    _load_scaling_buffers(hf, folder, recorded=bool(section.get("layers") or section.get("experts")))
    attach_fp8_record(hf)  # as convert_to_fp8 would: its next save_pretrained (or Trainer checkpoint) restores too
    return hf.to(device).eval()


def _weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or every shard that model.safetensors.index.json lists."""
    if (folder / WEIGHTS_NAME).is_file():
        return [folder / WEIGHTS_NAME]
    return [folder / shard for shard in sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()))]


def _load_scaling_buffers(model: nn.Module, folder: Path, recorded: bool) -> None:
    """Every FP8 scaling buffer of ``model`` from the folder's files, exactly: none missing, none left over."""
    expected = {k for k in model.state_dict() if is_scaling_buffer(k)}
    tensors = {}
    for path in _weight_files(folder):
        with safe_open(str(path), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if is_scaling_buffer(k)})
    unexpected = sorted(set(tensors) - expected)
    if unexpected and not recorded:
        raise ValueError(f"{str(folder)!r} holds FP8 scaling buffers ({unexpected[0]}, ...) but its config.json "
                         f"records no FP8 layers (no '{FP8TRAIN_SECTION}' section); model.hf_path fine-tunes from it "
                         "(the buffers are dropped), or save it again from the converted model")
    missing = sorted(expected - set(tensors))
    wrong = [k for k in sorted(expected & set(tensors))
             if tuple(tensors[k].shape) != tuple(model.get_buffer(k).shape)]
    if missing or unexpected or wrong:
        raise ValueError(f"{str(folder)!r} does not fit its config.json: FP8 scaling buffers missing {missing[:4]}, "
                         f"unexpected {unexpected[:4]}, wrong shape {wrong[:4]}")
    model.load_state_dict(tensors, strict=False)
