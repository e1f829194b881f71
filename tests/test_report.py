"""Reports and FP8 health: telemetry of a hand-built tensor with known clipping and underflow, the per-layer
aggregation and the advisor's thresholds, and report generation from a hand-written validation directory
(no training: every number below is chosen so the expected verdict can be computed by hand)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fp8train.training import telemetry
from fp8train.evidence.report import write_report

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


def _record(step, layers):
    return {"step": step, "layers": layers}


def _stats(over=0.0, under=0.0, sqnr=30.0, stale=None):
    return {"amax": 1.0, "scale": 1.0, "overflow_frac": over, "underflow_frac": under, "sqnr_db": sqnr,
            "staleness": stale, "nonfinite": False}


def test_layer_table_aggregates_and_dedupes():
    records = [
        _record(10, {"a": {"input": _stats(over=0.5, under=0.1, sqnr=10.0, stale=2.0)}}),
        _record(20, {"a": {"input": _stats(over=0.0, under=0.3, sqnr="inf")}}),
        _record(20, {"a": {"input": _stats(over=0.1, under=0.3, sqnr=20.0)}}),  # resumed run repeats step 20
    ]
    row = telemetry.layer_table(records)["a"]["input"]
    assert row["samples"] == 2
    assert row["overflow_frac"] == pytest.approx(0.3) and row["overflow_frac_max"] == pytest.approx(0.5)
    assert row["underflow_frac"] == pytest.approx(0.2) and row["underflow_frac_max"] == pytest.approx(0.3)
    assert row["sqnr_db"] == pytest.approx(15.0) and row["sqnr_db_min"] == pytest.approx(10.0)
    assert row["staleness_max"] == pytest.approx(2.0)
    exact = telemetry.layer_table([_record(10, {"b": {"weight": _stats(sqnr="inf")}})])["b"]["weight"]
    assert exact["sqnr_db"] == math.inf  # quantized exactly: never flagged


@pytest.mark.parametrize("stats, flagged", [
    (_stats(), False),
    (_stats(sqnr=14.9), True), (_stats(sqnr=15.1), False),
    (_stats(over=0.0011), True), (_stats(over=0.0009), False),
    (_stats(under=0.11), True), (_stats(under=0.09), False),
])
def test_advisor_thresholds(stats, flagged):
    table = telemetry.layer_table([_record(10, {"layers.0.mlp.down_proj": {"grad_output": stats}})])
    assert bool(telemetry.advise(table)) == flagged


def test_exclude_regex_matches_only_that_layer():
    import re

    pattern = telemetry.exclude_regex("layers.1.mlp.up_proj")
    assert re.search(pattern, "layers.1.mlp.up_proj")
    assert not re.search(pattern, "layers.11.mlp.up_proj") and not re.search(pattern, "layers.1xmlp.up_proj")


# ------------------------------------------------------------------------------------------------------------
# A hand-written validation directory
# ------------------------------------------------------------------------------------------------------------
STEPS = (0, 10, 20, 30, 40)
BASE_VAL = (5.5, 4.0, 3.5, 3.2, 3.0)


def _write_run(root, label, val, status="completed", seed=1337, extra=None, health=None, reason=None):
    run = root / "runs" / label
    run.mkdir(parents=True)
    lines = []
    for step, v in zip(STEPS, val):
        rec = {"step": step, "val_loss": v, "lr": 1e-3}
        if step:
            rec.update(loss=v + 0.1, tokens_per_s=1000.0 if label.startswith("bf16") else 500.0)
        lines.append(json.dumps(rec))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = {"status": status, "reason": reason, "steps": 40, "loss": val[-1] + 0.1, "val_loss": val[-1],
               "wall_time_s": 10.0, "seed": seed, "recipe": "none", "config_hash": "x", **(extra or {})}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "config.yaml").write_text("policy:\n  exclude:\n  - ^(.*\\.)?(lm_head)$\n")
    if health:
        (run / "telemetry.jsonl").write_text("".join(json.dumps(_record(s, health)) + "\n" for s in (20, 40)))
    return run


@pytest.fixture
def validation_dir(tmp_path):
    vdir = tmp_path / "val"
    vdir.mkdir()
    plan = {"margin": 0.02, "final_window": 2, "extra_seeds": 1, "baseline": "bf16", "config_hash": "ab" * 32,
            "candidates": [{"label": "good", "recipe": "delayed", "overrides": [], "recipe_code": "delayed:x"},
                           {"label": "broken", "recipe": "current", "overrides": [], "recipe_code": "current:y"}],
            "seeds": {"bf16": 1337, "bf16-seed1338": 1338}, "max_steps": 40, "created": "2025-01-01T00:00:00"}
    (vdir / "plan.json").write_text(json.dumps(plan))
    _write_run(vdir, "bf16", BASE_VAL)
    _write_run(vdir, "bf16-seed1338", (5.6, 4.1, 3.55, 3.23, 3.03), seed=1338)  # band 0.03 / 3.10 = 0.97%
    healthy = {"layers.0.attn.q_proj": {"input": _stats(), "weight": _stats(), "grad_output": _stats(under=0.01)},
               "layers.0.mlp.down_proj": {"input": _stats(), "weight": _stats(), "grad_output": _stats(under=0.4)}}
    _write_run(vdir, "good", (5.5, 4.02, 3.51, 3.22, 3.02), health=healthy)  # +0.65% <= max(0.97%, 2%)
    crash = {"layers.1.mlp.up_proj": {"input": dict(_stats(), amax="nan", nonfinite=True, sqnr_db="nan")},
             "layers.0.attn.q_proj": {"input": _stats(sqnr=29.0)}}
    _write_run(vdir, "broken", (5.5, 4.0, 3.6), status="diverged", reason="loss became nan at step 23",
                     extra={"divergence_telemetry": crash})
    return vdir


def test_validation_report_from_fixture(validation_dir):
    summary = write_report(validation_dir)
    good, broken = summary["candidates"]["good"], summary["candidates"]["broken"]
    assert good["pass"] and good["gap_rel"] == pytest.approx(0.02 / 3.10)
    assert good["noise_band_rel"] == pytest.approx(0.03 / 3.10) and good["threshold_rel"] == pytest.approx(0.02)
    assert good["speed_vs_bf16"] == pytest.approx(0.5)
    assert not broken["pass"] and "step 23" in broken["reason"]
    assert broken["divergence_layers"][0].startswith("layers.1.mlp.up_proj input")
    assert summary["verdict"] == "fail"

    on_disk = json.loads((validation_dir / "summary.json").read_text())
    assert on_disk["verdict"] == "fail" and on_disk["candidates"]["good"]["pass"] is True
    assert on_disk["candidates"]["good"]["noise_band_rel"] == pytest.approx(0.03 / 3.10)
    for name in ("loss_curves.png", "gap.png", "health.png"):
        assert (validation_dir / name).read_bytes()[:8] == PNG_MAGIC, name

    report = (validation_dir / "report.md").read_text()
    assert "**Verdict: FAIL**" in report and "2.00%" in report  # the declared margin
    assert "| good | `delayed:x` | 3.1200 | +0.0200 | +0.65% | 0.97% | 2.00% | - | **PASS**" in report
    assert "layers.1.mlp.up_proj" in report  # the divergence section names the broken layer
    # Advisor: the down_proj's gradients underflow 40% > 10%; the snippet keeps the run's existing excludes.
    assert "    - '^(.*\\.)?(lm_head)$'" in report
    assert "    - '^layers\\.0\\.mlp\\.down_proj$'  # grad_output underflow 40.0% > 10%" in report
    assert "q_proj$'" not in report


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


def test_missing_runs_are_reported_not_crashed(validation_dir):
    import shutil

    shutil.rmtree(validation_dir / "runs" / "good")
    summary = write_report(validation_dir)
    assert summary["candidates"]["good"]["status"] == "missing" and summary["verdict"] == "fail"


def test_plain_run_report_and_cli(validation_dir, capsys):
    from fp8train.cli import main

    run = validation_dir / "runs" / "good"
    own_summary = (run / "summary.json").read_text()
    assert main(["report", str(run)]) == 0
    assert (run / "summary.json").read_text() == own_summary  # a run's summary is train()'s, never rewritten
    assert (run / "loss_curves.png").read_bytes()[:8] == PNG_MAGIC
    assert (run / "health.png").read_bytes()[:8] == PNG_MAGIC
    assert "down_proj" in (run / "report.md").read_text()
    assert main(["report", str(validation_dir.parent)]) == 2  # neither kind of directory: clear error
    assert "neither a validation directory" in capsys.readouterr().err
