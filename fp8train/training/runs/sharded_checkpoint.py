"""Sharded checkpoints (train.parallel=fsdp2): every rank writes its own shard, in safetensors, never pickle.

Layout of one checkpoint, ``<run>/checkpoints/step_000120/``:

    shard-00001-model-00001-of-00001.safetensors   rank 0's shards of the weights, gradients' AdamW moments, ...
    shard-00002-model-00001-of-00001.safetensors   rank 1's (one file per rank that holds anything)
    manifest.json    step, world size, scheduler, RNG, optimizer hyper-parameters, every tensor's global shape,
                     each shard file's size and sha256, and a sha256 of the manifest itself (`manifest_sha256`)
    COMPLETE         written last: a checkpoint without it is never loaded

The format is torch.distributed.checkpoint (DCP) with its Hugging Face storage writer and reader
(`HuggingFaceStorageWriter(save_distributed=True)` / `HuggingFaceStorageReader`, torch >= 2.8). Why that one:
DCP's default FileSystemWriter keeps its global metadata (`.metadata`) as a pickle, and a pickle runs code when
it is loaded; the HF writer stores each rank's tensors as plain safetensors with the offset of every shard in
the file's own header, and the reader rebuilds DCP's metadata from those headers, so nothing is unpickled. DCP
then reshards on load: a checkpoint written by 2 ranks loads into 1 (or 1 into 2), each rank reading only the
slices it owns. Replicated tensors (the FP8 scaling buffers, AdamW's step counts) are stored once.
Non-tensor state (scheduler, RNG, optimizer hyper-parameters) goes in manifest.json, as in the DDP format.

Writing is atomic at the folder level, like checkpoint.py: all ranks write into ``.tmp-step_000120``; after
every rank's shard is on disk, rank 0 writes the manifest (with every rank's shard checksums), then COMPLETE,
then renames the folder into place. A rank killed mid-save leaves only the temporary folder (removed by the next
save); the previous checkpoint is untouched. Checkpoints must be on a file system every rank can see.

The rules are the DDP format's, through checkpoint.py's own functions: a checkpoint verifies only when its
manifest matches its own checksum and its step is the step in the folder's name (a folder renamed to another
step, its manifest edited to match or not, is skipped, never resumed at the wrong step), and its shards match
the manifest; pruning (`checkpoint.keep_last`) counts only checkpoints that verify and never removes the one the
run resumed from, so a corrupt newer folder never pushes out good ones.

For export and kv-eval, in one process: `latest_loadable_checkpoint(ckpt_dir)` finds the newest checkpoint of
either format, `read_model_state(path)` returns its full model state dict (what the DDP format's
model.safetensors holds); `load_sharded_checkpoint(path, model)` loads a sharded one into a plain model too.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_state_dict)

from safetensors.torch import load_file

from fp8train.nn.fp8_all_gather import unwrap_fp8_all_gather
from fp8train.training.runs.checkpoint import (MANIFEST, file_record, files_problem, latest_valid_checkpoint,
                                          manifest_problem, prune_checkpoints,
                                          remove_leftovers, seal_manifest, swap_into_place, verify_checkpoint)
from fp8train.training.storage.files import dumps, write_json_atomic, write_text_atomic

__all__ = ["SHARDED_FORMAT", "COMPLETE_MARKER", "is_sharded_checkpoint", "save_sharded_checkpoint",
           "verify_sharded_checkpoint", "verify_any_checkpoint", "load_sharded_checkpoint", "read_model_state",
           "latest_loadable_checkpoint", "MissingShardError"]

SHARDED_FORMAT = "fp8train-dcp-safetensors-1"
COMPLETE_MARKER = "COMPLETE"
_SHARD_SUFFIX = ".safetensors"
_MODEL, _OPTIM = "model.", "optim."  # key prefixes inside the shards


class MissingShardError(ValueError):
    """A checkpoint marked complete lacks a shard file: not a crash leftover (that has no marker) but lost data,
    or ranks writing to disks that are not shared. Never silently skipped for an older checkpoint."""


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_sharded_checkpoint(path: str | Path) -> bool:
    """True for a folder in this format (judged by its manifest, or by shard files when it has none)."""
    path = Path(path)
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == SHARDED_FORMAT
    except (OSError, ValueError, AttributeError):
        return path.is_dir() and any(p.name.startswith("shard-") for p in path.iterdir())


# ------------------------------------------------------------------------------------------------------------
# State dicts: flat {name: tensor}, tensors only (what the safetensors shards hold)
# ------------------------------------------------------------------------------------------------------------
def _flat_state(model, optimizer) -> tuple[dict, dict, dict]:
    """(flat tensors, model state dict, optimizer state dict) with the FSDP2 shards as DTensors; an
    FP8-all-gather weight is stored as its plain fp32 tensor (same storage, so loading writes into it)."""
    model_sd = get_model_state_dict(model)
    optim_sd = get_optimizer_state_dict(model, optimizer) if optimizer is not None else None
    model_sd = {k: unwrap_fp8_all_gather(v) for k, v in model_sd.items()}
    flat = {_MODEL + k: v for k, v in model_sd.items()}
    if optim_sd is not None:
        for fqn, state in optim_sd["state"].items():
            flat.update({f"{_OPTIM}{fqn}.{key}": value for key, value in state.items()
                         if isinstance(value, torch.Tensor)})
    return flat, model_sd, optim_sd


def _global_shapes(flat: dict) -> dict:
    return {name: list(t.shape) for name, t in flat.items()}


def _dtypes(flat: dict) -> dict:
    return {name: str(t.dtype).removeprefix("torch.") for name, t in flat.items()}


# ------------------------------------------------------------------------------------------------------------
# Save
# ------------------------------------------------------------------------------------------------------------
def save_sharded_checkpoint(ckpt_dir: str | Path, step: int, model, optimizer, scheduler=None,
                            extra: dict | None = None, keep_last: int = 3, protect=(), log=None) -> Path:
    """Every rank writes its shard of checkpoint ``step``; rank 0 seals it (manifest, COMPLETE, rename) and
    prunes to the newest ``keep_last`` that verify, never removing one in ``protect`` (the one the run resumed
    from). Collective: every rank must call it."""
    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f".tmp-{final.name}"  # one name for every rank (not per-pid as in the DDP format)
    if _rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        remove_leftovers(ckpt_dir)  # half-written folders of a save that was killed
        tmp.mkdir()
    _barrier()

    flat, _, optim_sd = _flat_state(model, optimizer)
    dcp.save(flat, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp), save_distributed=True))
    mine = {p.name: file_record(p) for p in tmp.glob(f"shard-{_rank() + 1:05d}-*{_SHARD_SUFFIX}")}
    for path in tmp.glob(f"shard-{_rank() + 1:05d}-*{_SHARD_SUFFIX}"):
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    shards = [mine]
    if _distributed():
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, mine)  # file names and checksums only (small Python objects)

    if _rank() == 0:
        files = {name: info for rank_files in shards for name, info in rank_files.items()}
        unseen = [name for name in files if not (tmp / name).is_file()]
        if unseen:
            raise RuntimeError(f"rank 0 cannot see shard(s) {', '.join(unseen)} that other ranks wrote under "
                               f"{tmp}: checkpoints need a file system shared by every rank")
        manifest = {
            "format": SHARDED_FORMAT, "step": step,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "optimizer_param_groups": optim_sd["param_groups"] if optim_sd is not None else None,
            "torch_rng_state": torch.get_rng_state().tolist(),
            "extra": extra or {}, "tensors": _global_shapes(flat), "dtypes": _dtypes(flat), "files": files,
        }
        # Plain dumps, not write_json_atomic: its non-finite marking would add a field after the checksum.
        write_text_atomic(tmp / MANIFEST, dumps(seal_manifest(manifest), indent=1))
        write_json_atomic(tmp / COMPLETE_MARKER, {"step": step})  # last: marks the checkpoint whole
        swap_into_place(tmp, final)
        prune_checkpoints(ckpt_dir, keep_last, protect=[final, *protect], log=log, verify=_counts_for_pruning)
    _barrier()
    return final


def _counts_for_pruning(path: Path) -> str | None:
    """verify_any_checkpoint, with a missing shard as one more reason not to count a checkpoint (it is left in
    place, as every checkpoint that does not verify is)."""
    try:
        return verify_any_checkpoint(path)
    except MissingShardError as err:
        return str(err)


# ------------------------------------------------------------------------------------------------------------
# Verify and find
# ------------------------------------------------------------------------------------------------------------
def verify_sharded_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint is complete and its shards match the manifest, else what is wrong. A shard
    that is missing from a completed checkpoint raises MissingShardError instead (see the class)."""
    path = Path(path)
    if not (path / COMPLETE_MARKER).is_file():
        return f"no {COMPLETE_MARKER} marker (the save did not finish)"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = {name: (int(v["bytes"]), str(v["sha256"])) for name, v in manifest["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"unreadable {MANIFEST} ({type(err).__name__}: {err})"
    if manifest.get("format") != SHARDED_FORMAT:
        return f"{MANIFEST} is not a sharded checkpoint ({SHARDED_FORMAT})"
    problem = manifest_problem(path, manifest)  # its own checksum, and the step in the folder's name
    if problem is not None:
        return problem
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        raise MissingShardError(f"sharded checkpoint {path} is missing shard file(s) {', '.join(missing)} of "
                                f"{len(files)} (written by another rank: was it on a disk this process cannot "
                                "see?); nothing was loaded")
    return files_problem(path, files)


def verify_any_checkpoint(path: str | Path) -> str | None:
    """verify_sharded_checkpoint or verify_checkpoint, whichever format the folder is in."""
    return verify_sharded_checkpoint(path) if is_sharded_checkpoint(path) else verify_checkpoint(path)


def latest_loadable_checkpoint(ckpt_dir: str | Path, log=print) -> Path | None:
    """The newest checkpoint of either format (DDP's single-file or this sharded one) that verifies."""
    return latest_valid_checkpoint(ckpt_dir, log=log, verify=verify_any_checkpoint)


# ------------------------------------------------------------------------------------------------------------
# Load
# ------------------------------------------------------------------------------------------------------------
def _check_fits(path: Path, saved: dict, flat: dict) -> None:
    """Same tensor names and global shapes, or a ValueError naming the first difference."""
    here = _global_shapes(flat)
    for name in sorted(set(saved) | set(here)):
        if saved.get(name) != here.get(name):
            there = "absent" if name not in saved else tuple(saved[name])
            ours = "absent" if name not in here else tuple(here[name])
            raise ValueError(f"checkpoint {path} was saved from a different model or FP8 recipe: "
                             f"{name.split('.', 1)[1]} is {there} there and {ours} here; use the run's own config")


def load_sharded_checkpoint(path: str | Path, model, optimizer=None, scheduler=None) -> dict:
    """Load a verified sharded checkpoint into ``model`` (sharded by FSDP2 with any world size, or plain), and
    the optimizer and scheduler when given; returns its manifest. Collective when distributed."""
    path = Path(path)
    problem = verify_sharded_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} cannot be loaded: {problem}")
    manifest = json.loads((path / MANIFEST).read_text())
    flat, model_sd, optim_sd = _flat_state(model, optimizer)
    saved = manifest["tensors"]
    if optimizer is None:
        saved = {k: v for k, v in saved.items() if k.startswith(_MODEL)}
    _check_fits(path, saved, flat)
    with warnings.catch_warnings():  # one process (export, a 1-rank run): DCP's single-process note is noise
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(str(path)), no_dist=not _distributed())
    model_sd = {k: flat[_MODEL + k] for k in model_sd}
    if optimizer is not None:
        for fqn, state in optim_sd["state"].items():
            for key in state:
                if f"{_OPTIM}{fqn}.{key}" in flat:
                    state[key] = flat[f"{_OPTIM}{fqn}.{key}"]
        optim_sd["param_groups"] = _param_groups(manifest["optimizer_param_groups"], optim_sd["param_groups"])
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        set_model_state_dict(model, model_sd)
    if scheduler is not None and manifest.get("scheduler") is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    if manifest.get("torch_rng_state") is not None:
        torch.set_rng_state(torch.tensor(manifest["torch_rng_state"], dtype=torch.uint8))
    return manifest


def _param_groups(saved: list, current: list) -> list:
    """Saved hyper-parameters over the current groups; JSON turned tuples (betas) into lists."""
    groups = []
    for old, new in zip(saved, current):
        group = dict(new)
        for key, value in old.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(new.get(key), tuple) and isinstance(value, list) else value
        groups.append(group)
    return groups


def read_model_state(path: str | Path) -> dict:
    """The full (unsharded) model state dict of a verified checkpoint of either format, {name: tensor} on the
    CPU, as the DDP format's model.safetensors holds it (FP8 scaling buffers included), in one process: what
    export and kv-eval read. The DDP format stores a tied tensor once; the sharded one under each name."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        problem = verify_checkpoint(path)
        if problem is not None:
            raise ValueError(f"checkpoint {path} cannot be loaded: {problem}")
        return load_file(str(path / "model.safetensors"))
    problem = verify_sharded_checkpoint(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} cannot be loaded: {problem}")
    manifest = json.loads((path / MANIFEST).read_text())
    flat = {name: torch.empty(shape, dtype=getattr(torch, manifest["dtypes"][name]))
            for name, shape in manifest["tensors"].items() if name.startswith(_MODEL)}
    with warnings.catch_warnings():  # one process on purpose: DCP's "assuming a single process" is noise here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(str(path)), no_dist=True)
    return {name[len(_MODEL):]: tensor for name, tensor in flat.items()}
