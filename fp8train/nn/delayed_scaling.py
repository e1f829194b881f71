"""Delayed scaling's machinery in one place: the per-step update, the optimizer-step count, the missing-update
check, the host mirror of the `initialized` flags, the stale-scale counters and the rules loaded state must satisfy.

``update_fp8_scales`` gathers the delayed layers and their pending amaxes (one all-reduce); ``update_group``
then applies the documented step (fp8train.nn.linear's docstring, "Delayed scaling, exactly") to the per-role
quantizers (fp8train.nn.quantizer.OperandQuantizer) of a group of layers sharing recipe options, on their stacked
buffers, with a fixed number of tensor ops however many layers there are, and refreshes the host mirror.

The optimizer-step count is process-wide (one torch.optim step post-hook), registered by the first forward that
needs it (a delayed layer's missing-update check, or any layer caching its FP8 weight: fused AdamW writes the
weights without bumping tensor._version), never by importing fp8train or building a layer.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from fp8train.nn.recipes import ROLES, Fp8Recipe
from fp8train.numerics import native_cast
from fp8train.numerics.native_delayed import delayed_update, update_plan
from fp8train.numerics.quant import max_scale, scale_rule

__all__ = ["update_fp8_scales", "update_group", "refuse_bad_fp8_state", "check_scales_updated",
           "watch_optimizer_steps", "optimizer_steps_seen", "MISSING_UPDATE_WARNING"]

optimizer_steps = 0  # steps of any torch.optim optimizer since step_hook was registered
step_hook = None  # its handle, once a layer needs the count


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global optimizer_steps
    optimizer_steps += 1


def watch_optimizer_steps() -> None:
    """Count optimizer steps from now on (process-wide, registered once; module docstring).

    Fused AdamW (transformers' Trainer default, fp8train's on CUDA) writes the weights in place without bumping
    tensor._version, so a layer's FP8 weight cache could not see its updates: every optimizer step counts
    instead, and the delayed-scaling check (check_scales_updated) reads the same count. A count that starts late
    is enough, as both readers compare it with the value they saw at an earlier forward."""
    global step_hook
    if step_hook is None:
        step_hook = register_optimizer_step_post_hook(_count_optimizer_step)


def optimizer_steps_seen() -> int:
    """The optimizer-step count an FP8 weight cache keys on, counting from the first call: for caches outside
    Fp8Linear (all experts' weights at once, nn/experts_weights.py)."""
    watch_optimizer_steps()
    return optimizer_steps


_missing_update_warned = False  # the delayed-scaling warning (linear's module docstring, 3.): once per process
MISSING_UPDATE_WARNING = (
    "Fp8Linear with delayed scaling: a forward runs with amaxes pending from an earlier optimizer step, so "
    "update_fp8_scales(model) was not called after that optimizer.step(): the delayed scales never update and "
    "every step is scaled from its own amax (current scaling). Call fp8train.update_fp8_scales(model) after each "
    "optimizer.step(); with transformers.Trainer pass callbacks=[fp8train.Fp8ScalingCallback()]")


def check_scales_updated(pending_since_step: int | None, stacklevel: int = 4) -> int:
    """The delayed-scaling check (linear's module docstring, 3.) for a training forward, given the optimizer-step
    count its owner (an Fp8Linear, or a grouped layer's per-expert state, nn/experts_scaling.py) saw at its first
    pending record (None: none yet): warns once per process when amaxes recorded before an optimizer step are
    still pending, i.e. update_fp8_scales was not called after that step. Returns the count to keep."""
    global _missing_update_warned
    if step_hook is None:
        watch_optimizer_steps()
    if pending_since_step is None:
        return optimizer_steps
    if pending_since_step != optimizer_steps and not _missing_update_warned:
        _missing_update_warned = True
        warnings.warn(MISSING_UPDATE_WARNING, RuntimeWarning, stacklevel=stacklevel)
    return pending_since_step

_STATE = ("amax_history", "scale", "scale_amax", "initialized", "stale_scale_steps")
_STATE_AND_PENDING = _STATE + ("pending_amax",)  # (what the native update writes: the pending amax too)

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


# ------------------------------------------------------------------------------------------------------------
# The update: all layers at once, on stacked buffers
# ------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def update_fp8_scales(model: torch.nn.Module, process_group=None) -> None:
    """Roll delayed-scaling histories once per optimizer step (after optimizer.step()). No-op for other recipes.

    All pending amaxes of all layers go through ONE all_reduce(MAX) when torch.distributed is initialized, so
    every data-parallel rank ends the step with identical scales. The update itself runs on stacked buffers:
    a fixed number of tensor ops per group of layers sharing history length and scale options (usually one
    group), however many layers there are, plus a few per grouped (experts) layer, however many experts it has.
    """
    # Units: a delayed Fp8Linear, or one expert of a grouped layer's per-expert state (nn/experts_scaling.py,
    # which lists them as `delayed_units`); each holds one quantizer per role. Every unit's amaxes go through the
    # same single all-reduce. A grouped layer whose (E,) role buffers hold its experts' rows
    # (`stacked_delayed_state`) is read and written a buffer at a time, not an expert at a time: 3 * E rows
    # each read and written by itself cost ~2000 small ops a step at E = 16 (a few ms on a CPU, more when its
    # threads wait on a loaded host). Row order (the all-reduced vector's): the single units' (unit, role) rows,
    # then each stacked layer's (expert, role) rows.
    # (each module's class and __dict__ are asked, not the module: getattr of a name a module lacks goes through
    # nn.Module.__getattr__ and a caught AttributeError, ~3 us for each of a model's modules every step)
    owners, singles, stacked = [], [], []
    for module in model.modules():
        if hasattr(type(module), "delayed_units"):
            if not module.delayed_units:
                continue
            owners.append(module)
            if getattr(module, "stacked_delayed_state", False):
                stacked.append(module)
            else:
                singles.extend(module.delayed_units)
        elif isinstance(module.__dict__.get("quantizers"), dict) and module.recipe.is_delayed:  # an Fp8Linear
            owners.append(module)
            singles.append(module)
    if not owners:
        return
    # One process and no stacked layer: each quantizer's pending amax is its row as it stands (update_group reads
    # it there); else the rows are gathered into one vector, for the all-reduce and the stacked layers' rows.
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(process_group) > 1
    step_amax = pendings = None
    if distributed or stacked:
        pendings = _pending_buffers(singles)
        step_amax = _rows(pendings, stacked, "pending_amax")  # (3 * units,)
        if distributed:
            dist.all_reduce(step_amax, op=dist.ReduceOp.MAX, group=process_group)
    groups: dict[tuple, tuple[list, list, list]] = {}  # key -> (single units, stacked layers, their unit rows)
    for index, unit in enumerate(singles):
        device = unit.quantizers[ROLES[0]].buffer("pending_amax").device
        member = groups.setdefault(_group_key(unit.recipe, device), ([], [], []))
        member[0].append(unit)
        member[2].append(index)
    first = len(singles)
    for layer in stacked:
        count = len(layer.delayed_units)
        member = groups.setdefault(_group_key(layer.delayed_units[0].recipe, layer.input_pending_amax.device),
                                   ([], [], []))
        member[1].append(layer)
        member[2].extend(range(first, first + count))
        first += count
    pending_reset = True  # (the native update sets its rows' pending amaxes back to -1 itself)
    for units, layers, indices in groups.values():
        rows = step_amax if step_amax is None or len(indices) == first \
            else step_amax.view(-1, len(ROLES))[indices].reshape(-1)
        native = update_group([u.quantizers[role] for u in units for role in ROLES], rows, tuple(layers))
        pending_reset = pending_reset and native
    if not pending_reset:
        pendings = _pending_buffers(singles) if pendings is None else pendings
        unset = torch.full_like(step_amax[0] if step_amax is not None else pendings[0], -1.0)
        sources = [unset] * len(pendings)
        for layer in stacked:
            pendings += [getattr(layer, f"{role}_pending_amax") for role in ROLES]
            sources += [unset.expand_as(pendings[-1])] * len(ROLES)
        torch._foreach_copy_(pendings, sources)  # one multi-tensor op: torch's foreach kernels have no public name
    for owner in owners:
        owner.scales_updated()


def _pending_buffers(singles: list) -> list:
    """The single units' pending amaxes, (unit, role) after (unit, role): the all-reduced vector's first rows."""
    return [u.quantizers[role].buffer("pending_amax") for u in singles for role in ROLES]


_recipe_keys: dict = {}  # id(recipe) -> (recipe, its options' key): one recipe object serves a run's layers


def _group_key(r: Fp8Recipe, device) -> tuple:
    found = _recipe_keys.get(id(r))
    if found is None or found[0] is not r:
        if len(_recipe_keys) > 256:  # (recipes made per call, e.g. in a sweep: start over rather than grow)
            _recipe_keys.clear()
        found = _recipe_keys[id(r)] = (r, (r.amax_history_len, r.amax_compute_algo, r.margin, r.pow2_scales,
                                           r.amax_outlier_factor, tuple(r.format_of(role) for role in ROLES)))
    return found[1] + (device,)


def _rows(buffers: list, stacked: tuple, name: str) -> torch.Tensor:
    """`buffers` (one row each) stacked, then each stacked layer's (E,) `name` buffers of its roles as its
    (expert, role) rows: (rows, ...)."""
    pieces = [torch.stack(buffers)] if buffers else []
    pieces += [torch.stack([getattr(layer, f"{role}_{name}") for role in ROLES], dim=1).flatten(0, 1)
               for layer in stacked]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def update_group(quantizers: list, step_amax: torch.Tensor | None, stacked: tuple = ()) -> bool:
    """The documented delayed-scaling step for `quantizers` (of layers with the same recipe options), one row of
    `step_amax` each (None: each quantizer's own pending amax, as one process has it; only without `stacked`),
    then for each grouped layer in `stacked` (its `stacked_delayed_state`: (E,) buffers per role) its (expert,
    role) rows. Returns True where the native kernel ran it (CPU, no grouped layer, scales not rounded to powers
    of two): it has set the quantizers' pending amaxes back to -1 too; else the caller does."""
    every = quantizers + [u.quantizers[role] for layer in stacked for u in layer.delayed_units for role in ROLES]
    r = every[0].recipe
    formats = tuple(q.format for q in every)
    per_quantizer = [q.buffers(_STATE_AND_PENDING) for q in quantizers]
    if not stacked and not r.pow2_scales and (step_amax is None or step_amax.is_cpu) and native_cast.available():
        # the same operations in one native call, each quantizer's buffers in place (native_delayed.py); its
        # pointer arrays are made once and kept with the group's first quantizer while they hold
        buffers = [b for row in per_quantizer for b in row]
        plan = quantizers[0].kept_update_plan = update_plan(quantizers, buffers, _STATE_AND_PENDING,
                                                            quantizers[0].kept_update_plan)  # (None: drops a stale one)
        if plan is not None:
            fmt_max, min_normal, cap = _format_constants(formats, False, torch.device("cpu"))
            flags = delayed_update(plan, None if step_amax is None else step_amax.contiguous(), fmt_max,
                                   min_normal, cap, r.margin, r.amax_compute_algo == "most_recent",
                                   r.amax_outlier_factor)
            if flags is not None:
                _refresh_host_mirror(every, flags)
                return True
    state = {name: [row[i] for row in per_quantizer] for i, name in enumerate(_STATE_AND_PENDING)}
    if step_amax is None:  # (one process: the quantizers' own pending amaxes are the rows)
        step_amax = torch.stack(state["pending_amax"])
    history, scale, scale_amax, initialized, stale = (_rows(state[name], stacked, name) for name in _STATE)
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
    targets = [b for name in _STATE for b in state[name]]
    sources = [row for name in _STATE for row in new[name][:len(quantizers)].unbind(0)]
    first = len(quantizers)
    for layer in stacked:
        count = len(layer.delayed_units)
        for name in _STATE:
            block = new[name][first:first + count * len(ROLES)].unflatten(0, (count, len(ROLES)))
            targets += [getattr(layer, f"{role}_{name}") for role in ROLES]
            sources += block.unbind(1)
        first += count * len(ROLES)
    torch._foreach_copy_(targets, sources)  # one multi-tensor op (see above)
    _refresh_host_mirror(every, initialized)
    return False


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
