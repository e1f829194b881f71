"""Delayed scaling's per-step arithmetic on stacked buffers, and the rules loaded scaling state must satisfy.

``fp8train.nn.linear.update_fp8_scales`` gathers the delayed layers and their pending amaxes (one all-reduce);
``update_group`` then applies the documented step (fp8train.nn.linear's docstring, "Delayed scaling, exactly")
to the per-role quantizers (fp8train.nn.quantizer.OperandQuantizer) of a group of layers sharing recipe options,
on their stacked buffers, with a fixed number of tensor ops however many layers there are.
"""

from __future__ import annotations

import functools

import torch

from fp8train.nn.recipes import ROLES, Fp8Recipe
from fp8train.numerics.quant import max_scale, scale_rule

__all__ = ["update_group", "refuse_bad_fp8_state"]

_STATE = ("amax_history", "scale", "scale_amax", "initialized", "stale_scale_steps")

# Loaded scaling state must be state this module could have produced: a NaN/inf/0/negative scale would quantize
# every later step wrongly (NaN loss many steps on, or a silently different curve) with nothing pointing at the
# checkpoint it came from. So a bad value is refused at load time, naming the buffer.
_LOADED_STATE_RULES = (("scale", "finite and > 0", lambda t: torch.isfinite(t) & (t > 0)),
                       ("scale_amax", "finite and >= 0", lambda t: torch.isfinite(t) & (t >= 0)),
                       ("amax_history", "finite and >= 0", lambda t: torch.isfinite(t) & (t >= 0)),
                       # event counters: a negative count would hide that many later events from telemetry
                       ("nonfinite_amax_count", "a count >= 0", lambda t: t >= 0),
                       ("stale_scale_steps", "a count >= 0", lambda t: t >= 0))


def refuse_bad_fp8_state(module, state_dict, prefix, *args) -> None:
    for name, buffer in module.named_buffers(recurse=False):  # torch's own size-mismatch error comes later, as a bug
        value = state_dict.get(f"{prefix}{name}")
        if isinstance(value, torch.Tensor) and buffer is not None and value.shape != buffer.shape:
            raise ValueError(f"FP8 scaling state {prefix}{name} has shape {tuple(value.shape)}, this layer's is "
                             f"{tuple(buffer.shape)} (another fp8.amax_history_len or recipe than the checkpoint's, "
                             "or an edited state; nothing was loaded into this layer)")
    for role in ROLES:
        for suffix, allowed, ok in _LOADED_STATE_RULES:
            key = f"{prefix}{role}_{suffix}"
            value = state_dict.get(key)
            if value is not None and not bool(ok(value.float()).all()):
                shown = value.float()[~ok(value.float())].reshape(-1)[:3].tolist()
                raise ValueError(f"FP8 scaling state {key} holds {shown}; it must be {allowed} (a damaged or "
                                 "hand-edited state; nothing was loaded into this layer)")


def update_group(quantizers: list, step_amax: torch.Tensor) -> None:
    """The documented delayed-scaling step for `quantizers` (of layers with the same recipe options), one row of
    `step_amax` each."""
    r = quantizers[0].recipe
    state = {name: [q.buffer(name) for q in quantizers] for name in _STATE}
    history, scale, scale_amax, initialized, stale = (torch.stack(state[name]) for name in _STATE)
    formats = tuple(q.format for q in quantizers)
    fmt_max, min_normal, cap = _format_constants(formats, r.pow2_scales, step_amax.device)
    recorded = step_amax >= 0  # pending stays at -1 when no micro-batch recorded an amax
    # A step whose amax lands below the smallest normal under the scale in force: an outlier blinds the layer.
    stale.add_(recorded & initialized & (step_amax > 0) & (step_amax.double() < scale.double() * min_normal))
    rolled = torch.cat([step_amax.unsqueeze(1), history[:, :-1]], dim=1)
    history = torch.where(recorded.unsqueeze(1), rolled, history)
    amax = _history_amax(history, r)
    usable = recorded & (amax > 0)
    new_scale = scale_rule(amax, fmt_max, cap, r.margin, r.pow2_scales)
    scale = torch.where(usable, new_scale, scale)
    scale_amax = torch.where(usable, amax, scale_amax)
    initialized = initialized | usable
    new = {"amax_history": history, "scale": scale, "scale_amax": scale_amax, "initialized": initialized,
           "stale_scale_steps": stale}
    # one multi-tensor op for the whole list: torch's foreach kernels have no public name
    torch._foreach_copy_([b for name in _STATE for b in state[name]],
                         [row for name in _STATE for row in new[name].unbind(0)])
    _refresh_host_mirror(quantizers, initialized)


def _refresh_host_mirror(quantizers: list, initialized: torch.Tensor) -> None:
    """Reads the `initialized` flags back to the quantizers' host mirrors (one host sync) while some are still
    False, on the 1st, 2nd, 4th, 8th, ... update since the mirror was reset. A role whose amax stays 0 (a
    zero-initialized projection, a branch whose gradient is always zero) never turns True; reading it every step
    would sync every step. Until the mirror learns a flag the forward takes the on-device fallback, which gives
    the same bits."""
    pending = [q for q in quantizers if not q.initialized_on_host]
    for q in pending:
        q.mirror_updates += 1
    if not any(q.mirror_updates & (q.mirror_updates - 1) == 0 for q in pending):  # no power of two
        return
    for q, flag in zip(quantizers, initialized.tolist()):
        q.initialized_on_host = flag


@functools.lru_cache(maxsize=256)
def _format_constants(formats: tuple, pow2: bool, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per row: the format's max, min normal and the scale cap, made once per group of layers: a tensor built
    from a Python list on a GPU is a blocking host-to-device copy, i.e. a host sync, and this runs every step."""
    return tuple(torch.tensor(values, dtype=torch.float64, device=device) for values in (
        [f.max for f in formats], [f.min_normal for f in formats], [max_scale(f.max, pow2) for f in formats]))


def _history_amax(history: torch.Tensor, r: Fp8Recipe) -> torch.Tensor:
    """Per row: max of the history ('max') or its newest entry ('most_recent'); with amax_outlier_factor, a
    single entry above factor x the second largest (> 0) is passed over for that second largest."""
    if r.amax_compute_algo == "most_recent":
        return history[:, 0]
    if not r.amax_outlier_factor or history.shape[1] < 2:
        return history.amax(dim=1)
    top2 = history.topk(2, dim=1).values
    largest, second = top2[:, 0], top2[:, 1]
    outlier = (second > 0) & (largest > second * r.amax_outlier_factor)
    return torch.where(outlier, second, largest)
