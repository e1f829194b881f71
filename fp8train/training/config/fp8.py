"""Config sections of the FP8 side: which recipe (`fp8`) and which layers (`policy`), and the two functions that
turn them into the objects the FP8 code uses (`Fp8Recipe`, `LayerPolicy`).

Every name and default here comes from fp8train.nn, where it is defined once: recipe, backend and format names
from `nn.recipes`, the layer-policy defaults from `nn.convert.LayerPolicy`. So `convert_to_fp8(model, recipe)`
and `fp8train train` with an unset `policy` section convert exactly the same layers. The fp8 section's recipe
keys are generated from `Fp8Recipe`'s fields (typed and documented there) and checked by `Fp8Recipe` itself, the
one place a recipe is validated; only the keys that are not recipe fields are declared here.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from fp8train.nn.convert import LayerPolicy
from fp8train.nn.gemm import AUTO_EMULATED_DTYPE, EMULATED_DTYPE_CHOICES
from fp8train.nn.overrides import normalize_overrides
from fp8train.nn.te import te_config_refusal
from fp8train.nn.recipes import (BASELINE_RECIPE, DEFAULT_RECIPE, RECIPE_NAMES, TENSORWISE_SCALINGS, Fp8Recipe,
                                 GemmBackend, RecipeFieldError, recipe)
from fp8train.numerics.cast_kernels import DEFAULT_QUANTIZE_KERNEL, KERNEL_CHOICES
from fp8train.training.config.base import Section, check_settings_file, require

FP8_RECIPE_CHOICES = (BASELINE_RECIPE,) + RECIPE_NAMES
# Fp8Recipe fields that fp8.recipe decides (the preset's name and its scaling kind): not fp8.* keys of their own.
PRESET_FIELDS = ("name", "scaling")
# Recipe fields given whole rather than as preset overrides: no preset sets them, so the resolved config shows
# the value that runs (backend: auto) instead of null.
_WHOLE_FIELDS = ("backend",)
_POLICY_DEFAULTS = LayerPolicy()


@dataclass
class _Fp8RunSection(Section):
    """The fp8.* keys that are not Fp8Recipe fields: which preset, how the layers run, how FSDP2 gathers."""

    _section = "fp8"
    recipe: str = DEFAULT_RECIPE
    """none (bf16 baseline) | delayed | current | rowwise | block | mxfp8."""
    # How the FP8 layers run (same numbers, different speed): not recipe fields, read once at set-up.
    emulated_dtype: str = AUTO_EMULATED_DTYPE
    """Emulated GEMMs' input dtype: auto (bf16 on CUDA and on CPUs with avx512_bf16/AMX, else fp32) | fp32 | bf16."""
    quantize_kernel: str = DEFAULT_QUANTIZE_KERNEL
    """auto (native on a CPU where fp8train's C kernel builds, compiled on a GPU, else eager) | eager | native |
    compiled (all bit-identical; numerics/cast_kernels.py)."""
    all_gather: bool = False
    """train.parallel=fsdp2 only: all-gather Fp8Linear weights as FP8 codes + scale instead of fp32 (tensorwise
    recipes delayed and current; rowwise and block weights have per-row / per-tile weight scales)."""

    def _check(self) -> None:
        self._in("emulated_dtype", EMULATED_DTYPE_CHOICES)
        self._in("quantize_kernel", KERNEL_CHOICES)
        self._in("recipe", FP8_RECIPE_CHOICES)
        run_recipe = self.to_recipe()  # every recipe field checked by Fp8Recipe, and only there (built once here)
        # at config time, with the reason (nn/te.py), before anything is written
        if run_recipe.backend == GemmBackend.TE:
            raise ValueError(te_config_refusal(run_recipe))
        if self.all_gather:
            require(self.recipe != BASELINE_RECIPE and run_recipe.is_tensorwise, "fp8.all_gather", self.all_gather,
                     f"needs a tensorwise fp8.recipe ({' or '.join(TENSORWISE_SCALINGS)}); fp8.recipe="
                     f"{self.recipe} has no single per-tensor weight scale to gather with (set fp8.all_gather=false)")

    def recipe_overrides(self) -> dict:
        """The recipe fields this section sets (None = keep the preset's value), as given."""
        return {name: getattr(self, name) for name in RECIPE_KEYS if getattr(self, name) is not None}

    def to_recipe(self) -> Fp8Recipe:
        """The Fp8Recipe of fp8.recipe with the set fields applied (for the baseline 'none', the default preset:
        its fields are checked all the same). A field's bad value is a ValueError naming fp8.<field>.

        Built once, when the section is checked (where the config is read), and that same object is returned while
        the fields are unchanged: a run has one recipe, whichever part of it asks (set-up, fork, plan.json)."""
        key = (self.recipe, self.recipe_overrides())
        built = self.__dict__.get("_built_recipe")
        if built is None or built[0] != key:
            built = self._built_recipe = (key, self._build_recipe())
        return built[1]

    def _build_recipe(self) -> Fp8Recipe:
        name = DEFAULT_RECIPE if self.recipe == BASELINE_RECIPE else self.recipe
        overrides = self.recipe_overrides()
        try:
            return recipe(name, **overrides)  # lists (YAML) become tuples in Fp8Recipe, the one conversion
        except RecipeFieldError as e:
            raise ValueError(f"config fp8.{e.field}={_plain(e.value)!r} is invalid: {e}") from None
        except (ValueError, TypeError) as e:  # a rule over several fields (e.g. mixed OCP / FNUZ formats)
            raise ValueError(f"config fp8 (recipe {name!r} with {overrides}): {e}") from None


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def _recipe_keys() -> list[tuple[str, type, dataclasses.Field]]:
    """The fp8.* key of every Fp8Recipe field but PRESET_FIELDS, typed as the field (YAML primitives: a tuple
    becomes a list) and Optional with default None (keep the preset's value), _WHOLE_FIELDS with the field's
    default. Documented once, on Fp8Recipe."""
    hints = typing.get_type_hints(Fp8Recipe)
    keys = []
    for f in dataclasses.fields(Fp8Recipe):
        if f.name in PRESET_FIELDS:
            continue
        tp = List[int] if typing.get_origin(hints[f.name]) is tuple else hints[f.name]
        if f.name in _WHOLE_FIELDS:
            keys.append((f.name, tp, field(default=f.default)))
        else:
            keys.append((f.name, Optional[tp], field(default=None)))
    return keys


RECIPE_KEYS = tuple(name for name, _, _ in _recipe_keys())
# The fp8 section: _Fp8RunSection's keys, then one key per Fp8Recipe field (generated: the recipe is the config).
Fp8Config = dataclasses.make_dataclass("Fp8Config", _recipe_keys(), bases=(_Fp8RunSection,), namespace={
    "__module__": __name__,
    "__doc__": "The fp8 section: the preset (fp8.recipe), its overrides (one key per Fp8Recipe field, typed and "
               "documented there; null keeps the preset's value), and how the layers run."})


@dataclass
class PolicyConfig(Section):
    _section = "policy"
    min_features: int = _POLICY_DEFAULTS.min_features
    """Linears with in_features or out_features below this stay in high precision (too small to gain)."""
    divisible_by: int = _POLICY_DEFAULTS.divisible_by
    """in_features and out_features must be multiples of this (FP8 GEMM alignment)."""
    exclude: List[str] = field(default_factory=list)
    """Regexes over module names kept out of FP8, ADDED to the defaults (embeddings, output head, MoE routers:
    fp8train.nn.convert.DEFAULT_EXCLUDE). Each must match a Linear; names match with or without `hf.`."""
    exclude_defaults: bool = _POLICY_DEFAULTS.exclude_defaults
    """Apply the default exclude list too; false: policy.exclude is the whole list (e.g. lm_head in FP8)."""
    skip_first_blocks: int = _POLICY_DEFAULTS.skip_first_blocks
    """Keep the first N transformer blocks in high precision."""
    skip_last_blocks: int = _POLICY_DEFAULTS.skip_last_blocks
    """Keep the last N transformer blocks in high precision."""
    overrides: Dict[str, str] = field(default_factory=dict)
    """Per-layer recipes: ordered {regex: recipe name or bf16}; the first regex that re.searches a converted
    layer's name decides its recipe (nn/overrides.py). A regex matching no nn.Linear is an error."""
    linear_subclasses: List[str] = field(default_factory=list)
    """Class names of nn.Linear subclasses whose forward is plain x @ W.T + b, converted like nn.Linear (e.g.
    [FalconLinear]); each is checked on a random input before the swap. Others stay in high precision."""
    overrides_file: str = ""
    """A YAML file with policy.overrides (e.g. written by `fp8train layer-recipes`): its overrides come before
    policy.overrides."""
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
        for i, name in enumerate(self.linear_subclasses):
            if not name.isidentifier():
                raise ValueError(f"config policy.linear_subclasses[{i}]={name!r} is not a class name "
                                 "(e.g. FalconLinear)")
        if self.overrides_file:
            read_overrides_file(self.overrides_file)  # a missing or malformed file fails here, before anything runs


def read_overrides_file(path: str) -> tuple[tuple[str, str], ...]:
    """The validated policy.overrides of a policy.overrides_file (e.g. `fp8train layer-recipes` output), in file
    order."""
    check_settings_file(path, "config policy.overrides_file")
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"config policy.overrides_file={path!r}: cannot read it "
                         f"({getattr(e, 'strerror', None) or e})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config policy.overrides_file={path!r} is not YAML: {str(e).splitlines()[0]}") from None
    overrides = data.get("policy", {}).get("overrides") if isinstance(data, dict) and isinstance(
        data.get("policy"), dict) else None
    if not isinstance(overrides, dict) or not overrides:
        raise ValueError(f"config policy.overrides_file={path!r} has no policy.overrides mapping (write one with "
                         f"`fp8train layer-recipes RUN_DIR --out LAYERS.yaml`)")
    return normalize_overrides(overrides, f"config policy.overrides_file={path!r}: policy.overrides")



def fp8_recipe_from_config(cfg) -> Fp8Recipe | None:
    """The `Fp8Recipe` for `cfg.fp8` (named preset plus the non-None overrides), or None for recipe 'none'."""
    return None if cfg.fp8.recipe == BASELINE_RECIPE else cfg.fp8.to_recipe()


def layer_policy_from_config(cfg) -> LayerPolicy:
    """The `LayerPolicy` of `cfg.policy`."""
    p = cfg.policy
    return LayerPolicy(
        min_features=p.min_features,
        divisible_by=p.divisible_by,
        exclude=list(p.exclude),
        exclude_defaults=p.exclude_defaults,
        skip_first_blocks=p.skip_first_blocks,
        skip_last_blocks=p.skip_last_blocks,
        overrides=(read_overrides_file(p.overrides_file) if p.overrides_file else ()) + normalize_overrides(dict(p.overrides)),
        linear_subclasses=tuple(p.linear_subclasses),
    )
