"""The verdict of a validation directory, recomputed from its files: plan.json and every run's metrics.jsonl,
summary.json and telemetry.jsonl. The arithmetic is fp8train.evidence.stats; this module gathers its inputs,
one paired gap per seed, and what went wrong in which run.

summary.json names (scripts and CI read them): top-level `verdict` (pass | fail | inconclusive; the report of a
validation whose runs have not all ended says incomplete: fp8train.evidence.completeness); under `candidates`,
keyed by label: `verdict`, `gap_mean`, `gap_lower`, `gap_upper` (relative gaps, one-sided 95% bounds), `mdg`
(minimum detectable gap, one-sided 95%, 80% power) and `seeds` (paired seeds in the estimate).
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import yaml

from fp8train.evidence import advisor, sequential, stats
from fp8train.evidence.curves import Curve, load_curve
from fp8train.evidence.run_plan import BASELINE, PLAN_FILE, run_dir
from fp8train.training.runs import telemetry
from fp8train.training.runs.run_log import counted
from fp8train.training.storage.files import read_json
from fp8train.training.config import AUTOCAST_PRECISION
from fp8train.training.storage.rundir import (CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, TELEMETRY_FILE, died_holding,
                                              is_locked)

__all__ = ["RunData", "load_validation", "baseline_precision", "summarize_validation", "evidence_cost", "METHOD",
           "SEQUENTIAL_METHOD"]

METHOD = ("Per seed s, the paired gap g_s = (candidate - baseline) / baseline of the mean validation loss over the "
          "final window (the same steps, the same validation batches, the same initial weights and batches for both). "
          "Over the n seeds: mean, sample sd, and one-sided 95% Student-t bounds mean -/+ t(0.95, n-1) sd/sqrt(n). "
          "PASS: upper bound <= margin. FAIL: a run diverged or stopped, a loss is non-finite, or lower bound > "
          "margin. Otherwise INCONCLUSIVE (also when a run skipped over 25% of its steps on non-finite gradients: "
          "it did not train; and for every seed whose baseline diverged, was stopped or skipped that share: the "
          "seed judges no candidate). Minimum detectable gap (one-sided 95%, 80% power): "
          "(t(0.95, n-1) + t(0.80, n-1)) sd/sqrt(n).")
MAX_SKIPPED_SHARE = 0.25  # of a run's steps skipped on non-finite gradients: more and the pair is not usable

SEQUENTIAL_METHOD = ("validate.seeds=auto: the same gaps, looked at after 2, 3, ..., max_seeds seeds in seed order. "
                     "Look k (n_k seeds, t_k = n_k / max_seeds) spends a_k = alpha(t_k) - alpha(t_(k-1)) of the "
                     "one-sided 5% under a Lan-DeMets (1983) spending function (pocock: alpha ln(1 + (e - 1) t); "
                     "obrien_fleming: 2 - 2 Phi(z_(1-alpha/2) / sqrt(t))) and is a t test at that level: bounds "
                     "mean -/+ t(1 - a_k, n_k - 1) sd/sqrt(n_k). A candidate stops at its first PASS or FAIL; "
                     "undecided at max_seeds: INCONCLUSIVE. By Boole's inequality a false PASS at a true gap on "
                     "the margin stays <= 5%. The bounds and seeds shown are those of the deciding (or latest) look.")


class RunData:
    """One run directory read back: its summary (None while running), losses and telemetry records, and the
    precision it ran in outside FP8 (its saved config.yaml's train.autocast; None without one)."""

    def __init__(self, path: Path, label: str, seed: int | None = None):
        self.dir, self.label, self.seed = path, label, seed
        self.summary = read_json(path / SUMMARY_FILE) if (path / SUMMARY_FILE).exists() else None
        self.precision = _precision(path / CONFIG_FILE)
        self.damage: list[str] = []  # damaged lines of its logs, skipped (file and line each)
        self.curve: Curve = load_curve(path, on_damaged=self.damage.append)
        self.telemetry = [dict(r, seed=seed) for r in telemetry.load(path / TELEMETRY_FILE, self.damage.append)]

    def missing_evaluations(self, steps: list[int]) -> list[int]:
        """Of `steps` (evaluation steps a completed run logs), those its metrics.jsonl has no val_loss for."""
        return [s for s in steps if s not in self.curve.val]

    @property
    def status(self) -> str:
        if self.summary is None:  # no summary.json: running only while a process holds the run directory
            # a summary.json there now: the run ended after this report read it, as a run that was running
            if is_locked(self.dir) or (self.dir / SUMMARY_FILE).exists():
                return "running"  # (also before its first log line: building the model, the step-0 evaluation)
            # started: it logged, wrote its config.yaml, or (killed in between) took its folder's lock
            started = self.curve.val or self.curve.train or (self.dir / CONFIG_FILE).is_file() \
                or died_holding(self.dir)
            return "unfinished" if started else "missing"
        return self.summary.get("status", "unknown")

    @property
    def tokens_per_s(self) -> float | None:
        # Median of the logged steps: robust to the first step's warm-up and to resumes (wall time is not).
        return statistics.median(self.curve.tokens_per_s) if self.curve.tokens_per_s else None

    def final(self, window: int) -> float | None:
        steps = stats.window_steps(self.curve.val, window)
        value = sum(self.curve.val[s] for s in steps) / len(steps) if steps else math.nan
        return value if math.isfinite(value) else None


def _precision(config_file: Path) -> str | None:
    try:
        autocast = (yaml.safe_load(config_file.read_text()) or {}).get("train", {}).get("autocast")
        return AUTOCAST_PRECISION.get(autocast)
    # a missing or damaged config (not UTF-8, not YAML, not a mapping) names no precision; the report's own read
    # of it says what is wrong
    except (OSError, ValueError, TypeError, yaml.YAMLError, AttributeError):
        return None


def baseline_precision(plan: dict, base_runs: dict[int, "RunData"]) -> str:
    """What the baseline ran in, bf16 or fp32: its runs' saved configs say (the baseline is "bf16" by its folder
    name only), else plan.json's declaration, else bf16 (a plan from before it was declared)."""
    ran = {r.precision for r in base_runs.values() if r.precision is not None}
    if len(ran) == 1:
        return ran.pop()
    return plan.get("baseline_precision", "bf16") if not ran else "/".join(sorted(ran))


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


def _skipped(run: RunData) -> str | None:
    """Why a completed run did not train enough to compare (it skipped over MAX_SKIPPED_SHARE of its steps on
    non-finite gradients, as a fork of a diverged source does: bf16 and FP8 then end at one untrained loss and
    their gap says nothing), or None."""
    summary = run.summary or {}
    steps, skipped = summary.get("steps"), summary.get("skipped_steps")
    if not isinstance(skipped, int) or skipped <= 0 or not isinstance(steps, int):
        return None
    if steps > 0 and skipped / steps <= MAX_SKIPPED_SHARE:
        return None
    return (f"{run.dir} skipped {skipped} of {counted(steps, 'step')} (non-finite gradients; over "
            f"{MAX_SKIPPED_SHARE:.0%} of its steps is too few updates to compare)")


def _did_not_train(base: RunData) -> str | None:
    """Why a seed's baseline cannot stand as the reference (it diverged or was stopped, or skipped over
    MAX_SKIPPED_SHARE of its steps), or None. The seed then judges no candidate: a candidate that diverged
    beside it (a fork of a state that had already gone wrong, say) says nothing about its FP8 layers."""
    if base.status in ("diverged", "stopped"):
        reason = (base.summary or {}).get("reason")
        return f"{base.dir} {base.status}" + (f": {reason}" if reason else "")
    return _skipped(base) if base.status == "completed" else None


def _seed_problems(base: RunData, cand: RunData, window: int, expected: list[int],
                   precision: str = "bf16") -> tuple[list[str], list[str], float]:
    """(failures, reasons the seed is unusable, paired gap) of one seed; `precision` names the baseline."""
    seed = cand.seed
    untrained = _did_not_train(base)
    if untrained is not None:  # then nothing of this seed judges the candidate, a divergence of its own neither
        return [], [f"seed {seed}: the {precision} baseline did not train ({untrained})"], math.nan
    if cand.status in ("diverged", "stopped"):
        reason = (cand.summary or {}).get("reason")
        return [f"seed {seed} {cand.status}" + (f": {reason}" if reason else "")], [], math.nan
    if base.status != "completed":
        return [], [f"seed {seed}: {precision} baseline {base.status}"], math.nan
    if cand.status != "completed":
        return [], [f"seed {seed}: candidate {cand.status}"], math.nan
    for who, run in ((f"{precision} baseline", base), ("candidate", cand)):  # damaged logs: unusable, not a failure
        skipped = _skipped(run) if run is cand else None
        if skipped is not None:
            return [], [f"seed {seed}: {who} {skipped}"], math.nan
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


def _fixed_verdict(plan: dict, base_runs: dict, cand_runs: dict) -> tuple:
    """(verdict, reason, estimate, lower, upper, gaps, seeds looked at, sequential record) of a fixed design."""
    margin, window = float(plan["margin"]), int(plan["final_window"])
    expected = final_evaluations(plan, window)
    failures, unusable, gaps = [], [], {}
    for seed in plan["seeds"]:
        failed, missing, gap = _seed_problems(base_runs[seed], cand_runs[seed], window, expected,
                                              plan.get("baseline_precision", "bf16"))
        failures += failed
        unusable += missing
        if math.isfinite(gap):
            gaps[seed] = gap
    est = stats.estimate(list(gaps.values()))
    verdict, reason = stats.decide(est, margin, failures)
    if verdict != "fail" and unusable:
        verdict, reason = "inconclusive", (f"{len(gaps)} of {counted(len(plan['seeds']), 'seed')} usable: "
                                           + "; ".join(unusable))
    return verdict, reason, est, est.lower, est.upper, gaps, list(plan["seeds"]), None


def _sequential_verdict(plan: dict, base_runs: dict, cand_runs: dict) -> tuple:
    """The same for validate.seeds=auto: the looks over the seeds in order, up to the first seed that is not
    usable yet (fp8train.evidence.sequential)."""
    margin, window = float(plan["margin"]), int(plan["final_window"])
    design = sequential.make_design(int(plan["sequential"]["max_seeds"]), plan["sequential"]["rule"])
    expected = final_evaluations(plan, window)
    failures, gaps, waiting = [], {}, None
    for seed in plan["seeds"]:
        failed, missing, gap = _seed_problems(base_runs[seed], cand_runs[seed], window, expected,
                                              plan.get("baseline_precision", "bf16"))
        failures += failed
        if missing or not math.isfinite(gap):
            waiting = "; ".join(missing) or f"seed {seed}: no usable gap"
            break
        gaps[seed] = gap
    out = sequential.sequential_verdict(list(gaps.values()), design, margin, failures)
    verdict, reason = out.verdict, out.reason
    if verdict == "continue":
        verdict = "inconclusive"
        reason = (f"{reason}; the next look needs {counted(out.next_seeds, 'seed')}"
                  + (f" ({waiting})" if waiting else ""))
    looked = list(plan["seeds"])[:out.estimate.n] if out.look else list(gaps)
    record = {"look": out.look, "critical": out.critical, "next_seeds": out.next_seeds,
              "decided": out.verdict != "continue"}
    return verdict, reason, out.estimate, out.lower, out.upper, {s: gaps[s] for s in looked if s in gaps}, \
        looked, record


def _candidate(plan: dict, base_runs: dict, cand_runs: dict, spec: dict) -> dict:
    margin = float(plan["margin"])
    rule = _sequential_verdict if plan.get("sequential") else _fixed_verdict
    verdict, reason, est, lower, upper, gaps, looked, record = rule(plan, base_runs, cand_runs)
    needed = stats.seeds_needed(est.mean, est.sd, margin) if verdict == "inconclusive" else None
    speeds = [c.tokens_per_s / b.tokens_per_s for b, c in ((base_runs[s], cand_runs[s]) for s in looked)
              if c.tokens_per_s and b.tokens_per_s]
    return {
        "verdict": verdict, "reason": reason, "gap_mean": est.mean, "gap_lower": lower,
        "gap_upper": upper, "mdg": est.mdg, "seeds": est.n, "gap_sd": est.sd, "seeds_needed": needed,
        "sequential": record,
        "gaps": {str(s): g for s, g in gaps.items()}, "recipe": spec["recipe"], "overrides": spec["overrides"],
        "recipe_code": spec.get("recipe_code", spec["recipe"]),
        "status": {str(s): cand_runs[s].status if s in looked or cand_runs[s].status != "missing" else "not needed"
                   for s in plan["seeds"]},
        # speed_vs_bf16 kept for scripts that read it: it is the speed over the baseline, whatever its precision
        "speed_vs_baseline": statistics.median(speeds) if speeds else None,
        "speed_vs_bf16": statistics.median(speeds) if speeds else None,
        "per_step": per_step_gaps(base_runs, cand_runs),
        # the layers of a candidate's divergence, where its baseline trained (else they are not the FP8 layers' doing)
        "divergence": [{"seed": s, "reason": (r.summary or {}).get("reason"),
                        "layers": advisor.worst_layers(r.summary["divergence_telemetry"])}
                       for s, r in cand_runs.items() if (r.summary or {}).get("divergence_telemetry")
                       and _did_not_train(base_runs[s]) is None],
        "advisor": advisor.advise(advisor.layer_table([rec for r in cand_runs.values() for rec in r.telemetry])),
    }


def summarize_validation(plan: dict, runs: dict[str, dict[int, RunData]]) -> dict:
    """The validation's summary.json content (see the module docstring for the names scripts rely on)."""
    window = int(plan["final_window"])
    base_runs = runs[BASELINE]
    precision = baseline_precision(plan, base_runs)
    plan = {**plan, "baseline_precision": precision}
    candidates = {spec["label"]: _candidate(plan, base_runs, runs[spec["label"]], spec)
                  for spec in plan["candidates"]}
    finals = [f for f in (r.final(window) for r in base_runs.values()) if f is not None]
    spread = statistics.stdev(finals) / statistics.fmean(finals) if len(finals) > 1 else None
    sequential_plan = plan.get("sequential")
    # validate.seeds=auto plans every seed up to max_seeds; the seeds are those whose baseline ended (one running,
    # or killed between rounds, is no pair yet)
    seeds = [s for s in plan["seeds"] if not sequential_plan
             or base_runs[s].status not in ("missing", "running", "unfinished", "interrupted")]
    return {
        "verdict": stats.overall_verdict([c["verdict"] for c in candidates.values()]),
        "margin": float(plan["margin"]), "final_window": window, "seeds": seeds,
        "planned_seeds": list(plan["seeds"]), "sequential": sequential_plan,
        "cost": evidence_cost(plan, runs, candidates),
        "confidence": stats.CONFIDENCE, "power": stats.POWER, "baseline": BASELINE,
        "baseline_precision": precision,
        "method": METHOD + (" " + SEQUENTIAL_METHOD if sequential_plan else ""),
        "baseline_final_val_loss": {str(s): r.final(window) for s, r in base_runs.items()},
        "baseline_seed_spread_rel": spread,
        "advisor_thresholds": {"mean": advisor.MEAN_THRESHOLDS, "worst_step": advisor.WORST_STEP_THRESHOLDS},
        "candidates": candidates,
        "runs": {f"{label}/seed{seed}": {"status": r.status, "wall_time_s": (r.summary or {}).get("wall_time_s"),
                                         "tokens_per_s": r.tokens_per_s, "final_val_loss": r.final(window),
                                         "damaged_lines": r.damage}
                 for label, by_seed in runs.items() for seed, r in by_seed.items()
                 if not sequential_plan or r.status != "missing"},
    }


def evidence_cost(plan: dict, runs: dict[str, dict[int, RunData]], candidates: dict) -> dict:
    """What the evidence cost: runs made, their wall seconds (x processes: device seconds), this process's CPU
    seconds of each run (rank 0's under a launch; the last segment of a resumed run), and what fixed designs
    would have run: every planned seed, and the fewest seeds with which a fixed design decides every candidate
    at the observed means and spreads (stats.seeds_needed; None when some candidate sits on the margin)."""
    made = [r.summary for by_seed in runs.values() for r in by_seed.values() if r.summary is not None]
    per_seed = 1 + len(plan["candidates"])
    margin = float(plan["margin"])
    needed = [stats.seeds_needed(c["gap_mean"], c["gap_sd"], margin) for c in candidates.values()]
    fixed = max(max(n, 2) for n in needed) if needed and None not in needed else None
    cpu = [s.get("cpu_time_s") for s in made]
    statuses = [r.status for by_seed in runs.values() for r in by_seed.values()]
    return {
        "runs": len(made), "running_runs": statuses.count("running"), "unfinished_runs": statuses.count("unfinished"),
        "run_seconds": sum(s.get("wall_time_s") or 0.0 for s in made),
        "device_seconds": sum((s.get("wall_time_s") or 0.0) * (s.get("world_size") or 1) for s in made),
        "cpu_seconds": sum(cpu) if cpu and None not in cpu else None,
        "planned_seeds_runs": len(plan["seeds"]) * per_seed,
        "fixed_design_seeds": fixed,
        "fixed_design_runs": fixed * per_seed if fixed is not None else None,
    }
