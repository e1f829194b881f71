"""Where a command's outputs may go (`export --out`, `kv-eval --out`, `layer-recipes --out`, the files of `report`),
checked before the work starts, and how a whole output folder is replaced.

The writes themselves are storage.files' (atomic, no links). What this module adds is what may be written and removed:
- an output path is checked before any work: not empty, not a symbolic link, of the right kind (a file output is
  never a folder, a folder output is never a file: `--force` never turns one into the other), not the source run,
  a folder holding it, its checkpoints or one of the files a run keeps; and the nearest existing folder above it
  takes a new file (a probe file is made and removed there), so `/proc/x` or a read-only folder is one line,
  before minutes of work, not a traceback after them;
- a folder that fp8train makes for an output holds the marker file `OUTPUT_MARKER`, which lists the names it wrote
  there; `--force` replaces a folder only if it holds that marker and nothing the marker does not list (or is
  empty): a folder fp8train did not write, or a file someone added to one, is never removed, whatever --force;
- no output file is one of the files a run or validation folder keeps (a folder holding `.fp8train.lock`), nor
  inside its checkpoints, whichever run it is: --force replaces outputs, never another run's records;
- a replaced folder is built beside the old one and renamed into place, so a failure leaves the old one whole;
- one command at a time writes an output (`claim_output_path`, held from the check of --out to the last file): the
  claim is the run directory's lock (rundir.DirLock) in a file beside the output, `.<name>.fp8train-claim`, so a
  second export, kv-eval or report to the same path is refused naming the path and the holder's PID, instead of
  the two writing one over the other; a killed holder's claim is taken over (storage.claims).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable

from fp8train.training.storage.claims import (CLAIM_SUFFIX, acquire_waiting, claim_file_beside, is_claim,
                                              refuse_claimed_folders_above, refuse_live_claims)
from fp8train.training.storage.files import (read_json, refuse_symlink, stale_temps, temp_path, write_failure,
                                             write_text_atomic)
from fp8train.training.storage.rundir import (CHECKPOINTS_DIR, CONFIG_FILE, LOCK_FILE, METRICS_FILE, SUMMARY_FILE,
                                              TELEMETRY_FILE, TRACKERS_FILE, DirLock,
                                              live_holder)

__all__ = ["OUTPUT_MARKER", "KEPT_FILES", "check_output_file", "check_output_folder", "check_output_files",
           "write_output_set", "foreign_entries", "make_output_folder", "is_output_folder", "replace_output_folder",
           "probe_writable", "claim_output_path", "CLAIM_SUFFIX"]

OUTPUT_MARKER = ".fp8train-output"
# The files a run keeps: no command's --out may replace them, with or without --force.
RUN_FILES = (CONFIG_FILE, METRICS_FILE, TELEMETRY_FILE, SUMMARY_FILE, TRACKERS_FILE, LOCK_FILE)
VALIDATION_PLAN_FILE = "plan.json"  # evidence.run_plan.PLAN_FILE (a later layer): the file a validation is declared by
KEPT_FILES = (*RUN_FILES, VALIDATION_PLAN_FILE)


def _named(path, option: str) -> Path:
    if path is None or str(path).strip() == "":
        raise ValueError(f"{option} is empty; give a path to write")
    return Path(os.path.expanduser(str(path)))


def _refuse_link(path: Path, option: str) -> None:
    if path.is_symlink():
        raise ValueError(f"{option} {path} is a symbolic link (to {os.readlink(path)}); fp8train does not write "
                         "through links (remove it or choose another path; nothing was written)")


def _refuse_source(path: Path, option: str, sources: Iterable) -> None:
    """`path` is not a source run, a folder holding one, its checkpoints, or one of the files the run keeps."""
    target = path.resolve()
    for source in sources:
        run = Path(source).resolve()
        if target == run or run.is_relative_to(target):
            raise ValueError(f"{option} {path} is the source run {source} or a folder holding it; write outside "
                             "it (nothing was written)")
        if target.is_relative_to(run / CHECKPOINTS_DIR):
            raise ValueError(f"{option} {path} is inside the checkpoints of the source run {source}; write outside "
                             f"{source}/{CHECKPOINTS_DIR} (nothing was written)")
        if target.is_relative_to(run) and target.relative_to(run).parts[0] in RUN_FILES:
            raise ValueError(f"{option} {path} is {target.relative_to(run).parts[0]}, a file the source run "
                             f"{source} keeps; write to a new path (nothing was written)")


def _is_run_folder(folder: Path) -> bool:
    """A folder fp8train trains or validates in: it holds the lock file every run and validation makes, a
    validation's plan, or (copied without its hidden lock file) a run's config.yaml beside its logs or checkpoints."""
    if (folder / LOCK_FILE).is_file() or (folder / VALIDATION_PLAN_FILE).is_file():
        return True
    return (folder / CONFIG_FILE).is_file() and any((folder / name).exists()
                                                     for name in (METRICS_FILE, SUMMARY_FILE, CHECKPOINTS_DIR))


def _refuse_kept(path: Path, option: str) -> None:
    """`path` is not a file some run or validation keeps (its config, logs, summary, plan), nor under the
    checkpoints of one, whichever run it is (the source run's are refused by _refuse_source, with its name)."""
    target = path.resolve()
    if target.name in KEPT_FILES and _is_run_folder(target.parent):
        raise ValueError(f"{option} {path} is {target.name}, a file the run or validation in {target.parent} keeps; "
                         "--force never replaces a run's records: write to a new path (nothing was written)")
    for folder in target.parents:
        if folder.name == CHECKPOINTS_DIR and _is_run_folder(folder.parent):
            raise ValueError(f"{option} {path} is inside the checkpoints of the run {folder.parent}; write outside "
                             "them (nothing was written)")


def probe_writable(path: Path, option: str) -> None:
    """The nearest existing folder above `path` takes a new file: made and removed at once, so the failure of
    the real write (no such folder, a file where a folder should be, /proc, read-only) is said before the work."""
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is not a folder (nothing was written)")
    probe = temp_path(parent / ".fp8train-probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as err:
        raise write_failure(err, path) from None
    probe.unlink(missing_ok=True)


def check_output_file(path, *, force: bool, option: str = "--out", sources: Iterable = (),
                      ours: Callable[[Path], str | None] | None = None) -> Path:
    """`path` as a file output: absent, or an existing file with `force`. Never a folder or a link. With `ours`
    (path -> None when the file there is the command's own earlier output, else what it lacks), `force` replaces
    only such a file, as it replaces only a folder holding fp8train's marker: a user's file is never lost to it."""
    path = _named(path, option)
    _refuse_link(path, option)
    if path.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file path (nothing was written)")
    if path.exists() and not force:
        raise FileExistsError(f"{option} {path} already exists; pass --force to replace it (nothing was written)")
    if path.exists() and not path.is_file():
        raise ValueError(f"{option} {path} exists and is not a regular file; give a file path (nothing was written)")
    lacking = ours(path) if ours is not None and path.exists() else None
    if lacking:
        raise ValueError(f"{option} {path} is a file that fp8train did not write ({lacking}); --force replaces only "
                         "fp8train's own output: remove it yourself or choose another path (nothing was written)")
    _refuse_source(path, option, sources)
    _refuse_kept(path, option)
    probe_writable(path, option)
    return path


def _marked_names(path: Path) -> set[str] | None:
    """The names the marker of `path` lists as written by fp8train; None without a valid marker (absent, a link,
    a hard link shared with another file, damaged, or one that lists no names)."""
    marker = path / OUTPUT_MARKER
    if not marker.is_file() or marker.is_symlink() or marker.stat().st_nlink != 1:
        return None
    try:
        record = read_json(marker)
    except (OSError, ValueError):
        return None
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list) or not all(isinstance(name, str) for name in files):
        return None
    return set(files)


def foreign_entries(path: Path) -> list[str]:
    """The entries of the folder `path` that fp8train's marker does not list as its own (all of them without a
    valid marker; none for an empty folder). A claim file left by a process that died is fp8train's own (stale)."""
    names = _marked_names(path) or set()
    return sorted(p.name for p in path.iterdir() if p.name != OUTPUT_MARKER and p.name not in names
                  and not (is_claim(p) and live_holder(p) is None))


def is_output_folder(path: Path) -> bool:
    """The folder holds fp8train's output marker (a regular file, not a link) and nothing the marker does not
    list: every entry in it is one fp8train wrote."""
    return _marked_names(path) is not None and not foreign_entries(path)


def check_output_folder(path, *, force: bool, option: str = "--out", sources: Iterable = ()) -> Path:
    """`path` as a folder output that replaces whatever is there: absent; or, with `force`, an empty folder or one
    that fp8train wrote (marker). Never a file, a link, or a folder fp8train did not write."""
    path = _named(path, option)
    _refuse_link(path, option)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path} is a file, not a folder; fp8train never replaces a file with a folder "
                         "(choose another path; nothing was written)")
    _refuse_source(path, option, sources)
    _refuse_kept(path, option)
    if path.exists():
        if not force:
            raise FileExistsError(f"{option} {path} already exists; pass --force to replace it (nothing was written)")
        refuse_live_claims(path, option)
        if any(path.iterdir()) and not is_output_folder(path):
            raise ValueError(_not_ours(path, option))
    probe_writable(path, option)
    return path


def _not_ours(path: Path, option: str) -> str:
    if _marked_names(path) is None:
        return (f"{option} {path} is a folder that fp8train did not write (no valid {OUTPUT_MARKER} in it); --force "
                "replaces only fp8train's own outputs: remove it yourself or choose another path (nothing was written)")
    extra = foreign_entries(path)
    nested = {name: _output_command(path / name) for name in extra}
    ours = [f"{name}/ (written by fp8train {command})" for name, command in nested.items() if command]
    if ours:  # fp8train's, but another command's output (kv-eval of this folder, say): it would be lost with it
        return (f"{option} {path} holds {', '.join(ours[:3])}{' ...' if len(ours) > 3 else ''}, which the folder's "
                f"own command did not write; --force replaces only the {option} folder's own files, never another "
                "command's results about them: move it out (or delete it) first, or choose another path (nothing "
                "was written)")
    return (f"{option} {path} holds {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}, which fp8train did not "
            "write there; --force replaces only a folder of fp8train's own files: move them out or choose another "
            "path (nothing was written)")


def _output_command(entry: Path) -> str | None:
    """The command whose output folder `entry` is (its marker's), when it is wholly one; None otherwise."""
    if entry.is_symlink() or not entry.is_dir() or not is_output_folder(entry):
        return None
    try:
        command = read_json(entry / OUTPUT_MARKER).get("command")
    except (OSError, ValueError):
        return None
    return command if isinstance(command, str) and command else "output"


def check_output_files(folder, names: Iterable[str], *, force: bool, option: str = "--out",
                       sources: Iterable = ()) -> Path:
    """`folder` as a folder that receives the files `names` (kv-eval's report): the folder is absent or a folder
    (never a file or a link); each of the files is absent, or an existing file (not a link) replaced with `force`.
    Nothing else in the folder is touched, so the folder need not be fp8train's."""
    folder, names = _named(folder, option), list(names)
    _refuse_link(folder, option)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{option} {folder} is a file, not a folder (choose another path; nothing was written)")
    _refuse_source(folder, option, sources)
    _refuse_kept(folder, option)
    for name in names:
        path = folder / name
        _refuse_link(path, option)
        if path.exists() and not path.is_file():
            raise ValueError(f"{option}: {path} exists and is not a file (nothing was written)")
        if path.exists() and not force:
            raise FileExistsError(f"{option}: {path} already exists (an earlier report?); pass --force to replace "
                                  "it (nothing was written)")
    probe_writable(folder / names[0], option)
    return folder


def make_output_folder(path: Path, command: str, files: Iterable[str] = (), parents: bool = True) -> Path:
    """Create `path` (and missing parents) as an output folder of `command`, with its marker listing `files`, the
    names it is about to write there. Only an absent folder (or one checked before: empty or fp8train's) is made
    one. Errors name the folder."""
    _refuse_link(path, "output folder")
    try:
        path.mkdir(parents=parents, exist_ok=True)
    except OSError as err:
        raise write_failure(err, path) from None
    _write_marker(path, command, files)
    return path


def _write_marker(path: Path, command: str, files: Iterable[str]) -> None:
    record = {"written_by": "fp8train", "command": command, "files": sorted(set(files) - {OUTPUT_MARKER})}
    write_text_atomic(path / OUTPUT_MARKER, json.dumps(record) + "\n")


def replace_output_folder(path: Path, command: str, build: Callable[[Path], None]) -> None:
    """Build the folder `path` with `build(folder)` beside it and rename it into place: a failure leaves the old
    folder (checked before by `check_output_folder`) whole and no temp folder; the old one is removed only once the
    new one is in place, and only because it holds the marker (or was empty). A folder in which another live process
    has claimed an output since it was checked is left as it is (LockBusy naming that process), before and after
    it is moved aside (claims: a claimer that came later sees this command's claim and backs off)."""
    if path.is_dir() and not path.is_symlink():
        refuse_live_claims(path, f"{command} --out")
    if path.is_symlink() or (path.exists() and (not path.is_dir() or (any(path.iterdir())
                                                                     and not is_output_folder(path)))):
        raise ValueError(f"{path} changed since it was checked: it is not fp8train's output folder any more "
                         "(nothing was written)")
    if not path.parent.is_dir():  # made (or there) when the output was claimed: deleted since, never made again
        raise ValueError(f"the folder {path.parent} was deleted while {command} ran; nothing was written")
    tmp, old, moved = temp_path(path), temp_path(path), False
    try:
        make_output_folder(tmp, command, parents=False)
        build(tmp)
        _write_marker(tmp, command, (p.name for p in tmp.iterdir()))  # what it holds now, all of it fp8train's
        if path.exists():
            os.rename(path, old)
            moved = True
            refuse_live_claims(old, f"{command} --out", path)  # claimed just before the move: it goes back, whole
        os.rename(tmp, path)
    except BaseException as err:
        if moved and not path.exists():  # the new one could not take its place: the old one goes back
            os.rename(old, path)
        if isinstance(err, OSError):
            raise write_failure(err, path) from err
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if moved:
        shutil.rmtree(old)


def write_output_set(folder: Path, writers: dict[str, Callable[[Path], object]], command: str,
                     source: Path | None = None) -> None:
    """Write the files ``writers`` names ({name: write(temp_path)}) into ``folder`` as one set: each to a temp file
    beside its target, fsync'd; only when all are written are they renamed into place (a writer that writes
    nothing, e.g. a plot with no data, leaves its target as it was). A failure in any (a full
    disk) leaves every target as it was (the earlier report's files, or none) and no temp file; a folder this call
    created is removed again, so no marker is left behind to block a plain re-run. Checked before with
    check_output_files. ``source``: the run (or validation) folder the command read; when the output lies in it (or
    is it) and it was deleted while the command ran, nothing is written and it is never made again (ValueError)."""
    folder = Path(folder)
    _refuse_vanished_source(folder, source, command)
    for name in writers:  # never through a link, and nothing written when one is there
        refuse_symlink(folder / name)
    created = not folder.exists()
    temps: dict[str, Path] = {}
    try:
        if created:  # its parents: made by claim_output_path, or the source folder that must not be made again
            folder.mkdir(parents=source is None)
        for name, write in writers.items():
            temps[name] = temp_path(folder / name)
            write(temps[name])
            if not temps[name].exists():
                del temps[name]
                continue
            with open(temps[name], "rb+") as f:
                os.fsync(f.fileno())
        if created:  # marked as fp8train's only once it holds a whole set
            _write_marker(folder, command, writers)
        for name, tmp in temps.items():  # renames within one folder: nothing left to run out of
            os.replace(tmp, folder / name)
        _remove_stale_temps(folder, writers)
    except BaseException as err:
        for tmp in temps.values():
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(err, OSError):
            _refuse_vanished_source(folder, source, command)  # the folder went with it mid-write: said as such
            raise write_failure(err, folder / (list(temps)[-1] if temps else "")) from err
        raise


def _remove_stale_temps(folder: Path, names: Iterable[str]) -> None:
    """The temp files of these outputs left by earlier writers that were killed mid-write (files.stale_temps: only
    its names, only of processes no longer running; the caller holds the output's claim, so no other live fp8train
    process writes them)."""
    for name in names:
        for stale in stale_temps(folder / name):
            try:
                stale.unlink()
            except OSError:
                pass  # a read-only folder: litter stays, the set is written


def _refuse_vanished_source(folder: Path, source: Path | None, command: str) -> None:
    """ValueError when ``folder`` lies in ``source`` (or is it) and ``source`` is gone: making the output's folder
    would bring a deleted run folder back, holding only the output."""
    if source is None:
        return
    # resolved: a run named through a link (or relative) and an output named by its real path are one folder
    real, inside = Path(os.path.realpath(source)), Path(os.path.realpath(folder))
    if (inside == real or real in inside.parents) and not real.is_dir():
        raise ValueError(f"the run directory {Path(os.path.abspath(source))} was deleted while {command} ran; nothing "
                         "was written")


@contextmanager
def claim_output_path(path, option: str = "--out", log=None, wait_s: float = 0.0):
    """Hold the output `path` (a file or folder, present or not) for the body: a second fp8train process
    claiming the same path meanwhile is refused (ValueError naming the path and the holder's PID), after waiting
    up to `wait_s` for it (validate's own report, after hours of runs, waits for a `fp8train report` of the same
    folder rather than fail). Check the output inside the body, so what was checked is still so when it is
    written. Missing parent folders are made for the claim file and removed again if the body leaves them empty.
    Yields the path."""
    path = _named(path, option)
    target = Path(os.path.abspath(path))  # the name as given, links not followed: the link is refused later
    if not target.name:  # the filesystem root: refused by the output checks, nothing to claim beside it
        yield path
        return
    _refuse_kept(path, option)  # no claim (nor folder made for it) inside any run's checkpoints
    probe_writable(path, option)  # a file where a folder of the path should be, /proc: said as before any claim
    made = [folder for folder in reversed(target.parents) if not folder.exists()]
    claim_file = claim_file_beside(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_failure(err, path) from None
    say = log or (lambda message: print(f"fp8train: {message}", file=sys.stderr))
    lock = DirLock(path, option, log=say, claim_file=claim_file)
    try:
        acquire_waiting(lock, wait_s)
        try:
            refuse_claimed_folders_above(path, option)  # a folder above it being replaced (export --force)
            yield path
        finally:
            lock.release()
    finally:
        for folder in reversed(made):  # deepest first; a folder the body wrote into stays
            try:
                folder.rmdir()
            except OSError:
                break
