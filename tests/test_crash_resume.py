"""Crash and resume with REAL processes and REAL signals.

One story, told once because every process start costs seconds of imports:

1. `fp8train train` runs in a subprocess and gets SIGKILL in the middle of training (after step 9 is logged);
2. `fp8train train ... train.resume=true` resumes from the newest checkpoint and gets SIGKILL while it is INSIDE
   save_checkpoint: FP8TRAIN_TEST_PAUSE_IN_CHECKPOINT makes the writer announce and sleep between its files, so
   the kill lands there with certainty, not by timing luck;
3. the newest complete checkpoint verifies and loads; the half-written one is invisible;
4. the newest complete checkpoint is then corrupted (one flipped bit): the final resume names it, skips it, falls
   back to the one before, and finishes;
5. the result equals an uninterrupted run exactly on CPU: every logged loss, val_loss, lr and grad_norm, the FP8
   state digest and the final weights, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fp8train.training.checkpoint import latest_valid_checkpoint, list_checkpoints, load_checkpoint, verify_checkpoint
from fp8train.training.config import fp8_recipe_from_config, layer_policy_from_config, load_config
from fp8train.nn.convert import convert_to_fp8
from refs import write_stdlib_corpus
from fp8train.training.model import build_model
from fp8train.training.loop import train

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]

STEPS, EVERY = 16, 4
TINY = {
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 32},
    "train": {"max_steps": STEPS, "batch_size": 8, "eval_every": 8, "eval_batches": 2, "lr": 3e-3, "device": "cpu"},
    "optim": {"warmup_steps": 2},
    "fp8": {"recipe": "delayed"},
    "policy": {"min_features": 16},
    "log": {"wandb": "disabled", "every": 1, "telemetry_every": 4},
    "checkpoint": {"every": EVERY, "keep_last": 0},
}
EXACT_KEYS = ("step", "loss", "val_loss", "lr", "grad_norm", "skipped_steps", "fp8/grad_output/nonfinite_amax_events",
              "fp8/input/sqnr_min_db", "fp8/grad_output/staleness_max")
TIMEOUT_S = 300


def _fp8train_command() -> list[str]:
    script = Path(sys.executable).parent / "fp8train"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fp8train.cli"]


def _start(root: Path, log: Path, *overrides: str, pause: float | None = None) -> subprocess.Popen:
    env = {**os.environ, "FP8TRAIN_COMPILE": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("FP8TRAIN_TEST_PAUSE_IN_CHECKPOINT", None)
    if pause is not None:
        env["FP8TRAIN_TEST_PAUSE_IN_CHECKPOINT"] = str(pause)
    cmd = [*_fp8train_command(), "train", str(root / "tiny.yaml"), "run.name=crash", *overrides, "--quiet"]
    with open(log, "w") as stderr:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)


def _wait_for(proc: subprocess.Popen, log: Path, condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"never saw {what} (exit {proc.returncode}):\n{log.read_text()[-4000:]}")
        time.sleep(0.02)


def _kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def _logged_steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):  # a line being written right now
            pass
    return steps


def _metrics(run_dir: Path) -> list[dict]:
    return [{k: r[k] for k in EXACT_KEYS if k in r}
            for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("crash")
    write_stdlib_corpus(root / "corpus.txt")
    config = {**TINY, "run": {"dir": str(root / "runs"), "name": "x"}, "data": {"path": str(root / "corpus.txt")}}
    (root / "tiny.yaml").write_text(yaml.safe_dump(config))
    return root


def test_kill9_mid_training_and_mid_checkpoint_then_resume_reproduces_exactly(root, capsys):
    run_dir, ckpts = root / "runs" / "crash", root / "runs" / "crash" / "checkpoints"

    # 1. SIGKILL in the middle of training.
    log1 = root / "first.log"
    proc = _start(root, log1)
    _wait_for(proc, log1, lambda: max(_logged_steps(run_dir), default=0) >= 9, "step 9 logged")
    _kill9(proc)
    killed_at = max(_logged_steps(run_dir))
    assert 9 <= killed_at < STEPS and not (run_dir / "summary.json").exists()
    newest = latest_valid_checkpoint(ckpts)
    assert newest is not None and int(newest.name[5:]) == EVERY * (killed_at // EVERY)

    # 2. Resume, and SIGKILL while the next checkpoint is half written.
    log2 = root / "second.log"
    proc = _start(root, log2, "train.resume=true", pause=120)
    _wait_for(proc, log2, lambda: "checkpoint paused in" in log2.read_text(), "the checkpoint pause")
    _kill9(proc)
    half = Path(log2.read_text().split("checkpoint paused in ")[1].split()[0])
    paused_step = int(half.name.split("-")[1][5:])
    assert paused_step == int(newest.name[5:]) + EVERY
    assert half.is_dir() and sorted(p.name for p in half.iterdir()) == ["model.safetensors"]

    # 3. The half-written checkpoint is invisible; the newest complete one verifies and loads.
    assert latest_valid_checkpoint(ckpts) == newest
    assert [int(p.name[5:]) for p in list_checkpoints(ckpts)] == list(range(EVERY, paused_step, EVERY))
    assert all(verify_checkpoint(p) is None for p in list_checkpoints(ckpts))
    cfg = load_config(str(root / "tiny.yaml"), ["run.name=crash"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    convert_to_fp8(model, fp8_recipe_from_config(cfg), layer_policy_from_config(cfg))
    assert load_checkpoint(newest, model)["step"] == int(newest.name[5:])
    assert bool(model.layers[0].attn.q_proj.input_initialized)

    # 4. Corrupt the newest complete checkpoint: the resume must name it and fall back to the one before.
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-100] ^= 0x10
    (newest / "model.safetensors").write_bytes(bytes(data))
    capsys.readouterr()
    summary = train(load_config(str(root / "tiny.yaml"), ["run.name=crash", "train.resume=true"]),
                    show_progress=False)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {newest}: model.safetensors checksum mismatch (corrupt)" in err
    previous = newest.with_name(f"step_{int(newest.name[5:]) - EVERY:06d}")
    assert summary["resumed_from"] == str(previous) and summary["status"] == "completed"
    assert not list(ckpts.glob(".tmp-*")), "the next save clears a killed writer's leftovers"

    # 5. Exactly the uninterrupted run.
    reference = train(load_config(str(root / "tiny.yaml"), ["run.name=reference"]), show_progress=False)
    assert _metrics(run_dir) == _metrics(root / "runs" / "reference")
    assert [r["step"] for r in _metrics(run_dir)] == list(range(STEPS + 1))
    for key in ("loss", "val_loss", "fp8_state_sha256", "steps"):
        assert summary[key] == reference[key], key
    final = f"step_{STEPS:06d}/model.safetensors"
    a, b = load_file(str(ckpts / final)), load_file(str(root / "runs" / "reference" / "checkpoints" / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    shutil.rmtree(root / "runs")
