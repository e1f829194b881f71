"""The built-in decoder's mixture-of-experts block: a router, dropless token-choice top-k routing, gated SiLU
experts run as grouped GEMMs, optional shared experts, and a load-balancing auxiliary loss.

Module names (a contract, as the dense decoder's are): `layers.{i}.mlp.router` (nn.Linear d_model -> n_experts,
kept in high precision by the default layer policy), `layers.{i}.mlp.experts.gate_up` (E experts, d_model ->
2 x expert_dim: gate rows first, then up rows) and `layers.{i}.mlp.experts.down` (expert_dim -> d_model), both
nn/experts.py GroupedLinear, which `convert_to_fp8` swaps for Fp8GroupedLinear in an FP8 run as it swaps
nn.Linear for Fp8Linear (the bf16 baseline keeps the high-precision grouped path); `layers.{i}.mlp.shared`
(a dense SwiGLU, when model.n_shared_experts > 0).

Routing, per token: router logits in fp32 (autocast off, fp32 weight and input), softmax over experts, the top_k
experts by probability (ties: the lower expert index, torch.topk's order is not relied on: see route()), their
probabilities renormalized to sum to 1 when top_k > 1 (top_k = 1 keeps the raw probability, so the router still
gets a gradient from the language-model loss). Dropless: every (token, expert) assignment runs; tokens are
sorted by expert (stable: by token order within an expert) into groups with cumulative ends `offs`.

Load-balancing loss (Switch Transformer; DeepSeek's per-sequence variant is not used): with N tokens,
f_e = (assignments to e) / (N top_k) and p_e = mean over tokens of the router probability of e,
aux = n_experts * sum_e f_e p_e (1.0 when routing is uniform). f_e is a count (no gradient); p_e carries it.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8train.nn.experts import GroupedLinear

__all__ = ["MoE", "Experts", "route", "moe_blocks", "moe_metrics", "routing_snapshot", "routing_agreement"]


def route(logits_fp32: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs (N, E) fp32, expert ids (N, k) int64, combine weights (N, k) fp32) for router logits (N, E)."""
    probs = logits_fp32.softmax(dim=-1)
    # Stable top-k: sort by probability descending, ties by expert index, so the choice is deterministic.
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    chosen = probs.gather(1, order)
    if top_k > 1:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return probs, order, chosen


class Experts(nn.Module):
    """E gated-SiLU experts over tokens sorted by expert: down(silu(gate) * up) per expert."""

    def __init__(self, n_experts: int, d_model: int, hidden: int, top_k: int):
        super().__init__()
        self.hidden = hidden
        self.gate_up = GroupedLinear(n_experts, d_model, 2 * hidden, top_k=top_k)
        self.down = GroupedLinear(n_experts, hidden, d_model, top_k=top_k)

    def forward(self, x_sorted: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x_sorted, offs).split(self.hidden, dim=-1)
        return self.down(F.silu(gate) * up, offs)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts). forward(x (B, T, C)) -> (B, T, C); after each forward,
    `aux_loss` (a () fp32 tensor with gradient), `expert_tokens` ((E,) int64 assignments per expert) and
    `routing` ((N, k) expert ids) describe that forward."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, hidden: int, n_shared: int, shared_cls):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = Experts(n_experts, d_model, hidden, top_k)
        self.shared = shared_cls(d_model, hidden * n_shared) if n_shared else None
        self.aux_loss: torch.Tensor | None = None
        self.expert_tokens: torch.Tensor | None = None
        self.routing: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        with torch.autocast(x.device.type, enabled=False):  # the routing decision in fp32
            logits = F.linear(flat.float(), self.router.weight.float())
        probs, experts, combine = route(logits, self.top_k)
        assignment_expert = experts.reshape(-1)  # (N k,): token n's slots at n*k .. n*k+k-1
        order = torch.sort(assignment_expert, stable=True).indices
        counts = torch.bincount(assignment_expert, minlength=self.n_experts)
        offs = counts.cumsum(0).to(torch.int32)
        token_of = order // self.top_k
        y_sorted = self.experts(flat[token_of], offs)
        y_sorted = y_sorted * combine.reshape(-1)[order].unsqueeze(-1).to(y_sorted.dtype)
        out = torch.zeros(B * T, C, dtype=y_sorted.dtype, device=x.device).index_add_(0, token_of, y_sorted)
        self.expert_tokens, self.routing = counts.detach(), experts.detach()
        f = counts.detach().float() / (B * T * self.top_k)
        self.aux_loss = self.n_experts * (f * probs.mean(dim=0)).sum()
        out = out.reshape(B, T, C)
        return out + self.shared(x) if self.shared is not None else out


def moe_blocks(model: nn.Module) -> list[tuple[str, MoE]]:
    """(name, MoE) of every MoE block of `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def moe_metrics(model: nn.Module) -> dict:
    """The metrics line's MoE numbers from the last forward: `moe/aux_loss` (the MoE blocks' load-balancing
    losses, summed, before model.aux_loss_coef) and `moe/max_load` (over blocks, the largest ratio of an
    expert's assignments to the mean per expert: 1.0 = perfectly balanced, n_experts = all on one). {} for a
    model without MoE blocks."""
    blocks = moe_blocks(model)
    if not blocks or blocks[0][1].expert_tokens is None:
        return {}
    counts = torch.stack([b.expert_tokens.float() / b.expert_tokens.float().mean() for _, b in blocks])
    aux = torch.stack([b.aux_loss.detach() for _, b in blocks]).sum()
    values = torch.stack([aux.float(), counts.max()]).tolist()  # one device-to-host copy
    return {"moe/aux_loss": values[0], "moe/max_load": values[1]}


@torch.no_grad()
def routing_snapshot(model: nn.Module, idx: torch.Tensor, autocast) -> dict:
    """{block name: {"expert_tokens": [assignments per expert], "routing": [per token: its top_k expert ids,
    ascending]}} of one eval-mode forward of `idx` under `autocast()`: what summary.json records so that two runs
    of a pair can be compared on the same tokens (routing_agreement)."""
    blocks = moe_blocks(model)
    if not blocks:
        return {}
    was_training = model.training
    model.eval()
    try:
        with autocast():
            model(idx)
    finally:
        model.train(was_training)
    out = {}
    for name, block in blocks:
        out[name] = {"expert_tokens": block.expert_tokens.tolist(),
                     "routing": block.routing.sort(dim=-1).values.tolist()}
    return out


def routing_agreement(baseline: dict, candidate: dict) -> dict:
    """Per block: the share of routing decisions (token, chosen expert) of `candidate` that `baseline` did not
    make on the same tokens (`flipped`: 0 = identical routing; each token's top_k set compared as a set), and
    the per-expert assignment counts of both with their difference. Blocks missing from either are left out."""
    result = {}
    for name, base in baseline.items():
        cand = candidate.get(name)
        if cand is None or len(cand["routing"]) != len(base["routing"]):
            continue
        decisions = sum(len(chosen) for chosen in base["routing"])
        changed = sum(len(set(c) - set(b)) for c, b in zip(cand["routing"], base["routing"]))
        result[name] = {"flipped": changed / decisions if decisions else 0.0,
                        "baseline_tokens": base["expert_tokens"], "candidate_tokens": cand["expert_tokens"],
                        "token_diff": [c - b for b, c in zip(base["expert_tokens"], cand["expert_tokens"])]}
    return result
