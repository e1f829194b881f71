"""Per-layer FP8 health: what each Fp8Linear's operands lose to quantization.

Every ``log.telemetry_every`` steps the loop turns ``layer.telemetry`` on for one step; each Fp8Linear then
records, per operand role (input, weight, grad_output): amax, scale, overflow (clipped) fraction, underflow
(flushed-to-zero) fraction, SQNR against the unquantized tensor and, for delayed scaling, staleness (this
step's amax over the amax its scale was made from: > 1 means the tensor grew past what its scale expected).
Sampling keeps the cost off the other steps. Records go to ``telemetry.jsonl`` (one line per sampled step,
every layer and role) and a few worst-case numbers go into metrics.jsonl and wandb.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from fp8train.nn.recipes import ROLES
from fp8train.training.rundir import append_jsonl, read_jsonl

STAT_KEYS = ("amax", "scale", "overflow_frac", "underflow_frac", "sqnr_db", "staleness", "nonfinite")


def enable(layers, on: bool) -> None:
    for _, layer in layers:
        layer.telemetry = on
        if on:
            layer.last_stats = {}


def collect(layers) -> dict:
    """{layer name: {role: stats}} from the last sampled forward/backward; turns sampling off."""
    stats = {}
    for name, layer in layers:
        stats[name] = {role: _plain(s) for role, s in getattr(layer, "last_stats", {}).items()}
        layer.telemetry = False
    return stats


def _plain(stats: dict) -> dict:
    out = {}
    for key, value in stats.items():
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value.float().mean().item()
        out[key] = value
    return out


def summarize(stats: dict) -> dict:
    """Worst cases across layers for the metrics line: max overflow/underflow per role, min SQNR per role."""
    out = {}
    for role in ROLES:
        rows = [s[role] for s in stats.values() if role in s]
        if not rows:
            continue
        out[f"fp8/{role}/overflow_max"] = max(r.get("overflow_frac", 0.0) or 0.0 for r in rows)
        out[f"fp8/{role}/underflow_max"] = max(r.get("underflow_frac", 0.0) or 0.0 for r in rows)
        sqnrs = [r["sqnr_db"] for r in rows if r.get("sqnr_db") is not None and math.isfinite(r["sqnr_db"])]
        if sqnrs:
            out[f"fp8/{role}/sqnr_min_db"] = min(sqnrs)
        stale = [r["staleness"] for r in rows if r.get("staleness") is not None]
        if stale:
            out[f"fp8/{role}/staleness_max"] = max(stale)
    return out


def counters(layers) -> dict:
    """Running event counts over all layers (non-finite amaxes that were kept out of the scales)."""
    out = {}
    for role in ROLES:
        total = 0
        for _, layer in layers:
            buf = getattr(layer, f"{role}_nonfinite_amax_count", None)
            if buf is not None:
                total += int(buf)
        out[f"fp8/{role}/nonfinite_amax_events"] = total
        # Delayed scaling: steps whose whole tensor fell below the smallest normal under a stale (outlier) scale.
        stale = [int(b) for b in (getattr(layer, f"{role}_stale_scale_steps", None) for _, layer in layers)
                 if b is not None]
        if stale:
            out[f"fp8/{role}/stale_scale_steps"] = sum(stale)
    return out


def append(path: Path, step: int, stats: dict, enabled: bool = True, extra: dict | None = None) -> None:
    """One telemetry.jsonl line; `extra` adds top-level keys ("shadow": recipe shadowing, "gemms": kernel paths)."""
    if enabled:  # strict JSON: non-finite floats as strings ("inf"), which _number reads back
        append_jsonl(path, [{"step": step, "layers": _strings_for_nonfinite(stats),
                             **_strings_for_nonfinite(extra or {})}])


def _strings_for_nonfinite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strings_for_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strings_for_nonfinite(v) for v in value]
    return value


def capture_step(model, layers, x, y, autocast) -> dict:
    """Re-run one micro-batch with telemetry on (used when a step diverges, to say which layer broke)."""
    enable(layers, True)
    was_training = model.training
    try:
        with autocast():
            _, loss = model(x, y)
        if torch.isfinite(loss):
            loss.backward()
    except RuntimeError:  # the point is to capture what we can
        pass
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return collect(layers)


def load(path: str | Path) -> list[dict]:
    return read_jsonl(path)  # a torn last line (kill -9 mid-append) is dropped; damage elsewhere is named


# ------------------------------------------------------------------------------------------------------------
# Aggregation for reports: telemetry.jsonl -> one row per layer and role, and the layers that should stay bf16
# ------------------------------------------------------------------------------------------------------------
# When a layer is better left in bf16 (the advisor's rule; stated in every report). SQNR: E4M3 keeps ~30 dB on
# well-scaled Gaussian data and E5M2 ~25 dB, so below 15 dB (~18% relative error) something is wrong with the
# layer's range, not with rounding. Overflow: a saturating cast turns clipped values into +-max, biased errors
# that do not average out, so even 0.1% matters. Underflow: flushed values are small, so a few percent is
# harmless; beyond 10% of a tensor the information loss shows in the loss.
ADVISOR_THRESHOLDS = {"sqnr_db_min": 15.0, "overflow_frac_max": 1e-3, "underflow_frac_max": 0.10}


def _number(value) -> float | None:
    """A stat as float (telemetry.jsonl writes non-finite floats as strings such as "inf"), or None."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def layer_table(records: list[dict]) -> dict:
    """{layer: {role: {overflow_frac, underflow_frac, sqnr_db (means over samples), overflow_frac_max,
    underflow_frac_max, sqnr_db_min, staleness_max, samples}}} from telemetry.jsonl records (``load``).

    A step logged twice (a resumed run repeats the steps after its checkpoint) counts once, the later line.
    SQNR means are taken over finite samples (an exact tensor has SQNR inf)."""
    by_step = {int(r["step"]): r["layers"] for r in records}
    samples: dict = {}
    for step in sorted(by_step):
        for layer, roles in by_step[step].items():
            for role, stats in roles.items():
                samples.setdefault(layer, {}).setdefault(role, []).append(stats)
    table = {}
    for layer, roles in samples.items():
        for role, rows in roles.items():
            over = [v for v in (_number(r.get("overflow_frac")) for r in rows) if v is not None]
            under = [v for v in (_number(r.get("underflow_frac")) for r in rows) if v is not None]
            sqnr_all = [v for v in (_number(r.get("sqnr_db")) for r in rows) if v is not None]
            sqnr = [v for v in sqnr_all if math.isfinite(v)]
            stale = [v for v in (_number(r.get("staleness")) for r in rows) if v is not None]
            table.setdefault(layer, {})[role] = {
                "overflow_frac": _mean(over), "overflow_frac_max": max(over, default=None),
                "underflow_frac": _mean(under), "underflow_frac_max": max(under, default=None),
                "sqnr_db": _mean(sqnr) if sqnr else (math.inf if sqnr_all else None),
                "sqnr_db_min": min(sqnr_all, default=None),
                "staleness_max": max(stale, default=None), "samples": len(rows),
            }
    return table


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def advise(table: dict, thresholds: dict | None = None) -> dict:
    """{layer: [reasons]} for layers whose mean telemetry crosses ADVISOR_THRESHOLDS in any role."""
    t = {**ADVISOR_THRESHOLDS, **(thresholds or {})}
    flagged: dict[str, list[str]] = {}
    for layer, roles in table.items():
        for role, s in roles.items():
            if s["sqnr_db"] is not None and s["sqnr_db"] < t["sqnr_db_min"]:
                flagged.setdefault(layer, []).append(f"{role} SQNR {s['sqnr_db']:.1f} dB < {t['sqnr_db_min']:g}")
            if s["overflow_frac"] is not None and s["overflow_frac"] > t["overflow_frac_max"]:
                flagged.setdefault(layer, []).append(
                    f"{role} overflow {s['overflow_frac']:.2%} > {t['overflow_frac_max']:.2%}")
            if s["underflow_frac"] is not None and s["underflow_frac"] > t["underflow_frac_max"]:
                flagged.setdefault(layer, []).append(
                    f"{role} underflow {s['underflow_frac']:.1%} > {t['underflow_frac_max']:.0%}")
    return flagged


def exclude_regex(layer: str) -> str:
    """An anchored policy.exclude regex matching exactly this module name."""
    return "^" + re.escape(layer) + "$"
