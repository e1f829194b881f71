"""Paired validation: the verdict arithmetic on hand-made curves, candidate specs and bad input, and one short
real CPU validation in which a sound recipe passes and a deliberately broken one fails, interrupted and resumed.

The broken candidate flushes every value to zero: `current` with margin 20 puts amax at 448 / 2**20 = 2**-11.2,
below E4M3's smallest subnormal 2**-9, and with policy.exclude=[] the output head is FP8 too, so its logits are
0 and the loss stays at ln(256) = 5.55 while bf16 falls to ~3. A gap of ~80% is far from any threshold, so the
test cannot flake on noise.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from fp8train.training.config import load_config
from fp8train.evidence.validate import (BASELINE, Candidate, DivergenceGuard, compare, first_out_of_band, load_curve,
                               parse_candidate, per_step, plan_runs, run_validation)

pytestmark = pytest.mark.usefixtures("single_thread")


def _curve(values, steps=(0, 10, 20, 30, 40)):
    return dict(zip(steps, values))


BASE = _curve([5.5, 4.0, 3.5, 3.2, 3.0])
SEED = _curve([5.6, 4.1, 3.55, 3.23, 3.03])  # final window (30, 40): band = |3.13 - 3.10| = 0.03 abs, ~0.97% rel


# ------------------------------------------------------------------------------------------------------------
# Verdict arithmetic, against numbers computed by hand
# ------------------------------------------------------------------------------------------------------------
def test_inside_band_passes_with_hand_computed_gap():
    cand = _curve([5.5, 4.02, 3.51, 3.22, 3.02])  # final window mean 3.12 vs 3.10
    v = compare(BASE, cand, [SEED], margin=0.005, final_window=2)
    assert v["window_steps"] == [30, 40]
    assert v["gap_abs"] == pytest.approx(0.02)
    assert v["gap_rel"] == pytest.approx(0.02 / 3.10)
    assert v["noise_band_abs"] == pytest.approx(0.03)
    assert v["noise_band_rel"] == pytest.approx(0.03 / 3.10)
    assert v["threshold_rel"] == pytest.approx(0.03 / 3.10)  # the band (0.97%) beats the margin (0.5%)
    assert v["pass"] and v["first_step_out_of_band"] is None


def test_outside_band_fails_and_names_first_step():
    cand = _curve([5.5, 4.01, 3.7, 3.5, 3.4])  # +5.7% at step 20, +12.5% final
    v = compare(BASE, cand, [SEED], margin=0.02, final_window=2)
    assert v["gap_rel"] == pytest.approx((3.45 - 3.10) / 3.10)
    assert v["threshold_rel"] == pytest.approx(0.02)  # margin beats the band
    assert not v["pass"] and "threshold" in v["reason"]
    # Step 10: +0.25% within max(band 2.5%, 2%); step 20: +5.7% > max(1.4%, 2%).
    assert v["first_step_out_of_band"] == 20


def test_negative_gap_passes_one_sided():
    cand = _curve([5.5, 3.8, 3.2, 2.9, 2.7])  # FP8 ~10% better: outside the band, but on the good side
    v = compare(BASE, cand, [SEED], margin=0.01, final_window=2)
    assert v["gap_rel"] < -0.05 and v["pass"]
    assert v["first_step_out_of_band"] is None


def test_margin_only_without_seeds_and_boundary():
    cand = _curve([5.5, 4.0, 3.5, 3.2, 3.0 * 1.02])  # final window 1: exactly +2%
    v = compare(BASE, cand, [], margin=0.02, final_window=1)
    assert v["noise_band_rel"] == 0.0 and v["gap_rel"] == pytest.approx(0.02)
    assert v["pass"] == (v["gap_rel"] <= 0.02)  # <= at the boundary, up to float rounding
    assert not compare(BASE, cand, [], margin=0.019, final_window=1)["pass"]


@pytest.mark.parametrize("status", ["diverged", "stopped"])
def test_unfinished_or_nonfinite_candidate_fails(status):
    cand = _curve([5.5, 4.0, 3.5], steps=(0, 10, 20))
    v = compare(BASE, cand, [SEED], margin=0.5, final_window=2, status=status, reason="loss became nan at step 23")
    assert not v["pass"] and status in v["reason"] and "step 23" in v["reason"]
    assert v["window_steps"] == [10, 20]  # compared at the steps it reached, against the baseline there
    nan = _curve([5.5, 4.0, float("nan"), 3.2, 3.0])
    v = compare(BASE, nan, [SEED], margin=0.5, final_window=2)
    assert not v["pass"] and v["first_step_out_of_band"] == 20


def test_per_step_band_and_threshold():
    rows = per_step(BASE, _curve([5.5, 4.0, 3.5, 3.2, 3.0]), [SEED, _curve([5.4, 4.3, 3.5, 3.2, 3.0])], 0.01)
    assert [r["step"] for r in rows] == [0, 10, 20, 30, 40]
    assert rows[1]["band_abs"] == pytest.approx(0.3)  # max(|4.1-4|, |4.3-4|)
    assert rows[1]["threshold_rel"] == pytest.approx(0.3 / 4.0)
    assert rows[4]["threshold_rel"] == pytest.approx(0.01)  # band 1% (0.03/3) vs margin 1%
    assert first_out_of_band(rows) is None


def test_divergence_guard():
    from fp8train.evidence.validate import Curve

    base = Curve(val={10: 3.0}, train={5: 4.0, 10: 3.1})
    guard = DivergenceGuard(base, factor=1.5, enabled=True)
    assert guard({"step": 5, "loss": 5.9}) is None  # 5.9 < 1.5 x 4.0
    assert "step 5" in guard({"step": 5, "loss": 6.1})
    assert "val_loss" in guard({"step": 10, "loss": 3.0, "val_loss": 4.6})
    assert guard({"step": 7, "loss": 100.0}) is None  # no baseline value at step 7
    assert "nan" in guard({"step": 7, "loss": float("nan")})
    off = DivergenceGuard(base, factor=1.5, enabled=False)
    assert off({"step": 5, "loss": 6.1}) is None and off({"step": 5, "loss": math.inf}) is not None


# ------------------------------------------------------------------------------------------------------------
# Candidate specs and bad input
# ------------------------------------------------------------------------------------------------------------
def test_parse_candidate_specs():
    assert parse_candidate("delayed") == Candidate("delayed", "delayed", ())
    c = parse_candidate("bad=current:margin=20,policy.exclude=[]")
    assert c == Candidate("bad", "current", ("fp8.margin=20", "policy.exclude=[]"))
    assert parse_candidate("current:input_format=e5m2").label == "current+input_format=e5m2"


@pytest.mark.parametrize("spec, match", [("none", "baseline"), ("fp16", "does not name"),
                                         ("current:margin", "KEY=VALUE"), ("bf16=current", "label")])
def test_bad_candidate_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_candidate(spec)


TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.batch_size=8",
        "train.max_steps=40", "train.eval_every=10", "train.eval_batches=2", "optim.warmup_steps=5",
        "policy.min_features=16", "log.wandb=disabled", "log.every=5", "log.telemetry_every=10",
        "data.max_bytes=300000", "validate.margin=0.05", "validate.final_window=2", "validate.extra_seeds=1"]


@pytest.mark.parametrize("overrides, match", [
    (["validate.candidates=[none]"], "validate.candidates"),
    (["validate.candidates=[]"], "validate.candidates"),
    (["validate.margin=-0.1"], "validate.margin"),
    (["validate.final_window=9"], "final_window"),
])
def test_bad_validation_config_is_a_clear_error(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        cfg = load_config(None, TINY + [f"run.dir={tmp_path}", *overrides])
        plan_runs(cfg)
    assert not any(tmp_path.iterdir())  # nothing written


def test_plan_pairs_runs():
    cfg = load_config(None, TINY + ["run.dir=/nonexistent", "validate.extra_seeds=2",
                                    "validate.candidates=[delayed,block]"])
    runs = plan_runs(cfg)
    assert [r.label for r in runs] == [BASELINE, "delayed", "block", "bf16-seed1338", "bf16-seed1339"]
    assert [r.cfg.fp8.recipe for r in runs] == ["none", "delayed", "block", "none", "none"]
    assert [r.cfg.train.seed for r in runs] == [1337, 1337, 1337, 1338, 1339]  # pairs share seed -> init, data
    assert all(r.cfg.train.resume and r.cfg.checkpoint.every > 0 for r in runs)
    assert {r.cfg.run.dir for r in runs} == {"/nonexistent/run/runs"}


# ------------------------------------------------------------------------------------------------------------
# One real validation on CPU: interrupted after the baseline, resumed, verdicts, report, hash mismatch
# ------------------------------------------------------------------------------------------------------------
class _Interrupt(Exception):
    pass


def test_real_validation_sound_passes_bad_fails_and_resumes(tmp_path, monkeypatch):
    import fp8train.training.loop as train_module

    cfg = load_config(None, TINY + [f"run.dir={tmp_path}", "run.name=val", "checkpoint.every=20"])
    candidates = ["current", "bad=current:margin=20,policy.exclude=[]"]
    vdir = tmp_path / "val"

    # 1) Interrupt the first candidate at step 25, after its step-20 checkpoint (the baseline has finished).
    real_train = train_module.train

    def interrupted(run_cfg, accelerator=None, show_progress=True, should_stop=None):
        def stop(record):
            if run_cfg.run.name == "current" and record["step"] == 25:
                raise _Interrupt
            return should_stop(record) if should_stop else None
        return real_train(run_cfg, accelerator, show_progress, stop)

    monkeypatch.setattr(train_module, "train", interrupted)
    with pytest.raises(_Interrupt):
        run_validation(cfg, candidates=candidates, show_progress=False)
    plan = json.loads((vdir / "plan.json").read_text())
    assert plan["margin"] == 0.05 and [c["label"] for c in plan["candidates"]] == ["current", "bad"]
    base_summary = vdir / "runs" / BASELINE / "summary.json"
    assert json.loads(base_summary.read_text())["status"] == "completed"
    assert not (vdir / "runs" / "current" / "summary.json").exists()
    mtime = os.stat(base_summary).st_mtime_ns

    # 2) Re-run: the baseline is reused untouched, the candidate resumes from step 20, the rest runs.
    monkeypatch.setattr(train_module, "train", real_train)
    logs = []
    summary = run_validation(cfg, candidates=candidates, show_progress=False, log=logs.append)
    assert any(f"{BASELINE}: finished earlier" in line and "reused" in line for line in logs)
    assert os.stat(base_summary).st_mtime_ns == mtime
    current = json.loads((vdir / "runs" / "current" / "summary.json").read_text())
    assert current["status"] == "completed" and current["resumed_from"].endswith("step_000020")

    # 3) The verdicts: the sound recipe passes, the broken one is stopped by the divergence guard and fails.
    verdicts = summary["candidates"]
    assert verdicts["current"]["pass"], verdicts["current"]
    assert abs(verdicts["current"]["gap_rel"]) < 0.05
    assert not verdicts["bad"]["pass"] and verdicts["bad"]["status"] == "stopped"
    assert "diverged" in verdicts["bad"]["reason"]
    assert summary["verdict"] == "fail"
    base_curve = load_curve(vdir / "runs" / BASELINE)
    assert base_curve.val[40] < base_curve.val[0] - 1.0  # the baseline learned something
    for name in ("report.md", "loss_curves.png", "gap.png", "health.png", "summary.json"):
        assert (vdir / name).stat().st_size > 0, name
    on_disk = json.loads((vdir / "summary.json").read_text())
    assert on_disk["verdict"] == "fail" and set(on_disk["candidates"]) == {"current", "bad"}
    report = (vdir / "report.md").read_text()
    assert "5.00%" in report and "| bad |" in report and "**FAIL**" in report
    # The flushed-to-zero candidate's telemetry says so: its layers are flagged for underflow.
    assert "underflow" in report and "policy:" in report

    # 4) A different config in the same directory is refused before anything is written.
    before = {p: os.stat(p).st_mtime_ns for p in vdir.rglob("*") if p.is_file()}
    for override in (["train.lr=1e-3"], ["validate.margin=0.1"]):
        other = load_config(None, TINY + [f"run.dir={tmp_path}", "run.name=val", "checkpoint.every=20", *override])
        with pytest.raises(ValueError, match="different config"):
            run_validation(other, candidates=candidates, show_progress=False)
    assert {p: os.stat(p).st_mtime_ns for p in vdir.rglob("*") if p.is_file()} == before
