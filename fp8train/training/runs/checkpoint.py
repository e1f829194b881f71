"""Checkpoints: safetensors for tensors, one small JSON manifest, no pickle.

Layout of one checkpoint, ``<run>/checkpoints/step_000120/``:

    model.safetensors      model state_dict, FP8 scaling state included (it lives in module buffers)
    optimizer.safetensors  AdamW moments and step counts, keyed ``state.<param index>.<name>``
    manifest.json          step, scheduler and RNG state, optimizer hyper-parameters, the size and sha256 of
                           each file, and a sha256 of the manifest itself (`manifest_sha256`): a checkpoint whose
                           files do not match its manifest, whose manifest does not match its own checksum, or
                           whose manifest step is not the step in its folder name, does not verify

A checkpoint is written into a hidden ``.tmp-*`` folder and renamed into place, so a job killed mid-write
leaves either the whole checkpoint or none of it (the leftover ``.tmp-*`` folder is removed by the next save);
loading walks from the newest to the oldest and skips (with a message naming it) any that is incomplete,
truncated or corrupt. Pruning (`checkpoint.keep_last`) counts only checkpoints that verify, and never removes the
checkpoint a run resumed from: a corrupt newer checkpoint can never push the good ones out. A write that fails
(full disk, read-only or forbidden folder) removes its temporary folder and leaves every earlier checkpoint.

The sharded format (train.parallel=fsdp2, sharded_checkpoint.py) follows the same rules through the same
functions: `seal_manifest` / `manifest_problem` (checksum and step), `files_problem` (sizes and sha256),
`swap_into_place` and `remove_leftovers` (the atomic rename), and `prune_checkpoints` with its own `verify`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import load_file, load_model, save_file, save_model

from fp8train.training.data.corpus import describe_fingerprint_change
from fp8train.training.models.decoder import tied_weight_groups
from fp8train.training.storage.files import as_os_error, dumps, give_default_mode, sha256_file

MANIFEST = "manifest.json"
MANIFEST_CHECKSUM = "manifest_sha256"
FILES = ("model.safetensors", "optimizer.safetensors")
_PREFIX = "step_"


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
                    extra: dict | None = None, keep_last: int = 3, protect: Iterable[str | Path] = (),
                    log=None) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep_last`` that verify (0 = keep all),
    never removing a checkpoint in ``protect`` (the one the run resumed from)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    remove_leftovers(ckpt_dir)  # half-written folders of a writer that was killed
    final = ckpt_dir / f"{_PREFIX}{step:06d}"
    tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}"
    try:
        tmp.mkdir()
        _write_files(tmp, step, model, optimizer, scheduler, extra)
    except BaseException:  # ENOSPC, EROFS, EACCES, a kill signal turned exception: leave no temp folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    swap_into_place(tmp, final)
    prune_checkpoints(ckpt_dir, keep_last, protect=[final, *protect], log=log)
    return final


def swap_into_place(tmp: Path, final: Path) -> None:
    """Rename the finished temporary folder `tmp` to `final` and fsync the parent. Re-saving a step (after a
    resume) moves the old folder aside first and deletes it only after the new one is in place."""
    old = None
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_files(tmp: Path, step: int, model, optimizer, scheduler, extra: dict | None) -> None:
    opt_tensors, param_groups = _optimizer_tensors(optimizer)
    try:
        # save_model handles tied (shared) weights, which plain save_file refuses.
        save_model(model, str(tmp / "model.safetensors"))
        save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    except Exception as err:  # a full disk comes back as SafetensorError("... (os error 28)"): make it an OSError
        raise (as_os_error(err, tmp) or err) from err
    manifest = {
        "step": step,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "optimizer_param_groups": param_groups,
        "torch_rng_state": torch.get_rng_state().tolist(),
        "extra": extra or {},
        "files": {},
    }
    for name in FILES:
        path = tmp / name
        give_default_mode(path)
        manifest["files"][name] = file_record(path)
    (tmp / MANIFEST).write_text(dumps(seal_manifest(manifest), indent=1))
    for path in tmp.iterdir():  # data on disk before the rename makes the checkpoint visible
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def file_record(path: Path) -> dict:
    """What a manifest records of one file: its size and sha256."""
    return {"bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest without its own checksum field, over canonical JSON (sorted keys): a manifest
    edited by hand (a step changed from 30 to 35) no longer matches it."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_CHECKSUM}
    return hashlib.sha256(dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal_manifest(manifest: dict) -> dict:
    """The manifest with its own checksum (`manifest_sha256`) added: write this one."""
    return {**manifest, MANIFEST_CHECKSUM: _manifest_digest(manifest)}


def manifest_problem(path: Path, manifest: dict) -> str | None:
    """None when a parsed manifest matches its own checksum and the step in its folder's name, else what is
    wrong: a folder renamed to another step, with or without its manifest's step edited to match, never
    verifies (it would resume at the wrong step)."""
    checksum = manifest.get(MANIFEST_CHECKSUM)
    if checksum is None:
        return f"{MANIFEST} has no {MANIFEST_CHECKSUM} (edited, or not written by this fp8train)"
    if checksum != _manifest_digest(manifest):
        return f"{MANIFEST} does not match its own checksum (edited or corrupt)"
    step = manifest.get("step")
    if type(step) is not int or step != checkpoint_step(path):
        return f"{MANIFEST} says step {step!r}, but the folder is {path.name}"
    return None


def files_problem(path: Path, files: dict) -> str | None:
    """None when every file in `files` ({name: (bytes, sha256)}) is in `path` with that size and checksum."""
    for name, (size, sha256) in files.items():
        file = path / name
        if not file.is_file():
            return f"missing {name}"
        if file.stat().st_size != size:
            return f"{name} is {file.stat().st_size} bytes, manifest says {size} (truncated?)"
        if sha256_file(file) != sha256:
            return f"{name} checksum mismatch (corrupt)"
    return None


def prune_checkpoints(ckpt_dir: str | Path, keep_last: int, protect: Iterable[str | Path] = (), log=None,
                      verify=None) -> list[Path]:
    """Remove all but the newest ``keep_last`` checkpoints THAT VERIFY (`verify(path) -> problem or None`, default
    `verify_checkpoint`; 0 = keep all); checkpoints in ``protect`` are never removed. A checkpoint that does not
    verify is not counted (it cannot be resumed from) and is left in place for inspection; it never costs a good
    one its place. Returns the removed folders."""
    if keep_last <= 0:
        return []
    verify = verify or verify_checkpoint
    protected = {Path(p).resolve() for p in protect}
    good = [p for p in list_checkpoints(ckpt_dir) if verify(p) is None]
    removed = [p for p in good[:-keep_last] if p.resolve() not in protected]
    for stale in removed:
        shutil.rmtree(stale, ignore_errors=True)
        if log is not None:
            log(f"pruned checkpoint {stale} (checkpoint.keep_last={keep_last})")
    return removed


def remove_leftovers(ckpt_dir: Path) -> None:
    """Remove the hidden temporary and moved-aside folders (``.tmp-*``, ``.old-*``) of a save that was killed."""
    for path in ckpt_dir.iterdir():
        if path.is_dir() and path.name.startswith((".tmp-", ".old-")):
            shutil.rmtree(path, ignore_errors=True)


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoint folders, oldest first (temporary folders are ignored)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir()
             if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def checkpoint_step(path: str | Path) -> int:
    """The step in a checkpoint folder's name (step_000120 -> 120)."""
    return int(Path(path).name[len(_PREFIX):])


def verify_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint verifies (manifest matches its own checksum and its folder's step, files match
    the manifest), else what is wrong."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (deleted: fp8train renames a checkpoint into place only once it is whole)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        expected = {name: (int(files[name]["bytes"]), str(files[name]["sha256"])) for name in FILES}
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError,
            AttributeError) as err:
        return f"unreadable manifest.json ({type(err).__name__}: {err})"
    return manifest_problem(path, manifest) or files_problem(path, expected)


def latest_valid_checkpoint(ckpt_dir: str | Path, log=print, verify=None) -> Path | None:
    """The newest checkpoint that verifies (`verify(path) -> problem or None`, default `verify_checkpoint`);
    broken ones are named and skipped."""
    verify = verify or verify_checkpoint
    for path in reversed(list_checkpoints(ckpt_dir)):
        problem = verify(path)
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
    try:  # Fp8Linear refuses non-finite or non-positive scaling state (its load_state_dict pre-hook)
        missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=False)
    except ValueError as err:
        raise ValueError(f"checkpoint {path} cannot be loaded: {err}; delete it to resume from the one "
                         "before") from None
    tied = {name for group in tied_weight_groups(model) for name in group}  # stored once: others show as missing
    if unexpected or [m for m in missing if m not in tied]:
        raise ValueError(f"checkpoint {path} does not fit this model: missing {missing}, unexpected {unexpected}"
                         " (was it made with another model size or FP8 recipe?)")
    if optimizer is not None:
        optimizer.load_state_dict(load_optimizer_files(path, manifest, optimizer))
    if scheduler is not None and manifest.get("scheduler") is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    if manifest.get("torch_rng_state") is not None:
        torch.set_rng_state(torch.tensor(manifest["torch_rng_state"], dtype=torch.uint8))
    return manifest


def load_optimizer_files(path: str | Path, manifest: dict, optimizer) -> dict:
    """The optimizer state_dict a checkpoint holds (optimizer.safetensors and the manifest's param groups), for
    ``optimizer.load_state_dict``."""
    tensors = load_file(str(Path(path) / "optimizer.safetensors"))
    groups = manifest["optimizer_param_groups"]
    for saved, current in zip(groups, optimizer.param_groups):  # JSON turned tuples (betas) into lists
        for key, value in saved.items():
            if isinstance(current.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
    return _optimizer_state(tensors, groups)


def check_checkpoint_origin(path: str | Path, manifest: dict, expected_hash: str, data_fingerprint: dict,
                            data_source: str = "the data", hash_key: str = "config_hash") -> None:
    """Refuse to resume from a checkpoint made on other data or from another config: its manifest's `extra`
    records the data fingerprint and the hash (`hash_key`) of the run that wrote it."""
    extra = manifest.get("extra") or {}
    change = describe_fingerprint_change(extra.get("data_fingerprint"), data_fingerprint, data_source)
    if change is not None:
        raise ValueError(f"cannot resume from {path}: {change}; use a new run.name (nothing was changed)")
    saved = extra.get(hash_key)
    if saved != expected_hash:
        raise ValueError(f"cannot resume from {path}: it was made from a different config ({hash_key} "
                         f"{str(saved)[:12]}, now {expected_hash[:12]}: model, data, optimizer, train or FP8 "
                         "settings differ); resume with the run's own config, or use a new run.name (nothing was "
                         "changed)")
