"""Per-layer FP8 health: what each Fp8Linear's operands lose to quantization.

Every ``log.telemetry_every`` steps the loop turns ``layer.telemetry`` on for one step; each Fp8Linear then
records, per operand role (input, weight, grad_output): amax, scale, overflow (clipped) fraction, underflow
(flushed-to-zero) fraction, SQNR against the unquantized tensor and, for delayed scaling, staleness (this
step's amax over the amax its scale was made from: > 1 means the tensor grew past what its scale expected).
Sampling keeps the cost off the other steps. Records go to ``telemetry.jsonl`` (one line per sampled step,
every layer and role) and a few worst-case numbers go into metrics.jsonl and wandb.

Layer names are module paths in the trained model. For a Hugging Face model fp8train trains a wrapper whose
`hf` attribute is the transformers model, so its names read `hf.<transformers name>` (`hf.model.layers.0.mlp.
up_proj`); policy.exclude patterns and the advisor's suggestions match those names. `collect_fp8_telemetry` (for
code that holds the transformers model itself) drops the prefix.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from fp8train.nn.convert import fp8_layers
from fp8train.nn.recipes import ROLES
from fp8train.training.storage.files import append_jsonl, read_jsonl

STAT_KEYS = ("amax", "scale", "overflow_frac", "underflow_frac", "sqnr_db", "staleness", "nonfinite")


def enable(layers, on: bool) -> None:
    for _, layer in layers:
        layer.telemetry = on
        if on:
            layer.last_stats = {}


def expert_scalings(model) -> list:
    """(name, ExpertScaling) of every FP8 grouped layer of `model` (fp8train's Fp8GroupedLinear: the layer's
    name; a transformers experts projection: `{module}.{param}`), in module order."""
    from fp8train.nn.experts_scaling import ExpertScaling

    found = []
    for name, module in model.named_modules():
        if isinstance(module, ExpertScaling):
            owner, _, leaf = name.rpartition(".")
            found.append((owner if leaf == "scaling" else name.removesuffix("_fp8"), module))
    return found


def enable_experts(scalings, on: bool) -> None:
    """Per-expert telemetry of grouped layers: each expert records as its own dense layer would."""
    for _, scaling in scalings:
        scaling.telemetry = on
        if on:
            for view in scaling.experts:
                view.last_stats = {}


def collect_experts(scalings) -> dict:
    """{`{layer}.expert{e}`: {role: stats}} for every expert that ran in the sampled step (an expert that got no
    token records its weight only); turns sampling off."""
    stats = {}
    for name, scaling in scalings:
        for index, view in enumerate(scaling.experts):
            stats[f"{name}.expert{index}"] = {role: _plain(s) for role, s in view.last_stats.items()}
        scaling.telemetry = False
    return stats


def expert_layer_of(name: str) -> str | None:
    """The grouped layer of a per-expert telemetry name (`layers.1.mlp.experts.down.expert3` ->
    `layers.1.mlp.experts.down`), None for any other name."""
    head, _, tail = name.rpartition(".expert")
    return head if head and tail.isdigit() else None


def collect(layers) -> dict:
    """{layer name: {role: stats}} from the last sampled forward/backward; turns sampling off."""
    stats = {}
    for name, layer in layers:
        stats[name] = {role: _plain(s) for role, s in getattr(layer, "last_stats", {}).items()}
        layer.telemetry = False
    return stats


def _plain(stats: dict) -> dict:
    out = {}
    for key, value in stats.items():
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value.float().mean().item()
        out[key] = value
    return out


def summarize(stats: dict) -> dict:
    """Worst cases across layers for the metrics line: max overflow/underflow per role, min SQNR per role."""
    out = {}
    for role in ROLES:
        rows = [s[role] for s in stats.values() if role in s]
        if not rows:
            continue
        out[f"fp8/{role}/overflow_max"] = max(r.get("overflow_frac", 0.0) or 0.0 for r in rows)
        out[f"fp8/{role}/underflow_max"] = max(r.get("underflow_frac", 0.0) or 0.0 for r in rows)
        sqnrs = [r["sqnr_db"] for r in rows if r.get("sqnr_db") is not None and math.isfinite(r["sqnr_db"])]
        if sqnrs:
            out[f"fp8/{role}/sqnr_min_db"] = min(sqnrs)
        stale = [r["staleness"] for r in rows if r.get("staleness") is not None]
        if stale:
            out[f"fp8/{role}/staleness_max"] = max(stale)
    return out


def counters(layers) -> dict:
    """Running event counts over all layers (non-finite amaxes that were kept out of the scales), read in one
    device-to-host copy (the loop calls this on logged steps; a read per buffer was a host sync each)."""
    keys, buffers = [], []
    for role in ROLES:
        for kind, suffix in (("nonfinite_amax_events", "nonfinite_amax_count"),
                             # delayed scaling: steps whose whole tensor fell below the smallest normal under a
                             # stale (outlier) scale
                             ("stale_scale_steps", "stale_scale_steps")):
            for _, layer in layers:
                buf = getattr(layer, f"{role}_{suffix}", None)
                if buf is not None:
                    keys.append(f"fp8/{role}/{kind}")
                    buffers.append(buf.reshape(()).long())
    values = torch.stack(buffers).tolist() if buffers else []
    out = {}
    for role in ROLES:  # keys in the order the metrics line always had
        out[f"fp8/{role}/nonfinite_amax_events"] = 0
        if f"fp8/{role}/stale_scale_steps" in keys:
            out[f"fp8/{role}/stale_scale_steps"] = 0
    for key, value in zip(keys, values):
        out[key] += value
    return out


def append(path: Path, step: int, stats: dict, enabled: bool = True, extra: dict | None = None) -> None:
    """One telemetry.jsonl line; `extra` adds top-level keys ("shadow": recipe shadowing, "gemms": kernel paths)."""
    if enabled:  # strict JSON: non-finite floats as strings ("inf"), which _number reads back
        append_jsonl(path, [{"step": step, "layers": _strings_for_nonfinite(stats),
                             **_strings_for_nonfinite(extra or {})}])


def _strings_for_nonfinite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _strings_for_nonfinite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strings_for_nonfinite(v) for v in value]
    return value


def capture_step(model, layers, x, y, autocast) -> dict:
    """Re-run one micro-batch with telemetry on (used when a step diverges, to say which layer broke)."""
    enable(layers, True)
    was_training = model.training
    try:
        with autocast():
            _, loss = model(x, y)
        if torch.isfinite(loss):
            loss.backward()
    except RuntimeError:  # the point is to capture what we can
        pass
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return collect(layers)


def record_problem(record: dict) -> str | None:
    """None when a telemetry.jsonl record has the shape `append` writes ({"layers": {layer: {role: {stat: value}}},
    "shadow": {layer: {recipe: {role: {stat: value}}}} when present), else what is wrong: readers index it that
    deep, so a wrongly shaped line is refused as damaged rather than crashing them."""
    for key, depth in (("layers", 3), ("shadow", 4)):
        if key == "shadow" and key not in record:
            continue
        if not _nested_dicts(record.get(key), depth):
            return f"has a wrongly shaped {key!r} (expected {' -> '.join(['{name'] * (depth - 1) + ['{stat: value}'])})"
    return None


def _nested_dicts(value, depth: int) -> bool:
    if not isinstance(value, dict):
        return False
    return depth == 1 or all(_nested_dicts(v, depth - 1) for v in value.values())


def load(path: str | Path, on_damaged=None) -> list[dict]:
    """telemetry.jsonl's records; a torn last line (kill -9 mid-append) is dropped, damage elsewhere (also a
    wrongly shaped record) is named, or passed to `on_damaged(message)` and skipped."""
    return read_jsonl(path, check=record_problem, on_damaged=on_damaged)


# ------------------------------------------------------------------------------------------------------------
# For library and transformers.Trainer users (fp8train.collect_fp8_telemetry, Fp8TelemetryCallback)
# ------------------------------------------------------------------------------------------------------------
def sample_fp8_telemetry(model) -> int:
    """Turn per-layer sampling on for the next forward and backward of `model`'s Fp8Linear layers (it costs host
    syncs and a pass over each operand, so sample one step now and then); returns how many layers sample."""
    layers = fp8_layers(model)
    enable(layers, True)
    return len(layers)


def collect_fp8_telemetry(model, per_layer: bool = True) -> dict[str, float]:
    """Per-layer FP8 health of the last sampled step, as flat tracker metrics, and sampling off again:
    `fp8/<layer>/<role>/<stat>` for every Fp8Linear (role: input, weight, grad_output; stat: amax, scale,
    overflow_frac, underflow_frac, sqnr_db, staleness for delayed scaling, nonfinite), then the worst cases over
    layers (`fp8/<role>/sqnr_min_db`, ...; the only keys with per_layer=False). Layer names are the model's own
    module paths (fp8train's wrapper prefix `hf.` removed). {} when no step was sampled since the last call.

        fp8train.sample_fp8_telemetry(model)
        loss = model(**batch).loss; loss.backward()
        accelerator.log(fp8train.collect_fp8_telemetry(model), step=step)   # or wandb.log(...)
    """
    layers = fp8_layers(model)
    prefix = getattr(model, "wrapped_name_prefix", "")  # fp8train's HFCausalLM: hf.<the transformers name>
    stats = {name[len(prefix):] if prefix and name.startswith(prefix) else name: roles
             for name, roles in collect(layers).items() if roles}
    for _, layer in layers:  # read once: the next call reports the next sampled step, or nothing
        layer.last_stats = {}
    out = {}
    if per_layer:
        for name, roles in stats.items():
            for role, values in roles.items():
                out.update({f"fp8/{name}/{role}/{key}": float(value) for key, value in values.items()
                            if isinstance(value, (int, float)) and not isinstance(value, bool)})
    return {**out, **summarize(stats)} if stats else {}
