"""Issue 13, case by case: an adversarial user's ways of making fp8train silently wrong or lose work, each one a
test that failed before the fix. Cases 11 and 12 (quantize edges, outlier-aware delayed scaling) live with the
numerics, in test_quant.py and test_linear.py.

 1 data rewritten under the same data.path (train resume, validate re-run, built-in corpus of another Python)
 2 pruning with a corrupt newer checkpoint          3 an existing non-run directory
 4 manifests: self-checksum, step vs folder, config hash on resume
 5 torn metrics/telemetry lines and plan.json       6 locks: second process refused, stale lock taken over
 7 config values that used to fail after writing    8 NaN/inf/0/negative FP8 state in a checkpoint
 9 full disk, read-only, forbidden folder           10 symlinks in a run directory
13 strict JSON, export over its own source, file modes, odd-sized .bin, /dev/zero

Runs are tiny (d_model 64, 2 layers, seq_len 32, batch 8, a few steps, fp32 activations) on a ~200 KB slice of
the standard library, one thread.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fp8train import cli
from fp8train.training.runs.checkpoint import (MANIFEST, latest_valid_checkpoint, list_checkpoints, load_checkpoint,
                                          save_checkpoint, verify_checkpoint)
from fp8train.training.config import load_config
from fp8train.training.loop import train
from fp8train.training.storage.rundir import LOCK_FILE
from refs import write_stdlib_corpus

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = {
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 32},
    "train": {"max_steps": 8, "batch_size": 8, "eval_every": 4, "eval_batches": 2, "lr": 3e-3, "device": "cpu",
              "autocast": "none", "threads": 1},
    "optim": {"warmup_steps": 2},
    "fp8": {"recipe": "delayed"},
    "policy": {"min_features": 16},
    "log": {"wandb": "disabled", "every": 1, "telemetry_every": 4},
    "checkpoint": {"every": 4, "keep_last": 0},
    "validate": {"candidates": ["delayed"], "seeds": 2, "final_window": 1},
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("reliability")
    write_stdlib_corpus(root / "corpus.txt")
    (root / "tiny.yaml").write_text(yaml.safe_dump({**TINY, "run": {"dir": str(root / "runs"), "name": "x"},
                                                    "data": {"path": str(root / "corpus.txt")}}))
    return root



def cfg_of(root: Path, name: str, *overrides: str):
    return load_config(str(root / "tiny.yaml"), [f"run.name={name}", *overrides])


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file below `directory` with its bytes (what 'nothing was changed' compares), the lock file aside:
    it records who holds the directory now."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def run_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    """Exit status and stderr lines of `fp8train ARGV` (only this call's: earlier output is dropped)."""
    capsys.readouterr()
    code = cli.main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


def rewrite_corpus(path: Path) -> None:
    """Same size, other text: only a content fingerprint can tell."""
    text = path.read_text()
    path.write_text(text[len(text) // 2:] + text[:len(text) // 2])


def strict_json(text: str):
    """json.loads that refuses NaN/Infinity, as any strict JSON reader does."""
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")
    return json.loads(text, parse_constant=refuse)


def tiny_model():
    from fp8train.nn.linear import Fp8Linear

    torch.manual_seed(0)
    model = torch.nn.Sequential(Fp8Linear(16, 32, recipe="delayed"), torch.nn.ReLU(),
                                Fp8Linear(32, 16, recipe="delayed"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def trained_model(steps: int = 2):
    from fp8train.nn.linear import update_fp8_scales

    model, optimizer = tiny_model()
    for _ in range(steps):
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        update_fp8_scales(model)
    return model, optimizer


# ------------------------------------------------------------------------------------------------------------
# 1. Data provenance
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_01_resume_refuses_data_rewritten_under_the_same_path(root, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    shutil.copy(root / "corpus.txt", corpus)
    args = ["train", str(root / "tiny.yaml"), "run.name=data-resume", f"run.dir={tmp_path}", f"data.path={corpus}",
            "--quiet"]
    assert cli.main(args + ["train.max_steps=4", "checkpoint.save_final=true"]) == 0
    before = files_of(tmp_path / "data-resume")
    rewrite_corpus(corpus)
    code, err = run_cli(capsys, *args, "train.max_steps=8", "train.resume=true")  # train on, on other data
    assert code == 2 and len(err) == 1 and "training tokens" in err[0] and str(corpus) in err[0], err
    assert files_of(tmp_path / "data-resume") == before


@pytest.mark.slow
def test_01_validate_refuses_a_rerun_on_other_data_and_another_python(root, tmp_path):
    from fp8train.evidence.validate import run_validation

    corpus = tmp_path / "corpus.txt"
    shutil.copy(root / "corpus.txt", corpus)
    cfg = load_config(str(root / "tiny.yaml"), [f"run.dir={tmp_path}", "run.name=val", f"data.path={corpus}",
                                                "train.max_steps=2", "train.eval_every=2", "log.telemetry_every=0"])
    run_validation(cfg, show_progress=False, log=lambda m: None, write_report=False)
    vdir = tmp_path / "val"
    before = files_of(vdir)
    rewrite_corpus(corpus)
    with pytest.raises(ValueError, match="training tokens .* -> .*nothing was changed"):
        run_validation(cfg, show_progress=False, log=lambda m: None, write_report=False)
    assert files_of(vdir) == before
    # The built-in corpus is the running Python's standard library: a plan made under another Python is refused.
    shutil.copy(root / "corpus.txt", corpus)
    cfg_builtin = load_config(str(root / "tiny.yaml"), [f"run.dir={tmp_path}", "run.name=val-builtin",
                                                        "data.path=", "data.max_bytes=300000", "train.max_steps=2",
                                                        "train.eval_every=2", "log.telemetry_every=0"])
    run_validation(cfg_builtin, show_progress=False, log=lambda m: None, write_report=False)
    plan_path = tmp_path / "val-builtin" / "plan.json"
    plan = json.loads(plan_path.read_text())
    assert plan["data_fingerprint"]["python"] == ".".join(map(str, sys.version_info[:3]))
    plan["data_fingerprint"]["python"] = "3.9.0"
    plan_path.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match="Python version of the built-in corpus 3.9.0 -> "):
        run_validation(cfg_builtin, show_progress=False, log=lambda m: None, write_report=False)


def test_01_fingerprint_is_of_the_tokens(root, tmp_path):
    """The fingerprint is sha256 of the token bytes of each split (recomputed here with hashlib from the split)."""
    import hashlib

    from fp8train.training.data.corpus import build_data

    corpus = tmp_path / "c.txt"
    shutil.copy(root / "corpus.txt", corpus)
    data = build_data(cfg_of(root, "fp", f"data.path={corpus}"))
    expected = hashlib.sha256(b"uint8" + data.train_tokens.tobytes()).hexdigest()
    assert data.fingerprint["train_sha256"] == expected
    assert data.fingerprint["val_tokens"] == len(data.val_tokens)
    rewrite_corpus(corpus)
    assert build_data(cfg_of(root, "fp", f"data.path={corpus}")).fingerprint["train_sha256"] != expected


# ------------------------------------------------------------------------------------------------------------
# 2. Pruning
# ------------------------------------------------------------------------------------------------------------
def _plant_corrupt(ckpt_dir: Path, good: Path, step: int) -> Path:
    bad = ckpt_dir / f"step_{step:06d}"
    shutil.copytree(good, bad)
    with open(bad / "model.safetensors", "r+b") as f:  # flip bytes in the middle: same size, wrong sha256
        f.seek(f.seek(0, os.SEEK_END) // 2)
        f.write(b"\xff" * 16)
    return bad


def test_02_pruning_counts_only_verified_checkpoints_and_keeps_the_resumed_one(tmp_path):
    model, optimizer = trained_model()
    resumed_from = save_checkpoint(tmp_path, 30, model, optimizer, keep_last=1)
    _plant_corrupt(tmp_path, resumed_from, 40)
    save_checkpoint(tmp_path, 35, model, optimizer, keep_last=1, protect=[resumed_from])
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_000030", "step_000035", "step_000040"]  # the corrupt one is left for inspection
    assert latest_valid_checkpoint(tmp_path, log=lambda m: None).name == "step_000035"
    save_checkpoint(tmp_path, 36, model, optimizer, keep_last=1)  # no longer protected: 30 and 35 go
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000036", "step_000040"]


@pytest.mark.slow
def test_02_resume_past_a_corrupt_newer_checkpoint_loses_nothing(root, tmp_path):
    over = [f"run.dir={tmp_path}", "checkpoint.every=2", "checkpoint.keep_last=1"]
    stop_at_5 = lambda record: "stopped for the test" if record["step"] == 5 else None  # noqa: E731
    assert train(cfg_of(root, "prune", *over), show_progress=False, should_stop=stop_at_5)["status"] == "stopped"
    ckpt = tmp_path / "prune" / "checkpoints"
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_000004"]
    _plant_corrupt(ckpt, ckpt / "step_000004", 40)
    summary = train(cfg_of(root, "prune", *over, "train.resume=true"), show_progress=False)
    assert summary["status"] == "completed" and summary["resumed_from"].endswith("step_000004")
    valid = [p.name for p in list_checkpoints(ckpt) if verify_checkpoint(p) is None]
    assert valid[-1] == "step_000008" and "step_000004" in valid


# ------------------------------------------------------------------------------------------------------------
# 3. An existing directory that is not a run
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("resume", ["false", "true"])
def test_03_a_directory_that_holds_no_run_is_refused(root, tmp_path, capsys, resume):
    vdir = tmp_path / "a-validation"
    vdir.mkdir()
    (vdir / "summary.json").write_text('{"verdict": "pass"}\n')
    (vdir / "plan.json").write_text('{"margin": 0.02}\n')
    before = files_of(vdir)
    code, err = run_cli(capsys, "train", str(root / "tiny.yaml"), f"run.dir={tmp_path}", "run.name=a-validation",
                        f"train.resume={resume}", "--quiet")
    assert code == 2 and len(err) == 1 and "not a run directory" in err[0], err
    assert files_of(vdir) == before


# ------------------------------------------------------------------------------------------------------------
# 4. Manifests
# ------------------------------------------------------------------------------------------------------------
def test_04_a_hand_edited_manifest_does_not_verify(tmp_path):
    model, optimizer = trained_model()
    path = save_checkpoint(tmp_path, 30, model, optimizer)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["step"] = 35
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert "does not match its own checksum" in verify_checkpoint(path)
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_checkpoint(path, tiny_model()[0])


def test_04_a_renamed_checkpoint_folder_does_not_verify(tmp_path):
    model, optimizer = trained_model()
    path = save_checkpoint(tmp_path, 30, model, optimizer)
    path.rename(tmp_path / "step_000035")
    assert verify_checkpoint(tmp_path / "step_000035") == "manifest.json says step 30, but the folder is step_000035"
    assert latest_valid_checkpoint(tmp_path, log=lambda m: None) is None


@pytest.mark.slow
def test_04_resume_checks_the_manifest_config_hash(root, tmp_path, capsys):
    base = [f"run.dir={tmp_path}", "train.max_steps=4", "checkpoint.save_final=true"]
    assert train(cfg_of(root, "manifest", *base), show_progress=False)["status"] == "completed"
    run_dir = tmp_path / "manifest"
    # config.yaml swapped for another seed and lr: config.yaml agrees with the new command, the manifest does not.
    other = cfg_of(root, "manifest", *base, "train.seed=7", "train.lr=1e-2")
    from fp8train.training.config import config_to_yaml

    (run_dir / "config.yaml").write_text(config_to_yaml(other))
    before = files_of(run_dir)
    code, err = run_cli(capsys, "train", str(root / "tiny.yaml"), "run.name=manifest", *base, "train.seed=7",
                        "train.lr=1e-2", "train.resume=true", "--quiet")
    assert code == 2 and len(err) == 1 and "different config" in err[0] and "step_000004" in err[0], err
    assert files_of(run_dir) == before
    # config.yaml deleted: the directory no longer holds a run, and is refused whatever the command says.
    (run_dir / "config.yaml").unlink()
    code, err = run_cli(capsys, "train", str(root / "tiny.yaml"), "run.name=manifest", *base, "train.seed=7",
                        "train.resume=true", "--quiet")
    assert code == 2 and "not a run directory" in err[0], err


# ------------------------------------------------------------------------------------------------------------
# 5. Torn and half-written files
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(root, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("finished")
    assert train(cfg_of(root, "done", f"run.dir={runs}"), show_progress=False)["status"] == "completed"
    return runs / "done"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "telemetry.jsonl"])
def test_05_report_survives_a_torn_last_line_and_names_a_damaged_one(finished_run, tmp_path, capsys, name):
    """A torn last line is dropped; a damaged line before it (not JSON, not UTF-8, or for telemetry a wrongly
    shaped record) is skipped and named, file and line, in report.md: never a crash."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    good = (run_dir / name).read_text()
    (run_dir / name).write_text(good + '{"step": 9, "lo')  # kill -9 during an append
    code, err = run_cli(capsys, "report", str(run_dir))
    assert code == 0, err
    lines = [line.encode() for line in good.splitlines()]
    damaged = [b'{"step": 2, "lo', b'{"step": 3, "loss": 1.5\xff\xfe}', b'{"step": 4, "layers": {"x": 5}}']
    (run_dir / name).write_bytes(b"\n".join(lines[:1] + damaged + lines[1:]) + b"\n")
    code, err = run_cli(capsys, "report", str(run_dir))
    assert code == 0, err
    report = (run_dir / "report.md").read_text()
    assert f"{run_dir / name}, line 2, is not valid JSON" in report
    assert f"{run_dir / name}, line 3, is not UTF-8 text" in report
    assert (f"{run_dir / name}, line 4, has a wrongly shaped 'layers'" in report) == (name == "telemetry.jsonl")


@pytest.mark.slow
def test_05_resume_drops_damaged_lines_and_names_them(root, tmp_path, capsys):
    """Non-UTF-8 bytes in metrics.jsonl and a wrongly shaped telemetry record before the checkpoint's step: the
    resume continues, drops those lines (named, file and line, on stderr) and rewrites the files without them."""
    runs = tmp_path / "runs"
    assert train(cfg_of(root, "r", f"run.dir={runs}", "train.max_steps=4"), show_progress=False)["status"] == \
        "completed"
    run_dir = runs / "r"
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines()
    metrics.write_bytes(b"\n".join([lines[0], b'{"step": 1, "loss": 2.5\xff}', *lines[2:]]) + b"\n")
    telemetry_file = run_dir / "telemetry.jsonl"
    telemetry_file.write_bytes(b'{"step": 2, "layers": [1, 2]}\n' + telemetry_file.read_bytes())
    capsys.readouterr()
    summary = train(cfg_of(root, "r", f"run.dir={runs}", "train.max_steps=6", "train.resume=true"),
                    show_progress=False)
    err = capsys.readouterr().err
    assert summary["status"] == "completed" and summary["steps"] == 6
    assert f"dropping a damaged line: {metrics}, line 2, is not UTF-8 text" in err, err
    assert f"dropping a damaged line: {telemetry_file}, line 1, has a wrongly shaped 'layers'" in err, err
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 2, 3, 4, 5, 6]


def test_05_torn_plan_json(tmp_path):
    from fp8train.evidence.validate import check_plan

    vdir = tmp_path / "v"
    vdir.mkdir()
    (vdir / "plan.json").write_text('{"margin": 0.0')  # what a non-atomic write killed midway left
    plan = {"data_fingerprint": {}, "margin": 0.02}
    assert check_plan(vdir, plan) is None  # nothing was run under it: plan again
    (vdir / "runs" / "bf16").mkdir(parents=True)
    with pytest.raises(ValueError, match="plan.json is damaged and runs were already made"):
        check_plan(vdir, plan)


# ------------------------------------------------------------------------------------------------------------
# 6. Locks
# ------------------------------------------------------------------------------------------------------------
HOLD_LOCK = """
import sys, time
from fp8train.training.storage.rundir import DirLock
DirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def _hold_lock(directory: Path) -> subprocess.Popen:
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(directory)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def test_06_lock_refuses_a_second_holder_and_is_taken_over_after_a_kill(tmp_path):
    from fp8train.training.storage.rundir import DirLock

    holder = _hold_lock(tmp_path / "run")
    try:
        with pytest.raises(ValueError, match=f"in use by another fp8train process \\(PID {holder.pid} "):
            DirLock(tmp_path / "run").acquire()
    finally:
        _kill9(holder)
    said = []
    with DirLock(tmp_path / "run", log=said.append):
        assert said == [f"run directory {tmp_path / 'run'}: took over the lock of PID {holder.pid}, which is no "
                        "longer running (killed?)"]
    with DirLock(tmp_path / "run", log=said.append):  # released cleanly: no takeover message
        assert len(said) == 1


@pytest.mark.slow
def test_06_second_train_on_a_running_run_is_refused(root, tmp_path, capsys):
    run_dir = tmp_path / "busy"
    args = ["train", str(root / "tiny.yaml"), f"run.dir={tmp_path}", "run.name=busy", "--quiet"]
    assert cli.main(args + ["train.max_steps=4"]) == 0
    before = files_of(run_dir)
    holder = _hold_lock(run_dir)  # stands in for a first train still running there
    try:
        code, err = run_cli(capsys, *args, "train.max_steps=8", "train.resume=true")
    finally:
        _kill9(holder)
    assert code == 2 and len(err) == 1 and f"PID {holder.pid}" in err[0], err
    assert files_of(run_dir) == before  # metrics.jsonl not touched by the second process


def _wait_for_step(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the run in `run_dir` has logged an optimizer step (it holds its lock by then: the lock is taken
    before the first write), or fail with the process's output."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any('"loss"' in line for line in metrics.read_text().splitlines()[:-1]):
            return
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"the first train never logged a step: {proc.communicate()[1][-2000:]}")


@pytest.mark.slow
def test_06_a_real_training_run_holds_its_lock_until_it_ends(root, tmp_path, capsys, commands):
    """A real `fp8train train` (100000 steps: still training when the second one starts) holds its run
    directory: a second train there, which would start or resume (train.resume=auto), is refused with the first
    one's PID and changes nothing; killed, the first one's lock is taken over."""
    import socket

    run_dir = tmp_path / "held"
    args = ["train", str(root / "tiny.yaml"), f"run.dir={tmp_path}", "run.name=held", "--quiet",
            "train.max_steps=100000", "train.eval_every=100000", "checkpoint.every=0", "log.telemetry_every=0"]
    first = subprocess.Popen(commands.fp8train(*args), env=commands.env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_step(run_dir, first)
        config_before = (run_dir / "config.yaml").read_bytes()
        # 2 steps: were it not refused, it would finish (and the test fail) in seconds
        code, err = run_cli(capsys, *args, "train.resume=auto", "train.max_steps=2")
        assert first.poll() is None  # still training: refused by its lock, not by a finished run
    finally:
        _kill9(first)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"fp8train train: error: run directory {run_dir} is in use by another fp8train "
                             f"process (PID {first.pid} on {socket.gethostname()}, since "), err
    assert err[0].endswith("); wait for it to finish or stop it (nothing was changed)"), err
    assert (run_dir / "config.yaml").read_bytes() == config_before
    assert not (run_dir / "summary.json").exists()  # the second process wrote nothing, the first never finished
    from fp8train.training.storage.rundir import DirLock

    said = []
    with DirLock(run_dir, log=said.append):
        assert said == [f"run directory {run_dir}: took over the lock of PID {first.pid}, which is no longer "
                        "running (killed?)"]


@pytest.mark.slow
def test_06_second_validate_of_a_directory_is_refused(root, tmp_path):
    from fp8train.evidence.validate import run_validation

    holder = _hold_lock(tmp_path / "val")
    try:
        cfg = load_config(str(root / "tiny.yaml"), [f"run.dir={tmp_path}", "run.name=val", "train.max_steps=2"])
        with pytest.raises(ValueError, match=f"validation directory .* \\(PID {holder.pid} "):
            run_validation(cfg, show_progress=False, log=lambda m: None, write_report=False)
    finally:
        _kill9(holder)
    assert not (tmp_path / "val" / "runs").exists()


# ------------------------------------------------------------------------------------------------------------
# 7. Config values that used to fail after the run directory was written
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override, named", [
    ("fp8.backend=scaled_mm", "fp8.backend"),
    ("fp8.margin=100000", "fp8.margin"),
    ("train.lr=1e39", "train.lr"),
    ("train.threads=100000", "train.threads"),
    ("run.name=" + "n" * 300, "run.name"),
    ("train.resume=-1", "train.resume"),
    ("train.resume=2", "train.resume"),
    ("train.resume=yes", "train.resume"),
])
def test_07_bad_values_fail_before_anything_is_written(root, tmp_path, capsys, override, named):
    if override == "fp8.backend=scaled_mm" and torch.cuda.is_available():
        pytest.skip("scaled_mm is valid where a CUDA GPU is visible")
    code, err = run_cli(capsys, "train", str(root / "tiny.yaml"), f"run.dir={tmp_path}", "run.name=bad",
                        override, "--quiet")
    assert code == 2 and len(err) == 1 and named in err[0], err
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------------
# 8. FP8 state in a checkpoint
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("buffer", ["input_scale", "weight_amax_history", "grad_output_scale_amax"])
@pytest.mark.parametrize("value", [math.nan, math.inf, 0.0, -1.0])
def test_08_bad_fp8_state_is_refused_at_load_naming_the_buffer(tmp_path, buffer, value):
    if value == 0.0 and not buffer.endswith("_scale"):
        pytest.skip("0 is a valid amax (an all-zero tensor)")
    model, optimizer = trained_model()
    getattr(model[2], buffer).view(-1)[0] = value
    path = save_checkpoint(tmp_path, 2, model, optimizer)  # a checkpoint that verifies: the manifest matches
    assert verify_checkpoint(path) is None
    fresh = tiny_model()[0]
    with pytest.raises(ValueError, match=f"checkpoint .*step_000002 cannot be loaded: FP8 scaling state 2.{buffer}"):
        load_checkpoint(path, fresh)


# ------------------------------------------------------------------------------------------------------------
# 9. Full disk, read-only, forbidden folder (real file systems: a small tmpfs; needs root to mount)
# ------------------------------------------------------------------------------------------------------------
def _cli_subprocess(*args: str, no_dac_override: bool = False) -> subprocess.CompletedProcess:
    """`fp8train ARGS` in a child; with `no_dac_override`, without the capabilities that let root write into
    folders it may not (so a 0555 folder refuses root as it refuses anyone)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "fp8train.cli", *args]
    if no_dac_override:
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _temp_files(directory: Path) -> list[str]:
    return [str(p) for p in directory.rglob("*") if ".tmp-" in p.name]


@pytest.mark.slow
def test_09_full_disk_during_a_checkpoint(root, small_fs):
    fs = small_fs("2800k")  # config, logs and the step-4 checkpoint fit (1.85 MB); step 8's does not
    done = _cli_subprocess("train", str(root / "tiny.yaml"), f"run.dir={fs}", "run.name=full", "--quiet")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "No space left on device" in err[0], done.stderr
    summary = json.loads((fs / "full" / "summary.json").read_text())
    assert summary["status"] == "failed" and "No space left" in summary["reason"]
    assert _temp_files(fs) == []
    assert [p.name for p in list_checkpoints(fs / "full" / "checkpoints")] == ["step_000004"]
    assert verify_checkpoint(fs / "full" / "checkpoints" / "step_000004") is None


@pytest.mark.slow
def test_09_read_only_and_forbidden(root, small_fs, tmp_path):
    fs = small_fs("8m")
    args = ["train", str(root / "tiny.yaml"), f"run.dir={fs}", "run.name=ro", "train.max_steps=4", "--quiet"]
    assert _cli_subprocess(*args).returncode == 0
    before = files_of(fs / "ro")
    subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
    # Extended to 6 steps, so the resume must write (a finished run resumed as it was changes nothing).
    done = _cli_subprocess(*args, "train.resume=true", "train.max_steps=6")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "Read-only file system" in err[0], done.stderr
    assert files_of(fs / "ro") == before
    forbidden = tmp_path / "forbidden"
    forbidden.mkdir(mode=0o555)
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is needed to run without root's permission override")
    done = _cli_subprocess("train", str(root / "tiny.yaml"), f"run.dir={forbidden}", "run.name=x", "--quiet",
                           no_dac_override=True)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and "Permission denied" in err[0], done.stderr
    assert list(forbidden.iterdir()) == []


# ------------------------------------------------------------------------------------------------------------
# 10. Symlinks in a run directory
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_10_symlinks_in_a_run_directory_are_refused(finished_run, tmp_path, capsys, root):
    outside = tmp_path / "precious.txt"
    outside.write_text("not fp8train's\n")
    run_dir = tmp_path / "runs" / "done"
    shutil.copytree(finished_run, run_dir)
    (run_dir / "telemetry.jsonl").unlink()
    (run_dir / "telemetry.jsonl").symlink_to(outside)
    code, err = run_cli(capsys, "train", str(root / "tiny.yaml"), f"run.dir={tmp_path / 'runs'}", "run.name=done",
                        "train.resume=true", "--quiet")
    assert code == 2 and len(err) == 1 and "symbolic link" in err[0] and "telemetry.jsonl" in err[0], err
    (run_dir / "telemetry.jsonl").unlink()
    (run_dir / "report.md").symlink_to(outside)
    code, err = run_cli(capsys, "report", str(run_dir))
    assert code == 2 and len(err) == 1 and "symbolic link" in err[0] and "report.md" in err[0], err
    assert outside.read_text() == "not fp8train's\n"


# ------------------------------------------------------------------------------------------------------------
# 13. Minor
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_13_nonfinite_values_are_strict_json_with_a_status(root, tmp_path):
    from fp8train.training.models.decoder import build_model

    def build_poisoned(model_cfg):  # from step 3 on, the first block's MLP outputs NaN
        model = build_model(model_cfg)
        calls = {"n": 0}

        def poison(module, args, output):
            if module.training:
                calls["n"] += 1
                return output * float("nan") if calls["n"] >= 3 else None
            return None

        model.layers[0].mlp.register_forward_hook(poison)
        return model

    summary = train(cfg_of(root, "nan", f"run.dir={tmp_path}", "train.skip_nonfinite_grads=false"),
                    show_progress=False, model_factory=build_poisoned)
    assert summary["status"] == "diverged"
    run_dir = tmp_path / "nan"
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [strict_json(line) for line in lines]
    assert records[-1]["step"] == 2 and records[0]["step"] == 0
    written = strict_json((run_dir / "summary.json").read_text())
    assert written["status"] == "diverged" and written["reason"] == "loss became nan at step 3"
    tele = written["divergence_telemetry"]
    assert any(role.get("nonfinite") for layer in tele.values() for role in layer.values())


def test_13_strict_jsonl_marks_what_became_null(tmp_path):
    from fp8train.training.storage.files import append_jsonl, read_jsonl, restore_nonfinite

    append_jsonl(tmp_path / "m.jsonl", [{"step": 1, "loss": math.nan, "grad_norm": -math.inf, "lr": 0.5}])
    line = (tmp_path / "m.jsonl").read_text().strip()
    assert strict_json(line) == {"step": 1, "loss": None, "grad_norm": None, "lr": 0.5,
                                 "nonfinite": {"loss": "nan", "grad_norm": "-inf"}}
    back = restore_nonfinite(read_jsonl(tmp_path / "m.jsonl")[0])
    assert math.isnan(back["loss"]) and back["grad_norm"] == -math.inf


@pytest.mark.slow
def test_13_export_never_overwrites_its_own_source_and_is_world_readable(tiny_fp8_run, tmp_path, capsys):
    run_dir = tmp_path / "tiny"
    shutil.copytree(tiny_fp8_run, run_dir)
    ckpt = list_checkpoints(run_dir / "checkpoints")[-1]
    source = ckpt / "model.safetensors"
    before = source.read_bytes()
    code, err = run_cli(capsys, "export", str(run_dir), "--format", "e4m3fn", "--out", str(source), "--force",
                        "--no-check")
    assert code == 2 and "inside the checkpoints" in err[-1], err
    assert source.read_bytes() == before and verify_checkpoint(ckpt) is None
    out = tmp_path / "model-fp8.safetensors"
    assert cli.main(["export", str(run_dir), "--format", "e4m3fn", "--out", str(out), "--no-check"]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(source.stat().st_mode) == 0o666 & ~umask  # checkpoints too (safetensors writes 0600)


def test_13_odd_sized_bin_names_data_path(root, tmp_path, capsys):
    corpus = tmp_path / "tokens.bin"
    corpus.write_bytes(b"\x01\x00" * 1000 + b"\x01")
    code, err = run_cli(capsys, "train", str(root / "tiny.yaml"), f"run.dir={tmp_path / 'runs'}",
                        f"data.path={corpus}", "--quiet")
    assert code == 2 and len(err) == 1 and "data.path" in err[0] and "2001 bytes" in err[0], err


def test_13_dev_zero_as_data_is_refused_at_once(root, tmp_path, capsys):
    started = time.monotonic()
    code, err = run_cli(capsys, "train", str(root / "tiny.yaml"), f"run.dir={tmp_path / 'runs'}",
                        "data.path=/dev/zero", "data.max_bytes=0", "--quiet")
    assert code == 2 and len(err) == 1 and "character device" in err[0], err
    assert time.monotonic() - started < 30
    assert not (tmp_path / "runs").exists()
