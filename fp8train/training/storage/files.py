"""Files written and read safely, in one place: every writer in fp8train goes through these functions, so the
promises below hold for every file a run (or an export, a plan, a report) leaves:
- `write_file_atomic` (and `write_text_atomic` / `write_json_atomic` on it) replace a file whole: a temp file in
  the same folder, named with the PID and random digits so no two writers share one, fsync'd, `os.replace`d
  onto the target and the folder fsync'd; a process killed mid-write leaves the old file or the new one, never
  half of it, and the temp file is removed if the write itself fails (full disk, read-only folder). Every
  error names the target, never the temp name (`write_failure`);
- JSON is strict: NaN and +-inf are written as null (`json_safe`), so every file parses with any JSON reader;
- `read_jsonl` drops a torn last line (what `kill -9` during an append leaves) and reports, by file name and
  line number, a damaged line anywhere else;
- nothing is written through a symlink (`refuse_symlink`): a link planted at an output path could make fp8train
  overwrite a file outside it;
- a failed write (full disk, read-only or forbidden folder) is one line naming the file (`write_error`).
Where a run's files live and who works in a run directory: fp8train.training.storage.rundir. What a command may
write or replace outside a run directory (--out paths, --force): fp8train.training.storage.outputs.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = [
    "json_safe", "dumps", "nonfinite_fields", "restore_nonfinite", "refuse_symlink", "temp_path", "stale_temps",
    "WRITE_ERRNOS",
    "write_failure", "write_error", "as_os_error", "write_file_atomic", "write_text_atomic", "write_json_atomic",
    "read_json", "read_jsonl", "append_jsonl", "truncate_jsonl", "give_default_mode", "sha256_file",
]

NONFINITE_FIELD = "nonfinite"  # {"loss": "nan"} beside "loss": null: strict JSON that still says what it was
# Write failures that are the environment's, not fp8train's: reported in one line, never as a traceback.
WRITE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.EFBIG}


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


def nonfinite_fields(record: dict, prefix: str = "") -> dict[str, str]:
    """{dotted key: "nan" | "inf" | "-inf"} for every non-finite float in `record` (nested dicts included)."""
    found = {}
    for key, value in record.items():
        if isinstance(value, float) and not math.isfinite(value):
            found[prefix + str(key)] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        elif isinstance(value, dict):
            found.update(nonfinite_fields(value, f"{prefix}{key}."))
    return found


def _marked(record: Any) -> Any:
    """A dict record gains a `nonfinite` field naming what json_safe turned into null (nothing if all finite)."""
    if isinstance(record, dict):
        found = nonfinite_fields(record)
        if found:
            return {**record, NONFINITE_FIELD: found}
    return record


def restore_nonfinite(record: dict) -> dict:
    """The inverse of the marking: top-level keys listed in `nonfinite` get their float values back."""
    marks = record.get(NONFINITE_FIELD)
    if not isinstance(marks, dict):
        return record
    out = dict(record)
    for key, text in marks.items():
        if key in out and out[key] is None and text in ("nan", "inf", "-inf"):
            out[key] = float(text)
    return out


def refuse_symlink(path: Path) -> None:
    """Raise if `path` is a symlink: fp8train never writes through a link (a planted one would make it overwrite
    the link's target, wherever that is)."""
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link (to {os.readlink(path)}); fp8train does not write through "
                         "links (remove the link or choose another path; nothing was changed)")


def temp_path(path: Path) -> Path:
    """A temp name beside `path` that no other writer picks: hidden, with this process's PID and 8 random hex
    digits (two threads or two processes writing the same file never share a temp file)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


_TEMP_TAIL = r"\.tmp-(\d+)-[0-9a-f]{8}"  # what temp_path adds to a name


def stale_temps(path: Path) -> list[Path]:
    """The temp files of `path` (temp_path's names, and those of an atomic write into such a temp name) that a
    process left beside it and is no longer running to finish: killed mid-write. Only files of exactly those names,
    and only when no process with a PID in the name is alive (this one included): a live writer's are never
    listed."""
    path = Path(path)
    single = re.compile(rf"\.{re.escape(path.name)}{_TEMP_TAIL}")
    nested = re.compile(rf"\.\.{re.escape(path.name)}{_TEMP_TAIL}{_TEMP_TAIL}")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return []
    stale = []
    for entry in entries:
        match = single.fullmatch(entry.name) or nested.fullmatch(entry.name)
        if match and not any(_alive(int(pid)) for pid in match.groups()) \
                and entry.is_file() and not entry.is_symlink():
            stale.append(entry)
    return stale


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: asks whether the process exists, sends nothing
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or a name that is no PID here): left alone
    return True


def _fsync_folder(folder: Path) -> None:
    # The rename itself is durable only once the folder's entry is on disk; some filesystems cannot fsync a
    # folder (EINVAL), which costs durability on a crash, not correctness.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_failure(err: OSError, path: Path) -> Exception:
    """The error to raise for a failed write of `path`: it names `path` (never a temp name). A failure of the
    environment (full disk, read-only, forbidden) stays an OSError, so a run records it (`record_write_failure`);
    any other (no such folder, not a folder, /proc) is a one-line ValueError."""
    if err.errno in WRITE_ERRNOS:
        return OSError(err.errno, err.strerror or os.strerror(err.errno), str(path))
    reason = err.strerror or str(err)
    return ValueError(f"cannot write {path}: {reason} (nothing was written there)")


def write_error(err: BaseException) -> str | None:
    """One line for a write failure of the environment (full disk, read-only or forbidden folder), else None."""
    if not isinstance(err, OSError) or err.errno not in WRITE_ERRNOS:
        return None
    where = f" {err.filename}" if err.filename else ""
    return f"cannot write{where}: {os.strerror(err.errno)} (errno {errno.errorcode[err.errno]})"


def as_os_error(err: BaseException, path: str | os.PathLike) -> OSError | None:
    """The OSError inside a library error that carries it only in its text (safetensors' writer reports a full
    disk as `SafetensorError: ... No space left on device (os error 28)`), so it is reported like any other."""
    if isinstance(err, OSError):
        return err
    found = re.search(r"\(os error (\d+)\)", str(err))
    return OSError(int(found.group(1)), os.strerror(int(found.group(1))), str(path)) if found else None


def write_file_atomic(path: str | os.PathLike, write: Callable[[Path], Any]) -> None:
    """Replace `path` whole with what `write(temp_path)` writes: the temp file beside it is fsync'd, renamed onto
    `path` and the folder fsync'd; a killed or failing write leaves the previous file and no temp file. `path`
    must not be a symbolic link. Errors name `path`."""
    path = Path(path)
    refuse_symlink(path)
    if path.is_dir():
        raise ValueError(f"cannot write {path}: it is a folder (nothing was changed)")
    tmp = temp_path(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        _remove_temp(tmp)
        raise write_failure(err, path) from err
    except BaseException:
        _remove_temp(tmp)
        raise
    _fsync_folder(path.parent)


def _remove_temp(tmp: Path) -> None:
    """Remove a failed write's temp file if it is there. Its own failure (the folder is gone, or is a file) must
    not replace the error being raised, which names the path the caller gave."""
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace `path` whole with `text` (write_file_atomic)."""
    write_file_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(path: str | os.PathLike, value: Any) -> None:
    """Strict JSON, written atomically; a dict with non-finite floats says which in its `nonfinite` field."""
    write_text_atomic(path, dumps(_marked(value), indent=2) + "\n")


def read_json(path: str | os.PathLike) -> dict:
    """Parse a JSON file holding an object (every file fp8train keeps: summaries, plans, manifests, markers); a
    damaged one (not UTF-8, not JSON, or a list or number instead of an object) is a ValueError naming the file."""
    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}); the file is damaged") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err.msg} at line {err.lineno}); the file is damaged") from err
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object; the file is damaged")
    return value


def read_jsonl(path: str | os.PathLike, *, require_step: bool = True, check=None, on_damaged=None) -> list[dict]:
    """The records of a JSONL file, in order. A torn LAST line (a writer killed mid-append) is dropped silently.
    A damaged line before it (bytes that are not UTF-8, not JSON, or a record that `check(record) -> problem or
    None` refuses) is a ValueError naming the file and line; with `on_damaged(message)` it is reported there
    and skipped instead. Missing file: no records. With `require_step`, only records whose "step" is an int
    are kept (the run-log convention)."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_bytes().splitlines()  # bytes: one bad byte damages its line, not the whole file
    records = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record, problem = json.loads(raw.decode("utf-8")), None
        except UnicodeDecodeError:
            problem = "is not UTF-8 text"
        except json.JSONDecodeError as err:
            problem = f"is not valid JSON ({err.msg})"
        if problem is not None and number == len(lines):
            break  # torn last line
        if problem is None and isinstance(record, dict) and check is not None:
            problem = check(record)
        if problem is not None:
            message = f"{path}, line {number}, {problem}; the file is damaged"
            if on_damaged is None:
                raise ValueError(message)
            on_damaged(message)
            continue
        if isinstance(record, dict) and (not require_step or isinstance(record.get("step"), int)):
            records.append(record)
    return records


def append_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Append one strict-JSON line per record. If the file ends in a torn line, it is cut off first, so the new
    records start on a line of their own."""
    path = Path(path)
    refuse_symlink(path)
    text = "".join(dumps(_marked(r)) + "\n" for r in records)
    try:
        if path.exists() and path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    data = path.read_bytes()
                    with open(path, "r+b") as torn:  # cut in place: never rewrite the whole log through a new file
                        torn.truncate(data.rfind(b"\n") + 1)
        with open(path, "a") as f:
            f.write(text)
    except OSError as err:  # a full disk mid-append: the error names the log (write() alone names nothing)
        raise write_failure(err, path) from err


def truncate_jsonl(path: str | os.PathLike, last_step: int, check=None, log=None) -> list[dict]:
    """Keep only the records of steps <= `last_step` (a resumed run rewrites what came after its checkpoint), and
    return them; the file is replaced whole. Missing file: nothing to do, no records. Damaged lines (see
    read_jsonl) are dropped and named through `log` (default: raise), so a damaged log never blocks a resume."""
    path = Path(path)
    on_damaged = None if log is None else (lambda message: log(f"dropping a damaged line: {message}"))
    kept = [r for r in read_jsonl(path, check=check, on_damaged=on_damaged) if r["step"] <= last_step]
    if path.exists():
        write_text_atomic(path, "".join(dumps(r) + "\n" for r in kept))
    return kept


def give_default_mode(path: str | os.PathLike) -> None:
    """The permissions an ordinary new file gets (0666 minus the umask). safetensors creates its files 0600,
    which leaves checkpoints and exports unreadable to the group that shares a run or serves a model."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (checkpoint shards can be large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
