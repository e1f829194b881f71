"""train.tp_size: tensor parallelism in FP8 (fp8train.nn.tensor_parallel, training.parallel.tp_mesh).

Refusals run in this process. The rest is one REAL `accelerate launch --multi_gpu --num_processes 2` (two gloo
CPU processes, tests/tp_harness.py), then one-process references here:
- layers: an Fp8Linear split colwise and rowwise over 2 ranks against the same layer whole, 3 steps, every recipe.
  The GEMMs that do not sum over the split dim (colwise output and grad_weight, rowwise grad_input and
  grad_weight) are bit-identical: their FP8 operands and scales are the unsharded layer's, which is what the
  amax reductions over TP are for. The GEMMs that sum over it (rowwise output, colwise grad_input) add the same
  exact FP8 products in another order (two partial GEMMs and one all-reduce addition): with u = 2^-24 and S the
  sum of |products| of one output, fp32 summation in any order is within (K - 1) u S of the exact sum, so two
  orders differ by at most 2 (K - 1) u S, plus at most 2 u |out| from each side's two scale multiplications and
  the all-reduce's addition: bound (2 K + 4) u S. S is taken from the unquantized operands widened by the FP8
  rounding (E4M3 / E5M2 values are within 2^-4 / 2^-3 of theirs, relative, above the subnormals): 1.25 S.
- training, exactly: train.tp_size=2 without sequence parallelism, every recipe, 20 steps, against one process
  whose two split-dim GEMMs add their parts in the ranks' order (tests/split_order.py): bit for bit. So the only
  difference from one process is the fp32 order of the two GEMMs above (bounded per GEMM as derived there), and
  with sequence parallelism two more fp32 reorderings (norm weight gradients and block input gradients summed per
  rank first).
- training, with tolerances: fp8train's train() with train.tp_size=2 for 20 steps against one process, every
  recipe with and without sequence parallelism, and current on a Hugging Face Llama (random init, its own TP plan
  by projection names, no sequence parallelism). Over training no a-priori bound holds: FP8 rounding turns those
  last-bit differences into different roundings a few steps on. Tolerances: 1e-4 over the first 5 steps, 1e-2 over the run, the spread a mere re-split gives
  one process (EARLY_RTOL, LATE_RTOL below); observed on the 2-core EPYC here: rowwise and block losses mostly
  bit-identical, delayed within 2e-4, current within 2.3e-3 (at its sensitive step 15).
  Gradient norms are compared over the first steps only: later single steps move by percents under ANY
  reordering (one process, grad_accum 2 against 1: delayed's step-15 norm by 54%, its losses by 1e-2).
- dp 2 x tp 2 (4 processes, train.parallel=fsdp2) against plain fsdp2 on the same 4 processes, and against one
  process accumulating 2 micro-batches (the same micro-batches as 2 dp ranks, as in the FSDP2 tests): the same
  tolerances; its step-10 checkpoint resumed as dp 4 (tp 1) continues its curve to the same tolerances;
- kill -9 of one rank inside a dp 2 x tp 2 DCP save: the previous checkpoint stays whole and resumes;
- docs/distributed.md's TP command, as written (size overrides appended, wandb offline): exit 0;
- delayed scaling: once scales exist, its one MAX all-reduce per step is the only amax collective (TP included);
  block scaling needs none (tiles inside shards); a checkpoint written with tp 2 resumes in one process.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig

from fp8train.nn.linear import Fp8Linear
from fp8train.training.config import load_config
from fp8train.training.loop import train
from fp8train.training.models.decoder import build_model
from fp8train.training.parallel.tp_mesh import check_tensor_parallel, check_tp_model
from fp8train.nn.convert import convert_to_fp8
from fp8train.nn.recipes import recipe
from fp8train.training.runs.sharded_checkpoint import latest_loadable_checkpoint
from conftest import Commands
from split_order import tp_reduction_order
from hf_helpers import TINY_ARCHS, VOCAB, hf_config
from refs import write_stdlib_corpus

pytestmark = pytest.mark.extended  # minutes of multi-process launches: CI runs them (pyproject)

RECIPES = ("delayed", "current", "rowwise", "block")
STEPS, EARLY = 20, 5
# Losses within EARLY_RTOL over the first EARLY steps (only summation order differs yet) and LATE_RTOL over the run:
# not derived (no a-priori bound survives FP8 rounding over steps) but set by what a pure re-split does to ONE
# process: grad_accum 2 against 1 moves its losses by up to 1.1e-2 (delayed) and 6e-3 (current) over 20 steps on
# this config, and single sensitive steps (step 15 here) by the most. TP stayed within 2.3e-3 (current, step 15);
# over the first 5 steps within 3e-6 on fp8train's decoder and 1.3e-5 on the Llama (current, step 5).
EARLY_RTOL, LATE_RTOL = 1e-4, 1e-2
U = 2.0 ** -24
TINY = {
    "model": {"n_layers": 2, "d_model": 64, "n_heads": 2, "seq_len": 32, "ffn_hidden": 128},
    "train": {"max_steps": STEPS, "batch_size": 8, "eval_every": 10, "eval_batches": 2, "lr": 3e-3,
              "device": "cpu", "threads": 1, "autocast": "none"},
    "optim": {"warmup_steps": 5},
    # 32-wide tiles: the shards of a 64-wide layer on 2 ranks hold whole tiles; fp32 GEMMs on every CPU
    "fp8": {"recipe": "delayed", "input_block": [1, 32], "weight_block": [32, 32], "grad_output_block": [1, 32],
            "emulated_dtype": "fp32"},
    "policy": {"min_features": 16},
    "log": {"wandb": "disabled", "every": 1, "telemetry_every": 0},
    "checkpoint": {"every": 10, "keep_last": 0, "save_final": True},
}
DELAYED_LAYERS = 14  # 2 blocks x 7 projections: the stacked pending amaxes are 3 x 14


# ------------------------------------------------------------------------------------------------------------
# Refused before anything runs, in one line
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [["train.tp_size=0"], ["train.tp_size=-2"], ["train.tp_size=65"],
                                       ["train.tp_size=2", "train.compile=true"],
                                       ["train.tp_size=2", "train.parallel=fsdp2", "fp8.all_gather=true"]])
def test_tp_size_the_config_cannot_run_is_refused(overrides):
    with pytest.raises(ValueError, match=r"train\.tp_size") as error:
        load_config(None, overrides)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("processes, overrides, words", [
    (3, [], "must divide the number of processes (3)"),
    (4, [], "needs processes == tp_size"),
])
def test_launch_tp_cannot_form_is_refused(processes, overrides, words):
    cfg = load_config(None, ["train.tp_size=2", *overrides])
    with pytest.raises(ValueError) as error:
        check_tensor_parallel(cfg, processes)
    assert words in str(error.value) and "\n" not in str(error.value)
    check_tensor_parallel(load_config(None, ["train.tp_size=2", "train.parallel=fsdp2"]), 4)  # dp 2 x tp 2: fine


def _converted(overrides, fp8_recipe):
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=64", "model.n_heads=2", *overrides])
    model = build_model(cfg.model)
    convert_to_fp8(model, fp8_recipe)
    return model


def test_split_tile_is_refused_naming_layer_and_sizes():
    # 64 output features on 2 ranks: shards of 32 cut the 64-wide tiles of the weight and grad_output
    model = _converted(["model.ffn_hidden=128"], recipe("block", input_block=(1, 64), weight_block=(64, 64),
                                                          grad_output_block=(1, 64)))
    with pytest.raises(ValueError) as error:
        check_tp_model(model, 2)
    message = str(error.value)
    assert "layers.0.attn.q_proj" in message and "shards of 32" in message and "64" in message
    assert "\n" not in message
    # the same layers with 32-wide tiles hold whole tiles per shard
    check_tp_model(_converted(["model.ffn_hidden=128"], recipe("block", input_block=(1, 32), weight_block=(32, 32),
                                                                grad_output_block=(1, 32))), 2)


def test_heads_that_do_not_split_are_refused():
    model = _converted(["model.ffn_hidden=128"], recipe("current"))
    with pytest.raises(ValueError, match=r"train.tp_size=4 must divide model.n_heads=2"):
        check_tp_model(model, 4)
    assert isinstance(model.layers[0].attn.q_proj, Fp8Linear)


@pytest.mark.parametrize("source", ["decoder", "qwen3_moe"])
def test_mixture_of_experts_is_refused_naming_the_experts(tmp_path, source):
    if source == "decoder":  # fp8train's decoder with its MoE blocks
        model = _converted(["model.n_experts=4", "model.top_k=2", "model.ffn_hidden=128"], recipe("delayed"))
        first = "layers.0.mlp.experts.gate_up"
    else:  # a Hugging Face MoE (transformers' experts module), converted as fp8train converts it
        hf_config("qwen3_moe").save_pretrained(tmp_path / "moe")
        cfg = load_config(None, [f"model.hf_config={tmp_path / 'moe'}", "model.seq_len=32"])
        model = build_model(cfg.model)
        convert_to_fp8(model, recipe("delayed"))
        first = next(n for n, _ in model.named_modules() if n.endswith("mlp.experts"))
    with pytest.raises(ValueError) as error:
        check_tp_model(model, 2)
    message = str(error.value)
    assert first in message and "nor expert parallelism is supported" in message and "\n" not in message


# ------------------------------------------------------------------------------------------------------------
# Real processes
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory, single_thread):
    root = tmp_path_factory.mktemp("tp")
    write_stdlib_corpus(root / "corpus.txt")
    config = {**TINY, "run": {"dir": str(root / "runs"), "name": "x"}, "data": {"path": str(root / "corpus.txt")}}
    (root / "tiny.yaml").write_text(yaml.safe_dump(config))
    # a Hugging Face Llama (random init) with 2 KV heads, so that each rank holds one
    llama = dict(TINY_ARCHS["llama"], vocab_size=VOCAB, num_key_value_heads=2)
    AutoConfig.for_model(llama.pop("model_type"), **llama).save_pretrained(root / "llama")
    (root / "hf.yaml").write_text(yaml.safe_dump({**config, "model": {"hf_config": str(root / "llama"),
                                                                      "seq_len": TINY["model"]["seq_len"]}}))
    harness = Path(__file__).parent / "tp_harness.py"
    argv = Commands.accelerate_launch(2, str(harness), "both", str(root), str(root / "tiny.yaml"), *RECIPES,
                                      *(f"{name}-nosp" for name in RECIPES), "current-hf")
    done = subprocess.run(argv, env=Commands.launch_env(root / "hf"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, Commands.launch_failure(done.returncode, done.stdout, done.stderr)
    cfg = lambda *o: load_config(str(root / "tiny.yaml"), list(o))  # noqa: E731
    for name in RECIPES:
        train(cfg(f"run.name=one_{name}", f"fp8.recipe={name}"), show_progress=False)
    train(load_config(str(root / "hf.yaml"), ["run.name=one_current-hf", "fp8.recipe=current"]), show_progress=False)
    with tp_reduction_order(2):  # one process adding the split GEMMs' parts as the 2 ranks do (tests/split_order.py)
        for name in RECIPES:
            train(cfg(f"run.name=split_{name}", f"fp8.recipe={name}"), show_progress=False)
    # tp 2 -> 1: the delayed tp=2 run as it was after its step-10 checkpoint, resumed in this one process
    source, resumed = root / "runs" / "tp_delayed", root / "runs" / "tp_2to1"
    shutil.copytree(source, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000020")
    (resumed / "summary.json").unlink()
    train(cfg("run.name=tp_2to1", "fp8.recipe=delayed", "train.resume=true", "train.tp_size=1"),
          show_progress=False)
    return root


def _metrics(root: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def _layers(root: Path) -> dict:
    return json.loads((root / "layers.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("style", ["colwise", "rowwise"])
@pytest.mark.parametrize("name", RECIPES)
def test_split_layer_computes_what_the_whole_layer_does(tp_runs, name, style):
    rows = _layers(tp_runs)[f"{name}/{style}"]
    exact = {"colwise": ("output", "grad_weight"), "rowwise": ("grad_input", "grad_weight")}[style]
    for step, row in enumerate(rows):
        for gemm, (equal, diff, abs_sums, k) in row.items():
            if gemm in exact:
                assert equal, f"{name} {style} step {step}: {gemm} differs from the unsharded layer's"
                continue
            bound = (2 * k + 4) * U * 1.25
            worst = max(d / (bound * s) if s else (0.0 if d == 0 else float("inf"))
                        for d_row, s_row in zip(diff, abs_sums) for d, s in zip(d_row, s_row))
            assert worst <= 1.0, f"{name} {style} step {step}: {gemm} off by {worst:.2f} x its bound"


@pytest.mark.slow
@pytest.mark.parametrize("name", [*RECIPES, *(f"{r}-nosp" for r in RECIPES), "current-hf"])
def test_tp2_trains_like_one_process(tp_runs, name):
    reference = name if name.endswith("-hf") else name.partition("-")[0]
    tp, one = _metrics(tp_runs, f"tp_{name}"), _metrics(tp_runs, f"one_{reference}")
    assert [r["step"] for r in tp] == [r["step"] for r in one] and len(tp) == STEPS + 1
    assert tp[0]["val_loss"] == pytest.approx(one[0]["val_loss"], rel=1e-6)  # the untrained model: one forward
    for a, b in zip(tp[1:], one[1:]):
        rtol = EARLY_RTOL if a["step"] <= EARLY else LATE_RTOL
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol), f"{name} step {a['step']}"
        # step 1: the same weights and batch, only sums in another order (the norm itself in float64): a norm that
        # counts a replica twice or a partial sum once (off by 4e-5 .. 3% when that was the bug) is caught here.
        # Later a step whose gradient hangs on a few E5M2 roundings moves its norm by percents under any reordering
        # (one process with grad_accum 2 against 1 moves delayed's step-15 norm by 54% here): first steps only.
        if a["step"] <= EARLY:
            rel = 1e-6 if a["step"] == 1 else 1e-3
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=rel), f"{name} step {a['step']}"
    summary = json.loads((tp_runs / "runs" / f"tp_{name}" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == STEPS


@pytest.mark.slow
@pytest.mark.parametrize("name", RECIPES)
def test_tp2_equals_one_process_summing_in_its_order_bit_for_bit(tp_runs, name):
    """tp 2 without sequence parallelism against one process whose two split-dim GEMMs (rowwise output, colwise
    grad_input) add their 2 parts as the ranks do (tests/split_order.py): every loss, validation loss and gradient
    norm of the 20 steps is bit for bit the same. So the TP machinery (DTensor shards, amax reductions,
    collectives, the optimizer on shards, checkpoint-free training) adds no error of its own; what separates tp 2
    from one process is only the fp32 order of those two GEMMs' sums, bounded per GEMM by the derived
    (2K + 4) u 1.25 S of test_split_layer_computes_what_the_whole_layer_does (and, with sequence parallelism, two
    more reorderings of fp32 sums: each norm weight gradient summed per rank's positions, each block input's
    gradient summed per rank over q/k/v (gate/up) before the ranks are added). What FP8 rounding makes of such
    last-bit differences over 20 steps has no a-priori bound: hence the run-level tolerances above."""
    keys = ("step", "loss", "val_loss", "grad_norm")
    tp, one = _metrics(tp_runs, f"tp_{name}-nosp"), _metrics(tp_runs, f"split_{name}")
    assert len(tp) == STEPS + 1
    assert [[r.get(k) for k in keys] for r in tp] == [[r.get(k) for k in keys] for r in one]


@pytest.mark.slow
def test_delayed_amaxes_take_one_max_all_reduce_per_step(tp_runs):
    sizes = json.loads((tp_runs / "train.json").read_text())["delayed"]["max_reduces"]
    stacked = 3 * DELAYED_LAYERS
    assert sizes.count(stacked) == STEPS
    first = sizes.index(stacked)
    # before the first update the roles fall back to their own amax, reduced over TP per quantize; afterwards the
    # stored scales hold and the per-step all-reduce is the only one
    assert set(sizes[:first]) == {1} and set(sizes[first:]) == {stacked}


@pytest.mark.slow
def test_block_tiles_stay_local_and_current_reduces_per_quantize(tp_runs):
    reduces = json.loads((tp_runs / "train.json").read_text())
    assert reduces["block"]["max_reduces"] == []
    assert set(reduces["current"]["max_reduces"]) == {1} and len(reduces["current"]["max_reduces"]) >= STEPS * 28


@pytest.mark.slow
def test_tp2_checkpoint_resumes_in_one_process(tp_runs):
    resumed, source = _metrics(tp_runs, "tp_2to1"), _metrics(tp_runs, "tp_delayed")
    after = [r for r in resumed if r["step"] > 10 and "loss" in r]
    assert [r["step"] for r in after] == list(range(11, STEPS + 1))
    by_step = {r["step"]: r for r in source}
    for r in after:  # the same weights, AdamW state and FP8 scaling state: the first steps agree closely
        rtol = EARLY_RTOL if r["step"] <= 10 + EARLY else LATE_RTOL
        assert r["loss"] == pytest.approx(by_step[r["step"]]["loss"], rel=rtol), r["step"]
    summary = json.loads((tp_runs / "runs" / "tp_2to1" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary.get("resumed_from", "").endswith("step_000010")


@pytest.fixture(scope="module")
def dp2_tp2(tmp_path_factory, single_thread):
    root = tmp_path_factory.mktemp("dp2tp2")
    write_stdlib_corpus(root / "corpus.txt")
    config = {**TINY, "run": {"dir": str(root / "runs"), "name": "x"}, "data": {"path": str(root / "corpus.txt")}}
    config["train"] = {**TINY["train"], "parallel": "fsdp2"}
    (root / "tiny.yaml").write_text(yaml.safe_dump(config))
    harness = Path(__file__).parent / "tp_harness.py"
    argv = Commands.accelerate_launch(4, str(harness), "mesh", str(root / "train.json"), str(root / "tiny.yaml"))
    done = subprocess.run(argv, env=Commands.launch_env(root / "hf"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, Commands.launch_failure(done.returncode, done.stdout, done.stderr)
    train(load_config(str(root / "tiny.yaml"), ["run.name=one_delayed", "train.grad_accum=2"]), show_progress=False)
    return root


@pytest.mark.slow
def test_dp2_tp2_trains_like_fsdp2_on_4_processes(dp2_tp2):
    """The reference the issue names: plain fsdp2 over the same 4 processes (dp 4: micro-batches of 2 sequences),
    the same config, against dp 2 x tp 2 accumulating 2 micro-batches a rank (the same 4 micro-batches: without
    it each dp rank's micro-batch holds 4 sequences, and delayed scaling's first step, scaled from each
    micro-batch's own amax, moves the step-1 gradient norm by 1.2e-3). Only summation orders differ (the gradient
    sum over ranks and micro-batches, the row-parallel sums): the same tolerances as against one process."""
    mesh, fsdp = _metrics(dp2_tp2, "tp_delayed_a2"), _metrics(dp2_tp2, "fsdp_delayed")
    assert [r["step"] for r in mesh] == [r["step"] for r in fsdp] and len(mesh) == STEPS + 1
    assert mesh[0]["val_loss"] == pytest.approx(fsdp[0]["val_loss"], rel=1e-6)
    for a, b in zip(mesh[1:], fsdp[1:]):
        rtol = EARLY_RTOL if a["step"] <= EARLY else LATE_RTOL
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol), a["step"]
        if a["step"] <= EARLY:  # (as in test_tp2_trains_like_one_process)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6 if a["step"] == 1 else 1e-3), a["step"]
    summary = json.loads((dp2_tp2 / "runs" / "fsdp_delayed" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 4


@pytest.mark.slow
def test_kill_9_of_one_rank_during_a_tp_save_leaves_the_last_checkpoint_resumable(dp2_tp2):
    """dp 2 x tp 2 (4 processes), checkpoints every 5 steps: rank 1 is SIGKILLed inside its step-10 save (its shard
    not written). The step-5 checkpoint stays whole (manifest and shards verify), step 10 never appears, and the
    run resumes from step 5 in one process (tp 1, the dp ranks' micro-batches as grad_accum 2): its first step
    is the uninterrupted dp 2 x tp 2 run's step 6, and it completes."""
    pid_file = dp2_tp2 / "kill.pid"
    harness = Path(__file__).parent / "tp_harness.py"
    argv = Commands.accelerate_launch(4, str(harness), "kill", str(pid_file), str(dp2_tp2 / "tiny.yaml"))
    proc = subprocess.Popen(argv, env=Commands.launch_env(dp2_tp2 / "hf"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    while not pid_file.exists() or not pid_file.read_text():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.2)
    time.sleep(0.2)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    proc.communicate(timeout=300)
    assert proc.returncode != 0
    ckpt_dir = dp2_tp2 / "runs" / "tp_kill" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir() if not p.name.startswith(".")) == ["step_000005"]
    assert latest_loadable_checkpoint(ckpt_dir) == ckpt_dir / "step_000005"
    train(load_config(str(dp2_tp2 / "tiny.yaml"), ["run.name=tp_kill", "fp8.recipe=delayed", "train.resume=true",
                                                   "train.tp_size=1", "train.grad_accum=2", "checkpoint.every=5"]),
          show_progress=False)
    summary = json.loads((dp2_tp2 / "runs" / "tp_kill" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed_from"].endswith("step_000005")
    by_step = {r["step"]: r for r in _metrics(dp2_tp2, "tp_delayed")}
    killed = _metrics(dp2_tp2, "tp_kill")
    # up to the checkpoint, the killed launch was the uninterrupted run (same config and mesh: the same numbers)
    assert [(r["step"], r.get("loss")) for r in killed if r["step"] <= 5] == \
        [(s, by_step[s].get("loss")) for s in range(6)]
    after = [r for r in killed if r["step"] > 5 and "loss" in r]
    assert [r["step"] for r in after] == list(range(6, STEPS + 1))  # (the log is cut back to step 5 on resume)
    # the first resumed step runs the checkpoint's weights, AdamW and FP8 state on the same batch: only summation
    # orders differ from the mesh (one process against dp 2 x tp 2). Later steps: no a-priori bound (the module
    # docstring), and resumed at the peak learning rate the curve moved by 3e-3 .. 1.3e-2 at steps 8-9 in two
    # runs here, past LATE_RTOL, which was set from runs resumed at step 10: those steps only have to be finite
    assert after[0]["loss"] == pytest.approx(by_step[6]["loss"], rel=EARLY_RTOL)
    assert all(math.isfinite(r["loss"]) for r in after)


@pytest.mark.slow
def test_dp2_tp2_fsdp2_trains_like_one_process(dp2_tp2):
    mesh, one = _metrics(dp2_tp2, "tp_delayed"), _metrics(dp2_tp2, "one_delayed")
    assert [r["step"] for r in mesh] == [r["step"] for r in one] and len(mesh) == STEPS + 1
    for a, b in zip(mesh[1:], one[1:]):
        rtol = EARLY_RTOL if a["step"] <= EARLY else LATE_RTOL
        assert a["loss"] == pytest.approx(b["loss"], rel=rtol), a["step"]
        if a["step"] <= EARLY:  # (as in test_tp2_trains_like_one_process)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6 if a["step"] == 1 else 1e-3), a["step"]
    summary = json.loads((dp2_tp2 / "runs" / "tp_delayed" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 4


DOCS = Path(__file__).resolve().parent.parent / "docs" / "distributed.md"
SMALL = ["train.max_steps=4", "train.eval_every=2", "train.eval_batches=1", "train.batch_size=4",
         "model.seq_len=32", "optim.warmup_steps=1", "data.max_bytes=200000", "log.telemetry_every=0", "--quiet"]


@pytest.mark.slow
def test_docs_tp_command_exits_0_with_wandb_offline(tmp_path, single_thread):
    block = re.search(r"## Tensor parallelism.*?```bash\n(.*?)```", DOCS.read_text(), flags=re.S).group(1)
    line = next(x for x in block.splitlines() if x.startswith("accelerate launch") and "--num_processes 2" in x)
    argv = shlex.split(line)
    script = argv.index("scripts/train.py")
    repo = DOCS.parent.parent
    wandb_home = str(tmp_path / "wandb-home")
    env = Commands.launch_env(tmp_path / "hf", WANDB_CONFIG_DIR=wandb_home, WANDB_CACHE_DIR=wandb_home,
                              WANDB_DATA_DIR=wandb_home, WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *argv[2:script], "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", str(repo / argv[script]), *argv[script + 1:], *SMALL,
           f"run.dir={tmp_path / 'runs'}", "log.wandb=offline"]
    done = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = next((tmp_path / "runs").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 4
    assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert (run_dir / "checkpoints" / "step_000004" / "COMPLETE").exists()  # a sharded (DCP) checkpoint


@pytest.mark.slow
def test_dp2_tp2_checkpoint_resumes_as_dp4(dp2_tp2):
    resumed, source = _metrics(dp2_tp2, "tp_to_dp"), _metrics(dp2_tp2, "tp_delayed")
    after = [r for r in resumed if r["step"] > 10 and "loss" in r]
    assert [r["step"] for r in after] == list(range(11, STEPS + 1))
    by_step = {r["step"]: r for r in source}
    for r in after:  # dp 4 runs 2 sequences a rank where dp 2 ran 4: stored delayed scales do not depend on it
        rtol = EARLY_RTOL if r["step"] <= 10 + EARLY else LATE_RTOL
        assert r["loss"] == pytest.approx(by_step[r["step"]]["loss"], rel=rtol), r["step"]
    summary = json.loads((dp2_tp2 / "runs" / "tp_to_dp" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 4
