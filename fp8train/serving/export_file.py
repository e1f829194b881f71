"""The single-file export's mark, and which existing file `export --out FILE.safetensors --force` may replace.

fp8train writes `"fp8train.serving.export": EXPORT_MARK` into the safetensors header of every single-file export
(serving/export.py, `_metadata`; a conversion keeps it). That entry is how a later export recognises the file as
fp8train's own: --force replaces such a file, as it replaces only an output folder holding fp8train's marker
(training/storage/outputs.py); any other file at --out (a user's model, a file that is not safetensors at all) is
refused before the run is read, and left as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from safetensors import safe_open

from fp8train.training.storage.outputs import check_output_file

__all__ = ["EXPORT_MARK", "MARK_KEY", "check_export_file", "export_mark"]

EXPORT_MARK = "fp8train-fp8-weights-v1"
MARK_KEY = "fp8train.serving.export"


def export_mark(path: Path) -> str | None:
    """The mark in the safetensors header of ``path`` (only the header is read); None for any other file."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return (f.metadata() or {}).get(MARK_KEY)
    except Exception:  # safetensors raises its own error types for a file that is not safetensors
        return None


def check_export_file(out, force: bool, sources: Iterable = ()) -> Path:
    """``out`` as the path of a single-file export: what check_output_file allows, and, when a file is there
    (with --force), one that fp8train wrote as an export."""
    def lacking(path: Path) -> str | None:
        return None if export_mark(path) == EXPORT_MARK else \
            f"its safetensors header holds no {MARK_KEY!r}: {EXPORT_MARK!r}"

    return check_output_file(out, force=force, sources=sources, ours=lacking)
