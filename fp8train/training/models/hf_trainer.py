"""Delayed scaling under transformers' Trainer: the callback that updates the scales after every optimizer step.

    from fp8train import Fp8ScalingCallback, convert_to_fp8
    convert_to_fp8(model, "delayed")
    Trainer(model=model, args=args, train_dataset=ds, callbacks=[Fp8ScalingCallback()]).train()

The Trainer never calls `update_fp8_scales`; without this callback a delayed recipe runs as current scaling (and
says so, once: fp8train.nn.linear). The callback calls it in `on_optimizer_step`, which the Trainer runs once per
optimizer step, after `optimizer.step()` and after every micro-batch of gradient accumulation has run its
forward and backward: the step's amax is the max over its micro-batches, as in fp8train's own loop. Under
torch.distributed the update all-reduces the amaxes with MAX, so every rank keeps the same scales. Recipes other
than delayed have nothing to update (no-op). Per-layer FP8 health under the Trainer: Fp8TelemetryCallback
(fp8train.training.runs.hf_telemetry).
"""

from __future__ import annotations

from fp8train.nn.linear import update_fp8_scales

try:
    from transformers import TrainerCallback
except ImportError as err:  # the callback only exists for transformers users
    raise ImportError("Fp8ScalingCallback needs Hugging Face transformers: pip install transformers  "
                      "(or fp8train[hf])") from err

__all__ = ["Fp8ScalingCallback"]


class Fp8ScalingCallback(TrainerCallback):
    """Roll the delayed-scaling amax histories of the Trainer's model once per optimizer step."""

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        if model is not None:
            update_fp8_scales(model)
