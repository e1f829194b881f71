"""Config section of paired validation (`fp8train validate`): candidates, margin, seeds, divergence stop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from fp8train.nn.recipes import RECIPE_NAMES
from fp8train.training.config.base import _Section, _require


@dataclass
class ValidateConfig(_Section):
    _section = "validate"
    candidates: List[str] = field(default_factory=lambda: ["delayed"])
    """FP8 recipes run against the bf16 baseline (the baseline always runs; do not list 'none')."""
    margin: float = 0.02
    """Allowed relative final-loss gap of a candidate over the baseline, declared before the runs."""
    extra_seeds: int = 1
    """Extra bf16 runs with other seeds; their spread is the seed-noise band."""
    final_window: int = 3
    """Number of final evaluation points averaged into the compared loss."""
    stop_on_divergence: bool = True
    """Stop a candidate early when its loss exceeds divergence_factor * the baseline's at the same step."""
    divergence_factor: float = 1.5
    """Loss ratio to the baseline counted as divergence."""

    def _check(self) -> None:
        allowed = f"a non-empty list of FP8 recipes from {list(RECIPE_NAMES)} ('none' is the baseline, always run)"
        _require(len(self.candidates) > 0, "validate.candidates", list(self.candidates), allowed)
        for spec in self.candidates:  # [LABEL=]RECIPE[:KEY=VALUE,...]; evidence/validate parses the rest
            name = str(spec).partition(":")[0].rpartition("=")[2]
            _require(name in RECIPE_NAMES, "validate.candidates", list(self.candidates),
                     allowed + ", each optionally as [LABEL=]RECIPE[:KEY=VALUE,...]")
        _require(len(set(self.candidates)) == len(self.candidates), "validate.candidates", list(self.candidates),
                 "no duplicates")
        self._at_least("margin", 0, "relative loss gap, must be >= 0")
        self._at_least("extra_seeds", 0)
        self._at_least("final_window", 1)
        _require(self.divergence_factor > 1, "validate.divergence_factor", self.divergence_factor, "must be > 1")
