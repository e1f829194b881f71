"""Per-layer FP8 health under transformers' Trainer, sent wherever `report_to` sends the Trainer's own logs.

    from fp8train import Fp8ScalingCallback, Fp8TelemetryCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Fp8ScalingCallback()])
    trainer.add_callback(Fp8TelemetryCallback(trainer, every=50))
    trainer.train()

The callback samples every `every`-th optimizer step (fp8train.training.runs.telemetry: the stats of that step's
last micro-batch) and logs the result with `trainer.log`, so it goes wherever the Trainer's own logs go: wandb,
TensorBoard, MLflow, ... as `report_to` says (wandb shows them under train/fp8/...), the log_history, and the
console. It holds the Trainer because a callback cannot reach the Trainer's loggers otherwise (callbacks given
to the Trainer run after the reporting integrations, so keys added to the Trainer's own logs would reach none).
"""

from __future__ import annotations

from fp8train.training.runs.telemetry import collect_fp8_telemetry, sample_fp8_telemetry

try:
    from transformers import TrainerCallback
except ImportError as err:  # the callback only exists for transformers users
    raise ImportError("Fp8TelemetryCallback needs Hugging Face transformers: pip install transformers  "
                      "(or fp8train[hf])") from err

__all__ = ["Fp8TelemetryCallback"]


class Fp8TelemetryCallback(TrainerCallback):
    """Every `every` optimizer steps, the model's per-layer FP8 health (fp8train.collect_fp8_telemetry) logged
    through `trainer.log`; per_layer=False logs only the worst cases over layers."""

    def __init__(self, trainer=None, every: int = 50, per_layer: bool = True):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"Fp8TelemetryCallback every={every!r}: an int >= 1 (optimizer steps between samples)")
        self.trainer, self.every, self.per_layer = trainer, every, per_layer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer is None or not hasattr(self.trainer, "log"):
            raise ValueError("Fp8TelemetryCallback needs the Trainer it logs through: "
                             "trainer.add_callback(Fp8TelemetryCallback(trainer, every=50))")

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        # global_step counts finished optimizer steps: this one becomes global_step + 1
        if model is not None and (state.global_step + 1) % self.every == 0:
            sample_fp8_telemetry(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.every:
            return
        metrics = collect_fp8_telemetry(model, self.per_layer)
        if metrics:
            self.trainer.log(metrics)
