"""find_resume_point decides start / resume / complete before anything is written (fp8train/training/resume.py): each
rule with a real config, a stored config.yaml, real checkpoints and summary.json, and no training (fast; the
training-run tests of the same rules are in test_resume_rules.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from fp8train.training.runs.checkpoint import load_checkpoint, save_checkpoint
from fp8train.training.config import config_to_yaml, load_config
from fp8train.training.runs.resume import ResumePoint, config_differences, find_resume_point

TINY = {
    "model": {"n_layers": 1, "d_model": 64, "n_heads": 2, "seq_len": 16},
    "train": {"max_steps": 4, "batch_size": 4, "eval_every": 2, "lr": 3e-3, "device": "cpu"},
    "log": {"wandb": "disabled"},
}


def cfg_of(tmp_path: Path, *overrides: str):
    config = tmp_path / "tiny.yaml"
    if not config.exists():
        config.write_text(yaml.safe_dump({**TINY, "run": {"dir": str(tmp_path / "runs"), "name": "r"},
                                          "data": {"path": str(tmp_path / "corpus.txt")}}))
    return load_config(str(config), list(overrides))


def stored_run(tmp_path: Path, cfg, steps=(), summary=None) -> Path:
    """A run directory as a run leaves it: config.yaml, checkpoints of `steps`, summary.json."""
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in steps:
        save_checkpoint(run_dir / "checkpoints", step, model, optimizer, keep_last=0)
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_a_new_run_starts(tmp_path):
    for resume in ("false", "auto"):
        cfg = cfg_of(tmp_path, f"train.resume={resume}")
        assert find_resume_point(cfg, tmp_path / "runs" / "r", print) == ResumePoint("start")


def test_resume_false_refuses_a_directory_that_holds_a_run(tmp_path):
    run_dir = stored_run(tmp_path, cfg_of(tmp_path))
    with pytest.raises(FileExistsError) as raised:
        find_resume_point(cfg_of(tmp_path, "train.resume=false"), run_dir, print)
    assert str(raised.value) == (f"run directory {run_dir} already holds a run; pass train.resume=true to continue "
                                 "it (or auto), or choose another run.name / run.dir (nothing was changed)")


def test_resume_continues_from_the_newest_checkpoint_that_verifies(tmp_path):
    run_dir = stored_run(tmp_path, cfg_of(tmp_path), steps=(2, 4, 6))
    (run_dir / "checkpoints" / "step_000006" / "manifest.json").unlink()  # a save killed mid-way
    said = []
    point = find_resume_point(cfg_of(tmp_path, "train.resume=true", "train.max_steps=8"), run_dir, said.append)
    assert point == ResumePoint("resume", run_dir / "checkpoints" / "step_000004")
    assert len(said) == 1 and str(run_dir / "checkpoints" / "step_000006") in said[0]


def test_a_completed_run_is_complete_and_a_failed_one_resumes(tmp_path):
    summary = {"status": "completed", "steps": 4, "val_loss": 5.0}
    run_dir = stored_run(tmp_path, cfg_of(tmp_path), steps=(2, 4), summary=summary)
    cfg = cfg_of(tmp_path, "train.resume=true")
    assert find_resume_point(cfg, run_dir, print) == ResumePoint("complete", run_dir / "checkpoints" / "step_000004",
                                                          summary)
    (run_dir / "summary.json").write_text(json.dumps({**summary, "status": "failed"}))
    assert find_resume_point(cfg, run_dir, print) == ResumePoint("resume", run_dir / "checkpoints" / "step_000004")


def test_another_experiment_is_refused_with_key_and_both_values(tmp_path):
    run_dir = stored_run(tmp_path, cfg_of(tmp_path), steps=(2,))
    with pytest.raises(ValueError) as raised:
        find_resume_point(cfg_of(tmp_path, "train.resume=auto", "train.lr=0.001", "train.max_steps=9"), run_dir, print)
    assert str(raised.value) == (
        f"train.resume=auto but {run_dir / 'config.yaml'} was made from a different experiment: train.lr: 0.003 "
        "(run) -> 0.001 (now). Only train.max_steps, train.eval_every, train.grad_accum, train.tp_size, train.sequence_parallel and run/log/checkpoint keys "
        "may change on resume; use a new run.name (nothing was changed)")


def test_config_differences_are_dotted_leaves_outside_the_ignored_keys(tmp_path):
    old = cfg_of(tmp_path)
    new = cfg_of(tmp_path, "train.lr=0.001", "model.n_heads=4", "train.max_steps=9", "run.name=other")
    assert config_differences(old, new) == [("model.n_heads", 2, 4), ("train.lr", 0.003, 0.001)]
    assert config_differences(old, new, ignore=()) == [("model.n_heads", 2, 4), ("run.name", "r", "other"),
                                                       ("train.lr", 0.003, 0.001), ("train.max_steps", 4, 9)]


def test_load_model_weights_loads_the_weights(tmp_path):
    model = torch.nn.Linear(3, 2)
    path = save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(model.parameters()))
    fresh = torch.nn.Linear(3, 2)
    load_checkpoint(path, fresh)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)
