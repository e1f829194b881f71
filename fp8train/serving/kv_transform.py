"""The FP8 KV-cache transform: what a cache holds for K and V, how its scales are calibrated, and how it is
installed into a model's attention layers (their `kv_transform` hook: fp8train's Decoder, and Hugging Face models
through fp8train.serving.kv_hooks.enable_kv_hook, installed by `kv_transforms`). See fp8train.serving.kvcache for
the evaluation."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from fp8train.numerics.formats import FORMATS, get_format
from fp8train.numerics.names import Granularity
from fp8train.numerics.quant import quantize, scale_from_amax
from fp8train.serving.kv_hooks import enable_kv_hook

__all__ = ["CACHE_FORMATS", "KV_CHOICES", "GRANULARITIES", "SCALE_SOURCES", "KvCacheConfig", "bf16_cache",
           "Fp8KvCache", "head_amax", "kv_transforms", "calibrate_kv_amax", "scales_from_amax", "autocast_bf16"]

CACHE_FORMATS = tuple(FORMATS)  # every format, by canonical name
KV_CHOICES = ("k", "v", "kv")
GRANULARITIES = ("tensor", "head")
SCALE_SOURCES = ("calibrated", "dynamic")

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
        if self.config.granularity == Granularity.TENSOR:
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
    """Install ``transform`` as every attention layer's kv_transform for the duration of the block (a Hugging Face
    model, bare or in fp8train's HFCausalLM as `.hf`, first gets the hook: kv_hooks.enable_kv_hook)."""
    for candidate in (model, getattr(model, "hf", None)):
        if hasattr(candidate, "_can_set_attn_implementation"):  # a transformers PreTrainedModel
            enable_kv_hook(candidate)
    attns = [m for m in model.modules() if hasattr(m, "kv_transform") and hasattr(m, "layer_idx")]
    if not attns:
        raise ValueError("this model has no attention layers with a kv_transform hook (fp8train's Decoder has "
                         "them; a Hugging Face model gets them when its attention goes through transformers' "
                         "AttentionInterface, which this architecture's does not)")
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
            with autocast_bf16(autocast):
                model(x)
    return recorder.amax


def scales_from_amax(amax: dict, config: KvCacheConfig) -> dict:
    """Frozen dequant scales for ``config`` from calibrated per-head amaxes."""
    scales = {}
    for key, a in amax.items():
        a = a.max() if config.granularity == Granularity.TENSOR else a
        scales[key] = scale_from_amax(a, config.fmt, config.margin, config.pow2)
    return scales


def autocast_bf16(enabled: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if enabled else nullcontext()

