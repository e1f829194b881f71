"""What an accelerate or Hugging Face user sees on the console, for real (real `accelerate launch` processes, real
CLI processes on a pipe and on a pseudo-terminal, real transformers models):

- a launch that asked for several processes and started one (`--cpu --num_processes 2`, a MULTI_CPU config
  without mpirun) says so in one line, and the run records world_size 1;
- `accelerate launch --mixed_precision fp8` on a machine without TransformerEngine / torchao dies in accelerate's
  launcher, before any fp8train code runs: docs/distributed.md quotes its exact error;
- a tokenizer larger than an HF model's vocabulary is refused naming keys that apply to HF models;
- output that is not a terminal gets one loss line per logged step; a terminal keeps the progress bar;
- every module compiles with warnings as errors (no invalid escape in a docstring: SyntaxWarning on 3.12+);
- a report of an HF run explains the `hf.` in front of its layer names, once.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import warnings
from pathlib import Path

import pytest
import yaml

import fp8train
from fp8train.evidence.report import write_run_report
from fp8train.training.config import load_config
from fp8train.training.loop import train
from hf_helpers import hf_config, make_pretrained, make_tokenizer

pytestmark = [pytest.mark.usefixtures("single_thread")]

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train.py"
ONE_PROCESS = "fp8train: accelerate launch asked for several processes but started 1"
SECTIONS = dict(model={"n_layers": 1, "seq_len": 16},
                train={"max_steps": 4, "batch_size": 4, "eval_every": 4, "eval_batches": 1, "autocast": "none",
                       "threads": 1},
                optim={"warmup_steps": 1}, log={"telemetry_every": 0, "every": 2},
                checkpoint={"every": 0, "save_final": False})
MULTI_CPU_CONFIG = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_CPU", "num_machines": 1,
                    "num_processes": 2, "machine_rank": 0, "mixed_precision": "no", "use_cpu": True}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny) -> Path:
    root = tmp_path_factory.mktemp("console")
    tiny.write(root, **SECTIONS)
    (root / "multi_cpu.yaml").write_text(yaml.safe_dump(MULTI_CPU_CONFIG))
    return root


# ------------------------------------------------------------------------------------------------------------
# accelerate launch
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("how", ["--cpu", "MULTI_CPU config"])
def test_a_launch_that_asked_for_2_processes_and_started_1_says_so(workdir, commands, how):
    name = "cpu" if how == "--cpu" else "multi_cpu"
    accelerate_args = (["--cpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                        "--dynamo_backend", "no"] if how == "--cpu"
                       else ["--config_file", str(workdir / "multi_cpu.yaml")])
    proc = commands.run([sys.executable, "-m", "accelerate.commands.launch", *accelerate_args, str(SCRIPT),
                         "--config", str(workdir / "tiny.yaml"), f"run.name={name}", "log.wandb=disabled", "--quiet"],
                        env=commands.launch_env(workdir / "hf"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith(ONE_PROCESS)]
    assert len(said) == 1 and "--multi_gpu --num_processes N" in said[0], proc.stderr[-3000:]
    summary = json.loads((workdir / "runs" / name / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["status"] == "completed"


def test_plain_runs_and_real_multi_process_launches_say_nothing():
    from fp8train.training.parallel.distributed import process_count_note

    assert process_count_note(1, {}) is None  # python scripts/train.py, no launcher
    # accelerate launch with one process asked for: no MASTER_ADDR
    assert process_count_note(1, {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "True"}) is None
    # torchrun / accelerate --multi_gpu: WORLD_SIZE is set, and the process count is what was asked for
    launched = {"ACCELERATE_MIXED_PRECISION": "no", "MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": "2"}
    assert process_count_note(2, launched) is None


def _accelerate_fp8_available() -> bool:
    from accelerate.utils import is_fp8_available

    return is_fp8_available()


@pytest.mark.slow
@pytest.mark.skipif(_accelerate_fp8_available(), reason="accelerate has an FP8 backend here (TE/torchao): its "
                    "launcher goes on and fp8train refuses (test_launch.py)")
def test_accelerate_fp8_mixed_precision_error_is_quoted_in_the_docs(workdir, commands):
    proc = commands.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                         "--mixed_precision", "fp8", str(SCRIPT), "--config", str(workdir / "tiny.yaml"),
                         "run.name=mp_fp8"], env=commands.launch_env(workdir / "hf"))
    assert proc.returncode != 0 and not (workdir / "runs" / "mp_fp8").exists()
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: FP8 is not available"), proc.stderr[-2000:]
    doc = " ".join((REPO / "docs" / "distributed.md").read_text().split())
    assert last in doc  # the exact line, as accelerate prints it


# ------------------------------------------------------------------------------------------------------------
# Hugging Face vocabulary
# ------------------------------------------------------------------------------------------------------------
def test_a_tokenizer_larger_than_the_hf_vocabulary_names_keys_that_apply(tmp_path, commands, capsys):
    model_dir = make_pretrained(tmp_path / "llama", "llama", steps=1)  # vocab_size 320
    tokenizer = make_tokenizer(tmp_path / "tok", vocab_size=400)
    (tmp_path / "empty.yaml").write_text("{}\n")
    code, _, err = commands.main(["train", "--quiet", str(tmp_path / "empty.yaml"), f"model.hf_path={model_dir}",
                                  "model.seq_len=16", f"data.tokenizer={tokenizer}", f"run.dir={tmp_path / 'runs'}", "run.name=v",
                                  "log.wandb=disabled", "train.max_steps=1", "data.max_bytes=50000"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "400 token ids" in lines[0] and "320 rows" in lines[0]
    assert "data.tokenizer" in lines[0] and "model.hf_config" in lines[0] and "model.vocab_size" not in lines[0]
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------------------------
# Progress: lines on a pipe, a bar that stays on a terminal
# ------------------------------------------------------------------------------------------------------------
def test_output_that_is_not_a_terminal_gets_a_loss_line_every_log_every_steps(workdir, commands):
    proc = commands.run(commands.fp8train("train", str(workdir / "tiny.yaml"), "run.name=piped",
                                          "log.wandb=disabled"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "\r" not in proc.stderr  # no progress bar redrawn into a log file
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[piped] step ")]
    assert [line.split(":")[0] for line in lines] == ["[piped] step 2/4", "[piped] step 4/4"], proc.stderr
    metrics = [json.loads(line) for line in (workdir / "runs" / "piped" / "metrics.jsonl").read_text().splitlines()]
    logged = {r["step"]: r for r in metrics if "loss" in r}
    for line in lines:
        step = int(re.search(r"step (\d+)/", line).group(1))
        assert f"loss {logged[step]['loss']:.4f}" in line  # the number metrics.jsonl holds for that step
    assert f"val_loss {logged[4]['val_loss']:.4f}" in lines[1]


def _screen(raw: str) -> list[str]:
    """What a terminal shows after `raw`: carriage returns rewrite the line, escape sequences are dropped."""
    lines, line, col = [], [], 0
    for ch in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw):
        if ch == "\n":
            lines.append("".join(line))
            line, col = [], 0
        elif ch == "\r":
            col = 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    return lines + ["".join(line)]


def test_a_terminal_keeps_the_progress_bar(workdir, commands):
    main_fd, terminal_fd = pty.openpty()
    fcntl.ioctl(terminal_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100; a new pty is 0 x 0
    proc = subprocess.Popen(commands.fp8train("train", str(workdir / "tiny.yaml"), "run.name=tty",
                                              "log.wandb=disabled"),
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=terminal_fd,
                            env=commands.env())
    os.close(terminal_fd)
    raw = b""
    while True:
        try:
            chunk = os.read(main_fd, 4096)
        except OSError:  # the other end closed
            break
        if not chunk:
            break
        raw += chunk
    os.close(main_fd)
    assert proc.wait(timeout=120) == 0, raw[-3000:]
    screen = _screen(raw.decode(errors="replace").replace("\r\n", "\n"))
    assert any(line.startswith("tty: 100%") and "4/4" in line for line in screen), screen
    assert not any(line.startswith("[tty] step ") for line in screen)  # the bar, not the lines


# ------------------------------------------------------------------------------------------------------------
# Source and report hygiene
# ------------------------------------------------------------------------------------------------------------
def test_every_module_compiles_with_warnings_as_errors():
    sources = sorted(Path(fp8train.__file__).parent.rglob("*.py")) + sorted((REPO / "scripts").glob("*.py"))
    failed = []
    for path in sources:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # an invalid escape: DeprecationWarning on 3.11, SyntaxWarning on 3.12+
            try:
                compile(path.read_text(), str(path), "exec")
            except SyntaxError as err:
                failed.append(f"{path}: {err}")
    assert not failed and len(sources) > 50, failed


def test_an_hf_run_report_explains_the_wrapper_prefix_once(tmp_path, tiny):
    hf_config("llama").save_pretrained(str(tmp_path / "cfg"))
    sections = tiny.config(tmp_path, train={"max_steps": 2, "eval_every": 2, "eval_batches": 1, "autocast": "none"},
                           log={"every": 1, "telemetry_every": 1, "wandb": "disabled"}, checkpoint={"every": 0})
    sections["model"] = {"hf_config": str(tmp_path / "cfg"), "seq_len": 16}
    sections["data"]["tokenizer"] = "bytes"
    (tmp_path / "hf.yaml").write_text(yaml.safe_dump(sections))
    assert train(load_config(str(tmp_path / "hf.yaml")), show_progress=False)["status"] == "completed"
    write_run_report(tmp_path / "runs" / "tiny")
    report = (tmp_path / "runs" / "tiny" / "report.md").read_text()
    assert report.count("`hf.` followed by transformers' own name") == 1, report
