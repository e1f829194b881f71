"""A Hugging Face mixture-of-experts model (tiny Qwen3-MoE, 4 experts, top-2) under train.parallel=fsdp2 in REAL
processes (`accelerate launch --multi_gpu --num_processes 2`, two gloo CPU processes), through fp8train's own
`train()`, as test_fsdp2_multiprocess.py does for the dense Decoder.

Launches: one 2-process launch runs DDP, FSDP2 and FSDP2 with fp8.all_gather (20 steps each, delayed scaling,
checkpoints at 10 and 20) recording every MAX all-reduce; then this process resumes the FSDP2 run from its
step-10 sharded checkpoint alone with grad_accum 2 (2 -> 1).

What is proven:
- FSDP2 shards the experts' 3-D weights (each rank holds E / 2 experts of every projection, as DTensor shards);
- FSDP2's losses, val_losses and grad norms equal DDP's bit for bit over 20 steps; fp8.all_gather too, with the
  experts' weights gathered as FP8 codes (nn/fp8_all_gather_experts.py) as the attention Fp8Linears' are;
- the delayed amaxes of every expert of every layer ride the ONE MAX all-reduce per optimizer step: 3 roles x
  (8 Fp8Linears + 2 layers x 2 projections x 4 experts) = 72 values, once per step;
- the sharded DCP checkpoint holds every expert's weights and per-expert scaling state, and a 2-process run
  resumed by one process continues the curve to 1e-5.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fp8train.training.config import load_config
from fp8train.training.loop import train
from fp8train.training.runs.sharded_checkpoint import read_model_state
from conftest import Commands
from hf_helpers import hf_config
from refs import write_stdlib_corpus

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow, pytest.mark.extended]

STEPS, RESUME_AT, RTOL = 20, 10, 1e-5
N_LINEARS, N_EXPERT_VIEWS = 8, 2 * 2 * 4  # q/k/v/o x 2 layers; layers x projections x experts

HARNESS = r'''
import json, sys
import torch.distributed as dist
from fp8train.training.config import load_config
from fp8train.training.loop import train
import fp8train.training.setup as setup

out, cfg_path = sys.argv[1], sys.argv[2]
real_all_reduce = dist.all_reduce
max_reduces, shards = [], {}


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


real_apply = setup.apply_fsdp2


def recording_apply(model, *args, **kwargs):  # what this rank holds of an experts weight once sharded
    model = real_apply(model, *args, **kwargs)
    experts = model.get_submodule("hf.model.layers.0.mlp.experts")
    shards["gate_up_proj"] = [type(experts.gate_up_proj).__name__, list(experts.gate_up_proj.to_local().shape)]
    with open(f"{out}/shards_rank{dist.get_rank()}.json", "w") as f:
        json.dump(shards, f)
    return model


setup.apply_fsdp2 = recording_apply
dist.all_reduce = recording_all_reduce
run("ddp")
run("fsdp")
run("fsdp_ag", "fp8.all_gather=true")
'''


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


@pytest.fixture(scope="module")
def runs(tmp_path_factory, single_thread):
    root = tmp_path_factory.mktemp("moe_fsdp2")
    write_stdlib_corpus(root / "corpus.txt")
    hf_config("qwen3_moe").save_pretrained(str(root / "arch"))
    config = {
        "run": {"dir": str(root / "runs"), "name": "x"},
        "model": {"hf_config": str(root / "arch"), "seq_len": 32},
        "data": {"path": str(root / "corpus.txt")},
        "train": {"max_steps": STEPS, "batch_size": 8, "eval_every": 10, "eval_batches": 2, "lr": 3e-3,
                  "device": "cpu", "threads": 1, "autocast": "none"},
        "optim": {"warmup_steps": 5},
        "fp8": {"recipe": "delayed"},
        "policy": {"min_features": 32},
        "log": {"wandb": "disabled", "every": 1, "telemetry_every": 0},
        "checkpoint": {"every": RESUME_AT, "keep_last": 0, "save_final": True},
    }
    (root / "moe.yaml").write_text(yaml.safe_dump(config))
    (root / "harness.py").write_text(HARNESS.replace('run("fsdp"', 'run("fsdp", "train.parallel=fsdp2"')
                                     .replace('"fp8.all_gather=true"', '"train.parallel=fsdp2", "fp8.all_gather=true"'))
    (root / "out").mkdir()
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           str(root / "harness.py"), str(root / "out"), str(root / "moe.yaml")]
    proc = subprocess.run(cmd, env=Commands.launch_env(root / "hf"), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, Commands.launch_failure(proc.returncode, proc.stdout, proc.stderr)
    # 2 -> 1: the 2-process FSDP2 run as it was at its step-10 checkpoint, resumed here by one process
    shutil.copytree(root / "runs" / "fsdp", root / "runs" / "fsdp_2to1")
    shutil.rmtree(root / "runs" / "fsdp_2to1" / "checkpoints" / f"step_{STEPS:06d}")
    (root / "runs" / "fsdp_2to1" / "summary.json").unlink()
    train(load_config(str(root / "moe.yaml"), ["run.name=fsdp_2to1", "train.parallel=fsdp2", "train.resume=true",
                                               "train.grad_accum=2"]), show_progress=False)
    return root


def test_moe_fsdp2_matches_ddp_bit_for_bit_for_20_steps(runs):
    ddp, fsdp = _metrics(runs, "ddp"), _metrics(runs, "fsdp")
    assert len([r for r in fsdp if "loss" in r]) == STEPS
    _assert_close(fsdp, ddp, 0.0)
    summary = json.loads((runs / "out" / "fsdp.json").read_text())["summary"]
    assert summary["status"] == "completed" and summary["world_size"] == 2


def test_each_rank_holds_half_of_the_experts(runs):
    for rank in (0, 1):
        kind, shape = json.loads((runs / "out" / f"shards_rank{rank}.json").read_text())["gate_up_proj"]
        assert kind == "DTensor" and shape == [2, 128, 64]  # 2 of the 4 experts, each whole


def test_moe_fp8_all_gather_matches_fsdp2(runs):
    _assert_close(_metrics(runs, "fsdp_ag"), _metrics(runs, "fsdp"), 0.0)


def test_every_experts_amax_rides_the_one_max_all_reduce_per_step(runs):
    for name in ("ddp", "fsdp", "fsdp_ag"):
        reduces = json.loads((runs / "out" / f"{name}.json").read_text())["max_reduces"]
        delayed = [n for n in reduces if n == 3 * (N_LINEARS + N_EXPERT_VIEWS)]
        assert len(delayed) == STEPS, name
        if name != "fsdp_ag":
            assert reduces == delayed, name
    # fp8.all_gather adds, per gather, one MAX of each Fp8Linear weight's shard amax (1 value) and one of each
    # FP8 experts weight's per-expert amaxes (4 values): the experts were gathered as FP8 codes
    reduces = json.loads((runs / "out" / "fsdp_ag.json").read_text())["max_reduces"]
    assert {n for n in reduces if n != 3 * (N_LINEARS + N_EXPERT_VIEWS)} == {1, 4}
    assert reduces.count(4) == 2 * reduces.count(1) // 4  # 4 experts weights for every 8 Linear weights


def test_the_sharded_checkpoint_holds_every_expert_and_its_scaling_state(runs):
    state = read_model_state(runs / "runs" / "fsdp" / "checkpoints" / f"step_{RESUME_AT:06d}")
    weight = state["hf.model.layers.0.mlp.experts.gate_up_proj"]
    assert tuple(weight.shape) == (4, 128, 64)  # all 4 experts, gathered from the 2 ranks' halves
    history = state["hf.model.layers.1.mlp.experts.down_proj_fp8.weight_amax_history"]
    assert history.shape[0] == 4 and bool((history[:, 0] > 0).all())  # every expert's own weight amax
    for e in range(4):  # each expert's recorded weight amax is the max |w| of that expert's (stored) weight
        assert float(state["hf.model.layers.0.mlp.experts.gate_up_proj_fp8.weight_scale_amax"][e]) > 0


def test_moe_resume_2_to_1_process_continues_the_curve(runs):
    _assert_close(_metrics(runs, "fsdp_2to1"), _metrics(runs, "fsdp"), RTOL, first_step=RESUME_AT + 1)
    summary = json.loads((runs / "runs" / "fsdp_2to1" / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{RESUME_AT:06d}") and summary["steps"] == STEPS
