"""The verdict arithmetic of a paired validation: pure functions of numbers (no torch, no files).

The unit of evidence is one seed's paired gap. For seed s, with the candidate and the bf16 baseline trained from
the same initial weights on the same batches and evaluated on the same validation batches,

    g_s = (mean of candidate_s over the window - mean of baseline_s over the window) / mean of baseline_s

where the window is the baseline's last W evaluation steps (W = validate.final_window). Over n seeds:

    mean = sum(g_s) / n,   sd = sample standard deviation (n - 1 in the denominator),   se = sd / sqrt(n)
    upper = mean + t(0.95, n - 1) * se        lower = mean - t(0.95, n - 1) * se

t(p, df) is the p-quantile of Student's t with df degrees of freedom, so upper and lower are one-sided 95%
confidence bounds on the true mean gap (together a two-sided 90% interval). Against the declared margin m:

    FAIL          a run diverged or stopped, a loss is non-finite, or lower > m (worse than the margin, 95% sure)
    PASS          upper <= m (no worse than the margin, 95% sure)
    INCONCLUSIVE  otherwise: the interval straddles m; `seeds_needed` says how many seeds, at the observed mean
                  and spread, would put it on one side

The minimum detectable gap of the design is

    mdg = (t(0.95, n - 1) + t(0.80, n - 1)) * sd / sqrt(n)

the true gap a one-sided 95% test detects (lower bound above 0) with 80% power at the observed spread. Read the
other way: a candidate whose true gap is at most m - mdg passes with probability about 80% or more, so a design
with mdg <= m can pass a harmless recipe, and a PASS rules out true gaps above m at 95% confidence.
With one seed there is no spread, hence no bound: the verdict is INCONCLUSIVE unless a run failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from fp8train.training.runs.run_log import counted

__all__ = [
    "CONFIDENCE", "POWER", "VERDICTS", "t_cdf", "t_quantile", "window_steps", "paired_gap", "GapEstimate",
    "estimate", "seeds_needed", "decide", "overall_verdict",
]

CONFIDENCE = 0.95  # one-sided, for both bounds
POWER = 0.80  # of the minimum detectable gap
VERDICTS = ("pass", "fail", "inconclusive")
MAX_SEEDS_NEEDED = 10_000  # beyond this "seeds needed" is reported as None: the mean sits on the margin


# ------------------------------------------------------------------------------------------------------------
# Student's t, from the regularized incomplete beta function (no scipy)
# ------------------------------------------------------------------------------------------------------------
def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b), evaluated with the modified Lentz method."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 500):
        # even step, then odd step of the fraction's recurrence
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result


def _regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b) = B(x; a, b) / B(a, b) for 0 <= x <= 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    # The fraction converges fast only for x < (a + 1) / (a + b + 2); use the symmetry I_x(a,b) = 1 - I_1-x(b,a).
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError(f"t_cdf: degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * _regularized_beta(df / (df + t * t), df / 2.0, 0.5)  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


@lru_cache(maxsize=4096)
def t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t (t_cdf inverted by bisection to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    low, high = 0.0, 1.0
    while t_cdf(high, df) < p:  # bracket: the quantile of p < 1 is finite
        low, high = high, 2.0 * high
    for _ in range(200):
        mid = 0.5 * (low + high)
        if t_cdf(mid, df) < p:
            low = mid
        else:
            high = mid
        if high - low < 1e-12 * max(1.0, high):
            break
    return 0.5 * (low + high)


# ------------------------------------------------------------------------------------------------------------
# One seed: the paired gap over the final window
# ------------------------------------------------------------------------------------------------------------
def window_steps(baseline: dict[int, float], window: int) -> list[int]:
    """The baseline's last ``window`` evaluation steps after step 0 (step 0 is the untrained model)."""
    return sorted(s for s in baseline if s > 0)[-window:]


def paired_gap(baseline: dict[int, float], candidate: dict[int, float], window: int) -> float:
    """g_s: the relative gap of the candidate's window mean over the baseline's, at the baseline's last
    ``window`` evaluation steps. NaN when the candidate lacks one of them or a value is not finite."""
    steps = window_steps(baseline, window)
    if not steps or any(s not in candidate for s in steps):
        return math.nan
    base_mean = sum(baseline[s] for s in steps) / len(steps)
    cand_mean = sum(candidate[s] for s in steps) / len(steps)
    if not (math.isfinite(base_mean) and math.isfinite(cand_mean)) or base_mean == 0:
        return math.nan
    return (cand_mean - base_mean) / abs(base_mean)


# ------------------------------------------------------------------------------------------------------------
# Over seeds: estimate, bounds, minimum detectable gap
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GapEstimate:
    """Mean paired gap over ``n`` seeds with its one-sided 95% bounds and the design's minimum detectable gap
    (NaN where undefined: no seeds, or one seed for sd, bounds and mdg)."""

    n: int
    mean: float
    sd: float
    se: float
    lower: float
    upper: float
    mdg: float


def estimate(gaps: list[float]) -> GapEstimate:
    """The estimate from finite per-seed gaps (see the module docstring for the formulas)."""
    n = len(gaps)
    if n == 0 or not all(math.isfinite(g) for g in gaps):
        return GapEstimate(n, math.nan, math.nan, math.nan, math.nan, math.nan, math.nan)
    mean = sum(gaps) / n
    if n == 1:
        return GapEstimate(1, mean, math.nan, math.nan, -math.inf, math.inf, math.nan)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / (n - 1))
    se = sd / math.sqrt(n)
    t_conf, t_power = t_quantile(CONFIDENCE, n - 1), t_quantile(POWER, n - 1)
    return GapEstimate(n, mean, sd, se, mean - t_conf * se, mean + t_conf * se, (t_conf + t_power) * se)


def seeds_needed(mean: float, sd: float, margin: float) -> int | None:
    """The fewest seeds n with t(0.95, n - 1) * sd / sqrt(n) < |margin - mean|: at this mean and spread, the
    bound would then sit on one side of the margin. None when no count up to MAX_SEEDS_NEEDED does."""
    distance = abs(margin - mean)
    if not (math.isfinite(distance) and math.isfinite(sd)) or distance == 0:
        return None

    def decides(n: int) -> bool:
        return t_quantile(CONFIDENCE, n - 1) * sd / math.sqrt(n) < distance

    if not decides(MAX_SEEDS_NEEDED):
        return None
    low, high = 1, MAX_SEEDS_NEEDED  # the half-width falls as n grows, so bisect: decides(high), not low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if decides(mid) else (mid, high)
    return high


def decide(est: GapEstimate, margin: float, failures: list[str]) -> tuple[str, str]:
    """(verdict, reason) of one candidate. ``failures``: what went wrong in its runs (diverged, stopped,
    non-finite loss), each a sentence; any makes it FAIL."""
    if failures:
        return "fail", "; ".join(failures)
    if est.n < 2:
        return "inconclusive", f"{counted(est.n, 'seed')}: at least 2 are needed for a confidence bound"
    if est.lower > margin:
        return "fail", f"lower bound {est.lower:+.2%} > margin {margin:.2%}: worse than the margin"
    if est.upper <= margin:
        return "pass", f"upper bound {est.upper:+.2%} <= margin {margin:.2%}"
    needed = seeds_needed(est.mean, est.sd, margin)
    more = (f"about {counted(needed, 'seed')} at this spread would decide" if needed is not None
            else "the mean sits on the margin: no number of seeds decides")
    return "inconclusive", f"bounds [{est.lower:+.2%}, {est.upper:+.2%}] straddle margin {margin:.2%}; {more}"


def overall_verdict(verdicts: list[str]) -> str:
    """FAIL if any candidate fails, else INCONCLUSIVE if any is, else PASS (no candidates: inconclusive)."""
    if "fail" in verdicts:
        return "fail"
    if "inconclusive" in verdicts or not verdicts:
        return "inconclusive"
    return "pass"
