"""Run by tests/test_sequence_gather.py as `python tests/sp_gather_harness.py OUT.json RECIPE...` (not a test).

Starts 2 gloo processes (tp 2, sequence parallelism). Per recipe: fp8train's decoder (2 blocks), converted to FP8,
copied, and parallelized twice on the same mesh: once with the blocks' inputs all-gathered as FP8 codes and
scales (nn/sequence_gather.py), once in their own dtype (torch's redistribute). Both train 3 steps under bf16
autocast on the same batches (forward, backward, the norms' partial gradients summed, SGD, the delayed update);
rank 0 writes, per step, whether the losses, every gradient (whole, full_tensor) and every FP8 scaling buffer are
bit-identical, and every collective's bytes (bench.collective_bytes: counted as the collectives run).
"""

import copy
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TILES = dict(input_block=(1, 16), weight_block=(16, 16), grad_output_block=(1, 16))  # inside 16-position shards


def _model(name: str):
    from fp8train.nn.convert import convert_to_fp8
    from fp8train.nn.linear import configure_execution
    from fp8train.nn.recipes import recipe
    from fp8train.training.config import load_config
    from fp8train.training.models.decoder import build_model

    cfg = load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=32",
                             "model.ffn_hidden=128", "model.vocab_size=256", "policy.min_features=16"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    r = recipe("block", **TILES) if name.startswith("block") else recipe(name.partition("-")[0])
    if name == "block-32":  # 32-position tiles across the 16-position shards: gathered in bf16 instead
        r = recipe("block", input_block=(1, 32), weight_block=(32, 32), grad_output_block=(1, 32))
    convert_to_fp8(model, r)
    configure_execution(model, emulated_dtype="fp32")  # fp32 GEMMs: the same results on every CPU
    return model


def _step_results(models, counters, batch):
    from fp8train.nn.linear import update_fp8_scales
    from fp8train.training.parallel.tp_mesh import reduce_partial_grads

    losses = []
    for model, counter in zip(models, counters):
        with counter, torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(batch, batch)
            loss.backward()
            reduce_partial_grads(model)
        losses.append(loss.detach())
    grads = [{n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
              for n, p in m.named_parameters()} for m in models]
    buffers = [{n: b for n, b in m.named_buffers() if "_amax" in n or "_scale" in n or "nonfinite" in n
                or "initialized" in n} for m in models]
    row = {"loss": torch.equal(*losses),
           "grads": [n for n in grads[0] if not torch.equal(grads[0][n], grads[1][n])],
           "grad_count": len(grads[0]),
           "buffers": [n for n in buffers[0] if not torch.equal(buffers[0][n], buffers[1][n])],
           "buffer_count": len(buffers[0])}
    for model in models:
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
                p.grad = None
        update_fp8_scales(model)
    return row


def _worker(rank: int, port: int, out: str, names: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    from fp8train.bench.collective_bytes import CollectiveBytes
    from fp8train.training.parallel.tp_mesh import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for name in names:
        fp8 = _model(name)
        high = copy.deepcopy(fp8)
        apply_tensor_parallel(fp8, mesh, sequence_parallel=True, fp8_gather=True)
        apply_tensor_parallel(high, mesh, sequence_parallel=True, fp8_gather=False)
        gen = torch.Generator().manual_seed(1)
        rows = []
        for step in range(3):
            counters = [CollectiveBytes(), CollectiveBytes()]
            batch = torch.randint(0, 256, (4, 32), generator=gen)
            row = _step_results([fp8, high], counters, batch)
            row["bytes"] = [[[c.kind, c.dtype, c.nbytes, c.backward, c.module] for c in counter.calls]
                            for counter in counters]
            rows.append(row)
        results[name] = rows
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.start_processes(_worker, args=(free, sys.argv[1], sys.argv[2:]), nprocs=2, start_method="spawn")
