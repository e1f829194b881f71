"""The verdict exactly at its bounds and one float step past them.

PASS is `upper bound <= margin`, FAIL is `lower bound > margin`: an upper bound exactly on the margin passes and
one float step above it does not; a lower bound exactly on the margin does not fail and one step above it does.
The paired gaps are exact in float64 (powers of two), so the bounds below are computed by hand: with gaps
(g - d, g + d), n = 2, mean g, sd = d * sqrt(2), se = d, bounds g -/+ t(0.95, 1) * d.
"""

from __future__ import annotations

import math

import pytest

from fp8train.evidence.stats import GapEstimate, decide, estimate, t_quantile

STEP_UP = math.nextafter(0.25, math.inf)
STEP_DOWN = math.nextafter(0.25, 0.0)


def _bounds(lower: float, upper: float) -> GapEstimate:
    return GapEstimate(n=4, mean=(lower + upper) / 2, sd=0.1, se=0.05, lower=lower, upper=upper, mdg=0.2)


@pytest.mark.parametrize("lower, upper, margin, verdict", [
    (0.0, 0.25, 0.25, "pass"),              # upper == margin: on the threshold, passes
    (0.0, 0.25, STEP_DOWN, "inconclusive"),  # margin one float step smaller: no longer passes
    (0.0, STEP_UP, 0.25, "inconclusive"),    # upper one step over the margin
    (0.0, STEP_DOWN, 0.25, "pass"),          # one step under
    (0.25, 0.5, 0.25, "inconclusive"),       # lower == margin: not (yet) worse than the margin
    (STEP_UP, 0.5, 0.25, "fail"),            # lower one step over: fails
])
def test_bounds_against_the_margin_are_exact(lower, upper, margin, verdict):
    assert decide(_bounds(lower, upper), margin, [])[0] == verdict


def test_hand_computed_bounds_of_two_seeds():
    g, d = 0.125, 0.0625
    est = estimate([g - d, g + d])
    t = t_quantile(0.95, 1)
    assert est.mean == g and est.se == pytest.approx(d, rel=1e-15)
    assert est.upper == pytest.approx(g + t * d, rel=1e-15) and est.lower == pytest.approx(g - t * d, rel=1e-15)
    assert decide(est, est.upper, [])[0] == "pass"  # the margin set exactly to the bound
