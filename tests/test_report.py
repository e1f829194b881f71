"""Reports and FP8 health: telemetry of a hand-built tensor with known clipping and underflow, the per-layer
aggregation and the advisor's two kinds of thresholds (mean and worst step), and report generation from a
hand-written validation directory (no training: every number below is chosen so that the expected verdict,
bounds and MDG can be computed by hand)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp8train.evidence import advisor
from fp8train.evidence.curves import Curve
from fp8train.evidence.report import write_report
from fp8train.training.runs import telemetry
from fp8train.training.config import config_hash, config_to_yaml, load_config

pytestmark = pytest.mark.usefixtures("single_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------------------------------
# Telemetry
# ------------------------------------------------------------------------------------------------------------
def test_fp8linear_telemetry_counts_known_clipping_and_underflow():
    from fp8train.nn.linear import Fp8Linear
    from fp8train.nn.recipes import recipe

    layer = Fp8Linear(16, 16, bias=False, recipe=recipe("delayed"))
    # Delayed scaling with a fixed dequant scale of 1: E4M3 holds [2**-9, 448]. Of 256 input values, 32 are
    # 1000 (past 448 + half a top step = 464: clipped) and 64 are 2**-12 (below half the smallest subnormal,
    # 2**-10: flushed to 0); the other 160 are 1.0 (exact).
    layer.input_scale.fill_(1.0)
    layer.input_scale_amax.fill_(448.0)
    layer.input_initialized.fill_(True)
    x = torch.ones(256)
    x[:32] = 1000.0
    x[32:96] = 2.0 ** -12
    x = x[torch.randperm(256)].reshape(16, 16)
    telemetry.enable([("fc", layer)], True)
    layer(x).sum().backward()
    stats = telemetry.collect([("fc", layer)])["fc"]
    assert stats["input"]["overflow_frac"] == pytest.approx(32 / 256)
    assert stats["input"]["underflow_frac"] == pytest.approx(64 / 256)
    assert stats["input"]["amax"] == pytest.approx(1000.0)
    assert stats["input"]["staleness"] == pytest.approx(1000.0 / 448.0)
    # Reference SQNR: the error is 552 on 32 clipped values and 2**-12 on 64 flushed ones.
    signal = 32 * 1000.0 ** 2 + 64 * 2.0 ** -24 + 160
    noise = 32 * 552.0 ** 2 + 64 * 2.0 ** -24
    assert stats["input"]["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), abs=1e-6)
    assert set(stats) == {"input", "weight", "grad_output"} and not layer.telemetry


# ------------------------------------------------------------------------------------------------------------
# Aggregation and the advisor
# ------------------------------------------------------------------------------------------------------------
def _record(step, layers, seed=None):
    return {"step": step, "layers": layers, **({"seed": seed} if seed is not None else {})}


def _stats(over=0.0, under=0.0, sqnr=30.0, stale=None):
    return {"amax": 1.0, "scale": 1.0, "overflow_frac": over, "underflow_frac": under, "sqnr_db": sqnr,
            "staleness": stale, "nonfinite": False}


def test_layer_table_aggregates_dedupes_and_keeps_the_worst_step():
    records = [
        _record(10, {"a": {"input": _stats(over=0.5, under=0.1, sqnr=10.0, stale=2.0)}}),
        _record(20, {"a": {"input": _stats(over=0.0, under=0.3, sqnr="inf")}}),
        _record(20, {"a": {"input": _stats(over=0.1, under=0.3, sqnr=20.0)}}),  # resumed run repeats step 20
    ]
    row = advisor.layer_table(records)["a"]["input"]
    assert row["samples"] == 2
    assert row["overflow_frac"] == pytest.approx(0.3) and row["overflow_frac_max"] == pytest.approx(0.5)
    assert row["overflow_frac_max_at"] == {"step": 10, "seed": None}
    assert row["underflow_frac"] == pytest.approx(0.2) and row["underflow_frac_max"] == pytest.approx(0.3)
    assert row["sqnr_db"] == pytest.approx(15.0) and row["sqnr_db_min"] == pytest.approx(10.0)
    assert row["staleness_max"] == pytest.approx(2.0) and row["staleness_max_at"]["step"] == 10
    exact = advisor.layer_table([_record(10, {"b": {"weight": _stats(sqnr="inf")}})])["b"]["weight"]
    assert exact["sqnr_db"] == math.inf  # quantized exactly: never flagged
    # Two seeds' records of the same step are two samples, not one
    pooled = advisor.layer_table([_record(10, {"a": {"input": _stats()}}, seed=1),
                                  _record(10, {"a": {"input": _stats(sqnr=5.0)}}, seed=2)])["a"]["input"]
    assert pooled["samples"] == 2 and pooled["sqnr_db_min_at"] == {"step": 10, "seed": 2}


@pytest.mark.parametrize("stats, flagged", [
    (_stats(), False),
    (_stats(sqnr=14.9), True), (_stats(sqnr=15.1), False),
    (_stats(over=0.0011), True), (_stats(over=0.0009), False),
    (_stats(under=0.11), True), (_stats(under=0.09), False),
])
def test_advisor_mean_thresholds(stats, flagged):
    table = advisor.layer_table([_record(10, {"layers.0.mlp.down_proj": {"grad_output": stats}})])
    assert bool(advisor.advise(table)) == flagged


@pytest.mark.parametrize("spike, flagged", [
    (_stats(sqnr=9.9), True), (_stats(sqnr=10.1), False),
    (_stats(over=0.0101), True), (_stats(over=0.0099), False),
    (_stats(under=0.51), True), (_stats(under=0.49), False),
    (_stats(stale=4.1), True), (_stats(stale=3.9), False),
])
def test_advisor_worst_step_thresholds(spike, flagged):
    """One spike among 20 sampled steps: every mean stays below its threshold (e.g. overflow 1.01% / 20 = 0.05%),
    so only the worst-step rule can flag it, naming the step."""
    records = [_record(10 * i, {"l": {"grad_output": spike if i == 7 else _stats(stale=1.0)}}) for i in range(1, 21)]
    table = advisor.layer_table(records)
    assert advisor.advise(table, worst_thresholds={k: math.inf if k != "sqnr_db_min" else -math.inf
                                                   for k in advisor.WORST_STEP_THRESHOLDS}) == {}
    reasons = advisor.advise(table).get("l", [])
    assert bool(reasons) == flagged
    if flagged:
        assert len(reasons) == 1 and reasons[0].endswith("at step 70")


def test_advisor_catches_the_spike_that_the_mean_hid():
    """Issue 17: a grad_output at 2.2 dB SQNR with 11.6x staleness on one sampled step of three."""
    healthy = {"grad_output": _stats(sqnr=29.0, stale=1.0)}
    spike = {"grad_output": _stats(sqnr=2.2, stale=11.6)}
    records = [_record(50, {"layers.1.mlp.down_proj": healthy}, seed=7),
               _record(100, {"layers.1.mlp.down_proj": spike}, seed=7),
               _record(150, {"layers.1.mlp.down_proj": healthy}, seed=7)]
    table = advisor.layer_table(records)
    assert table["layers.1.mlp.down_proj"]["grad_output"]["sqnr_db"] > advisor.MEAN_THRESHOLDS["sqnr_db_min"]
    reasons = advisor.advise(table)["layers.1.mlp.down_proj"]
    assert reasons == ["grad_output SQNR 2.2 dB < 10 at step 100 (seed 7)",
                       "grad_output staleness 11.6x > 4x at step 100 (seed 7)"]


def test_exclude_regex_matches_only_that_layer():
    import re

    pattern = advisor.exclude_regex("layers.1.mlp.up_proj")
    assert re.search(pattern, "layers.1.mlp.up_proj")
    assert not re.search(pattern, "layers.11.mlp.up_proj") and not re.search(pattern, "layers.1xmlp.up_proj")


# ------------------------------------------------------------------------------------------------------------
# A hand-written validation directory: 2 seeds, a good candidate and a broken one
# ------------------------------------------------------------------------------------------------------------
STEPS = (0, 10, 20, 30, 40)
SEEDS = (1, 2)
BASE_VAL = {1: (5.5, 4.0, 3.5, 3.2, 3.0), 2: (5.6, 4.1, 3.6, 3.3, 3.1)}
# good: final window (30, 40) means 3.10 x 1.005 (seed 1) and 3.20 x 1.007 (seed 2): gaps +0.5% and +0.7%
GOOD_VAL = {1: (5.5, 4.0, 3.5, 3.2 * 1.005, 3.0 * 1.005), 2: (5.6, 4.1, 3.6, 3.3 * 1.007, 3.1 * 1.007)}


FINGERPRINT = {"train_tokens": 1000, "train_sha256": "a" * 64, "val_tokens": 100, "val_sha256": "b" * 64}


def _write_run(vdir, label, seed, val, status="completed", extra=None, health=None, reason=None):
    run = vdir / "runs" / label / f"seed{seed}"
    run.mkdir(parents=True)
    lines = []
    for step, v in zip(STEPS, val):
        rec = {"step": step, "val_loss": v, "lr": 1e-3}
        if step:
            rec.update(loss=v + 0.1, tokens_per_s=1000.0 if label == "bf16" else 500.0)
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    # What train() writes: the resolved config, and a summary naming the data it trained on and the hash of both.
    cfg = load_config(None, ["policy.exclude=[^(.*\\.)?(lm_head)$]", f"train.seed={seed}", "validate.final_window=2"])
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    summary = {"status": status, "reason": reason, "steps": 40, "loss": val[-1] + 0.1, "val_loss": val[-1],
               "wall_time_s": 10.0, "seed": seed, "recipe": "none", "data_fingerprint": FINGERPRINT,
               "config_hash": config_hash(cfg, data_fingerprint=FINGERPRINT), **(extra or {})}
    (run / "summary.json").write_text(json.dumps(summary))
    if health:
        (run / "telemetry.jsonl").write_text("".join(json.dumps(_record(s, h)) + "\n" for s, h in health))
    return run


@pytest.fixture
def validation_dir(tmp_path):
    vdir = tmp_path / "val"
    vdir.mkdir()
    plan = {"margin": 0.02, "final_window": 2, "seeds": list(SEEDS), "baseline": "bf16", "config_hash": "ab" * 32,
            "candidates": [{"label": "good", "recipe": "delayed", "overrides": [], "recipe_code": "delayed:x"},
                           {"label": "broken", "recipe": "current", "overrides": [], "recipe_code": "current:y"}],
            "max_steps": 40, "eval_every": 10, "created": "2025-01-01T00:00:00", "data_fingerprint": FINGERPRINT}
    (vdir / "plan.json").write_text(json.dumps(plan))
    healthy = {"layers.0.attn.q_proj": {"input": _stats(), "weight": _stats(), "grad_output": _stats(under=0.01)},
               "layers.0.mlp.down_proj": {"input": _stats(), "weight": _stats(), "grad_output": _stats(under=0.4)}}
    spiky = {"layers.0.attn.q_proj": {"input": _stats(), "weight": _stats(), "grad_output": _stats(sqnr=3.0)},
             "layers.0.mlp.down_proj": {"input": _stats(), "weight": _stats(), "grad_output": _stats(under=0.4)}}
    for seed in SEEDS:
        _write_run(vdir, "bf16", seed, BASE_VAL[seed])
        _write_run(vdir, "good", seed, GOOD_VAL[seed],
                   health=[(20, healthy), (40, spiky if seed == 2 else healthy)])
    crash = {"layers.1.mlp.up_proj": {"input": dict(_stats(), amax="nan", nonfinite=True, sqnr_db="nan")},
             "layers.0.attn.q_proj": {"input": _stats(sqnr=29.0)}}
    _write_run(vdir, "broken", 1, (5.5, 4.0, 3.6), status="diverged", reason="loss became nan at step 23",
               extra={"divergence_telemetry": crash})
    _write_run(vdir, "broken", 2, BASE_VAL[2])
    return vdir


def _sequential_vdir(tmp_path, missing):
    """validate.seeds=auto with 4 seeds at most: seed 1 ran both, seed 2 lacks the `missing` run."""
    from fp8train.evidence import sequential

    vdir = tmp_path / "val"
    vdir.mkdir()
    plan = {"margin": 0.02, "final_window": 2, "seeds": [1, 2, 3, 4], "baseline": "bf16", "config_hash": "ab" * 32,
            "candidates": [{"label": "good", "recipe": "delayed", "overrides": [], "recipe_code": "delayed:x"}],
            "max_steps": 40, "eval_every": 10, "created": "2025-01-01T00:00:00", "data_fingerprint": FINGERPRINT,
            "sequential": {"max_seeds": 4, **sequential.make_design(4).as_dict()}}
    (vdir / "plan.json").write_text(json.dumps(plan))
    _write_run(vdir, "bf16", 1, BASE_VAL[1])
    _write_run(vdir, "good", 1, GOOD_VAL[1])
    _write_run(vdir, "good" if missing == "bf16" else "bf16", 2, (GOOD_VAL if missing == "bf16" else BASE_VAL)[2])
    return vdir


@pytest.mark.parametrize("missing, waiting", [("good", "seed 2: candidate missing"),
                                             ("bf16", "seed 2: bf16 baseline missing")])
def test_a_sequential_validation_waits_for_the_seed_its_first_look_needs(tmp_path, missing, waiting):
    """The looks stop at seed 2, so the first look (2 seeds) cannot be made yet: INCONCLUSIVE for now, the reason
    naming the seed it waits for."""
    from fp8train.evidence.verdict import load_validation, summarize_validation

    good = summarize_validation(*load_validation(_sequential_vdir(tmp_path, missing)))["candidates"]["good"]
    assert good["verdict"] == "inconclusive"
    assert good["reason"] == f"needs 2 seeds for its first look; the next look needs 2 seeds ({waiting})"
    assert good["sequential"]["next_seeds"] == 2 and good["sequential"]["decided"] is False
    assert good["gaps"] == {"1": pytest.approx(0.005)}  # seed 1's paired gap, the only one usable


def test_the_next_round_is_the_first_looks_seeds_of_the_baseline_and_the_undecided_candidate(tmp_path):
    from fp8train.evidence.run_plan import PlannedRun
    from fp8train.evidence.rounds import next_round
    from fp8train.training.config.validation import parse_candidate

    vdir = _sequential_vdir(tmp_path, "good")
    runs = []
    for seed in (1, 2, 3, 4):
        for label in ("bf16", "good"):
            cfg = load_config(None, [f"run.dir={vdir / 'runs' / label}", f"run.name=seed{seed}", f"train.seed={seed}"])
            runs.append(PlannedRun(label, seed, cfg, None if label == "bf16" else parse_candidate("good=delayed")))
    assert [r.key for r in next_round(vdir, runs)] == ["bf16/seed1", "good/seed1", "bf16/seed2", "good/seed2"]


def test_validation_report_from_fixture(validation_dir):
    summary = write_report(validation_dir)
    good, broken = summary["candidates"]["good"], summary["candidates"]["broken"]
    # gaps +0.5%, +0.7%: mean 0.6%, sd 0.1414%, se 0.1%; t(0.95, 1) = 6.314, t(0.80, 1) = 1.376
    assert good["gaps"] == {"1": pytest.approx(0.005), "2": pytest.approx(0.007)}
    assert good["gap_mean"] == pytest.approx(0.006) and good["seeds"] == 2
    assert good["gap_upper"] == pytest.approx(0.006 + 6.314 * 0.001, abs=2e-6)
    assert good["gap_lower"] == pytest.approx(0.006 - 6.314 * 0.001, abs=2e-6)
    assert good["mdg"] == pytest.approx((6.314 + 1.376) * 0.001, abs=2e-6)
    assert good["verdict"] == "pass" and good["speed_vs_bf16"] == pytest.approx(0.5)
    assert good["gap_sd"] == pytest.approx(math.sqrt(2) * 0.001) and good["seeds_needed"] is None  # decided
    assert (good["recipe"], good["overrides"], good["recipe_code"]) == ("delayed", [], "delayed:x")
    assert good["status"] == {"1": "completed", "2": "completed"}
    assert broken["status"] == {"1": "diverged", "2": "completed"} and broken["divergence"][0]["seed"] == 1
    assert broken["divergence"][0]["reason"] == "loss became nan at step 23" and len(broken["divergence"]) == 1
    # the advisor over both seeds' telemetry: down_proj's mean underflow, q_proj's 3 dB step (seed 2)
    assert sorted(good["advisor"]) == ["layers.0.attn.q_proj", "layers.0.mlp.down_proj"]
    # the top level: what the verdict was computed with, and every run
    assert (summary["margin"], summary["final_window"], summary["seeds"], summary["baseline"]) == (0.02, 2, [1, 2],
                                                                                                   "bf16")
    assert (summary["confidence"], summary["power"]) == (0.95, 0.80) and summary["method"].startswith("Per seed s")
    assert set(summary["advisor_thresholds"]) == {"mean", "worst_step"}
    assert summary["runs"]["good/seed1"] == {"status": "completed", "wall_time_s": 10.0, "tokens_per_s": 500.0,
                                             "final_val_loss": pytest.approx(3.1 * 1.005, rel=1e-12),
                                             "damaged_lines": []}
    assert summary["runs"]["broken/seed1"]["status"] == "diverged" and len(summary["runs"]) == 6
    assert broken["verdict"] == "fail" and "seed 1 diverged" in broken["reason"] and "step 23" in broken["reason"]
    assert broken["divergence"][0]["layers"][0].startswith("layers.1.mlp.up_proj input")
    assert summary["verdict"] == "fail"
    assert summary["baseline_seed_spread_rel"] == pytest.approx(math.sqrt(0.005) / 3.15)  # sd(3.10, 3.20) / mean

    on_disk = json.loads((validation_dir / "summary.json").read_text())
    assert on_disk["verdict"] == "fail" and on_disk["candidates"]["good"]["verdict"] == "pass"
    assert on_disk["candidates"]["broken"]["gap_upper"] is None  # strict JSON: one usable seed, no bound (inf)
    for name in ("forest.png", "gap.png", "loss_curves.png", "health.png"):
        assert (validation_dir / name).read_bytes()[:8] == PNG_MAGIC, name

    report = (validation_dir / "report.md").read_text()
    assert "**Verdict: FAIL**" in report and "2.00%" in report  # the declared margin
    assert "| good | `delayed:x` | 2 | +0.60% | [-0.03%, +1.23%] | 0.77% | **PASS** |" in report
    assert "layers.1.mlp.up_proj" in report and "forest.png" in report
    # Advisor: down_proj's gradients underflow 40% > 10% on average; q_proj's gradient SQNR fell to 3 dB on one
    # step of seed 2 (its mean over the 4 samples, 23 dB, looks healthy). The snippet keeps existing excludes.
    assert "    - '^(.*\\.)?(lm_head)$'" in report
    assert "    - '^layers\\.0\\.mlp\\.down_proj$'  # grad_output mean underflow 40.0% > 10.0%" in report
    assert "    - '^layers\\.0\\.attn\\.q_proj$'  # grad_output SQNR 3.0 dB < 10 at step 40 (seed 2)" in report


def test_all_pass_and_rewrite_is_stable(validation_dir):
    import shutil

    shutil.rmtree(validation_dir / "runs" / "broken")
    plan = json.loads((validation_dir / "plan.json").read_text())
    plan["candidates"] = plan["candidates"][:1]
    (validation_dir / "plan.json").write_text(json.dumps(plan))
    first = write_report(validation_dir)
    assert first["verdict"] == "pass"
    text = (validation_dir / "summary.json").read_text()
    write_report(validation_dir)
    assert (validation_dir / "summary.json").read_text() == text


def test_missing_runs_make_it_inconclusive_not_a_crash(validation_dir):
    import shutil

    shutil.rmtree(validation_dir / "runs" / "broken")
    shutil.rmtree(validation_dir / "runs" / "good" / "seed2")
    summary = write_report(validation_dir)
    good = summary["candidates"]["good"]
    assert good["status"]["2"] == "missing" and good["verdict"] == "inconclusive" and "1 of 2" in good["reason"]
    assert summary["candidates"]["broken"]["verdict"] == "inconclusive"  # no run at all: nothing to judge
    # runs the plan needs are missing: no verdict yet (issue 44, N5), the seeds that ended give inconclusive
    assert summary["verdict"] == "incomplete" and summary["verdict_so_far"] == "inconclusive"
    assert summary["incomplete"]["missing"] == 3  # broken/seed1, broken/seed2, good/seed2


@pytest.mark.parametrize("unusable, why", [("candidate", "seed 3: candidate missing"),
                                            ("baseline", "seed 3: bf16 baseline unfinished"),
                                            ("baseline held", "seed 3: bf16 baseline running")])
def test_passing_usable_seeds_with_an_unusable_one_are_inconclusive(tmp_path, unusable, why):
    """Three seeds; seeds 1 and 2 are the fixture's good pair (gaps +0.5%, +0.7%: upper bound 0.6% + 6.314 x
    0.1% = 1.23% <= 2%, a PASS on their own), seed 3 has no candidate run, or a baseline with metrics and no
    summary: unfinished (killed: no process holds its directory), or running (this process holds its lock). The
    estimate is the two usable seeds'; the verdict is INCONCLUSIVE, not PASS, and says why."""
    from fp8train.evidence.verdict import load_validation, summarize_validation
    from fp8train.training.storage.rundir import DirLock

    vdir = tmp_path / "val"
    vdir.mkdir()
    plan = {"margin": 0.02, "final_window": 2, "seeds": [1, 2, 3], "baseline": "bf16", "config_hash": "ab" * 32,
            "candidates": [{"label": "good", "recipe": "delayed", "overrides": [], "recipe_code": "delayed:x"}],
            "max_steps": 40, "created": "2025-01-01T00:00:00"}
    (vdir / "plan.json").write_text(json.dumps(plan))
    for seed in SEEDS:
        _write_run(vdir, "bf16", seed, BASE_VAL[seed])
        _write_run(vdir, "good", seed, GOOD_VAL[seed])
    base3 = _write_run(vdir, "bf16", 3, BASE_VAL[1])
    if unusable.startswith("baseline"):
        _write_run(vdir, "good", 3, GOOD_VAL[1])
        (base3 / "summary.json").unlink()
    lock = DirLock(base3).acquire() if unusable == "baseline held" else None
    try:
        summary = summarize_validation(*load_validation(vdir))
    finally:
        if lock is not None:
            lock.release()
    good = summary["candidates"]["good"]
    assert good["verdict"] == "inconclusive" and summary["verdict"] == "inconclusive"
    assert good["reason"] == f"2 of 3 seeds usable: {why}"
    assert good["gaps"] == {"1": pytest.approx(0.005), "2": pytest.approx(0.007)} and good["seeds"] == 2
    assert good["gap_mean"] == pytest.approx(0.006)
    assert good["gap_upper"] == pytest.approx(0.006 + 6.314 * 0.001, abs=2e-6)
    assert good["gap_lower"] == pytest.approx(0.006 - 6.314 * 0.001, abs=2e-6)
    assert good["status"]["3"] == ("missing" if unusable == "candidate" else "completed")
    # at this mean and spread 2 seeds already decide: t(0.95, 1) x 0.1% = 0.63% < 2% - 0.6%
    assert good["seeds_needed"] == 2
    # per evaluation step: the seeds whose runs both have a curve (a missing candidate run has none)
    per_step = good["per_step"]
    assert [(r["step"], r["n"]) for r in per_step] == [(s, 2 if unusable == "candidate" else 3) for s in STEPS]
    assert per_step[-1]["gap_mean"] == pytest.approx(0.006 if unusable == "candidate" else (0.005 * 2 + 0.007) / 3)


@pytest.mark.parametrize("status, reason, said", [
    ("stopped", "val_loss above 10 at step 30", "seed 2 stopped: val_loss above 10 at step 30"),
    ("diverged", None, "seed 2 diverged"),  # no reason recorded: none invented
    ("completed", None, "seed 2: non-finite or missing validation loss in the final window"),  # no step 40
])
def test_a_stopped_or_diverged_seed_fails_the_candidate(tmp_path, status, reason, said):
    """Seed 1 passes on its own; seed 2's candidate run ended `status`: FAIL, whatever the other seeds say."""
    from fp8train.evidence.verdict import load_validation, summarize_validation

    vdir = tmp_path / "val"
    vdir.mkdir()
    plan = {"margin": 0.02, "final_window": 2, "seeds": list(SEEDS), "baseline": "bf16", "config_hash": "ab" * 32,
            "candidates": [{"label": "good", "recipe": "delayed", "overrides": [], "recipe_code": "delayed:x"}],
            "max_steps": 40, "created": "2025-01-01T00:00:00"}
    (vdir / "plan.json").write_text(json.dumps(plan))
    for seed in SEEDS:
        _write_run(vdir, "bf16", seed, BASE_VAL[seed])
    _write_run(vdir, "good", 1, GOOD_VAL[1])
    _write_run(vdir, "good", 2, GOOD_VAL[2][:3], status=status, reason=reason)
    summary = summarize_validation(*load_validation(vdir))
    good = summary["candidates"]["good"]
    assert (good["verdict"], good["reason"], summary["verdict"]) == ("fail", said, "fail")
    assert good["gaps"] == {"1": pytest.approx(0.005)} and good["status"] == {"1": "completed", "2": status}


@pytest.mark.parametrize("seed2, verdict, reason", [
    ("missing", "inconclusive", "1 of 3 seeds usable: seed 2: candidate missing; seed 3: candidate missing"),
    ("diverged", "fail", "seed 2 diverged: loss became nan at step 23"),  # a failure stays one, seed 3 aside
])
def test_every_unusable_seed_is_named_and_a_failure_is_not_hidden(tmp_path, seed2, verdict, reason):
    from fp8train.evidence.verdict import load_validation, summarize_validation

    vdir = tmp_path / "val"
    vdir.mkdir()
    plan = {"margin": 0.02, "final_window": 2, "seeds": [1, 2, 3], "baseline": "bf16", "config_hash": "ab" * 32,
            "candidates": [{"label": "good", "recipe": "delayed", "overrides": [], "recipe_code": "delayed:x"}],
            "max_steps": 40, "created": "2025-01-01T00:00:00"}
    (vdir / "plan.json").write_text(json.dumps(plan))
    for seed in (1, 2, 3):
        _write_run(vdir, "bf16", seed, BASE_VAL[1])
    _write_run(vdir, "good", 1, GOOD_VAL[1])
    if seed2 == "diverged":
        _write_run(vdir, "good", 2, GOOD_VAL[1][:3], status="diverged", reason="loss became nan at step 23")
    good = summarize_validation(*load_validation(vdir))["candidates"]["good"]
    assert (good["verdict"], good["reason"]) == (verdict, reason)
    del plan["candidates"][0]["recipe_code"]  # a plan written before recipe codes: the recipe name stands in
    (vdir / "plan.json").write_text(json.dumps(plan))
    assert summarize_validation(*load_validation(vdir))["candidates"]["good"]["recipe_code"] == "delayed"


def test_per_step_gaps_by_hand():
    """Per step held by every seed of both: (candidate - bf16) / |bf16|, NaN where the baseline loss is 0."""
    from types import SimpleNamespace

    from fp8train.evidence.verdict import per_step_gaps

    run = lambda val: SimpleNamespace(curve=SimpleNamespace(val=val))  # noqa: E731
    base = {1: run({0: 0.0, 10: 2.0, 20: 1.0}), 2: run({0: 0.0, 10: 4.0})}
    cand = {1: run({0: 0.0, 10: 2.2, 20: 1.5}), 2: run({0: 0.0, 10: 4.0})}
    rows = per_step_gaps(base, cand)
    assert [(r["step"], r["n"]) for r in rows] == [(0, 2), (10, 2)]  # step 20: seed 2 has none
    assert math.isnan(rows[0]["gap_mean"]) and rows[1]["gap_mean"] == pytest.approx(0.05, rel=1e-12)


def test_final_window_means_of_every_run(validation_dir):
    """Each run's final validation loss is the mean over the last final_window (2) evaluation steps: bf16 seed 1
    (3.2 + 3.0) / 2 = 3.1, seed 2 3.2; good seed 1 3.1 x 1.005. A non-finite value in the window gives None."""
    from fp8train.evidence.verdict import RunData, load_validation, summarize_validation

    summary = summarize_validation(*load_validation(validation_dir))
    finals = summary["baseline_final_val_loss"]
    assert finals == {"1": pytest.approx(3.1, rel=1e-12), "2": pytest.approx(3.2, rel=1e-12)}
    assert summary["runs"]["good/seed1"]["final_val_loss"] == pytest.approx(3.1 * 1.005, rel=1e-12)
    assert summary["runs"]["bf16/seed2"]["status"] == "completed"
    run = _write_run(validation_dir, "nan", 1, (5.5, 4.0, 3.5, math.nan, 3.0))
    assert RunData(run, "nan").final(2) is None and RunData(run, "nan").final(1) == 3.0


def test_a_run_that_ends_while_it_is_read_is_running_not_unfinished(tmp_path):
    """A report reads a run without summary.json (running), and the run writes its summary before the report asks
    whether a process holds it: it was running when read, not "unfinished: killed?"."""
    from fp8train.evidence.verdict import RunData

    run = _write_run(tmp_path, "bf16", 1, (5.5, 4.0, 3.5))
    summary = (run / "summary.json").read_text()
    (run / "summary.json").unlink()
    read = RunData(run, "bf16")  # no lock file, no summary: as after a kill
    assert read.status == "unfinished"
    read = RunData(run, "bf16")
    (run / "summary.json").write_text(summary)  # the run ended after the read
    assert read.status == "running"


def test_plain_run_report_and_cli(validation_dir, capsys):
    from fp8train.cli import main

    run = validation_dir / "runs" / "good" / "seed2"
    own_summary = (run / "summary.json").read_text()
    assert main(["report", str(run)]) == 0
    assert (run / "summary.json").read_text() == own_summary  # a run's summary is train()'s, never rewritten
    assert (run / "loss_curves.png").read_bytes()[:8] == PNG_MAGIC
    assert (run / "health.png").read_bytes()[:8] == PNG_MAGIC
    text = (run / "report.md").read_text()
    assert "down_proj" in text and "at step 40" in text
    assert main(["report", str(validation_dir.parent)]) == 2  # neither kind of directory: clear error
    assert "neither a validation directory" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------------
# Pairing checked before any verdict: `report` refuses what `validate` would refuse, and rewrites nothing
# ------------------------------------------------------------------------------------------------------------
def test_a_run_made_from_another_config_than_planned_is_refused_by_its_plan_entry(validation_dir):
    """plan.json's per-run config hash is checked against the run's config.yaml: the fixture's runs match their
    own summaries, so only the plan entry can tell this one apart."""
    from fp8train.evidence.pairing import check_pairing
    from fp8train.evidence.verdict import load_validation

    run = validation_dir / "runs" / "good" / "seed1"
    own = config_hash(load_config(str(run / "config.yaml")))
    plan, runs = load_validation(validation_dir)
    check_pairing(validation_dir, {**plan, "runs": {"good/seed1": {"config_hash": own}}}, runs)  # as planned
    with pytest.raises(ValueError) as caught:
        check_pairing(validation_dir, {**plan, "runs": {"good/seed1": {"config_hash": "0" * 64}}}, runs)
    assert str(caught.value).startswith(
        f"{validation_dir}: its runs are not paired as plan.json declares, so no verdict is computed (nothing was "
        "written): runs/good/seed1: its config.yaml is not the config plan.json planned for it. Restore")


def test_a_run_of_a_forked_validation_must_record_its_fork(validation_dir):
    """A forked validation's finished run records the sha256 of the checkpoint it loaded; one recording none (no
    run of this tree writes such a summary) is refused, whatever the pinned checkpoint is now."""
    from fp8train.evidence.pairing import check_pairing
    from fp8train.evidence.verdict import load_validation

    plan, runs = load_validation(validation_dir)
    pinned = {"checkpoint": str(validation_dir / "no-such-checkpoint"), "step": 4, "sha256": "a" * 64}
    finished = [run for by_seed in runs.values() for run in by_seed.values() if run.summary is not None]
    for run in finished:
        run.summary = {**run.summary, "fork": {"checkpoint": pinned["checkpoint"], "step": 4, "sha256": "a" * 64}}
    check_pairing(validation_dir, {**plan, "fork": pinned}, runs)  # every run records the pinned sha256
    label, seed = finished[0].label, finished[0].seed
    finished[0].summary = {k: v for k, v in finished[0].summary.items() if k != "fork"}
    with pytest.raises(ValueError, match=f"runs/{label}/seed{seed}: its summary.json records no fork checkpoint, so "
                                         "what it started from cannot be checked"):
        check_pairing(validation_dir, {**plan, "fork": pinned}, runs)


def test_shadow_section_of_a_run_report_by_hand(tmp_path):
    """The worst layer per recipe and role: lowest mean SQNR (with its layer), highest overflow and underflow."""
    from fp8train.evidence.report import _shadow_markdown

    def stats(sqnr, overflow, underflow):
        return dict(sqnr_db=sqnr, overflow_frac=overflow, underflow_frac=underflow)

    shadow = {"a": {"current": {"input": stats(30.0, 0.001, 0.02), "weight": stats(40.0, 0.0, 0.0)}},
              "b": {"current": {"input": stats(20.0, 0.0, 0.05)}}}
    assert _shadow_markdown(tmp_path, [{"step": 10, "shadow": shadow}]) == [
        "## Recipe shadowing", "",
        "What each shadowed recipe would have done to this run's real operands (worst layer per role: lowest mean "
        f"SQNR, highest overflow and underflow). `fp8train layer-recipes {tmp_path} --out layers.yaml` turns it into a "
        "recipe per layer.", "",
        "| recipe | role | min SQNR dB (layer) | max overflow | max underflow |", "|---|---|---|---|---|",
        "| current | input | 20.0 (b) | 0.10% | 5.00% |",
        "| current | weight | 40.0 (a) | 0.00% | 0.00% |",
        ""]
    assert _shadow_markdown(tmp_path, [{"step": 10}]) == []  # no shadow recipes: no section


@pytest.fixture
def drawn(monkeypatch):
    """The figures a plot function makes, kept for inspection instead of written."""
    from fp8train.evidence import plots

    figures = []
    monkeypatch.setattr(plots, "_write_png", lambda fig, plt, path: figures.append(fig))
    yield figures
    import matplotlib.pyplot as plt

    for fig in figures:
        plt.close(fig)


def test_forest_plot_puts_each_number_where_it_says(drawn, tmp_path):
    """Row y of a candidate (the first on top): its seeds' gaps as 5 pt grey dots at y + 0.18, its bounds as a
    bar at y, its mean as a 9 pt square at y; values in percent; the title says how to read it."""
    from fp8train.evidence.plots import plot_forest

    candidates = {"good": {"verdict": "pass", "gaps": {"1": 0.005, "2": 0.007}, "gap_lower": -0.0003,
                           "gap_upper": 0.0123, "gap_mean": 0.006},
                  "bad": {"verdict": "fail", "gaps": {"1": 0.04}, "gap_lower": 0.03, "gap_upper": 0.05,
                          "gap_mean": 0.04}}
    plot_forest(tmp_path / "forest.png", candidates, 0.02, "val")
    (ax,) = drawn[0].axes
    points = [(list(line.get_xdata()), list(line.get_ydata()), line.get_marker(), line.get_markersize())
              for line in ax.get_lines()]
    assert points[:3] == [([pytest.approx(0.5), pytest.approx(0.7)], [1.18, 1.18], "o", 5.0),
                          ([pytest.approx(-0.03), pytest.approx(1.23)], [1, 1], "None", pytest.approx(6.0)),
                          ([pytest.approx(0.6)], [1], "s", 9.0)]
    assert points[3:6] == [([pytest.approx(4.0)], [0.18], "o", 5.0),
                           ([pytest.approx(3.0), pytest.approx(5.0)], [0, 0], "None", pytest.approx(6.0)),
                           ([pytest.approx(4.0)], [0], "s", 9.0)]
    assert ax.get_title() == "val: paired gaps over seeds (PASS when the upper bound is left of the margin)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["bad (FAIL)", "good (PASS)"]
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["one seed's paired gap", "one-sided 95% bounds",
                                                          "mean gap", "margin 2.0%"]
    assert legend.get_texts()[0].get_fontsize() == 8.0


def test_loss_curves_draw_every_seed_and_label_each_run_once(drawn, tmp_path):
    import types

    from fp8train.evidence.plots import plot_loss_curves

    def run(scale):
        return types.SimpleNamespace(curve=Curve(val={10: 4.0 * scale, 20: 3.0 * scale},
                                                 train={5: 5.0 * scale, 10: 4.5 * scale}))

    plot_loss_curves(tmp_path / "loss.png", {"bf16": [run(1.0), run(1.01)], "current": [run(1.02)]}, "val")
    train_ax, val_ax, zoom_ax = drawn[0].axes
    assert [list(line.get_ydata()) for line in train_ax.get_lines()] == [[5.0, 4.5], [5.05, 4.545], [5.1, 4.59]]
    for ax in (val_ax, zoom_ax):
        lines = ax.get_lines()
        assert [list(line.get_xdata()) for line in lines] == [[10, 20]] * 3
        assert [(line.get_marker(), line.get_markersize()) for line in lines] == [("o", 2.0)] * 3
        assert [line.get_label() for line in lines][::2] == ["bf16", "current"]  # one legend entry per run label
    legend = zoom_ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["bf16", "current"]
    assert legend.get_texts()[0].get_fontsize() == 8.0
    assert drawn[0]._suptitle.get_text() == "val: loss curves (one line per seed)"
    # the zoom, by hand: from step 10 (half of 20) on the values are 3.0 ... 4.08, the middle one 4.0; high =
    # min(4.08, 4.0 + 3 x 1.0) = 4.08, padded by 5% of 1.08 either side; x from 10 - 5% of 10 to 20 x 1.02
    assert zoom_ax.get_ylim() == (pytest.approx(3.0 - 0.054), pytest.approx(4.08 + 0.054))
    assert zoom_ax.get_xlim() == (pytest.approx(9.5), pytest.approx(20.4))


def test_health_figure_size_grows_with_its_columns_and_layers(drawn, tmp_path):
    """One stacked heatmap per statistic: width max(8, 0.75 x columns + 4) inches, height 3 x (1.6 + 0.28 x
    layers); here 1 run x 3 roles = 3 columns (6.25 -> 8 wide) and 3 layers (7.32 high), then 4 runs: 12
    columns, 13 wide."""
    from fp8train.evidence.plots import plot_health

    cell = {"overflow_frac": 0.001, "underflow_frac": 0.2, "sqnr_db": 25.0}
    table = {layer: {role: dict(cell) for role in ("input", "weight", "grad_output")} for layer in ("a", "b", "c")}
    assert plot_health(tmp_path / "h.png", {"x": table}, "val")
    assert tuple(drawn[0].get_size_inches()) == (8.0, pytest.approx(7.32))
    assert plot_health(tmp_path / "h.png", {name: table for name in "wxyz"}, "val")
    assert tuple(drawn[1].get_size_inches()) == (13.0, pytest.approx(7.32))
    assert not plot_health(tmp_path / "h.png", {"x": {}}, "val")  # no telemetry: no figure


def test_health_heatmaps_colour_scales_and_cells_without_fp8(drawn, tmp_path):
    """Overflow 0.1% and underflow 20% in every cell, SQNR 25 dB; layer c has FP8 telemetry for its input only.
    Percent panels: log colour from 1e-3 to at least 1 (so 0.1% is not the top colour), else their largest value;
    SQNR: 0 to 40 dB. A cell without FP8 is NaN, shown grey (#dddddd), never a crash."""
    import matplotlib.colors
    import numpy as np

    from fp8train.evidence.plots import plot_health

    cell = {"overflow_frac": 0.001, "underflow_frac": 0.2, "sqnr_db": 25.0}
    table = {layer: {role: dict(cell) for role in ("input", "weight", "grad_output")} for layer in ("a", "b")}
    table["c"] = {"input": dict(cell)}
    assert plot_health(tmp_path / "h.png", {"x": table}, "val")
    overflow, underflow, sqnr = (ax.images[0] for ax in drawn[0].axes if ax.images)  # (colour bars: no image)
    assert (overflow.norm.vmin, overflow.norm.vmax) == (1e-3, 1.0)
    assert (underflow.norm.vmin, underflow.norm.vmax) == (1e-3, pytest.approx(20.0))
    assert (sqnr.norm.vmin, sqnr.norm.vmax) == (0.0, 40.0)
    values = np.ma.getdata(sqnr.get_array())
    assert values[:2].tolist() == [[25.0] * 3] * 2 and values[2, 0] == 25.0 and np.isnan(values[2, 1:]).all()
    for image in (overflow, underflow, sqnr):
        assert image.get_cmap().get_bad() == pytest.approx(matplotlib.colors.to_rgba("#dddddd"))


@pytest.mark.parametrize("value, spec, shown", [(None, "+.2%", "n/a"), (math.nan, ".4f", "n/a"),
                                                 (math.inf, ".2%", "n/a"), (0.0123, "+.2%", "+1.23%"),
                                                 (3.14159, ".4f", "3.1416")])
def test_report_numbers_and_what_a_missing_one_shows(value, spec, shown):
    from fp8train.evidence.report import _fmt

    assert _fmt(value, spec) == shown


def test_evidence_cost_by_hand():
    """Runs made (summaries), their wall seconds, wall x processes, CPU seconds (None when a run lacks them), and
    what fixed designs would have run: every planned seed, and the fewest seeds that decide every candidate."""
    import types

    from fp8train.evidence import stats
    from fp8train.evidence.verdict import evidence_cost

    def run(summary, status=None):
        return types.SimpleNamespace(summary=summary, status=status or ("completed" if summary else "missing"))

    plan = {"margin": 0.02, "seeds": [1, 2, 3], "candidates": [{"label": "good"}]}
    runs = {"bf16": {1: run({"wall_time_s": 10.0, "cpu_time_s": 8.0}),
                     2: run({"wall_time_s": 12.0, "world_size": 2, "cpu_time_s": 9.0}), 3: run(None)},
            "good": {1: run({"wall_time_s": 20.0, "cpu_time_s": 15.0}), 2: run(None, "unfinished"),
                     3: run(None, "running")}}
    candidates = {"good": {"gap_mean": 0.006, "gap_sd": 0.001}}
    fixed = max(stats.seeds_needed(0.006, 0.001, 0.02), 2)
    assert evidence_cost(plan, runs, candidates) == {
        "runs": 3, "running_runs": 1, "unfinished_runs": 1, "run_seconds": 42.0, "device_seconds": 10.0 + 24.0 + 20.0, "cpu_seconds": 32.0,
        "planned_seeds_runs": 6, "fixed_design_seeds": fixed, "fixed_design_runs": 2 * fixed}
    runs["good"][2] = run({"wall_time_s": 5.0})  # no CPU time recorded: the CPU total is unknown
    assert evidence_cost(plan, runs, candidates)["cpu_seconds"] is None
    on_margin = {"good": {"gap_mean": 0.02, "gap_sd": 0.001}}  # no fixed design decides it
    assert stats.seeds_needed(0.02, 0.001, 0.02) is None
    cost = evidence_cost(plan, runs, on_margin)
    assert (cost["fixed_design_seeds"], cost["fixed_design_runs"]) == (None, None)


def test_report_help_says_what_directory_it_takes(capsys):
    from fp8train.cli import main

    with pytest.raises(SystemExit):
        main(["report", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())  # the whole entry, from its name to the next section
    assert "positional arguments: run_dir a validation directory (with plan.json) or a run directory options:" \
        in help_text


def _edit_json(path, **changes):
    record = json.loads(path.read_text())
    record.update(changes)
    path.write_text(json.dumps(record))


def _unpaired_by_data(vdir):
    _edit_json(vdir / "runs" / "good" / "seed2" / "summary.json",
               data_fingerprint={**FINGERPRINT, "train_sha256": "c" * 64})


def _unpaired_by_override(vdir):
    plan = json.loads((vdir / "plan.json").read_text())
    plan["candidates"][0]["overrides"] = ["model.d_model=128"]  # a plan.json from before the rule, or edited
    (vdir / "plan.json").write_text(json.dumps(plan))


def _unpaired_by_config(vdir):
    run = vdir / "runs" / "good" / "seed1"
    (run / "config.yaml").write_text(config_to_yaml(load_config(None, ["model.d_model=128", "train.seed=1"])))


@pytest.mark.parametrize("unpair, named", [
    (_unpaired_by_data, "runs/good/seed2: it trained on other data than plan.json declares (the data changed: "
                        "training tokens aaaaaaaaaaaa -> cccccccccccc)"),
    (_unpaired_by_override, "'model.d_model' in 'good' cannot be set per candidate: a candidate may change only "
                            "fp8.* and policy.* keys"),
    (_unpaired_by_config, "runs/good/seed1: its summary.json does not belong to its config.yaml and the planned "
                          "data"),
])
def test_report_refuses_unpaired_runs_and_writes_nothing(validation_dir, capsys, unpair, named):
    from fp8train.cli import main

    assert main(["report", str(validation_dir)]) == 0
    before = {p: p.read_bytes() for p in validation_dir.iterdir() if p.is_file()}
    capsys.readouterr()
    unpair(validation_dir)
    code = main(["report", str(validation_dir)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and named in err, err
    assert {p: p.read_bytes() for p in validation_dir.iterdir() if p.is_file() and p.name != "plan.json"} == {
        p: b for p, b in before.items() if p.name != "plan.json"}  # summary.json's verdict not rewritten


@pytest.mark.parametrize("who, run", [("candidate", "good"), ("bf16 baseline", "bf16")])
def test_a_completed_run_that_lost_its_last_metrics_line_is_damaged_not_a_failure(validation_dir, who, run):
    """good/seed2 (or its baseline) says completed at step 40, but metrics.jsonl ends at step 30 (its last line
    lost: a file system that kept the rename but not the append): the seed is unusable, so the verdict is
    INCONCLUSIVE with the reason, never a FAIL blamed on FP8 (nor a gap over an earlier, shifted window)."""
    import shutil

    shutil.rmtree(validation_dir / "runs" / "broken")
    plan = json.loads((validation_dir / "plan.json").read_text())
    plan["candidates"] = plan["candidates"][:1]
    (validation_dir / "plan.json").write_text(json.dumps(plan))
    metrics = validation_dir / "runs" / run / "seed2" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()[:-1]))
    good = write_report(validation_dir)["candidates"]["good"]
    assert good["verdict"] == "inconclusive" and good["seeds"] == 1, good
    assert (f"seed 2: {who} damaged: metrics.jsonl has no val_loss for step(s) [40] that it logged"
            in good["reason"]), good["reason"]


@pytest.mark.parametrize("state", ["killed", "running"])
def test_a_plain_report_of_a_run_without_summary_names_its_config_recipe_and_logged_steps(tiny_fp8_run, tmp_path,
                                                                                          state):
    import json
    import shutil

    import fcntl
    import os

    from fp8train.cli import main
    from fp8train.training.storage.rundir import LOCK_FILE

    run = tmp_path / "tiny"
    shutil.copytree(tiny_fp8_run, run)
    recorded = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()  # killed (or still running) before it wrote one
    last = max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
               if "loss" in json.loads(line))
    fd = os.open(run / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    try:
        if state == "running":  # what a training process holds on its run directory
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["report", str(run)]) == 0
    finally:
        os.close(fd)
    head = (run / "report.md").read_text().splitlines()[2]
    assert head.startswith(f"Status {'unfinished' if state == 'killed' else 'running'}; recipe "
                           f"`{recorded['recipe']}`; {last} logged steps;"), head
    assert recorded["recipe"] not in ("?", "none")
