"""A run's logged losses, read back from metrics.jsonl (a torn last line, what kill -9 leaves, is dropped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fp8train.training.storage.files import read_jsonl, restore_nonfinite
from fp8train.training.storage.rundir import METRICS_FILE

__all__ = ["Curve", "load_curve"]


@dataclass
class Curve:
    """{step: value} of validation and training loss, and the logged throughput. Later lines win (a resumed run
    rewrites the steps after its checkpoint)."""

    val: dict[int, float] = field(default_factory=dict)
    train: dict[int, float] = field(default_factory=dict)
    tokens_per_s: list[float] = field(default_factory=list)


def _record_problem(record: dict) -> str | None:
    for key in ("val_loss", "loss", "tokens_per_s"):
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"has a non-numeric {key!r} ({str(value)[:40]!r})"
    return None


def _number(value) -> float:
    # strict JSON writes NaN and inf as null (restore_nonfinite brings back the marked ones): an unmarked null
    # loss is still a non-finite loss
    return float("nan") if value is None else float(value)


def load_curve(run_dir: str | Path, on_damaged=None) -> Curve:
    """The run's curve; a damaged metrics.jsonl line raises a ValueError naming it, or with `on_damaged(message)`
    is reported there and skipped."""
    curve = Curve()
    for record in map(restore_nonfinite, read_jsonl(Path(run_dir) / METRICS_FILE, check=_record_problem,
                                                    on_damaged=on_damaged)):
        step = record["step"]
        if "val_loss" in record:
            curve.val[step] = _number(record["val_loss"])
        if "loss" in record:
            curve.train[step] = _number(record["loss"])
        if record.get("tokens_per_s") is not None:
            curve.tokens_per_s.append(float(record["tokens_per_s"]))
    return curve
