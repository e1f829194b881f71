"""KV-cache memory arithmetic: bytes of K and V per token, and of the scales of a static FP8 cache."""

from __future__ import annotations

from fp8train.numerics.names import Granularity
from fp8train.serving.kv_transform import CACHE_FORMATS

__all__ = ["kv_bytes_per_token", "kv_scale_bytes", "memory_report"]

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
    per_layer = 1 if granularity == Granularity.TENSOR else n_kv_heads
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

