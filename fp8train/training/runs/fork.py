"""Forking a run (`train.fork_from`): a new run that starts from a checkpoint of another run.

    fp8train train recipes/cpu_validate.yaml run.name=fork train.fork_from=runs/src/checkpoints/step_000200

The forked run counts its own steps from 0 and trains train.max_steps of them, starting from the checkpoint's
weights, AdamW state (moments, step counts, hyper-parameters) and learning-rate schedule: the source run's
schedule goes on from where the checkpoint left it (same peak rate, warmup and decay horizon; past the horizon,
its final rate), as if the source run had gone on. So train.lr and optim.* must be the source run's, and so must
the model (model.*, except model.seq_len). What is random after the fork is the forked run's own: the batches
are a pure function of (train.seed, step) and torch's generator (dropout) is re-seeded with train.seed at the
fork, so two forks with one seed, in bf16 and in FP8, see the same batches in the same order.

FP8 scaling state: fresh (as at step 0 of any FP8 run: the first step scales from its own amax), unless the
checkpoint comes from an FP8 run of the same recipe (the same recipe code) with the same FP8 layers: then its
scaling state (amax histories, scales) is loaded with the weights. `fp8_state_origin` says which.

Everything is checked before the run directory is touched: the checkpoint verifies (its manifest's sizes and
sha256), it is a single-file (DDP) checkpoint, its run's config.yaml is readable, compatible and still the one
that wrote the checkpoint (the manifest's resume_hash, as export checks: an edited config.yaml would record
settings the checkpoint was not trained with). The sha256 of the checkpoint's files is taken just before they
are loaded (`fork_record`): summary.json and every checkpoint of the forked run record it with the path and step,
so what a run started from is on file. A resumed forked run resumes from its own checkpoints and never reads the
source again. A checkpoint deleted under a fork (pruned by its still-training run) is a ValueError saying so.
"""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from fp8train.nn.convert import fp8_layers
from fp8train.training.runs.checkpoint import FILES, MANIFEST, checkpoint_step, load_optimizer_files, verify_checkpoint
from fp8train.training.config import FullConfig, fp8_recipe_from_config, load_config
from fp8train.training.models.decoder import tied_weight_groups
from fp8train.training.runs.resume import config_differences, resume_hash
from fp8train.training.runs.source_status import failed_summary, failure_text
from fp8train.training.storage.files import read_json, sha256_file
from fp8train.training.storage.rundir import CHECKPOINTS_DIR, CONFIG_FILE
from fp8train.training.runs.sharded_checkpoint import is_sharded_checkpoint, latest_loadable_checkpoint

__all__ = ["Fork", "resolve_fork_checkpoint", "checkpoint_sha256", "open_fork", "fp8_state_origin", "load_fork",
           "fork_record", "deleted_message", "source_config_problem"]

_MUST_MATCH = ("model.", "optim.", "train.lr")  # the checkpoint holds them: a different value would be ignored
_MAY_DIFFER = ("model.seq_len",)  # RoPE / learned positions up to the source's length: the weights fit any


@dataclass(frozen=True)
class Fork:
    """The checkpoint a run forks from, its step, its source run's config, and where FP8 state comes from."""

    checkpoint: Path
    step: int
    source_cfg: FullConfig
    fp8_state: str  # "fresh" | "checkpoint"


def deleted_message(key: str, path: str) -> str:
    """Why `path` (as given to `key`) cannot be found: deleted, or, for a relative path, resolved from here."""
    where = Path(path)
    if where.is_absolute():
        return f"{key}={path}: {where} does not exist (deleted?)"
    return (f"{key}={path}: {where.absolute()} does not exist (a relative path, read from {Path.cwd()}: deleted, "
            "or meant from another folder?)")


def resolve_fork_checkpoint(path: str, key: str = "train.fork_from") -> Path:
    """A checkpoint folder as given, or a run directory's newest checkpoint that verifies; ValueError else."""
    try:
        return _resolve(path, key)
    except FileNotFoundError as err:  # removed while it was read (a pruning source run)
        raise ValueError(f"{key}={path}: the checkpoint was deleted while it was read ({err.filename} is gone)"
                         ) from None


def _resolve(path: str, key: str) -> Path:
    where = Path(path)
    if not where.exists():
        raise ValueError(deleted_message(key, path))
    if (where / MANIFEST).is_file() or is_sharded_checkpoint(where):
        checkpoint = where.resolve()  # a link to a checkpoint: the folder it names
        if re.fullmatch(r"step_\d+", checkpoint.name) is None:
            raise ValueError(f"{key}={path}: {checkpoint} is not named step_NNNNNN as fp8train writes checkpoints "
                             "(its manifest's step is checked against the name); give the checkpoint's own folder "
                             "or its run directory")
    elif (where / CHECKPOINTS_DIR).is_dir():
        passed_over: list[str] = []
        checkpoint = latest_loadable_checkpoint(where / CHECKPOINTS_DIR, log=passed_over.append)
        if checkpoint is None:
            raise ValueError(f"{key}={path}: the run directory holds no checkpoint that verifies")
        _say_passed_over(passed_over, checkpoint, key, path)
    else:
        raise ValueError(f"{key}={path}: not a checkpoint folder (with {MANIFEST}) nor a run directory with "
                         f"{CHECKPOINTS_DIR}/")
    if is_sharded_checkpoint(checkpoint):
        raise ValueError(_sharded_refusal(checkpoint, path, key))
    problem = verify_checkpoint(checkpoint)
    if problem is not None and not checkpoint.exists():
        raise ValueError(f"{key}={path}: checkpoint {checkpoint} was deleted while it was read")
    if problem is not None:
        raise ValueError(f"{key}={path}: checkpoint {checkpoint} does not verify: {problem}")
    _refuse_failed_source(checkpoint.resolve(), path, key, given_run=checkpoint.resolve() != where.resolve())
    return checkpoint.resolve()


def _sharded_refusal(checkpoint: Path, path: str, key: str) -> str:
    """Why a sharded checkpoint cannot be forked, naming what sharded it as the checkpoint records it: its
    manifest's parallel and tp_size (checkpoints written before the manifest held them: its run's config.yaml)."""
    manifest = read_json(checkpoint / MANIFEST)
    extra, world = manifest.get("extra") or {}, manifest.get("world_size")
    recorded, where = (extra.get("parallel"), extra.get("tp_size")), "its manifest"
    if recorded[0] is None or recorded[1] is None:
        config_file = checkpoint.parent.parent / CONFIG_FILE
        try:
            source = load_config(str(config_file)).train
            recorded, where = (source.parallel, source.tp_size), str(config_file)
        except (OSError, ValueError):
            recorded = (None, None)
    parallel, tp_size = recorded
    ranks = f"across the {world} processes that wrote it" if isinstance(world, int) and world > 1 else "into per-rank shard files"
    if isinstance(tp_size, int) and tp_size > 1:
        what = (f"a tensor-parallel checkpoint (train.tp_size={tp_size}, train.parallel={parallel}, per {where}): "
                f"its weights are split {ranks}")
    elif parallel == "fsdp2":
        what = f"a sharded (train.parallel=fsdp2, per {where}) checkpoint: its weights are split {ranks}"
    else:
        what = (f"a sharded checkpoint (its weights split {ranks}; written with train.parallel=fsdp2 or "
                "train.tp_size > 1, which neither its manifest nor its run's config.yaml says)")
    return (f"{key}={path}: {checkpoint} is {what}; a fork starts from a single-file checkpoint, written by a run "
            "with train.parallel=ddp and train.tp_size=1 (nothing was written)")


def _skips_in_a_row(checkpoint: Path) -> int:
    """How many steps in a row up to ``checkpoint`` were skipped on non-finite gradients (its manifest's
    consecutive_skips, as the run recorded it when it saved); 0 when not recorded."""
    try:
        count = (read_json(checkpoint / MANIFEST).get("extra") or {}).get("consecutive_skips")
    except (OSError, ValueError):
        return 0
    return count if isinstance(count, int) and count > 0 else 0


def _went_wrong_from(checkpoint: Path, at) -> int | None:
    """The first step of the source's non-finite run when ``checkpoint`` was written at or after it, else None:
    inside a streak of skipped steps (steps step-k+1..step, k its consecutive_skips), or at or after the step it
    diverged at."""
    step, in_a_row = checkpoint_step(checkpoint), _skips_in_a_row(checkpoint)
    if in_a_row:
        return step - in_a_row + 1
    return at if isinstance(at, int) and at <= step else None


def _say_passed_over(messages: list[str], checkpoint: Path, key: str, path: str) -> None:
    """One line on stderr per newer checkpoint that was passed over and is still there (damaged: a checksum
    mismatch, say), naming the one used; one deleted while it was checked (pruned by its run) is not damage."""
    for message in messages:
        skipped = Path(message.removeprefix("skipping checkpoint ").split(": ", 1)[0])
        if skipped.exists():
            print(f"{key}={path}: {message}; using {checkpoint.name}", file=sys.stderr)


def _refuse_failed_source(checkpoint: Path, path: str, key: str, given_run: bool) -> None:
    """A source run that ended diverged or stopped: its run directory is refused (its newest checkpoint is the
    state it went wrong from), and so is one of its checkpoints written at or after the first step of the
    non-finite run that ended it (a fork of it skips every step, bf16 baseline included). A clean checkpoint
    given directly, written before that, is the user's choice."""
    run_dir = checkpoint.parent.parent
    summary = failed_summary(run_dir)
    if summary is None:
        return
    at = summary.get("diverged_at_step")
    bad_from = _went_wrong_from(checkpoint, at)
    if not given_run and bad_from is None:
        return
    # clean: written before the non-finite run began (the newest itself when it was: a run directory is still
    # refused, as export refuses it, but its clean checkpoint given by name is not)
    clean = sorted((p for p in (run_dir / CHECKPOINTS_DIR).glob("step_*") if re.fullmatch(r"step_\d+", p.name)
                    and checkpoint_step(p) <= checkpoint_step(checkpoint) and _went_wrong_from(p, at) is None
                    and (bad_from is None or checkpoint_step(p) < bad_from)), key=checkpoint_step)
    if not isinstance(at, int) and bad_from is None:  # stopped by a guard, at no one step: only the older one is safe
        clean = [p for p in clean if p != checkpoint]
    hint = (f"Its last checkpoint written before its non-finite steps is {clean[-1]} (check its loss): pass "
            f"{key}={clean[-1]}" if clean else "It holds no checkpoint from before that to fork from")
    if bad_from is not None and _skips_in_a_row(checkpoint):
        state = (f"{checkpoint.name} was written after its non-finite steps began at step {bad_from} (every step "
                 f"from {bad_from} to {checkpoint_step(checkpoint)} was skipped)")
    else:
        state = f"{checkpoint.name} is the state it went wrong from"
    raise ValueError(f"{key}={path}: {failure_text(run_dir, summary)}; {state}, and forked runs of it can skip "
                     f"every step on non-finite gradients. {hint}; nothing was written")


def checkpoint_sha256(checkpoint: Path) -> str:
    """sha256 over the checkpoint's files (the manifest and each file's own sha256, in a fixed order); a
    ValueError saying it was deleted when a file is gone."""
    try:
        lines = [f"{name}:{sha256_file(checkpoint / name)}" for name in (MANIFEST, *FILES)]
    except FileNotFoundError as err:
        raise ValueError(f"the fork checkpoint {checkpoint} was deleted ({Path(err.filename or checkpoint).name} "
                         "is gone)") from None
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def fork_record(fork: "Fork", sha256: str) -> dict:
    """What a forked run records of its start (summary.json, its checkpoints' manifests): path, step, sha256."""
    return {"checkpoint": str(fork.checkpoint), "step": fork.step, "sha256": sha256}


def _recipe_code(cfg: FullConfig) -> str:
    recipe = fp8_recipe_from_config(cfg)
    return recipe.code() if recipe is not None else "none"


def fp8_state_origin(cfg: FullConfig, source_cfg: FullConfig) -> str:
    """"checkpoint" when both runs are FP8 with the same recipe code (and policy), else "fresh"."""
    same = _recipe_code(cfg) != "none" and _recipe_code(cfg) == _recipe_code(source_cfg)
    return "checkpoint" if same and not config_differences(source_cfg.policy, cfg.policy, ignore=()) else "fresh"


def open_fork(cfg: FullConfig, path: str | None = None, key: str = "train.fork_from") -> Fork:
    """Resolve and check the fork of ``cfg`` (train.fork_from, or ``path``) before anything is written."""
    checkpoint = resolve_fork_checkpoint(path or cfg.train.fork_from, key)
    config_file = checkpoint.parent.parent / CONFIG_FILE
    if not config_file.is_file():
        raise ValueError(f"{key}: {checkpoint} is not inside a run directory (no {config_file}); fork from a "
                         "checkpoint of an fp8train run")
    source_cfg = load_config(str(config_file))
    _check_source_config(checkpoint, source_cfg, config_file, key)
    diffs = [(k, old, new) for k, old, new in config_differences(source_cfg, cfg, ignore=_MAY_DIFFER)
             if k.startswith(_MUST_MATCH)]
    if diffs:
        detail = "; ".join(f"{k}: {old!r} (source) -> {new!r} (now)" for k, old, new in diffs[:5])
        raise ValueError(f"{key}: {checkpoint} comes from a run with another model or optimizer: {detail}. A fork "
                         "goes on with the source run's weights, AdamW state and schedule; use its model.*, "
                         "train.lr and optim.* (from its config.yaml)")
    if cfg.train.parallel == "fsdp2":
        raise ValueError(f"{key} with train.parallel=fsdp2 is not supported; fork with train.parallel=ddp")
    step = checkpoint_step(checkpoint)
    return Fork(checkpoint, step, source_cfg, fp8_state_origin(cfg, source_cfg))


def _check_source_config(checkpoint: Path, source_cfg: FullConfig, config_file: Path, key: str) -> None:
    """The source's config.yaml is the one that wrote the checkpoint (its manifest's resume_hash): one edited
    after training (another train.lr, say) would pass the checks above with values the checkpoint ignores."""
    try:
        extra = read_json(checkpoint / MANIFEST).get("extra") or {}
    except FileNotFoundError:  # resolved a moment ago: its run pruned it since, or someone deleted it
        raise ValueError(f"{key}: the fork checkpoint {checkpoint} was deleted (pruned by its still-training run, or "
                         "removed) while it was opened; fork from a checkpoint that stays (nothing was written)") \
            from None
    if not _config_wrote(extra, source_cfg):
        raise ValueError(f"{key}: checkpoint {checkpoint} was not written by a run of {config_file} (its manifest's "
                         f"resume_hash {str(extra.get('resume_hash'))[:12]} is another config's: config.yaml was "
                         "edited after training, or the checkpoint was copied from another run); restore the source "
                         "run's own config.yaml (nothing was written)")


def _config_wrote(manifest_extra: dict, source_cfg: FullConfig) -> bool:
    saved = manifest_extra.get("resume_hash")
    return saved is None or saved == resume_hash(source_cfg, manifest_extra.get("data_fingerprint"))


def source_config_problem(checkpoint: Path) -> str | None:
    """None while the config.yaml of the run holding ``checkpoint`` is still the one that wrote it; else what
    changed, naming the file (a validation checks this before each run: the source may be edited meanwhile)."""
    config_file = checkpoint.parent.parent / CONFIG_FILE
    try:
        extra = read_json(checkpoint / MANIFEST).get("extra") or {}
        source_cfg = load_config(str(config_file))
    except FileNotFoundError as err:
        return f"the fork source's {Path(err.filename or config_file).name} in {config_file.parent} was deleted"
    except (OSError, ValueError) as err:
        return f"the fork source's config.yaml {config_file} cannot be read now ({' '.join(str(err).split())})"
    if _config_wrote(extra, source_cfg):
        return None
    return (f"the fork source's config.yaml {config_file} was edited after the checkpoint {checkpoint.name} was "
            f"pinned: it is no longer the config that wrote it (resume_hash {str(extra.get('resume_hash'))[:12]})")


def _fp8_buffer_names(model: torch.nn.Module) -> set[str]:
    return {f"{name}.{buf}" for name, layer in fp8_layers(model) for buf, _ in layer.named_buffers()}


def _linear_prefixes(model: torch.nn.Module) -> set[str]:
    return {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def load_fork(fork: Fork, model: torch.nn.Module, optimizer, scheduler, seed: int) -> dict:
    """Load the fork's weights (and FP8 state when fork.fp8_state says so), AdamW state and LR schedule into a
    freshly built run; returns the checkpoint's manifest. ValueError when the checkpoint does not fit, or was
    deleted (pruned by its still-training run)."""
    try:
        return _load_fork(fork, model, optimizer, scheduler, seed)
    except FileNotFoundError as err:
        raise ValueError(f"the fork checkpoint {fork.checkpoint} was deleted while it was loaded "
                         f"({Path(err.filename or fork.checkpoint).name} is gone)") from None


def _load_fork(fork: Fork, model: torch.nn.Module, optimizer, scheduler, seed: int) -> dict:
    saved = load_file(str(fork.checkpoint / "model.safetensors"))
    own = model.state_dict()
    fp8_buffers = _fp8_buffer_names(model)
    take_fp8 = fork.fp8_state == "checkpoint" and all(
        name in saved and saved[name].shape == own[name].shape for name in fp8_buffers)
    partner = {name: group for group in tied_weight_groups(model) for name in group}
    state, missing = {}, []
    for name, tensor in own.items():
        if name in fp8_buffers and not take_fp8:
            state[name] = tensor  # fresh scaling state, as built
            continue
        source = name if name in saved else next((n for n in partner.get(name, ()) if n in saved), None)
        if source is None or saved[source].shape != tensor.shape:
            missing.append(name if source is None else f"{name} {tuple(saved[source].shape)} vs {tuple(tensor.shape)}")
            continue
        state[name] = saved[source]
    # The source's own FP8 state (of an nn.Linear here: a bf16 fork, or another recipe) is left behind.
    linears = _linear_prefixes(model)
    unexpected = [n for n in saved if n not in own and n.rsplit(".", 1)[0] not in linears]
    if missing or unexpected:
        raise ValueError(f"fork checkpoint {fork.checkpoint} does not fit this model: missing or reshaped "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state)
    manifest = read_json(fork.checkpoint / MANIFEST)
    optimizer.load_state_dict(load_optimizer_files(fork.checkpoint, manifest, optimizer))
    _check_optimizer_shapes(fork, optimizer)
    if manifest.get("scheduler") is not None:
        scheduler.load_state_dict(manifest["scheduler"])
    torch.manual_seed(seed)  # what is random from here on (dropout) is this run's own
    return manifest


def _check_optimizer_shapes(fork: Fork, optimizer) -> None:
    inner = getattr(optimizer, "optimizer", optimizer)
    for group in inner.param_groups:
        for param in group["params"]:
            for key, value in inner.state.get(param, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                    raise ValueError(f"fork checkpoint {fork.checkpoint}: AdamW {key} is {tuple(value.shape)} for "
                                     f"a parameter of shape {tuple(param.shape)}: another model")
