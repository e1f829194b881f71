"""transformers.Trainer callbacks: delayed-scaling updates, and per-layer FP8 health sent to `report_to`.

    from fp8train import Fp8ScalingCallback, Fp8TelemetryCallback, convert_to_fp8
    convert_to_fp8(model, "delayed")
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Fp8ScalingCallback()])
    trainer.add_callback(Fp8TelemetryCallback(trainer, every=50))
    trainer.train()

The Trainer never calls `update_fp8_scales`; without Fp8ScalingCallback a delayed recipe runs as current scaling
(and says so, once: fp8train.nn.linear). The callback calls it in `on_optimizer_step`, which the Trainer runs once
per optimizer step, after `optimizer.step()` and after every micro-batch of gradient accumulation has run its
forward and backward: the step's amax is the max over its micro-batches, as in fp8train's own loop. Under
torch.distributed the update all-reduces the amaxes with MAX, so every rank keeps the same scales. Recipes other
than delayed have nothing to update (no-op).

Fp8TelemetryCallback samples every `every`-th optimizer step (fp8train.training.runs.telemetry: the stats of
that step's last micro-batch) and logs the result with `trainer.log`, so it goes wherever the Trainer's own logs
go: wandb, TensorBoard, MLflow, ... as `report_to` says (wandb shows them under train/fp8/...), the
log_history, and the console. It holds the Trainer because a callback cannot reach the Trainer's loggers
otherwise (callbacks run after the reporting integrations, so adding keys to the Trainer's own logs would reach
none of them).
"""

from __future__ import annotations

from fp8train.nn.linear import update_fp8_scales
from fp8train.training.runs.telemetry import collect_fp8_telemetry, sample_fp8_telemetry

try:
    from transformers import TrainerCallback
except ImportError as err:  # the callbacks only exist for transformers users
    raise ImportError("Fp8ScalingCallback and Fp8TelemetryCallback need Hugging Face transformers: pip install "
                      "transformers  (or fp8train[hf])") from err

__all__ = ["Fp8ScalingCallback", "Fp8TelemetryCallback"]


class Fp8ScalingCallback(TrainerCallback):
    """Roll the delayed-scaling amax histories of the Trainer's model once per optimizer step."""

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            update_fp8_scales(model)


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
