"""``fp8train bench``: quantize, Fp8Linear, train-step and activation-memory benchmarks, side by side with bf16.

Every figure is measured in ONE process, contenders interleaved round by round (round r runs every contender
once), after a warm-up, over several repeats: we report the median time, its spread (min-max and IQR) and the
ratio to the baseline with the IQR of the per-round (paired) ratios. Interleaving matters on a shared CPU: load
from other processes then hits every contender alike, so ratios stay meaningful when absolute times do not.

Modules: options (what to run), harness (timing, machine description, op counts), one module per section
(quant_section, linear_section: linear and ops, train_section: train and memory), report (targets, tables).

Sections (``--sections``):
- quant:  quantize throughput (G elements/s) per granularity and format: the compiled fused kernel (compile
          time reported separately, never inside the timing), the same function eager, and a naive eager chain
          (amax, div, clamp, .to(float8)) as the reference the speedups are relative to.
- linear: forward+backward of Fp8Linear per recipe against nn.Linear under bf16 autocast (the baseline), fp32
          nn.Linear, and torchao's Float8Linear when torchao is installed (emulate=True on CPU).
- ops:    top-level aten ops of one Fp8Linear forward+backward per recipe (weight copy reused and fresh) against
          nn.Linear under bf16 autocast, and of one delayed-scaling update for 1 and 8 layers.
- train:  one optimizer step (forward, backward, clip, AdamW, FP8 scale update) of the decoder of the CPU
          validation recipe (CUDA: the ~1B recipe, smaller batch), bf16 vs each recipe: tokens/s and memory.
- memory: bytes autograd saves for backward over one forward of that decoder (saved_tensors_hooks), bf16 vs FP8.
- experts (not in the default run): an FP8 grouped GEMM fwd+bwd per recipe against the fastest high-precision
          grouped GEMM (torch's grouped_mm or a per-expert loop, bf16 and fp32): bench/experts_section.py.

Why the bf16 baseline is unusually slow on CPU: without avx512_bf16/AMX, torch's CPU bf16 GEMM is a slow path
(~17 GFLOP/s unloaded vs ~78 for fp32), and the grad_input GEMM of a bf16 nn.Linear (grad_output @ weight, a
row-major right operand) is slower still. The emulated FP8 backend computes in fp32 there, so ratios to bf16
flatter FP8 on such a CPU; the linear targets are stated against the FASTER of fp32 and bf16, and both ratios
are printed. On CPUs with bf16 GEMM instructions the emulated GEMMs run in bf16 (fp8.emulated_dtype: auto).

Allocator: large fresh allocations page-fault heavily on the reference VM, so on CPU the bench asks glibc
(mallopt) to keep freed memory instead of returning it to the OS; it applies to every contender and the output
says so. ``--no-malloc-tuning`` turns it off.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from fp8train.bench.distributed_section import bench_distributed
from fp8train.bench.tp_section import bench_tensor_parallel
from fp8train.bench.experts_section import bench_experts
from fp8train.bench.harness import Timing, enable_malloc_reuse, machine_info, paired_ratio
from fp8train.bench.linear_section import bench_linear, bench_ops, torchao_linear
from fp8train.bench.options import (OPTIONAL_SECTIONS, RECIPES, SECTIONS, BenchOptions, log, parse_list,
                                    parse_shapes, resolve_fp8_kernel)
from fp8train.bench.quant_section import bench_quant
from fp8train.bench.report_tables import check_targets, format_report
from fp8train.bench.train_section import bench_memory, bench_train, saved_tensor_bytes
from fp8train.training.config import load_config
from fp8train.training.storage.outputs import check_output_file, claim_output_path
from fp8train.training.storage.files import write_text_atomic

__all__ = ["parse_shapes", "run_bench", "machine_info", "format_report", "SECTIONS", "add_cli_arguments",
           "cli_main", "Timing", "saved_tensor_bytes"]

# Names the tests and scripts used before the split into modules.
_ratio, _torchao_linear = paired_ratio, torchao_linear


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
    kernel, why = resolve_fp8_kernel(opts)
    warmup = opts.warmup if opts.warmup is not None else (1 if opts.quick else 2)
    repeats = opts.repeats if opts.repeats is not None else (5 if opts.quick else 9)
    # a quantize round is ~0.3 s for all its contenders on CPU: the full count even with --quick (its median is the
    # one most moved by a neighbour's memory traffic)
    quant_repeats = opts.repeats if opts.repeats is not None else 9
    results = {
        "machine": machine_info(opts.device),
        "settings": {"device": opts.device, "quick": opts.quick, "warmup": warmup, "repeats": repeats,
                     "quant_repeats": quant_repeats,
                     "sections": list(opts.sections), "recipes": list(opts.recipes), "malloc_tuning": malloc,
                     "fp8_path": f"{kernel} ({why})"},
        "sections": {}, "notes": [], "errors": {},
    }
    started = time.perf_counter()
    for name in opts.sections:
        t0 = time.perf_counter()
        log(f"section {name} ...")
        try:
            if name == "quant":
                results["sections"]["quant"] = bench_quant(opts, warmup, quant_repeats)
            elif name == "ops":
                results["sections"]["ops"] = bench_ops(opts, kernel)
            elif name == "linear":
                results["sections"]["linear"] = bench_linear(opts, warmup, repeats, results["notes"], kernel)
            elif name == "train":
                results["sections"]["train"] = bench_train(opts, warmup + 1, repeats, kernel)
            elif name == "memory":
                results["sections"]["memory"] = bench_memory(opts)
            elif name == "distributed":
                results["sections"]["distributed"] = bench_distributed(opts.device)
                if "skipped" not in results["sections"]["distributed"]:  # tensor parallelism, tp 2 (tp_section)
                    results["sections"]["distributed"]["tensor_parallel"] = bench_tensor_parallel(opts.device)
            elif name == "experts":
                results["sections"]["experts"] = bench_experts(opts, warmup, repeats, kernel)
        except Exception as err:  # keep going: the other sections are still worth having
            results["errors"][name] = f"{type(err).__name__}: {err}"
            log(f"section {name} failed: {results['errors'][name]}")
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
    # --out was checked before the work (check_output_file); each rewrite is whole, never through a link
    write_text_atomic(path, json.dumps(results, indent=2, default=str) + "\n")


def add_cli_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON to stdout (the table goes to stderr)")
    parser.add_argument("--out", metavar="FILE", help="also write the JSON results to FILE (refused if it exists, "
                        "unless --force)")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to run (default cpu)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats (CPU: < 3 min)")
    parser.add_argument("--shapes", metavar="MxKxN,...", help="linear shapes, e.g. 4096x1024x1024,1024x256x256")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"FP8 recipes (default {','.join(RECIPES)})")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"sections (default {','.join(SECTIONS)}; also: {','.join(OPTIONAL_SECTIONS)})")
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                        help="quantize kernel in the ops/linear/train sections: on a CPU where fp8train's C kernel "
                        "builds, native (it compiles nothing of torch's); else on = the fastest bit-exact kernel "
                        "measured for this machine, off = eager (auto: eager for --quick on CPU)")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="leave glibc's allocator settings alone")
    parser.add_argument("--train-config", metavar="YAML", help="recipe whose model/batch the train and memory "
                        "sections use (default recipes/cpu_validate.yaml, on CUDA recipes/gpu_1b.yaml)")
    parser.add_argument("--quant-numel", type=int,
                        help="elements per quantize call (default 16M, the size the targets are stated at)")
    parser.add_argument("--warmup", type=int, help="untimed calls per contender before timing")
    parser.add_argument("--repeats", type=int, help="timed rounds")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (CPU)")
    parser.add_argument("--no-torchao", action="store_true", help="skip the torchao Float8Linear comparison")


MAX_QUANT_NUMEL = 1 << 30  # 4 GiB of fp32 input per call, 64x the stated size: above it, an allocation failure


def options_from_args(args) -> BenchOptions:
    for key in ("quant_numel", "warmup", "repeats", "threads"):
        value = getattr(args, key, None)
        if value is not None and value < (0 if key == "warmup" else 1):
            raise ValueError(f"--{key.replace('_', '-')} must be >= {0 if key == 'warmup' else 1}, got {value}")
    if args.quant_numel is not None and args.quant_numel > MAX_QUANT_NUMEL:
        raise ValueError(f"--quant-numel {args.quant_numel} must be <= {MAX_QUANT_NUMEL} (2^30)")
    if args.train_config is not None:  # a bad recipe is the user's, said before any section, not a failed section
        load_config(args.train_config)
    return BenchOptions(
        device=args.device, quick=args.quick, shapes=parse_shapes(args.shapes) if args.shapes else None,
        recipes=parse_list(args.recipes, RECIPES, "--recipes"),
        sections=parse_list(args.sections, SECTIONS + OPTIONAL_SECTIONS, "--sections"), compile=args.compile,
        malloc_tuning=not args.no_malloc_tuning, train_config=args.train_config, quant_numel=args.quant_numel,
        warmup=args.warmup, repeats=args.repeats, threads=args.threads, torchao=not args.no_torchao,
        out=args.out)


def cli_main(args) -> int:
    opts = options_from_args(args)
    if not opts.out:
        return _bench(args, opts)
    with claim_output_path(opts.out, "bench --out"):  # a second bench writing the same file meanwhile is refused
        # before minutes of timing: an existing file, a link, a run's records or /proc/x is one line
        opts.out = str(check_output_file(opts.out, force=args.force, ours=_not_bench_results))
        return _bench(args, opts)


def _not_bench_results(path: Path) -> str | None:
    """None when `path` holds the JSON an earlier bench wrote (its "machine", "settings" and "sections"), the one
    kind of file bench --force replaces; else what it lacks."""
    try:
        results = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return "it is not JSON"
    if isinstance(results, dict) and {"machine", "settings", "sections"} <= results.keys():
        return None
    return "it is no bench result: no \"machine\", \"settings\" and \"sections\""


def _bench(args, opts) -> int:
    results = run_bench(opts)
    report = format_report(results)
    text = json.dumps(results, indent=2, default=str)
    if args.json:
        print(report, file=sys.stderr)
        print(text)
    else:
        print(report)
    return 1 if results["errors"] else 0
