"""FP8 KV-cache evaluation: how much does storing K and V in FP8 cost a trained model, by context position?

    fp8train kv-eval RUN_DIR [--format e4m3fn,e5m2] [--kv kv,k,v] [--granularity tensor|head]
                             [--scale-source calibrated|dynamic] [--margin N] [--matrix] ...

What is compared. The newest valid checkpoint of RUN_DIR is rebuilt from RUN_DIR/config.yaml with its fp32
master weights in the plain model (an FP8-trained run is loaded by parameter name, its FP8 scaling buffers are
dropped: see fp8train.serving.export.load_run), weights fixed, run under the run's autocast (bf16, as in training). Every
attention layer's `kv_transform` hook then sees K (after RoPE) and V, (B, n_kv_heads, T, head_dim), and returns
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

import json
import math
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn

from fp8train import __version__
from fp8train.numerics.formats import FORMATS, get_format
from fp8train.numerics.quant import quantize, scale_from_amax

__all__ = [
    "kv_bytes_per_token", "kv_scale_bytes", "memory_report", "KvCacheConfig", "Fp8KvCache", "bf16_cache",
    "calibrate_kv_amax", "kv_transforms", "score_caches", "position_buckets", "bucket_stats", "greedy_generate",
    "KvEvalOptions", "kv_eval", "write_report", "add_cli_arguments", "cli_main", "CACHE_FORMATS",
]

CACHE_FORMATS = tuple(FORMATS)  # every format, by canonical name
KV_CHOICES = ("k", "v", "kv")
GRANULARITIES = ("tensor", "head")
SCALE_SOURCES = ("calibrated", "dynamic")
_Z95 = 1.959963984540054  # two-sided 95% normal quantile


# ------------------------------------------------------------------------------------------------------------
# Memory arithmetic
# ------------------------------------------------------------------------------------------------------------
_PRECISION_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1,
                    **{name: 1 for name in CACHE_FORMATS}, "e4m3": 1}


def _nbytes(precision) -> int:
    if isinstance(precision, int) and not isinstance(precision, bool) and precision > 0:
        return precision
    if isinstance(precision, str) and precision in _PRECISION_BYTES:
        return _PRECISION_BYTES[precision]
    raise ValueError(f"precision {precision!r}: give bytes per element (int > 0) or one of "
                     f"{', '.join(_PRECISION_BYTES)}")


def kv_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int, k_dtype_bytes=2, v_dtype_bytes=2) -> int:
    """Bytes of K and V payload one token adds to the cache: n_layers * n_kv_heads * head_dim * (k + v).

    ``k_dtype_bytes``/``v_dtype_bytes``: bytes per element, or a precision name ("bf16", "fp8", "e4m3fn", ...).
    Scales are not included (see kv_scale_bytes). 80 layers, 8 KV heads, head_dim 128: 320 KiB in bf16, 160 KiB in
    FP8, 240 KiB with bf16 K and FP8 V.
    """
    for key, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an int >= 1, got {value!r}")
    return n_layers * n_kv_heads * head_dim * (_nbytes(k_dtype_bytes) + _nbytes(v_dtype_bytes))


def kv_scale_bytes(n_layers: int, n_kv_heads: int, granularity: str = "tensor", kv: str = "kv") -> int:
    """fp32 scale bytes of a static (calibrated) FP8 cache: one per layer (tensor) or per layer and KV head
    (head), for each FP8 tensor (K, V or both). A fixed cost per model, not per token. (A serving cache with
    dynamic per-token-per-head scales would instead add n_layers * n_kv_heads * 4 bytes per token per FP8 tensor.)"""
    per_layer = 1 if granularity == "tensor" else n_kv_heads
    return 4 * n_layers * per_layer * len(kv)


def memory_report(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int) -> list[dict]:
    """KV payload per token and per full context for the precisions kv-eval compares."""
    rows = []
    for label, k, v in (("bf16 K, bf16 V", "bf16", "bf16"), ("fp8 K, fp8 V", "fp8", "fp8"),
                        ("bf16 K, fp8 V", "bf16", "fp8"), ("fp8 K, bf16 V", "fp8", "bf16")):
        per_token = kv_bytes_per_token(n_layers, n_kv_heads, head_dim, k, v)
        rows.append({"cache": label, "bytes_per_token": per_token, "bytes_per_context": per_token * seq_len,
                     "seq_len": seq_len})
    return rows


# ------------------------------------------------------------------------------------------------------------
# The cache transforms
# ------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KvCacheConfig:
    """One FP8 cache setting."""

    fmt: str = "e4m3fn"
    """FP8 format of the cached tensors: e4m3fn | e5m2 | e4m3fnuz | e5m2fnuz."""
    kv: str = "kv"
    """Which tensors are FP8: k, v or kv (the other stays bf16)."""
    granularity: str = "tensor"
    """tensor (one scale per layer for K and for V) | head (one per KV head)."""
    scale_source: str = "calibrated"
    """calibrated (amax on the calibration split, frozen) | dynamic (amax of each forward's K/V)."""
    margin: int = 0
    """Scale headroom in powers of two: scale = amax / max * 2**margin."""
    pow2: bool = False
    """Round scales up to powers of two (dequantized values then are exact in bf16)."""

    def __post_init__(self) -> None:
        if self.fmt not in CACHE_FORMATS and self.fmt != "e4m3":
            raise ValueError(f"--format {self.fmt!r} is not an FP8 format; allowed: {', '.join(CACHE_FORMATS)}")
        object.__setattr__(self, "fmt", get_format(self.fmt).name)
        for key, allowed in (("kv", KV_CHOICES), ("granularity", GRANULARITIES), ("scale_source", SCALE_SOURCES)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"--{key.replace('_', '-')} {getattr(self, key)!r}; allowed: {', '.join(allowed)}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise ValueError(f"--margin must be an int (powers of two), got {self.margin!r}")

    @property
    def label(self) -> str:
        return f"{self.fmt}:{self.kv}:{self.granularity}:{self.scale_source}:m{self.margin}" + \
            (":pow2" if self.pow2 else "")


def bf16_cache(k: torch.Tensor, v: torch.Tensor, layer_idx: int):
    """The reference cache: K and V rounded to bf16 (exact no-op when they already are bf16)."""
    return k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)


class Fp8KvCache:
    """kv_transform that stores K and/or V in FP8 (quantize -> dequantize) and counts clipping and underflow.

    ``scales``: {(layer, "k"|"v"): dequant scale, shape () for tensor or (n_kv_heads,) for head granularity}, used
    as given (calibrated or forced); None with scale_source "dynamic" computes them from each forward's amax.
    """

    def __init__(self, config: KvCacheConfig, n_layers: int, n_kv_heads: int, scales: Optional[dict] = None):
        if config.scale_source == "calibrated" and scales is None:
            raise ValueError("a calibrated FP8 cache needs scales (see calibrate_kv_amax)")
        self.config, self.fmt = config, get_format(config.fmt)
        self.scales = scales
        self.counting = True
        zeros = lambda: torch.zeros(n_kv_heads, dtype=torch.int64)  # noqa: E731
        self.overflow = {(i, t): zeros() for i in range(n_layers) for t in "kv"}
        self.underflow = {(i, t): zeros() for i in range(n_layers) for t in "kv"}
        self.numel = {(i, t): 0 for i in range(n_layers) for t in "kv"}  # elements per head

    def __call__(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int):
        k_ref, v_ref = bf16_cache(k, v, layer_idx)
        k_out = self._fp8(k_ref, layer_idx, "k") if "k" in self.config.kv else k_ref
        v_out = self._fp8(v_ref, layer_idx, "v") if "v" in self.config.kv else v_ref
        return k_out, v_out

    def _scale(self, x: torch.Tensor, layer_idx: int, kind: str) -> torch.Tensor:
        if self.scales is not None:
            return torch.as_tensor(self.scales[(layer_idx, kind)], dtype=torch.float32)
        amax = head_amax(x)  # (H,)
        if self.config.granularity == "tensor":
            amax = amax.max()
        return scale_from_amax(amax, self.fmt, self.config.margin, self.config.pow2)

    def _fp8(self, x: torch.Tensor, layer_idx: int, kind: str) -> torch.Tensor:
        B, H, T, D = x.shape
        x32 = x.float()
        scale = self._scale(x32, layer_idx, kind)
        if scale.dim() == 0:
            q = quantize(x32, self.fmt, scale=scale)
            scale_full = scale
        else:  # per KV head: rows of (H, B*T*D), one scale per row
            rows = x32.transpose(0, 1).reshape(H, -1)
            q = quantize(rows, self.fmt, granularity="row", axis=-1, scale=scale.reshape(H, 1))
            scale_full = scale.reshape(1, H, 1, 1)
        deq = q.dequantize(torch.float32)
        if scale.dim() != 0:
            deq = deq.reshape(H, B, T, D).transpose(0, 1)
        if self.counting:
            # Same definitions as quant.quant_error, per head.
            limit = self.fmt.max + self.fmt.step_at_max / 2
            over = (x32.abs() / scale_full > limit) & torch.isfinite(x32)
            under = (x32 != 0) & (deq == 0)
            self.overflow[(layer_idx, kind)] += over.sum(dim=(0, 2, 3))
            self.underflow[(layer_idx, kind)] += under.sum(dim=(0, 2, 3))
            self.numel[(layer_idx, kind)] += B * T * D
        return deq.to(x.dtype)

    def health(self) -> dict:
        """Clipping and underflow fractions per layer, K/V and head, and overall per K/V."""
        layers, totals = [], {t: [0, 0, 0] for t in "kv"}
        for (layer_idx, kind), over in sorted(self.overflow.items()):
            n = self.numel[(layer_idx, kind)]
            if kind not in self.config.kv or n == 0:
                continue
            under = self.underflow[(layer_idx, kind)]
            layers.append({"layer": layer_idx, "tensor": kind, "elements_per_head": n,
                           "clip_frac": float(over.sum()) / (n * len(over)),
                           "underflow_frac": float(under.sum()) / (n * len(over)),
                           "clip_frac_per_head": [float(c) / n for c in over],
                           "underflow_frac_per_head": [float(u) / n for u in under]})
            totals[kind][0] += int(over.sum())
            totals[kind][1] += int(under.sum())
            totals[kind][2] += n * len(over)
        overall = {t: {"clip_frac": c / n, "underflow_frac": u / n} for t, (c, u, n) in totals.items() if n}
        return {"layers": layers, "overall": overall}


def head_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| per KV head of x (B, H, T, D) -> (H,) fp32."""
    return x.detach().abs().amax(dim=(0, 2, 3)).float()


@contextmanager
def kv_transforms(model: nn.Module, transform: Optional[Callable]):
    """Install ``transform`` as every attention layer's kv_transform for the duration of the block."""
    attns = [m for m in model.modules() if hasattr(m, "kv_transform") and hasattr(m, "layer_idx")]
    if not attns:
        raise ValueError("this model has no attention layers with a kv_transform hook (kv-eval needs fp8train's "
                         "Decoder; model.hf_config models are not supported)")
    previous = [m.kv_transform for m in attns]
    for m in attns:
        m.kv_transform = transform
    try:
        yield
    finally:
        for m, p in zip(attns, previous):
            m.kv_transform = p


class _AmaxRecorder:
    """Reference cache that also records the running per-head amax of K and V (for calibration)."""

    def __init__(self):
        self.amax: dict = {}

    def __call__(self, k, v, layer_idx):
        k, v = bf16_cache(k, v, layer_idx)
        for kind, x in (("k", k), ("v", v)):
            key = (layer_idx, kind)
            a = head_amax(x)
            self.amax[key] = a if key not in self.amax else torch.maximum(self.amax[key], a)
        return k, v


@torch.no_grad()
def calibrate_kv_amax(model: nn.Module, batches, autocast: bool) -> dict:
    """{(layer, "k"|"v"): per-head amax (H,)} over ``batches`` with the reference cache."""
    if not batches:
        raise ValueError("the calibration split is empty (--calib-batches 0 or no calibration windows); "
                         "give --calib-batches >= 1 or use --scale-source dynamic")
    recorder = _AmaxRecorder()
    with kv_transforms(model, recorder):
        for x, _ in batches:
            with _autocast(autocast):
                model(x)
    return recorder.amax


def scales_from_amax(amax: dict, config: KvCacheConfig) -> dict:
    """Frozen dequant scales for ``config`` from calibrated per-head amaxes."""
    scales = {}
    for key, a in amax.items():
        a = a.max() if config.granularity == "tensor" else a
        scales[key] = scale_from_amax(a, config.fmt, config.margin, config.pow2)
    return scales


def _autocast(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else nullcontext()


# ------------------------------------------------------------------------------------------------------------
# Scoring: per-token loss, accuracy and KL for several caches on the same batches
# ------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def _logp(model, x, transform, autocast: bool) -> torch.Tensor:
    with kv_transforms(model, transform), _autocast(autocast):
        logits, _ = model(x)
    return logits.float().log_softmax(-1)  # (B, T, V) fp32


@torch.no_grad()
def score_caches(models: dict, batches, caches: dict, autocast: bool, reference=("bf16", "bf16")) -> dict:
    """Per-token numbers of every (weights, cache) cell on the same batches.

    ``models``: {weights label: model}, the reference weights first; ``caches``: {cache label: kv_transform,
    None, or {weights label: kv_transform}}; the first cache is the per-weights reference. Returns {(weights, cache): {"loss", "correct", "kl", "kl_global"}} with (N, T) tensors:
    kl against the same weights with the first cache, kl_global against the ``reference`` cell.
    """
    cache_names = list(caches)
    out = {(w, c): {"loss": [], "correct": [], "kl": [], "kl_global": []} for w in models for c in caches}
    for x, y in batches:
        logp_global = None
        for w, model in models.items():
            logp_ref = None
            for c in cache_names:
                transform = caches[c][w] if isinstance(caches[c], dict) else caches[c]
                logp = _logp(model, x, transform, autocast)
                logp_ref = logp if logp_ref is None else logp_ref
                if (w, c) == tuple(reference):
                    logp_global = logp
                cell = out[(w, c)]
                cell["loss"].append(-logp.gather(-1, y.unsqueeze(-1)).squeeze(-1))
                cell["correct"].append((logp.argmax(-1) == y).float())
                cell["kl"].append(_kl(logp_ref, logp))
                cell["kl_global"].append(_kl(logp_global, logp) if logp_global is not None else None)
    for cell in out.values():
        for key, parts in cell.items():
            cell[key] = torch.cat(parts) if all(p is not None for p in parts) else None
    return out


def _kl(logp_ref: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) per token, (B, T)."""
    return (logp_ref.exp() * (logp_ref - logp)).sum(-1)


def position_buckets(n_positions: int, edges=None) -> list[tuple[int, int]]:
    """[lo, hi) position ranges: 0-7, 8-15, 16-31, ... doubling up to n_positions (or the given edges)."""
    if edges is None:
        edges = [0, 8]
        while edges[-1] * 2 < n_positions:
            edges.append(edges[-1] * 2)
        edges = [e for e in edges if e < n_positions] + [n_positions]
    edges = sorted(set(int(e) for e in edges))
    if edges[0] != 0 or edges[-1] > n_positions or len(edges) < 2:
        raise ValueError(f"--buckets {edges}: edges must start at 0, increase and end at most at {n_positions}")
    return list(zip(edges[:-1], edges[1:]))


def _mean_ci(per_sequence: torch.Tensor) -> dict:
    values = per_sequence.double()
    n = values.numel()
    mean = float(values.mean())
    half = _Z95 * float(values.std(unbiased=True)) / math.sqrt(n) if n > 1 else math.nan
    return {"mean": mean, "ci95": half}


def bucket_stats(cell: dict, ref_cell: dict, buckets, global_cell: Optional[dict] = None) -> list[dict]:
    """Per bucket: mean and 95% CI over sequences of loss, its delta to ``ref_cell``, KL, accuracy."""
    rows = []
    for lo, hi in buckets:
        per_seq = lambda t: t[:, lo:hi].mean(dim=1)  # noqa: E731  (N,)
        row = {"positions": [lo, hi - 1], "loss": _mean_ci(per_seq(cell["loss"])),
               "loss_delta": _mean_ci(per_seq(cell["loss"] - ref_cell["loss"])),
               "kl": _mean_ci(per_seq(cell["kl"])), "accuracy": _mean_ci(per_seq(cell["correct"])),
               "accuracy_delta": _mean_ci(per_seq(cell["correct"] - ref_cell["correct"]))}
        if global_cell is not None:
            row["loss_delta_vs_bf16_bf16"] = _mean_ci(per_seq(cell["loss"] - global_cell["loss"]))
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------------
# Greedy continuations (recomputed, not incremental: see the module docstring)
# ------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, n_tokens: int, transform, autocast: bool) -> torch.Tensor:
    """(B, n_tokens) greedy continuation of ``prompts`` (B, P); each step reruns the whole sequence."""
    seq = prompts
    for _ in range(n_tokens):
        with kv_transforms(model, transform), _autocast(autocast):
            logits, _ = model(seq)
        seq = torch.cat([seq, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompts.shape[1]:]


def _agreement(ref: torch.Tensor, test: torch.Tensor) -> dict:
    same = ref == test  # (B, G)
    prefix = torch.cumprod(same.long(), dim=1).sum(dim=1).float()  # tokens agreeing before the first difference
    return {"exact_match": float(same.all(dim=1).float().mean()), "token_agreement": float(same.float().mean()),
            "mean_agreeing_prefix": float(prefix.mean()), "prompts": ref.shape[0], "tokens": ref.shape[1]}


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
    return [KvCacheConfig(fmt, kv, opts.granularity, opts.scale_source, opts.margin, opts.pow2)
            for fmt in opts.formats for kv in opts.kv]


def kv_eval(run_dir, opts: KvEvalOptions = KvEvalOptions(), log=print) -> dict:
    """Run the whole evaluation of ``run_dir`` (see the module docstring); returns the report as a dict."""
    import platform

    from fp8train.training.data import build_data
    from fp8train.serving.export import fp8_weight_model, load_run

    configs = _cache_configs(opts)  # bad options fail before anything is loaded
    if opts.matrix:
        get_format(opts.weight_format)
    run = load_run(run_dir, log=log)
    cfg, model = run.cfg, run.model
    seq_len = cfg.model.seq_len
    n_pos = opts.max_positions or seq_len
    if not 1 <= n_pos <= seq_len:
        raise ValueError(f"--max-positions {n_pos} must be in [1, model.seq_len={seq_len}]")
    buckets = position_buckets(n_pos, opts.buckets)
    autocast = cfg.train.autocast == "bf16"
    data = build_data(cfg)
    val = data.val_batches()
    val = val[:opts.batches] if opts.batches else val
    batches = [(x[:, :n_pos], y[:, :n_pos]) for x, y in val]

    calibration = None
    amax = None
    if opts.scale_source == "calibrated":
        calib = [data.train_batch(cfg.train.max_steps + i) for i in range(max(0, opts.calib_batches))]
        calib = [(x[:, :n_pos], y[:, :n_pos]) for x, y in calib]
        amax = calibrate_kv_amax(model, calib, autocast)
        calibration = {"split": "train", "how": f"data.train_batch(step) for steps {cfg.train.max_steps}.."
                       f"{cfg.train.max_steps + len(calib) - 1} (after the run's last step)",
                       "batches": len(calib), "sequences": sum(len(x) for x, _ in calib),
                       "tokens": sum(x.numel() for x, _ in calib)}

    n_layers, n_kv = cfg.model.n_layers, cfg.model.kv_heads()
    models = {"bf16": model}
    if opts.matrix:
        if not run.fp8_names:
            raise ValueError(f"--matrix: the layer policy in {run.run_dir}/config.yaml puts no Linear in FP8 (e.g. "
                             f"policy.min_features={cfg.policy.min_features} exceeds every layer), so FP8 weights "
                             "would equal bf16 weights; drop --matrix")
        models["fp8"] = fp8_weight_model(model, run.fp8_names, opts.weight_format)
    fp8_caches = {}
    for c in configs:
        scales = scales_from_amax(amax, c) if amax is not None else None
        fp8_caches[c.label] = {w: Fp8KvCache(c, n_layers, n_kv, scales) for w in models}
    log(f"kv-eval: {len(batches)} batches x {len(batches[0][0])} sequences x {n_pos} positions, "
        f"{len(models)} weight precision(s) x {1 + len(configs)} caches")

    # One pass: every cell on every batch. Each (weights, cache) has its own Fp8KvCache, so its own health counts.
    cells = score_caches(models, batches, {"bf16": bf16_cache, **fp8_caches}, autocast)
    global_ref = cells[("bf16", "bf16")]

    # Greedy continuations on the first gen_prompts sequences.
    generation = {}
    if opts.gen_prompts > 0 and opts.gen_tokens > 0:
        prompt_len = opts.prompt_len or n_pos - opts.gen_tokens
        if prompt_len < 1 or prompt_len + opts.gen_tokens > seq_len:
            raise ValueError(f"--prompt-len {prompt_len} + --gen-tokens {opts.gen_tokens} must fit in "
                             f"model.seq_len={seq_len} with a prompt of at least 1 token")
        prompts = torch.cat([x for x, _ in val])[:opts.gen_prompts, :prompt_len]
        for w, m in models.items():
            ref_tokens = greedy_generate(m, prompts, opts.gen_tokens, bf16_cache, autocast)
            generation[(w, "bf16")] = _agreement(ref_tokens, ref_tokens)
            for label in fp8_caches:
                cache = fp8_caches[label][w]
                cache.counting = False  # health counts the evaluation forwards only
                tokens = greedy_generate(m, prompts, opts.gen_tokens, cache, autocast)
                generation[(w, label)] = _agreement(ref_tokens, tokens)
        generation_info = {"prompts": len(prompts), "prompt_len": prompt_len, "tokens": opts.gen_tokens,
                           "method": "greedy, full recompute per step, K/V through the cache transform"}
    else:
        generation_info = None

    report_cells = []
    for (w, c), cell in cells.items():
        ref_cell = cells[(w, "bf16")]
        all_positions = [(0, n_pos)]
        entry = {"weights": w, "cache": c,
                 "cache_config": asdict(next(x for x in configs if x.label == c)) if c != "bf16" else None,
                 "overall": bucket_stats(cell, ref_cell, all_positions, global_ref)[0],
                 "by_position": bucket_stats(cell, ref_cell, buckets, global_ref if opts.matrix else None),
                 "generation": generation.get((w, c)),
                 "health": fp8_caches[c][w].health() if c != "bf16" else None}
        entry["overall"].pop("positions")
        if cell["kl_global"] is not None:
            entry["overall"]["kl_vs_bf16_bf16"] = _mean_ci(cell["kl_global"].mean(dim=1))
        report_cells.append(entry)

    head_dim = cfg.model.d_model // cfg.model.n_heads
    return {
        "manifest": {
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
            "fp8train_version": __version__, "torch_version": torch.__version__, "python": platform.python_version(),
        },
        "model": {"n_layers": n_layers, "n_kv_heads": n_kv, "head_dim": head_dim, "seq_len": seq_len},
        "memory": {"rows": memory_report(n_layers, n_kv, head_dim, seq_len),
                   "scale_bytes_static": {g: kv_scale_bytes(n_layers, n_kv, g) for g in GRANULARITIES}},
        "buckets": [[lo, hi - 1] for lo, hi in buckets],
        "cells": report_cells,
    }


# ------------------------------------------------------------------------------------------------------------
# Report files
# ------------------------------------------------------------------------------------------------------------
def _fmt(stat: dict, scale: float = 1.0, digits: int = 4) -> str:
    mean, ci = stat["mean"] * scale, stat["ci95"] * scale
    return f"{mean:.{digits}g} ± {ci:.2g}" if math.isfinite(ci) else f"{mean:.{digits}g}"


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f} KiB" if n < 2**20 else f"{n / 2**20:,.1f} MiB"


def write_report(result: dict, out_dir) -> dict:
    """kv_eval.json, kv_eval.md and kv_eval.png in ``out_dir``; returns their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "kv_eval.json", "md": out_dir / "kv_eval.md", "png": out_dir / "kv_eval.png"}
    paths["json"].write_text(json.dumps(result, indent=1))
    paths["md"].write_text(_markdown(result))
    _plot(result, paths["png"])
    return {k: str(v) for k, v in paths.items()}


def _markdown(r: dict) -> str:
    m = r["manifest"]
    lines = ["# FP8 KV-cache evaluation", "",
             f"Run `{m['run_dir']}`, checkpoint {m['checkpoint']} (step {m['checkpoint_step']}), seed {m['seed']}, "
             f"trained with recipe `{m['run_recipe']}`; weights: {m['weights_loaded_as']}; autocast {m['autocast']}; "
             f"backend {m['backend']}.", "",
             f"Cache: formats {', '.join(m['formats'])}; FP8 tensors {', '.join(m['kv'])}; granularity "
             f"{m['granularity']}; scale source {m['scale_source']}; margin {m['margin']}"
             f"{' (pow2 scales)' if m['pow2'] else ''}. Reference: {m['reference_cache']}. KL: {m['kl']}. "
             f"Intervals: {m['ci']}.", "",
             f"Evaluated on {m['eval']['sequences']} validation sequences x {m['eval']['positions']} positions."]
    if m["calibration"]:
        c = m["calibration"]
        lines.append(f"Calibration split: {c['split']} ({c['how']}), {c['sequences']} sequences, {c['tokens']} tokens.")
    lines += ["", "## KV memory", "", "| cache | per token | per full context |", "|---|---|---|"]
    for row in r["memory"]["rows"]:
        lines.append(f"| {row['cache']} | {_kib(row['bytes_per_token'])} ({row['bytes_per_token']} B) | "
                     f"{_kib(row['bytes_per_context'])} ({row['seq_len']} tokens) |")
    s = r["memory"]["scale_bytes_static"]
    lines += ["", f"Scales (not in the payload above): static per-tensor {s['tensor']} B, per-head {s['head']} B per "
              "model (fp32, K and V); dynamic per-token-per-head scales would add 8 B x layers x KV heads per token.",
              "", "## Overall", "",
              "| weights | cache | loss | Δloss vs bf16 cache | KL | accuracy | Δaccuracy | greedy exact match | "
              "K clip / underflow | V clip / underflow |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cell in r["cells"]:
        o, g, h = cell["overall"], cell["generation"], cell["health"]
        health = {t: f"{100 * v['clip_frac']:.3g}% / {100 * v['underflow_frac']:.3g}%"
                  for t, v in (h["overall"].items() if h else [])}
        greedy = "-" if g is None else f"{100 * g['exact_match']:.0f}% (prefix {g['mean_agreeing_prefix']:.1f})"
        lines.append(f"| {cell['weights']} | {cell['cache']} | {_fmt(o['loss'])} | {_fmt(o['loss_delta'])} | "
                     f"{_fmt(o['kl'])} | {_fmt(o['accuracy'])} | {_fmt(o['accuracy_delta'])} | {greedy} | "
                     f"{health.get('k', '-')} | {health.get('v', '-')} |")
    if m["matrix"]:
        lines += ["", "## Weights x cache (Δ vs bf16 weights, bf16 cache)", "",
                  "| weights | cache | Δloss | KL |", "|---|---|---|---|"]
        for cell in r["cells"]:
            o = cell["overall"]
            lines.append(f"| {cell['weights']} | {cell['cache']} | {_fmt(o['loss_delta_vs_bf16_bf16'])} | "
                         f"{_fmt(o['kl_vs_bf16_bf16']) if 'kl_vs_bf16_bf16' in o else '-'} |")
    lines += ["", "## By context position", ""]
    for cell in r["cells"]:
        if cell["cache"] == "bf16":
            continue
        lines += [f"### weights {cell['weights']}, cache {cell['cache']}", "",
                  "| positions | Δloss | KL | accuracy | Δaccuracy |", "|---|---|---|---|---|"]
        for b in cell["by_position"]:
            lines.append(f"| {b['positions'][0]}-{b['positions'][1]} | {_fmt(b['loss_delta'])} | {_fmt(b['kl'])} | "
                         f"{_fmt(b['accuracy'])} | {_fmt(b['accuracy_delta'])} |")
        lines.append("")
    lines += ["## Cache health by layer (clip % / underflow %; per head in kv_eval.json)", ""]
    for cell in r["cells"]:
        if cell["health"] is None or cell["weights"] != "bf16":
            continue
        lines += [f"{cell['cache']}:", "", "| layer | tensor | clip % | underflow % | worst head clip % |",
                  "|---|---|---|---|---|"]
        for row in cell["health"]["layers"]:
            lines.append(f"| {row['layer']} | {row['tensor']} | {100 * row['clip_frac']:.3g} | "
                         f"{100 * row['underflow_frac']:.3g} | {100 * max(row['clip_frac_per_head']):.3g} |")
        lines.append("")
    lines.append("Plot: kv_eval.png (Δloss and KL against context position, 95% intervals).")
    return "\n".join(lines) + "\n"


def _plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fp8_cells = [c for c in r["cells"] if c["cache"] != "bf16"]
    fig, (ax_loss, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.5 + 0.25 * len(fp8_cells)))
    colors = plt.get_cmap("tab20" if len(fp8_cells) > 10 else "tab10").colors
    for i, cell in enumerate(fp8_cells):
        mids = [(lo + hi) / 2 for lo, hi in (b["positions"] for b in cell["by_position"])]
        label = cell["cache"] if not r["manifest"]["matrix"] else f"{cell['weights']} weights, {cell['cache']}"
        style = dict(color=colors[i % len(colors)], capsize=3, label=label,
                     marker="o" if cell["weights"] == "bf16" else "s", ls="-" if cell["weights"] == "bf16" else "--")
        for ax, key in ((ax_loss, "loss_delta"), (ax_kl, "kl")):
            ys = [b[key]["mean"] for b in cell["by_position"]]
            errs = [0 if not math.isfinite(b[key]["ci95"]) else b[key]["ci95"] for b in cell["by_position"]]
            ax.errorbar(mids, ys, yerr=errs, **style)
    ax_loss.axhline(0, color="gray", lw=0.8)
    ax_loss.set(xlabel="context position (bucket midpoint)", ylabel="loss(FP8 cache) - loss(bf16 cache) [nats]",
                title="Loss delta by position (95% CI)")
    ax_kl.set(xlabel="context position (bucket midpoint)", ylabel="KL(bf16 cache || FP8 cache) [nats/token]",
              title="Next-token KL by position (95% CI)")
    m = r["manifest"]
    fig.suptitle(f"FP8 KV cache, step {m['checkpoint_step']}: {m['granularity']} scales, {m['scale_source']}, "
                 f"margin {m['margin']}")
    for ax in (ax_loss, ax_kl):
        ax.grid(alpha=0.3)
    # One legend under both panels, so it never covers the curves.
    handles, labels = ax_loss.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(3, max(1, len(labels))), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.035 * math.ceil(len(labels) / 3), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def _csv(text: str) -> tuple:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_cli_arguments(parser) -> None:
    parser.add_argument("run_dir", help="run directory (its newest valid checkpoint and config.yaml)")
    parser.add_argument("--out", help="output folder (default RUN_DIR/kv_eval)")
    parser.add_argument("--format", default="e4m3fn,e5m2",
                        help=f"FP8 cache format(s), comma-separated: {', '.join(CACHE_FORMATS)} (default e4m3fn,e5m2)")
    parser.add_argument("--kv", default="kv", help="FP8 tensors, comma-separated caches: k, v, kv (default kv)")
    parser.add_argument("--granularity", default="tensor", choices=GRANULARITIES,
                        help="one scale per layer (tensor) or per KV head (head)")
    parser.add_argument("--scale-source", default="calibrated", choices=SCALE_SOURCES,
                        help="calibrated: amax on train-split windows, frozen; dynamic: amax of each forward")
    parser.add_argument("--margin", type=int, default=0, help="scale headroom, powers of two (default 0)")
    parser.add_argument("--pow2", action="store_true", help="round scales up to powers of two")
    parser.add_argument("--batches", type=int, default=0, help="validation batches (default: all of the run's)")
    parser.add_argument("--max-positions", type=int, default=0, help="positions per sequence (default seq_len)")
    parser.add_argument("--calib-batches", type=int, default=4, help="calibration batches (train split; default 4)")
    parser.add_argument("--gen-prompts", type=int, default=8, help="prompts for greedy continuations (0 = off)")
    parser.add_argument("--gen-tokens", type=int, default=16, help="greedy tokens per prompt (default 16)")
    parser.add_argument("--prompt-len", type=int, default=0, help="prompt length (default positions - gen tokens)")
    parser.add_argument("--buckets", help="position bucket edges, e.g. 0,8,16,32,64 (default doubling from 8)")
    parser.add_argument("--matrix", action="store_true", help="also FP8 weights (per output channel) x cache")
    parser.add_argument("--weight-format", default="e4m3fn", help="FP8 weight format for --matrix")


def cli_main(args) -> int:
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    opts = KvEvalOptions(
        formats=_csv(args.format), kv=_csv(args.kv), granularity=args.granularity, scale_source=args.scale_source,
        margin=args.margin, pow2=args.pow2, batches=args.batches, max_positions=args.max_positions,
        calib_batches=args.calib_batches, gen_prompts=args.gen_prompts, gen_tokens=args.gen_tokens,
        prompt_len=args.prompt_len, matrix=args.matrix, weight_format=args.weight_format,
        buckets=tuple(int(e) for e in _csv(args.buckets)) if args.buckets else None)
    for key, value in (("--batches", opts.batches), ("--max-positions", opts.max_positions),
                       ("--calib-batches", opts.calib_batches), ("--gen-prompts", opts.gen_prompts),
                       ("--gen-tokens", opts.gen_tokens), ("--prompt-len", opts.prompt_len)):
        if value < 0:
            raise ValueError(f"{key} must be >= 0, got {value}")
    result = kv_eval(args.run_dir, opts, log=lambda m: print(m, file=sys.stderr))
    paths = write_report(result, args.out or Path(args.run_dir) / "kv_eval")
    _print_summary(result)
    print(f"report: {paths['md']}  ({paths['json']}, {paths['png']})")
    return 0


def _print_summary(r: dict) -> None:
    mdl = r["model"]
    print(f"KV cache of this model ({mdl['n_layers']} layers x {mdl['n_kv_heads']} KV heads x head_dim "
          f"{mdl['head_dim']}), payload without scales:")
    for row in r["memory"]["rows"]:
        print(f"  {row['cache']:<15} {_kib(row['bytes_per_token']):>12} per token, "
              f"{_kib(row['bytes_per_context']):>12} per {row['seq_len']}-token context")
    for cell in r["cells"]:
        o = cell["overall"]
        print(f"  weights {cell['weights']:<4} cache {cell['cache']:<34} loss {_fmt(o['loss'])}  "
              f"Δloss {_fmt(o['loss_delta'])}  KL {_fmt(o['kl'])}")
