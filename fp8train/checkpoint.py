"""Checkpoints: safetensors for tensors, one small JSON manifest, no pickle.

Layout of one checkpoint, ``<run>/checkpoints/step_000120/``:

    model.safetensors      model state_dict, FP8 scaling state included (it lives in module buffers)
    optimizer.safetensors  AdamW moments and step counts, keyed ``state.<param index>.<name>``
    manifest.json          step, scheduler and RNG state, optimizer hyper-parameters, and the size and sha256 of
                           each file: a checkpoint whose files do not match its manifest is not loaded

A checkpoint is written into a hidden ``.tmp-*`` folder and renamed into place, so a job killed mid-write
leaves either the whole checkpoint or none of it; loading walks from the newest to the oldest and skips (with
a message naming it) any that is incomplete, truncated or corrupt.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

MANIFEST = "manifest.json"
_PREFIX = "step_"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict, list]:
    state = optimizer.state_dict()
    tensors = {}
    for index, param_state in state["state"].items():
        for key, value in param_state.items():
            tensors[f"state.{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    return tensors, state["param_groups"]


def _optimizer_state(tensors: dict, param_groups: list) -> dict:
    state: dict = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    return {"state": state, "param_groups": param_groups}


def save_checkpoint(ckpt_dir: str | Path, step: int, model: torch.nn.Module, optimizer, scheduler=None,
                    extra: dict | None = None, keep_last: int = 3) -> Path:
    """Write checkpoint ``step`` atomically and prune all but the newest ``keep_last``."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    final = ckpt_dir / f"{_PREFIX}{step:06d}"
    tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()

    # save_model handles tied (shared) weights, which plain save_file refuses.
    save_model(model, str(tmp / "model.safetensors"))
    opt_tensors, param_groups = _optimizer_tensors(optimizer)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    manifest = {
        "step": step,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "optimizer_param_groups": param_groups,
        "torch_rng_state": torch.get_rng_state().tolist(),
        "extra": extra or {},
        "files": {},
    }
    for name in ("model.safetensors", "optimizer.safetensors"):
        path = tmp / name
        manifest["files"][name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for path in tmp.iterdir():  # data on disk before the rename makes the checkpoint visible
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():  # re-saving the same step (e.g. after a resume) replaces it whole
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(ckpt_dir)
    for old in list_checkpoints(ckpt_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint folders, oldest first (temporary folders are ignored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def verify_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint's files match its manifest, else what is wrong."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (incomplete write)"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"unreadable manifest.json ({err})"
    for name, expected in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"missing {name}"
        if file.stat().st_size != expected["bytes"]:
            return f"{name} is {file.stat().st_size} bytes, manifest says {expected['bytes']} (truncated?)"
        if _sha256(file) != expected["sha256"]:
            return f"{name} checksum mismatch (corrupt)"
    return None


def latest_valid_checkpoint(ckpt_dir: str | Path, log=print) -> Path | None:
    """The newest checkpoint that verifies; broken ones are named and skipped."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log(f"skipping checkpoint {path}: {problem}")
    return None


def load_checkpoint(path: str | Path, model: torch.nn.Module, optimizer=None, scheduler=None) -> dict:
    """Load a verified checkpoint into ``model`` (and optimizer/scheduler); returns its manifest."""
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} cannot be loaded: {problem}")
    manifest = json.loads((path / MANIFEST).read_text())
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    if unexpected or [m for m in missing if not _is_tied_alias(model, m)]:
        raise ValueError(f"checkpoint {path} does not fit this model: missing {missing}, unexpected {unexpected}"
                         " (was it made with another model size or FP8 recipe?)")
    if optimizer is not None:
        tensors = load_file(str(path / "optimizer.safetensors"))
        optimizer.load_state_dict(_optimizer_state(tensors, manifest["optimizer_param_groups"]))
    if scheduler is not None and manifest.get("scheduler") is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    if manifest.get("torch_rng_state") is not None:
        torch.set_rng_state(torch.tensor(manifest["torch_rng_state"], dtype=torch.uint8))
    return manifest


def _is_tied_alias(model: torch.nn.Module, name: str) -> bool:
    # safetensors' save_model stores one copy of tied tensors; the alias shows up as "missing" on load.
    params = dict(model.named_parameters(remove_duplicate=False))
    tensor = params.get(name)
    return tensor is not None and sum(p is tensor for p in params.values()) > 1


def load_model_weights(path: str | Path, model: torch.nn.Module) -> dict:
    """Weights only (for evaluation/export): the model part of a verified checkpoint."""
    return load_checkpoint(path, model)


