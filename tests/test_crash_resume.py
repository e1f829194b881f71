"""Crash and resume with REAL processes and REAL SIGKILLs, at points the test controls (no timing luck).

The kills come from tests/crashpoint.py, which runs the real `fp8train train` and SIGKILLs the process at a chosen
point, or writes a marker file there for the test to react to:

1. killed on entering step 12's checkpoint (step 12 already logged, its checkpoint not begun);
2. resumed, and killed INSIDE step 12's checkpoint, between its two tensor files;
3. the half-written checkpoint is invisible; the newest complete one verifies and loads;
4. that one is corrupted (one flipped bit): the final resume names it, skips it, falls back to the one before and
   finishes;
5. the result equals an uninterrupted run exactly on CPU: every logged loss, val_loss, lr and grad_norm, the FP8
   state digest and the final weights, bit for bit.

A second test sends the SIGKILL itself once step 4's checkpoint exists and asserts only what must hold wherever
that kill lands (mid-step, mid-metrics-line, mid-checkpoint, or after the run ended): every visible checkpoint
verifies, the newest is at least step 4, and the resumed run reproduces the uninterrupted one exactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8train.nn.convert import convert_to_fp8
from fp8train.training.runs.checkpoint import latest_valid_checkpoint, list_checkpoints, load_checkpoint, verify_checkpoint
from fp8train.training.config import fp8_recipe_from_config, layer_policy_from_config, load_config
from fp8train.training.loop import train
from fp8train.training.models.decoder import build_model

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]

STEPS, EVERY = 16, 4
SECTIONS = dict(train={"max_steps": STEPS, "eval_every": 8}, checkpoint={"every": EVERY, "keep_last": 0})
EXACT_KEYS = ("step", "loss", "val_loss", "lr", "grad_norm", "skipped_steps", "fp8/grad_output/nonfinite_amax_events",
              "fp8/input/sqnr_min_db", "fp8/grad_output/staleness_max")
TIMEOUT_S = 300


def _step_of(path: Path) -> int:
    return int(path.name[len("step_"):])


def _metrics(run_dir: Path) -> list[dict]:
    """The exactly reproducible keys of every complete metrics line (a torn last line is dropped)."""
    records = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [{k: r[k] for k in EXACT_KEYS if k in r} for r in records]


def _crash(commands, config: Path, name: str, kill_at: str, *overrides: str) -> subprocess.CompletedProcess:
    argv = commands.crashpoint(kill_at, "train", str(config), f"run.name={name}", *overrides, "--quiet")
    proc = commands.run(argv, timeout=TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL, f"exit {proc.returncode}, expected SIGKILL:\n{proc.stderr[-4000:]}"
    return proc


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    """The config, and the uninterrupted reference run every crashed run must reproduce."""
    root = tmp_path_factory.mktemp("crash")
    config = tiny.write(root, **SECTIONS)
    reference = train(load_config(str(config), ["run.name=reference"]), show_progress=False)
    assert reference["status"] == "completed"
    return root, config, reference


def _assert_reproduces_reference(root: Path, name: str, summary: dict, reference: dict) -> None:
    run_dir, reference_dir = root / "runs" / name, root / "runs" / "reference"
    assert summary["status"] == "completed"
    assert _metrics(run_dir) == _metrics(reference_dir)
    assert [r["step"] for r in _metrics(run_dir)] == list(range(STEPS + 1))
    for key in ("loss", "val_loss", "fp8_state_sha256", "steps"):
        assert summary[key] == reference[key], key
    final = f"checkpoints/step_{STEPS:06d}/model.safetensors"
    a, b = load_file(str(run_dir / final)), load_file(str(reference_dir / final))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_kill9_before_and_inside_a_checkpoint_then_resume_reproduces_exactly(setup, commands, capsys):
    root, config, reference = setup
    run_dir = root / "runs" / "crash"
    ckpts = run_dir / "checkpoints"

    # 1. SIGKILL as step 12's checkpoint begins: step 12 has run, its checkpoint has not been started.
    _crash(commands, config, "crash", "before-checkpoint:12")
    assert not (run_dir / "summary.json").exists()
    assert [_step_of(p) for p in list_checkpoints(ckpts)] == [4, 8]
    assert all(verify_checkpoint(p) is None for p in list_checkpoints(ckpts))
    assert not list(ckpts.glob(".tmp-*"))
    logged = [r["step"] for r in _metrics(run_dir)]
    assert logged == list(range(len(logged))) and 8 <= logged[-1] <= 12  # a prefix; past the newest checkpoint

    # 2. Resume from step 8, SIGKILL inside step 12's checkpoint, between its two tensor files.
    _crash(commands, config, "crash", "inside-checkpoint:12", "train.resume=true")
    half = list(ckpts.glob(".tmp-step_000012-*"))
    assert len(half) == 1 and sorted(p.name for p in half[0].iterdir()) == ["model.safetensors"]

    # 3. The half-written checkpoint is invisible; the newest complete one verifies and loads.
    newest = latest_valid_checkpoint(ckpts)
    assert newest == ckpts / "step_000008"
    assert [_step_of(p) for p in list_checkpoints(ckpts)] == [4, 8]
    cfg = load_config(str(config), ["run.name=crash"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    convert_to_fp8(model, fp8_recipe_from_config(cfg), layer_policy_from_config(cfg))
    assert load_checkpoint(newest, model)["step"] == 8
    assert bool(model.layers[0].attn.q_proj.input_initialized)

    # 4. Corrupt the newest complete checkpoint: the resume must name it and fall back to the one before.
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[-100] ^= 0x10
    (newest / "model.safetensors").write_bytes(bytes(data))
    capsys.readouterr()
    summary = train(load_config(str(config), ["run.name=crash", "train.resume=true"]), show_progress=False)
    err = capsys.readouterr().err
    assert f"skipping checkpoint {newest}: model.safetensors checksum mismatch (corrupt)" in err
    assert summary["resumed_from"] == str(ckpts / "step_000004")
    assert not list(ckpts.glob(".tmp-*")), "the next save clears a killed writer's leftovers"

    # 5. Exactly the uninterrupted run.
    _assert_reproduces_reference(root, "crash", summary, reference)
    shutil.rmtree(run_dir)


def test_kill9_wherever_it_lands_then_resume_reproduces_exactly(setup, commands):
    root, config, reference = setup
    run_dir, marker = root / "runs" / "anywhere", root / "step4.done"
    argv = commands.crashpoint(f"marker-after-checkpoint:4:{marker}", "train", str(config), "run.name=anywhere",
                               "--quiet")
    log = root / "anywhere.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(argv, env=commands.env(), stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + TIMEOUT_S
    while not marker.exists():  # the wait only detects the marker; nothing below depends on when it is seen
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the run never completed step 4's checkpoint (exit {proc.wait()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.05)
    # A delay from the OS's entropy spreads the kills of repeated runs over the rest of the run (a few seconds of
    # training on an idle machine); the assertions below hold wherever it lands.
    time.sleep(random.SystemRandom().uniform(0.0, 2.0))
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it finished already: a kill after the end is a place it may land too
        pass
    exit_code = proc.wait(timeout=60)
    assert exit_code in (-signal.SIGKILL, 0)

    # What holds wherever the kill landed.
    ckpts = run_dir / "checkpoints"
    visible = list_checkpoints(ckpts)
    assert all(verify_checkpoint(p) is None for p in visible), [verify_checkpoint(p) for p in visible]
    steps = [_step_of(p) for p in visible]
    assert steps == list(range(EVERY, steps[-1] + 1, EVERY)) and steps[-1] >= 4
    logged = [r["step"] for r in _metrics(run_dir)]
    assert logged == list(range(len(logged))) and logged[-1] >= 4
    print(f"kill landed after step {logged[-1]} was logged, newest checkpoint step {steps[-1]}")

    # On an idle machine the run can end (summary.json written) before the kill lands; the resume then finds it
    # complete and changes nothing. Otherwise it resumes from the newest checkpoint.
    finished = (run_dir / "summary.json").exists()
    summary = train(load_config(str(config), ["run.name=anywhere", "train.resume=true"]), show_progress=False)
    if not finished:
        assert summary["resumed_from"] == str(ckpts / f"step_{steps[-1]:06d}")
    _assert_reproduces_reference(root, "anywhere", summary, reference)
    shutil.rmtree(run_dir)
