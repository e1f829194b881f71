"""One command at a time writes an output (storage/outputs.claim_output_path): two exports, kv-evals or reports to
the same path at once never both succeed (the second would write over the first, or under its check); the second
is refused in one line naming the path and the PID that holds it, and the claim of a killed process is taken over
with a message. The holders here are real processes (a second fp8train, or a process that claims and waits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from fp8train.training.storage.outputs import CLAIM_SUFFIX

pytestmark = pytest.mark.slow

HOLD = ("import sys\nfrom fp8train.training.storage.outputs import claim_output_path\n"
        "with claim_output_path(sys.argv[1]):\n    print('held', flush=True)\n    sys.stdin.readline()\n")
# as `fp8train report` (and validate's own report) claims the folder it writes into: inside it
HOLD_REPORT = ("import sys\nfrom fp8train.training.storage.claims import claim_folder\n"
               "with claim_folder(sys.argv[1], 'report', ''):\n    print('held', flush=True)\n"
               "    sys.stdin.readline()\n")


def _holder(commands, path: Path, script: str = HOLD) -> subprocess.Popen:
    """A process that claims `path` and holds it until its stdin closes (or it is killed)."""
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=commands.env())
    assert proc.stdout.readline().strip() == "held"
    return proc


def _release(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def _claim_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(CLAIM_SUFFIX))


def _weight_dtypes(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def test_two_exports_to_one_new_folder_at_once_one_is_refused_and_the_folder_is_the_others(
        tiny_fp8_run, tmp_path, commands):
    out = tmp_path / "model"
    argv = {"fp8": commands.fp8train("export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(out)),
            "dense": commands.fp8train("export", str(tiny_fp8_run), "--format", "hf", "--dtype", "float32",
                                       "--out", str(out))}
    procs = {k: subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=commands.env())
             for k, a in argv.items()}
    done = {k: (p.wait(timeout=120), *p.communicate()) for k, p in procs.items()}
    winners = [k for k, (rc, _, _) in done.items() if rc == 0]
    assert len(winners) == 1, done  # before the claim: both exited 0, one folder written over the other
    loser = next(k for k in done if k != winners[0])
    rc, _, err = done[loser]
    assert rc == 2 and err.count("\n") == 1, done[loser]
    # refused while the other held the path, or (if it had finished first) because the folder is there now
    assert f"export --out {out} is in use by another fp8train process (PID " in err or "already exists" in err, err
    # the folder is wholly the winner's: FP8 weights with their compressed-tensors config, or fp32 dense weights
    config = json.loads((out / "config.json").read_text())
    if winners[0] == "fp8":
        assert "quantization_config" in config and "F8_E4M3" in _weight_dtypes(out)
    else:
        assert "quantization_config" not in config and _weight_dtypes(out) == {"F32"}
    assert _claim_files(tmp_path) == []


def test_an_export_to_a_path_another_process_holds_is_refused_naming_it_and_writes_nothing(
        tiny_fp8_run, tmp_path, commands):
    out = tmp_path / "new" / "model"
    holder = _holder(commands, out)
    try:
        done = commands.run(commands.fp8train("export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(out)),
                            timeout=120)
    finally:
        _release(holder)
    assert done.returncode == 2, done.stderr
    assert f"export --out {out} is in use by another fp8train process (PID {holder.pid} " in done.stderr
    assert not out.exists()
    assert not (tmp_path / "new").exists()  # the holder made the parent for its claim; removed with it


def test_the_claim_of_a_killed_export_is_taken_over_with_a_message(tiny_fp8_run, tmp_path, commands):
    out = tmp_path / "model.safetensors"
    holder = _holder(commands, out)
    holder.kill()  # kill -9: its claim file stays, with its PID, but the kernel dropped the lock
    holder.wait(timeout=30)
    assert _claim_files(tmp_path) == [f".model.safetensors{CLAIM_SUFFIX}"]
    done = commands.run(commands.fp8train("export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(out),
                                          "--no-check"), timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"took over the lock of PID {holder.pid}, which is no longer running" in done.stderr
    assert out.is_file() and _claim_files(tmp_path) == []


def test_kv_eval_into_a_folder_another_process_holds_is_refused(tiny_fp8_run, tmp_path, commands, capsys):
    out = tmp_path / "kv"
    holder = _holder(commands, out)
    try:
        code, _, err = commands.main(["kv-eval", str(tiny_fp8_run), "--out", str(out), "--format", "e4m3fn",
                                      "--batches", "1", "--calib-batches", "1", "--gen-prompts", "0"], capsys)
    finally:
        _release(holder)
    assert code == 2 and f"kv-eval --out {out} is in use by another fp8train process (PID {holder.pid} " in err
    assert not out.exists()


def test_a_report_of_a_folder_another_process_reports_is_refused_and_leaves_its_files(tiny_fp8_run, tmp_path,
                                                                                       commands, capsys):
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):
        (run / name).write_bytes((tiny_fp8_run / name).read_bytes())
    holder = _holder(commands, run, HOLD_REPORT)
    try:
        code, _, err = commands.main(["report", str(run)], capsys)
        listed = sorted(p.name for p in run.iterdir())
    finally:
        _release(holder)
    assert code == 2 and f"report of {run} is in use by another fp8train process (PID {holder.pid} " in err
    # the holder's claim (inside the folder: its parent need not be writable), and nothing of the refused report
    assert listed == [f".report{CLAIM_SUFFIX}", "config.yaml", "metrics.jsonl", "summary.json"]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl", "summary.json"]
    code, _, _ = commands.main(["report", str(run)], capsys)  # once it is free, the same command writes it
    assert code == 0 and (run / "report.md").is_file() and _claim_files(tmp_path) == _claim_files(run) == []



def test_validate_waits_for_a_report_of_its_folder_then_writes_its_own(tiny, tmp_path, commands):
    """A `fp8train report` of a validation's folder still writing when the validation ends: the validation waits
    for it (bounded) and then writes its final report, instead of failing after all its runs."""
    import threading

    from fp8train.evidence.validate import run_validation
    from fp8train.training.config import load_config
    from test_fork import TINY

    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=val", f"data.path={tiny.corpus}", *TINY,
                             "train.max_steps=2", "train.eval_every=2", "validate.final_window=1",
                             "validate.margin=0.05", "validate.workers=1", "validate.seeds=2",
                             "validate.candidates=[current]"])
    said, held = [], []

    def log(line: str) -> None:
        said.append(line)
        if line.startswith(f"[validate] {tmp_path / 'val'}: ") and not held:  # planned: a report claims the folder
            held.append(_holder(commands, tmp_path / "val", HOLD_REPORT))  # held while the runs train
        if "current/seed1338: completed" in line:  # released 2 s after the last run
            threading.Timer(2.0, held[0].stdin.close).start()

    try:
        summary = run_validation(cfg, log=log, show_progress=False)
    finally:
        for holder in held:
            if not holder.stdin.closed:
                holder.stdin.close()
            assert holder.wait(timeout=30) == 0
    assert len(held) == 1
    assert summary["verdict"] in ("pass", "fail", "inconclusive")
    assert json.loads((tmp_path / "val" / "summary.json").read_text())["verdict"] == summary["verdict"]
    assert (tmp_path / "val" / "report.md").is_file()
    assert _claim_files(tmp_path) == _claim_files(tmp_path / "val") == []


def test_layer_recipes_to_a_file_another_process_holds_is_refused(tiny_fp8_run, tmp_path, commands, capsys):
    out = tmp_path / "plan.yaml"
    holder = _holder(commands, out)
    try:
        code, _, err = commands.main(["layer-recipes", str(tiny_fp8_run), "--out", str(out), "--repeats", "1"], capsys)
    finally:
        _release(holder)
    assert code == 2 and f"layer-recipes --out {out} is in use by another fp8train process (PID {holder.pid} " in err
    assert not out.exists()


def test_a_claim_file_that_cannot_be_made_is_named(tiny_fp8_run, tmp_path, commands, capsys):
    blocker = tmp_path / f".model{CLAIM_SUFFIX}"
    blocker.mkdir()  # a folder where the claim file goes
    code, _, err = commands.main(["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out",
                                  str(tmp_path / "model"), "--no-check"], capsys)
    assert code == 2 and err.count("\n") == 1 and f"cannot write {blocker}: Is a directory" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == [blocker.name]


def test_a_pool_worker_killed_from_outside_stops_the_validation_in_one_line(tiny, tmp_path):
    """kill -9 of a validate worker (what the OOM killer does): one line naming the run, not an internal error."""
    import multiprocessing
    import signal

    from fp8train.evidence.validate import run_validation
    from fp8train.training.config import load_config
    from test_fork import TINY

    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=val", f"data.path={tiny.corpus}", *TINY,
                             "train.max_steps=100000", "train.eval_every=1000", "validate.final_window=1",
                             "validate.workers=2", "validate.seeds=2", "validate.candidates=[current]"])
    killed, submitted, workers_at_first_run = [], [], []

    def log(line: str) -> None:  # both baselines training: kill one worker of the pool (this process's children)
        submitted.append(line)
        if ": running" in line and not workers_at_first_run:
            workers_at_first_run.append(len([p for p in multiprocessing.active_children() if p.pid not in before]))
        if sum(": running" in said for said in submitted) == 2 and not killed:
            deadline = time.monotonic() + 120
            while not all((tmp_path / f"val/runs/bf16/seed{seed}/metrics.jsonl").exists() for seed in (1337, 1338)):
                assert time.monotonic() < deadline, submitted
                time.sleep(0.1)
            # the pool's workers: children started since the validation began (not another test's helper
            # process still alive in this pytest worker: killing that one let the validation train on for 100000
            # steps, the suite waiting on it)
            workers = [p for p in multiprocessing.active_children() if p.pid not in before]
            os.kill(workers[0].pid, signal.SIGKILL)
            killed.append(workers[0].pid)

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match=r"^validation stopped: a worker process ended abruptly while "
                                         r"(bf16|current)/seed133[78] was running \(killed"):
        run_validation(cfg, log=log, show_progress=False)
    assert killed
    # both workers were started before the first run: a worker the pool started later, inside its second submit,
    # could be left out of what the pool watches, and its kill went unseen while the other trained on (a suite
    # waited 10 minutes on this test)
    assert workers_at_first_run == [2], workers_at_first_run
    # no worker trains on (its run: 100000 steps) once the validation has stopped: each was ended, and the run
    # folders it had say interrupted (a worker left going held its run's lock and this test process for minutes)
    deadline = time.monotonic() + 60
    while [p for p in multiprocessing.active_children() if p.pid not in before]:
        assert time.monotonic() < deadline, multiprocessing.active_children()
        time.sleep(0.2)
    for summary in tmp_path.glob("val/runs/*/seed*/summary.json"):
        assert json.loads(summary.read_text())["status"] == "interrupted", summary


def test_kv_eval_of_a_missing_run_says_so_and_makes_no_folder_for_its_claim(tmp_path, commands, capsys):
    missing = tmp_path / "no_such_run"
    code, _, err = commands.main(["kv-eval", str(missing), "--format", "e4m3fn"], capsys)
    assert code == 2 and f"run directory {str(missing)!r} does not exist" in err, err
    assert list(tmp_path.iterdir()) == []


def _export_in_this_process(run: Path, out: Path, commands, capsys) -> None:
    """The folder a test starts from: `fp8train export RUN --format e4m3fn --out OUT` run in this process (the
    seconds of a new process's imports go to the second processes the tests are about)."""
    code, _, err = commands.main(["export", str(run), "--format", "e4m3fn", "--out", str(out), "--no-check"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("holder_state", ["live", "killed"])
def test_export_force_over_a_folder_kv_eval_writes_in_names_the_holder_or_takes_a_dead_ones_claim(
        tiny_fp8_run, tmp_path, commands, capsys, holder_state):
    out = tmp_path / "o4"
    _export_in_this_process(tiny_fp8_run, out, commands, capsys)
    export = commands.fp8train("export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(out), "--no-check")
    holder = _holder(commands, out / "kv_eval")  # `kv-eval o4` claims o4/kv_eval: its claim file is in o4
    if holder_state == "killed":
        holder.kill()
        holder.wait(timeout=30)
    try:
        done = commands.run([*export, "--force"], timeout=120)
    finally:
        if holder_state == "live":
            _release(holder)
    if holder_state == "live":
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
        assert f"--out {out} is in use by another fp8train process (PID {holder.pid} " in done.stderr
        assert "writing kv_eval there" in done.stderr and "did not write" not in done.stderr
    else:  # a dead holder's claim is stale: fp8train's own file, replaced with the folder
        assert done.returncode == 0, done.stderr
        assert _claim_files(out) == [] and "F8_E4M3" in _weight_dtypes(out)


def test_kv_eval_into_a_folder_that_an_export_force_is_replacing_is_refused(tiny_fp8_run, tmp_path, commands,
                                                                            capsys):
    """`export --force --out o5` holds o5's claim from its check to its last file; a `kv-eval o5` (a real second
    process) started meanwhile would claim o5/kv_eval inside the folder about to be replaced, and lose its report
    with it (or the export would delete a folder in use): it is refused, naming the export's PID."""
    from fp8train.training.storage.outputs import claim_output_path

    out = tmp_path / "o5"
    _export_in_this_process(tiny_fp8_run, out, commands, capsys)
    before = sorted(p.name for p in out.iterdir())
    with claim_output_path(out, "export --out"):  # as `export --force --out o5` holds it while it works
        done = commands.run(commands.fp8train("kv-eval", str(out), "--format", "e4m3fn", "--batches", "1",
                                              "--calib-batches", "1", "--gen-prompts", "0"), timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert (f"kv-eval --out {out / 'kv_eval'} is in use by another fp8train process (PID {os.getpid()} "
            in done.stderr and f"writing {out}, which holds it)" in done.stderr), done.stderr
    assert sorted(p.name for p in out.iterdir()) == before  # no kv_eval/, no claim left in it
    assert _claim_files(tmp_path) == []


def test_an_output_claimed_in_a_folder_after_its_check_stops_the_replacement_naming_the_holder(
        tiny_fp8_run, tmp_path, commands, capsys):
    """The folder passed `export --force`'s check; then another process (real) claimed an output inside it: the
    replacement leaves the folder whole, the claim in it, and names that process (it used to say the folder had
    become 'not fp8train's output folder')."""
    from fp8train.training.storage.outputs import check_output_folder, replace_output_folder
    from fp8train.training.storage.rundir import LockBusy

    out = tmp_path / "o6"
    _export_in_this_process(tiny_fp8_run, out, commands, capsys)
    check_output_folder(out, force=True)
    contents = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    holder = _holder(commands, out / "kv_eval")  # what `kv-eval o6` holds while it evaluates
    try:
        with pytest.raises(LockBusy) as refused:
            replace_output_folder(out, "export", lambda folder: (folder / "model.safetensors").write_bytes(b"new"))
        assert _claim_files(out) == [f".kv_eval{CLAIM_SUFFIX}"]  # still there, still its
    finally:
        _release(holder)
    assert str(refused.value).startswith(f"export --out {out} is in use by another fp8train process (PID "
                                         f"{holder.pid} ")
    assert "writing kv_eval there" in str(refused.value)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == contents
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o6"]  # no temp folder beside it
