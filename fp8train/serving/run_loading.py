"""A finished run, loaded once for serving-side work (export, kv-eval).

Which model: the newest valid checkpoint of RUN_DIR, in the plain model rebuilt from RUN_DIR/config.yaml (built
once: a Hugging Face run's architecture comes from its config.json, its pretrained weights are not read, the
checkpoint is). A run trained in FP8 is loaded into the plain model by name: its Fp8Linear layers keep their
fp32 master weights under the same names as nn.Linear (`layers.0.attn.q_proj.weight`), and the FP8 scaling
buffers they add (`*_amax_history`, `*_scale`, `*_nonfinite_amax_count`, ...) are training state, dropped after
checking that they belong to layers the run's policy converted. A GPT-2 Conv1D layer trained as Fp8Linear is
checkpointed in Conv1D's (in, out) layout (Fp8Linear's state_dict) and loads as it is. Anything else missing or
unexpected (a shape included) is an error.

A Hugging Face folder (config.json and safetensors weights, e.g. a dense export) is loaded too, as the run a
default config with `model.hf_path` set to it would start from (step 0; model.seq_len = min(128, its maximum
positions); data: the built-in corpus with the folder's own tokenizer, the one `--tokenizer` names (a Trainer
checkpoint holds none), or bytes for fp8train's dense export of a byte-level run, which has none), so export and
kv-eval take either. Its FP8 layers are the ones config.json records when a converted model was saved
(`convert_to_fp8` recorded them: nn/fp8_record.py), else its default policy's.

A live run (still training, pruning with checkpoint.keep_last) is read at one checkpoint: the newest that
verifies, read whole into memory once; every later step of export or kv-eval uses that copy (a LoadedRun is
passed on, never the run folder read again). A checkpoint the run prunes while it is being read is reported as
pruned (not as damaged) and the newest one is read instead, up to PRUNED_RETRIES times.

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
from fp8train.nn.hf_experts import SCALING_SUFFIX, expert_projections, is_hf_experts
from fp8train.nn.recipes import ROLES
from fp8train.training.data.corpus import BYTE_VOCAB
from fp8train.training.data.tokenized import has_tokenizer
from fp8train.training.runs.checkpoint import MANIFEST, checkpoint_step, list_checkpoints
from fp8train.training.runs.sharded_checkpoint import latest_loadable_checkpoint, read_model_state
from fp8train.training.config import layer_policy_from_config, load_config
from fp8train.serving.kv_hooks import hf_kv_shape
from fp8train.training.models.decoder import build_model, tied_weight_groups
from fp8train.training.models.hf import HFCausalLM
from fp8train.training.runs.resume import resume_hash
from fp8train.training.storage.files import read_json

__all__ = ["LoadedRun", "load_run", "loaded_run", "source_dir", "PRUNED_RETRIES", "fp8_policy_names", "fp8_linear_names", "tied_aliases", "package_version", "kv_shape"]


@dataclass
class LoadedRun:
    model: nn.Module  # fp32 master weights, eval mode, plain nn.Linear (or Conv1D) everywhere
    cfg: object  # FullConfig from RUN_DIR/config.yaml
    run_dir: Path
    checkpoint: Path
    step: int
    fp8_names: list  # Linears the run's layer policy puts in FP8


PRUNED_RETRIES = 5  # a run saving every step with keep_last=1 prunes each checkpoint about a step after writing it


def loaded_run(run, tokenizer: str | None = None) -> LoadedRun:
    """``run`` itself when already loaded, else ``load_run(run, tokenizer=tokenizer)``: one reading of a source,
    passed on."""
    return run if isinstance(run, LoadedRun) else load_run(run, tokenizer=tokenizer)


def source_dir(run) -> Path:
    """The folder of ``run`` (a LoadedRun or a path): what an output must never overwrite."""
    return run.run_dir if isinstance(run, LoadedRun) else Path(run)


def fp8_linear_names(run: LoadedRun, experts_exported: bool = False) -> list[str]:
    """The run's FP8 layers that serving formats can hold: nn.Linear ones (a GPT-2 Conv1D trained in FP8 is
    exported in high precision). Refuses a run left with none, saying why, unless `experts_exported` (the
    folder export, which writes FP8 experts too) and the run has FP8 experts."""
    modules = dict(run.model.named_modules())  # (an FP8 experts projection is a Parameter, not a module)
    names = [n for n in run.fp8_names if isinstance(modules.get(n), nn.Linear)]
    if not names and any(n not in modules for n in run.fp8_names):
        if experts_exported:
            return names
        raise ValueError(f"the FP8 weights of {run.run_dir} are all experts, which this single-file format does not "
                         f"hold (FP8 Linears only); the folder export writes them: fp8train export {run.run_dir} "
                         "--format e4m3fn --out DIR")
    if not names and any(n in modules for n in run.fp8_names):
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
    if not config_file.is_file() and (run_dir / "plan.json").is_file():  # evidence.pairs.PLAN_FILE
        runs = sorted(p.parent for p in run_dir.glob("runs/*/*/config.yaml"))
        raise ValueError(f"{str(run_dir)!r} is a validation directory (plan.json), not a run: give one of its runs"
                         + (f", e.g. {runs[0]}" if runs else ""))
    if not config_file.is_file():
        raise ValueError(f"run directory {str(run_dir)!r} has no config.yaml (is it a run made by fp8train train?) "
                         "and no config.json (a Hugging Face folder)")
    cfg = load_config(str(config_file))
    pruned = []  # checkpoints the live run deleted while this process read them
    for _ in range(PRUNED_RETRIES):
        read = _read_newest(run_dir, cfg, config_file, pruned, log)
        if read is not None:
            ckpt, manifest, state = read
            break
    else:
        raise ValueError(f"every checkpoint of {str(run_dir)!r} this process chose was pruned while it was read "
                         f"({', '.join(p.name for p in pruned)}): the run is still training and deletes them "
                         "(checkpoint.keep_last); export or evaluate it when it has finished, or train with a "
                         "larger checkpoint.keep_last (nothing was written)")
    torch.manual_seed(0)  # the values are overwritten below; this only keeps construction deterministic
    model = build_model(cfg.model, load_weights=False)
    fp8_names = fp8_policy_names(model, cfg)
    _load_master_weights(model, state, fp8_names, ckpt)
    model.eval()
    return LoadedRun(model, cfg, run_dir, ckpt, int(manifest["step"]), fp8_names)


def _read_newest(run_dir: Path, cfg, config_file: Path, pruned: list, log):
    """(checkpoint, manifest, model state) of the newest checkpoint that verifies, read whole; None when the one
    chosen was pruned while being read (added to ``pruned``: try again with the newest)."""
    skipped = []  # why each newer checkpoint was passed over (damaged, incomplete): said if none is left
    said = []  # every line on the checkpoints passed over: logged when one is read, else the error says why
    listed = list_checkpoints(run_dir / "checkpoints")
    keep_last = cfg.checkpoint.keep_last

    def was_pruned(path: Path) -> bool:
        return _was_pruned(path, keep_last)

    def passed_over(message: str) -> None:
        path = next((p for p in listed if message.startswith(f"skipping checkpoint {p}:")), None)
        if path is not None and was_pruned(path):  # complete when listed, deleted by the run since: not damaged
            message = f"checkpoint {path} was pruned by the run while it was checked; reading a newer one"
        else:
            skipped.append(message)
        said.append(message)

    # either format: DDP's model.safetensors or train.parallel=fsdp2's per-rank shards
    try:
        ckpt = latest_loadable_checkpoint(run_dir / "checkpoints", log=passed_over)
    except OSError:  # a file that verification had listed was deleted under it
        if not any(was_pruned(path) for path in listed):
            raise
        ckpt = None
    if log is not None and (ckpt is not None or any(was_pruned(path) for path in listed)):
        for message in said:
            log(message)
    if ckpt is None:
        if any(was_pruned(path) for path in listed):
            pruned += [path for path in listed if was_pruned(path)]
            return None  # those passed over were deleted while checked: the run wrote newer ones
        why = f": {' '.join(skipped[0].split())}" if skipped else ""
        raise ValueError(f"run directory {str(run_dir)!r} has no valid checkpoint under checkpoints/{why} (train "
                         "with checkpoint.save_final=true, or check the run finished)")
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())  # verified by latest_loadable_checkpoint
        _check_origin(ckpt, manifest, cfg, config_file)
        return ckpt, manifest, read_model_state(ckpt)  # verified again, then read into memory
    except (OSError, ValueError) as err:
        if not was_pruned(ckpt):
            raise
        if log is not None:
            log(f"checkpoint {ckpt} was pruned by the run while it was read ({type(err).__name__}); reading the "
                "newest one instead")
        pruned.append(ckpt)
        return None


def _was_pruned(ckpt: Path, keep_last: int) -> bool:
    """``ckpt`` failed because the run's rotation (checkpoint.keep_last) deleted it: it is gone or going
    (shutil.rmtree), the run prunes at all, and ``keep_last`` newer checkpoints with their manifests exist, as
    rotation leaves them (it removes an old one only after saving a new one). Anything else missing (every
    manifest removed by hand, a run that keeps all) was deleted, and is said so, never "pruned"."""
    if keep_last <= 0 or not _partly_deleted(ckpt):
        return False
    newer = [other for other in list_checkpoints(ckpt.parent)
             if checkpoint_step(other) > checkpoint_step(ckpt) and (other / MANIFEST).is_file()]
    return len(newer) >= keep_last


def _partly_deleted(ckpt: Path) -> bool:
    """The folder, its manifest or a file the manifest lists is gone (rmtree removes them one by one)."""
    try:
        files = json.loads((ckpt / MANIFEST).read_text())["files"]
        return any(not (ckpt / str(name)).exists() for name in files)
    except (OSError, ValueError, KeyError, TypeError):
        return True


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
    byte_level_export = isinstance(config.get("fp8train_export"), dict) and config.get("vocab_size") == BYTE_VOCAB
    if not tokenizer and not has_tokenizer(folder) and not byte_level_export:
        raise ValueError(f"{str(folder)!r} holds no tokenizer files (a Trainer saves none unless given "
                         "processing_class=tokenizer); name the model's tokenizer folder: export --tokenizer PATH "
                         "(or copy the tokenizer's files into the folder)")
    max_pos = config.get("max_position_embeddings") or config.get("n_positions") or 128
    overrides = [f"model.hf_path={folder}", f"model.seq_len={min(128, int(max_pos))}"]
    if tokenizer:
        overrides.append(f"data.tokenizer={tokenizer}")
    elif not has_tokenizer(folder) and byte_level_export:
        # fp8train's dense export copies the run's tokenizer; without one the run was byte-level
        overrides.append("data.tokenizer=bytes")
    cfg = load_config(None, overrides)
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
    # FP8 experts projections (`...experts.gate_up_proj`: 3-D Parameters of an experts module), recorded apart
    experts = [prefix + name for name in ((config.get(FP8_RECORD_KEY) or {}).get("experts") or [])]
    modules = dict(model.named_modules())
    for name in experts:
        owner, _, param = name.rpartition(".")
        if owner not in modules or not is_hf_experts(modules[owner]) or param not in expert_projections(modules[owner]):
            raise ValueError(f"{str(folder)!r}: config.json records FP8 experts {name[len(prefix):]!r}, which is no "
                             "experts projection of the model it describes")
    return names + experts


def _load_master_weights(model: nn.Module, state: dict, fp8_names: list, ckpt: Path) -> None:
    expected = model.state_dict()
    # an FP8 experts projection `...experts.gate_up_proj` keeps its scaling state under `...gate_up_proj_fp8.`
    converted = set(fp8_names) | {name + SCALING_SUFFIX for name in fp8_names}
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
