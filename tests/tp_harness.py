"""Run under `accelerate launch --multi_gpu --num_processes 2` by tests/test_tensor_parallel.py (not a test).

Job `both OUT_DIR CONFIG RECIPE...` runs the two below in one launch; job `mesh OUT CONFIG` trains delayed
with tp 2 and resumes its step-10 checkpoint with tp 1 (all processes data parallel), then trains the same with
plain fsdp2 over all processes; job `kill PIDFILE CONFIG` trains delayed with tp 2, checkpoints every 5 steps, and
rank 1 writes its pid to PIDFILE and waits inside its step-10 save (the test kills it there). Job `layers OUT`: for every recipe, an Fp8Linear split colwise and rowwise over the 2 ranks (torch's styles)
against the same layer unsharded in this process, over 3 steps (forward, backward, optimizer step, delayed
update); writes, per GEMM, whether it is bit-identical and its largest difference over the bound that the test
derives (inputs: |x| @ |W|^T in float64). Job `train OUT CONFIG RECIPE...`: fp8train's train() with
train.tp_size=2 for each recipe, every MAX all-reduce's size recorded in order."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

job, out = sys.argv[1], sys.argv[2]


def layers() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from fp8train.nn.linear import Fp8Linear, update_fp8_scales
    from fp8train.nn.recipes import recipe
    from fp8train.nn.tensor_parallel import keep_scaling_state_local

    if not dist.is_initialized():  # (job both: the trainings after this go on in the same group)
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    tiles = dict(input_block=(1, 32), weight_block=(32, 32), grad_output_block=(1, 32))
    results = {}
    for name in ("delayed", "current", "rowwise", "block"):
        r = recipe(name, **tiles) if name == "block" else recipe(name)
        for style_name in ("colwise", "rowwise"):
            torch.manual_seed(0)
            ref = Fp8Linear(128, 64, bias=False, recipe=r)
            tp = Fp8Linear(128, 64, bias=False, recipe=r)
            tp.load_state_dict(ref.state_dict())
            for layer in (ref, tp):
                layer.emulated_dtype = "fp32"  # fp32 GEMMs: results that do not depend on the CPU
            style = ColwiseParallel(output_layouts=Replicate()) if style_name == "colwise" else RowwiseParallel()
            parallelize_module(tp, mesh, style)
            keep_scaling_state_local(tp)
            opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, tp)]
            rows = []
            for step in range(3):
                x = torch.randn(16, 128) * (1 + step)
                g = torch.randn(16, 64)
                x_ref = x.clone().requires_grad_()
                x_tp = (x.chunk(world, -1)[rank] if style_name == "rowwise" else x).clone().requires_grad_()
                w = ref.weight.detach().double()
                y_ref, y_tp = ref(x_ref), tp(x_tp)
                y_ref.backward(g)
                y_tp.backward(g)
                gin_ref = x_ref.grad.chunk(world, -1)[rank] if style_name == "rowwise" else x_ref.grad
                gw_tp = tp.weight.grad.full_tensor()
                # the sums of |products| each GEMM adds (unquantized operands; the test widens for FP8 rounding)
                rows.append({
                    "output": [torch.equal(y_ref, y_tp), (y_ref - y_tp).abs().double().tolist(),
                               (x.abs().double() @ w.abs().t()).tolist(), 128],
                    "grad_input": [torch.equal(gin_ref, x_tp.grad), (gin_ref - x_tp.grad).abs().double().tolist(),
                                   (g.abs().double() @ w.abs()).chunk(world, -1)[rank].tolist()
                                   if style_name == "rowwise" else (g.abs().double() @ w.abs()).tolist(), 64],
                    "grad_weight": [torch.equal(ref.weight.grad, gw_tp), (ref.weight.grad - gw_tp).abs().double()
                                    .tolist(), (g.abs().double().t() @ x.abs().double()).tolist(), 16]})
                for opt in opts:  # grad_weight is bit-identical (checked): the weights stay equal
                    opt.step()
                    opt.zero_grad()
                update_fp8_scales(ref)
                update_fp8_scales(tp)
            results[f"{name}/{style_name}"] = rows
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


def train_runs(cfg_path: str, names: list[str]) -> None:
    from fp8train.training.config import load_config
    from fp8train.training.loop import train

    real_all_reduce, max_reduces = dist.all_reduce, []

    def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, *args, **kwargs):
        if op == dist.ReduceOp.MAX:
            max_reduces.append(tensor.numel())
        return real_all_reduce(tensor, op, *args, **kwargs)

    dist.all_reduce = recording_all_reduce
    # (quantizers call dist.all_reduce through the module: the recorder sees the TP amax reductions too)
    results = {}
    for name in names:
        max_reduces.clear()
        # "delayed-nosp": without sequence parallelism; "current-hf": the Hugging Face Llama of hf.yaml beside it
        recipe, _, variant = name.partition("-")
        overrides = ["train.sequence_parallel=false"] if variant == "nosp" else []
        path = str(Path(cfg_path).with_name("hf.yaml")) if variant == "hf" else cfg_path
        summary = train(load_config(path, [f"run.name=tp_{name}", f"fp8.recipe={recipe}", "train.tp_size=2",
                                           *overrides]), show_progress=False)
        results[name] = {"summary": summary, "max_reduces": list(max_reduces)}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f, default=str)


def resume_on_another_mesh(cfg_path: str, source: str, resumed: str, step: int, *overrides: str) -> None:
    """Run `source` as it was after checkpoint `step`, resumed as `resumed` with `overrides` (another mesh)."""
    import shutil
    from pathlib import Path

    from fp8train.training.config import load_config
    from fp8train.training.loop import train

    runs = Path(load_config(cfg_path).run.dir)
    if dist.get_rank() == 0:
        shutil.copytree(runs / source, runs / resumed)
        for ckpt in (runs / resumed / "checkpoints").glob("step_*"):
            if int(ckpt.name[5:]) > step:
                shutil.rmtree(ckpt)
        (runs / resumed / "summary.json").unlink()
    dist.barrier()
    train(load_config(cfg_path, [f"run.name={resumed}", "train.resume=true", *overrides]), show_progress=False)


if job == "layers":
    layers()
elif job == "train":
    train_runs(sys.argv[3], sys.argv[4:])
elif job == "mesh":  # delayed on dp x tp = processes/2 x 2, then its step-10 checkpoint resumed with tp 1 (dp 4)
    train_runs(sys.argv[3], ["delayed"])
    resume_on_another_mesh(sys.argv[3], "tp_delayed", "tp_to_dp", 10, "fp8.recipe=delayed", "train.tp_size=1")
    # the reference the issue names: plain fsdp2 over all the processes (dp 4, no tp), the same config, against
    # dp 2 x tp 2 accumulating 2 micro-batches a rank: the same 4 micro-batches of 2 sequences each
    from fp8train.training.config import load_config
    from fp8train.training.loop import train

    train(load_config(sys.argv[3], ["run.name=fsdp_delayed", "fp8.recipe=delayed"]), show_progress=False)
    train(load_config(sys.argv[3], ["run.name=tp_delayed_a2", "fp8.recipe=delayed", "train.tp_size=2",
                                    "train.grad_accum=2"]), show_progress=False)
elif job == "kill":  # dp x tp, checkpoints every 5 steps; rank 1 pauses inside its second save: the test kills it
    import os
    import time

    import fp8train.training.runs.sharded_checkpoint as sharded
    from fp8train.training.config import load_config
    from fp8train.training.loop import train

    real_save, saves = sharded.dcp.save, []

    def pausing_save(*args, **kwargs):
        saves.append(1)
        if len(saves) == 2 and dist.get_rank() == 1:  # its own shard of step 10 not written yet
            Path(out).write_text(str(os.getpid()))
            time.sleep(120)
        return real_save(*args, **kwargs)

    sharded.dcp.save = pausing_save
    train(load_config(sys.argv[3], ["run.name=tp_kill", "fp8.recipe=delayed", "train.tp_size=2",
                                    "checkpoint.every=5", "train.max_steps=10"]), show_progress=False)
else:  # "both": layers to OUT/layers.json, then the trainings to OUT/train.json (one launch, one import)
    out_dir = out
    out = f"{out_dir}/layers.json"
    layers()
    out = f"{out_dir}/train.json"
    train_runs(sys.argv[3], sys.argv[4:])
