"""A finished run, loaded once for serving-side work (export, kv-eval).

Which model: the newest valid checkpoint of RUN_DIR, in the plain model rebuilt from RUN_DIR/config.yaml (built
once: a Hugging Face run's architecture comes from its config.json, its pretrained weights are not read, the
checkpoint is). A run trained in FP8 is loaded into the plain model by name: its Fp8Linear layers keep their
fp32 master weights under the same names as nn.Linear (`layers.0.attn.q_proj.weight`), and the FP8 scaling
buffers they add (`*_amax_history`, `*_scale`, `*_nonfinite_amax_count`, ...) are training state, dropped after
checking that they belong to layers the run's policy converted. A GPT-2 Conv1D layer trained as Fp8Linear is
checkpointed in Conv1D's (in, out) layout (Fp8Linear's state_dict) and loads as it is; a rectangular (out, in)
weight comes from a checkpoint written before that rule and is transposed back. Anything else missing or
unexpected is an error.

A Hugging Face folder (config.json and safetensors weights, e.g. a dense export) is loaded too, as the run a
default config with `model.hf_path` set to it would start from (step 0; model.seq_len = min(128, its maximum
positions); data: the built-in corpus with the folder's own tokenizer, or the one `--tokenizer` names: a Trainer
checkpoint holds none), so export and kv-eval take either. Its FP8 layers are the ones config.json records when
a converted model was saved (`convert_to_fp8` recorded them: nn/fp8_record.py), else its default policy's.

Which layers are FP8: those the run's recipe and layer policy convert (for a bf16 run: those its policy would
convert), found by a dry run of `convert_to_fp8` on the same model, before its weights are loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from fp8train import __version__
from fp8train.nn.convert import convert_to_fp8, is_conv1d
from fp8train.nn.fp8_record import FP8_RECORD_KEY
from fp8train.nn.recipes import ROLES
from fp8train.training.runs.checkpoint import MANIFEST
from fp8train.training.runs.sharded_checkpoint import latest_loadable_checkpoint, read_model_state
from fp8train.training.config import layer_policy_from_config, load_config
from fp8train.training.models.hf import hf_kv_shape
from fp8train.training.models.decoder import HFCausalLM, build_model, tied_weight_groups
from fp8train.training.runs.resume import resume_hash
from fp8train.training.storage.files import read_json
from fp8train.training.data.tokenized import has_tokenizer

__all__ = ["LoadedRun", "load_run", "fp8_policy_names", "fp8_linear_names", "tied_aliases", "package_version", "kv_shape"]


@dataclass
class LoadedRun:
    model: nn.Module  # fp32 master weights, eval mode, plain nn.Linear (or Conv1D) everywhere
    cfg: object  # FullConfig from RUN_DIR/config.yaml
    run_dir: Path
    checkpoint: Path
    step: int
    fp8_names: list  # Linears the run's layer policy puts in FP8


def fp8_linear_names(run: LoadedRun) -> list[str]:
    """The run's FP8 layers that serving formats can hold: nn.Linear ones (a GPT-2 Conv1D trained in FP8 is
    exported in high precision). Refuses a run left with none, saying why."""
    names = [n for n in run.fp8_names if isinstance(run.model.get_submodule(n), nn.Linear)]
    if not names and run.fp8_names:
        raise ValueError(f"every FP8 layer of {run.run_dir} is a transformers Conv1D (GPT-2); FP8 weight exports hold "
                         "nn.Linear weights only (compressed-tensors quantizes nn.Linear), so there is nothing to "
                         f"export in FP8. Write the dense Hugging Face folder instead, which transformers and vLLM "
                         f"load as GPT-2: fp8train export {run.run_dir} --format hf --out DIR")
    if not names:
        raise ValueError(f"the layer policy of {run.run_dir}/config.yaml keeps every Linear out of FP8 (policy.* "
                         "keys); nothing to export in FP8")
    return names


def package_version() -> str:
    return __version__  # defined once, in fp8train/__init__.py (pyproject's version, as installed)


def fp8_policy_names(model: nn.Module, cfg) -> list[str]:
    """Names of the Linears that the run's recipe and layer policy convert to FP8 (a dry run: ``model`` is
    not changed). A bf16 run (recipe none) reports what its policy would convert."""
    run_recipe = cfg.fp8.to_recipe()  # a bf16 run's: the default preset's
    report = convert_to_fp8(model, run_recipe.replace(backend="emulated"), layer_policy_from_config(cfg),
                            dry_run=True)
    return [name for name, _ in report.converted]


def load_run(run_dir, log=None, tokenizer: str | None = None) -> LoadedRun:
    """The newest valid checkpoint of ``run_dir`` in the plain model rebuilt from its config.yaml. ``tokenizer``:
    the tokenizer folder of a Hugging Face folder that holds none (a Trainer checkpoint); a run has its own."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run directory {str(run_dir)!r} does not exist")
    config_file = run_dir / "config.yaml"
    if not config_file.is_file() and (run_dir / "config.json").is_file():
        return _load_hf_folder(run_dir, tokenizer)
    if tokenizer:
        raise ValueError(f"--tokenizer applies to a Hugging Face folder (e.g. a Trainer checkpoint); the run "
                         f"directory {str(run_dir)!r} tokenizes with its own (data.tokenizer in its config.yaml)")
    if not config_file.is_file():
        raise ValueError(f"run directory {str(run_dir)!r} has no config.yaml (is it a run made by fp8train train?) "
                         "and no config.json (a Hugging Face folder)")
    cfg = load_config(str(config_file))
    # either format: DDP's model.safetensors or train.parallel=fsdp2's per-rank shards
    skipped = []  # why each newer checkpoint was passed over (damaged, incomplete): said if none is left

    def passed_over(message: str) -> None:
        skipped.append(message)
        if log is not None:
            log(message)

    ckpt = latest_loadable_checkpoint(run_dir / "checkpoints", log=passed_over)
    if ckpt is None:
        why = f": {' '.join(skipped[0].split())}" if skipped else ""
        raise ValueError(f"run directory {str(run_dir)!r} has no valid checkpoint under checkpoints/{why} (train "
                         "with checkpoint.save_final=true, or check the run finished)")
    manifest = json.loads((ckpt / MANIFEST).read_text())  # verified by latest_loadable_checkpoint
    _check_origin(ckpt, manifest, cfg, config_file)
    torch.manual_seed(0)  # the values are overwritten below; this only keeps construction deterministic
    model = build_model(cfg.model, load_weights=False)
    fp8_names = fp8_policy_names(model, cfg)
    state = read_model_state(ckpt)
    _load_master_weights(model, state, fp8_names, ckpt)
    model.eval()
    return LoadedRun(model, cfg, run_dir, ckpt, int(manifest["step"]), fp8_names)


def _check_origin(ckpt: Path, manifest: dict, cfg, config_file: Path) -> None:
    """The checkpoint was written by a run of this config.yaml, as a resume requires: its manifest's resume_hash
    is the config's (on the data the manifest records). A checkpoint folder copied from another run, or a
    config.yaml edited after training, would otherwise export or evaluate weights that are not this run's, or
    under another model's settings."""
    extra = manifest.get("extra") or {}
    saved = extra.get("resume_hash")
    if saved is not None and saved != resume_hash(cfg, extra.get("data_fingerprint")):
        raise ValueError(f"checkpoint {ckpt} was not written by a run of {config_file} (its manifest's resume_hash "
                         f"{str(saved)[:12]} is another config's: the checkpoint was copied from another run, or "
                         "config.yaml was edited after training); restore the run's own config.yaml or checkpoint "
                         "(nothing was written)")


def _load_hf_folder(folder: Path, tokenizer: str | None) -> LoadedRun:
    config = read_json(folder / "config.json")  # a damaged or non-object config.json: one line naming it
    if not tokenizer and not has_tokenizer(folder):
        raise ValueError(f"{str(folder)!r} holds no tokenizer files (a Trainer saves none unless given "
                         "processing_class=tokenizer); name the model's tokenizer folder: export --tokenizer PATH "
                         "(or copy the tokenizer's files into the folder)")
    max_pos = config.get("max_position_embeddings") or config.get("n_positions") or 128
    cfg = load_config(None, [f"model.hf_path={folder}", f"model.seq_len={min(128, int(max_pos))}",
                             *([f"data.tokenizer={tokenizer}"] if tokenizer else [])])
    model = build_model(cfg.model).eval()  # its weights, checked (fp8train.training.models.hf)
    trainer_state = folder / "trainer_state.json"  # a Trainer checkpoint says its step; another folder is step 0
    step = int(read_json(trainer_state).get("global_step") or 0) if trainer_state.is_file() else 0
    return LoadedRun(model, cfg, folder, folder, step, _recorded_fp8_names(model, config, folder)
                     or fp8_policy_names(model, cfg))


def _recorded_fp8_names(model: nn.Module, config: dict, folder: Path) -> list[str]:
    """The FP8 layers a converted model recorded in its config.json (nn/fp8_record.py: a save of a model that
    convert_to_fp8 converted, e.g. a Trainer checkpoint), as names of the run's model; [] when none."""
    recorded = list(((config.get(FP8_RECORD_KEY) or {}).get("layers") or {}))
    prefix = getattr(model, "wrapped_name_prefix", "")
    names = [prefix + name for name in recorded]
    linear_names = {n for n, m in model.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)}
    unknown = [n for n in names if n not in linear_names]
    if unknown:
        raise ValueError(f"{str(folder)!r}: config.json records FP8 layer {unknown[0][len(prefix):]!r}, which is no "
                         "Linear of the model it describes")
    return names


def _load_master_weights(model: nn.Module, state: dict, fp8_names: list, ckpt: Path) -> None:
    expected = model.state_dict()
    converted = set(fp8_names)
    for name in fp8_names:  # an older checkpoint's Conv1D-born Fp8Linear weight, in the (out, in) layout
        module, key = model.get_submodule(name), f"{name}.weight"
        if is_conv1d(module) and key in state and module.nx != module.nf \
                and tuple(state[key].shape) == (module.nf, module.nx):
            state[key] = state[key].t().contiguous()
    extra = [k for k in state if k not in expected]
    # an FP8 layer's scaling buffers: `{layer}.{role}_*`, or `{layer}.scaling.{role}_*` for an Fp8GroupedLinear
    owner_of = lambda k: k.rpartition(".")[0].removesuffix(".scaling")  # noqa: E731
    foreign = [k for k in extra
               if not (owner_of(k) in converted and k.rpartition(".")[2].startswith(tuple(f"{r}_" for r in ROLES)))]
    # A tied tensor is stored once under one of its names (safetensors' save_model): any of them will do.
    names_of = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(key)
    shared = {key: names for names in names_of.values() for key in names}
    missing = [k for k in expected if not any(name in state for name in shared[k])]
    if foreign or missing:
        raise ValueError(f"checkpoint {ckpt} does not fit the model of its run's config.yaml: missing {missing}, "
                         f"unexpected {foreign}")
    kept = {k: v for k, v in state.items() if k in expected}
    model.load_state_dict(kept, strict=False)


def tied_aliases(model: nn.Module) -> set[str]:
    """state_dict names that are a second name of a tensor already listed (tied embeddings)."""
    return {name for group in tied_weight_groups(model) for name in group[1:]}


def kv_shape(run: LoadedRun) -> dict:
    """n_layers, n_kv_heads, head_dim of the run's model (what its KV cache holds per token)."""
    if isinstance(run.model, HFCausalLM):
        return hf_kv_shape(run.model.hf)
    m = run.cfg.model
    return {"n_layers": m.n_layers, "n_kv_heads": m.kv_heads(), "head_dim": m.d_model // m.n_heads}
