"""The sections of the prepared GPU check (fp8train.bench.gpu_check runs them): what to learn from a short GPU loan.

Sections run in order of information per second, each in its own process under its own time limit, and each
writes OUT_DIR/<section>.json the moment it ends (summary.json is rewritten after every section), so a timeout
or crash keeps everything learned before it:

| section     | what it answers                                                                 | limit (s) |
|-------------|---------------------------------------------------------------------------------|-----------|
| checks      | CUDA visible, capability, C compiler and Python.h (inductor), imports, offline   | 30        |
| capability  | which `_scaled_mm` calls this torch+GPU accept: dtype pairs x scaling kinds x    | 45        |
|             | operand layouts x output dtype, each with its error against a dequantized GEMM   |           |
| gemm_tflops | bf16 vs FP8 GEMM TFLOP/s (tensorwise, rowwise, blockwise) at 8192^3 and at the   | 60        |
|             | ~1B recipe's layer shapes                                                        |           |
| sync        | Fp8Linear forward, backward and scale update per recipe under CUDA's sync debug  | 45        |
|             | mode ("error"): any host sync fails; plus which kernel each GEMM reached         |           |
| cuda_tests  | pytest -m cuda tests/test_cuda.py                                                | 110       |
| train       | a short `train()` per recipe on the GPU (loss, tokens/s, GEMM paths)             | 100       |
| bench       | `fp8train bench` linear section at 8192^3 only (eager quantize: no compile wait) | the rest  |

Each section function takes (device, dry, out_dir, limit_s) and returns a JSON-able dict with "ok".
"""

from __future__ import annotations

import importlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import torch

from fp8train.nn.gemm import Fp8Operand
from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.nn.recipes import RECIPE_NAMES, recipe
from fp8train.nn.scaled_gemm import HAS_SCALED_MM_V2, call_scaled_mm, scaled_mm_arguments
from fp8train.training import loop as loop_module
from fp8train.training.config import load_config
from fp8train.training.loop import train
from fp8train.training.rundir import write_json_atomic

# name -> time limit (s), in the order the check runs them (information per second)
SECTIONS = {"checks": 30, "capability": 45, "gemm_tflops": 60, "sync": 45, "cuda_tests": 110, "train": 100,
            "bench": 200}
REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRED_MODULES = ("torch", "numpy", "omegaconf", "accelerate", "pytest", "ml_dtypes", "safetensors", "fp8train")
OPTIONAL_MODULES = ("torchao", "transformer_engine")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_MODE": "disabled"}
# ~1B recipe (recipes/gpu_1b.yaml: d_model 2048, GQA 32/8 heads of 64, ffn 8192), 8192 tokens per micro-batch
SHAPES_1B = {"qkv": (8192, 2048, 3072), "attn_out": (8192, 2048, 2048), "gate_up": (8192, 2048, 16384),
             "down": (8192, 8192, 2048)}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# ------------------------------------------------------------------------------------------------------------
# Sections (each returns a JSON-able dict with "ok")
# ------------------------------------------------------------------------------------------------------------
def section_checks(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    found = {}
    for name in REQUIRED_MODULES + OPTIONAL_MODULES:
        try:
            module = importlib.import_module(name)
            found[name] = getattr(module, "__version__", "present")
        except Exception as err:  # a broken optional install must be reported, not crash the check
            found[name] = f"missing ({type(err).__name__}: {err})"
    compiler = shutil.which(os.environ.get("CC", "")) or next(
        (shutil.which(c) for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    info = dict(python=sys.version.split()[0], executable=sys.executable, torch=torch.__version__,
                torch_cuda=torch.version.cuda, hip=torch.version.hip, cuda_available=torch.cuda.is_available(),
                scaled_mm_v2=HAS_SCALED_MM_V2, compiler=compiler, python_h=str(python_h) if python_h.exists()
                else None, modules=found, offline_env={k: os.environ.get(k) for k in OFFLINE_ENV})
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"sm{props.major}{props.minor}",
                    memory_gib=round(props.total_memory / 2 ** 30, 1))
    missing = [n for n in REQUIRED_MODULES if str(found[n]).startswith("missing")]
    gpu_ok = dry or (torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9))
    problems = [f"missing modules: {', '.join(missing)}"] * bool(missing)
    problems += ["no CUDA GPU of sm89+ visible to torch"] * (not gpu_ok)
    problems += ["no C compiler (inductor cannot compile: the compiled quantize falls back to eager)"] * (
        compiler is None)
    problems += ["Python.h missing (inductor cannot build its kernels)"] * (not python_h.exists())
    return dict(ok=not missing and gpu_ok, problems=problems, **info)


def _operands(kind: str, a_dtype, b_dtype, size: int, device: str):
    """(a (M, K), b (K, N)) Fp8Operands with the scale layout of `kind` (pow2 scales, so references are exact)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a_data = (torch.randn(size, size, generator=g) * 4).to(a_dtype).to(device)
    b_data = (torch.randn(size, size, generator=g) * 4).to(b_dtype).to(device)  # stored (N, K): b = .t()
    tiles = size // 128
    pow2 = lambda *shape: torch.exp2(torch.randint(-3, 3, shape, generator=g).float()).to(device)  # noqa: E731
    scales = {"tensorwise": (pow2(), pow2(), None, None),
              "rowwise": (pow2(size, 1), pow2(size, 1), None, None),
              "blockwise_1x128_128x128": (pow2(size, tiles), pow2(tiles, tiles), (1, 128), (128, 128)),
              "blockwise_1x128_1x128": (pow2(size, tiles), pow2(size, tiles), (1, 128), (1, 128)),
              "blockwise_128x128_1x128": (pow2(tiles, tiles), pow2(size, tiles), (128, 128), (1, 128))}[kind]
    a = Fp8Operand(a_data, scales[0], scales[2])
    b = Fp8Operand(b_data, scales[1], scales[3]).t()
    return a, b


def section_capability(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    size = 128 if dry else 256
    kinds = ("tensorwise", "rowwise", "blockwise_1x128_128x128", "blockwise_1x128_1x128", "blockwise_128x128_1x128")
    cells = []
    for a_name, b_name in (("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3"), ("e5m2", "e5m2")):
        for kind in kinds:
            a, b = _operands(kind, FP8[a_name], FP8[b_name], size, device)
            reference = a.dequantize(torch.float32) @ b.dequantize(torch.float32)
            for layout in ("TN", "NN", "TT"):  # TN: the layout fp8train passes; NN / TT probe what is refused
                args = scaled_mm_arguments(a, b, kind)
                if layout == "NN":
                    args["mat_b"] = args["mat_b"].contiguous()
                if layout == "TT":
                    args["mat_a"] = args["mat_a"].t().contiguous().t()
                for out_dtype in (torch.bfloat16, torch.float32):
                    cell = dict(a=a_name, b=b_name, kind=kind, layout=layout, out=str(out_dtype).split(".")[-1])
                    try:
                        out = call_scaled_mm(args, out_dtype, None, False)
                        cell.update(ok=True, rel_err=float((out.float() - reference).norm() / reference.norm()))
                    except Exception as err:  # the point is to record what this build refuses, and how
                        cell.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}")
                    cells.append(cell)
    accepted = sorted({(c["kind"], c["a"], c["b"]) for c in cells if c["ok"] and c["layout"] == "TN"})
    return dict(ok=True, cells=cells, accepted_tn=[list(x) for x in accepted])


def _median_time(fn, device: str, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def section_gemm_tflops(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    shapes = {"cube": (256, 256, 256)} if dry else {"cube": (8192, 8192, 8192), **SHAPES_1B}
    warmup, repeats = (1, 2) if dry else (3, 10)
    rows = []
    for label, (m, k, n) in shapes.items():
        a_hp = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b_hp = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
        flops = 2.0 * m * k * n
        row = dict(shape=label, m=m, k=k, n=n, bf16_tflops=flops / _median_time(lambda: a_hp @ b_hp, device,
                                                                                    warmup, repeats) / 1e12)
        for kind in ("tensorwise", "rowwise", "blockwise_1x128_128x128"):
            a, b = _gemm_operands(a_hp, b_hp, kind)
            args = scaled_mm_arguments(a, b, kind)
            for fast in (True, False):
                key = f"{kind}{'_fast' if fast else ''}_tflops"
                try:
                    seconds = _median_time(lambda: call_scaled_mm(args, torch.bfloat16, None, fast), device,
                                           warmup, repeats)
                    row[key] = flops / seconds / 1e12
                    row[key.replace("_tflops", "_vs_bf16")] = row[key] / row["bf16_tflops"]
                except Exception as err:  # record and go on: a refused kind is itself a result
                    row[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        rows.append(row)
        write_json_atomic(out_dir / "gemm_tflops.partial.json", dict(rows=rows))
    return dict(ok=True, rows=rows)


def _gemm_operands(a_hp, b_hp, kind: str):
    """FP8 copies of bf16 operands with unit scales laid out for `kind` (speed only; values do not matter)."""
    (m, k), n, dev = a_hp.shape, b_hp.shape[1], a_hp.device
    a_data, b_data = a_hp.to(torch.float8_e4m3fn), b_hp.to(torch.float8_e4m3fn)
    if kind == "tensorwise":
        return Fp8Operand(a_data, torch.ones((), device=dev)), Fp8Operand(b_data, torch.ones((), device=dev))
    if kind == "rowwise":
        return (Fp8Operand(a_data, torch.ones(m, 1, device=dev)), Fp8Operand(b_data, torch.ones(1, n, device=dev)))
    return (Fp8Operand(a_data, torch.ones(m, k // 128, device=dev), (1, 128)),
            Fp8Operand(b_data, torch.ones(k // 128, n // 128, device=dev), (128, 128)))


def section_sync(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    results = {}
    features = 256 if dry else 1024
    for name in RECIPE_NAMES:
        layer = Fp8Linear(features, features, recipe=recipe(name)).to(device)
        x = torch.randn(512, features, device=device, requires_grad=True)

        def step():
            with torch.autocast(device, dtype=torch.bfloat16):
                y = layer(x)
            y.float().sum().backward()
            update_fp8_scales(layer)
        step()  # first call: caches, kernel probes and compiles are allowed to sync
        entry = dict(gemm_paths=dict(layer.gemm_paths))
        try:
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            step()
            entry["host_sync"] = False
        except RuntimeError as err:
            entry.update(host_sync=True, error=str(err).splitlines()[0][:300])
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        results[name] = entry
    return dict(ok=not any(e["host_sync"] for e in results.values()), recipes=results,
                checked_sync_mode=device == "cuda")


def section_cuda_tests(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py"]
    command += ["--collect-only"] if dry else ["-m", "cuda", f"--junitxml={out_dir / 'cuda_tests.xml'}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=max(limit_s - 5, 1), cwd=REPO_ROOT)
    (out_dir / "cuda_tests.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    return dict(ok=proc.returncode == 0, returncode=proc.returncode, result=tail, collect_only=dry)


def section_train(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    names = ("current",) if dry else RECIPE_NAMES
    steps = 2 if dry else 20
    runs = {}
    # plus one FSDP2 smoke step on one GPU: fully_shard, FP8 weight all-gather, a sharded checkpoint (issue 15)
    fsdp2 = ["train.parallel=fsdp2", "fp8.all_gather=true", "checkpoint.save_final=true"]
    for label, name, extra in [(n, n, []) for n in names] + [("current_fsdp2", "current", fsdp2)]:
        overrides = [f"run.dir={out_dir / 'train_runs'}", f"run.name={label}", f"fp8.recipe={name}",
                     "model.n_layers=2", "model.d_model=256", "model.n_heads=4", "model.seq_len=128",
                     f"train.max_steps={steps}", "train.batch_size=8", f"train.eval_every={steps}",
                     "train.eval_batches=1", f"train.device={device}", "optim.warmup_steps=1", "log.wandb=disabled",
                     "log.every=5", "log.telemetry_every=0", "checkpoint.every=0", "checkpoint.save_final=false",
                     "data.max_bytes=300000"]
        if dry:
            overrides += ["model.d_model=64", "model.seq_len=32", "train.batch_size=2", "train.autocast=none",
                          "policy.min_features=16"]
        overrides += extra
        t0 = time.perf_counter()
        summary, syncs = train_watching_syncs(load_config(None, overrides))
        wall = summary.get("wall_time_s") or math.nan
        runs[label] = dict(status=summary.get("status"), loss=summary.get("loss"), seconds=time.perf_counter() - t0,
                           tokens_per_s=(summary.get("tokens") or 0) / wall, fp8_layers=summary.get("fp8_layers"),
                           host_syncs_between_logging_steps=len(syncs), sync_warnings=syncs[:5],
                           checked_sync_mode=device == "cuda")
        write_json_atomic(out_dir / "train.partial.json", dict(runs=runs))
    ok = all(r["status"] == "completed" and r["loss"] is not None and math.isfinite(r["loss"])
             and r["host_syncs_between_logging_steps"] == 0 for r in runs.values())
    return dict(ok=ok, runs=runs)


def train_watching_syncs(cfg) -> tuple[dict, list[str]]:
    """train(cfg), with every step that is no sync point of the loop (loop.is_sync_step; telemetry off) run
    under torch.cuda.set_sync_debug_mode("warn") on CUDA, after the first step (kernel probes, caches, the first
    FP8 scales may sync once). Returns the summary and one line per host sync such a step made."""
    real_step, synced = loop_module.optimizer_step, []

    def watched(run, state, step):
        if run.accelerator.device.type != "cuda" or step == 0 or loop_module.is_sync_step(cfg, step + 1, False):
            return real_step(run, state, step)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return real_step(run, state, step)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                synced.extend(f"step {step + 1}: {str(w.message).splitlines()[0][:200]}" for w in seen
                              if "synchroniz" in str(w.message))
    loop_module.optimizer_step = watched
    try:
        return train(cfg, show_progress=False), synced
    finally:
        loop_module.optimizer_step = real_step


def section_bench(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    command = [sys.executable, "-m", "fp8train.cli", "bench", "--device", device, "--sections", "linear",
               "--compile", "off", "--out", str(out_dir / "bench_result.json")]
    command += (["--shapes", "64x64x64", "--recipes", "current", "--no-torchao", "--warmup", "0", "--repeats", "1"]
                if dry else ["--shapes", "8192x8192x8192"])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=max(limit_s - 5, 1), cwd=REPO_ROOT)
    (out_dir / "bench.log").write_text(proc.stdout + proc.stderr)
    return dict(ok=proc.returncode == 0, returncode=proc.returncode, result_file="bench_result.json")


SECTION_FUNCTIONS = {"checks": section_checks, "capability": section_capability, "gemm_tflops": section_gemm_tflops,
                     "sync": section_sync, "cuda_tests": section_cuda_tests, "train": section_train,
                     "bench": section_bench}
