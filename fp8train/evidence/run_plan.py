"""The paired runs of a validation: which runs, with which configs, declared in plan.json before any run.

For every seed s of validate.seeds, the bf16 baseline (fp8.recipe=none) and every candidate train with
train.seed=s: the same initial weights and the same batches in the same order (train() guarantees both), and the
same validation batches (they do not depend on the seed), so within a seed the recipe is the only difference.

Layout of the validation directory <run.dir>/<run.name>/:

    plan.json                   written BEFORE any run: declared margin, candidates, seeds, config hashes
    runs/<label>/seed<s>/       one normal run directory per run (label = bf16 or the candidate's label)
    report.md, *.png, summary.json     written at the end (fp8train.evidence.report)

A directory planned from another config, or with another declared margin, candidate list or seed list, is
refused with a ValueError naming what differs, and nothing in it is touched.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

from fp8train.evidence import stats
from fp8train.evidence.layer_recipes import check_fp8_conversion
from fp8train.evidence.sequential import sequential_plan
from fp8train.training.config import (AUTOCAST_PRECISION, BASELINE_RECIPE, HASH_EXCLUDE, FullConfig,
                                      apply_overrides, config_hash, fp8_recipe_from_config)
from fp8train.training.config.validation import BASELINE_LABEL, Candidate, parse_candidate, resolve_seeds
from fp8train.training.data.corpus import build_data, describe_fingerprint_change
from fp8train.training.runs.run_log import counted
from fp8train.training.storage.files import read_json
from fp8train.training.storage.rundir import dir_state

__all__ = ["PLAN_FILE", "BASELINE", "PlannedRun", "plan_runs", "fingerprint_runs", "validation_plan", "check_plan", "validation_dir",
           "run_dir", "derive_config", "wandb_labels"]

PLAN_FILE = "plan.json"
BASELINE = BASELINE_LABEL
RUNS_DIR = "runs"
# What must match between a new invocation and the plan on disk: the experiment and what was declared.
# (validate.workers is absent on purpose: how many runs go at once changes nothing that is measured.)
PLAN_KEYS = ("data_fingerprint", "config_hash", "margin", "final_window", "seeds", "stop_on_divergence", "divergence_factor",
             "candidates", "runs", "confidence", "power", "sequential", "fork")


@dataclass
class PlannedRun:
    """One training run of the plan: ``label`` is bf16 or a candidate's label, ``seed`` its train.seed."""

    label: str
    seed: int
    cfg: FullConfig
    candidate: Candidate | None = None
    data_fingerprint: dict | None = None  # what train() will train on (set by fingerprint_runs)
    data_source: str = "the data"
    pinned_fork: dict | None = None  # validate.fork_from: plan.json's checkpoint and sha256 (evidence/fork_pinning.py)

    def config_hash(self) -> str:
        """The hash train() records in this run's summary.json: its config and its data's fingerprint."""
        return config_hash(self.cfg, data_fingerprint=self.data_fingerprint)

    @property
    def key(self) -> str:
        """The run's folder below runs/, e.g. ``current/seed1337``."""
        return f"{self.label}/seed{self.seed}"

    @property
    def is_baseline(self) -> bool:
        return self.candidate is None


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


def validation_dir(cfg: FullConfig) -> Path:
    return Path(cfg.run.dir) / cfg.run.name


def run_dir(vdir: Path, label: str, seed: int) -> Path:
    return vdir / RUNS_DIR / label / f"seed{seed}"


def derive_config(cfg: FullConfig, overrides: list[str], what: str = "") -> FullConfig:
    """`cfg` with dotlist overrides applied in memory, checked as load_config checks them (strict keys, typed,
    range-checked)."""
    try:
        return apply_overrides(cfg, list(overrides))
    except ValueError as err:
        if not what:
            raise
        raise ValueError(f"validate.candidates: {what}: {err}") from None


def _for_seed(template: FullConfig, runs_dir: Path, seed: int, wandb: dict) -> FullConfig:
    """``template`` (one label's derived config) for one seed: its own copy, with run.dir, run.name, train.seed and
    the run's wandb labels (``wandb``: log fields) set through the sections' constructors (their checks run).
    OmegaConf costs ~0.1 s a config, so the merge is done once per label, not once per run: 1000 seeds plan in
    seconds."""
    own = copy.deepcopy(template)
    return dataclasses.replace(own, run=dataclasses.replace(own.run, dir=str(runs_dir), name=f"seed{seed}"),
                               train=dataclasses.replace(own.train, seed=seed),
                               log=dataclasses.replace(own.log, **wandb))


def plan_runs(cfg: FullConfig, candidates=None, log=None) -> list[PlannedRun]:
    """The runs of a validation, seed by seed: the baseline, then each candidate. Every check of the specs and of
    the derived configs happens here, before anything is written. ``log`` gets one line before a plan of over
    MAX_PLANNED_RUNS runs (allowed by validate.max_plan_steps=0), which takes minutes to plan."""
    specs = list(cfg.validate.candidates) if candidates is None else list(candidates)
    if not specs:
        raise ValueError("validate.candidates is empty: list at least one FP8 recipe spec; the bf16 baseline "
                         "always runs")
    parsed = [parse_candidate(s) for s in specs]
    labels = [c.label for c in parsed]
    if len(set(labels)) != len(labels):
        raise ValueError(f"validate.candidates: labels must differ, got {labels} (give one a LABEL=)")
    seeds = resolve_seeds(cfg.validate.seeds, cfg.train.seed, cfg.validate.max_seeds)
    if max(seeds) >= 2**63:
        raise ValueError(f"validate.seeds={cfg.validate.seeds} with train.seed={cfg.train.seed} reaches seed "
                         f"{max(seeds)}; seeds must be < 2**63")
    _check_plan_size(cfg, len(seeds) * (1 + len(parsed)))
    if log is not None and len(seeds) * (1 + len(parsed)) > MAX_PLANNED_RUNS:
        log(f"[validate] planning {len(seeds) * (1 + len(parsed))} runs ({counted(len(seeds), 'seed')} x "
            f"{1 + len(parsed)} labels; validate.max_plan_steps=0): about 1 ms and 5 kB each, before anything runs")
    _check_eval_points(cfg)

    vdir = validation_dir(cfg)
    # Resumable by construction: every run resumes from its newest checkpoint, and there is one to resume from.
    every = cfg.checkpoint.every or max(1, cfg.train.max_steps // 4)
    common = ["train.resume=auto", f"checkpoint.every={every}"]
    first = seeds[0]

    def where(label):
        return [f"run.dir={vdir / RUNS_DIR / label}", f"run.name=seed{first}", f"train.seed={first}"]

    # each label's config derived once, at the first seed, with every check; the other seeds differ only there
    templates = [(BASELINE, None, BASELINE_RECIPE, derive_config(cfg, common + where(BASELINE) + ["fp8.recipe=none"]))]
    for cand in parsed:
        overrides = common + where(cand.label) + [f"fp8.recipe={cand.recipe}", *cand.overrides]
        templates.append((cand.label, cand, cand.recipe, derive_config(cfg, overrides, repr(cand.label))))
        check_fp8_conversion(templates[-1][3])  # e.g. a policy.overrides_file made for another model: refused now
    baseline_shown = AUTOCAST_PRECISION[cfg.train.autocast]  # what the baseline computes in: its wandb label
    return [PlannedRun(label, seed, _for_seed(template, vdir / RUNS_DIR / label, seed, wandb_labels(
                cfg.run.name, baseline_shown if label == BASELINE else label, recipe_name, seed)), cand)
            for seed in seeds for label, cand, recipe_name, template in templates]


# Planning costs time and memory per run (a config, a folder name, a plan.json entry: ~1 ms and ~5 kB each), however
# short the runs: past this many runs a plan is refused unless validate.max_plan_steps=0 lifts the bounds.
MAX_PLANNED_RUNS = 20000


def _check_plan_size(cfg: FullConfig, runs: int) -> None:
    bound, steps = cfg.validate.max_plan_steps, runs * cfg.train.max_steps
    if bound and steps > bound:
        raise ValueError(f"validate: the plan is {runs} runs x train.max_steps={cfg.train.max_steps} = {steps} "
                         f"training steps, over validate.max_plan_steps={bound}; if you mean it, set "
                         f"validate.max_plan_steps={steps} (or 0 for no bound) (nothing was written)")
    if bound and runs > MAX_PLANNED_RUNS:
        raise ValueError(f"validate: the plan is {runs} runs (seeds x (1 + candidates)), over {MAX_PLANNED_RUNS}, "
                         "which take minutes and gigabytes only to plan; if you mean it, set "
                         "validate.max_plan_steps=0 (no bound) (nothing was written)")


def wandb_labels(validation: str, label: str, recipe_name: str, seed: int) -> dict:
    """The log.wandb_* overrides of one run: named <validation>/<label>/seed<N> (the baseline's label is its
    precision, bf16 or fp32, whatever its folder's name), grouped by the validation, job
    type baseline or candidate, tagged recipe:<name> and seed:<N>, so wandb's UI tells the runs apart (the keys
    are outside the config hash: they change nothing measured)."""
    job_type = "baseline" if recipe_name == BASELINE_RECIPE else "candidate"
    return {"wandb_name": f"{validation}/{label}/seed{seed}", "wandb_group": validation, "wandb_job_type": job_type,
            "wandb_tags": [f"recipe:{recipe_name}", f"seed:{seed}"]}


def _check_eval_points(cfg: FullConfig) -> None:
    every, steps = cfg.train.eval_every, cfg.train.max_steps
    # the evaluation steps every, 2 every, ... and the last step (counted, not listed: max_steps may be huge)
    points = steps // every + (steps % every != 0) if every else 1
    if points < cfg.validate.final_window:
        raise ValueError(f"validate.final_window={cfg.validate.final_window} needs that many evaluation points, "
                         f"but train.eval_every={every} with train.max_steps={steps} gives {points}")


def _recipe_code(cfg: FullConfig) -> str:
    recipe = fp8_recipe_from_config(cfg)
    return recipe.code() if recipe is not None else BASELINE_RECIPE


def validation_plan(cfg: FullConfig, runs: list[PlannedRun]) -> dict:
    """plan.json: what is declared before any run (the margin, candidates, seeds, method) and the runs' hashes."""
    v = cfg.validate
    first_seed = runs[0].seed
    return {
        "margin": v.margin, "final_window": v.final_window, "seeds": list(dict.fromkeys(r.seed for r in runs)),
        "stop_on_divergence": v.stop_on_divergence, "divergence_factor": v.divergence_factor,
        "confidence": stats.CONFIDENCE, "power": stats.POWER, "baseline": BASELINE,
        "baseline_precision": AUTOCAST_PRECISION[runs[0].cfg.train.autocast],  # what the baseline computes in
        "candidates": [dict(r.candidate.as_dict(), recipe_code=_recipe_code(r.cfg)) for r in runs
                       if not r.is_baseline and r.seed == first_seed],
        "runs": {r.key: {"label": r.label, "seed": r.seed, "config_hash": config_hash(r.cfg)} for r in runs},
        # train.seed differs between the seeds' runs and is declared in "seeds", so the experiment's hash skips it
        "config_hash": config_hash(runs[0].cfg, exclude=HASH_EXCLUDE + ("train.seed",)),
        "data_fingerprint": runs[0].data_fingerprint,
        "sequential": sequential_plan(v),  # validate.seeds=auto: the looks and their critical values
        "max_steps": cfg.train.max_steps, "eval_every": cfg.train.eval_every,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def check_plan(vdir: Path, plan: dict, data_source: str = "the data") -> dict | None:
    """The plan already in ``vdir`` if it matches ``plan``; None if there is none (or a damaged one that no run
    depends on); ValueError on a mismatch, naming what differs."""
    state = dir_state(vdir, PLAN_FILE)
    if state == "other":
        raise ValueError(f"{vdir} exists and is not a validation directory (no {PLAN_FILE}); choose another "
                         "run.name or run.dir (nothing was changed)")
    if state != "run":
        return None
    try:
        old = read_json(vdir / PLAN_FILE)
    except ValueError:
        if any((vdir / RUNS_DIR).glob("*")):  # runs were made under that plan: its declarations are lost
            raise ValueError(f"{vdir / PLAN_FILE} is damaged and runs were already made under it, so what was "
                             "declared before them cannot be checked; use a new run.name (nothing was changed)"
                             ) from None
        return None  # damaged before any run started: nothing depends on it, plan again
    change = describe_fingerprint_change(old.get("data_fingerprint"), plan.get("data_fingerprint"), data_source)
    if change is not None:
        raise ValueError(f"{vdir}: {change}. Its runs were made on the old data, so a verdict now would compare "
                         "runs on different data; use a new run.name (nothing was changed)")
    diffs = [k for k in PLAN_KEYS if _canonical(k, old.get(k)) != _canonical(k, plan.get(k))]
    if diffs:
        detail = "; ".join(_describe_diff(k, old.get(k), plan.get(k)) for k in diffs)
        raise ValueError(f"{vdir} was planned from a different config ({detail}). The margin, candidates and seeds "
                         "are declared before the runs and cannot change afterwards; use a new run.name "
                         "(nothing was changed)")
    return old


def _canonical(key: str, value):
    if key == "candidates" and isinstance(value, list):  # recipe_code is derived (display only), not declared
        value = [{k: v for k, v in c.items() if k != "recipe_code"} if isinstance(c, dict) else c for c in value]
    if isinstance(value, float) and math.isfinite(value):
        value = round(value, 12)
    return json.dumps(value, sort_keys=True)


def _describe_diff(key: str, old, new) -> str:
    if key == "config_hash":
        return "model/data/optimizer/train settings differ (config hash)"
    if key == "data_fingerprint":
        return "the data fingerprint differs"
    if key == "runs":
        return "the runs' configs differ"
    return f"validate.{key}: plan.json has {old!r}, now {new!r}"
