"""The verdict of a validation directory, recomputed from its files: plan.json and every run's metrics.jsonl,
summary.json and telemetry.jsonl. The arithmetic is fp8train.evidence.stats; this module gathers its inputs,
one paired gap per seed, and what went wrong in which run.

summary.json names (scripts and CI read them): top-level `verdict` (pass | fail | inconclusive); under
`candidates`, keyed by label: `verdict`, `gap_mean`, `gap_lower`, `gap_upper` (relative gaps, one-sided 95%
bounds), `mdg` (minimum detectable gap, one-sided 95%, 80% power) and `seeds` (paired seeds in the estimate).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from fp8train.evidence import advisor, stats
from fp8train.evidence.curves import Curve, load_curve
from fp8train.evidence.pairs import BASELINE, PLAN_FILE, run_dir
from fp8train.training import telemetry
from fp8train.training.rundir import METRICS_FILE, SUMMARY_FILE, TELEMETRY_FILE, read_json

__all__ = ["RunData", "load_validation", "summarize_validation", "METHOD"]

METHOD = ("Per seed s, the paired gap g_s = (candidate - bf16) / bf16 of the mean validation loss over the final "
          "window (the same steps, the same validation batches, the same initial weights and batches for both). "
          "Over the n seeds: mean, sample sd, and one-sided 95% Student-t bounds mean -/+ t(0.95, n-1) sd/sqrt(n). "
          "PASS: upper bound <= margin. FAIL: a run diverged or stopped, a loss is non-finite, or lower bound > "
          "margin. Otherwise INCONCLUSIVE. Minimum detectable gap (one-sided 95%, 80% power): "
          "(t(0.95, n-1) + t(0.80, n-1)) sd/sqrt(n).")


class RunData:
    """One run directory read back: its summary (None while running), losses and telemetry records."""

    def __init__(self, path: Path, label: str, seed: int | None = None):
        self.dir, self.label, self.seed = path, label, seed
        self.summary = read_json(path / SUMMARY_FILE) if (path / SUMMARY_FILE).exists() else None
        self.damage: list[str] = []  # damaged lines of its logs, skipped (file and line each)
        self.curve: Curve = load_curve(path, on_damaged=self.damage.append)
        self.telemetry = [dict(r, seed=seed) for r in telemetry.load(path / TELEMETRY_FILE, self.damage.append)]

    def missing_evaluations(self, steps: list[int]) -> list[int]:
        """Of `steps` (evaluation steps a completed run logs), those its metrics.jsonl has no val_loss for."""
        return [s for s in steps if s not in self.curve.val]

    @property
    def status(self) -> str:
        if self.summary is None:
            return "running" if self.curve.val or self.curve.train else "missing"
        return self.summary.get("status", "unknown")

    @property
    def tokens_per_s(self) -> float | None:
        # Median of the logged steps: robust to the first step's warm-up and to resumes (wall time is not).
        return statistics.median(self.curve.tokens_per_s) if self.curve.tokens_per_s else None

    def final(self, window: int) -> float | None:
        steps = stats.window_steps(self.curve.val, window)
        value = sum(self.curve.val[s] for s in steps) / len(steps) if steps else math.nan
        return value if math.isfinite(value) else None


def load_validation(vdir: Path) -> tuple[dict, dict[str, dict[int, RunData]]]:
    """(plan, {label: {seed: RunData}}) of a validation directory, the baseline under BASELINE."""
    plan = read_json(vdir / PLAN_FILE)
    labels = [BASELINE] + [c["label"] for c in plan["candidates"]]
    runs = {label: {seed: RunData(run_dir(vdir, label, seed), label, seed) for seed in plan["seeds"]}
            for label in labels}
    return plan, runs


def final_evaluations(plan: dict, window: int) -> list[int]:
    """The last `window` evaluation steps every completed run of the plan logs (train.eval_every multiples and
    the last step, as the loop evaluates); [] for a plan that does not record its schedule."""
    steps, every = plan.get("max_steps"), plan.get("eval_every")
    if not isinstance(steps, int) or not isinstance(every, int):
        return []
    return sorted(set(range(every, steps + 1, every) if every > 0 else ()) | {steps})[-window:]


def _damaged(run: RunData, expected: list[int]) -> str | None:
    """Why a completed run's logs cannot be used (its final evaluations are not all there), or None."""
    missing = run.missing_evaluations(expected)
    if not missing:
        return None
    why = "; ".join(run.damage) if run.damage else "its last lines were lost?"
    return f"{METRICS_FILE} has no val_loss for step(s) {missing} that it logged ({why})"


def _seed_problems(base: RunData, cand: RunData, window: int, expected: list[int]) -> tuple[list[str], list[str],
                                                                                            float]:
    """(failures, reasons the seed is unusable, paired gap) of one seed."""
    seed = cand.seed
    if cand.status in ("diverged", "stopped"):
        reason = (cand.summary or {}).get("reason")
        return [f"seed {seed} {cand.status}" + (f": {reason}" if reason else "")], [], math.nan
    if base.status != "completed":
        return [], [f"seed {seed}: bf16 baseline {base.status}"], math.nan
    if cand.status != "completed":
        return [], [f"seed {seed}: candidate {cand.status}"], math.nan
    for who, run in (("bf16 baseline", base), ("candidate", cand)):  # damaged logs: unusable, not a failure
        damage = _damaged(run, expected)
        if damage is not None:
            return [], [f"seed {seed}: {who} damaged: {damage}"], math.nan
    steps = stats.window_steps(base.curve.val, window)
    if any(not math.isfinite(cand.curve.val.get(s, math.nan)) for s in steps):
        return [f"seed {seed}: non-finite or missing validation loss in the final window"], [], math.nan
    return [], [], stats.paired_gap(base.curve.val, cand.curve.val, window)


def per_step_gaps(base_runs: dict[int, RunData], cand_runs: dict[int, RunData]) -> list[dict]:
    """Per evaluation step held by every seed of both: the mean paired gap over seeds and its bounds."""
    pairs = [(base_runs[s].curve.val, cand_runs[s].curve.val) for s in cand_runs
             if base_runs[s].curve.val and cand_runs[s].curve.val]
    if not pairs:
        return []
    common = set.intersection(*(set(b) & set(c) for b, c in pairs))
    rows = []
    for step in sorted(common):
        gaps = [(c[step] - b[step]) / abs(b[step]) if b[step] else math.nan for b, c in pairs]
        est = stats.estimate(gaps)
        rows.append({"step": step, "n": est.n, "gap_mean": est.mean, "gap_lower": est.lower, "gap_upper": est.upper})
    return rows


def _candidate(plan: dict, base_runs: dict, cand_runs: dict, spec: dict) -> dict:
    margin, window = float(plan["margin"]), int(plan["final_window"])
    expected = final_evaluations(plan, window)
    failures, unusable, gaps = [], [], {}
    for seed in plan["seeds"]:
        failed, missing, gap = _seed_problems(base_runs[seed], cand_runs[seed], window, expected)
        failures += failed
        unusable += missing
        if math.isfinite(gap):
            gaps[seed] = gap
    est = stats.estimate(list(gaps.values()))
    verdict, reason = stats.decide(est, margin, failures)
    if verdict != "fail" and unusable:
        verdict, reason = "inconclusive", (f"{len(gaps)} of {len(plan['seeds'])} seeds usable: "
                                           + "; ".join(unusable))
    needed = stats.seeds_needed(est.mean, est.sd, margin) if verdict == "inconclusive" else None
    speeds = [c.tokens_per_s / b.tokens_per_s for b, c in ((base_runs[s], cand_runs[s]) for s in plan["seeds"])
              if c.tokens_per_s and b.tokens_per_s]
    return {
        "verdict": verdict, "reason": reason, "gap_mean": est.mean, "gap_lower": est.lower,
        "gap_upper": est.upper, "mdg": est.mdg, "seeds": est.n, "gap_sd": est.sd, "seeds_needed": needed,
        "gaps": {str(s): g for s, g in gaps.items()}, "recipe": spec["recipe"], "overrides": spec["overrides"],
        "recipe_code": spec.get("recipe_code", spec["recipe"]),
        "status": {str(s): cand_runs[s].status for s in plan["seeds"]},
        "speed_vs_bf16": statistics.median(speeds) if speeds else None,
        "per_step": per_step_gaps(base_runs, cand_runs),
        "divergence": [{"seed": s, "reason": (r.summary or {}).get("reason"),
                        "layers": advisor.worst_layers(r.summary["divergence_telemetry"])}
                       for s, r in cand_runs.items() if (r.summary or {}).get("divergence_telemetry")],
        "advisor": advisor.advise(advisor.layer_table([rec for r in cand_runs.values() for rec in r.telemetry])),
    }


def summarize_validation(plan: dict, runs: dict[str, dict[int, RunData]]) -> dict:
    """The validation's summary.json content (see the module docstring for the names scripts rely on)."""
    window = int(plan["final_window"])
    base_runs = runs[BASELINE]
    candidates = {spec["label"]: _candidate(plan, base_runs, runs[spec["label"]], spec)
                  for spec in plan["candidates"]}
    finals = [f for f in (r.final(window) for r in base_runs.values()) if f is not None]
    spread = statistics.stdev(finals) / statistics.fmean(finals) if len(finals) > 1 else None
    return {
        "verdict": stats.overall_verdict([c["verdict"] for c in candidates.values()]),
        "margin": float(plan["margin"]), "final_window": window, "seeds": list(plan["seeds"]),
        "confidence": stats.CONFIDENCE, "power": stats.POWER, "method": METHOD, "baseline": BASELINE,
        "baseline_final_val_loss": {str(s): r.final(window) for s, r in base_runs.items()},
        "baseline_seed_spread_rel": spread,
        "advisor_thresholds": {"mean": advisor.MEAN_THRESHOLDS, "worst_step": advisor.WORST_STEP_THRESHOLDS},
        "candidates": candidates,
        "runs": {f"{label}/seed{seed}": {"status": r.status, "wall_time_s": (r.summary or {}).get("wall_time_s"),
                                         "tokens_per_s": r.tokens_per_s, "final_val_loss": r.final(window),
                                         "damaged_lines": r.damage}
                 for label, by_seed in runs.items() for seed, r in by_seed.items()},
    }
