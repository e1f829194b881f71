"""``fp8train bench`` sections linear and ops: forward+backward of Fp8Linear per recipe against nn.Linear under
bf16 autocast, fp32 nn.Linear, and torchao's Float8Linear when torchao is installed (emulate=True on CPU); and
the number of aten ops each dispatches. In the linear section every contender's weight changes before each timed
call (an in-place multiply by 1, the same op for all), so each re-casts or re-quantizes its weight as it would
after every optimizer step.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from fp8train.bench.harness import count_input_reads, count_top_level_ops, paired_ratio, side_by_side
from fp8train.bench.options import GPU_PEAKS, SHAPES, BenchOptions, log
from fp8train.nn.linear import Fp8Linear, configure_execution, update_fp8_scales

__all__ = ["bench_linear", "bench_ops", "torchao_linear"]


def torchao_linear(linear: nn.Linear, device: str):
    """torchao's Float8Linear (tensorwise dynamic) over a copy of ``linear``, or (None, why not)."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except Exception as err:  # ImportError, or a torchao built for another torch
        return None, f"torchao not available ({type(err).__name__}: {err}); pip install torchao to compare"
    try:
        wrapper = nn.Sequential(copy.deepcopy(linear))
        convert_to_float8_training(wrapper, config=Float8LinearConfig(emulate=device != "cuda"))
        return wrapper, None
    except Exception as err:
        return None, f"torchao Float8Linear failed: {type(err).__name__}: {err}"


def _fwd_bwd(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, autocast: bool, device: str):
    weights = [p for p in module.parameters() if p.dim() == 2]

    def step():
        # Every contender's weight changes in place before each call, as after an optimizer step: the FP8 layers
        # then re-quantize it (their cache keys on the weight's version) just as bf16 autocast re-casts it, so
        # no contender times a weight cast it would not pay in training (one micro-batch per step: the worst
        # case for FP8; with gradient accumulation the FP8 copy is reused across micro-batches).
        with torch.no_grad():
            # one multi-tensor op for the whole list: torch's foreach kernels have no public name
            torch._foreach_mul_(weights, 1.0)
        x_ = x.detach().requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = module(x_)
        y.backward(grad.to(y.dtype))
        module.zero_grad(set_to_none=True)
    return step


def bench_linear(opts: BenchOptions, warmup: int, repeats: int, notes: list, kernel: str = "eager") -> dict:
    shapes = opts.shapes or SHAPES[(opts.device, opts.quick)]
    rows_out, torchao_note = [], None
    for m, k, n in shapes:
        torch.manual_seed(0)
        linear = nn.Linear(k, n, bias=False, device=opts.device)
        x = torch.randn(m, k, device=opts.device)
        grad = torch.randn(m, n, device=opts.device)
        x_bf16, grad_bf16 = x.bfloat16(), grad.bfloat16()
        contenders = {
            "bf16": _fwd_bwd(linear, x_bf16, grad_bf16, True, opts.device),
            "fp32": _fwd_bwd(linear, x, grad, False, opts.device),
        }
        fp8_layers = {}
        for name in opts.recipes:
            layer = fp8_layers[name] = Fp8Linear.from_linear(copy.deepcopy(linear), name)
            configure_execution(layer, quantize_kernel=kernel)
            contenders[name] = _fwd_bwd(layer, x_bf16, grad_bf16, True, opts.device)
        ao, why = torchao_linear(linear, opts.device) if opts.torchao else (None, "torchao skipped (--no-torchao)")
        if ao is not None:
            contenders["torchao"] = _fwd_bwd(ao, x_bf16, grad_bf16, True, opts.device)
        torchao_note = torchao_note or why
        timings = side_by_side(contenders, opts.device, warmup, repeats)
        flops = 6.0 * m * k * n
        for name, timing in timings.items():
            row = {"shape": [m, k, n], "contender": name, "tflops": flops / timing.median / 1e12,
                   **timing.summary(), **paired_ratio(timing, timings["bf16"])}
            fp32 = paired_ratio(timing, timings["fp32"])
            row.update(ratio_fp32=fp32["ratio"], ratio_fp32_q1=fp32["ratio_q1"], ratio_fp32_q3=fp32["ratio_q3"])
            # the target's baseline: the faster high-precision Linear on this machine (fp32 or bf16 autocast)
            fastest = min(("bf16", "fp32"), key=lambda c: timings[c].median)
            row.update(fastest_hp=fastest, ratio_fastest_hp=paired_ratio(timing, timings[fastest])["ratio"])
            if "torchao" in timings:
                row["ratio_torchao"] = timing.median / timings["torchao"].median
            if name in fp8_layers:  # which kernel each GEMM reached: "scaled_mm:<kind>", "fallback:...", "emulated"
                row["gemm_paths"] = dict(fp8_layers[name].gemm_paths)
                row["all_gemms_fp8_kernel"] = all(p.startswith("scaled_mm:") for p in row["gemm_paths"].values())
            if opts.device == "cuda":
                row.update(_gpu_efficiency(row, timings))
            rows_out.append(row)
        log(f"linear {m}x{k}x{n}: " + ", ".join(
            f"{n_} {t.median * 1e3:.1f} ms ({t.median / timings['bf16'].median:.2f}x bf16)"
            for n_, t in timings.items()))
    if torchao_note:
        notes.append(torchao_note)
    return {"rows": rows_out}


def _gpu_efficiency(row: dict, timings: dict) -> dict:
    """On CUDA: speedup over bf16, that speedup as a % of the ideal 2x of FP8 tensor cores, % of dense peak."""
    speedup = 1.0 / row["ratio"]
    out = {"speedup_vs_bf16": speedup, "pct_of_2x": 100.0 * speedup / 2.0}
    name = torch.cuda.get_device_name(0)
    peak = next((p for key, p in GPU_PEAKS.items() if key in name), None)
    if peak is not None:
        is_fp8 = row["contender"] not in ("bf16", "fp32")
        out["pct_of_peak"] = 100.0 * row["tflops"] / (peak[1] if is_fp8 else peak[0])
    return out


def bench_ops(opts: BenchOptions, kernel: str = "eager") -> dict:
    """Top-level aten ops of one forward + `.float().sum().backward()` of a 512x256 -> 256 layer (bf16 autocast)
    per recipe, with the weight's FP8 copy reused (a later micro-batch) and made afresh (the first micro-batch
    after an optimizer step); and of one delayed-scaling update for 1 and 8 layers (stacked: independent of the
    layer count). ``input_reads``: the ops of one forward (fp32, no autocast, steady state) that read the input:
    its passes over memory (delayed scaling casts with its known scale and takes the amax in that same pass)."""
    torch.manual_seed(0)
    x = torch.randn(512, 256, device=opts.device)

    def fwd_bwd(layer, fresh: bool):
        def step():
            if fresh:  # what an optimizer step does to the weight: an in-place change
                with torch.no_grad():
                    layer.weight.mul_(1.0)
            with torch.autocast(opts.device, dtype=torch.bfloat16):
                y = layer(x.detach().requires_grad_(True))
            y.float().sum().backward()
        return step

    base = nn.Linear(256, 256, device=opts.device)
    rows = [{"contender": "nn.Linear bf16", "ops": count_top_level_ops(fwd_bwd(base, False)), "ops_fresh_weight": None,
             "input_reads": count_input_reads(lambda: base(x), x)}]
    for name in opts.recipes:
        layer = Fp8Linear(256, 256, recipe=name, device=opts.device)
        configure_execution(layer, quantize_kernel=kernel)
        fwd_bwd(layer, False)()
        update_fp8_scales(layer)  # steady state: delayed scales initialized
        fwd_bwd(layer, True)()
        layer(x)  # (the weight's FP8 copy made: only the input is read below)
        rows.append({"contender": name, "ops": count_top_level_ops(fwd_bwd(layer, False)),
                     # minus the in-place weight change itself (one op, the optimizer's, not the layer's)
                     "ops_fresh_weight": count_top_level_ops(fwd_bwd(layer, True)) - 1,
                     "input_reads": count_input_reads(lambda: layer(x), x)})
    update = {}
    for n_layers in (1, 8):
        model = nn.Sequential(*[Fp8Linear(256, 256, recipe="delayed", device=opts.device) for _ in range(n_layers)])
        model(x).float().sum().backward()
        update[n_layers] = count_top_level_ops(lambda: update_fp8_scales(model))
    log("ops: " + ", ".join(f"{r['contender']} {r['ops']}" for r in rows) + f"; delayed update {update}")
    return {"rows": rows, "delayed_update_ops": {str(k): v for k, v in update.items()}, "shape": [512, 256, 256]}
