"""The verdict exactly at its threshold and one float step past it.

A candidate whose gap equals the threshold passes (the rule is `gap <= threshold`); one float step worse fails.
The losses are powers of two and small integers, so every gap below is exact in float64: (5 - 4) / 4 = 0.25.
"""

from __future__ import annotations

import math

import pytest

from fp8train.evidence.validate import compare

BASE = {0: 8.0, 10: 4.0}
STEP_UP = math.nextafter(0.25, math.inf)
STEP_DOWN = math.nextafter(0.25, 0.0)


@pytest.mark.parametrize("candidate_final, margin, passes", [
    (5.0, 0.25, True),                                # gap 0.25 == margin: on the threshold, passes
    (5.0, STEP_DOWN, False),                          # margin one float step smaller: fails
    (math.nextafter(5.0, math.inf), 0.25, False),     # gap one step over the margin: fails
    (math.nextafter(5.0, 0.0), 0.25, True),           # one step under: passes
])
def test_margin_threshold_is_inclusive(candidate_final, margin, passes):
    v = compare(BASE, {0: 8.0, 10: candidate_final}, [], margin=margin, final_window=1)
    assert v["gap_rel"] == (candidate_final - 4.0) / 4.0 and v["threshold_rel"] == margin
    assert v["pass"] is passes, v


@pytest.mark.parametrize("candidate_final, passes", [(5.0, True), (math.nextafter(5.0, math.inf), False)])
def test_noise_band_threshold_is_inclusive(candidate_final, passes):
    """The seed band sets the threshold when it is wider than the margin: a second bf16 seed ending at 5.0 makes
    the band |5 - 4| / 4 = 0.25 > margin 0.1; a gap exactly on the band passes, one step past it fails."""
    v = compare(BASE, {0: 8.0, 10: candidate_final}, [{0: 8.0, 10: 5.0}], margin=0.1, final_window=1)
    assert v["noise_band_rel"] == 0.25 and v["threshold_rel"] == 0.25
    assert v["pass"] is passes, v
