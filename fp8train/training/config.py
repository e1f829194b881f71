"""Run configuration: one typed dataclass per concern, composed in `FullConfig`.

Merge order (lingua-style): the schema defaults below, then the YAML file, then `key=value` overrides from the
command line. Merging is strict: an unknown key is a `ValueError` naming its dotted path and the nearest valid
names; a wrong type or an out-of-range value is a `ValueError` naming the key, the value and what is allowed.
The YAML schema holds primitives only ("e4m3fn", not a torch dtype); `fp8_recipe_from_config` and
`layer_policy_from_config` turn the merged config into the objects the FP8 code uses.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fp8train.training.hf import check_hf_model_fields

__all__ = [
    "RunConfig", "ModelConfig", "DataConfig", "TrainConfig", "OptimConfig", "Fp8Config", "PolicyConfig",
    "LogConfig", "CheckpointConfig", "ValidateConfig", "FullConfig",
    "load_config", "config_to_yaml", "config_hash", "fp8_recipe_from_config", "layer_policy_from_config",
    "RECIPE_NAMES", "FP8_RECIPE_CHOICES",
]

# Validated here by name so the config works before (and independently of) fp8train.nn.recipes.
RECIPE_NAMES = ("delayed", "current", "rowwise", "block")
FP8_RECIPE_CHOICES = ("none",) + RECIPE_NAMES
FP8_BACKENDS = ("auto", "emulated", "scaled_mm", "te")
FP8_FORMAT_NAMES = ("e4m3fn", "e4m3", "e5m2", "e4m3fnuz", "e5m2fnuz")
AMAX_ALGOS = ("max", "most_recent")
WANDB_MODES = ("disabled", "offline", "online")
DEVICES = ("auto", "cpu", "cuda")
AUTOCAST_MODES = ("bf16", "none")

# Anchored (^...$) so they mean the same under re.search, re.match and re.fullmatch: a module NAMED `gate`
# (an MoE router) is excluded, Llama's `gate_proj` is not.
DEFAULT_EXCLUDE = [
    r"^(.*\.)?(embed|embed_tokens|embeddings|tok_embeddings|wte|wpe)$",  # embeddings
    r"^(.*\.)?(lm_head|output|head)$",  # output head: logits are sensitive, and it is often tied to embed
    r"^(.*\.)?(router|gate)$",  # MoE routers: tiny, and their softmax decides which expert runs
]


def _require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config {key}={value!r} is invalid: {allowed}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _Section:
    """Mixin: `_check()` runs the section's validation at construction, naming keys as `<section>.<field>`."""

    _section = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # inf/nan pass every `>= low` check below, so refuse them first
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"config {self._key(f.name)}={value!r} is invalid: must be a finite number")
        self._check()

    def _key(self, name: str) -> str:
        return f"{self._section}.{name}"

    def _check(self) -> None:  # overridden
        pass

    def _in(self, name: str, choices: Iterable[str]) -> None:
        value = getattr(self, name)
        _require(value in choices, self._key(name), value, f"one of {list(choices)}")

    def _at_least(self, name: str, low: float, what: str = "") -> None:
        value = getattr(self, name)
        _require(value >= low, self._key(name), value, what or f"must be >= {low}")


@dataclass
class RunConfig(_Section):
    _section = "run"
    name: str = "run"
    """Run name; the run directory is <run.dir>/<run.name>."""
    dir: str = "runs"
    """Parent folder of run directories."""

    def _check(self) -> None:
        _require(bool(self.name) and "/" not in self.name and self.name not in (".", ".."), "run.name", self.name,
                 "a non-empty folder name without '/'")
        _require(bool(self.dir), "run.dir", self.dir, "a non-empty path")


@dataclass
class ModelConfig(_Section):
    _section = "model"
    n_layers: int = 4
    """Number of transformer blocks."""
    d_model: int = 128
    """Residual stream width."""
    n_heads: int = 4
    """Query heads; head_dim = d_model / n_heads (must be even for RoPE)."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 = n_heads (plain multi-head)."""
    seq_len: int = 128
    """Training context length in tokens."""
    vocab_size: int = 256
    """Vocabulary size; 256 = byte-level text. For a nanoGPT .bin corpus, set it above the largest token id."""
    ffn_hidden: int = 0
    """SwiGLU hidden width; 0 = auto: 8/3 * d_model rounded up to a multiple of 16 (FP8-eligible)."""
    tie_embeddings: bool = False
    """Share the embedding matrix with the output head."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    hf_config: str = ""
    """Local Hugging Face config.json (or its folder) to build a transformers causal LM instead; "" = ours."""
    hf_path: str = ""
    """Local Hugging Face model folder (config.json + safetensors) to fine-tune from its weights; "" = none."""

    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def ffn_dim(self) -> int:
        return self.ffn_hidden or 16 * -(-(8 * self.d_model // 3) // 16)

    def _check(self) -> None:
        for name in ("n_layers", "d_model", "n_heads"):
            self._at_least(name, 1)
        self._at_least("n_kv_heads", 0, "must be >= 0 (0 = n_heads)")
        self._at_least("seq_len", 2, "must be >= 2 (inputs and shifted targets)")
        self._at_least("vocab_size", 2)
        self._at_least("ffn_hidden", 0, "must be >= 0 (0 = auto)")
        _require(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        _require(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        _require(self.d_model % self.n_heads == 0, "model.d_model", self.d_model,
                 f"must be divisible by model.n_heads={self.n_heads}")
        head_dim = self.d_model // self.n_heads
        _require(head_dim % 2 == 0, "model.n_heads", self.n_heads,
                 f"head_dim = d_model / n_heads = {head_dim} must be even (RoPE rotates channel pairs)")
        _require(self.n_heads % self.kv_heads() == 0, "model.n_kv_heads", self.n_kv_heads,
                 f"must divide model.n_heads={self.n_heads}")
        if self.hf_path or self.hf_config:  # Decoder fields would be ignored by an HF model: refuse them
            check_hf_model_fields(self, type(self)())


@dataclass
class DataConfig(_Section):
    _section = "data"
    path: str = ""
    """Text file, folder of text files (recursive), or nanoGPT uint16 .bin; "" = built-in corpus (Python stdlib)."""
    val_fraction: float = 0.05
    """Share held out for validation: by file for folders and the built-in corpus, else the tail of the tokens."""
    split_seed: int = 0
    """Salt of the file-level train/validation split (a hash of each file's relative path)."""
    max_bytes: int = 32_000_000
    """Cap on text corpora: files are read in sorted order until this many bytes; 0 = no cap. Not for .bin."""
    tokenizer: str = ""
    """Local Hugging Face tokenizer folder (tokenizer.json): text is tokenized with it, once, and cached."""
    hf_dataset: str = ""
    """Local `datasets` dataset saved with save_to_disk (its text is data.text_field); replaces data.path."""
    text_field: str = "text"
    """Column of data.hf_dataset that holds the text."""

    def _check(self) -> None:
        _require(0 < self.val_fraction < 1, "data.val_fraction", self.val_fraction, "must be in (0, 1)")
        self._at_least("max_bytes", 0, "must be >= 0 (0 = no cap)")
        _require(bool(self.text_field), "data.text_field", self.text_field, "a column name of data.hf_dataset")
        _require(not (self.hf_dataset and self.path), "data.hf_dataset", self.hf_dataset,
                 f"replaces data.path (set to {self.path!r}): give one of them")


@dataclass
class TrainConfig(_Section):
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
    resume: bool = False
    """Resume from the latest checkpoint in the run directory."""

    def _check(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum", "eval_batches"):
            self._at_least(name, 1)
        self._at_least("seed", 0)
        _require(self.seed < 2**63, "train.seed", self.seed, "must be < 2**63 (torch.manual_seed's range)")
        self._at_least("eval_every", 0, "must be >= 0 (0 = only at the end)")
        self._at_least("threads", 0, "must be >= 0 (0 = torch's default)")
        self._at_least("grad_clip", 0, "must be >= 0 (0 = no clipping)")
        _require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _require(self.batch_size % self.grad_accum == 0, "train.batch_size", self.batch_size,
                 f"must be divisible by train.grad_accum={self.grad_accum}")
        self._in("device", DEVICES)
        self._in("autocast", AUTOCAST_MODES)


@dataclass
class OptimConfig(_Section):
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
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas", list(self.betas),
                 "two floats in [0, 1)")
        _require(self.eps > 0, "optim.eps", self.eps, "must be > 0")
        self._at_least("warmup_steps", 0)
        _require(0 <= self.min_lr_ratio <= 1, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")


@dataclass
class Fp8Config(_Section):
    _section = "fp8"
    recipe: str = "delayed"
    """none (bf16 baseline) | delayed | current | rowwise | block."""
    backend: str = "auto"
    """FP8 GEMM backend: auto | emulated (any device) | scaled_mm (CUDA sm89+) | te (Transformer Engine)."""
    # Optional per-field overrides of the named preset; None keeps the preset's value.
    margin: Optional[int] = None
    """Scale headroom in powers of two (scale = amax / max * 2**margin)."""
    pow2_scales: Optional[bool] = None
    """Round scales up to powers of two."""
    amax_history_len: Optional[int] = None
    """Delayed scaling: length of the amax history."""
    amax_compute_algo: Optional[str] = None
    """Delayed scaling: max | most_recent over the history."""
    input_format: Optional[str] = None
    """FP8 format of activations: e4m3fn | e5m2 | e4m3fnuz | e5m2fnuz."""
    weight_format: Optional[str] = None
    """FP8 format of weights."""
    grad_output_format: Optional[str] = None
    """FP8 format of output gradients."""
    input_block: Optional[List[int]] = None
    """Block recipe: scale block (rows, cols) of activations, e.g. [1, 128]."""
    weight_block: Optional[List[int]] = None
    """Block recipe: scale block of weights, e.g. [128, 128]."""
    grad_output_block: Optional[List[int]] = None
    """Block recipe: scale block of output gradients, e.g. [1, 128]."""

    def _check(self) -> None:
        self._in("recipe", FP8_RECIPE_CHOICES)
        self._in("backend", FP8_BACKENDS)
        if self.margin is not None:
            self._at_least("margin", 0)
        if self.amax_history_len is not None:
            self._at_least("amax_history_len", 1)
        if self.amax_compute_algo is not None:
            self._in("amax_compute_algo", AMAX_ALGOS)
        for name in ("input_format", "weight_format", "grad_output_format"):
            if getattr(self, name) is not None:
                self._in(name, FP8_FORMAT_NAMES)
        for name in ("input_block", "weight_block", "grad_output_block"):
            block = getattr(self, name)
            if block is not None:
                _require(len(block) == 2 and all(b >= 1 for b in block), self._key(name), list(block),
                         "two positive ints [rows, cols], e.g. [1, 128] or [128, 128]")


@dataclass
class PolicyConfig(_Section):
    _section = "policy"
    min_features: int = 256
    """Linears with in_features or out_features below this stay in high precision (too small to gain)."""
    divisible_by: int = 16
    """in_features and out_features must be multiples of this (FP8 GEMM alignment)."""
    exclude: List[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    """Regexes over module names kept out of FP8 (default: embeddings, output head, MoE routers)."""
    skip_first_blocks: int = 0
    """Keep the first N transformer blocks in high precision."""
    skip_last_blocks: int = 0
    """Keep the last N transformer blocks in high precision."""
    allow_no_fp8: bool = False
    """Let a run whose policy converts no layer proceed in high precision (otherwise it fails, listing why)."""

    def _check(self) -> None:
        self._at_least("min_features", 0)
        self._at_least("divisible_by", 1)
        self._at_least("skip_first_blocks", 0)
        self._at_least("skip_last_blocks", 0)
        for i, pattern in enumerate(self.exclude):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError(f"config policy.exclude[{i}]={pattern!r} is not a valid regex: {e}") from None


@dataclass
class LogConfig(_Section):
    _section = "log"
    every: int = 10
    """Write a metrics.jsonl line (and a wandb log) every N optimizer steps."""
    telemetry_every: int = 50
    """Sample per-layer FP8 health (amax, scales, clipping, SQNR) every N steps; 0 = off."""
    wandb: str = "offline"
    """disabled | offline | online."""
    wandb_project: str = "fp8train"
    """wandb project name."""

    def _check(self) -> None:
        self._at_least("every", 1)
        self._at_least("telemetry_every", 0, "must be >= 0 (0 = off)")
        self._in("wandb", WANDB_MODES)


@dataclass
class CheckpointConfig(_Section):
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


@dataclass
class ValidateConfig(_Section):
    _section = "validate"
    candidates: List[str] = field(default_factory=lambda: ["delayed"])
    """FP8 recipes run against the bf16 baseline (the baseline always runs; do not list 'none')."""
    margin: float = 0.02
    """Allowed relative final-loss gap of a candidate over the baseline, declared before the runs."""
    extra_seeds: int = 1
    """Extra bf16 runs with other seeds; their spread is the seed-noise band."""
    final_window: int = 3
    """Number of final evaluation points averaged into the compared loss."""
    stop_on_divergence: bool = True
    """Stop a candidate early when its loss exceeds divergence_factor * the baseline's at the same step."""
    divergence_factor: float = 1.5
    """Loss ratio to the baseline counted as divergence."""

    def _check(self) -> None:
        allowed = f"a non-empty list of FP8 recipes from {list(RECIPE_NAMES)} ('none' is the baseline, always run)"
        _require(len(self.candidates) > 0, "validate.candidates", list(self.candidates), allowed)
        for name in self.candidates:
            _require(name in RECIPE_NAMES, "validate.candidates", list(self.candidates), allowed)
        _require(len(set(self.candidates)) == len(self.candidates), "validate.candidates", list(self.candidates),
                 "no duplicates")
        self._at_least("margin", 0, "relative loss gap, must be >= 0")
        self._at_least("extra_seeds", 0)
        self._at_least("final_window", 1)
        _require(self.divergence_factor > 1, "validate.divergence_factor", self.divergence_factor, "must be > 1")


@dataclass
class FullConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.run.dir, self.run.name)


# ---------------------------------------------------------------------------------------------------------
# Loading: strict key check with suggestions, then OmegaConf merge, then construction (which validates).


def _field_types(schema: type) -> dict[str, Any]:
    # typing.get_type_hints resolves the string annotations of `from __future__ import annotations`.
    return typing.get_type_hints(schema)


def _leaf_paths(schema: type, prefix: str = "") -> list[str]:
    paths = []
    for name, tp in _field_types(schema).items():
        if dataclasses.is_dataclass(tp):
            paths += _leaf_paths(tp, f"{prefix}{name}.")
        else:
            paths.append(prefix + name)
    return paths


def _check_keys(given: Any, schema: type, prefix: str = "") -> None:
    """Raise ValueError for any key of `given` (a plain dict) that `schema` does not have."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(given, dict):
        raise ValueError(f"config {where} must be a mapping of keys, got {given!r}")
    types = _field_types(schema)
    for key, value in given.items():
        path = f"{prefix}{key}"
        if key not in types or key.startswith("_"):
            names = [n for n in types if not n.startswith("_")]
            near = difflib.get_close_matches(str(key), names, n=3, cutoff=0.5)
            if not near:  # e.g. a bare "lr" at the top level: look through every dotted path
                leaves = _leaf_paths(FullConfig)
                near = [p for p in leaves if difflib.get_close_matches(str(key), [p.split(".")[-1]], cutoff=0.8)]
            hint = f"did you mean {', '.join(repr(n) for n in near[:3])}? " if near else ""
            raise ValueError(f"unknown config key '{path}': {hint}valid keys in {where}: {', '.join(names)}")
        if dataclasses.is_dataclass(types[key]):
            _check_keys(value, types[key], path + ".")
        elif isinstance(value, dict):  # OmegaConf answers a mapping given to a list field with a bare TypeError
            raise ValueError(f"config {path}={value!r} is invalid: {path} is a single setting, not a section "
                             "(give a value, or a list in [brackets])")


def _read_yaml(path: str) -> dict:
    if not os.path.exists(path):
        raise ValueError(f"config file {path!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"config file {path!r} is a directory; give a YAML file")
    try:
        loaded = OmegaConf.load(path)
    except Exception as e:  # yaml.YAMLError and friends; their messages span lines, the CLI prints one
        raise ValueError(f"config file {path!r} is not valid YAML: {' '.join(str(e).split())}") from None
    container = OmegaConf.to_container(loaded) if loaded is not None else {}
    if container is None:  # an empty file
        return {}
    if not isinstance(container, dict):
        raise ValueError(f"config file {path!r} must hold a mapping of sections, got {type(container).__name__}")
    return container


def _parse_overrides(overrides: Iterable[str]) -> dict:
    merged = OmegaConf.create({})
    for item in overrides:
        if "=" not in item or not item.split("=", 1)[0].strip():
            raise ValueError(f"override {item!r} must look like section.key=value, e.g. train.lr=1e-3")
        if item.strip().endswith("="):  # `data.path=` means the empty string (OmegaConf would read null)
            item = item.strip() + "''"
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item.strip()]))
        except Exception as e:  # OmegaConf's errors, and yaml's for a value like `[1,`
            raise ValueError(f"override {item!r} could not be parsed: {' '.join(str(e).split())}") from None
    return OmegaConf.to_container(merged)


def _omegaconf_error(e: OmegaConfBaseException) -> ValueError:
    key = getattr(e, "full_key", None) or getattr(e, "key", None) or "?"
    msg = getattr(e, "msg", None) or str(e)
    return ValueError(f"config {key}: {msg.splitlines()[0]}")


def add_config_arguments(parser, example_config: str, example_override: str, what: str = "progress bars") -> None:
    """The command-line shape of config-driven commands: `CONFIG [key=value ...] [--quiet]`."""
    parser.add_argument("config", help=f"recipe YAML, e.g. {example_config}")
    parser.add_argument("overrides", nargs="*", help=f"key=value overrides, e.g. {example_override}")
    parser.add_argument("--quiet", action="store_true", help=f"no {what}")


def load_config(path: Optional[str] = None, overrides: Iterable[str] = ()) -> FullConfig:
    """Schema defaults <- YAML file at `path` (None = no file) <- `key=value` overrides; validated FullConfig."""
    layers = [_read_yaml(path) if path is not None else {}, _parse_overrides(list(overrides))]
    for layer in layers:
        _check_keys(layer, FullConfig)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(FullConfig), *layers)
        return OmegaConf.to_object(merged)  # builds the dataclasses, so every _check() runs here
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e) from None


def _to_dictconfig(cfg: FullConfig | DictConfig) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)


def config_to_yaml(cfg: FullConfig | DictConfig) -> str:
    """The resolved config as YAML; `load_config` of this text gives back an equal config."""
    return OmegaConf.to_yaml(_to_dictconfig(cfg))


# Keys that do not change what is trained or measured: a run dir made under another name, resumed, with other
# logging or checkpoint cadence, or judged with another margin still holds the same experiment.
HASH_EXCLUDE = ("run", "train.resume", "log", "checkpoint", "validate")


def config_hash(cfg: FullConfig | DictConfig, exclude: Iterable[str] = HASH_EXCLUDE) -> str:
    """sha256 of the resolved config without the `exclude` dotted keys (whole sections or single fields)."""
    container = OmegaConf.to_container(_to_dictconfig(cfg), resolve=True)
    for dotted in exclude:
        *parents, last = dotted.split(".")
        node = container
        for p in parents:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(last, None)
    return hashlib.sha256(json.dumps(container, sort_keys=True).encode()).hexdigest()


def fp8_recipe_from_config(cfg: FullConfig):
    """The `Fp8Recipe` for `cfg.fp8` (named preset plus the non-None overrides), or None for recipe 'none'."""
    fp8 = cfg.fp8
    if fp8.recipe == "none":
        return None
    from fp8train.nn.recipes import recipe  # lazy: the config must load without the FP8 stack

    overrides: dict[str, Any] = {"backend": fp8.backend}
    for f in dataclasses.fields(Fp8Config):
        value = getattr(fp8, f.name)
        if f.name in ("recipe", "backend") or value is None:
            continue
        overrides[f.name] = tuple(value) if f.name.endswith("_block") else value
    try:
        return recipe(fp8.recipe, **overrides)
    except (ValueError, TypeError) as e:
        raise ValueError(f"fp8 (recipe {fp8.recipe!r} with overrides {overrides}): {e}") from e


def layer_policy_from_config(cfg: FullConfig):
    """The `LayerPolicy` of `cfg.policy`."""
    from fp8train.nn.convert import LayerPolicy  # lazy, as above

    p = cfg.policy
    return LayerPolicy(
        min_features=p.min_features,
        divisible_by=p.divisible_by,
        exclude=list(p.exclude),
        skip_first_blocks=p.skip_first_blocks,
        skip_last_blocks=p.skip_last_blocks,
    )
