"""Run-directory I/O, in one place: where a run's files live, and how they are written and read safely.

Every writer in fp8train goes through these functions, so the promises below hold for every file a run leaves:
- `write_text_atomic` / `write_json_atomic` replace a file whole (temp file in the same folder, then
  `os.replace`): a process killed mid-write leaves the old file or the new one, never half of it, and the temp
  file is removed if the write itself fails (full disk, read-only folder);
- JSON is strict: NaN and +-inf are written as null (`json_safe`), so every file parses with any JSON reader;
- `read_jsonl` drops a torn last line (what `kill -9` during an append leaves) and reports, by file name and
  line number, a damaged line anywhere else;
- nothing is written through a symlink inside a run directory (`refuse_symlink`): a link planted there could
  make a run overwrite a file outside it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "CONFIG_FILE", "METRICS_FILE", "TELEMETRY_FILE", "SUMMARY_FILE", "CHECKPOINTS_DIR", "TRACKERS_FILE",
    "run_dir_path", "json_safe", "dumps", "write_text_atomic", "write_json_atomic", "read_json", "read_jsonl",
    "append_jsonl", "truncate_jsonl", "refuse_symlink",
]

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
TELEMETRY_FILE = "telemetry.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINTS_DIR = "checkpoints"
TRACKERS_FILE = "trackers.json"  # tracker run ids (wandb), so a resumed run continues the same tracker run


def run_dir_path(parent: str | os.PathLike, name: str) -> Path:
    """The run directory `<run.dir>/<run.name>`."""
    return Path(parent) / name


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float replaced by None, recursively (strict JSON has no NaN or Infinity)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def dumps(value: Any, **kwargs) -> str:
    """Strict JSON text of `value` (NaN/inf as null; unknown objects via str)."""
    return json.dumps(json_safe(value), allow_nan=False, default=str, **kwargs)


def refuse_symlink(path: Path) -> None:
    """Raise if `path` is a symlink: fp8train never writes through a link inside a run directory."""
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link; fp8train does not write through links in a run directory "
                         "(remove the link)")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` whole with `text`; a killed or failing write leaves the previous file and no temp file."""
    path = Path(path)
    refuse_symlink(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    write_text_atomic(path, dumps(value, indent=2) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """Parse a JSON file; a damaged one is a ValueError that names the file."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); the file is damaged") from err


def read_jsonl(path: str | os.PathLike, *, require_step: bool = True) -> list[dict]:
    """The records of a JSONL file, in order. A torn LAST line (a writer killed mid-append) is dropped silently;
    a damaged line before it is a ValueError naming the file and line. Missing file: no records.
    With `require_step`, only records whose "step" is an int are kept (the run-log convention)."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                break  # torn last line
            raise ValueError(f"{path}, line {number}, is not valid JSON ({err.msg}); the file is damaged") from err
        if isinstance(record, dict) and (not require_step or isinstance(record.get("step"), int)):
            records.append(record)
    return records


def append_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Append one strict-JSON line per record. If the file ends in a torn line, it is cut off first, so the new
    records start on a line of their own."""
    path = Path(path)
    refuse_symlink(path)
    text = "".join(dumps(r) + "\n" for r in records)
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                data = path.read_bytes()
                path.write_bytes(data[:data.rfind(b"\n") + 1])
    with open(path, "a") as f:
        f.write(text)


def truncate_jsonl(path: str | os.PathLike, last_step: int) -> list[dict]:
    """Keep only the records of steps <= `last_step` (a resumed run rewrites what came after its checkpoint), and
    return them; the file is replaced whole. Missing file: nothing to do, no records."""
    path = Path(path)
    kept = [r for r in read_jsonl(path) if r["step"] <= last_step]
    if path.exists():
        write_text_atomic(path, "".join(dumps(r) + "\n" for r in kept))
    return kept
