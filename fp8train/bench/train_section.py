"""``fp8train bench`` sections train and memory: one optimizer step (forward, backward, clip, AdamW, FP8 scale
update) of the decoder of the CPU validation recipe (CUDA: the ~1B recipe, smaller batch; any recipe with
``--train-config``, e.g. the GEMM-bound recipes/cpu_gemm_bound.yaml), bf16 vs each recipe (tokens/s, peak and
resident memory; on CPU an fp32 step too, the fast baseline where bf16 GEMMs have no hardware support); and the
bytes autograd saves for backward over one forward of it.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Callable

import torch
import torch.nn as nn

from fp8train.bench.harness import Timing, paired_ratio, side_by_side
from fp8train.bench.options import REPO_RECIPES, BenchOptions, log
from fp8train.nn.convert import convert_to_fp8
from fp8train.nn.linear import configure_execution, update_fp8_scales
from fp8train.nn.recipes import BASELINE_RECIPE, ScalingKind
from fp8train.training.config import fp8_recipe_from_config, layer_policy_from_config, load_config
from fp8train.training.data.corpus import build_data
from fp8train.training.models.decoder import build_model

__all__ = ["bench_train", "bench_memory", "saved_tensor_bytes"]


def _train_cfg(opts: BenchOptions, recipe_name: str):
    overrides = [f"fp8.recipe={recipe_name}", "data.max_bytes=2000000", "log.wandb=disabled"]
    if recipe_name == ScalingKind.MXFP8:  # its 1x32 blocks are fixed (OCP MX): the recipe file's block tiles are for `block`
        overrides += ["fp8.input_block=null", "fp8.weight_block=null", "fp8.grad_output_block=null"]
    path = opts.train_config
    if path is None:
        default = REPO_RECIPES / ("cpu_validate.yaml" if opts.device == "cpu" else "gpu_1b.yaml")
        path = str(default) if default.exists() else None
    if path is None:  # installed without the repo's recipes/: the CPU validation model, inline
        overrides += ["model.n_layers=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=64",
                      "train.batch_size=16"]
    if opts.device == "cuda":  # one micro-batch of the ~1B model per step (the recipe accumulates 16)
        overrides += [f"train.batch_size={4 if opts.quick else 8}", "train.grad_accum=1"]
    overrides += [f"train.device={opts.device}"]
    return load_config(path, overrides), path


def _build(cfg, device: str, kernel: str = "eager"):
    torch.manual_seed(cfg.train.seed)  # same initial weights for every contender
    with torch.device(device):  # initialize in place (a ~1B model is slow to initialize on the CPU)
        model = build_model(cfg.model)
    recipe = fp8_recipe_from_config(cfg)
    converted = 0
    if recipe is not None:
        converted = len(convert_to_fp8(model, recipe, layer_policy_from_config(cfg)).converted)
        configure_execution(model, quantize_kernel=kernel, emulated_dtype=cfg.fp8.emulated_dtype)
    model.to(device).train()
    return model, converted


def _train_step_fn(model, cfg, batches, device: str, autocast: bool = True):
    """One optimizer step as fp8train.training.loop does it (bf16 autocast, clip, AdamW, FP8 scale update), minus
    logging and evaluation; ``autocast=False``: the fp32 baseline. Cycles through ``batches`` so every contender
    sees the same data in the same order."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.train.lr,
                                  betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, foreach=False)
    state = {"step": 0}

    def step():
        x, y = batches[state["step"] % len(batches)]
        state["step"] += 1
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(x, y)
        loss.backward()
        if cfg.train.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_fp8_scales(model)
        state["loss"] = loss.detach()

    return step, optimizer, state


def _resident_bytes(model: nn.Module, optimizer) -> int:
    tensors = {t.data_ptr(): t.numel() * t.element_size()
               for t in list(model.parameters()) + list(model.buffers())}
    for st in optimizer.state.values():
        tensors.update({t.data_ptr(): t.numel() * t.element_size() for t in st.values()
                        if isinstance(t, torch.Tensor)})
    return sum(tensors.values())


def _step_peak_bytes(step: Callable, device: str) -> int:
    """Peak memory allocated during one step above what was allocated before it (transient: activations,
    gradients, FP8 copies). CUDA: the caching allocator's statistics; CPU: the profiler's allocation events."""
    if device == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile  # heavy to import: only here

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def bench_train(opts: BenchOptions, warmup: int, repeats: int, kernel: str = "eager") -> dict:
    """The train section. On a CPU without --threads, the step runs with the train config's `train.threads`
    (recipes/cpu_validate.yaml: 1, as its runs train), not torch's default; the threads used are reported."""
    cfg, _ = _train_cfg(opts, BASELINE_RECIPE)
    threads_before = torch.get_num_threads()
    if opts.device == "cpu" and not opts.threads and cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    try:
        result = _bench_train(opts, warmup, repeats, kernel)
    finally:
        torch.set_num_threads(threads_before)
    return result


def _bench_train(opts: BenchOptions, warmup: int, repeats: int, kernel: str) -> dict:
    cfg, path = _train_cfg(opts, BASELINE_RECIPE)
    data = build_data(cfg)
    n_batches = warmup + repeats
    batches = [tuple(t.to(opts.device) for t in data.train_batch(s)) for s in range(n_batches)]
    tokens = cfg.train.batch_size * cfg.model.seq_len
    steps, extras = {}, {}
    baselines = ("bf16", "fp32") if opts.device == "cpu" else ("bf16",)  # fp32: no autocast, nothing in FP8
    for name in (*baselines, *opts.recipes):
        cfg_r, _ = _train_cfg(opts, BASELINE_RECIPE if name in baselines else name)
        model, converted = _build(cfg_r, opts.device, kernel)
        step, optimizer, state = _train_step_fn(model, cfg_r, batches, opts.device, autocast=name != "fp32")
        steps[name] = step
        extras[name] = dict(model=model, optimizer=optimizer, state=state, converted=converted)
        if opts.device == "cuda":  # one ~1B model + AdamW state at a time on the GPU
            timing = side_by_side({name: step}, opts.device, warmup, repeats)[name]
            extras[name].update(timing=timing, peak=_step_peak_bytes(step, opts.device),
                                resident=_resident_bytes(model, optimizer), loss=float(state["loss"]))
            del steps[name], extras[name]["model"], extras[name]["optimizer"], model, optimizer, step
            gc.collect()
            torch.cuda.empty_cache()
    per_round = 1
    if opts.device != "cuda":
        per_round = _steps_per_round(steps["bf16"])
        rounds = {name: _repeated(step, per_round) for name, step in steps.items()}
        timings = {name: Timing([seconds / per_round for seconds in t.times])
                   for name, t in side_by_side(rounds, opts.device, warmup, repeats).items()}
        for name, ex in extras.items():
            ex.update(timing=timings[name], peak=_step_peak_bytes(steps[name], opts.device),
                      resident=_resident_bytes(ex["model"], ex["optimizer"]), loss=float(ex["state"]["loss"]))
    base = extras["bf16"]["timing"]
    rows = []
    for name, ex in extras.items():
        t = ex["timing"]
        rows.append({"contender": name, "tokens_per_s": tokens / t.median, "fp8_layers": ex["converted"],
                     "step_peak_mb": ex["peak"] / 2**20, "resident_mb": ex["resident"] / 2**20,
                     "last_loss": ex["loss"], **t.summary(), **paired_ratio(t, base)})
        if "fp32" in extras:
            fp32 = paired_ratio(t, extras["fp32"]["timing"])
            rows[-1].update(ratio_fp32=fp32["ratio"], ratio_fp32_q1=fp32["ratio_q1"], ratio_fp32_q3=fp32["ratio_q3"])
        if opts.device == "cuda":
            rows[-1]["speedup_vs_bf16"] = base.median / t.median
    log("train: " + ", ".join(f"{r['contender']} {r['tokens_per_s']:.0f} tok/s ({r['ratio']:.2f}x)" for r in rows))
    m = cfg.model
    return {"config": path or "built-in CPU validation model", "tokens_per_step": tokens,
            "threads": torch.get_num_threads() if opts.device == "cpu" else None,
            "steps_per_round": per_round if opts.device != "cuda" else 1,
            "model": {"n_layers": m.n_layers, "d_model": m.d_model, "seq_len": m.seq_len,
                      "batch_size": cfg.train.batch_size}, "rows": rows}


# A CPU round times several steps of each contender: one step of the 64-wide CPU recipe takes ~25 ms, where
# a scheduler tick, a page fault or a garbage collection moves one step's time by 10-20% and the median of 9
# one-step ratios moved by 0.1-0.15 between runs of the same tree (AMD EPYC Zen 4, 2 cores).
ROUND_SECONDS = 0.25  # at least this much of the bf16 step per round
MAX_STEPS_PER_ROUND = 16


def _steps_per_round(bf16_step: Callable) -> int:
    """Steps per timed round on a CPU: enough bf16 steps for ROUND_SECONDS (timed once, after a warm-up step)."""
    bf16_step()
    t0 = time.perf_counter()
    bf16_step()
    one = time.perf_counter() - t0
    return max(1, min(MAX_STEPS_PER_ROUND, math.ceil(ROUND_SECONDS / max(one, 1e-6))))


def _repeated(step: Callable, count: int) -> Callable:
    def steps():
        for _ in range(count):
            step()
    return steps


def saved_tensor_bytes(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: str) -> dict:
    """Bytes autograd keeps for backward over one forward (each storage counted once; parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen, by_dtype = set(), {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in params and storage.nbytes() > 0:
            seen.add(key)
            name = str(t.dtype).replace("torch.", "")
            by_dtype[name] = by_dtype.get(name, 0) + storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(device, dtype=torch.bfloat16):
        _, loss = model(x, y)
    loss.backward()  # leaves nothing behind for the next contender
    model.zero_grad(set_to_none=True)
    return {"total_bytes": sum(by_dtype.values()), "by_dtype": by_dtype}


def bench_memory(opts: BenchOptions) -> dict:
    cfg, _ = _train_cfg(opts, BASELINE_RECIPE)
    x, y = (t.to(opts.device) for t in build_data(cfg).train_batch(0))
    rows, base = [], None
    for name in ("bf16", *opts.recipes):
        cfg_r, _ = _train_cfg(opts, BASELINE_RECIPE if name == "bf16" else name)
        model, converted = _build(cfg_r, opts.device)
        saved = saved_tensor_bytes(model, x, y, opts.device)
        base = base or saved["total_bytes"]
        rows.append({"contender": name, "fp8_layers": converted, "saved_mb": saved["total_bytes"] / 2**20,
                     "ratio": saved["total_bytes"] / base, "saved_fraction": 1 - saved["total_bytes"] / base,
                     "by_dtype_mb": {k: v / 2**20 for k, v in saved["by_dtype"].items()}})
        del model
        gc.collect()
        if opts.device == "cuda":
            torch.cuda.empty_cache()
    log("memory: " + ", ".join(f"{r['contender']} {r['saved_mb']:.1f} MB" for r in rows))
    return {"tokens": int(x.numel()), "rows": rows}
