"""Set-up of a training run: everything that can fail on a user mistake fails here, before the run directory is
touched (launcher settings, batch split, trackers, data, model, FP8 conversion, the resume decision); then the
run directory's config.yaml, the model on its device, AdamW with fp32 state, the LR schedule and accelerate's
wrapping.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fp8train.nn.convert import convert_to_fp8, fp8_layers
from fp8train.training.runs.claim import (check_backend_device, check_resume_origin, check_run_dir, claim_run_dir,
                                     run_hashes)
from fp8train.nn.linear import configure_execution
from fp8train.training.compile import check_compiler, compile_model
from fp8train.training.config import (FullConfig, config_to_yaml, fp8_recipe_from_config, layer_policy_from_config)
from fp8train.training.data.corpus import build_data
from fp8train.training.parallel.distributed import Fp8StateSync, check_distributed_type, set_cpu_threads
from fp8train.training.runs.fork import Fork, open_fork
from fp8train.training.parallel.fsdp2 import apply_fsdp2, ensure_process_group
from fp8train.training.parallel.tp_mesh import (apply_tensor_parallel, check_tensor_parallel, check_tp_model,
                                                        data_parallel, make_mesh)
from fp8train.training.models.decoder import build_model, check_model_for_run
from fp8train.training.optim import AdamW
from fp8train.training.runs.resume import ResumePoint, find_resume_point
from fp8train.training.storage.files import write_text_atomic
from fp8train.training.storage.rundir import CONFIG_FILE
from fp8train.training.shadow import RecipeShadow, shadowed_layers
from fp8train.training.runs.telemetry import expert_scalings
from fp8train.training.runs.tracking import Trackers, check_trackers_available

__all__ = ["Run", "set_up", "lr_at"]


@dataclass
class Run:
    """What set-up builds: fixed for the whole run."""

    cfg: FullConfig
    accelerator: object
    run_dir: Path
    data: object
    val_batches: list
    model: torch.nn.Module
    fp8_recipe: object
    conversion: object
    resume_point: ResumePoint
    show_progress: bool
    started: float
    ddp_model: torch.nn.Module = None
    optimizer: torch.optim.Optimizer = None
    scheduler: object = None
    lr_horizon: dict = field(default_factory=dict)  # {"steps": N}: the schedule's length (see resume.py)
    layers: list = field(default_factory=list)
    experts: list = field(default_factory=list)  # (name, ExpertScaling) of the FP8 grouped layers (telemetry)
    fp8_sync: Fp8StateSync = None
    shadow: RecipeShadow | None = None  # log.shadow_recipes: other recipes measured on telemetry steps
    trackers: Trackers = None
    dir_state: str = "absent"  # what the run directory was at set-up: absent | empty | run (claim.py)
    lock: object = None  # the run directory's DirLock, held by the main process for the run's life
    hashes: dict = field(default_factory=dict)  # config_hash, resume_hash, data_fingerprint (claim.run_hashes)
    made_process_group: bool = False  # fsdp2 in one process without a launcher: set_up made a 1-rank group
    cpu_started: float = field(default_factory=time.process_time)  # this process's CPU time at set-up
    fork: Fork | None = None  # train.fork_from of a run that starts now (a resumed fork has its own checkpoints)
    fork_record: dict | None = None  # what it forked from (path, step, sha256): in summary.json and checkpoints

    @property
    def sharded(self) -> bool:
        """train.parallel=fsdp2 or train.tp_size > 1: parameters are DTensors (FSDP2 shards, TP shards), no DDP
        wrapper, checkpoints are sharded (DCP), collectives everywhere."""
        return self.cfg.train.parallel == "fsdp2" or self.cfg.train.tp_size > 1

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(this rank's dp rank, dp size): the ranks of one tensor-parallel group train on one slice."""
        return data_parallel(self.accelerator, self.cfg.train.tp_size)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def say(self, message: str) -> None:
        if self.is_main and self.show_progress:
            print(message, file=sys.stderr)



def _device_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cpu":
        import os

        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return None


def check_model_fits(cfg: FullConfig, device: torch.device) -> None:
    """Refuse, before anything is built or written, a model.* / train.batch_size that cannot fit the device: a
    LOWER bound of what training needs (q and o projections alone, 2 d_model^2 a layer, plus the embeddings, in
    fp32 with gradient and two AdamW moments: 16 bytes a parameter; and each layer's saved input) against the
    device's whole memory. Otherwise d_model=1048576 is an allocation traceback, n_layers=100000 minutes of
    building first. A Hugging Face model (model.hf_path / hf_config) is sized by its own config: not checked."""
    m = cfg.model
    available = _device_memory_bytes(torch.device(device))
    if m.hf_path or m.hf_config or available is None:
        return
    params = m.n_layers * 2 * m.d_model ** 2 + m.vocab_size * m.d_model
    activations = m.n_layers * cfg.train.batch_size * m.seq_len * m.d_model * 4
    needed = 16 * params + activations
    if needed > available:
        raise ValueError(f"model.n_layers={m.n_layers}, model.d_model={m.d_model}, train.batch_size="
                         f"{cfg.train.batch_size} x model.seq_len={m.seq_len} need at least {needed / 2**30:,.1f} GiB "
                         f"to train (weights, gradients, AdamW state, activations); {device} has "
                         f"{available / 2**30:,.1f} GiB")


def set_up(cfg: FullConfig, accelerator, show_progress: bool, model_factory=None) -> Run:
    """Everything a run needs before its first step, checked before anything is written; `model_factory(cfg.model)`
    builds the model (training.models.decoder.build_model unless given, e.g. a model with hooks of your own)."""
    started = time.time()
    check_distributed_type(accelerator, cfg)
    set_cpu_threads(cfg, accelerator)
    check_tensor_parallel(cfg, accelerator.num_processes)
    world = accelerator.num_processes // cfg.train.tp_size  # data-parallel ranks
    if cfg.train.batch_size % (world * cfg.train.grad_accum):
        raise ValueError(f"train.batch_size={cfg.train.batch_size} must be divisible by data-parallel processes x "
                         f"train.grad_accum = {world} x {cfg.train.grad_accum}")
    check_trackers_available(cfg)
    check_model_fits(cfg, accelerator.device)
    data = build_data(cfg)
    val_batches = data.val_batches()
    torch.manual_seed(cfg.train.seed)  # same seed -> same initial weights in every run of a pair, any recipe
    model = (model_factory or build_model)(cfg.model)
    fp8_recipe = fp8_recipe_from_config(cfg)
    conversion = None
    if fp8_recipe is not None:
        with warnings.catch_warnings():  # "nothing converted" is refused below, in one line
            warnings.simplefilter("ignore")
            conversion = convert_to_fp8(model, fp8_recipe, layer_policy_from_config(cfg))
        # How the FP8 layers run (same numbers): read once here ("auto" kernel: measured once per machine).
        configure_execution(model, quantize_kernel=cfg.fp8.quantize_kernel, emulated_dtype=cfg.fp8.emulated_dtype)
    check_model_for_run(model, data.vocab_size, conversion, cfg.policy.allow_no_fp8)
    check_backend_device(fp8_recipe, accelerator.device)
    if cfg.train.tp_size > 1:
        check_tp_model(model, cfg.train.tp_size)  # heads, MLP and FP8 tiles split evenly (one line if not)
    if cfg.train.compile:
        check_compiler(accelerator.device)  # a missing compiler is a config error, before anything is written
    run_dir = cfg.run_dir
    log = (lambda m: print(m, file=sys.stderr)) if accelerator.is_main_process else (lambda m: None)
    dir_state = check_run_dir(run_dir)  # absent, empty or a run; no symlinks (every rank)
    point = find_resume_point(cfg, run_dir, log)  # every rank decides, so every rank fails the same way
    if point.checkpoint is not None:  # same data, same experiment as the checkpoint's manifest says
        check_resume_origin(point.checkpoint, cfg, data)
    fork = open_fork(cfg) if cfg.train.fork_from and point.kind == "start" else None  # checked, not yet loaded
    run = Run(cfg, accelerator, run_dir, data, val_batches, model, fp8_recipe, conversion, point, show_progress,
               started, dir_state=dir_state, hashes=run_hashes(cfg, data), fork=fork)
    if point.kind != "complete":
        _prepare_training(run)
    return run


_FORK_COMMENT = "# train.fork_from resolved to "


def _fork_comment(run: Run) -> str:
    """train.fork_from stays as given in config.yaml (a resume compares it); where it led is a comment line,
    written at the fork and kept by every resume (which never reads the source again)."""
    if run.fork is not None:
        return f"{_FORK_COMMENT}{run.fork.checkpoint} (step {run.fork.step})\n"
    old = run.run_dir / CONFIG_FILE
    if not run.cfg.train.fork_from or not old.is_file():
        return ""
    return "".join(line for line in old.read_text().splitlines(keepends=True) if line.startswith(_FORK_COMMENT))


def _prepare_training(run: Run) -> None:
    """config.yaml written (rank 0, between barriers: no rank mistakes it for an earlier run's), the model on
    its device, AdamW and the LR schedule, accelerate's wrapping."""
    cfg, accelerator = run.cfg, run.accelerator
    accelerator.wait_for_everyone()
    text = config_to_yaml(cfg) + _fork_comment(run)
    write_config = lambda: write_text_atomic(run.run_dir / CONFIG_FILE, text)  # noqa: E731
    run.lock = claim_run_dir(run.run_dir, accelerator, run.dir_state, write_config, lambda m: run.say(m))
    accelerator.wait_for_everyone()
    if run.conversion is not None:
        run.say(str(run.conversion))
    run.model.to(accelerator.device)
    if run.sharded:  # before AdamW exists, so its state is built on the shards
        run.made_process_group = ensure_process_group(accelerator.device)
        mesh = None
        if cfg.train.tp_size > 1:  # TP first, then FSDP2 along dp over the TP shards (torch's 2-D composition)
            mesh = make_mesh(accelerator.device, accelerator.num_processes, cfg.train.tp_size)
            apply_tensor_parallel(run.model, mesh["tp"], cfg.train.sequence_parallel)
        if cfg.train.parallel == "fsdp2":
            apply_fsdp2(run.model, accelerator.device, fp8_all_gather=cfg.fp8.all_gather,
                        mesh=None if mesh is None else mesh["dp"])
    if cfg.train.compile:
        compile_model(run.model)  # in place: state_dict keys (checkpoints) unchanged
    optimizer = _make_optimizer(run.model, cfg)
    run.lr_horizon["steps"] = cfg.train.max_steps
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_at(s, cfg, run.lr_horizon["steps"]))
    if run.sharded:  # accelerate would wrap it in DDP: it keeps the plain optimizer and never sees the model
        run.ddp_model, run.optimizer = run.model, optimizer
    else:
        run.ddp_model, run.optimizer = accelerator.prepare(run.model, optimizer)
    if run.ddp_model is not run.model and hasattr(run.ddp_model, "broadcast_buffers"):
        # DDP would copy rank 0's buffers over every rank's at each forward: that hides a rank whose FP8 state
        # went astray (update_fp8_scales' all-reduce keeps them equal; Fp8StateSync checks it) and overwrites
        # the non-finite amax counters of the other ranks.
        run.ddp_model.broadcast_buffers = False
    run.layers = fp8_layers(run.model)
    run.experts = expert_scalings(run.model)
    run.fp8_sync = Fp8StateSync(run.layers, accelerator)
    if cfg.log.shadow_recipes:
        run.shadow = RecipeShadow(shadowed_layers(run.model, layer_policy_from_config(cfg)), cfg.log.shadow_recipes)


def lr_at(step: int, cfg: FullConfig, horizon: int) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr at `horizon` steps, then that final rate."""
    warmup = cfg.optim.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
    floor = cfg.optim.min_lr_ratio
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def _make_optimizer(model: torch.nn.Module, cfg: FullConfig) -> torch.optim.Optimizer:
    # Weight decay on matrices only (not norms, biases); params stay fp32 (master weights), so does AdamW state.
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # CUDA: the fused kernel (one launch for all parameters); CPU keeps the per-parameter loop it was tuned with
    # (torch's fused CPU kernel rounds differently). Either way the loop's skip is decided on the device and
    # handed over as found_inf (fp8train.training.optim).
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    return AdamW(groups, lr=cfg.train.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                 foreach=False if not on_cuda else None, fused=True if on_cuda else None)
