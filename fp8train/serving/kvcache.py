"""FP8 KV-cache evaluation: how much does storing K and V in FP8 cost a trained model, by context position?

    fp8train kv-eval RUN_DIR [--format e4m3fn,e5m2] [--kv kv,k,v] [--granularity tensor|head]
                             [--scale-source calibrated|dynamic] [--margin N] [--matrix] ...

What is compared. The newest valid checkpoint of RUN_DIR is rebuilt from RUN_DIR/config.yaml with its fp32
master weights in the plain model (an FP8-trained run is loaded by parameter name, its FP8 scaling buffers are
dropped: see fp8train.serving.run_loading), weights fixed, run under the run's autocast (bf16, as in training). Every
attention layer's `kv_transform` hook (fp8train's Decoder, or a Hugging Face model's attention through
fp8train.serving.kv_hooks.enable_kv_hook) then sees K (after RoPE) and V, (B, n_kv_heads, T, head_dim), and returns
what the cache would hold:

- reference cache ("bf16"): K and V rounded to bf16 (a no-op under bf16 autocast);
- FP8 cache: K and/or V (--kv k | v | kv; the other stays bf16) quantized to --format with round-to-nearest-even,
  saturating, at the scale below, and dequantized back (FP8 value * scale, then the attention's dtype).

Scales are dequant scales `amax / fmt.max * 2**margin` per layer, for K and V separately, one per layer
(--granularity tensor) or one per KV head (head). --scale-source calibrated: the amax is measured once on a
calibration split, --calib-batches windows of the run's TRAIN split (`data.train_batch` at steps after the run's
last step; never the validation tokens that are evaluated), with the reference cache and the bf16 weights, then frozen (--matrix reuses them for FP8 weights). dynamic: the
amax of the K/V tensor of each forward (the whole (B, T) window: an optimistic stand-in for a serving cache, which
must fix a scale before later tokens exist).

Measured on the run's validation batches (`data.val_batches()`, the same prompts for every cache): per token the
loss, next-token accuracy, and the KL divergence KL(p_ref || p_fp8) of the FP8-cache next-token distribution from
the reference one (expectation under the reference, as llama.cpp's --kl-divergence). Tokens are bucketed by
context position (0-7, 8-15, 16-31, ... up to seq_len); each bucket's numbers are means over sequences of the
per-sequence bucket means, with 95% normal-approximation confidence intervals over sequences (paired: the same
sequences under both caches). Greedy continuations: --gen-tokens tokens generated greedily from the first
--prompt-len tokens of --gen-prompts validation sequences with each cache; generation recomputes the whole
prefix every step (no incremental cache) and every K/V still goes through the transform, so with calibrated
(static) scales it equals an incremental FP8 cache exactly. Cache health: per layer and per KV head, the fraction
of K/V elements clipped (|x / scale| past max + half the top spacing) and underflowed (nonzero -> 0), on the
evaluation forwards. --matrix adds FP8 weights (per-output-channel, as `fp8train export`) x cache precision.

Output: RUN_DIR/kv_eval/ (or --out): kv_eval.json, kv_eval.md and kv_eval.png (loss delta and KL by position).
"""


from __future__ import annotations

import platform
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import torch

from fp8train.numerics.formats import get_format
from fp8train.serving.fp8_weights import fp8_weight_model
from fp8train.serving.kv_memory import kv_bytes_per_token, kv_scale_bytes, memory_report
from fp8train.serving.kv_report import check_report_folder, format_stat, kib, weights_label, write_report
from fp8train.serving.kv_scoring import (agreement, bucket_edges, bucket_stats, greedy_generate, mean_ci,
                                         position_buckets, score_caches)
from fp8train.serving.kv_transform import (CACHE_FORMATS, GRANULARITIES, SCALE_SOURCES, Fp8KvCache, KvCacheConfig,
                                           bf16_cache, calibrate_kv_amax, kv_transforms, scales_from_amax)
from fp8train.serving.export_checks import refuse_failed_source
from fp8train.serving.run_loading import fp8_linear_names, kv_shape, load_run, package_version
from fp8train.training.data.corpus import build_data
from fp8train.training.storage.outputs import claim_output_path

__all__ = [
    "kv_bytes_per_token", "kv_scale_bytes", "memory_report", "KvCacheConfig", "Fp8KvCache", "bf16_cache",
    "calibrate_kv_amax", "kv_transforms", "score_caches", "position_buckets", "bucket_stats", "greedy_generate",
    "KvEvalOptions", "kv_eval", "write_report", "add_cli_arguments", "cli_main", "CACHE_FORMATS",
]

# ------------------------------------------------------------------------------------------------------------
# The evaluation
# ------------------------------------------------------------------------------------------------------------
@dataclass
class KvEvalOptions:
    formats: tuple = ("e4m3fn", "e5m2")
    """FP8 formats of the cache, each evaluated against the bf16 cache."""
    kv: tuple = ("kv",)
    """Which tensors are FP8 (k, v, kv); several give several caches."""
    granularity: str = "tensor"
    scale_source: str = "calibrated"
    margin: int = 0
    pow2: bool = False
    batches: int = 0
    """Validation batches evaluated (0 = all of the run's train.eval_batches)."""
    max_positions: int = 0
    """Evaluate the first N positions of each sequence (0 = model.seq_len)."""
    calib_batches: int = 4
    """Calibration windows: this many train-split batches (train.batch_size sequences each)."""
    gen_prompts: int = 8
    gen_tokens: int = 16
    prompt_len: int = 0
    """Prompt length for greedy continuations (0 = max_positions - gen_tokens)."""
    matrix: bool = False
    """Also evaluate FP8 weights (per-output-channel) x cache precision."""
    weight_format: str = "e4m3fn"
    buckets: Optional[tuple] = None
    """Bucket edges (positions), e.g. (0, 8, 16, 32, 64); None = doubling from 8."""


def _cache_configs(opts: KvEvalOptions) -> list[KvCacheConfig]:
    if not opts.formats:
        raise ValueError("--format: give at least one FP8 format")
    if not opts.kv:
        raise ValueError("--kv: give at least one of k, v, kv")
    configs = [KvCacheConfig(fmt, kv, opts.granularity, opts.scale_source, opts.margin, opts.pow2)
               for fmt in opts.formats for kv in opts.kv]
    # a value given twice (or a format and its alias: e4m3, e4m3fn) would be one cache reported as two
    _refuse_repeats("--format", opts.formats, [KvCacheConfig(fmt).fmt for fmt in opts.formats])
    _refuse_repeats("--kv", opts.kv, list(opts.kv))
    return configs


def _refuse_repeats(option: str, given, canonical: list) -> None:
    for i, name in enumerate(canonical):
        if name in canonical[:i]:
            raise ValueError(f"{option} {','.join(given)}: {given[i]!r} repeats {given[canonical.index(name)]!r}; "
                             "give each value once")


def _positions(opts: KvEvalOptions, seq_len: int) -> tuple[int, int | None]:
    """(positions evaluated, prompt length of the greedy continuations or None without them), each checked
    against model.seq_len before any work; a derived value's error names the option the user gave."""
    n_pos = opts.max_positions or seq_len
    if not 1 <= n_pos <= seq_len:
        raise ValueError(f"--max-positions {n_pos} must be in [1, model.seq_len={seq_len}]")
    if opts.gen_prompts <= 0 or opts.gen_tokens <= 0:
        return n_pos, None
    if opts.prompt_len:
        if opts.prompt_len + opts.gen_tokens > seq_len:
            raise ValueError(f"--prompt-len {opts.prompt_len} + --gen-tokens {opts.gen_tokens} must fit in "
                             f"model.seq_len={seq_len}")
        return n_pos, opts.prompt_len
    if opts.gen_tokens >= n_pos:  # the prompt is the positions before the generated tokens
        positions = f"--max-positions {n_pos}" if opts.max_positions else f"model.seq_len={seq_len}"
        raise ValueError(f"--gen-tokens {opts.gen_tokens} must be below {positions}: the prompt (--prompt-len left "
                         "out) is the positions before the generated tokens, at least 1 (--gen-prompts 0 turns "
                         "continuations off)")
    return n_pos, n_pos - opts.gen_tokens


def kv_eval(run_dir, opts: KvEvalOptions = KvEvalOptions(), log=print) -> dict:
    """Run the whole evaluation of ``run_dir`` (see the module docstring); returns the report as a dict."""
    configs = _cache_configs(opts)  # bad options fail before anything is loaded
    if opts.matrix:
        get_format(opts.weight_format)
    run = load_run(run_dir, log=log)
    seq_len = run.cfg.model.seq_len
    n_pos, prompt_len = _positions(opts, seq_len)
    buckets = position_buckets(n_pos, opts.buckets)
    autocast = run.cfg.train.autocast == "bf16"
    data = build_data(run.cfg)
    val = data.val_batches()[:opts.batches] if opts.batches else data.val_batches()
    batches = [(x[:, :n_pos], y[:, :n_pos]) for x, y in val]
    amax, calibration = _calibrate(run, data, opts, n_pos, autocast)
    models = _weight_models(run, opts)
    shape = kv_shape(run)
    fp8_caches = {c.label: {w: Fp8KvCache(c, shape["n_layers"], shape["n_kv_heads"],
                                          scales_from_amax(amax, c) if amax is not None else None) for w in models}
                  for c in configs}
    log(f"kv-eval: {len(batches)} batches x {len(batches[0][0])} sequences x {n_pos} positions, "
        f"{len(models)} weight precision(s) x {1 + len(configs)} caches")
    # One pass: every cell on every batch. Each (weights, cache) has its own Fp8KvCache, so its own health counts.
    cells = score_caches(models, batches, {"bf16": bf16_cache, **fp8_caches}, autocast)
    generation, generation_info = _generation(models, fp8_caches, val, opts, prompt_len, autocast)
    return {
        "manifest": _manifest(run, opts, configs, calibration, batches, n_pos, generation_info),
        "model": {**shape, "seq_len": seq_len},
        "memory": {"rows": memory_report(shape["n_layers"], shape["n_kv_heads"], shape["head_dim"], seq_len),
                   "scale_bytes_static": {g: kv_scale_bytes(shape["n_layers"], shape["n_kv_heads"], g)
                                          for g in GRANULARITIES}},
        "buckets": [[lo, hi - 1] for lo, hi in buckets],
        "cells": _report_cells(cells, configs, fp8_caches, generation, buckets, n_pos, opts.matrix),
        # what the high-precision weights (cells' weights "bf16") compute in: the run's autocast, else fp32
        "weights_dtype": "bf16" if autocast else "fp32",
    }



def _calibrate(run, data, opts: KvEvalOptions, n_pos: int, autocast: bool):
    """Calibrated per-head K/V amaxes on train-split windows after the run's last step (None for dynamic)."""
    if opts.scale_source != "calibrated":
        return None, None
    last = run.cfg.train.max_steps
    calib = [data.train_batch(last + i) for i in range(max(0, opts.calib_batches))]
    calib = [(x[:, :n_pos], y[:, :n_pos]) for x, y in calib]
    amax = calibrate_kv_amax(run.model, calib, autocast)
    return amax, {"split": "train", "how": f"data.train_batch(step) for steps {last}..{last + len(calib) - 1} "
                  "(after the run's last step)", "batches": len(calib),
                  "sequences": sum(len(x) for x, _ in calib), "tokens": sum(x.numel() for x, _ in calib)}


def _weight_models(run, opts: KvEvalOptions) -> dict:
    models = {"bf16": run.model}
    if opts.matrix:
        if not run.fp8_names:
            raise ValueError(f"--matrix: the layer policy in {run.run_dir}/config.yaml puts no Linear in FP8 (e.g. "
                             f"policy.min_features={run.cfg.policy.min_features} exceeds every layer), so FP8 weights "
                             "would equal bf16 weights; drop --matrix")
        models["fp8"] = fp8_weight_model(run.model, fp8_linear_names(run), opts.weight_format)
    return models


def _generation(models: dict, fp8_caches: dict, val, opts: KvEvalOptions, prompt_len: int | None, autocast: bool):
    """Greedy continuations of the first gen_prompts validation sequences with every cache (prompt_len None: off)."""
    if prompt_len is None:
        return {}, None
    prompts = torch.cat([x for x, _ in val])[:opts.gen_prompts, :prompt_len]
    generation = {}
    for w, model in models.items():
        ref_tokens = greedy_generate(model, prompts, opts.gen_tokens, bf16_cache, autocast)
        generation[(w, "bf16")] = agreement(ref_tokens, ref_tokens)
        for label, caches in fp8_caches.items():
            caches[w].counting = False  # health counts the evaluation forwards only
            generation[(w, label)] = agreement(ref_tokens, greedy_generate(model, prompts, opts.gen_tokens,
                                                                            caches[w], autocast))
    return generation, {"prompts": len(prompts), "prompt_len": prompt_len, "tokens": opts.gen_tokens,
                        "method": "greedy, full recompute per step, K/V through the cache transform"}


def _report_cells(cells: dict, configs, fp8_caches: dict, generation: dict, buckets, n_pos: int, matrix: bool):
    global_ref = cells[("bf16", "bf16")]
    report_cells = []
    for (w, c), cell in cells.items():
        ref_cell = cells[(w, "bf16")]
        entry = {"weights": w, "cache": c,
                 "cache_config": asdict(next(x for x in configs if x.label == c)) if c != "bf16" else None,
                 "overall": bucket_stats(cell, ref_cell, [(0, n_pos)], global_ref)[0],
                 "by_position": bucket_stats(cell, ref_cell, buckets, global_ref if matrix else None),
                 "generation": generation.get((w, c)),
                 "health": fp8_caches[c][w].health() if c != "bf16" else None}
        entry["overall"].pop("positions")
        if cell["kl_global"] is not None:
            entry["overall"]["kl_vs_bf16_bf16"] = mean_ci(cell["kl_global"].mean(dim=1))
        report_cells.append(entry)
    return report_cells


def _manifest(run, opts: KvEvalOptions, configs, calibration, batches, n_pos: int, generation_info) -> dict:
    cfg = run.cfg
    return {
        "run_dir": str(run.run_dir.resolve()), "checkpoint": run.checkpoint.name, "checkpoint_step": run.step,
        "seed": cfg.train.seed, "run_recipe": cfg.fp8.recipe, "backend": "emulated",
        "weights_loaded_as": "fp32 master weights in the plain model (FP8 scaling buffers dropped)",
        "autocast": cfg.train.autocast, "formats": [c.fmt for c in configs][::len(opts.kv)],
        "kv": list(opts.kv), "granularity": opts.granularity, "scale_source": opts.scale_source,
        "margin": opts.margin, "pow2": opts.pow2, "calibration": calibration,
        "eval": {"split": "validation (data.val_batches)", "batches": len(batches),
                 "sequences": sum(len(x) for x, _ in batches), "positions": n_pos},
        "reference_cache": "bf16 (K/V rounded to bf16)", "kl": "KL(p_bf16_cache || p_fp8_cache) per token",
        "ci": "95% normal approximation over sequences (paired)", "generation": generation_info,
        "matrix": opts.matrix, "weight_format": opts.weight_format if opts.matrix else None,
        "fp8train_version": package_version(), "torch_version": torch.__version__,
        "python": platform.python_version(),
    }


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def _csv(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_cli_arguments(parser) -> None:
    parser.add_argument("run_dir", help="run directory (its newest valid checkpoint and config.yaml)")
    parser.add_argument("--out", help="output folder (default RUN_DIR/kv_eval)")
    parser.add_argument("--force", action="store_true", help="replace the report files of an earlier kv-eval in --out")
    parser.add_argument("--format", default="e4m3fn,e5m2",
                        help=f"FP8 cache format(s), comma-separated: {', '.join(CACHE_FORMATS)} (default e4m3fn,e5m2)")
    parser.add_argument("--kv", default="kv", help="FP8 tensors, comma-separated caches: k, v, kv (default kv)")
    parser.add_argument("--granularity", default="tensor", choices=GRANULARITIES,
                        help="one scale per layer (tensor) or per KV head (head)")
    parser.add_argument("--scale-source", default="calibrated", choices=SCALE_SOURCES,
                        help="calibrated: amax on train-split windows, frozen; dynamic: amax of each forward")
    parser.add_argument("--margin", type=int, default=0, help="scale headroom, powers of two (default 0)")
    parser.add_argument("--pow2", action="store_true", help="round scales up to powers of two")
    # --batches, --max-positions, --prompt-len: left out, a value derived from the run; given, at least 1
    parser.add_argument("--batches", type=int, help="validation batches (default: all of the run's)")
    parser.add_argument("--max-positions", type=int, help="positions per sequence (default seq_len)")
    parser.add_argument("--calib-batches", type=int, default=4, help="calibration batches (train split; default 4)")
    parser.add_argument("--gen-prompts", type=int, default=8, help="prompts for greedy continuations (0 = off)")
    parser.add_argument("--gen-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    parser.add_argument("--prompt-len", type=int, help="prompt length (default positions - gen tokens)")
    parser.add_argument("--buckets", help="position bucket edges, e.g. 0,8,16,32,64 (default doubling from 8)")
    parser.add_argument("--matrix", action="store_true", help="also FP8 weights (per output channel) x cache")
    parser.add_argument("--weight-format", default="e4m3fn", help="FP8 weight format for --matrix")
    parser.add_argument("--allow-diverged", action="store_true",
                        help="evaluate a run whose summary.json says it diverged or was stopped as diverging")


MAX_COUNT = 1024  # as train.eval_batches and export's --calib-batches


def cli_main(args) -> int:
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    for key, value in (("--batches", args.batches), ("--max-positions", args.max_positions),
                       ("--prompt-len", args.prompt_len)):
        if value is not None and value < 1:  # 0 would silently mean the default
            raise ValueError(f"{key} must be >= 1, got {value} (leave it out for the default)")
    opts = KvEvalOptions(
        formats=_csv(args.format), kv=_csv(args.kv), granularity=args.granularity, scale_source=args.scale_source,
        margin=args.margin, pow2=args.pow2, batches=args.batches or 0, max_positions=args.max_positions or 0,
        calib_batches=args.calib_batches, gen_prompts=args.gen_prompts, gen_tokens=args.gen_tokens,
        prompt_len=args.prompt_len or 0, matrix=args.matrix, weight_format=args.weight_format,
        buckets=bucket_edges(args.buckets) if args.buckets else None)
    for key, value in (("--calib-batches", opts.calib_batches), ("--gen-prompts", opts.gen_prompts),
                       ("--gen-tokens", opts.gen_tokens)):
        if value < 0:
            raise ValueError(f"{key} must be >= 0, got {value}")
    _cache_configs(opts)  # repeated or unknown --format / --kv values: said before the run is read
    for key, value in (("--calib-batches", opts.calib_batches), ("--gen-prompts", opts.gen_prompts)):
        if value > MAX_COUNT:  # each is a forward pass (or a generation): a bound on hours before the report
            raise ValueError(f"{key} {value} must be <= {MAX_COUNT}")
    refuse_failed_source(args.run_dir, args.allow_diverged, "evaluate")  # its losses would measure the divergence
    if not Path(args.run_dir).is_dir():  # said before the claim below makes RUN_DIR for RUN_DIR/kv_eval's claim
        raise ValueError(f"run directory {str(args.run_dir)!r} does not exist")
    out = Path(args.run_dir) / "kv_eval" if args.out is None else args.out
    with claim_output_path(out, "kv-eval --out"):  # a second kv-eval into the same folder is refused meanwhile
        out = check_report_folder(out, args.force, args.run_dir)
        result = kv_eval(args.run_dir, opts, log=lambda m: print(m, file=sys.stderr))
        paths = write_report(result, out, args.run_dir)
    _print_summary(result)
    print(f"report: {paths['md']}  ({paths['json']}, {paths['png']})")
    return 0


def _print_summary(r: dict) -> None:
    mdl = r["model"]
    print(f"KV cache of this model ({mdl['n_layers']} layers x {mdl['n_kv_heads']} KV heads x head_dim "
          f"{mdl['head_dim']}), payload without scales:")
    for row in r["memory"]["rows"]:
        print(f"  {row['cache']:<15} {kib(row['bytes_per_token']):>12} per token, "
              f"{kib(row['bytes_per_context']):>12} per {row['seq_len']}-token context")
    for cell in r["cells"]:
        o = cell["overall"]
        print(f"  weights {weights_label(r, cell):<4} cache {cell['cache']:<34} loss {format_stat(o['loss'])}  "
              f"Δloss {format_stat(o['loss_delta'])}  KL {format_stat(o['kl'])}")
