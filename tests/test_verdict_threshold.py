"""The verdict exactly at its bounds and one float step past them.

PASS is `upper bound <= margin`, FAIL is `lower bound > margin`: an upper bound exactly on the margin passes and
one float step above it does not; a lower bound exactly on the margin does not fail and one step above it does.
The paired gaps are exact in float64 (powers of two), so the bounds below are computed by hand: with gaps
(g - d, g + d), n = 2, mean g, sd = d * sqrt(2), se = d, bounds g -/+ t(0.95, 1) * d.
"""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from fp8train.evidence.stats import GapEstimate, decide, estimate, t_quantile
from fp8train.evidence.validate import run_validation
from fp8train.training.config import load_config

# 2 paired seeds of a tiny model (conftest's tiny corpus), 10 steps, evaluated at 5 and 10, no telemetry.
TINY_VALIDATION = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.batch_size=8",
                   "train.max_steps=10", "train.eval_every=5", "train.eval_batches=2", "optim.warmup_steps=2",
                   "policy.min_features=16", "log.wandb=disabled", "log.every=5", "log.telemetry_every=0",
                   "validate.seeds=2", "validate.final_window=1", "validate.margin=0.05", "validate.workers=1",
                   "train.autocast=none", "train.threads=1"]
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


def test_t_quantiles_of_one_and_two_degrees_of_freedom_have_closed_forms():
    """Independent references for the bounds: t with 1 df is Cauchy, quantile tan(pi (p - 1/2)); with 2 df the
    quantile is (2p - 1) / sqrt(2 p (1 - p))."""
    assert t_quantile(0.95, 1) == pytest.approx(math.tan(math.pi * 0.45), rel=1e-10)
    assert t_quantile(0.95, 2) == pytest.approx(0.9 / math.sqrt(2 * 0.95 * 0.05), rel=1e-10)


# ------------------------------------------------------------------------------------------------------------
# Through a real validation and `fp8train report`
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_validation_verdict_at_and_past_its_bounds(tmp_path, tiny, commands, capsys):
    """A real 2-seed CPU validation of `current`; then the declared margin (plan.json and every run's config.yaml)
    is set exactly on the candidate's upper bound, one float step below it, exactly on its lower bound and one step
    below that, where those are margins a validation can declare (in (0, 1)), and `fp8train report` recomputes the
    verdict from the run files each time: pass, inconclusive, inconclusive, fail, in summary.json and report.md."""
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=val", f"data.path={tiny.corpus}", *TINY_VALIDATION])
    first = run_validation(cfg, candidates=["current"], show_progress=False)["candidates"]["current"]
    lower, upper = first["gap_lower"], first["gap_upper"]
    assert first["seeds"] == 2 and math.isfinite(lower) and lower < upper
    vdir = tmp_path / "val"
    plan = json.loads((vdir / "plan.json").read_text())
    assert upper > 0  # the boundary a margin can be declared at (a margin is in (0, 1))
    probed = []
    for margin, verdict in ((upper, "pass"), (math.nextafter(upper, -math.inf), "inconclusive"),
                            (lower, "inconclusive"), (math.nextafter(lower, -math.inf), "fail")):
        if not 0 < margin < 1:  # not a margin a validation can declare (lower is usually < 0 here)
            continue
        probed.append(verdict)
        # As a validation planned with this margin would be: plan.json and every run's config.yaml declare it
        # (`report` refuses a plan.json edited on its own: test_report_tampering.py)
        (vdir / "plan.json").write_text(json.dumps({**plan, "margin": margin}))
        for config_file in (vdir / "runs").glob("*/seed*/config.yaml"):
            run_cfg = OmegaConf.load(config_file)
            run_cfg.validate.margin = margin
            OmegaConf.save(run_cfg, config_file)
        code, out, err = commands.main(["report", str(vdir)], capsys)
        assert code == 0, err
        summary = json.loads((vdir / "summary.json").read_text())
        candidate = summary["candidates"]["current"]
        assert (candidate["gap_lower"], candidate["gap_upper"]) == (lower, upper)  # the same runs, re-read
        assert candidate["verdict"] == verdict and summary["verdict"] == verdict, (margin, candidate["reason"])
        assert f"**Verdict: {verdict.upper()}**" in (vdir / "report.md").read_text()
    assert probed[:2] == ["pass", "inconclusive"]  # at the upper bound and one float step below it
