"""The advisor: which layers are better left in bf16, from their sampled FP8 health (telemetry.jsonl).

Each Fp8Linear's sampled steps are aggregated per operand role (input, weight, grad_output) into a mean and a
worst step. A layer is flagged when, in any role, EITHER the mean over its sampled steps crosses a
MEAN_THRESHOLDS entry, OR a single sampled step crosses a WORST_STEP_THRESHOLDS entry; every reason names the
role, the value, the threshold and, for the worst step, the step (and seed) it happened at. Averages hide spikes:
a grad_output at 2.2 dB SQNR on one step of three averages to a healthy-looking 20 dB.

Why these numbers. E4M3 keeps ~30 dB SQNR on well-scaled Gaussian data and E5M2 ~25 dB, so a mean below 15 dB
(~18% relative error) means the layer's range, not rounding, is wrong; one step below 10 dB (~32% error) is a
spike worth a look. Overflow: a saturating cast turns clipped values into +-max, biased errors that do not
average out, so 0.1% on average matters, and 1% on one step. Underflow: flushed values are small, so a few
percent is harmless; beyond 10% on average, or half the tensor on one step, the information loss shows.
Staleness (delayed scaling: this step's amax over the amax its scale was made from) above 4 on one step means the
tensor outgrew its scale by two binades, which its top values lose to clipping.
"""

from __future__ import annotations

import math
import re

from fp8train.training.runs.telemetry import expert_layer_of

__all__ = ["MEAN_THRESHOLDS", "WORST_STEP_THRESHOLDS", "layer_table", "advise", "by_policy_layer", "exclude_regex",
           "worst_layers", "number"]

# Crossed by the mean over a layer's sampled steps.
MEAN_THRESHOLDS = {"sqnr_db_min": 15.0, "overflow_frac_max": 1e-3, "underflow_frac_max": 0.10}
# Crossed by any single sampled step.
WORST_STEP_THRESHOLDS = {"sqnr_db_min": 10.0, "overflow_frac_max": 1e-2, "underflow_frac_max": 0.50,
                         "staleness_max": 4.0}


def number(value) -> float | None:
    """A stat as float (telemetry.jsonl may hold non-finite floats as strings such as "inf"), or None."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _role_row(rows: list[tuple[dict, dict]]) -> dict:
    """Mean and worst step of one layer's role; ``rows`` = [(stats, where)] with where = {step, seed}."""
    def series(key):
        return [(v, where) for v, where in ((number(s.get(key)), w) for s, w in rows) if v is not None]

    over, under, sqnr_all, stale = series("overflow_frac"), series("underflow_frac"), series("sqnr_db"), \
        series("staleness")
    sqnr = [v for v, _ in sqnr_all if math.isfinite(v)]
    out = {"overflow_frac": _mean([v for v, _ in over]), "underflow_frac": _mean([v for v, _ in under]),
           # an exact tensor has SQNR inf: finite samples are averaged, all-exact stays inf (never flagged)
           "sqnr_db": _mean(sqnr) if sqnr else (math.inf if sqnr_all else None), "samples": len(rows)}
    for key, samples, pick in (("overflow_frac_max", over, max), ("underflow_frac_max", under, max),
                               ("sqnr_db_min", sqnr_all, min), ("staleness_max", stale, max)):
        out[key], out[key + "_at"] = pick(samples, key=lambda sample: sample[0]) if samples else (None, None)
    return out


def layer_table(records: list[dict]) -> dict:
    """{layer: {role: row}} from telemetry.jsonl records ({"step", "layers"}, optionally "seed" when records of
    several runs are pooled). A row holds the means over samples (overflow_frac, underflow_frac, sqnr_db), the
    worst sample of each (overflow_frac_max, underflow_frac_max, sqnr_db_min, staleness_max) with where it
    happened (`<key>_at` = {"step", "seed"}), and the sample count. A (seed, step) logged twice (a resumed run
    repeats the steps after its checkpoint) counts once, the later line."""
    by_step = {(r.get("seed"), int(r["step"])): r["layers"] for r in records}
    samples: dict = {}
    for seed, step in sorted(by_step, key=lambda k: (str(k[0]), k[1])):
        for layer, roles in by_step[(seed, step)].items():
            for role, stats in roles.items():
                samples.setdefault(layer, {}).setdefault(role, []).append((stats, {"step": step, "seed": seed}))
    return {layer: {role: _role_row(rows) for role, rows in roles.items()} for layer, roles in samples.items()}


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _at(where: dict | None) -> str:
    if not where:
        return ""
    seed = f" (seed {where['seed']})" if where.get("seed") is not None else ""
    return f" at step {where['step']}{seed}"


def _role_reasons(role: str, s: dict, mean_t: dict, worst_t: dict) -> list[str]:
    reasons = []
    if s["sqnr_db"] is not None and s["sqnr_db"] < mean_t["sqnr_db_min"]:
        reasons.append(f"{role} mean SQNR {s['sqnr_db']:.1f} dB < {mean_t['sqnr_db_min']:g}")
    elif s["sqnr_db_min"] is not None and s["sqnr_db_min"] < worst_t["sqnr_db_min"]:
        reasons.append(f"{role} SQNR {s['sqnr_db_min']:.1f} dB < {worst_t['sqnr_db_min']:g}{_at(s['sqnr_db_min_at'])}")
    for key, what, fmt in (("overflow_frac", "overflow", ".2%"), ("underflow_frac", "underflow", ".1%")):
        mean, worst = s[key], s[key + "_max"]
        if mean is not None and mean > mean_t[key + "_max"]:
            reasons.append(f"{role} mean {what} {mean:{fmt}} > {mean_t[key + '_max']:{fmt}}")
        elif worst is not None and worst > worst_t[key + "_max"]:
            reasons.append(f"{role} {what} {worst:{fmt}} > {worst_t[key + '_max']:{fmt}}{_at(s[key + '_max_at'])}")
    stale = s.get("staleness_max")
    if stale is not None and stale > worst_t["staleness_max"]:
        reasons.append(f"{role} staleness {stale:.1f}x > {worst_t['staleness_max']:g}x{_at(s['staleness_max_at'])}")
    return reasons


def advise(table: dict, mean_thresholds: dict | None = None, worst_thresholds: dict | None = None) -> dict:
    """{layer: [reasons]} for layers whose telemetry crosses a mean or a worst-step threshold in any role."""
    mean_t = {**MEAN_THRESHOLDS, **(mean_thresholds or {})}
    worst_t = {**WORST_STEP_THRESHOLDS, **(worst_thresholds or {})}
    flagged: dict[str, list[str]] = {}
    for layer, roles in table.items():
        for role, s in roles.items():
            reasons = _role_reasons(role, s, mean_t, worst_t)
            if reasons:
                flagged.setdefault(layer, []).extend(reasons)
    return flagged


def by_policy_layer(flagged: dict) -> dict:
    """advise()'s {name: reasons} with per-expert telemetry names (`{grouped layer}.expert{e}`) folded into their
    grouped layer, the unit policy.exclude works on (all of a layer's experts or none); each such reason is
    prefixed by its expert ("expert3: grad_output mean SQNR ...")."""
    out: dict = {}
    for name, reasons in flagged.items():
        layer = expert_layer_of(name)
        prefix = f"{name.rpartition('.')[2]}: " if layer is not None else ""
        out.setdefault(layer or name, []).extend(prefix + r for r in reasons)
    return out


def exclude_regex(layer: str) -> str:
    """An anchored policy.exclude regex matching exactly this module name."""
    return "^" + re.escape(layer) + "$"


def worst_layers(stats: dict, n: int = 3) -> list[str]:
    """The layers/roles that look worst in a one-step telemetry capture (non-finite first, then low SQNR)."""
    rows = []
    for layer, roles in stats.items():
        for role, s in roles.items():
            amax, sqnr = number(s.get("amax")), number(s.get("sqnr_db"))
            bad = bool(s.get("nonfinite")) or (amax is not None and not math.isfinite(amax))
            rows.append((0 if bad else 1, sqnr if sqnr is not None and math.isfinite(sqnr) else 1e9, layer, role, s))
    rows.sort(key=lambda r: (r[0], r[1]))
    return [f"{layer} {role}: amax {s.get('amax')}, SQNR {s.get('sqnr_db')}, overflow {s.get('overflow_frac')}, "
            f"underflow {s.get('underflow_frac')}" for _, _, layer, role, s in rows[:n]]
