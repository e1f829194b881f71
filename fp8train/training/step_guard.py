"""The training loop's non-finite guard, decided on the device, so that a step that logs nothing syncs nothing.

After every optimizer step the loop used to read the step's loss and gradient norm on the host (two host syncs)
to decide: stop as diverged, skip the update (train.skip_nonfinite_grads), or apply it. Here the same decision
is made on the device, every step, from the same two numbers:

    diverged  |= loss non-finite | grad norm non-finite and (guard off | MAX_CONSECUTIVE_SKIPS-th in a row)
    found_inf  = diverged | grad norm non-finite            (the optimizer leaves the step out: optim.AdamW)
    consecutive = consecutive + 1 if grad norm non-finite else 0

and the host reads the numbers back only at the loop's sync points (logging, evaluation, checkpoint and
telemetry steps, the last step): `read()` returns every step's (loss, grad norm) since the last sync in one
device-to-host copy, and the loop replays them through the rules it always had (same messages, same step
numbers, same counters); `read()` also checks that the device reached the same decision.

`diverged` is sticky: once set, every later step until the sync that reports it changes nothing. The
optimizer gets found_inf = 1, and `freeze_fp8_state()` (called just before update_fp8_scales) keeps the FP8
scaling state where the divergent step left it: its pending amaxes are set to -1 ("nothing recorded", so
the delayed-scaling update leaves history and scale alone), and the non-finite amax counters are put back to
their values at the start of each later step. So a run reports and ends in the state it had when it diverged,
whichever step the sync comes at (proven against log.every=1 in tests/test_step_syncs.py). On a skipped step
that is not a divergence the FP8 update runs as before (as the loop always did).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp8train.nn.recipes import ROLES

__all__ = ["MAX_CONSECUTIVE_SKIPS", "StepGuard", "Accounted", "divergence_reason"]

# With train.skip_nonfinite_grads, a run whose gradients stay non-finite this many optimizer steps in a row has
# diverged (it is no longer training: every step is skipped), and stops as such.
MAX_CONSECUTIVE_SKIPS = 5


def divergence_reason(skip_nonfinite_grads: bool, consecutive_skips: int, step: int, step_loss: float,
                      grad_norm: float) -> str | None:
    """Why step `step` (0-based) ends the run, or None: the rules as the host states them."""
    if not math.isfinite(step_loss):
        return f"loss became {step_loss} at step {step + 1}"
    if not math.isfinite(grad_norm) and not skip_nonfinite_grads:
        return (f"gradient norm became {grad_norm} at step {step + 1} (train.skip_nonfinite_grads=false, so the "
                "step was not applied)")
    if not math.isfinite(grad_norm) and consecutive_skips + 1 >= MAX_CONSECUTIVE_SKIPS:
        # steps numbered from 1, as everywhere: the last one is the step the run stopped at (diverged_at_step),
        # not applied; the ones before it were skipped and count among the steps the run took
        first = step + 2 - MAX_CONSECUTIVE_SKIPS
        return (f"gradient norm non-finite for {consecutive_skips + 1} steps in a row (steps {first}-{step + 1}): "
                f"{_steps(first, step)} skipped, the run stopped at step {step + 1}")
    return None


def _steps(first: int, last: int) -> str:
    return f"step {first} was" if first == last else f"steps {first}-{last} were"


@dataclass
class Accounted:
    """The steps since the last sync point, counted: the run's skip counters after them, the (loss, grad norm)
    of the newest step that did not diverge (None: none did), and the divergence, if one did."""

    skipped_steps: int
    consecutive_skips: int
    last: tuple[float, float] | None = None
    diverged_step: int | None = None  # 0-based
    reason: str | None = None


class StepGuard:
    """Device-side skip/divergence state of one run (see the module docstring)."""

    def __init__(self, device: torch.device, layers, skip_nonfinite_grads: bool, consecutive_skips: int):
        self.skip_nonfinite_grads = skip_nonfinite_grads
        self.consecutive = torch.full((), consecutive_skips, dtype=torch.int64, device=device)
        self.diverged = torch.zeros((), dtype=torch.bool, device=device)
        self.window: list[tuple[int, torch.Tensor]] = []  # (step, [loss, grad norm]) since the last read()
        self._counters = [getattr(layer, f"{role}_nonfinite_amax_count") for _, layer in layers for role in ROLES]
        self._pendings = [getattr(layer, f"{role}_pending_amax") for _, layer in layers if layer.recipe.is_delayed
                          for role in ROLES]
        self._counters_at_start = None
        self._diverged_before = self.diverged

    def begin_step(self) -> None:
        """Before the step's forward: what a frozen (diverged) run puts back afterwards."""
        self._diverged_before = self.diverged.clone()
        if self._counters:
            self._counters_at_start = torch.stack(self._counters)

    def decide(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """Record step `step` (0-based) with its () float64 loss (averaged over ranks) and () fp32 gradient norm;
        returns found_inf for the optimizer: () float32, 1.0 = leave this step's update out."""
        loss_bad = ~torch.isfinite(loss)
        grad_bad = ~torch.isfinite(grad_norm)
        if self.skip_nonfinite_grads:
            diverge = loss_bad | (grad_bad & (self.consecutive + 1 >= MAX_CONSECUTIVE_SKIPS))
        else:
            diverge = loss_bad | grad_bad
        self.diverged = self.diverged | diverge
        self.consecutive = torch.where(grad_bad, self.consecutive + 1, 0)
        self.window.append((step, torch.stack([loss.double(), grad_norm.double()])))
        return (self.diverged | grad_bad).float()

    def freeze_fp8_state(self) -> None:
        """Just before update_fp8_scales: a diverged run's FP8 state stays as its divergent step left it."""
        # one multi-tensor op per list: torch's foreach kernels have no public name
        if self._pendings:
            pending = torch.stack(self._pendings)
            torch._foreach_copy_(self._pendings, list(torch.where(self.diverged, -1.0, pending).unbind(0)))  # (above)
        if self._counters:
            kept = torch.where(self._diverged_before, self._counters_at_start, torch.stack(self._counters))
            torch._foreach_copy_(self._counters, list(kept.unbind(0)))  # (foreach: above)

    def account(self, skipped_steps: int, consecutive_skips: int) -> Accounted:
        """At a sync point: read the steps back and count them as the host counted every step before
        (divergence_reason; a non-finite gradient norm under the guard is one skipped step)."""
        steps, device_diverged, device_consecutive = self.read()
        out = Accounted(skipped_steps, consecutive_skips)
        for step, step_loss, norm in steps:
            grad_norm = norm if math.isfinite(step_loss) else math.nan  # a non-finite loss is reported as such
            reason = divergence_reason(self.skip_nonfinite_grads, out.consecutive_skips, step, step_loss, grad_norm)
            if reason is not None:
                out.diverged_step, out.reason = step, reason
                return out
            skipped = not math.isfinite(grad_norm)
            out.skipped_steps += skipped
            out.consecutive_skips = out.consecutive_skips + 1 if skipped else 0
            out.last = (step_loss, grad_norm)
        if device_diverged or device_consecutive != out.consecutive_skips:
            raise RuntimeError(f"internal error: the device's skip/divergence state (diverged={device_diverged}, "
                               f"consecutive={device_consecutive}) disagrees with the host's count")
        return out

    def read(self) -> tuple[list[tuple[int, float, float]], bool, int]:
        """The one host sync: [(step, loss, grad norm)] since the last read, and the device's `diverged` and
        `consecutive` after them (the loop checks that its replay of the rules agrees)."""
        if not self.window:
            return [], False, 0
        steps = [step for step, _ in self.window]
        flat = torch.cat([torch.stack([v for _, v in self.window]).reshape(-1),
                          torch.stack([self.diverged.double(), self.consecutive.double()])]).tolist()
        self.window = []
        values = [(step, flat[2 * i], flat[2 * i + 1]) for i, step in enumerate(steps)]
        return values, bool(flat[-2]), int(flat[-1])
