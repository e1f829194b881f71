"""Group-sequential verdicts (`validate.seeds: auto`): pure functions of numbers (no torch, no files).

Seeds are added in rounds and the verdict is looked at after each: look k sees the first n_k paired seeds
(n_k = 2, 3, ..., validate.max_seeds). Looking repeatedly at growing data and stopping at the first bound that
clears the margin would, with the fixed design's t(0.95, n - 1) at every look, pass a candidate whose true gap IS
the margin far more often than 5%. Each look therefore gets a share of the 5% and a wider critical value:

1. Alpha spending (Lan & DeMets (1983), "Discrete sequential boundaries for clinical trials", Biometrika 70(3),
   659-663): a spending function alpha(t) of the information fraction t = n_k / max_seeds says how much of the
   one-sided error alpha = 0.05 may be spent by look k; look k spends a_k = alpha(t_k) - alpha(t_(k-1)). Both of
   that paper's functions are offered (`validate.spending`):
       pocock            alpha(t) = alpha * ln(1 + (e - 1) t)                  (spends early: stops early)
       obrien_fleming    alpha(t) = 2 - 2 Phi(z_(1 - alpha/2) / sqrt(t))        (spends late: rarely stops early)
2. Look k is a one-sided t test at level a_k: c_k = t(1 - a_k, n_k - 1). The level of each look is exact for
   normal per-seed gaps (the spread is estimated, so t, not z), and by Boole's inequality the chance of a false
   PASS at ANY look is at most a_1 + ... + a_K = alpha, whatever the correlation between looks.

Why not the usual exact boundaries: the recursive integration of Armitage, McPherson & Rowe (1969) spends alpha
against the joint law of the z statistics, and converting those boundaries to t quantiles at the same nominal
level (Jennison & Turnbull 2000, ch. 11) overshot alpha with 1 to 9 degrees of freedom: 5.4% to 6.1% false
PASS in simulation. Testing each look at its spent alpha is conservative instead (about 3% to 4.5% at the margin,
tests/test_sequential.py), never above.

At look k, with the mean paired gap and its standard error over the first n_k seeds,

    upper_k = mean + c_k * se        lower_k = mean - c_k * se
    PASS  upper_k <= margin          FAIL  lower_k > margin (or a run failed)          otherwise: add a seed

and at the last look (n = max_seeds) what is still undecided is INCONCLUSIVE. The same c_k serve both
directions, so a false FAIL at a true gap equal to the margin is also <= 5%. A candidate decided at look k
runs no more seeds; the bf16 baseline runs as long as one candidate is undecided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

from fp8train.evidence import stats
from fp8train.training.config.validation import AUTO_SEEDS, SPENDING_RULES
from fp8train.training.runs.run_log import counted

__all__ = ["FIRST_LOOK", "spend", "SequentialDesign", "make_design", "look_decision", "SequentialOutcome",
           "sequential_verdict", "sequential_plan"]

FIRST_LOOK = 2  # seeds at the first look: one seed has no spread, hence no bound
_NORMAL = NormalDist()


def spend(rule: str, t: float, alpha: float) -> float:
    """alpha(t): the one-sided error spent by information fraction t in [0, 1] (Lan & DeMets 1983)."""
    if rule not in SPENDING_RULES:
        raise ValueError(f"validate.spending={rule!r}: allowed {list(SPENDING_RULES)}")
    if t <= 0:
        return 0.0
    t = min(t, 1.0)
    if rule == "pocock":
        return alpha * math.log(1 + (math.e - 1) * t)
    return 2 - 2 * _NORMAL.cdf(_NORMAL.inv_cdf(1 - alpha / 2) / math.sqrt(t))


@dataclass(frozen=True)
class SequentialDesign:
    """The looks (seeds at each), the alpha each spends and their t critical values c_k (module docstring)."""

    looks: tuple[int, ...]
    spent: tuple[float, ...]
    critical: tuple[float, ...]
    rule: str
    alpha: float

    def as_dict(self) -> dict:
        return {"rule": self.rule, "alpha": self.alpha, "looks": list(self.looks), "spent": list(self.spent),
                "critical": list(self.critical)}


@lru_cache(maxsize=64)
def make_design(max_seeds: int, rule: str = "pocock",
                alpha: float = round(1 - stats.CONFIDENCE, 12)) -> SequentialDesign:
    """Looks at 2, 3, ..., max_seeds seeds, information fraction n / max_seeds."""
    if max_seeds < FIRST_LOOK:
        raise ValueError(f"validate.max_seeds={max_seeds}: at least {FIRST_LOOK} (one seed has no spread)")
    looks = tuple(range(FIRST_LOOK, max_seeds + 1))
    cumulative = [spend(rule, n / max_seeds, alpha) for n in looks]
    spent = tuple(b - a for a, b in zip([0.0] + cumulative[:-1], cumulative))
    critical = tuple(stats.t_quantile(1 - a, n - 1) for a, n in zip(spent, looks))
    return SequentialDesign(looks, spent, critical, rule, alpha)


def look_decision(est: stats.GapEstimate, critical: float, margin: float, last: bool) -> tuple[str, str, float, float]:
    """(verdict, reason, lower, upper) at one look: pass, fail, inconclusive (the last look), or continue."""
    if est.n < 2 or not math.isfinite(est.se):
        return ("inconclusive" if last else "continue"), counted(est.n, "usable seed"), -math.inf, math.inf
    lower, upper = est.mean - critical * est.se, est.mean + critical * est.se
    at = f"at {est.n} seeds (critical value {critical:.3g})"
    if lower > margin:
        return "fail", f"lower bound {lower:+.2%} > margin {margin:.2%} {at}: worse than the margin", lower, upper
    if upper <= margin:
        return "pass", f"upper bound {upper:+.2%} <= margin {margin:.2%} {at}", lower, upper
    if last:
        return ("inconclusive", f"bounds [{lower:+.2%}, {upper:+.2%}] straddle margin {margin:.2%} {at}, the "
                "last look (validate.max_seeds)", lower, upper)
    return "continue", f"bounds [{lower:+.2%}, {upper:+.2%}] straddle margin {margin:.2%} {at}", lower, upper


@dataclass(frozen=True)
class SequentialOutcome:
    """Where one candidate stands: ``verdict`` pass | fail | inconclusive (the last look) | continue (the next
    look needs ``next_seeds`` seeds); the bounds of the latest look held (``seeds`` seeds, critical value)."""

    verdict: str
    reason: str
    estimate: stats.GapEstimate
    lower: float
    upper: float
    critical: float
    look: int  # 1-based index of the latest look held, 0 before the first
    next_seeds: int | None = None


def sequential_verdict(gaps: list[float], design: SequentialDesign, margin: float,
                       failures: list[str] = ()) -> SequentialOutcome:
    """The looks over ``gaps`` (finite per-seed paired gaps, in seed order, as many as have run), from the
    first, until one decides; a failure (a diverged or stopped run) decides FAIL at once."""
    est = stats.estimate(list(gaps))
    if failures:
        return SequentialOutcome("fail", "; ".join(failures), est, est.lower, est.upper, math.nan, 0)
    outcome = SequentialOutcome("continue", f"needs {design.looks[0]} seeds for its first look", est, -math.inf,
                                math.inf, math.nan, 0, design.looks[0])
    for look, (n, critical) in enumerate(zip(design.looks, design.critical), start=1):
        if len(gaps) < n:
            return outcome
        est = stats.estimate(list(gaps[:n]))
        last = look == len(design.looks)
        verdict, reason, lower, upper = look_decision(est, critical, margin, last)
        outcome = SequentialOutcome(verdict, reason, est, lower, upper, critical, look,
                                    None if last or verdict != "continue" else design.looks[look])
        if verdict != "continue":
            return outcome
    return outcome


def sequential_plan(validate_cfg) -> dict | None:
    """What plan.json declares of a validate.seeds=auto design before any run (None for a fixed design)."""
    if validate_cfg.seeds != AUTO_SEEDS:
        return None
    design = make_design(validate_cfg.max_seeds, validate_cfg.spending)
    return {"max_seeds": validate_cfg.max_seeds, **design.as_dict()}
