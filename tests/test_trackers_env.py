"""What wandb users expect of the trackers, checked on real wandb offline runs (their .wandb files read back by
tests/wandb_records.py):

- WANDB_MODE, WANDB_PROJECT and WANDB_DIR are honoured unless the config sets the value (log.wandb and
  log.wandb_project default to "", so any value written in the config wins, and an unset one falls to the
  environment, then to offline / fp8train);
- a validation's runs are named <validation>/<label>/seed<N>, grouped by the validation, job type baseline or
  candidate, tagged recipe:<name> and seed:<N>;
- a baseline trained with train.autocast=none is called fp32 (not bf16) in the summary, the verdict and the report;
- an HF run's tracker config has no Decoder defaults it did not use (model.vocab_size 256 for a 320-token model).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fp8train.evidence.run_plan import plan_runs
from fp8train.evidence.validate import run_validation
from fp8train.training.config import load_config
from fp8train.training.loop import train
from hf_helpers import VOCAB, make_pretrained, make_tokenizer
from wandb_records import offline_run

pytestmark = pytest.mark.usefixtures("single_thread")

SHORT = dict(train={"max_steps": 2, "eval_every": 2, "eval_batches": 1, "autocast": "none"},
             log={"every": 1, "telemetry_every": 0, "trackers": ["wandb"]}, checkpoint={"every": 0})


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb's own files (settings, cache, artifacts) in the test's folder, and no WANDB_* of the caller's."""
    for var in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_TAGS"):
        monkeypatch.delenv(var, raising=False)
    home = str(tmp_path / "wandb-home")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, home)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return monkeypatch


def _short_config(tiny, root: Path, **log):
    """The tiny config without a log.wandb value (so the environment may decide), plus `log`."""
    sections = tiny.config(root, **SHORT)
    del sections["log"]["wandb"]
    sections["log"].update(log)
    path = root / "short.yaml"
    path.write_text(yaml.safe_dump(sections))
    return load_config(str(path))


@pytest.mark.parametrize("env, log, where, project", [
    ({}, {}, "run", "fp8train"),                                            # nothing set: offline, fp8train
    ({"WANDB_MODE": "disabled"}, {}, None, None),                          # the environment disables wandb
    ({"WANDB_MODE": "disabled"}, {"wandb": "offline"}, "run", "fp8train"),  # the config wins
    ({"WANDB_PROJECT": "from-env", "WANDB_DIR": "{tmp}/wandb-dir"}, {}, "env-dir", "from-env"),
    ({"WANDB_PROJECT": "from-env"}, {"wandb_project": "from-config"}, "run", "from-config"),
])
def test_wandb_environment_is_honoured_unless_the_config_sets_the_value(tiny, tmp_path, wandb_env, env, log,
                                                                        where, project):
    for var, value in env.items():
        wandb_env.setenv(var, value.format(tmp=tmp_path))
    cfg = _short_config(tiny, tmp_path, **log)
    assert train(cfg, show_progress=False)["status"] == "completed"
    run_dir = tmp_path / "runs" / "tiny"
    if where is None:
        assert not (run_dir / "wandb").exists() and not list(tmp_path.glob("**/offline-run-*"))
        return
    folder = run_dir if where == "run" else tmp_path / "wandb-dir"
    recorded = offline_run(folder)
    assert recorded["project"] == project and recorded["name"] == "tiny"
    assert recorded["config"]["log"]["wandb"] == "offline" and recorded["config"]["log"]["wandb_project"] == project
    if where == "env-dir":
        assert not (run_dir / "wandb").exists()


def test_an_unknown_wandb_mode_in_the_environment_is_refused_before_anything_is_written(tiny, tmp_path, wandb_env):
    wandb_env.setenv("WANDB_MODE", "sometimes")
    cfg = _short_config(tiny, tmp_path)
    with pytest.raises(ValueError, match=r"WANDB_MODE='sometimes'.*offline.*log\.wandb"):
        train(cfg, show_progress=False)
    assert not (tmp_path / "runs").exists()


VALIDATION = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.seq_len=16", "train.batch_size=4",
              "train.max_steps=4", "train.eval_every=2", "train.eval_batches=1", "optim.warmup_steps=1",
              "policy.min_features=16", "log.every=2", "log.telemetry_every=0", "data.max_bytes=100000",
              "validate.final_window=2", "validate.seeds=2", "train.seed=5", "validate.workers=1"]


@pytest.mark.slow
def test_validation_runs_are_labelled_in_wandb_and_an_fp32_baseline_is_called_fp32(tmp_path, wandb_env):
    cfg = load_config(None, VALIDATION + [f"run.dir={tmp_path}", "run.name=val", "log.wandb=offline",
                                          "train.autocast=none"])
    summary = run_validation(cfg, candidates=["current"], show_progress=False)
    vdir = tmp_path / "val"
    for folder, name, job_type, recipe_name in (("bf16", "fp32", "baseline", "none"),
                                                ("current", "current", "candidate", "current")):
        for seed in (5, 6):
            recorded = offline_run(vdir / "runs" / folder / f"seed{seed}")
            assert recorded["name"] == f"val/{name}/seed{seed}", recorded
            assert recorded["group"] == "val" and recorded["job_type"] == job_type
            assert recorded["tags"] == [f"recipe:{recipe_name}", f"seed:{seed}"]
    assert summary["baseline_precision"] == "fp32"
    on_disk = json.loads((vdir / "summary.json").read_text())
    assert on_disk["baseline_precision"] == "fp32" and json.loads((vdir / "plan.json").read_text())[
        "baseline_precision"] == "fp32"
    assert "(candidate - baseline) / baseline" in on_disk["method"]
    report = (vdir / "report.md").read_text()
    assert "| fp32 baseline (final-window val loss) |" in report and "speed vs fp32 |" in report
    assert "trains the fp32 baseline" in report and "the fp32 seeds' final losses" in report
    assert "bf16 baseline" not in report and "trains bf16" not in report and "speed vs bf16" not in report


def test_a_bf16_baseline_is_named_bf16_in_wandb(tmp_path):
    runs = plan_runs(load_config(None, VALIDATION + [f"run.dir={tmp_path}", "run.name=v2"]), ["delayed"])
    assert [(r.cfg.log.wandb_name, r.cfg.log.wandb_job_type) for r in runs[:2]] == [
        ("v2/bf16/seed5", "baseline"), ("v2/delayed/seed5", "candidate")]


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tracking")
    return make_pretrained(root / "llama", "llama"), make_tokenizer(root / "tok")


def test_an_hf_runs_tracker_config_has_no_unused_decoder_defaults(hf_folders, tiny, tmp_path, wandb_env):
    model_dir, tokenizer = hf_folders
    sections = tiny.config(tmp_path, **SHORT)
    sections["model"] = {"hf_path": str(model_dir), "seq_len": 16}
    sections["data"]["tokenizer"] = str(tokenizer)
    sections["log"]["wandb"] = "offline"
    path = tmp_path / "hf.yaml"
    path.write_text(yaml.safe_dump(sections))
    assert train(load_config(str(path)), show_progress=False)["status"] == "completed"
    config = offline_run(tmp_path / "runs" / "tiny")["config"]
    assert "vocab_size" not in config["model"] and "d_model" not in config["model"], config["model"]
    assert config["model_config"]["vocab_size"] == VOCAB and config["model"]["seq_len"] == 16
