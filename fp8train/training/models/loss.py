"""The language-model loss both model kinds return from `forward(idx, targets) -> (logits, loss)`."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["lm_loss"]


def lm_loss(logits: torch.Tensor, targets: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Mean next-token cross-entropy of `logits` (B, T, V) against `targets` (B, T); None without targets."""
    if targets is None:
        return None
    # fp32 softmax: a bf16 log-sum-exp over the vocabulary visibly biases the loss we compare runs by.
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
