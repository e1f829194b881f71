"""Scoring caches: per-token loss, accuracy and KL of several (weights, cache) cells on the same batches,
bucketed by context position with confidence intervals over sequences, and greedy continuations."""

from __future__ import annotations

import math
from typing import Optional

import torch

from fp8train.serving.kv_transform import autocast_bf16, kv_transforms

__all__ = ["score_caches", "bucket_edges", "position_buckets", "mean_ci", "bucket_stats", "greedy_generate",
           "agreement"]

_Z95 = 1.959963984540054  # two-sided 95% normal quantile

# ------------------------------------------------------------------------------------------------------------
# Scoring: per-token loss, accuracy and KL for several caches on the same batches
# ------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def _logp(model, x, transform, autocast: bool) -> torch.Tensor:
    with kv_transforms(model, transform), autocast_bf16(autocast):
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


def bucket_edges(text: str) -> tuple[int, ...]:
    """--buckets as given ("0,8,16"): whole numbers starting at 0, each above the one before (checked here, before
    the run is read; position_buckets checks the end against the positions)."""
    try:
        edges = tuple(int(e) for e in text.split(","))
    except ValueError:
        raise ValueError(f"--buckets {text!r}: give comma-separated whole numbers, e.g. 0,8,16,32") from None
    _check_edges(edges, None)
    return edges


def _check_edges(edges, n_positions: int | None) -> None:
    shown = ",".join(str(e) for e in edges)
    at_most = f" and end at most at {n_positions} (the positions evaluated)" if n_positions is not None else ""
    if len(edges) < 2 or edges[0] != 0 or any(b <= a for a, b in zip(edges, edges[1:])) \
            or (n_positions is not None and edges[-1] > n_positions):
        raise ValueError(f"--buckets {shown}: edges must start at 0, each be above the one before (no repeats)"
                         f"{at_most}")


def position_buckets(n_positions: int, edges=None) -> list[tuple[int, int]]:
    """[lo, hi) position ranges: 0-7, 8-15, 16-31, ... doubling up to n_positions (or the given edges)."""
    if edges is None:
        edges = [0, 8]
        while edges[-1] * 2 < n_positions:
            edges.append(edges[-1] * 2)
        edges = [e for e in edges if e < n_positions] + [n_positions]
    edges = [int(e) for e in edges]
    _check_edges(edges, n_positions)
    return list(zip(edges[:-1], edges[1:]))


def mean_ci(per_sequence: torch.Tensor) -> dict:
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
        row = {"positions": [lo, hi - 1], "loss": mean_ci(per_seq(cell["loss"])),
               "loss_delta": mean_ci(per_seq(cell["loss"] - ref_cell["loss"])),
               "kl": mean_ci(per_seq(cell["kl"])), "accuracy": mean_ci(per_seq(cell["correct"])),
               "accuracy_delta": mean_ci(per_seq(cell["correct"] - ref_cell["correct"]))}
        if global_cell is not None:
            row["loss_delta_vs_bf16_bf16"] = mean_ci(per_seq(cell["loss"] - global_cell["loss"]))
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
        with kv_transforms(model, transform), autocast_bf16(autocast):
            logits, _ = model(seq)
        seq = torch.cat([seq, logits[:, -1].float().argmax(-1, keepdim=True)], dim=1)
    return seq[:, prompts.shape[1]:]


def agreement(ref: torch.Tensor, test: torch.Tensor) -> dict:
    same = ref == test  # (B, G)
    prefix = torch.cumprod(same.long(), dim=1).sum(dim=1).float()  # tokens agreeing before the first difference
    return {"exact_match": float(same.all(dim=1).float().mean()), "token_agreement": float(same.float().mean()),
            "mean_agreeing_prefix": float(prefix.mean()), "prompts": ref.shape[0], "tokens": ref.shape[1]}

