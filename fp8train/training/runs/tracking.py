"""Experiment trackers through accelerate's tracker classes: wandb, TensorBoard, MLflow, Aim, ...

`log.trackers` lists accelerate's tracker names; wandb runs when it is listed and `log.wandb` is not `disabled`
(`log.wandb` keeps its meaning: offline, the default, writes under the run directory with no network; `wandb
sync <run_dir>/wandb/offline-run-*` uploads it later). Trackers whose logs are files write them under the run
directory (`<run_dir>/tensorboard`, ...).

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

__all__ = ["Trackers", "check_trackers_available", "tracked_config"]

def active_trackers(cfg) -> list[str]:
    return [t for t in cfg.log.trackers if t != "wandb" or cfg.log.wandb != "disabled"]


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
                kwargs = {"mode": cfg.log.wandb, "dir": str(run_dir), "name": cfg.run.name,
                          "id": ids["wandb_run_id"], "resume": "allow"}
            if tracker_cls.requires_logging_directory:
                tracker = tracker_cls(name, str(run_dir), **kwargs)  # logs under <run_dir>/<name>
            else:
                tracker = tracker_cls(cfg.log.wandb_project, **kwargs)
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
