"""``fp8train bench --sections experts``: one mixture-of-experts projection's forward+backward as an FP8 grouped
GEMM (nn/experts.py, per recipe) against the fastest high-precision grouped GEMM on the same machine: torch's
grouped GEMM (`F.grouped_mm`, where it runs on the device) and a loop of one GEMM per expert, each in bf16
and fp32. The shape is DeepSeek-like scaled to a CPU: 16 experts, K=1024, N=512, 8192 routed tokens, skewed
routing (expert e gets a share proportional to 0.8**e). Every contender's weight changes in place before each
timed call (as after an optimizer step), so each re-casts or re-quantizes it as in training; every contender keeps
fp32 master weights (the bf16 rows cast them each step, as autocast does); the FP8 rows run under bf16 autocast.
On CUDA the same contenders run (GFLOP/s in the table): the GPU section prepared for the H200, bf16 vs FP8.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fp8train.bench.harness import paired_ratio, side_by_side
from fp8train.bench.options import BenchOptions
from fp8train.nn.experts import Fp8GroupedLinear
from fp8train.nn.linear import update_fp8_scales

__all__ = ["bench_experts", "EXPERTS_SHAPE", "EXPERTS_TARGETS", "skewed_group_sizes"]

EXPERTS_SHAPE = (16, 1024, 512, 8192)   # experts, K, N, routed tokens
EXPERTS_TARGETS = {"tensorwise": 1.3, "block": 1.5}   # x the fastest high-precision grouped GEMM


def skewed_group_sizes(experts: int, tokens: int, decay: float = 0.8) -> list[int]:
    """Tokens per expert proportional to decay**e (the first expert ~5x the median at 16 experts)."""
    shares = [decay ** e for e in range(experts)]
    sizes = [int(tokens * s / sum(shares)) for s in shares]
    sizes[0] += tokens - sum(sizes)
    return sizes


def _grouped_mm_runs(device: str) -> bool:
    try:
        x = torch.randn(4, 16, device=device, dtype=torch.bfloat16)
        w = torch.randn(2, 16, 16, device=device, dtype=torch.bfloat16)
        F.grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([2, 4], dtype=torch.int32, device=device))
        return True
    except Exception:  # not built for this device / torch version: the per-expert loop is the baseline
        return False


def _high_precision(weight, x, grad, offs, sizes, dtype, grouped: bool):
    # fp32 master weights, as the FP8 contenders': the bf16 rows cast the weight each step (what autocast does for
    # nn.Linear; torch's grouped GEMM is not on autocast's lists) and their weight gradient comes back as fp32
    weight = weight.detach().clone().requires_grad_(True)
    x, grad = x.to(dtype), grad.to(dtype)

    def step():
        with torch.no_grad():
            weight.mul_(1.0)
        x_ = x.detach().requires_grad_(True)
        w = weight.to(dtype)
        if grouped:
            y = F.grouped_mm(x_, w.transpose(1, 2), offs=offs)
        else:
            y = torch.cat([x_e @ w_e.t() for x_e, w_e in zip(x_.split(sizes), w.unbind(0))])
        y.backward(grad)
        weight.grad = None
    return step


def _fp8(layer, x, grad, offs, device):
    # bf16 activations and gradients made once, as the high-precision rows' (no contender times a cast of them);
    # delayed scaling runs its per-step scale update too (a training step's share of its cost: steady state,
    # every expert on its stored scales after the first step)
    x, grad = x.bfloat16(), grad.bfloat16()
    delayed = layer.recipe.is_delayed

    def step():
        with torch.no_grad():
            layer.weight.mul_(1.0)
        x_ = x.detach().requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16):
            y = layer(x_, offs)
        y.backward(grad)
        layer.weight.grad = None
        if delayed:
            update_fp8_scales(layer)
    return step


def bench_experts(opts: BenchOptions, warmup: int, repeats: int, kernel: str) -> dict:
    experts, k, n, tokens = EXPERTS_SHAPE
    device = opts.device
    sizes = skewed_group_sizes(experts, tokens)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    torch.manual_seed(0)
    weight = torch.randn(experts, n, k, device=device) * k ** -0.5
    x, grad = torch.randn(tokens, k, device=device), torch.randn(tokens, n, device=device)
    grouped = _grouped_mm_runs(device)
    contenders = {}
    for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        if grouped:
            contenders[f"{label} grouped_mm"] = _high_precision(weight, x, grad, offs, sizes, dtype, True)
        contenders[f"{label} per-expert loop"] = _high_precision(weight, x, grad, offs, sizes, dtype, False)
    high_precision = list(contenders)
    layers = {}
    for name in opts.recipes:
        layer = layers[name] = Fp8GroupedLinear(experts, k, n, recipe=name, device=device)
        with torch.no_grad():
            layer.weight.copy_(weight)
        layer.scaling.configure(quantize_kernel=kernel)
        contenders[name] = _fp8(layer, x, grad, offs, device)
    timings = side_by_side(contenders, device, warmup, repeats)
    fastest = min(high_precision, key=lambda c: timings[c].median)
    flops = 6.0 * tokens * k * n
    rows = []
    for name, timing in timings.items():
        row = {"contender": name, **timing.summary(), "tflops": flops / timing.median / 1e12,
               **paired_ratio(timing, timings[fastest])}
        if name not in high_precision:
            row["target"] = EXPERTS_TARGETS["block" if name in ("block", "mxfp8", "rowwise") else "tensorwise"]
            # which kernel each GEMM reached (on CUDA: one grouped call or the per-expert loop, and why)
            row["gemm_paths"] = dict(layers[name].scaling.gemm_paths)
            row["grouped_paths"] = dict(layers[name].scaling.grouped_paths)
        rows.append(row)
    return {"shape": {"experts": experts, "k": k, "n": n, "tokens": tokens, "group_sizes": sizes},
            "fastest_high_precision": fastest, "grouped_mm_runs": grouped, "rows": rows}
