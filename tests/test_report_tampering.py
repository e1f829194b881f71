"""`fp8train report` on a validation or run folder changed after the runs: a verdict only from what validate would
accept, and a damaged file is one line naming it (exit 2), never a traceback.

One real tiny validation (2 seeds, bf16 + current, 3 steps) is made once; each case tampers with a copy."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.batch_size=2",
        "train.max_steps=3", "train.eval_every=3", "train.eval_batches=1", "optim.warmup_steps=1",
        "policy.min_features=16", "log.wandb=disabled", "log.telemetry_every=0", "data.max_bytes=200000",
        "train.autocast=none", "validate.candidates=[current]", "validate.seeds=2", "validate.final_window=1",
        "validate.workers=1"]


@pytest.fixture(scope="module")
def validation(tmp_path_factory) -> Path:
    from fp8train.evidence.validate import run_validation
    from fp8train.training.config import load_config

    root = tmp_path_factory.mktemp("tamper")
    run_validation(load_config(None, [*TINY, f"run.dir={root}", "run.name=val"]), show_progress=False,
                   log=lambda line: None)
    return root / "val"


def _one_line_refusal(commands, capsys, folder: Path, *named: str) -> str:
    code, _, err = commands.main(["report", str(folder)], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "internal error" not in err, err
    assert all(n in lines[0] for n in named), lines[0]
    return lines[0]


def test_a_log_copied_from_another_seed_gives_no_verdict(validation, tmp_path, commands, capsys):
    """current/seed1337's metrics.jsonl replaced by seed1338's: the curves would pair seed 1338's candidate with
    seed 1337's baseline; its summary.json still records its own final val_loss, so the swap shows."""
    vdir = shutil.copytree(validation, tmp_path / "val")
    runs = vdir / "runs" / "current"
    shutil.copy(runs / "seed1338" / "metrics.jsonl", runs / "seed1337" / "metrics.jsonl")
    _one_line_refusal(commands, capsys, vdir, "runs/current/seed1337", "metrics.jsonl", "not this run's")


@pytest.mark.parametrize("key, value", [("margin", 0.5), ("final_window", 2)])
def test_an_edited_plan_declaration_gives_no_verdict(validation, tmp_path, key, value, commands, capsys):
    """plan.json's margin (a looser one turns a FAIL into a PASS) or final window edited after the runs: every
    run's config.yaml still holds what was declared before them."""
    vdir = shutil.copytree(validation, tmp_path / "val")
    plan = json.loads((vdir / "plan.json").read_text())
    plan[key] = value
    (vdir / "plan.json").write_text(json.dumps(plan))
    _one_line_refusal(commands, capsys, vdir, f"validate.{key}", "plan.json was edited")


@pytest.mark.parametrize("content", [b"\xff\xfe garbage", b"[1, 2]", b"seed: [1,\n"], ids=["bytes", "list", "torn"])
@pytest.mark.parametrize("name", ["summary.json", "config.yaml"])
def test_a_damaged_run_file_is_one_line_naming_it(validation, tmp_path, name, content, commands, capsys):
    """A run folder's summary.json or config.yaml that is not UTF-8, holds a list, or is cut short: the report
    of the run (and of the validation holding it) names the file, exit 2; before, a traceback."""
    vdir = shutil.copytree(validation, tmp_path / "val")
    run = vdir / "runs" / "current" / "seed1337"
    (run / name).write_bytes(content)
    _one_line_refusal(commands, capsys, run, name)
    _one_line_refusal(commands, capsys, vdir, name)
