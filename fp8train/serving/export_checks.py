"""What an export says about its source, checked: the source did not end diverged, and the reloaded export's
logits are within the documented bounds of the source model's (docs/serving.md).

A diverged run's last good checkpoint can hold weights far outside what FP8 represents well (an export of one
measured logits max |diff| 4.4e4, mean KL 250): ``export`` refuses a run whose summary.json says it ended
diverged, or was stopped by a validation's divergence guard, unless ``--allow-diverged``. A run still training
has no summary yet and is exported at the checkpoint it is read at (serving.run_loading). After writing, the
export is reloaded and compared with that same in-memory source; a comparison outside FIDELITY_BOUNDS is printed
with its figures and the command exits 1.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn

from fp8train.training.runs.checkpoint import list_checkpoints
from fp8train.training.runs.source_status import REFUSED_STATUSES, failed_summary, failure_text
from fp8train.training.storage.rundir import CHECKPOINTS_DIR

__all__ = ["REFUSED_STATUSES", "FIDELITY_BOUNDS", "MOE_FIDELITY_BOUNDS", "refuse_failed_source", "compare_logits",
           "outside_bounds", "print_check", "fidelity_bounds"]

# Per comparison of an export with its source, on the run's first validation batches (docs/serving.md)
FIDELITY_BOUNDS = {"max_abs_logit_diff": 0.5, "mean_kl": 1e-3}
# A mixture-of-experts model routes each token to its top-k experts: FP8 weights move a router score by a rounding
# step, and a token whose two best experts were nearly tied goes to another expert, which moves its logits by far
# more than rounding does (a tiny Qwen3-MoE: max |diff| 1.5 at mean KL 6e-4, 98.8% top-1). For such models only the
# mean KL is bounded: it averages the few flipped tokens with the rest.
MOE_FIDELITY_BOUNDS = {"mean_kl": FIDELITY_BOUNDS["mean_kl"]}
_BOUND_NAMES = {"max_abs_logit_diff": "max|diff|", "mean_kl": "mean KL"}


def refuse_failed_source(run_dir, allow_diverged: bool, action: str = "export") -> None:
    """ValueError when ``run_dir``'s summary.json says the run ended diverged or stopped, unless allowed
    (``action``: what the command would do with it, for the message)."""
    summary = None if allow_diverged else failed_summary(run_dir)
    if summary is not None:
        ended = failure_text(run_dir, summary)
        if not list_checkpoints(Path(run_dir) / CHECKPOINTS_DIR):  # said first: --allow-diverged would not help
            raise ValueError(f"{ended} and has no checkpoint under {CHECKPOINTS_DIR}/: nothing to {action} (train "
                             "with checkpoint.save_final=true; nothing was written)")
        raise ValueError(f"{ended}; its last checkpoint is not a model to serve. Pass --allow-diverged to {action} "
                         "it anyway (nothing was written)")


@torch.no_grad()
def compare_logits(model_a: nn.Module, model_b: nn.Module, batches, autocast: bool = True) -> dict:
    """max |logit diff|, mean KL(p_a || p_b) per token and top-1 agreement of two models on the same inputs."""
    max_abs, kl_sum, agree, tokens = 0.0, 0.0, 0, 0
    for x, _ in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits_a = model_a(x)[0].float()
            logits_b = model_b(x)[0].float()
        logp_a, logp_b = logits_a.log_softmax(-1), logits_b.log_softmax(-1)
        max_abs = max(max_abs, float((logits_a - logits_b).abs().max()))
        kl_sum += float((logp_a.exp() * (logp_a - logp_b)).sum(-1).sum())
        agree += int((logits_a.argmax(-1) == logits_b.argmax(-1)).sum())
        tokens += x.numel()
    return {"max_abs_logit_diff": max_abs, "mean_kl": kl_sum / tokens, "top1_agreement": agree / tokens,
            "tokens": tokens}


def fidelity_bounds(model: nn.Module) -> dict:
    """The bounds an export of ``model`` is held to: MOE_FIDELITY_BOUNDS when it has experts (3-D weights: only
    expert weights are 3-D here), else FIDELITY_BOUNDS."""
    return MOE_FIDELITY_BOUNDS if any(p.dim() == 3 for p in model.parameters()) else FIDELITY_BOUNDS


def outside_bounds(check: dict, bounds: dict = FIDELITY_BOUNDS) -> list[str]:
    """Each figure of ``check`` ({comparison: compare_logits result}) over its bound (a NaN is over)."""
    return [f"{name}: {_BOUND_NAMES[key]} {stats[key]:.4g} > {bound:g}" for name, stats in check.items()
            for key, bound in bounds.items() if not (math.isfinite(stats[key]) and stats[key] <= bound)]


def print_check(check: dict, out, bounds: dict = FIDELITY_BOUNDS) -> int:
    """Print the comparisons; 0 when all are within ``bounds``, else 1 after one line naming what is over."""
    for name, stats in check.items():
        print(f"  logits {name}: max|diff| {stats['max_abs_logit_diff']:.4g}, mean KL {stats['mean_kl']:.3g}, "
              f"top-1 agreement {100 * stats['top1_agreement']:.2f}% over {stats['tokens']} tokens")
    over = outside_bounds(check, bounds)
    if over:
        shown = ", ".join(f"{_BOUND_NAMES[k]} <= {v:g}" for k, v in bounds.items())
        print(f"fp8train export: the export at {out} is outside the documented bounds ({shown}): "
              f"{'; '.join(over)}. It was written, but does not match its source", file=sys.stderr)
        return 1
    return 0
