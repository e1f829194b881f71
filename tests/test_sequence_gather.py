"""The sequence-parallel all-gather in FP8 (fp8train.nn.sequence_gather) and the bytes the collectives move.

In this process: which modules gather in FP8 and which fall back (fp8_gather_refusal), and that the gathered
input refuses to be computed with. With real processes (tests/sp_gather_harness.py: 2 gloo ranks, tp 2,
sequence parallelism, fp8train's decoder under bf16 autocast, 3 training steps): for every recipe the run that
gathers the blocks' inputs as FP8 codes and scales computes bit for bit what the run gathering them in high
precision computes (losses, every gradient, every FP8 scaling buffer), the independent reference being torch's
own DTensor redistribute of the high-precision input. The bytes come from the collectives as they ran
(bench.collective_bytes), checked against the sizes written out here from the shapes (B=4, T=32, D=64, 2 blocks,
2 ranks). The bench's tensor-parallel section (bench.tp_section) shows the block inputs' gather at half of bf16's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8train.bench.collective_bytes import CollectiveCall
from fp8train.bench.tp_section import BLOCK_INPUTS, bench_tensor_parallel, collective_name, format_tensor_parallel
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.recipes import recipe
from fp8train.nn.sequence_gather import Fp8GatheredInput, fp8_gather_refusal
from fp8train.numerics.quant import quantize

RECIPES = ("delayed", "current", "rowwise", "block", "block-32")
B, T, D, BLOCKS, TP = 4, 32, 64, 2, 2
HARNESS = Path(__file__).parent / "sp_gather_harness.py"


def _layers(r, n=3):
    return [Fp8Linear(64, 64, bias=False, recipe=r) for _ in range(n)]


@pytest.mark.parametrize("name", ["delayed", "current", "rowwise"])
def test_tensorwise_and_rowwise_inputs_gather_in_fp8(name):
    assert fp8_gather_refusal(_layers(recipe(name)), local_positions=16) is None


def test_block_tiles_must_lie_inside_a_rank_s_positions():
    # input tiles 1x16: the copy grad_weight reads runs 16 positions per tile; shards of 16 positions hold them
    tiles16 = recipe("block", input_block=(1, 16), weight_block=(16, 16), grad_output_block=(1, 16))
    assert fp8_gather_refusal(_layers(tiles16), local_positions=16) is None
    assert "span the 8-position shards" in fp8_gather_refusal(_layers(tiles16), local_positions=8)
    # square 16x16 input tiles: no transposed copy, but the forward tile's 16 rows are positions too
    square = recipe("block", input_block=(16, 16), weight_block=(16, 16), grad_output_block=(1, 16))
    assert fp8_gather_refusal(_layers(square), local_positions=16) is None
    assert fp8_gather_refusal(_layers(square), local_positions=24) is not None


def test_mixed_or_unconverted_projections_gather_in_high_precision():
    assert "not an Fp8Linear" in fp8_gather_refusal([*_layers(recipe("current"), 2), torch.nn.Linear(64, 64)], 16)
    assert "differ in recipe" in fp8_gather_refusal([*_layers(recipe("current"), 2), *_layers(recipe("delayed"), 1)],
                                                    16)
    assert fp8_gather_refusal(_layers(recipe("mxfp8")), 16) == "mxfp8 tiles"


def test_gathered_input_keeps_views_and_refuses_arithmetic():
    codes = quantize(torch.randn(8, 4), "e4m3fn")
    gathered = Fp8GatheredInput(torch.Size((2, 4, 4)), torch.float32, torch.device("cpu"), codes, None,
                                codes.amax, torch.tensor(False))
    flat = gathered.reshape(-1, 4)
    assert isinstance(flat, Fp8GatheredInput) and flat.shape == (8, 4) and flat.fp8 is codes
    with pytest.raises(RuntimeError, match="only the module's Fp8Linear projections can read it"):
        gathered + 1
    with pytest.raises(RuntimeError, match="keep the last dim"):
        gathered.reshape(2, 16)


def test_collectives_are_named_by_what_they_move():
    call = lambda kind, backward, module: CollectiveCall(kind, "float32", 8, backward, module)  # noqa: E731
    assert collective_name(call("all_gather", False, "Decoder.layers.0.attn")) == BLOCK_INPUTS
    assert collective_name(call("reduce_scatter", True, "Decoder.layers.1.mlp")).startswith("block input gradients")
    assert collective_name(call("all_reduce", True, "Decoder.layers.0.attn.q_proj")).startswith("all-reduces")
    assert collective_name(call("all_gather", False, "Decoder.lm_head")).startswith("final norm output")


# ------------------------------------------------------------------------------------------------------------
# Real processes
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gathered_runs(tmp_path_factory, single_thread):
    out = tmp_path_factory.mktemp("sp") / "sp.json"
    done = subprocess.run([sys.executable, str(HARNESS), str(out), *RECIPES], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def _forward_block_gathers(calls) -> list:
    return [c for c in calls if c[0] == "all_gather" and not c[3] and (".attn" in c[4] or ".mlp" in c[4])]


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name", RECIPES)
def test_fp8_gather_computes_what_the_high_precision_gather_does(gathered_runs, name):
    for step, row in enumerate(gathered_runs[name]):
        assert row["loss"], f"{name} step {step}: losses differ"
        assert row["grads"] == [] and row["grad_count"] == 21, f"{name} step {step}: {row['grads']}"
        assert row["buffers"] == [] and row["buffer_count"] > 0, f"{name} step {step}: {row['buffers']}"


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("name", RECIPES)
def test_block_inputs_travel_as_fp8_codes(gathered_runs, name):
    fp8_calls, high_calls = gathered_runs[name][-1]["bytes"]
    elements = B * T * D  # one block input, gathered: every rank receives all of it
    high = _forward_block_gathers(high_calls)
    # the high-precision run gathers each block input once (attn, mlp per block), in fp32 (RMSNorm's output)
    assert [(c[1], c[2]) for c in high] == [("float32", 4 * elements)] * (2 * BLOCKS)
    fp8 = [c for c in _forward_block_gathers(fp8_calls) if c[1] == "uint8"]
    small = [c for c in _forward_block_gathers(fp8_calls) if c[1] != "uint8"]
    if name == "block-32":  # 32-position tiles over 16-position shards: gathered in high precision instead
        assert fp8 == [] and [(c[1], c[2]) for c in small] == [("float32", 4 * elements)] * (2 * BLOCKS)
        return
    assert len(fp8) == 2 * BLOCKS
    rows = B * T
    expected = {  # codes, plus: delayed each rank's amax; rowwise the row scales, each rank's amax and the
        # transposed codes; block (1x16 tiles) the tile scales of both copies and each rank's amax
        "delayed": elements + 4 * TP,
        "current": elements,
        "rowwise": 2 * elements + 4 * rows + 4 * TP,
        "block": 2 * elements + 4 * (rows * D // 16) * 2 + 4 * TP,
    }[name]
    assert {c[2] for c in fp8} == {expected}
    # before the cast: current's amax (one float a rank), rowwise's column amaxes (D floats a rank); nothing else
    assert [c[2] for c in small] == {"current": [4 * TP], "rowwise": [4 * D * TP]}.get(name, []) * (2 * BLOCKS)
    # backward: the projections' input gradients go back as one reduce-scatter per module, no all-reduce of them
    backward = [c for c in fp8_calls if c[3] and (".attn" in c[4] or ".mlp" in c[4])]
    assert [c[2] for c in backward if c[0] == "reduce_scatter"] == [4 * elements] * (2 * BLOCKS)
    assert all(c[2] <= 4 * max(D, B * T) for c in backward if c[0] == "all_reduce")  # amaxes only


@pytest.mark.slow
@pytest.mark.extended
def test_bench_tp_section_halves_the_block_inputs_gather_against_bf16():
    section = bench_tensor_parallel(steps=2, recipes=("current",))
    rows = {r["contender"]: r for r in section["rows"]}
    fp8, bf16, fp32 = rows["fp8 gather"], rows["bf16 gather"], rows["fp32 gather"]
    assert fp8["losses"] == fp32["losses"]  # bit for bit
    gathered = fp8["bytes_per_step"][BLOCK_INPUTS]
    # 1 byte per element against 2 and 4, plus one float per rank and gather (the amax before the cast)
    assert gathered <= 0.5 * bf16["bytes_per_step"][BLOCK_INPUTS] * 1.001
    assert gathered <= 0.25 * fp32["bytes_per_step"][BLOCK_INPUTS] * 1.001
    assert fp8["fp8_bytes_per_step"] > 0 and bf16["fp8_bytes_per_step"] == 0
    for name, nbytes in fp32["bytes_per_step"].items():  # every other collective moves what it moved
        if name != BLOCK_INPUTS:
            assert fp8["bytes_per_step"][name] == nbytes, name
    assert "x bf16 gather" in format_tensor_parallel(section)


WEIGHT_UPDATE = r'''
import os, sys, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from fp8train.nn.linear import Fp8Linear
torch.manual_seed(0)
tp, whole = Fp8Linear(64, 32, bias=False, recipe="current"), Fp8Linear(64, 32, bias=False, recipe="current")
whole.load_state_dict(tp.state_dict())
parallelize_module(tp, init_device_mesh("cpu", (1,)), ColwiseParallel(output_layouts=Replicate()))
x = torch.randn(8, 64)
tp(x)  # caches the FP8 copy of the shard
with torch.no_grad():  # an in-place write through the DTensor parameter (not an optimizer step)
    tp.weight.mul_(-2.0)
    whole.weight.mul_(-2.0)
print(torch.equal(tp(x).full_tensor() if hasattr(tp(x), "full_tensor") else tp(x), whole(x)))
dist.destroy_process_group()
'''


@pytest.mark.slow
def test_a_tensor_parallel_weight_written_in_place_is_quantized_again(tmp_path):
    """The FP8 copy of a TP shard is cached per weight version: an in-place write through the DTensor parameter
    (which bumps the DTensor's counter, not its shard's) must make it again."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "update.py").write_text(WEIGHT_UPDATE)
    done = subprocess.run([sys.executable, str(tmp_path / "update.py"), str(port)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "True"
