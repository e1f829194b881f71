"""``fp8train bench``: quantize, Fp8Linear, train-step and activation-memory benchmarks, side by side with bf16.

Every figure is measured in ONE process, contenders interleaved round by round (round r runs every contender
once), after a warm-up, over several repeats: we report the median time, its spread (min-max and IQR) and the
ratio to the baseline with the IQR of the per-round (paired) ratios. Interleaving matters on a shared CPU: load
from other processes then hits every contender alike, so ratios stay meaningful when absolute times do not.

Sections (``--sections``):
- quant:  quantize throughput (G elements/s) per granularity and format: the compiled fused kernel (compile
          time reported separately, never inside the timing), the same function eager, and a naive eager chain
          (amax, div, clamp, .to(float8)) as the reference the speedups are relative to.
- linear: forward+backward of Fp8Linear per recipe against nn.Linear under bf16 autocast (the baseline), fp32
          nn.Linear, and torchao's Float8Linear when torchao is installed (emulate=True on CPU).
- train:  one optimizer step (forward, backward, clip, AdamW, FP8 scale update) of the decoder of the CPU
          validation recipe (CUDA: the ~1B recipe, smaller batch), bf16 vs each recipe: tokens/s and memory.
- memory: bytes autograd saves for backward over one forward of that decoder (saved_tensors_hooks), bf16 vs FP8.

Why the bf16 baseline is unusually slow on CPU: without avx512_bf16/AMX, torch's CPU bf16 GEMM is a slow path
(~17 GFLOP/s unloaded vs ~78 for fp32), and the grad_input GEMM of a bf16 nn.Linear (grad_output @ weight, a
row-major right operand) is slower still (~0.4 GFLOP/s measured). The emulated FP8 backend computes in fp32,
so ratios to bf16 flatter FP8 on CPU; the fp32 column is the honest comparison there and both are printed.

Allocator: large fresh allocations page-fault heavily on the reference VM, so on CPU the bench asks glibc
(mallopt) to keep freed memory instead of returning it to the OS; it applies to every contender and the output
says so. ``--no-malloc-tuning`` turns it off.
"""

from __future__ import annotations

import copy
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn

from fp8train.bench.distributed import bench_distributed, format_distributed
from fp8train.nn.recipes import RECIPE_NAMES

__all__ = ["parse_shapes", "run_bench", "machine_info", "format_report", "SECTIONS", "add_cli_arguments",
           "cli_main"]

SECTIONS = ("quant", "linear", "train", "memory")
# Not in the default run: launches 2 processes (fp8train.bench.distributed; ~1 minute on 2 CPU cores).
OPTIONAL_SECTIONS = ("distributed",)
RECIPES = RECIPE_NAMES
# (M, K, N): input (M, K), weight (N, K). The full CPU list stops at 4096x1024x1024 (the target shape): a bf16
# nn.Linear fwd+bwd already takes ~20 s there on the reference box (see the module docstring).
SHAPES = {
    ("cpu", False): [(1024, 256, 256), (2048, 512, 512), (4096, 1024, 1024)],
    ("cpu", True): [(1024, 256, 256), (2048, 512, 512)],
    ("cuda", False): [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 8192, 8192)],
    ("cuda", True): [(4096, 4096, 4096), (8192, 8192, 8192)],
}
QUANT_LAYOUTS = [("tensor", (1, 128)), ("row", (1, 128)), ("block", (1, 128)), ("block", (128, 128))]
QUANT_FORMATS = ("e4m3fn", "e5m2")
# Dense (no sparsity) tensor-core peaks in TFLOP/s from vendor datasheets: (bf16, fp8). Matched by substring.
GPU_PEAKS = {"H100": (989.0, 1979.0), "H200": (989.0, 1979.0), "H800": (989.0, 1979.0), "GH200": (989.0, 1979.0),
             "B200": (2250.0, 4500.0), "L40S": (362.0, 733.0), "L4": (121.0, 242.5)}
REPO_RECIPES = Path(__file__).resolve().parents[2] / "recipes"


# ------------------------------------------------------------------------------------------------------------
# Options and argument parsing
# ------------------------------------------------------------------------------------------------------------
@dataclass
class BenchOptions:
    device: str = "cpu"
    """'cpu' or 'cuda'."""
    quick: bool = False
    """Smaller sizes, fewer shapes and repeats (CPU: under 3 minutes)."""
    shapes: Optional[list] = None
    """Linear shapes (M, K, N); None = the default list for the device and mode."""
    recipes: tuple = RECIPES
    """FP8 recipes to compare with bf16."""
    sections: tuple = SECTIONS
    """Which sections run."""
    compile: str = "auto"
    """FP8 quantize kernel in linear/train: 'on' (compiled_select), 'off' (eager), or 'auto' (off for --quick
    on CPU, where the compiled kernel does not pay for its compile time, on otherwise)."""
    malloc_tuning: bool = True
    """CPU: keep freed memory in the process (glibc mallopt) so repeats do not page-fault."""
    train_config: Optional[str] = None
    """Recipe YAML whose model/batch the train and memory sections use; None = the device's default."""
    quant_numel: Optional[int] = None
    """Elements quantized per call; None = 16M (quick: 4M)."""
    warmup: Optional[int] = None
    repeats: Optional[int] = None
    threads: Optional[int] = None
    """torch intra-op threads on CPU; None = leave torch's default."""
    torchao: bool = True
    """Compare with torchao's Float8Linear when it is installed."""
    out: Optional[str] = None
    """JSON file, rewritten after every section (so a run cut short by a timeout still leaves results)."""


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'4096x1024x1024,1024x256x256' -> [(4096, 1024, 1024), (1024, 256, 256)]; ValueError naming a bad item."""
    shapes = []
    for item in (s.strip() for s in str(text).split(",")):
        parts = item.lower().split("x")
        try:
            dims = tuple(int(p) for p in parts)
        except ValueError:
            dims = ()
        if len(dims) != 3 or any(d <= 0 for d in dims):
            raise ValueError(f"--shapes: cannot parse {item!r}; expected MxKxN with three positive ints, "
                             "e.g. 4096x1024x1024 (input M x K, weight N x K), comma-separated")
        shapes.append(dims)
    return shapes


def _parse_list(text: str, allowed: tuple, key: str) -> tuple:
    items = tuple(s.strip() for s in str(text).split(",") if s.strip())
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise ValueError(f"{key}: {', '.join(bad) or repr(text)} not allowed; choose from {', '.join(allowed)}")
    return items


# ------------------------------------------------------------------------------------------------------------
# Machine, allocator, timing
# ------------------------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: str) -> dict:
    info = {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
        "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None,
        "device": device, "torchao": _torchao_version(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_capability=f"{props.major}.{props.minor}", cuda=torch.version.cuda,
                    gpu_memory_gb=round(props.total_memory / 2**30, 1))
    return info


def _torchao_version() -> Optional[str]:
    try:
        import importlib.metadata as md
        return md.version("torchao")
    except Exception:
        return None


def enable_malloc_reuse() -> bool:
    """Ask glibc to keep freed memory in the heap (no mmap for big blocks, no trimming), so a repeated run reuses
    pages instead of page-faulting fresh ones. True when glibc accepted it."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
    ok = libc.mallopt(M_MMAP_MAX, 0) == 1  # big blocks come from the heap too, so they are kept and reused
    ok &= libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) == 1
    ok &= libc.mallopt(M_TRIM_THRESHOLD, -1) == 1  # never give freed heap memory back
    return bool(ok)


@dataclass
class Timing:
    """Seconds per call over the timed rounds."""

    times: list

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    def summary(self) -> dict:
        q1, _, q3 = _quartiles(self.times)
        return {"median_s": self.median, "min_s": min(self.times), "max_s": max(self.times), "q1_s": q1,
                "q3_s": q3, "repeats": len(self.times)}


def _quartiles(values: list) -> tuple[float, float, float]:
    if len(values) < 2:
        v = values[0]
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[1], q[2]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time_call(fn: Callable, device: str) -> float:
    if device == "cuda":  # CUDA events: GPU time of the call, launched after everything before it finished
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def side_by_side(contenders: dict, device: str, warmup: int, repeats: int,
                 first_call: Optional[dict] = None) -> dict:
    """Time every contender (name -> zero-arg callable) ``repeats`` times, interleaved round by round, after
    ``warmup`` untimed calls each. ``first_call`` (a dict) receives each contender's first-call seconds (that
    is where a torch.compile happens), so the caller can report compile time apart from the timing."""
    for name, fn in contenders.items():
        seconds = _time_call(fn, device)
        if first_call is not None:
            first_call[name] = seconds
        for _ in range(max(warmup - 1, 0)):
            fn()
        _sync(device)
    times = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            times[name].append(_time_call(fn, device))
    return {name: Timing(t) for name, t in times.items()}


def _ratio(timing: Timing, base: Optional[Timing]) -> dict:
    """Time ratio to the baseline: median and IQR of the per-round (paired) ratios. Pairing cancels load that
    drifts between rounds, which the ratio of the two medians would not."""
    if base is None:
        return {"ratio": None, "ratio_q1": None, "ratio_q3": None}
    paired = [a / b for a, b in zip(timing.times, base.times)]
    q1, median, q3 = _quartiles(paired)
    return {"ratio": median, "ratio_q1": q1, "ratio_q3": q3}


def _resolve_compile(opts: BenchOptions) -> tuple[bool, str]:
    if opts.compile in ("on", "off"):
        return opts.compile == "on", f"--compile {opts.compile}"
    if opts.quick and opts.device == "cpu":
        return False, "auto: eager for --quick on CPU (compiled quantize is not faster here; compiles cost s)"
    return True, "auto: compiled (fp8train's default path)"


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------------
# Section: quantize throughput
# ------------------------------------------------------------------------------------------------------------
def _naive_quantize(x: torch.Tensor, fmt, granularity: str, block: tuple[int, int]) -> torch.Tensor:
    """The textbook eager chain: amax, scale, divide, clamp, torch's float8 cast (the reference)."""
    if granularity == "tensor":
        amax = x.abs().max()
    elif granularity == "row":
        amax = x.abs().amax(dim=-1, keepdim=True)
    else:
        rows, cols = x.shape
        br, bc = block
        tiles = x.reshape(rows // br, br, cols // bc, bc)
        amax = tiles.abs().amax(dim=(1, 3), keepdim=True)
        scale = (amax / fmt.max).clamp(min=1e-30)
        return (tiles / scale).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype).reshape(rows, cols)
    scale = (amax / fmt.max).clamp(min=1e-30)
    return (x / scale).clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)


def bench_quant(opts: BenchOptions, warmup: int, repeats: int) -> dict:
    from fp8train.numerics.formats import get_format
    from fp8train.numerics.quant import quantize

    numel = opts.quant_numel or ((1 << 22) if opts.quick else (1 << 24))
    cols = 4096 if numel >= 4096 * 128 else 1024
    rows = max(numel // cols // 128, 1) * 128
    x = torch.randn(rows, cols, device=opts.device)
    numel = x.numel()
    # --quick on CPU: both formats tensorwise, e4m3fn at the other granularities (each compile costs seconds).
    configs = [(g, b, f) for g, b in QUANT_LAYOUTS for f in QUANT_FORMATS
               if not (opts.quick and f != "e4m3fn" and g != "tensor")]
    rows_out = []
    for granularity, block, fmt_name in configs:
        fmt = get_format(fmt_name)
        label = granularity if granularity != "block" else f"block {block[0]}x{block[1]}"

        def compiled(g=granularity, b=block, f=fmt_name):
            return quantize(x, f, granularity=g, block=b, kernel="compiled_select")

        def eager(g=granularity, b=block, f=fmt_name):
            return quantize(x, f, granularity=g, block=b, kernel="eager")

        def naive(g=granularity, b=block, f=fmt):
            return _naive_quantize(x, f, g, b)

        contenders = {"naive eager": naive, "fp8train eager": eager}
        if granularity == "tensor" and fmt_name == "e4m3fn":  # what the memory system allows right now
            contenders["reference: amax only (1 read)"] = lambda: torch.amax(x)
        if opts.compile != "off":
            contenders["fp8train compiled"] = compiled
        first = {}
        timings = side_by_side(contenders, opts.device, warmup, repeats, first_call=first)
        base = timings["naive eager"]
        for name, timing in timings.items():
            rows_out.append({
                "granularity": label, "format": fmt_name, "path": name, "numel": numel,
                "gelem_per_s": numel / timing.median / 1e9,
                "speedup_vs_naive": 1.0 / _ratio(timing, base)["ratio"],
                "compile_s": max(first[name] - timing.median, 0.0) if name.endswith("compiled") else None,
                **timing.summary(), **_ratio(timing, base),
            })
        _log(f"quant {label} {fmt_name}: " + ", ".join(
            f"{n} {numel / t.median / 1e9:.2f} G el/s" for n, t in timings.items()))
    return {"numel": numel, "shape": list(x.shape), "rows": rows_out}


# ------------------------------------------------------------------------------------------------------------
# Section: Fp8Linear forward + backward
# ------------------------------------------------------------------------------------------------------------
def _torchao_linear(linear: nn.Linear, device: str):
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
    def step():
        x_ = x.detach().requires_grad_(True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = module(x_)
        y.backward(grad.to(y.dtype))
        module.zero_grad(set_to_none=True)
    return step


def bench_linear(opts: BenchOptions, warmup: int, repeats: int, notes: list, compiled: bool = False) -> dict:
    from fp8train.nn.linear import Fp8Linear, configure_execution

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
            configure_execution(layer, quantize_kernel="compiled_select" if compiled else "eager")
            contenders[name] = _fwd_bwd(layer, x_bf16, grad_bf16, True, opts.device)
        ao, why = _torchao_linear(linear, opts.device) if opts.torchao else (None, "torchao skipped (--no-torchao)")
        if ao is not None:
            contenders["torchao"] = _fwd_bwd(ao, x_bf16, grad_bf16, True, opts.device)
        torchao_note = torchao_note or why
        timings = side_by_side(contenders, opts.device, warmup, repeats)
        flops = 6.0 * m * k * n
        for name, timing in timings.items():
            row = {"shape": [m, k, n], "contender": name, "tflops": flops / timing.median / 1e12,
                   **timing.summary(), **_ratio(timing, timings["bf16"])}
            fp32 = _ratio(timing, timings["fp32"])
            row.update(ratio_fp32=fp32["ratio"], ratio_fp32_q1=fp32["ratio_q1"], ratio_fp32_q3=fp32["ratio_q3"])
            if "torchao" in timings:
                row["ratio_torchao"] = timing.median / timings["torchao"].median
            if name in fp8_layers:  # which kernel each GEMM reached: "scaled_mm:<kind>", "fallback:...", "emulated"
                row["gemm_paths"] = dict(fp8_layers[name].gemm_paths)
                row["all_gemms_fp8_kernel"] = all(p.startswith("scaled_mm:") for p in row["gemm_paths"].values())
            if opts.device == "cuda":
                row.update(_gpu_efficiency(row, timings))
            rows_out.append(row)
        _log(f"linear {m}x{k}x{n}: " + ", ".join(
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


# ------------------------------------------------------------------------------------------------------------
# Sections: end-to-end train step and activation memory
# ------------------------------------------------------------------------------------------------------------
def _train_cfg(opts: BenchOptions, recipe_name: str):
    from fp8train.training.config import load_config

    overrides = [f"fp8.recipe={recipe_name}", "data.max_bytes=2000000", "log.wandb=disabled"]
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


def _build(cfg, device: str):
    from fp8train.training.config import fp8_recipe_from_config, layer_policy_from_config
    from fp8train.nn.convert import convert_to_fp8
    from fp8train.training.model import build_model

    torch.manual_seed(cfg.train.seed)  # same initial weights for every contender
    with torch.device(device):  # initialize in place (a ~1B model is slow to initialize on the CPU)
        model = build_model(cfg.model)
    recipe = fp8_recipe_from_config(cfg)
    converted = 0
    if recipe is not None:
        converted = len(convert_to_fp8(model, recipe, layer_policy_from_config(cfg)).converted)
    model.to(device).train()
    return model, converted


def _train_step_fn(model, cfg, batches, device: str):
    """One optimizer step as fp8train.training.loop does it (bf16 autocast, clip, AdamW, FP8 scale update), minus
    logging and evaluation. Cycles through ``batches`` so every contender sees the same data in the same order."""
    from fp8train.nn.linear import update_fp8_scales

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.train.lr,
                                  betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, foreach=False)
    state = {"step": 0}

    def step():
        x, y = batches[state["step"] % len(batches)]
        state["step"] += 1
        with torch.autocast(device, dtype=torch.bfloat16):
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
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def bench_train(opts: BenchOptions, warmup: int, repeats: int, compiled: bool = False) -> dict:
    from fp8train.nn.linear import configure_execution

    from fp8train.training.data import build_data

    cfg, path = _train_cfg(opts, "none")
    data = build_data(cfg)
    n_batches = warmup + repeats
    batches = [tuple(t.to(opts.device) for t in data.train_batch(s)) for s in range(n_batches)]
    tokens = cfg.train.batch_size * cfg.model.seq_len
    steps, extras = {}, {}
    for name in ("bf16", *opts.recipes):
        cfg_r, _ = _train_cfg(opts, "none" if name == "bf16" else name)
        model, converted = _build(cfg_r, opts.device)
        configure_execution(model, quantize_kernel="compiled_select" if compiled else "eager")
        step, optimizer, state = _train_step_fn(model, cfg_r, batches, opts.device)
        steps[name] = step
        extras[name] = dict(model=model, optimizer=optimizer, state=state, converted=converted)
        if opts.device == "cuda":  # one ~1B model + AdamW state at a time on the GPU
            timing = side_by_side({name: step}, opts.device, warmup, repeats)[name]
            extras[name].update(timing=timing, peak=_step_peak_bytes(step, opts.device),
                                resident=_resident_bytes(model, optimizer), loss=float(state["loss"]))
            del steps[name], extras[name]["model"], extras[name]["optimizer"], model, optimizer, step
            gc.collect()
            torch.cuda.empty_cache()
    if opts.device != "cuda":
        timings = side_by_side(steps, opts.device, warmup, repeats)
        for name, ex in extras.items():
            ex.update(timing=timings[name], peak=_step_peak_bytes(steps[name], opts.device),
                      resident=_resident_bytes(ex["model"], ex["optimizer"]), loss=float(ex["state"]["loss"]))
    base = extras["bf16"]["timing"]
    rows = []
    for name, ex in extras.items():
        t = ex["timing"]
        rows.append({"contender": name, "tokens_per_s": tokens / t.median, "fp8_layers": ex["converted"],
                     "step_peak_mb": ex["peak"] / 2**20, "resident_mb": ex["resident"] / 2**20,
                     "last_loss": ex["loss"], **t.summary(), **_ratio(t, base)})
        if opts.device == "cuda":
            rows[-1]["speedup_vs_bf16"] = base.median / t.median
    _log("train: " + ", ".join(f"{r['contender']} {r['tokens_per_s']:.0f} tok/s ({r['ratio']:.2f}x)" for r in rows))
    m = cfg.model
    return {"config": path or "built-in CPU validation model", "tokens_per_step": tokens,
            "model": {"n_layers": m.n_layers, "d_model": m.d_model, "seq_len": m.seq_len,
                      "batch_size": cfg.train.batch_size}, "rows": rows}


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
    from fp8train.training.data import build_data

    cfg, _ = _train_cfg(opts, "none")
    x, y = (t.to(opts.device) for t in build_data(cfg).train_batch(0))
    rows, base = [], None
    for name in ("bf16", *opts.recipes):
        cfg_r, _ = _train_cfg(opts, "none" if name == "bf16" else name)
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
    _log("memory: " + ", ".join(f"{r['contender']} {r['saved_mb']:.1f} MB" for r in rows))
    return {"tokens": int(x.numel()), "rows": rows}


# ------------------------------------------------------------------------------------------------------------
# Targets
# ------------------------------------------------------------------------------------------------------------
def check_targets(results: dict, device: str) -> list[dict]:
    """The issue's targets against what this run measured (met: None when the figure was not measured)."""
    out = []

    def target(name, value, op, threshold, note=""):
        met = None if value is None else (value >= threshold if op == ">=" else value <= threshold)
        out.append({"target": name, "value": value, "op": op, "threshold": threshold, "met": met, "note": note})

    sections = results.get("sections", {})
    quant = {(r["granularity"], r["format"], r["path"]): r for r in sections.get("quant", {}).get("rows", [])}
    linear = {(tuple(r["shape"]), r["contender"]): r for r in sections.get("linear", {}).get("rows", [])}
    train = {r["contender"]: r for r in sections.get("train", {}).get("rows", [])}
    if device == "cpu":
        for (gran, fmt, path), r in quant.items():
            if path == "fp8train compiled":
                target(f"quantize {gran} {fmt} compiled (G el/s)", r["gelem_per_s"], ">=",
                       3.0 if gran == "tensor" else 1.5)
        for name in RECIPES:
            r = linear.get(((4096, 1024, 1024), name))
            target(f"Fp8Linear {name} fwd+bwd 4096x1024x1024 (x bf16)", r and r["ratio"], "<=", 1.3,
                   "" if r is None else f"{r['ratio_fp32']:.2f}x fp32")
        for name in RECIPES:
            r = train.get(name)
            target(f"train step {name} (x bf16)", r and r["ratio"], "<=",
                   1.3 if name in ("delayed", "current") else 1.5)
    else:
        for name in ("delayed", "current"):
            r = linear.get(((8192, 8192, 8192), name))
            target(f"Fp8Linear {name} fwd+bwd 8192^3 speedup vs bf16", r and r["speedup_vs_bf16"], ">=", 1.5,
                   "" if r is None else f"{r['pct_of_2x']:.0f}% of the 2x FP8 ideal")
            ao = linear.get(((8192, 8192, 8192), "torchao"))
            target(f"Fp8Linear {name} 8192^3 time / torchao tensorwise", r and ao and r["ratio_torchao"],
                   "<=", 1.0, "" if ao else "torchao not measured")
        for name in ("delayed", "current"):
            r = train.get(name)
            target(f"train step {name} speedup vs bf16 (~1B recipe)", r and r.get("speedup_vs_bf16"), ">=", 1.2)
    return out


# ------------------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------------------
def _fmt_ratio(r: dict, key: str = "ratio") -> str:
    if r.get(key) is None:
        return "-"
    q1, q3 = r.get(f"{key}_q1"), r.get(f"{key}_q3")
    return f"{r[key]:.2f}x" + (f" [{q1:.2f}-{q3:.2f}]" if q1 is not None else "")


def _table(header: list, rows: list) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def format_report(results: dict) -> str:
    m, parts = results["machine"], []
    parts.append(f"machine: {m['cpu']}, {m['cores']} cores ({m['torch_threads']} torch threads), torch "
                 f"{m['torch']}, python {m['python']}, load average {m['load_average']}"
                 + (f"; GPU {m['gpu']} (sm{m['gpu_capability']}, CUDA {m['cuda']})" if "gpu" in m else ""))
    s = results["settings"]
    parts.append(f"settings: device {s['device']}, quick={s['quick']}, warm-up {s['warmup']}, repeats "
                 f"{s['repeats']} (median; spreads are IQR of paired per-round ratios), contenders interleaved "
                 f"round by round; malloc reuse (glibc mallopt, all contenders): {s['malloc_tuning']}; "
                 f"linear/train quantize path: {s['fp8_path']}")
    sec = results["sections"]
    if "quant" in sec:
        q = sec["quant"]
        rows = [[r["granularity"], r["format"], r["path"], f"{r['gelem_per_s']:.2f}",
                 f"{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}", f"{r['speedup_vs_naive']:.2f}x",
                 "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"] for r in q["rows"]]
        parts.append(f"\nquantize, {q['numel'] / 2**20:.0f}M fp32 elements {tuple(q['shape'])}\n" + _table(
            ["granularity", "format", "path", "G el/s", "min-max ms", "vs naive", "compile s"], rows))
    if "linear" in sec:
        rows = [["x".join(map(str, r["shape"])), r["contender"], f"{r['median_s'] * 1e3:.1f}",
                 f"{r['q1_s'] * 1e3:.1f}-{r['q3_s'] * 1e3:.1f}", f"{r['tflops'] * 1e3:.1f}", _fmt_ratio(r),
                 _fmt_ratio(r, "ratio_fp32"), "-" if r.get("ratio_torchao") is None else f"{r['ratio_torchao']:.2f}x"]
                + ([f"{r['pct_of_2x']:.0f}%", "-" if r.get("pct_of_peak") is None else f"{r['pct_of_peak']:.0f}%"]
                   if "pct_of_2x" in r else []) for r in sec["linear"]["rows"]]
        header = ["MxKxN", "contender", "ms", "IQR ms", "GFLOP/s", "x bf16 [IQR]", "x fp32 [IQR]", "x torchao"]
        if any("pct_of_2x" in r for r in sec["linear"]["rows"]):
            header += ["% of 2x", "% of peak"]
        parts.append("\nlinear forward+backward (bf16 = nn.Linear under bf16 autocast; FP8 rows under autocast "
                     "too)\n" + _table(header, rows))
        kernels = {r["contender"]: r["gemm_paths"] for r in sec["linear"]["rows"] if r.get("gemm_paths")}
        parts += [f"  {name} GEMMs: " + ", ".join(f"{g} {p}" for g, p in paths.items())
                  for name, paths in kernels.items()]
    if "train" in sec:
        t = sec["train"]
        rows = [[r["contender"], r["fp8_layers"], f"{r['median_s'] * 1e3:.1f}",
                 f"{r['q1_s'] * 1e3:.1f}-{r['q3_s'] * 1e3:.1f}", f"{r['tokens_per_s']:.0f}", _fmt_ratio(r),
                 f"{r['step_peak_mb']:.1f}", f"{r['resident_mb']:.1f}"] for r in t["rows"]]
        md = t["model"]
        parts.append(f"\ntrain step ({t['config']}: {md['n_layers']} layers, d_model {md['d_model']}, "
                     f"{md['batch_size']}x{md['seq_len']} tokens)\n" + _table(
                         ["contender", "fp8 layers", "ms/step", "IQR ms", "tokens/s", "x bf16 [IQR]",
                          "step peak MB", "resident MB"], rows))
    if "memory" in sec:
        rows = [[r["contender"], f"{r['saved_mb']:.2f}", f"{r['ratio']:.2f}x", f"{100 * r['saved_fraction']:.0f}%",
                 ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["by_dtype_mb"].items()))]
                for r in sec["memory"]["rows"]]
        parts.append(f"\nactivation memory saved for backward, one forward of {sec['memory']['tokens']} tokens\n"
                     + _table(["contender", "saved MB", "x bf16", "saved vs bf16", "by dtype (MB)"], rows))
    if "distributed" in sec:
        parts.append(format_distributed(sec["distributed"]))
    if results.get("targets"):
        rows = [[t["target"], "-" if t["value"] is None else f"{t['value']:.2f}", f"{t['op']} {t['threshold']}",
                 {True: "met", False: "MISSED", None: "not measured"}[t["met"]], t["note"]] for t in results["targets"]]
        parts.append("\ntargets\n" + _table(["target", "value", "target", "status", "note"], rows))
    for note in results.get("notes", []):
        parts.append(f"note: {note}")
    for name, err in results.get("errors", {}).items():
        parts.append(f"ERROR in section {name}: {err}")
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------------------------
# Driver and CLI
# ------------------------------------------------------------------------------------------------------------
def run_bench(opts: BenchOptions) -> dict:
    """Run the chosen sections; a section that fails is recorded in results['errors'] and the rest still run."""
    if opts.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {opts.device!r}")
    if opts.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU is visible to torch (torch.cuda.is_available() is False, "
                         f"torch {torch.__version__}); run on a GPU machine or use --device cpu")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    malloc = enable_malloc_reuse() if opts.device == "cpu" and opts.malloc_tuning else False
    compiled, why = _resolve_compile(opts)
    warmup = opts.warmup if opts.warmup is not None else (1 if opts.quick else 2)
    repeats = opts.repeats if opts.repeats is not None else (5 if opts.quick else 9)
    results = {
        "machine": machine_info(opts.device),
        "settings": {"device": opts.device, "quick": opts.quick, "warmup": warmup, "repeats": repeats,
                     "sections": list(opts.sections), "recipes": list(opts.recipes), "malloc_tuning": malloc,
                     "fp8_path": f"{'compiled' if compiled else 'eager'} ({why})"},
        "sections": {}, "notes": [], "errors": {},
    }
    started = time.perf_counter()
    for name in opts.sections:
        t0 = time.perf_counter()
        _log(f"section {name} ...")
        try:
            if name == "quant":
                results["sections"]["quant"] = bench_quant(opts, warmup, repeats)
            elif name == "linear":
                results["sections"]["linear"] = bench_linear(opts, warmup, repeats, results["notes"], compiled)
            elif name == "train":
                results["sections"]["train"] = bench_train(opts, warmup + 1, repeats, compiled)
            elif name == "memory":
                results["sections"]["memory"] = bench_memory(opts)
            elif name == "distributed":
                results["sections"]["distributed"] = bench_distributed(opts.device)
        except Exception as err:  # keep going: the other sections are still worth having
            results["errors"][name] = f"{type(err).__name__}: {err}"
            _log(f"section {name} failed: {results['errors'][name]}")
        if name in results["sections"]:
            results["sections"][name]["seconds"] = time.perf_counter() - t0
        if opts.out:
            _write_json(opts.out, results)
    results["targets"] = check_targets(results, opts.device)
    results["machine"]["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    results["wall_s"] = time.perf_counter() - started
    load = results["machine"]["load_average"]
    if opts.device == "cpu" and load and load[0] > (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        results["notes"].append(
            f"the machine was loaded (1-min load {load[0]} on {os.cpu_count()} cores): with "
            f"{torch.get_num_threads()} OpenMP threads small ops stall waiting for a descheduled thread, which "
            "slows small layers and the tiny train step several-fold; compare with --threads 1")
    if opts.out:
        _write_json(opts.out, results)
    return results


def _write_json(path: str, results: dict) -> None:
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(results, indent=2, default=str) + "\n")
    tmp.replace(path)


def add_cli_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON to stdout (the table goes to stderr)")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON results to FILE")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default cpu)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (CPU: < 3 min)")
    parser.add_argument("--shapes", metavar="MxKxN,...", help="linear shapes, e.g. 4096x1024x1024,1024x256x256")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"FP8 recipes (default {','.join(RECIPES)})")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"sections (default {','.join(SECTIONS)}; also: {','.join(OPTIONAL_SECTIONS)})")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                        help="quantize path in the linear/train sections (auto: eager for --quick on CPU)")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc's allocator settings alone")
    parser.add_argument("--train-config", metavar="YAML", help="recipe whose model/batch the train and memory "
                        "sections use (default recipes/cpu_validate.yaml, on CUDA recipes/gpu_1b.yaml)")
    parser.add_argument("--quant-numel", type=int, help="elements per quantize call (default 16M, quick 4M)")
    parser.add_argument("--warmup", type=int, help="untimed calls per contender before timing")
    parser.add_argument("--repeats", type=int, help="timed rounds")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao Float8Linear comparison")


def options_from_args(args) -> BenchOptions:
    for key in ("quant_numel", "warmup", "repeats", "threads"):
        value = getattr(args, key, None)
        if value is not None and value < (0 if key == "warmup" else 1):
            raise ValueError(f"--{key.replace('_', '-')} must be >= {0 if key == 'warmup' else 1}, got {value}")
    return BenchOptions(
        device=args.device, quick=args.quick, shapes=parse_shapes(args.shapes) if args.shapes else None,
        recipes=_parse_list(args.recipes, RECIPES, "--recipes"),
        sections=_parse_list(args.sections, SECTIONS + OPTIONAL_SECTIONS, "--sections"), compile=args.compile,
        malloc_tuning=not args.no_malloc_tuning, train_config=args.train_config, quant_numel=args.quant_numel,
        warmup=args.warmup, repeats=args.repeats, threads=args.threads, torchao=not args.no_torchao,
        out=args.out)


def cli_main(args) -> int:
    opts = options_from_args(args)
    results = run_bench(opts)
    report = format_report(results)
    text = json.dumps(results, indent=2, default=str)
    if args.json:
        print(report, file=sys.stderr)
        print(text)
    else:
        print(report)
    return 1 if results["errors"] else 0
