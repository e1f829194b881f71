"""Config sections of the FP8 side: which recipe (`fp8`) and which layers (`policy`), and the two functions that
turn them into the objects the FP8 code uses (`Fp8Recipe`, `LayerPolicy`).

Every name and default here comes from fp8train.nn, where it is defined once: recipe, backend and format names
from `nn.recipes`, the layer-policy defaults from `nn.convert.LayerPolicy`. So `convert_to_fp8(model, recipe)`
and `fp8train train` with an unset `policy` section convert exactly the same layers.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from fp8train.nn.convert import LayerPolicy
from fp8train.nn.gemm import EMULATED_DTYPES
from fp8train.nn.fp8_all_gather import FP8_ALL_GATHER_SCALINGS
from fp8train.nn.overrides import normalize_overrides
from fp8train.nn.te import te_config_refusal
from fp8train.nn.recipes import (AMAX_COMPUTE_ALGOS, BACKENDS, FORMAT_NAMES, MAX_AMAX_HISTORY, RECIPE_NAMES,
                                 Fp8Recipe, recipe)
from fp8train.numerics.kernel_probe import KERNEL_CHOICES
from fp8train.training.config.base import _Section, _require

# E5M2, the widest format, spans 32 binades from min subnormal to max: a larger margin flushes every value.
MAX_MARGIN = 32

EXECUTION_FIELDS = ("emulated_dtype", "quantize_kernel")  # fp8.* keys that are not Fp8Recipe fields
BASELINE_RECIPE = "none"  # fp8.recipe of the bf16 baseline: no layer converted
FP8_RECIPE_CHOICES = (BASELINE_RECIPE,) + RECIPE_NAMES
_POLICY_DEFAULTS = LayerPolicy()


@dataclass
class Fp8Config(_Section):
    _section = "fp8"
    recipe: str = "delayed"
    """none (bf16 baseline) | delayed | current | rowwise | block | mxfp8."""
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
    amax_outlier_factor: Optional[float] = None
    """Delayed scaling, opt-in: a history max above this factor x the second largest does not set the scale."""
    # How the FP8 layers run (same numbers, different speed): not recipe fields, read once at set-up.
    emulated_dtype: str = "auto"
    """Emulated GEMMs' input dtype: auto (bf16 on CUDA and on CPUs with avx512_bf16/AMX, else fp32) | fp32 | bf16."""
    quantize_kernel: str = "auto"
    """auto (native on a CPU where fp8train's C kernel builds, else the fastest bit-exact kernel, measured once
    per machine and cached) | eager | compiled_cast | compiled_select | native."""
    all_gather: bool = False
    """train.parallel=fsdp2 only: all-gather Fp8Linear weights as FP8 codes + scale instead of fp32 (tensorwise
    recipes delayed and current; rowwise and block weights have per-row / per-tile scales)."""
    fast_accum_forward: Optional[bool] = None
    """scaled_mm: fast (unpromoted) tensor-core accumulation in the forward GEMM (preset default: true)."""
    accumulator_bits: Optional[int] = None
    """emulated: model a tensor core keeping this many accumulator bits (Hopper ~14); 0 = exact fp32."""
    accumulator_promotion: Optional[int] = None
    """emulated with accumulator_bits: products along K between promotions to fp32 (default 128; 0 = never)."""

    def _check(self) -> None:
        self._in("emulated_dtype", ("auto",) + tuple(EMULATED_DTYPES))
        self._in("quantize_kernel", KERNEL_CHOICES)
        if self.amax_outlier_factor is not None:
            _require(self.amax_outlier_factor == 0 or self.amax_outlier_factor > 1,
                     self._key("amax_outlier_factor"), self.amax_outlier_factor, "must be 0 (off) or > 1")
        self._in("recipe", FP8_RECIPE_CHOICES)
        self._in("backend", BACKENDS)
        if self.all_gather:
            _require(self.recipe in FP8_ALL_GATHER_SCALINGS, "fp8.all_gather", self.all_gather,
                     f"needs a tensorwise fp8.recipe ({' or '.join(FP8_ALL_GATHER_SCALINGS)}); fp8.recipe="
                     f"{self.recipe} has no single per-tensor weight scale to gather with (set fp8.all_gather=false)")
        if self.backend == "te":  # at config time, with the reason (nn/te.py), before anything is written
            raise ValueError(te_config_refusal(recipe("current" if self.recipe == BASELINE_RECIPE else self.recipe)))
        if self.margin is not None:  # 2**margin beyond 32 binades flushes every value of every format to zero
            _require(0 <= self.margin <= MAX_MARGIN, self._key("margin"), self.margin,
                     f"must be in [0, {MAX_MARGIN}] (powers of two of headroom; above {MAX_MARGIN} every FP8 value "
                     "of every format underflows to zero)")
        if self.amax_history_len is not None:
            _require(1 <= self.amax_history_len <= MAX_AMAX_HISTORY, self._key("amax_history_len"),
                     self.amax_history_len, f"must be in [1, {MAX_AMAX_HISTORY}] (steps of amax kept per layer and "
                     "role; each one is memory and work on every update)")
        if self.accumulator_bits is not None:
            _require(self.accumulator_bits == 0 or 2 <= self.accumulator_bits <= 24, self._key("accumulator_bits"),
                     self.accumulator_bits, "0 (exact fp32) or an int in [2, 24] (significant bits kept)")
        if self.accumulator_promotion is not None:
            _require(self.accumulator_promotion >= 0 and self.accumulator_promotion % 32 == 0,
                     self._key("accumulator_promotion"), self.accumulator_promotion,
                     "0 (never) or a positive multiple of 32 (the MMA depth)")
        if self.amax_compute_algo is not None:
            self._in("amax_compute_algo", AMAX_COMPUTE_ALGOS)
        for name in ("input_format", "weight_format", "grad_output_format"):
            if getattr(self, name) is not None:
                self._in(name, FORMAT_NAMES)
        for name in ("input_block", "weight_block", "grad_output_block"):
            block = getattr(self, name)
            if block is not None:
                _require(len(block) == 2 and all(b >= 1 for b in block), self._key(name), list(block),
                         "two positive ints [rows, cols], e.g. [1, 128] or [128, 128]")


@dataclass
class PolicyConfig(_Section):
    _section = "policy"
    min_features: int = _POLICY_DEFAULTS.min_features
    """Linears with in_features or out_features below this stay in high precision (too small to gain)."""
    divisible_by: int = _POLICY_DEFAULTS.divisible_by
    """in_features and out_features must be multiples of this (FP8 GEMM alignment)."""
    exclude: List[str] = field(default_factory=lambda: list(_POLICY_DEFAULTS.exclude))
    """Regexes over module names kept out of FP8 (default: embeddings, output head, MoE routers)."""
    skip_first_blocks: int = _POLICY_DEFAULTS.skip_first_blocks
    """Keep the first N transformer blocks in high precision."""
    skip_last_blocks: int = _POLICY_DEFAULTS.skip_last_blocks
    """Keep the last N transformer blocks in high precision."""
    overrides: Dict[str, str] = field(default_factory=dict)
    """Per-layer recipes: ordered {regex: recipe name or bf16}; the first regex that re.searches a converted
    layer's name decides its recipe (nn/overrides.py). A regex matching no nn.Linear is an error."""
    plan: str = ""
    """A `fp8train plan` output (YAML with policy.overrides): its overrides come before policy.overrides."""
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
        normalize_overrides(dict(self.overrides), "config policy.overrides")
        if self.plan:
            read_plan_overrides(self.plan)  # a missing or malformed plan fails here, before anything runs


def read_plan_overrides(path: str) -> tuple[tuple[str, str], ...]:
    """The validated policy.overrides of a plan file (`fp8train plan` output), in file order."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"config policy.plan={path!r}: cannot read it ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config policy.plan={path!r} is not YAML: {str(e).splitlines()[0]}") from None
    overrides = data.get("policy", {}).get("overrides") if isinstance(data, dict) and isinstance(
        data.get("policy"), dict) else None
    if not isinstance(overrides, dict) or not overrides:
        raise ValueError(f"config policy.plan={path!r} has no policy.overrides mapping (write one with "
                         f"`fp8train plan RUN_DIR --out PLAN.yaml`)")
    return normalize_overrides(overrides, f"config policy.plan={path!r}: policy.overrides")



def fp8_recipe_from_config(cfg) -> Fp8Recipe | None:
    """The `Fp8Recipe` for `cfg.fp8` (named preset plus the non-None overrides), or None for recipe 'none'."""
    fp8 = cfg.fp8
    if fp8.recipe == BASELINE_RECIPE:
        return None
    overrides: dict[str, Any] = {"backend": fp8.backend}
    for f in dataclasses.fields(Fp8Config):
        value = getattr(fp8, f.name)
        # all_gather (how FSDP2 gathers) and the execution fields are not recipe fields
        if f.name in ("recipe", "backend", "all_gather") + EXECUTION_FIELDS or value is None:
            continue
        overrides[f.name] = tuple(value) if f.name.endswith("_block") else value
    try:
        run_recipe = recipe(fp8.recipe, **overrides)
    except (ValueError, TypeError) as e:
        raise ValueError(f"fp8 (recipe {fp8.recipe!r} with overrides {overrides}): {e}") from e
    if run_recipe.backend == "te":  # refused here, before any run directory or model exists
        raise ValueError(te_config_refusal(run_recipe))
    return run_recipe


def layer_policy_from_config(cfg) -> LayerPolicy:
    """The `LayerPolicy` of `cfg.policy`."""
    p = cfg.policy
    return LayerPolicy(
        min_features=p.min_features,
        divisible_by=p.divisible_by,
        exclude=list(p.exclude),
        skip_first_blocks=p.skip_first_blocks,
        skip_last_blocks=p.skip_last_blocks,
        overrides=(read_plan_overrides(p.plan) if p.plan else ()) + normalize_overrides(dict(p.overrides)),
    )
