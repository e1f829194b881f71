"""Config section of paired validation (`fp8train validate`): candidates, margin, paired seeds, workers.

A candidate is a spec ``[LABEL=]RECIPE[:KEY=VALUE,...]``: an FP8 recipe preset, optionally with config overrides
(bare keys are fp8.* fields, e.g. ``margin=3``; dotted keys may be any fp8.* or policy.* key, e.g.
``policy.exclude_defaults=false``: `PAIRED_SECTIONS`) and a folder label. Only those: a candidate that changed the model, the
data, the schedule or the seed would no longer be paired with its bf16 baseline, and its gap would measure that
change, not FP8 (`current:model.d_model=128` once passed at -11%). From a shell, quote specs holding ``=`` inside
the list:
``'validate.candidates=[current,"slow=current:margin=3"]'``. `parse_candidate` checks the spec's shape here; the
override keys and values are checked when the validation derives each run's config, before anything runs.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, List, Optional

from fp8train.nn.recipes import BASELINE_RECIPE, DEFAULT_RECIPE, OVERRIDE_BF16, RECIPE_NAMES
from fp8train.nn.recipes import is_int
from fp8train.training.config.base import Section, require

__all__ = ["ValidateConfig", "Candidate", "parse_candidate", "check_candidate_key", "resolve_seeds", "BASELINE_LABEL",
           "PAIRED_SECTIONS", "AUTO_SEEDS", "SPENDING_RULES"]

BASELINE_LABEL = OVERRIDE_BF16  # folder of the baseline (high-precision) runs; no candidate may take it
# what reports call the baseline (its folder's name, or fp32 under train.autocast=none): no candidate's label
BASELINE_NAMES = (BASELINE_LABEL, "fp32")
_LABEL_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")
_SEED_LIMIT = 2**63  # torch.manual_seed's range
# The most seeds a validation may list or count, whatever validate.max_plan_steps says: planning 1e8 seeds grows
# past 4 GB before the plan-size check can see it (each seed is a list entry, then configs per run).
MAX_SEED_COUNT = 100_000
# The config sections a candidate may override: what FP8 does and to which layers. Everything else (model.*, data.*,
# train.*, optim.*, ...) is shared by the pair, and run.*, validate.*, log.*, checkpoint.* are the validation's own.
PAIRED_SECTIONS = ("fp8", "policy")
AUTO_SEEDS = "auto"  # validate.seeds: add seeds in rounds until decided (fp8train.evidence.sequential)
SPENDING_RULES = ("pocock", "obrien_fleming")  # validate.spending: Lan & DeMets (1983) spending functions


@dataclass(frozen=True)
class Candidate:
    """One FP8 candidate: a recipe preset plus config overrides (a dotlist), under a folder label."""

    label: str
    recipe: str
    overrides: tuple[str, ...] = ()

    def as_dict(self) -> dict:
        return {"label": self.label, "recipe": self.recipe, "overrides": list(self.overrides)}


def parse_candidate(spec: str | Candidate) -> Candidate:
    """``current`` or ``[LABEL=]RECIPE[:KEY=VALUE,...]`` -> Candidate; a ValueError names the bad part."""
    if isinstance(spec, Candidate):  # built in Python: its overrides follow the same rule
        for override in spec.overrides:
            check_candidate_key(override.partition("=")[0].strip(), spec.label)
        return spec
    spec = str(spec).strip()
    head, _, tail = spec.partition(":")
    label, _, recipe_name = head.rpartition("=")
    if recipe_name == BASELINE_RECIPE:
        raise ValueError(f"validate.candidates: {spec!r} is the bf16 baseline, which always runs; list FP8 "
                         f"recipes from {list(RECIPE_NAMES)}")
    if recipe_name not in RECIPE_NAMES:
        raise ValueError(f"validate.candidates: {recipe_name!r} in {spec!r} is not an FP8 recipe; allowed: "
                         f"{list(RECIPE_NAMES)}, written [LABEL=]RECIPE[:KEY=VALUE,...]")
    overrides = []
    for item in (s.strip() for s in _split_top_level(tail)):
        key, eq, value = item.partition("=")
        if not eq or not key.strip() or not item:
            raise ValueError(f"validate.candidates: {item!r} in {spec!r} must look like KEY=VALUE "
                             "(e.g. margin=3 or policy.exclude_defaults=false)")
        key = key.strip() if "." in key else "fp8." + key.strip()
        check_candidate_key(key, spec)
        overrides.append(f"{key}={value.strip()}")
    if tail and not overrides:
        raise ValueError(f"validate.candidates: {spec!r} has ':' but no KEY=VALUE after it")
    if not label:
        label = recipe_name if not overrides else recipe_name + "+" + "+".join(
            o.removeprefix("fp8.") for o in overrides)
        label = re.sub(r"[^A-Za-z0-9._+=-]", "_", label)
    if not _LABEL_OK.match(label) or label in BASELINE_NAMES:
        raise ValueError(f"validate.candidates: label {label!r} of {spec!r} must be a plain folder name "
                         "(letters, digits, . _ + = -, not starting with a symbol) other than the baseline's "
                         f"names {' and '.join(map(repr, BASELINE_NAMES))}")
    return Candidate(label, recipe_name, tuple(overrides))


def check_candidate_key(key: str, spec: str) -> None:
    """Refuse a candidate override outside PAIRED_SECTIONS (see the module docstring), naming it."""
    if key.split(".")[0] not in PAIRED_SECTIONS:
        allowed = " and ".join(f"{section}.*" for section in PAIRED_SECTIONS)
        raise ValueError(f"validate.candidates: {key!r} in {spec!r} cannot be set per candidate: a candidate may "
                         f"change only {allowed} keys (bare keys are fp8.*), so that it stays paired with the "
                         "bf16 baseline (same model, data, schedule and seed); set other keys for the whole "
                         "validation instead")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets, so ``policy.exclude=[a,b],margin=1`` is two overrides."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if text:
        parts.append(text[start:])
    return parts


def resolve_seeds(seeds: Any, first_seed: int, max_seeds: int = 0) -> list[int]:
    """`validate.seeds` as the list of seeds to run: a count n means first_seed, first_seed + 1, ...,
    first_seed + n - 1 (first_seed = train.seed); a list is taken as given; auto means the count max_seeds,
    of which the rounds run only as many as the verdict needs."""
    if seeds == AUTO_SEEDS:
        seeds = max_seeds
    if is_int(seeds):
        return [first_seed + i for i in range(seeds)]
    return [int(s) for s in seeds]


@dataclass
class ValidateConfig(Section):
    _section = "validate"
    candidates: List[str] = field(default_factory=lambda: [DEFAULT_RECIPE])
    """FP8 candidates run against the bf16 baseline: specs [LABEL=]RECIPE[:KEY=VALUE,...] (not 'none')."""
    margin: float = 0.02
    """Allowed relative validation-loss gap of a candidate over bf16, in (0, 1); declared before the runs."""
    seeds: Any = 4
    """Paired seeds: a count (seeds train.seed, +1, ...) or a list; each seed runs bf16 and every candidate; or
    auto: the seeds train.seed, +1, ..., added one round at a time until every candidate is decided or
    validate.max_seeds is reached, each look's bound widened by alpha spending (fp8train.evidence.sequential)."""
    max_seeds: int = 6
    """With validate.seeds=auto: the most seeds (the last look); >= 2."""
    spending: str = "pocock"
    """With validate.seeds=auto: the alpha-spending function, pocock (stops early) or obrien_fleming."""
    fork_from: str = ""
    """A run directory (its newest valid checkpoint) or one checkpoint folder of it: every paired run starts from
    its weights and optimizer state and trains train.max_steps more steps. Empty: from scratch."""
    max_plan_steps: int = 500_000
    """The most training steps a plan may hold (runs x train.max_steps; validate.seeds=auto counts max_seeds):
    a larger plan is refused before anything is written, naming its size; raise this, or 0 for no bound."""
    workers: Optional[int] = None
    """Training runs at once; null = auto (CPU: cores // train.threads; CUDA: one run per GPU)."""
    final_window: int = 3
    """Number of final evaluation points averaged into each run's compared loss."""
    stop_on_divergence: bool = True
    """Stop a candidate early when its loss exceeds divergence_factor * the baseline's at the same step."""
    divergence_factor: float = 1.5
    """Loss ratio to the baseline counted as divergence."""

    def _check(self) -> None:
        allowed = ("a non-empty list of candidate specs [LABEL=]RECIPE[:KEY=VALUE,...] with RECIPE from "
                   f"{list(RECIPE_NAMES)} ('{BASELINE_RECIPE}', the baseline, always runs)")
        require(len(self.candidates) > 0, "validate.candidates", list(self.candidates), allowed)
        labels = [parse_candidate(spec).label for spec in self.candidates]
        require(len(set(labels)) == len(labels), "validate.candidates", list(self.candidates),
                 f"labels must differ, got {labels} (give one a LABEL=)")
        require(0 < self.margin < 1, "validate.margin", self.margin,
                 "a relative loss gap in (0, 1), e.g. 0.02 for 2%")
        self._check_seeds()
        if self.workers is not None:
            require(is_int(self.workers) and self.workers >= 1, "validate.workers", self.workers,
                     "an int >= 1, or null for auto (CPU: cores // train.threads; CUDA: one run per GPU)")
        require(is_int(self.max_plan_steps) and self.max_plan_steps >= 0, "validate.max_plan_steps",
                 self.max_plan_steps, "an int >= 0 (0: no bound)")
        self._at_least("final_window", 1)
        require(self.divergence_factor > 1, "validate.divergence_factor", self.divergence_factor, "must be > 1")

    def _check_seeds(self) -> None:
        seeds = self.seeds
        # 2 at least, as validate.max_seeds: the verdict's confidence bound needs a spread of the per-seed gaps, so
        # one seed could only ever end INCONCLUSIVE, after training its runs
        allowed = (f"a count in [2, {MAX_SEED_COUNT}], a list of at least 2 and at most {MAX_SEED_COUNT} distinct ints "
                   f"in [0, 2**63), or {AUTO_SEEDS!r}; one seed has no spread, and the verdict needs 2")
        self._in("spending", SPENDING_RULES)
        require(is_int(self.max_seeds) and 2 <= self.max_seeds <= 1000, "validate.max_seeds", self.max_seeds,
                 "an int in [2, 1000] (the last look of validate.seeds=auto; one seed has no spread)")
        if seeds == AUTO_SEEDS:
            return
        if is_int(seeds):
            require(2 <= seeds <= MAX_SEED_COUNT, "validate.seeds", seeds, allowed)
            return
        is_list = isinstance(seeds, (list, tuple))
        shown = f"[{len(seeds)} seeds]" if is_list and len(seeds) > 10 else seeds  # not 100000 ints in a message
        require(is_list and 2 <= len(seeds) <= MAX_SEED_COUNT, "validate.seeds", shown, allowed)
        seeds = list(seeds)
        require(all(is_int(s) and 0 <= s < _SEED_LIMIT for s in seeds), "validate.seeds", seeds, allowed)
        repeated = sorted(s for s, n in Counter(seeds).items() if n > 1)  # linear: lists go up to MAX_SEED_COUNT
        require(not repeated, "validate.seeds", seeds, f"{allowed}; repeated: {repeated}")
        self.seeds = seeds  # a plain list (OmegaConf hands over a ListConfig for an Any field)
