"""What every config section shares: construction-time checks that name the dotted key and what is allowed."""

from __future__ import annotations

import dataclasses
import math
import os
import stat
from typing import Any, Iterable

# A config or plan file is a few KiB; a bound keeps a wrong path (a data file, a log) from being parsed for minutes.
MAX_SETTINGS_FILE_BYTES = 16 << 20


def check_settings_file(path: str, what: str) -> None:
    """`path` can be read as a settings file: it exists and is a regular file of at most 16 MiB. A FIFO or a
    device (/dev/zero, /dev/stdin) would block or never end, so each is refused by name before it is opened."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise ValueError(f"{what} {path!r} cannot be read: {err.strerror or err}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{what} {path!r} is a directory; give a YAML file")
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{what} {path!r} is not a regular file (a FIFO, socket or device would block or never "
                         "end); give a YAML file")
    if info.st_size > MAX_SETTINGS_FILE_BYTES:
        raise ValueError(f"{what} {path!r} is {info.st_size / 2**20:.0f} MiB; a settings file is at most "
                         f"{MAX_SETTINGS_FILE_BYTES >> 20} MiB (is it the right file?)")


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
