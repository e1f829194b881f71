"""Run configuration: one typed dataclass per concern, composed in `FullConfig`.

Merge order (lingua-style): the schema defaults, then the YAML file, then `key=value` overrides from the command
line (`load_config`). The YAML schema holds primitives only ("e4m3fn", not a torch dtype);
`fp8_recipe_from_config` and `layer_policy_from_config` turn the merged config into the objects the FP8 code uses.

Where things live (each importable from here):
- `base`        the section mixin: construction-time checks that name the dotted key and what is allowed;
- `run`         run, train, optim, log, checkpoint sections;
- `model_data`  model and data sections;
- `fp8`         fp8 and policy sections, and the recipe / layer-policy objects built from them (their names and
                defaults come from fp8train.nn, defined once there);
- `validation`  the validate section;
- `full`        `FullConfig`, all sections composed;
- `load`        strict loading, YAML text, hashing;
- `arguments`   the command-line shape of config-driven commands (CONFIG or --config CONFIG, overrides).
"""

from fp8train.nn.convert import DEFAULT_EXCLUDE
from fp8train.nn.recipes import RECIPE_NAMES
from fp8train.training.config.arguments import add_config_arguments, resolve_config_arguments
from fp8train.training.config.fp8 import (BASELINE_RECIPE, FP8_RECIPE_CHOICES, Fp8Config, PolicyConfig,
                                          fp8_recipe_from_config, layer_policy_from_config)
from fp8train.training.config.full import FullConfig
from fp8train.training.config.load import HASH_EXCLUDE, apply_overrides, config_hash, config_to_yaml, load_config
from fp8train.training.config.model_data import DataConfig, ModelConfig
from fp8train.training.config.run import (AUTOCAST_MODES, AUTOCAST_PRECISION, DEVICES, WANDB_MODES, CheckpointConfig,
                                          LogConfig, OptimConfig, RunConfig, TrainConfig)
from fp8train.training.config.validation import ValidateConfig

__all__ = [
    "RunConfig", "ModelConfig", "DataConfig", "TrainConfig", "OptimConfig", "Fp8Config", "PolicyConfig",
    "LogConfig", "CheckpointConfig", "ValidateConfig", "FullConfig",
    "load_config", "apply_overrides", "config_to_yaml", "config_hash", "fp8_recipe_from_config", "layer_policy_from_config",
    "add_config_arguments", "resolve_config_arguments", "HASH_EXCLUDE", "RECIPE_NAMES", "FP8_RECIPE_CHOICES", "BASELINE_RECIPE",
    "DEFAULT_EXCLUDE", "WANDB_MODES", "DEVICES", "AUTOCAST_MODES", "AUTOCAST_PRECISION",
]
