"""What every config section shares: construction-time checks that name the dotted key and what is allowed."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable


def require(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config {key}={value!r} is invalid: {allowed}")


class Section:
    """Mixin: `_check()` runs the section's validation at construction, naming keys as `<section>.<field>`."""

    _section = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # inf/nan pass every `>= low` check below, so refuse them first
            value = getattr(self, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"config {self._key(f.name)}={value!r} is invalid: must be a finite number")
        self._check()

    def _key(self, name: str) -> str:
        return f"{self._section}.{name}"

    def _check(self) -> None:  # overridden
        pass

    def _in(self, name: str, choices: Iterable[str]) -> None:
        value = getattr(self, name)
        require(value in choices, self._key(name), value, f"one of {list(choices)}")

    def _at_least(self, name: str, low: float, what: str = "") -> None:
        value = getattr(self, name)
        require(value >= low, self._key(name), value, what or f"must be >= {low}")
