"""The sections of the prepared GPU check (fp8train.bench.gpu_check runs them): what to learn from a short GPU loan.

Sections run in order of information per second, each in its own process under its own time limit, and each
writes OUT_DIR/<section>.json the moment it ends (summary.json is rewritten after every section), so a timeout
or crash keeps everything learned before it:

| section     | what it answers                                                                 | limit (s) |
|-------------|---------------------------------------------------------------------------------|-----------|
| checks      | CUDA visible, capability, C compiler and Python.h (inductor), imports, offline   | 45        |
| parity      | CUDA equals the float64 reference and the CPU emulation bit for bit per GEMM     | 90        |
|             | kind and output dtype (integer FP8 values, per-tile pow2 scales); every recipe's |           |
|             | Fp8Linear fwd+bwd vs the CPU emulation within the derived accumulation bound     |           |
|             | (bench/gpu_parity.py; parity.jsonl, one line per case)                           |           |
| capability  | which `_scaled_mm` calls this torch+GPU accept: dtype pairs x scaling kinds x    | 45        |
|             | operand layouts x output dtype, each with its error against a dequantized GEMM   |           |
| gemm_tflops | bf16 vs FP8 GEMM TFLOP/s per kind (1x128 x 1x128 wgrad and MX included) at       | 60        |
|             | 8192^3 and at the ~1B recipe's layer shapes; 10 calls per timing window          |           |
| sync        | Fp8Linear forward, backward and scale update per recipe under CUDA's sync debug  | 45        |
|             | mode ("error"): any host sync fails; the kernel each GEMM reached, and the paths |           |
|             | planned for sm90 and sm100 (scaled_gemm.target_gpu, nothing run)                 |           |
| e2e         | recipes/gpu_125m.yaml, bf16 (fp8.recipe=none) against FP8 recipes: tokens/s      | 100       |
| cuda_tests  | pytest -m cuda tests/test_cuda.py (short trains left to `train`); log streamed   | 100       |
| train       | a short `train()` per recipe (loss, tokens/s, GEMM paths), plus an FSDP2 smoke  | 70        |
| bench       | `fp8train bench` linear section at 8192^3 only (eager quantize: no compile wait) | the rest  |

A section whose modules are missing (SECTION_NEEDS) writes its JSON at once with the missing names.
Each section function takes (device, dry, out_dir, limit_s) and returns a JSON-able dict with "ok".
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
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

from fp8train.bench.gpu_parity import TARGET_GPUS, section_capability, section_parity
from fp8train.nn.gemm import Fp8Operand
from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.nn.recipes import RECIPE_NAMES, recipe
from fp8train.nn.scaled_gemm import HAS_SCALED_MM_V2, call_scaled_mm, scaled_mm_arguments, target_gpu
from fp8train.training.storage.files import write_json_atomic
# (the training side, which needs omegaconf and accelerate, is imported by the sections that train: the GPU image
# may lack them, and the other sections must run anyway)

# name -> time limit (s), in the order the check runs them (information per second)
SECTIONS = {"checks": 45, "parity": 90, "capability": 45, "gemm_tflops": 60, "sync": 45, "e2e": 100, "cuda_tests": 100,
            "train": 70, "bench": 200}
REPO_ROOT = Path(__file__).resolve().parents[2]
REQUIRED_MODULES = ("torch", "numpy", "ml_dtypes", "fp8train")  # without these nothing runs
# per section; scripts/prepare_gpu_wheels.sh carries omegaconf and pytest where the image lacks them
SECTION_NEEDS = {"cuda_tests": ("pytest",), "train": ("omegaconf", "accelerate", "safetensors"),
                 "e2e": ("omegaconf", "accelerate", "safetensors"), "bench": ("omegaconf", "accelerate")}
OPTIONAL_MODULES = ("torchao", "transformer_engine", "transformers", "wandb", "tensorboard")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_MODE": "disabled"}
# ~1B recipe (recipes/gpu_1b.yaml: d_model 2048, GQA 32/8 heads of 64, ffn 8192), 8192 tokens per micro-batch
SHAPES_1B = {"qkv": (8192, 2048, 3072), "attn_out": (8192, 2048, 2048), "gate_up": (8192, 2048, 16384),
             "down": (8192, 8192, 2048)}


# ------------------------------------------------------------------------------------------------------------
# Sections (each returns a JSON-able dict with "ok")
# ------------------------------------------------------------------------------------------------------------
def section_checks(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    found = {}
    needed = sorted({m for needs in SECTION_NEEDS.values() for m in needs} - set(REQUIRED_MODULES))
    for name in REQUIRED_MODULES + tuple(needed) + OPTIONAL_MODULES:
        try:  # the required ones are imported; the others only looked up (importing transformers costs seconds)
            if name in REQUIRED_MODULES:
                found[name] = getattr(importlib.import_module(name), "__version__", "present")
            elif module_missing(name):
                found[name] = "missing (not installed)"
            else:
                found[name] = _distribution_version(name)
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
    for section, needs in SECTION_NEEDS.items():
        lacking = [n for n in needs if str(found[n]).startswith("missing")]
        problems += [f"section {section} cannot run without {', '.join(lacking)} (scripts/prepare_gpu_wheels.sh "
                     f"carries them)"] * bool(lacking)
    problems += ["no CUDA GPU of sm89+ visible to torch"] * (not gpu_ok)
    problems += ["no C compiler (inductor cannot compile: the compiled quantize falls back to eager)"] * (
        compiler is None)
    problems += ["Python.h missing (inductor cannot build its kernels)"] * (not python_h.exists())
    return dict(ok=not missing and gpu_ok, problems=problems, **info)


def module_missing(name: str) -> bool:
    """True when `name` cannot be imported here (not installed, or blocked by a None in sys.modules)."""
    if name in sys.modules:
        return sys.modules[name] is None
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True


def _distribution_version(module: str) -> str:
    try:
        return importlib.metadata.version(module.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        return "present"


def _median_time(fn, device: str, warmup: int, repeats: int, calls: int = 1) -> float:
    """Median seconds per call over `repeats` windows of `calls` back-to-back calls (several calls per window, so
    the launch overhead of one call does not land in the timed GPU window at small shapes)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


# the kinds fp8train's recipes reach: forward/dgrad and wgrad of block, and MX (sm100)
TIMED_KINDS = ("tensorwise", "rowwise", "blockwise_1x128_128x128", "blockwise_1x128_1x128", "mx_1x32")


def section_gemm_tflops(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    shapes = {"cube": (256, 256, 256)} if dry else {"cube": (8192, 8192, 8192), **SHAPES_1B}
    warmup, repeats, calls = (1, 2, 1) if dry else (3, 7, 10)
    rows = []
    for label, (m, k, n) in shapes.items():
        a_hp = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b_hp = torch.randn(n, k, device=device, dtype=torch.bfloat16).t()
        flops = 2.0 * m * k * n
        row = dict(shape=label, m=m, k=k, n=n, bf16_tflops=flops / _median_time(lambda: a_hp @ b_hp, device,
                                                                                    warmup, repeats, calls) / 1e12)
        for kind in TIMED_KINDS:
            a, b = _gemm_operands(a_hp, b_hp, kind)
            args = scaled_mm_arguments(a, b, kind)
            # fast accumulation exists for tensorwise / rowwise only (cuBLAS refuses it with block scales)
            for fast in ((True, False) if kind in ("tensorwise", "rowwise") else (False,)):
                key = f"{kind}{'_fast' if fast else ''}_tflops"
                try:
                    seconds = _median_time(lambda: call_scaled_mm(args, torch.bfloat16, None, fast), device,
                                           warmup, repeats, calls)
                    row[key] = flops / seconds / 1e12
                    row[key.replace("_tflops", "_vs_bf16")] = row[key] / row["bf16_tflops"]
                except Exception as err:  # record and go on: a refused kind is itself a result
                    row[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
        rows.append(row)
        write_json_atomic(out_dir / "gemm_tflops.partial.json", dict(rows=rows))
    return dict(ok=True, rows=rows, calls_per_window=calls)


def _gemm_operands(a_hp, b_hp, kind: str):
    """FP8 copies of bf16 operands with unit scales laid out for `kind` (speed only; values do not matter)."""
    (m, k), n, dev = a_hp.shape, b_hp.shape[1], a_hp.device
    a_data, b_data = a_hp.to(torch.float8_e4m3fn), b_hp.to(torch.float8_e4m3fn)
    if kind == "tensorwise":
        return Fp8Operand(a_data, torch.ones((), device=dev)), Fp8Operand(b_data, torch.ones((), device=dev))
    if kind == "rowwise":
        return (Fp8Operand(a_data, torch.ones(m, 1, device=dev)), Fp8Operand(b_data, torch.ones(1, n, device=dev)))
    if kind == "blockwise_1x128_1x128":  # wgrad: both operands tiled 1x128 along K
        return (Fp8Operand(a_data, torch.ones(m, k // 128, device=dev), (1, 128)),
                Fp8Operand(b_data, torch.ones(k // 128, n, device=dev), (128, 1)))
    if kind == "mx_1x32":
        return (Fp8Operand(a_data, torch.ones(m, k // 32, device=dev), (1, 32)),
                Fp8Operand(b_data, torch.ones(k // 32, n, device=dev), (32, 1)))
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
                checked_sync_mode=device == "cuda", planned=target_gemm_paths())


def target_gemm_paths(features: int = 256, tokens: int = 256) -> dict:
    """{gpu: {recipe: {gemm: path}}}: the kernel each GEMM of each recipe would reach on sm90 and sm100, or why it
    would fall back, planned on the CPU (scaled_gemm.target_gpu: no kernel runs)."""
    planned = {}
    for gpu, capability in TARGET_GPUS.items():
        planned[gpu] = {}
        for name in RECIPE_NAMES:
            layer = Fp8Linear(features, features, recipe=recipe(name, backend="scaled_mm"))
            x = torch.randn(tokens, features, requires_grad=True)
            with target_gpu(capability), torch.autocast("cpu", dtype=torch.bfloat16):
                layer(x).float().sum().backward()
            planned[gpu][name] = dict(layer.gemm_paths)
    return planned


def section_cuda_tests(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    """pytest -m cuda tests/test_cuda.py, its output streamed to cuda_tests.log as it runs (so a timeout keeps
    what ran), stopped 10 s before the section's limit. The short training runs are the train section's job."""
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/test_cuda.py",
               "-k", "not test_short_train_on_cuda", "--durations=8"]
    command += ["--collect-only"] if dry else ["-m", "cuda", f"--junitxml={out_dir / 'cuda_tests.xml'}"]
    log_path = out_dir / "cuda_tests.log"
    with open(log_path, "w") as log:
        # the image's pytest plugins are not ours to load: test_cuda.py needs none, and one built for another pytest
        # would fail the run before a test starts
        env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True,
                                env=env)
        try:
            returncode, timed_out = proc.wait(timeout=max(limit_s - 10, 1)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            returncode, timed_out = proc.wait(), True
    lines = log_path.read_text(errors="replace").strip().splitlines() or [""]
    return dict(ok=returncode == 0 and not timed_out, returncode=returncode, timed_out=timed_out, result=lines[-1],
                passed_lines=sum(" passed" in line or "PASSED" in line for line in lines[-40:]), collect_only=dry)


def section_train(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    from fp8train.training.config import load_config

    names = ("current",) if dry else RECIPE_NAMES
    steps = 2 if dry else 12
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
    """train(cfg), with every step that is no sync point of the loop (step.is_sync_step; telemetry off) run
    under torch.cuda.set_sync_debug_mode("warn") on CUDA, after the first step (kernel probes, caches, the first
    FP8 scales may sync once). Returns the summary and one line per host sync such a step made."""
    from fp8train.training import loop as loop_module
    from fp8train.training.step import is_sync_step

    real_step, synced = loop_module.optimizer_step, []

    def watched(run, state, step):
        if run.accelerator.device.type != "cuda" or step == 0 or is_sync_step(cfg, step + 1, False):
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
        return loop_module.train(cfg, show_progress=False), synced
    finally:
        loop_module.optimizer_step = real_step


E2E_RECIPES = ("none", "delayed", "current")  # none: the bf16 baseline; delayed: the recipe's own choice


def section_e2e(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    """recipes/gpu_125m.yaml trained a few steps as bf16 and per FP8 recipe: tokens/s of the steady windows
    (the first logging window holds the warm-up), and the FP8/bf16 ratio (the goal is >= 1.25)."""
    from fp8train.training.config import load_config

    steps, every = (2, 1) if dry else (16, 4)
    runs = {}
    for name in E2E_RECIPES[:2] if dry else E2E_RECIPES:
        overrides = [f"run.dir={out_dir / 'e2e_runs'}", f"run.name={name}", f"fp8.recipe={name}",
                     f"train.max_steps={steps}", f"log.every={every}", "log.telemetry_every=0", "log.wandb=disabled",
                     f"train.eval_every={steps}", "train.eval_batches=1", f"train.device={device}",
                     "optim.warmup_steps=1", "checkpoint.every=0", "checkpoint.save_final=false",
                     "data.max_bytes=4000000"]
        if dry:
            overrides += ["model.n_layers=1", "model.d_model=64", "model.n_heads=2", "model.seq_len=32",
                          "model.ffn_hidden=128", "train.batch_size=2", "train.autocast=none",
                          "policy.min_features=16", "data.max_bytes=200000"]
        cfg = load_config(str(REPO_ROOT / "recipes" / "gpu_125m.yaml"), overrides)
        summary, _ = train_watching_syncs(cfg)
        metrics = [json.loads(line) for line in (out_dir / "e2e_runs" / name / "metrics.jsonl").read_text()
                   .splitlines() if line.strip() and "tokens_per_s" in line]
        steady = [m["tokens_per_s"] for m in metrics[1:]] or [m["tokens_per_s"] for m in metrics]
        runs[name] = dict(status=summary.get("status"), loss=summary.get("loss"),
                          tokens_per_s=statistics.median(steady) if steady else None, windows=len(steady),
                          fp8_layers=summary.get("fp8_layers"))
        write_json_atomic(out_dir / "e2e.partial.json", dict(runs=runs))
    base = runs["none"]["tokens_per_s"]
    for name, run in runs.items():
        run["vs_bf16"] = run["tokens_per_s"] / base if base and run["tokens_per_s"] else None
    ok = all(r["status"] == "completed" and r["loss"] is not None and math.isfinite(r["loss"]) for r in runs.values())
    return dict(ok=ok, runs=runs, config="recipes/gpu_125m.yaml", goal_vs_bf16=1.25)


def section_bench(device: str, dry: bool, out_dir: Path, limit_s: float) -> dict:
    command = [sys.executable, "-m", "fp8train.cli", "bench", "--device", device, "--sections", "linear",
               "--compile", "off", "--out", str(out_dir / "bench_result.json"), "--force"]
    command += (["--shapes", "64x64x64", "--recipes", "current", "--no-torchao", "--warmup", "0", "--repeats", "1"]
                if dry else ["--shapes", "8192x8192x8192"])
    proc = subprocess.run(command, capture_output=True, text=True, timeout=max(limit_s - 5, 1), cwd=REPO_ROOT)
    (out_dir / "bench.log").write_text(proc.stdout + proc.stderr)
    return dict(ok=proc.returncode == 0, returncode=proc.returncode, result_file="bench_result.json")


SECTION_FUNCTIONS = {"checks": section_checks, "parity": section_parity, "capability": section_capability,
                     "gemm_tflops": section_gemm_tflops,
                     "sync": section_sync, "e2e": section_e2e, "cuda_tests": section_cuda_tests,
                     "train": section_train, "bench": section_bench}
