"""How runs end when they are told to, in real processes (fp8train.training.runs.lifetime):

- SIGTERM or SIGINT of `fp8train train` leaves summary.json with status "interrupted", the step and the signal,
  and the run resumes from its last checkpoint;
- `fp8train validate` with validate.workers=2, killed with SIGKILL or stopped with SIGTERM while both workers
  train: within seconds no process of it is left (workers, the resource tracker), and each run that was training
  says "interrupted" in its summary.json;
- a repeated signal (Linux sends a worker the parent-death signal again for each thread of its parent that ends)
  does not cut the writing of that summary short.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp8train.training.config import load_config
from fp8train.training.loop import train
from fp8train.training.runs.lifetime import Interrupted, interrupts_held, interrupts_raised
from refs import write_stdlib_corpus

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.batch_size=8",
        "train.eval_every=50", "train.eval_batches=2", "optim.warmup_steps=2", "policy.min_features=16",
        "log.wandb=disabled", "log.every=1", "log.telemetry_every=0", "data.max_bytes=300000", "train.threads=1",
        "train.max_steps=2000", "checkpoint.every=5", "checkpoint.keep_last=2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    write_stdlib_corpus(path)
    return path


@pytest.fixture(autouse=True)
def sigint_as_a_terminal_gives_it():
    """These tests are about SIGINT where it has its usual meaning. A shell that starts the suite in the
    background (`... &` in a script, nohup) starts every process with SIGINT ignored, which fp8train keeps (it
    installs its handler only over the default: tests/test_lifetime.py's last test): the tests here, and the
    processes they start (_start), get Python's default instead."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _sigint_default() -> None:  # in the child, before exec: Python then installs its KeyboardInterrupt handler
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(commands, *args) -> subprocess.Popen:
    # its own session: the test can find every process it starts (workers, resource tracker) by process group
    return subprocess.Popen(commands.fp8train(*args), env=commands.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=_sigint_default)


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(condition, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"exited early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting for the runs to start")
        time.sleep(0.2)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (an orphan's exit status waits for whoever adopted it)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2:].split()[0] != "Z"


def _alive_in_group(pgid: int) -> list[str]:
    """Processes of process group `pgid` that are not zombies: 'pid command' each."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # ended while we looked
            continue
        command, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(f"{stat.parent.name} {command}")
    return alive


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_of_train_writes_an_interrupted_summary_and_the_run_resumes(tmp_path, corpus, commands, signum):
    run = tmp_path / "r"
    proc = _start(commands, "train", str(RECIPES / "cpu_delayed.yaml"), "--quiet", *TINY, f"data.path={corpus}",
                  f"run.dir={tmp_path}", "run.name=r")
    try:
        _wait_for(lambda: _lines(run / "metrics.jsonl") >= 8, proc)
        proc.send_signal(signum)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()
    # the exit status a shell gives a process ended by the signal (128 + its number): 143 for SIGTERM, 130 for SIGINT
    assert proc.returncode == 128 + signum and f"interrupted by {signum.name}" in err, (proc.returncode, err)
    summary = json.loads((run / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["status"] == "interrupted" and 7 <= steps < 2000, summary
    assert f"interrupted by {signum.name} after step {steps}; continue with train.resume=true" in summary["reason"]
    checkpoint = int(summary["last_good_checkpoint"].rsplit("_", 1)[1])
    assert checkpoint <= steps and checkpoint % 5 == 0

    cfg = load_config(str(RECIPES / "cpu_delayed.yaml"), [*TINY, f"data.path={corpus}", f"run.dir={tmp_path}",
                                                          "run.name=r", "train.resume=true",
                                                          f"train.max_steps={checkpoint + 2}"])
    resumed = train(cfg, show_progress=False)
    assert resumed["status"] == "completed" and resumed["resumed_from"].endswith(f"step_{checkpoint:06d}")


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_validate_workers_end_with_validate(tmp_path, corpus, commands, signum):
    vdir = tmp_path / "val"
    proc = _start(commands, "validate", str(RECIPES / "cpu_validate.yaml"), "--quiet", *TINY, f"data.path={corpus}",
                  f"run.dir={tmp_path}", "run.name=val", "validate.workers=2", "validate.seeds=2",
                  "validate.candidates=[current]",
                  "validate.final_window=1", "validate.stop_on_divergence=false")
    runs = [vdir / "runs" / "bf16" / f"seed{seed}" for seed in (1337, 1338)]
    try:
        _wait_for(lambda: all(_lines(r / "metrics.jsonl") >= 3 for r in runs), proc)  # both workers training
        assert len(_alive_in_group(proc.pid)) >= 4  # validate, its resource tracker, two workers
        proc.send_signal(signum)
        proc.wait(timeout=60)
        assert proc.returncode == (-signal.SIGKILL if signum == signal.SIGKILL else 128 + signum)
        deadline = time.monotonic() + 20
        while _alive_in_group(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive_in_group(proc.pid), _alive_in_group(proc.pid)
    finally:
        if _alive_in_group(proc.pid):  # what a failing run left: never leave it to the rest of the suite
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read()  # what validate and its workers printed: the first thing to read when this fails
    for run in runs:
        assert (run / "summary.json").exists(), (f"{run} has no summary.json; its files: "
                                                 f"{sorted(p.name for p in run.iterdir())}; stderr:\n{err}")
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "interrupted" and "interrupted by SIGTERM" in summary["reason"], (summary, err)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_inside_interrupts_held_waits_for_the_block_to_end(signum):
    """What the loop's checkpoint relies on: the rest of the block runs, then Interrupted names the signal."""
    after_signal = []
    with pytest.raises(Interrupted) as raised:
        with interrupts_raised():
            with interrupts_held():
                with interrupts_held():  # nested: only the outermost block raises
                    os.kill(os.getpid(), signum)
                    time.sleep(0.05)  # the handler has run by now (main thread, between bytecodes)
                    after_signal.append("inner")
                after_signal.append("outer")
    assert after_signal == ["inner", "outer"] and raised.value.signum == signum
    with interrupts_raised():  # nothing left pending: the next block runs to its end
        with interrupts_held():
            after_signal.append("next")
    assert after_signal[-1] == "next"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_repeated_signal_does_not_cut_the_interrupt_handling_short(signum):
    """The summary is written in the handler of the first Interrupted; a repeat of the signal while it is written
    is dropped, inside the block and after it (where the worker's os._exit is on its way), until a new block."""
    handled = []
    with pytest.raises(Interrupted) as raised:
        with interrupts_raised():
            try:
                os.kill(os.getpid(), signum)
                time.sleep(0.05)
            except Interrupted:
                os.kill(os.getpid(), signal.SIGTERM)  # repeats, of either kind
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)
                handled.append("summary written")
                raise
    assert handled == ["summary written"] and raised.value.signum == signum
    with pytest.raises(Interrupted):  # the same after a signal held back by interrupts_held
        with interrupts_raised():
            try:
                with interrupts_held():
                    os.kill(os.getpid(), signum)
                    time.sleep(0.05)
            except Interrupted:
                os.kill(os.getpid(), signum)
                time.sleep(0.05)
                handled.append("summary written after a checkpoint")
                raise
    assert handled[-1] == "summary written after a checkpoint"
    with pytest.raises(Interrupted):  # a new block: its first signal is raised again
        with interrupts_raised():
            os.kill(os.getpid(), signum)
            time.sleep(0.05)


# A worker whose summary takes a second to write, and a parent that starts it from a thread which then ends, and
# kills itself with SIGKILL 0.3 s later: Linux sends the parent-death signal when the thread the worker is a child
# of ends (the worker passes to the parent's main thread) and again when the parent dies.
_WORKER = """
import os, signal, sys, time
from pathlib import Path
from fp8train.training.runs.lifetime import Interrupted, die_with_parent, interrupts_raised
parent, out = int(sys.argv[1]), Path(sys.argv[2])
die_with_parent(parent)
try:
    with interrupts_raised():
        try:
            (out / "ready").touch()
            while True:
                time.sleep(0.01)
        except Interrupted as err:
            time.sleep(1.0)
            (out / "summary").write_text(signal.Signals(err.signum).name)
            raise
except Interrupted as err:
    os._exit(128 + err.signum)
"""
_PARENT = """
import os, signal, subprocess, sys, threading, time
from pathlib import Path
out = Path(sys.argv[1])
def start_worker():
    worker = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(os.getpid()), str(out)])
    print(worker.pid, flush=True)
    while not (out / "ready").exists():
        time.sleep(0.01)
thread = threading.Thread(target=start_worker)
thread.start()
thread.join()
time.sleep(0.3)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_worker_told_twice_by_its_dying_parent_still_writes_its_summary(tmp_path, commands):
    parent = subprocess.run([sys.executable, "-c", _PARENT, str(tmp_path), _WORKER], env=commands.env(),
                            capture_output=True, text=True, timeout=120)
    assert parent.returncode == -signal.SIGKILL, parent.stderr
    worker_pid = int(parent.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _running(worker_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(worker_pid), "the worker outlived its parent"
    assert (tmp_path / "summary").read_text() == "SIGTERM"


def test_an_ignored_sigint_stays_ignored():
    """A process started with SIGINT ignored (nohup, a background job of a script) keeps ignoring it inside a
    run's block: fp8train takes over only the default handlers; SIGTERM still ends the block."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with interrupts_raised():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    with pytest.raises(Interrupted) as raised:
        with interrupts_raised():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert raised.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
