"""Experiment trackers through accelerate's tracker classes: wandb, TensorBoard, MLflow, Aim, ...

`log.trackers` lists accelerate's tracker names; wandb runs when it is listed and its mode is not `disabled`
(offline, the default, writes under the run directory with no network; `wandb sync <run_dir>/wandb/offline-run-*`
uploads it later). Trackers whose logs are files write them under the run directory (`<run_dir>/tensorboard`, ...).

wandb's own environment variables are honoured unless the config sets the value. "Sets" means a non-empty value:
`log.wandb` and `log.wandb_project` default to "" (not to offline and fp8train), so a value written in the YAML
or on the command line, even one equal to the old default, wins, and an unset one falls to WANDB_MODE /
WANDB_PROJECT, then to offline / fp8train. (The empty default survives every copy of the config: the saved
config.yaml of a resumed run, and the derived configs of a validation's runs.) WANDB_DIR, for which there is no
config key, moves wandb's files from the run directory to $WANDB_DIR/wandb. WANDB_NAME names the run when
`log.wandb_name` is "". The tracker config records the resolved mode and project.

What every tracker gets, once at the start: the resolved config (the `fp8` section with the recipe's actual
values, not the nulls that mean "preset default"), the conversion report (which layers are FP8, which stayed
high precision and why) and the model's own config. Then every logged metrics line, step 0's validation loss
included.

Resumed runs are one tracker run: the wandb run id is stored in `<run_dir>/trackers.json` when a run starts and
reused (wandb `resume="allow"`) by every resume of it.

The trackers are started and finished here on the main process, not through `Accelerator.init_trackers` /
`end_training`: `end_training` also destroys the process group, which a multi-process run still needs for its
last barrier (and which `fp8train validate` needs for its next run).
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from pathlib import Path

from accelerate.tracking import LOGGER_TYPE_TO_CLASS, get_available_trackers
from omegaconf import OmegaConf

from fp8train.training.config.model_data import drop_decoder_fields
from fp8train.training.storage.files import json_safe, read_json, write_json_atomic
from fp8train.training.storage.rundir import TRACKERS_FILE

__all__ = ["Trackers", "check_trackers_available", "tracked_config", "wandb_mode", "wandb_project"]

DEFAULT_WANDB_MODE, DEFAULT_WANDB_PROJECT = "offline", "fp8train"
# WANDB_MODE values wandb itself accepts, as the mode they mean (dryrun and run are its older spellings)
WANDB_ENV_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline",
                   "disabled": "disabled"}


def wandb_mode(cfg, env=os.environ) -> str:
    """log.wandb if the config sets it, else WANDB_MODE if set, else offline (ValueError for an unknown
    WANDB_MODE, naming the values wandb accepts)."""
    if cfg.log.wandb:
        return cfg.log.wandb
    value = env.get("WANDB_MODE", "").strip().lower()
    if not value:
        return DEFAULT_WANDB_MODE
    if value not in WANDB_ENV_MODES:
        raise ValueError(f"environment WANDB_MODE={env['WANDB_MODE']!r} is not a wandb mode: use one of "
                         f"{list(WANDB_ENV_MODES)}, or set log.wandb, which wins over it")
    return WANDB_ENV_MODES[value]


def wandb_project(cfg, env=os.environ) -> str:
    """log.wandb_project if the config sets it, else WANDB_PROJECT if set, else fp8train."""
    return cfg.log.wandb_project or env.get("WANDB_PROJECT", "").strip() or DEFAULT_WANDB_PROJECT


def active_trackers(cfg) -> list[str]:
    return [t for t in cfg.log.trackers if t != "wandb" or wandb_mode(cfg) != "disabled"]


def check_trackers_available(cfg) -> None:
    """ImportError naming what to install for a listed tracker whose package is missing (before any write)."""
    available = {str(t) for t in get_available_trackers()}
    missing = [t for t in active_trackers(cfg) if t not in available]
    if missing:
        raise ImportError(f"log.trackers lists {', '.join(missing)} but its package is not installed "
                          f"(pip install {' '.join(missing)}), or remove it from log.trackers")


def tracked_config(cfg, fp8_recipe, conversion, model) -> dict:
    """What the trackers store as the run's configuration (see the module docstring)."""
    config = drop_decoder_fields(OmegaConf.to_container(OmegaConf.structured(cfg)))  # unused by an HF model
    if fp8_recipe is not None:
        resolved = dataclasses.asdict(fp8_recipe)
        config["fp8"] = {**config["fp8"], **{k: v for k, v in resolved.items() if k in config["fp8"]},
                         "preset": fp8_recipe.name, "code": fp8_recipe.code()}
    model_config = getattr(getattr(model, "hf", model), "config", None)  # HFCausalLM wraps the transformers model
    if hasattr(model_config, "to_dict"):  # a transformers model: its own config, as loaded
        model_config = model_config.to_dict()
    else:
        model_config = {**config["model"], "kv_heads": cfg.model.kv_heads(), "ffn_dim": cfg.model.ffn_dim()}
    config["model_config"] = model_config
    config["conversion"] = conversion.to_dict() if conversion is not None else None
    config["log"] = {**config["log"], "wandb": wandb_mode(cfg), "wandb_project": wandb_project(cfg)}  # resolved
    return json.loads(json.dumps(json_safe(config), default=str))


def _flatten(values: dict, prefix: str = "") -> dict:
    """Dotted keys and scalar values, for trackers that take only flat hyperparameters (TensorBoard's hparams)."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, (bool, int, float, str)) or value is None:
            flat[prefix + key] = value
        else:
            flat[prefix + key] = json.dumps(value)
    return flat


def _run_ids(run_dir: Path, fresh: bool) -> dict:
    """Tracker run ids of this run directory: a new wandb id for a fresh run, the stored one on resume."""
    path = run_dir / TRACKERS_FILE
    ids = {} if fresh or not path.exists() else read_json(path)
    if "wandb_run_id" not in ids:
        ids["wandb_run_id"] = uuid.uuid4().hex[:16]
    write_json_atomic(path, ids)
    return ids


def _wandb_kwargs(cfg, run_dir: Path, run_id: str) -> dict:
    """wandb.init's arguments (see the module docstring for what comes from the environment)."""
    log = cfg.log
    # passed explicitly, even WANDB_DIR: wandb reads its environment once per process, at its first init
    kwargs = {"mode": wandb_mode(cfg), "name": log.wandb_name or os.environ.get("WANDB_NAME") or cfg.run.name,
              "id": run_id, "resume": "allow", "dir": os.environ.get("WANDB_DIR") or str(run_dir)}
    kwargs.update({key: value for key, value in (("group", log.wandb_group), ("job_type", log.wandb_job_type),
                                                 ("tags", list(log.wandb_tags))) if value})
    return kwargs


class Trackers:
    """The run's trackers (main process only; every other rank holds an empty list)."""

    def __init__(self, cfg, run_dir: Path, is_main: bool, fresh: bool):
        self.trackers = []
        names = active_trackers(cfg) if is_main else []
        if not names:
            return
        ids = _run_ids(run_dir, fresh)
        os.environ.setdefault("WANDB_SILENT", "true")  # our progress bar and summary line say what matters
        for name in names:
            tracker_cls = LOGGER_TYPE_TO_CLASS[name]
            kwargs = {}
            if name == "wandb":
                kwargs = _wandb_kwargs(cfg, run_dir, ids["wandb_run_id"])
            if tracker_cls.requires_logging_directory:
                tracker = tracker_cls(name, str(run_dir), **kwargs)  # logs under <run_dir>/<name>
            else:
                tracker = tracker_cls(wandb_project(cfg), **kwargs)
            tracker.start()
            self.trackers.append(tracker)

    def store_config(self, config: dict) -> None:
        for tracker in self.trackers:
            tracker.store_init_configuration(config if tracker.name == "wandb" else _flatten(config))

    def log(self, record: dict, step: int) -> None:
        values = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for tracker in self.trackers:
            tracker.log(values, step=step)

    def finish(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
