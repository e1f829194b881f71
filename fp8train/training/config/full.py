"""The whole run configuration: one section per concern, composed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8train.training.config.fp8 import Fp8Config, PolicyConfig
from fp8train.training.config.model_data import DataConfig, ModelConfig
from fp8train.training.config.run import CheckpointConfig, LogConfig, OptimConfig, RunConfig, TrainConfig
from fp8train.training.config.validation import ValidateConfig


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

    def __post_init__(self) -> None:
        if self.fp8.all_gather and self.train.parallel != "fsdp2":
            raise ValueError(f"config fp8.all_gather=true is invalid: it changes how FSDP2 all-gathers weights, "
                             f"and train.parallel={self.train.parallel}; set train.parallel=fsdp2 or "
                             "fp8.all_gather=false")
        if self.fp8.all_gather and self.train.tp_size > 1:  # (the FP8 weight all-gather covers 1-D FSDP2 only)
            raise ValueError(f"config fp8.all_gather=true is invalid with train.tp_size={self.train.tp_size}: FP8 "
                             "weight all-gathers are not built for a (dp, tp) mesh; set fp8.all_gather=false")

    @property
    def run_dir(self) -> Path:
        """<run.dir>/<run.name> (fp8train.training.storage.rundir says where everything in it lives)."""
        return Path(self.run.dir) / self.run.name
