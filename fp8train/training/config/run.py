"""Config sections of how a run executes: its name and folder, the training schedule, the optimizer, logging
and checkpoints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List

from accelerate.tracking import LOGGER_TYPE_TO_CLASS

from fp8train.nn.recipes import RECIPE_NAMES, recipe
from fp8train.training.config.base import Section, require

WANDB_MODES = ("disabled", "offline", "online")
TRACKER_NAMES = tuple(LOGGER_TYPE_TO_CLASS)  # accelerate's names: aim, comet_ml, mlflow, tensorboard, wandb, ...
SHADOW_RECIPES = tuple(n for n in RECIPE_NAMES if not recipe(n).is_delayed)  # delayed needs a history a shadow lacks
# Upper bounds of values that would otherwise fail late, after the run directory was written: a folder name
# longer than NAME_MAX is an OSError at mkdir; torch.set_num_threads(100000) segfaults; AdamW fails inside its
# fp32 arithmetic for lr near 1e38, and moves every weight by ~lr per step, so beyond 1e3 nothing can train.
MAX_NAME_BYTES = 255
RESUME_WORDS = ("true", "false", "auto")  # train.resume, as written (load.py refuses yes, 1, -1 before YAML reads them)
MAX_THREADS = 512
MAX_LR = 1e3
# Every evaluation (step 0, every train.eval_every steps, the end) runs all train.eval_batches forwards: 1024 of
# them cost about a third of 1024 training steps, per evaluation; 100000 kept a run at its step-0 evaluation for
# minutes after config.yaml was written. (The batches are windows spread over the validation split, so beyond
# the split's size more of them only repeat its tokens.)
MAX_EVAL_BATCHES = 1024
DEVICES = ("auto", "cpu", "cuda")
AUTOCAST_MODES = ("bf16", "none")
MAX_TP_SIZE = 64  # a tensor-parallel group spans one node's GPUs; 64 already exceeds any node
# What a run without FP8 computes in, by train.autocast: the name a baseline is labelled with (reports, verdicts)
AUTOCAST_PRECISION = {"bf16": "bf16", "none": "fp32"}
PARALLEL_MODES = ("ddp", "fsdp2")  # data parallelism: replicated (DDP) or sharded (torch's FSDP2 fully_shard)


@dataclass
class RunConfig(Section):
    _section = "run"
    name: str = "run"
    """Run name; the run directory is <run.dir>/<run.name>."""
    dir: str = "runs"
    """Parent folder of run directories."""

    def _check(self) -> None:
        require(bool(self.name) and "/" not in self.name and self.name not in (".", ".."), "run.name", self.name,
                 "a non-empty folder name without '/'")
        require(len(self.name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES, "run.name",
                 self.name[:40] + "...", f"at most {MAX_NAME_BYTES} bytes (a file-system limit on folder names)")
        require(bool(self.dir), "run.dir", self.dir, "a non-empty path")


@dataclass
class TrainConfig(Section):
    _section = "train"
    seed: int = 1337
    """Seed of the initialization and the data order (batches are a pure function of seed and step)."""
    max_steps: int = 300
    """Optimizer steps."""
    batch_size: int = 16
    """GLOBAL sequences per optimizer step (over all ranks and micro-batches)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step on each rank."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    eval_every: int = 50
    """Evaluate on the validation batches every N steps (and at the end); 0 = only at the end."""
    eval_batches: int = 8
    """Number of fixed validation batches (train.batch_size sequences each)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""
    skip_nonfinite_grads: bool = True
    """Skip the optimizer step (and count it) when the gradient norm is inf/NaN."""
    device: str = "auto"
    """auto (cuda if available) | cpu | cuda."""
    threads: int = 0
    """CPU threads per process; 0 = torch's default (split between processes). Small models: 1 is often fastest."""
    autocast: str = "bf16"
    """Activation precision outside FP8 layers: bf16 autocast, or none (fp32)."""
    resume: Any = False
    """true | false | auto: resume from the newest valid checkpoint in the run directory (true: one must exist;
    auto: start when there is none). Rules for what may change on resume: fp8train.training.runs.resume."""
    parallel: str = "ddp"
    """Data parallelism over the launched processes: ddp (replicated weights) | fsdp2 (weights, gradients and
    AdamW state sharded by torch's fully_shard, per decoder block then the root; sharded checkpoints)."""
    tp_size: int = 1
    """Tensor-parallel degree: the processes form a (dp, tp) mesh, dp = processes / tp_size, each decoder block's
    projections split over tp (fp8train.training.parallel.tp_mesh); train.parallel applies along dp. 1 = off."""
    sequence_parallel: bool = True
    """With train.tp_size > 1 and fp8train's decoder: norms and residual stream split along the sequence over tp
    (all-gather before each block's colwise projections, reduce-scatter after the rowwise ones). false: replicated."""
    compile: bool = False
    """torch.compile the model (every recipe compiles without graph breaks; needs a C++ compiler on CPU)."""
    fork_from: str = ""
    """A checkpoint folder (or a run directory: its newest valid checkpoint) to start this run from: its weights,
    AdamW state and LR schedule go on for train.max_steps steps of this run's own data order (train.seed); FP8
    scaling state fresh unless the source is the same FP8 recipe (fp8train.training.runs.fork). Empty: from scratch."""

    def _check(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum", "eval_batches"):
            self._at_least(name, 1)
        require(self.eval_batches <= MAX_EVAL_BATCHES, "train.eval_batches", self.eval_batches,
                 f"must be in [1, {MAX_EVAL_BATCHES}] (validation batches run at every evaluation)")
        self._at_least("seed", 0)
        require(self.seed < 2**63, "train.seed", self.seed, "must be < 2**63 (torch.manual_seed's range)")
        self._at_least("eval_every", 0, "must be >= 0 (0 = only at the end)")
        require(0 <= self.threads <= MAX_THREADS, "train.threads", self.threads,
                 f"must be in [0, {MAX_THREADS}] (0 = torch's default)")
        self._at_least("grad_clip", 0, "must be >= 0 (0 = no clipping)")
        require(0 < self.lr <= MAX_LR, "train.lr", self.lr, f"must be in (0, {MAX_LR:g}] (AdamW's peak step size)")
        require(self.batch_size % self.grad_accum == 0, "train.batch_size", self.batch_size,
                 f"must be divisible by train.grad_accum={self.grad_accum}")
        self._in("device", DEVICES)
        self._in("autocast", AUTOCAST_MODES)
        # YAML and the command line give true/false as bools, but "True" or "false" may arrive as strings.
        words = dict(zip(RESUME_WORDS, (True, False, "auto")))
        if isinstance(self.resume, str) and self.resume.lower() in words:
            self.resume = words[self.resume.lower()]
        require(isinstance(self.resume, bool) or self.resume == "auto", "train.resume", self.resume,
                 "one of true, false, auto")
        self._in("parallel", PARALLEL_MODES)
        require(isinstance(self.tp_size, int) and 1 <= self.tp_size <= MAX_TP_SIZE, "train.tp_size", self.tp_size,
                 f"must be an integer in [1, {MAX_TP_SIZE}] (1 = no tensor parallelism)")
        require(self.tp_size == 1 or not self.compile, "train.tp_size", self.tp_size,
                 "tensor parallelism runs eagerly: set train.compile=false")


@dataclass
class OptimConfig(Section):
    _section = "optim"
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only; norms and biases get none)."""
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 30
    """Linear warmup steps, then cosine decay to min_lr_ratio * lr at train.max_steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of train.lr."""

    def _check(self) -> None:
        self._at_least("weight_decay", 0)
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", list(self.betas),
                 "two floats in [0, 1)")
        require(self.eps > 0, "optim.eps", self.eps, "must be > 0")
        self._at_least("warmup_steps", 0)
        require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


@dataclass
class LogConfig(Section):
    _section = "log"
    every: int = 10
    """Write a metrics.jsonl line (and a tracker log) every N optimizer steps."""
    telemetry_every: int = 50
    """Sample per-layer FP8 health (amax, scales, clipping, SQNR) every N steps; 0 = off."""
    trackers: List[str] = field(default_factory=lambda: ["wandb"])
    """accelerate trackers to log to: wandb, tensorboard, mlflow, aim, ... (wandb only while log.wandb is not
    disabled; file-based trackers write under the run directory). [] = none."""
    wandb: str = ""
    """disabled | offline (files under the run directory; upload later with `wandb sync`) | online. "" (the
    default) = the environment's WANDB_MODE if set, else offline: a value written here wins over WANDB_MODE."""
    wandb_project: str = ""
    """wandb project name; "" (the default) = WANDB_PROJECT if set, else fp8train."""
    wandb_name: str = ""
    """wandb run name; "" = run.name (fp8train validate sets <validation>/<label>/seed<N>)."""
    wandb_group: str = ""
    """wandb run group; "" = none (fp8train validate sets the validation's name)."""
    wandb_job_type: str = ""
    """wandb job type; "" = none (fp8train validate sets baseline or candidate)."""
    wandb_tags: List[str] = field(default_factory=list)
    """wandb run tags (fp8train validate sets recipe=<recipe> and seed=<N>)."""
    shadow_recipes: List[str] = field(default_factory=list)
    """Recipes to shadow on every telemetry step: each Fp8Linear (each nn.Linear in a bf16 run) also measures
    what these recipes would do to its real operands (SQNR, overflow, underflow per role); training unchanged.
    Empty = off. Needs telemetry_every > 0. Feeds `fp8train layer-recipes`."""

    def _check(self) -> None:
        self._at_least("every", 1)
        self._at_least("telemetry_every", 0, "must be >= 0 (0 = off)")
        require(self.wandb in WANDB_MODES + ("",), "log.wandb", self.wandb,
                f"one of {list(WANDB_MODES)}, or \"\" for WANDB_MODE if set, else offline")
        for tag in self.wandb_tags:  # wandb refuses these only at wandb.init, after the run directory exists
            require(0 < len(tag) <= 64, "log.wandb_tags", list(self.wandb_tags), "tags of 1 to 64 characters")
        for name in self.trackers:
            require(name in TRACKER_NAMES, "log.trackers", list(self.trackers), f"names from {list(TRACKER_NAMES)}")
        require(len(set(self.trackers)) == len(self.trackers), "log.trackers", list(self.trackers), "no duplicates")
        for name in self.shadow_recipes:
            require(name in SHADOW_RECIPES, "log.shadow_recipes", list(self.shadow_recipes),
                     f"recipe names from {list(SHADOW_RECIPES)} ('delayed' needs an amax history a shadow "
                     f"does not keep: "
                     f"'current' is its best case); {name!r} is not one")
        require(len(set(self.shadow_recipes)) == len(self.shadow_recipes), "log.shadow_recipes",
                 list(self.shadow_recipes), "each recipe at most once")
        require(not self.shadow_recipes or self.telemetry_every > 0, "log.shadow_recipes",
                 list(self.shadow_recipes), "needs log.telemetry_every > 0 (shadowing runs on telemetry steps)")


@dataclass
class CheckpointConfig(Section):
    _section = "checkpoint"
    every: int = 0
    """Save a checkpoint (model, optimizer, FP8 scaling state) every N optimizer steps; 0 = no periodic saves."""
    keep_last: int = 2
    """Keep only the newest N periodic checkpoints; 0 = keep all."""
    save_final: bool = True
    """Save a checkpoint at the end of training."""

    def _check(self) -> None:
        self._at_least("every", 0, "must be >= 0 (0 = no periodic saves)")
        self._at_least("keep_last", 0, "must be >= 0 (0 = keep all)")
