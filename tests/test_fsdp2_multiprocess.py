"""train.parallel=fsdp2 in REAL processes: `accelerate launch --multi_gpu --num_processes 2` on a machine without
GPUs starts two gloo CPU processes, exactly what a user gets; every run goes through fp8train's own `train()`.

Launches (each costs seconds of imports, so one harness runs several trainings per launch):
- before: one process, fsdp2 on a one-rank group (no launcher), grad_accum 2: 30 steps with checkpoints every
  10 (for 1 -> 2); one rank accumulating 2 micro-batches computes on the same micro-batches as 2 ranks x 1;
- main launch, 2 processes: DDP and FSDP2 with grad_accum 1 and 2 (30 steps), FSDP2 with fp8.all_gather,
  FSDP2 resumed from its own step-10 checkpoint (same world size), and the 1-process run resumed from step 10
  with 2 processes (1 -> 2); every MAX all-reduce is recorded;
- after: the 2-process FSDP2 run resumed from step 10 in one process with grad_accum 2 (2 -> 1), in this process;
- two launches with --num_machines 2 and machine ranks 0 and 1 (main process on 127.0.0.1): the same run;
- a launch whose rank 1 is killed with SIGKILL inside its second checkpoint save.

What is proven, and the tolerances (FP8 rounding turns one-ulp weight differences into visibly different runs
within tens of steps, so these hold only because the computations are the same up to exact operations: the
two-rank gradient average, power-of-two grad_output scales, a float64 gradient norm):
- FSDP2 losses, val_losses and grad norms equal DDP's bit for bit over 30 steps without gradient accumulation;
  with grad_accum 2 to 1e-5 over the first 10 steps and 1e-3 over 30 (the 1e-5-for-30-steps target is missed
  there: see the test); fp8.all_gather equals FSDP2 without it bit for bit;
- every rank holds bit-identical FP8 state (the loop's SHA-256 check raises otherwise; the run would fail);
- the delayed amaxes go through exactly one all-reduce MAX per optimizer step (3 roles x 14 layers in one);
- resume: same world size bit for bit on CPU; 2 -> 1 and 1 -> 2 within 1e-5 over the 20 steps after the resume;
- the simulated 2-machine launch logs exactly what the single-machine 2-process launch logs;
- kill -9 of one rank during a save leaves the previous checkpoint whole and loadable, the new one never visible.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from fp8train.bench.distributed_section import MODEL_SHAPES, bench_distributed, format_distributed
from fp8train.training.config import load_config
from fp8train.training.loop import train
from fp8train.training.runs.sharded_checkpoint import latest_loadable_checkpoint, read_model_state
from conftest import Commands
from refs import write_stdlib_corpus

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]
# The launches below (a minute of real 2-process runs on 2 cores) run with CI's extended tests (`pytest -m
# extended`), out of README's 10-minute command. That command keeps the bench's test at the end of this file: two
# real gloo processes under DDP, FSDP2 and FSDP2 with fp8.all_gather, their losses equal; tests/test_fsdp2.py and
# tests/test_fsdp2_cli.py check FSDP2 on a one-rank group, the CLI and sharded checkpoints.
EXTENDED = pytest.mark.extended

STEPS, RESUME_AT, RTOL = 30, 10, 1e-5
TINY = {
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 32},
    "train": {"max_steps": STEPS, "batch_size": 8, "eval_every": 10, "eval_batches": 2, "lr": 3e-3,
              "device": "cpu", "threads": 1},
    "optim": {"warmup_steps": 5},
    "fp8": {"recipe": "delayed"},
    "policy": {"min_features": 16},
    "log": {"wandb": "disabled", "every": 1, "telemetry_every": 0},
    "checkpoint": {"every": RESUME_AT, "keep_last": 0, "save_final": True},
}
FSDP2 = ["train.parallel=fsdp2"]

HARNESS = r'''
import json, os, shutil, sys, time
import torch.distributed as dist
import fp8train.training.runs.sharded_checkpoint as sharded
from fp8train.training.config import load_config
from fp8train.training.loop import train

out, cfg_path, job = sys.argv[1], sys.argv[2], sys.argv[3]
real_all_reduce = dist.all_reduce
max_reduces = []


def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
    if op == dist.ReduceOp.MAX:
        max_reduces.append(tensor.numel())
    return real_all_reduce(tensor, op, *args, **kwargs)


def run(name, *overrides):
    max_reduces.clear()
    summary = train(load_config(cfg_path, [f"run.name={name}", *overrides]), show_progress=False)
    if dist.get_rank() == 0:
        with open(f"{out}/{name}.json", "w") as f:
            json.dump({"summary": summary, "max_reduces": list(max_reduces)}, f, default=str)


def trimmed_copy(src, dst, step):
    """A copy of run `src` as it was right after checkpoint `step` (later checkpoints and summary dropped)."""
    if dist.get_rank() == 0:
        shutil.copytree(src, dst)
        for ckpt in (dst / "checkpoints").glob("step_*"):
            if int(ckpt.name[5:]) > step:
                shutil.rmtree(ckpt)
        (dst / "summary.json").unlink()
    dist.barrier()


runs = load_config(cfg_path).run.dir
from pathlib import Path
runs = Path(runs)
if job == "main":
    dist.all_reduce = recording_all_reduce
    run("ddp_a1")
    run("fsdp_a1", "train.parallel=fsdp2")
    run("ddp_a2", "train.grad_accum=2")
    run("fsdp_a2", "train.parallel=fsdp2", "train.grad_accum=2")
    run("fsdp_ag", "train.parallel=fsdp2", "fp8.all_gather=true")
    trimmed_copy(runs / "fsdp_a1", runs / "fsdp_resume_same", int(sys.argv[4]))
    run("fsdp_resume_same", "train.parallel=fsdp2", "train.resume=true")
    run("fsdp_1to2", "train.parallel=fsdp2", "train.resume=true")
elif job == "node":
    run("fsdp_nodes", "train.parallel=fsdp2")
elif job == "kill":
    real_save, saves = sharded.dcp.save, []

    def pausing_save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2 and dist.get_rank() == 1:  # inside the second save: the test kills us here
            with open(f"{out}/in_save", "w") as f:
                f.write(str(os.getpid()))
            time.sleep(120)
        return real_save(*args, **kwargs)

    sharded.dcp.save = pausing_save
    run("fsdp_kill", "train.parallel=fsdp2")
'''


def _free_port() -> int:
    # Only for the two-"machine" launch: two launchers must be told one port in advance. The one-machine launches
    # take theirs from torch's own store (conftest's launch_env), with no probe-and-release race.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(root: Path, job: str, *extra: str, machines: tuple[int, int] = (1, 0), port: int | None = None):
    num_machines, machine_rank = machines
    rendezvous = [] if port is None else ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", str(num_machines), "--machine_rank", str(machine_rank), *rendezvous,
           "--mixed_precision", "no", "--dynamo_backend", "no",
           str(root / "harness.py"), str(root / "out"), str(root / "tiny.yaml"), job, *extra]
    env = Commands.env(HF_HOME=str(root / "hf")) if port is not None else Commands.launch_env(root / "hf")
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 600) -> None:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, Commands.launch_failure(proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, single_thread):
    root = tmp_path_factory.mktemp("fsdp2")
    write_stdlib_corpus(root / "corpus.txt")
    config = {**TINY, "run": {"dir": str(root / "runs"), "name": "x"}, "data": {"path": str(root / "corpus.txt")}}
    (root / "tiny.yaml").write_text(yaml.safe_dump(config))
    (root / "harness.py").write_text(HARNESS)
    (root / "out").mkdir()
    cfg = lambda *o: load_config(str(root / "tiny.yaml"), list(o))  # noqa: E731

    # One process, fsdp2 on its own one-rank group: the 1 -> 2 source, trimmed to its step-10 checkpoint. It
    # accumulates 2 micro-batches, so it computes on the same micro-batches as 2 ranks x 1.
    train(cfg("run.name=fsdp_single", *FSDP2, "train.grad_accum=2"), show_progress=False)
    _trim(root / "runs" / "fsdp_single", root / "runs" / "fsdp_1to2")
    _finish(_launch(root, "main", str(RESUME_AT)))
    # 2 -> 1: the 2-process FSDP2 run, resumed from step 10 in this one process.
    _trim(root / "runs" / "fsdp_a1", root / "runs" / "fsdp_2to1")
    train(cfg("run.name=fsdp_2to1", *FSDP2, "train.resume=true", "train.grad_accum=2"), show_progress=False)
    # Two "machines" of one process each, rendezvous on 127.0.0.1.
    port = _free_port()
    nodes = [_launch(root, "node", machines=(2, rank), port=port) for rank in (0, 1)]
    for proc in nodes:
        _finish(proc)
    return root


def _trim(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name[5:]) > RESUME_AT:
            shutil.rmtree(ckpt)
    (dst / "summary.json").unlink()


def _metrics(root: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def _assert_close(a: list[dict], b: list[dict], rtol: float, first_step: int = 0) -> None:
    a = [r for r in a if r["step"] >= first_step]
    b = [r for r in b if r["step"] >= first_step]
    assert [r["step"] for r in a] == [r["step"] for r in b] and a, "different steps logged"
    for x, y in zip(a, b):
        for key in ("loss", "val_loss", "grad_norm", "lr"):
            if key in y:
                assert abs(x[key] - y[key]) <= rtol * abs(y[key]), (x["step"], key, x[key], y[key])


@EXTENDED
@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp2_matches_ddp_for_30_steps(runs, accum):
    ddp, fsdp = _metrics(runs, f"ddp_a{accum}"), _metrics(runs, f"fsdp_a{accum}")
    assert len([r for r in fsdp if "loss" in r]) == STEPS
    _assert_close(fsdp, ddp, 0.0)  # bit for bit (the target is 1e-5)
    summary = json.loads((runs / "out" / f"fsdp_a{accum}.json").read_text())["summary"]
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["fp8_layers"] == 14


@EXTENDED
def test_fp8_all_gather_matches_fsdp2(runs):
    _assert_close(_metrics(runs, "fsdp_ag"), _metrics(runs, "fsdp_a1"), RTOL)


@EXTENDED
def test_delayed_amaxes_are_all_reduced_once_per_step(runs):
    for name in ("fsdp_a1", "fsdp_a2", "ddp_a1"):
        reduces = json.loads((runs / "out" / f"{name}.json").read_text())["max_reduces"]
        assert reduces == [3 * 14] * STEPS, name  # one MAX all-reduce per step: 3 roles x 14 Fp8Linears


@EXTENDED
def test_resume_same_world_size_is_bit_exact(runs):
    resumed, full = _metrics(runs, "fsdp_resume_same"), _metrics(runs, "fsdp_a1")
    _assert_close(resumed, full, 0.0)
    assert [r["step"] for r in resumed] == list(range(STEPS + 1))


@EXTENDED
@pytest.mark.parametrize("resumed, reference", [("fsdp_2to1", "fsdp_a1"), ("fsdp_1to2", "fsdp_single")])
def test_resume_with_another_world_size_continues_the_curve(runs, resumed, reference):
    _assert_close(_metrics(runs, resumed), _metrics(runs, reference), RTOL, first_step=RESUME_AT + 1)
    summary = json.loads((runs / "runs" / resumed / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{RESUME_AT:06d}") and summary["steps"] == STEPS


@EXTENDED
def test_two_machine_launch_matches_one_machine(runs):
    _assert_close(_metrics(runs, "fsdp_nodes"), _metrics(runs, "fsdp_a1"), 0.0)


@EXTENDED
def test_kill_9_of_one_rank_during_a_save_leaves_the_previous_checkpoint(runs):
    out = runs / "out"
    proc = _launch(runs, "kill")
    deadline = time.time() + 300
    while not (out / "in_save").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.2)
    time.sleep(0.2)
    os.kill(int((out / "in_save").read_text()), signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    ckpt_dir = runs / "runs" / "fsdp_kill" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith(".")) == ["step_000010"]
    assert latest_loadable_checkpoint(ckpt_dir) == ckpt_dir / "step_000010"
    state = read_model_state(ckpt_dir / "step_000010")
    reference = read_model_state(runs / "runs" / "fsdp_a1" / "checkpoints" / "step_000010")
    assert state.keys() == reference.keys() and "layers.1.mlp.down_proj.weight_scale" in state
    for name, value in state.items():  # the same run as fsdp_a1 up to step 10: the same weights and FP8 state
        assert torch.equal(value, reference[name]), name


def test_bench_distributed_bytes_meet_the_targets():
    """fp8train bench --sections distributed: the per-rank bytes and all-gather bytes docs/distributed.md quotes."""
    section = bench_distributed(steps=2)
    rows = {(r["model"], r["contender"]): r for r in section["rows"]}
    for model, _ in MODEL_SHAPES:
        ddp, fsdp, fp8 = (rows[(model, c)] for c in ("ddp", "fsdp2", "fsdp2+fp8_all_gather"))
        # params + grads + AdamW per rank: half of DDP's with 2 ranks (a world of 2 splits every tensor in two)
        assert fsdp["state_vs_ddp"] == pytest.approx(0.5, abs=0.01) and fp8["state_vs_ddp"] <= 0.55
        # FP8 codes are 1 byte for 4: at most 25% of the FP8 layers' fp32 bytes, plus the fp32 rest
        assert 0.25 < fp8["all_gather_vs_fp32"] < rows[(model, "fsdp2+bf16_gather")]["all_gather_vs_fp32"]
        assert fp8["losses"] == fsdp["losses"] == ddp["losses"]
    assert rows[("wide 4x256", "fsdp2+fp8_all_gather")]["all_gather_vs_fp32"] <= 0.30
    assert "x fp32 gather" in format_distributed(section)
