"""Paired bf16-vs-FP8 validation: did FP8 hurt the model, judged against a margin declared before the runs.

    fp8train validate recipes/cpu_validate.yaml [key=value ...]
    accelerate launch --num_processes 2 -m fp8train.cli validate recipes/cpu_validate.yaml

From one config, in this order: the bf16 baseline (fp8.recipe=none), one run per FP8 candidate
(validate.candidates), then validate.extra_seeds bf16 runs with seeds train.seed+1, +2, ... The baseline and the
candidates share train.seed, hence initial weights and the batches of every step (train() guarantees both), so
the recipe is the only difference between them. The extra seeds change init and data order: their spread around
the baseline is the seed-noise band, the difference that means nothing.

Layout of the validation directory <run.dir>/<run.name>/:

    plan.json              written BEFORE any run: declared margin, candidates, seeds, config hash
    runs/<label>/          one normal run directory per run (config.yaml, metrics.jsonl, summary.json, ...)
    report.md, loss_curves.png, gap.png, health.png, summary.json     written at the end (fp8train.evidence.report)

Re-running the command skips finished runs (summary.json with a final status and the expected config hash) and
resumes unfinished ones from their newest checkpoint. A directory planned from another config, or with another
declared margin, candidate list or seed count, is refused with a ValueError and nothing in it is touched.

The verdict (all losses are validation losses at the evaluation steps; W = validate.final_window):

    gap_abs   = mean over the candidate's last W evaluation steps of (candidate - baseline) at the same steps
    gap_rel   = gap_abs / (baseline's mean over those steps)
    band_rel  = max over extra seeds of |seed's final-window loss - baseline's| / baseline's   (0 with no seeds)
    threshold = max(band_rel, validate.margin)
    pass      = the candidate finished all steps, every loss is finite, and gap_rel <= threshold

The test is one-sided: it asks "is FP8 worse than bf16 by more than noise or the margin?", so a negative gap
(FP8 better) always passes. Per evaluation step s the same arithmetic gives gap_rel(s), band_rel(s) and
threshold(s) = max(band_rel(s), margin); "first step out of band" is the first s > 0 with
gap_rel(s) > threshold(s). It is reported, not part of the verdict: early steps are noisy. A candidate that
diverges (non-finite loss, or with validate.stop_on_divergence a loss above divergence_factor x the baseline's
at the same step) is stopped, fails, and the report names the step and the worst layers there.

Candidates are recipe names, or specs ``[LABEL=]RECIPE[:KEY=VALUE,...]`` whose keys are fp8.* fields (bare
names, e.g. ``margin=20``) or dotted config keys (``policy.exclude=[]``): ``run_validation`` takes these
directly; the config accepts what ``config.ValidateConfig`` allows.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fp8train.evidence.plan import check_fp8_conversion
from fp8train.training.config import FullConfig, add_config_arguments, config_hash, config_to_yaml, load_config
from fp8train.training.data import build_data, describe_fingerprint_change
from fp8train.training.rank0 import on_main_process
from fp8train.training.rundir import (DirLock, dir_state, read_json, read_jsonl, restore_nonfinite,
                                      write_json_atomic)

__all__ = [
    "Candidate", "parse_candidate", "plan_runs", "run_validation", "load_curve", "compare", "first_out_of_band",
    "final_window_mean", "DivergenceGuard", "add_cli_arguments", "cli_main", "PLAN_FILE", "BASELINE",
]

PLAN_FILE = "plan.json"
BASELINE = "bf16"
FINAL_STATUSES = ("completed", "stopped", "diverged")  # re-running a run that ended so gives the same result
_LABEL_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")


# ------------------------------------------------------------------------------------------------------------
# Candidates and the plan
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One FP8 run of a validation: a recipe preset plus config overrides (dotlist), under a folder label."""

    label: str
    recipe: str
    overrides: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"label": self.label, "recipe": self.recipe, "overrides": list(self.overrides)}


def parse_candidate(spec: str | Candidate) -> Candidate:
    """``current`` or ``[LABEL=]RECIPE[:KEY=VALUE,...]`` -> Candidate; bare keys are fp8.* fields."""
    from fp8train.training.config import RECIPE_NAMES

    if isinstance(spec, Candidate):
        return spec
    spec = str(spec).strip()
    head, _, tail = spec.partition(":")
    label, _, recipe_name = head.rpartition("=")
    if recipe_name == "none":
        raise ValueError(f"validate.candidates: {spec!r} is the bf16 baseline, which always runs; list FP8 "
                         f"recipes from {list(RECIPE_NAMES)}")
    if recipe_name not in RECIPE_NAMES:
        raise ValueError(f"validate.candidates: {spec!r} does not name an FP8 recipe; allowed: "
                         f"{list(RECIPE_NAMES)}, optionally as [LABEL=]RECIPE[:KEY=VALUE,...]")
    overrides = []
    for item in filter(None, (s.strip() for s in tail.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"validate.candidates: {item!r} in {spec!r} must look like KEY=VALUE")
        overrides.append(f"{key if '.' in key else 'fp8.' + key}={value}")
    if not label:
        label = recipe_name if not overrides else recipe_name + "+" + "+".join(
            o.removeprefix("fp8.") for o in overrides)
        label = re.sub(r"[^A-Za-z0-9._+=-]", "_", label)
    if not _LABEL_OK.match(label) or label == BASELINE or label.startswith(BASELINE + "-seed"):
        raise ValueError(f"validate.candidates: label {label!r} of {spec!r} must be a plain folder name "
                         f"(letters, digits, . _ + = -) other than {BASELINE!r}")
    return Candidate(label, recipe_name, tuple(overrides))


@dataclass
class PlannedRun:
    label: str
    kind: str  # "baseline" | "candidate" | "seed"
    cfg: FullConfig
    candidate: Candidate | None = None
    data_fingerprint: dict | None = None  # what train() will train on (set by run_validation)
    data_source: str = "the data"

    def config_hash(self) -> str:
        """The hash train() records for this run in its summary.json."""
        return config_hash(self.cfg)


def fingerprint_runs(runs: list[PlannedRun]) -> None:
    """Read each run's data once per distinct data setting and record its content fingerprint: the plan, and
    every check of a re-run against it, are then about the tokens, not just the path."""
    seen: dict[str, tuple[dict, str]] = {}
    for run in runs:
        key = repr((run.cfg.data, run.cfg.model.seq_len, run.cfg.model.vocab_size))
        if key not in seen:
            data = build_data(run.cfg)
            seen[key] = (data.fingerprint, data.source)
        run.data_fingerprint, run.data_source = seen[key]


def derive_config(cfg: FullConfig, overrides: list[str]) -> FullConfig:
    """`cfg` with dotlist overrides applied, through load_config (strict keys, typed, range-checked)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(config_to_yaml(cfg))
        f.flush()
        return load_config(f.name, list(overrides))


def validation_dir(cfg: FullConfig) -> Path:
    return Path(cfg.run.dir) / cfg.run.name


def plan_runs(cfg: FullConfig, candidates=None) -> list[PlannedRun]:
    """The runs of a validation, in the order they run: baseline, candidates, extra seeds."""
    specs = list(cfg.validate.candidates) if candidates is None else list(candidates)
    if not specs:
        raise ValueError("validate.candidates is empty: list at least one FP8 recipe (delayed, current, rowwise, "
                         "block); the bf16 baseline always runs")
    parsed = [parse_candidate(s) for s in specs]
    labels = [c.label for c in parsed]
    if len(set(labels)) != len(labels):
        raise ValueError(f"validate.candidates: duplicate labels {labels}")
    if cfg.validate.margin < 0 or not math.isfinite(cfg.validate.margin):
        raise ValueError(f"validate.margin={cfg.validate.margin} must be a finite relative gap >= 0")
    _check_eval_points(cfg)

    runs_root = str(validation_dir(cfg) / "runs")
    # Resumable by construction: every run resumes from its newest checkpoint, and there is one to resume from.
    every = cfg.checkpoint.every or max(1, cfg.train.max_steps // 4)
    common = [f"run.dir={runs_root}", "train.resume=auto", f"checkpoint.every={every}"]
    runs = [PlannedRun(BASELINE, "baseline", derive_config(cfg, common + [f"run.name={BASELINE}",
                                                                           "fp8.recipe=none"]))]
    for cand in parsed:
        overrides = common + [f"run.name={cand.label}", f"fp8.recipe={cand.recipe}", *cand.overrides]
        runs.append(PlannedRun(cand.label, "candidate", derive_config(cfg, overrides), cand))
        check_fp8_conversion(runs[-1].cfg)  # e.g. a policy.plan made for another model: refused before any run
    for i in range(1, cfg.validate.extra_seeds + 1):
        seed = cfg.train.seed + i
        runs.append(PlannedRun(f"{BASELINE}-seed{seed}", "seed", derive_config(
            cfg, common + [f"run.name={BASELINE}-seed{seed}", "fp8.recipe=none", f"train.seed={seed}"])))
    return runs


def _check_eval_points(cfg: FullConfig) -> None:
    every, steps = cfg.train.eval_every, cfg.train.max_steps
    points = len(set(range(every, steps + 1, every)) | {steps}) if every else 1
    if points < cfg.validate.final_window:
        raise ValueError(f"validate.final_window={cfg.validate.final_window} needs that many evaluation points, "
                         f"but train.eval_every={every} with train.max_steps={steps} gives {points}")


def make_plan(cfg: FullConfig, runs: list[PlannedRun]) -> dict:
    v = cfg.validate
    return {
        "margin": v.margin, "final_window": v.final_window, "extra_seeds": v.extra_seeds,
        "stop_on_divergence": v.stop_on_divergence, "divergence_factor": v.divergence_factor,
        "baseline": BASELINE,
        "candidates": [dict(r.candidate.as_dict(), recipe_code=_recipe_code(r.cfg)) for r in runs
                       if r.kind == "candidate"],
        "seeds": {r.label: r.cfg.train.seed for r in runs if r.kind != "candidate"},
        "runs": {r.label: {"kind": r.kind, "config_hash": r.config_hash()} for r in runs},
        "config_hash": runs[0].config_hash(), "data_fingerprint": runs[0].data_fingerprint,
        "max_steps": cfg.train.max_steps, "eval_every": cfg.train.eval_every,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# What must match between a new invocation and the plan on disk: the experiment and what was declared.
_PLAN_KEYS = ("data_fingerprint", "config_hash", "margin", "final_window", "extra_seeds", "stop_on_divergence", "divergence_factor",
              "candidates", "runs")


def check_plan(vdir: Path, plan: dict, data_source: str = "the data") -> dict | None:
    """The plan already in ``vdir`` if it matches ``plan``; None if there is none; ValueError on a mismatch."""
    path = vdir / PLAN_FILE
    state = dir_state(vdir, PLAN_FILE)
    if state == "other":
        raise ValueError(f"{vdir} exists and is not a validation directory (no {PLAN_FILE}); choose another "
                         "run.name or run.dir (nothing was changed)")
    if state != "run":
        return None
    try:
        old = read_json(path)
    except ValueError:
        if any((vdir / "runs").glob("*")):  # runs were made under that plan: its declarations are lost
            raise ValueError(f"{path} is damaged and runs were already made under it, so what was declared "
                             "before them cannot be checked; use a new run.name (nothing was changed)") from None
        return None  # damaged before any run started: nothing depends on it, plan again
    change = describe_fingerprint_change(old.get("data_fingerprint"), plan["data_fingerprint"], data_source)
    if change is not None:
        raise ValueError(f"{vdir}: {change}. Its runs were made on the old data, so a verdict now would compare "
                         "runs on different data; use a new run.name (nothing was changed)")
    diffs = [k for k in _PLAN_KEYS if _canon(old.get(k)) != _canon(plan.get(k))]
    if diffs:
        detail = "; ".join(_describe_diff(k, old.get(k), plan.get(k)) for k in diffs)
        raise ValueError(f"{vdir} was planned from a different config ({detail}). The margin and candidates are "
                         "declared before the runs and cannot change afterwards; use a new run.name "
                         "(nothing was changed)")
    return old


def _canon(value):
    if isinstance(value, list):  # candidates: recipe_code is derived (display only), not declared
        value = [{k: v for k, v in c.items() if k != "recipe_code"} if isinstance(c, dict) else c for c in value]
    return json.dumps(value, sort_keys=True)


def _describe_diff(key: str, old, new) -> str:
    if key == "config_hash":
        return "model/data/optimizer/train settings differ (config hash)"
    if key == "data_fingerprint":
        return "the data fingerprint differs (plan.json from an older fp8train?)"
    if key == "runs":
        return "the runs' configs differ"
    return f"validate.{key}: plan.json has {old!r}, now {new!r}"


def _recipe_code(cfg: FullConfig) -> str:
    from fp8train.training.config import fp8_recipe_from_config

    r = fp8_recipe_from_config(cfg)
    return r.code() if r is not None else "none"


# ------------------------------------------------------------------------------------------------------------
# Curves and the verdict (pure functions: no torch, no files except load_curve)
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Curve:
    """A run's logged losses: {step: value}. Later lines win (a resumed run may repeat a step)."""

    val: dict[int, float] = field(default_factory=dict)
    train: dict[int, float] = field(default_factory=dict)
    tokens_per_s: list[float] = field(default_factory=list)


def load_curve(run_dir: str | Path) -> Curve:
    curve = Curve()
    # A torn last line (a run killed mid-append) is dropped; NaN/inf, stored as null, come back as floats.
    for rec in map(restore_nonfinite, read_jsonl(Path(run_dir) / "metrics.jsonl")):
        if rec.get("val_loss") is not None:
            curve.val[int(rec["step"])] = float(rec["val_loss"])
        if rec.get("loss") is not None:
            curve.train[int(rec["step"])] = float(rec["loss"])
        if rec.get("tokens_per_s") is not None:
            curve.tokens_per_s.append(float(rec["tokens_per_s"]))
    return curve


def final_window_steps(val: dict[int, float], window: int) -> list[int]:
    """The last ``window`` evaluation steps (step 0, the untrained model, only if nothing else exists)."""
    steps = sorted(s for s in val if s > 0) or sorted(val)
    return steps[-window:]


def final_window_mean(val: dict[int, float], window: int) -> float:
    steps = final_window_steps(val, window)
    return sum(val[s] for s in steps) / len(steps) if steps else math.nan


def per_step(baseline: dict[int, float], candidate: dict[int, float], seeds: list[dict[int, float]],
             margin: float) -> list[dict]:
    """Per common evaluation step: relative gap, relative seed band and the threshold max(band, margin)."""
    rows = []
    for s in sorted(set(baseline) & set(candidate)):
        b = baseline[s]
        band_abs = max([abs(seed[s] - b) for seed in seeds if s in seed], default=0.0)
        gap_abs = candidate[s] - b
        band_rel = band_abs / abs(b) if b else math.inf
        rows.append({"step": s, "gap_abs": gap_abs, "gap_rel": gap_abs / abs(b) if b else math.inf,
                     "band_abs": band_abs, "band_rel": band_rel, "threshold_rel": max(band_rel, margin)})
    return rows


def first_out_of_band(rows: list[dict]) -> int | None:
    """First evaluation step after 0 where the candidate is worse than threshold (non-finite counts as worse)."""
    for r in rows:
        if r["step"] > 0 and not (r["gap_rel"] <= r["threshold_rel"]):
            return r["step"]
    return None


def compare(baseline: dict[int, float], candidate: dict[int, float], seeds: list[dict[int, float]],
            margin: float, final_window: int, status: str = "completed", reason: str | None = None) -> dict:
    """The verdict of one candidate (see the module docstring for the definition)."""
    steps = [s for s in final_window_steps(candidate, final_window) if s in baseline]
    base_mean = sum(baseline[s] for s in steps) / len(steps) if steps else math.nan
    cand_mean = sum(candidate[s] for s in steps) / len(steps) if steps else math.nan
    gap_abs = cand_mean - base_mean
    gap_rel = gap_abs / abs(base_mean) if base_mean else math.nan
    base_final = final_window_mean(baseline, final_window)
    band_abs = max([abs(final_window_mean(seed, final_window) - base_final) for seed in seeds], default=0.0)
    band_rel = band_abs / abs(base_final) if base_final else math.nan
    threshold = max(band_rel, margin) if math.isfinite(band_rel) else math.nan
    rows = per_step(baseline, candidate, seeds, margin)
    finite = all(math.isfinite(v) for v in candidate.values()) and math.isfinite(gap_rel)
    if status != "completed":
        passed, why = False, f"run {status}" + (f": {reason}" if reason else "")
    elif not steps:
        passed, why = False, "no evaluation points to compare"
    elif not finite:
        passed, why = False, "non-finite validation loss"
    elif gap_rel <= threshold:
        passed, why = True, ("FP8 better than bf16 beyond the threshold; the test is one-sided"
                             if gap_rel < -threshold else "gap within threshold")
    else:
        passed, why = False, f"relative gap {gap_rel:+.2%} > threshold {threshold:.2%}"
    return {
        "pass": passed, "reason": why, "status": status,
        "final_val_loss": cand_mean, "baseline_final_val_loss": base_mean, "window_steps": steps,
        "gap_abs": gap_abs, "gap_rel": gap_rel, "noise_band_abs": band_abs, "noise_band_rel": band_rel,
        "threshold_rel": threshold, "margin": margin, "first_step_out_of_band": first_out_of_band(rows),
        "per_step": rows,
    }


class DivergenceGuard:
    """train()'s should_stop for a candidate: non-finite loss, or (when enabled) a loss above factor x the
    baseline's at the same step (validation loss on evaluation steps, training loss on logged steps)."""

    def __init__(self, baseline: Curve | None, factor: float, enabled: bool):
        self.baseline, self.factor, self.enabled = baseline, factor, enabled

    def __call__(self, record: dict) -> str | None:
        step = record.get("step")
        for key in ("val_loss", "loss"):
            value = record.get(key)
            if value is None:
                continue
            if not math.isfinite(value):
                return f"{key} became {value} at step {step}"
            ref = (self.baseline.val if key == "val_loss" else self.baseline.train).get(step) \
                if self.enabled and self.baseline is not None else None
            if ref is not None and math.isfinite(ref) and value > self.factor * ref:
                return (f"diverged: {key} {value:.4f} > {self.factor:g} x baseline {ref:.4f} at step {step}")
        return None


# ------------------------------------------------------------------------------------------------------------
# Running
# ------------------------------------------------------------------------------------------------------------
def _finished(run: PlannedRun) -> dict | None:
    """The run's summary if it already ended (final status, same config); else None."""
    path = Path(run.cfg.run.dir) / run.cfg.run.name / "summary.json"
    if not path.exists():
        return None
    summary = read_json(path)
    if summary.get("status") in FINAL_STATUSES and summary.get("config_hash") == run.config_hash():
        return summary
    return None


def _reusable_accelerator(accelerator):
    """Let train() be called repeatedly with one Accelerator. Accelerate's end_training destroys the process
    group (the next run's collectives would fail) and init_trackers appends to, and restarts, the trackers of
    earlier runs; here end_training only finishes this run's trackers and init_trackers starts a fresh list."""
    init, real_end = accelerator.init_trackers, accelerator.end_training

    def init_trackers(*args, **kwargs):
        accelerator.trackers = []
        return init(*args, **kwargs)

    def end_training():
        for tracker in accelerator.trackers:
            tracker.finish()
        accelerator.trackers = []

    accelerator.init_trackers, accelerator.end_training = init_trackers, end_training
    return real_end


def run_validation(cfg: FullConfig, candidates=None, accelerator=None, show_progress: bool = True,
                   log=None, write_report: bool = True) -> dict:
    """Run (or finish) the validation of ``cfg``; returns the validation summary (also summary.json)."""
    from fp8train.training.loop import make_accelerator

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    runs = plan_runs(cfg, candidates)
    fingerprint_runs(runs)
    plan = make_plan(cfg, runs)
    vdir = validation_dir(cfg)
    # Every rank checks (and fails alike) before rank 0 writes anything.
    check_plan(vdir, plan, runs[0].data_source)
    for run in runs:
        summary_path = Path(run.cfg.run.dir) / run.label / "summary.json"
        if summary_path.exists() and read_json(summary_path).get("config_hash") != run.config_hash():
            raise ValueError(f"{summary_path} comes from a different config than {vdir / PLAN_FILE} declares; "
                             "use a new run.name (nothing was changed)")

    accelerator = accelerator or make_accelerator(cfg)
    lock = DirLock(vdir, "validation directory", log=log)

    def lock_and_plan() -> None:
        vdir.mkdir(parents=True, exist_ok=True)
        lock.acquire()  # for the validation's life: a second validate of this directory is refused
        try:
            if check_plan(vdir, plan, runs[0].data_source) is None:  # again, under the lock
                write_json_atomic(vdir / PLAN_FILE, plan)  # whole or not at all: a kill never leaves a torn plan
        except BaseException:
            lock.release()
            raise

    accelerator.wait_for_everyone()
    on_main_process(accelerator, lock_and_plan)
    try:
        return _run_planned(cfg, runs, vdir, accelerator, show_progress, log, write_report)
    finally:
        lock.release()


def _run_planned(cfg, runs, vdir, accelerator, show_progress, log, write_report) -> dict:
    from fp8train.training.loop import train

    is_main = accelerator.is_main_process
    real_end_training = _reusable_accelerator(accelerator)
    if is_main:
        log(f"[validate] {vdir}: {len(runs)} runs, margin {cfg.validate.margin:g} (declared in {PLAN_FILE})")

    baseline_curve = None
    try:
        for i, run in enumerate(runs, 1):
            done = _finished(run)
            if done is not None:
                if is_main:
                    log(f"[validate] {i}/{len(runs)} {run.label}: finished earlier ({done['status']}), reused")
            else:
                if is_main:
                    log(f"[validate] {i}/{len(runs)} {run.label}: running (recipe {_recipe_code(run.cfg)}, "
                        f"seed {run.cfg.train.seed})")
                guard = None
                if run.kind == "candidate":
                    guard = DivergenceGuard(baseline_curve, cfg.validate.divergence_factor,
                                            cfg.validate.stop_on_divergence)
                train(run.cfg, accelerator=accelerator, show_progress=show_progress, should_stop=guard)
            if run.kind == "baseline":
                accelerator.wait_for_everyone()  # rank 0 wrote metrics.jsonl; every rank reads the same curve
                baseline_curve = load_curve(Path(run.cfg.run.dir) / run.label)
    finally:
        accelerator.end_training = real_end_training

    summary = {}
    if is_main and write_report:
        from fp8train.evidence.report import write_validation_report

        summary = write_validation_report(vdir)
        log(f"[validate] verdict: {summary['verdict'].upper()} -> {vdir / 'report.md'}")
    accelerator.wait_for_everyone()
    return summary


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def add_cli_arguments(parser) -> None:
    add_config_arguments(parser, "recipes/cpu_validate.yaml", "validate.candidates=[delayed]",
                         "progress bars or conversion tables")


def cli_main(args) -> int:
    cfg = load_config(args.config, args.overrides)
    summary = run_validation(cfg, show_progress=not args.quiet)
    if not summary:  # not the main process
        return 0
    return 0 if summary["verdict"] == "pass" else 1
