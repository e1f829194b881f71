"""Run files read back safely: a torn last line (what `kill -9` during an append leaves) is dropped by every
reader of run logs (telemetry.load, validate.load_curve, the loop's resume), a damaged line before the end is an
error naming the file and line, and appending after a torn line starts a fresh line."""

from __future__ import annotations

import json
import math
import re

import pytest

from fp8train.evidence.curves import load_curve
from fp8train.evidence import advisor
from fp8train.training.runs import telemetry
from fp8train.training.storage.files import read_jsonl, truncate_jsonl

STATS = {"layers.0.attn.q_proj": {"input": {"amax": 3.5, "sqnr_db": 31.25, "overflow_frac": 0.0},
                                  "weight": {"amax": 0.5, "sqnr_db": math.inf, "overflow_frac": 0.0}}}
METRICS = [{"step": 0, "val_loss": 5.5, "lr": 0.001},
           {"step": 1, "loss": 5.25, "lr": 0.002, "tokens_per_s": 100.0},
           {"step": 2, "loss": 4.75, "val_loss": 4.5, "lr": 0.003, "tokens_per_s": 125.0}]


def _torn(line: str) -> str:
    return line[: len(line) // 2]  # half a record and no newline: a writer killed mid-append


@pytest.mark.parametrize("cut", [1, 7, -2])
def test_telemetry_load_drops_a_torn_last_line(tmp_path, cut):
    path = tmp_path / "telemetry.jsonl"
    telemetry.append(path, 4, STATS)
    telemetry.append(path, 8, STATS)
    whole = path.read_text()
    third = json.dumps({"step": 12, "layers": {"x": {"input": {"amax": 1.0}}}})
    path.write_text(whole + third[:cut])
    records = telemetry.load(path)
    assert [r["step"] for r in records] == [4, 8]
    assert records[0]["layers"]["layers.0.attn.q_proj"]["input"]["sqnr_db"] == 31.25
    # SQNR inf (an exact tensor) survives the strict-JSON file as "inf" and reads back as inf.
    table = advisor.layer_table(records)
    assert table["layers.0.attn.q_proj"]["weight"]["sqnr_db"] == math.inf


def test_telemetry_append_after_a_torn_line_starts_a_new_line(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    telemetry.append(path, 4, STATS)
    path.write_text(path.read_text() + '{"step": 8, "lay')
    telemetry.append(path, 8, STATS)
    assert [r["step"] for r in telemetry.load(path)] == [4, 8]
    assert all(json.loads(line) for line in path.read_text().splitlines())


def test_load_curve_drops_a_torn_last_line(tmp_path):
    lines = [json.dumps(r) for r in METRICS]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n" + _torn(lines[2]))
    curve = load_curve(tmp_path)
    assert curve.val == {0: 5.5}
    assert curve.train == {1: 5.25}
    assert curve.tokens_per_s == [100.0]


def test_load_curve_reads_every_complete_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    curve = load_curve(tmp_path)
    assert curve.val == {0: 5.5, 2: 4.5} and curve.train == {1: 5.25, 2: 4.75}


@pytest.mark.parametrize("reader", [telemetry.load, lambda p: load_curve(p.parent)])
def test_a_damaged_line_before_the_end_is_an_error_naming_file_and_line(tmp_path, reader):
    path = tmp_path / ("telemetry.jsonl" if reader is telemetry.load else "metrics.jsonl")
    shape = {"layers": {}} if reader is telemetry.load else {}  # a telemetry record holds its layers' stats
    lines = [json.dumps({**r, **shape}) for r in METRICS]
    path.write_text(lines[0] + "\n" + _torn(lines[1]) + "\n" + lines[2] + "\n")
    with pytest.raises(ValueError, match=rf"{path.name}, line 2"):
        reader(path)


def test_truncate_keeps_steps_up_to_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in METRICS]
    path.write_text("\n".join(lines) + "\n" + '{"step": 3, "lo')
    kept = truncate_jsonl(path, 1)
    assert kept == METRICS[:2] and read_jsonl(path) == METRICS[:2]
    assert path.read_text().endswith("\n")


# ------------------------------------------------------------------------------------------------------------
# The run directory's other promises, each asserted exactly (what a directory is, links, non-finite values in
# the logs, write failures, the lock and its holder)
# ------------------------------------------------------------------------------------------------------------
def test_dir_state_names_each_kind(tmp_path):
    from fp8train.training.storage.rundir import LOCK_FILE, dir_state
    assert dir_state(tmp_path / "nothing", "config.yaml") == "absent"
    (tmp_path / "file").write_text("x")
    assert dir_state(tmp_path / "file", "config.yaml") == "other"
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    assert dir_state(tmp_path / "dangling", "config.yaml") == "other"  # a link to nothing is not "absent"
    for name, files, state in [("empty", [], "empty"), ("locked", [LOCK_FILE], "empty"),
                               ("run", [LOCK_FILE, "config.yaml"], "run"), ("busy", ["notes.txt"], "other")]:
        (tmp_path / name).mkdir()
        for file in files:
            (tmp_path / name / file).write_text("")
        assert dir_state(tmp_path / name, "config.yaml") == state, name


@pytest.mark.parametrize("where", ["top", "checkpoint"])
def test_a_link_in_a_run_directory_is_refused_by_name(tmp_path, where):
    from fp8train.training.storage.rundir import refuse_symlinks_in
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000001").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    refuse_symlinks_in(run)  # no link: nothing to say
    refuse_symlinks_in(run / "metrics.jsonl")  # not a folder: nothing to look at
    link = run / "summary.json" if where == "top" else run / "checkpoints" / "step_000001" / "model.safetensors"
    link.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ValueError) as raised:
        refuse_symlinks_in(run)
    assert str(raised.value) == (f"{link} is a symbolic link (to {tmp_path / 'elsewhere'}); fp8train does not write "
                                 "through links in a run directory (remove the link; nothing was changed)")


def test_nonfinite_values_are_null_in_the_log_and_named_beside_them(tmp_path):
    from fp8train.training.storage.files import append_jsonl, restore_nonfinite
    path = tmp_path / "m.jsonl"
    append_jsonl(path, [{"step": 1, "loss": math.nan, "lr": math.inf, "gap": -math.inf, "fp8": {"amax": math.nan},
                         "ok": 0.5}])
    line = path.read_text()
    assert line == ('{"step": 1, "loss": null, "lr": null, "gap": null, "fp8": {"amax": null}, "ok": 0.5, '
                    '"nonfinite": {"loss": "nan", "lr": "inf", "gap": "-inf", "fp8.amax": "nan"}}\n')
    back = restore_nonfinite(json.loads(line))
    assert math.isnan(back["loss"]) and back["lr"] == math.inf and back["gap"] == -math.inf
    assert back["fp8"] == {"amax": None} and back["ok"] == 0.5  # only top-level keys come back


def test_append_after_a_torn_line_keeps_every_complete_line(tmp_path):
    from fp8train.training.storage.files import append_jsonl
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    append_jsonl(path, [{"step": 3}])
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'


def test_truncate_names_each_damaged_line_it_drops(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n{"step": 3}\n')
    said = []
    assert truncate_jsonl(path, 2, log=said.append) == [{"step": 1}, {"step": 2}]
    assert said == [f"dropping a damaged line: {path}, line 2, is not valid JSON (Expecting value); the file is "
                    "damaged"]
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_write_failures_name_the_file_and_keep_the_errno(tmp_path):
    import errno
    import os
    from fp8train.training.storage.files import write_failure
    full = write_failure(OSError(errno.ENOSPC, ""), tmp_path / "summary.json")
    assert type(full) is OSError and full.errno == errno.ENOSPC
    assert full.strerror == os.strerror(errno.ENOSPC) and full.filename == str(tmp_path / "summary.json")
    missing = write_failure(OSError(errno.ENOENT, "No such file or directory"), tmp_path / "a" / "b.json")
    assert type(missing) is ValueError
    assert str(missing) == (f"cannot write {tmp_path / 'a' / 'b.json'}: No such file or directory (nothing was "
                            "written there)")
    odd = write_failure(OSError("a driver said no"), tmp_path / "c.json")
    assert str(odd) == f"cannot write {tmp_path / 'c.json'}: a driver said no (nothing was written there)"


def test_a_library_error_carrying_an_os_error_becomes_one(tmp_path):
    import errno
    import os
    from fp8train.training.storage.files import as_os_error
    found = as_os_error(RuntimeError("SafetensorError: I/O error: No space left on device (os error 28)"),
                        tmp_path / "model.safetensors")
    assert (found.errno, found.strerror, found.filename) == (errno.ENOSPC, os.strerror(errno.ENOSPC),
                                                            str(tmp_path / "model.safetensors"))
    assert as_os_error(RuntimeError("something else (os error)"), tmp_path) is None
    err = OSError(errno.EROFS, "Read-only file system")
    assert as_os_error(err, tmp_path) is err


def test_a_write_failure_is_recorded_in_the_summary(tmp_path):
    import errno
    from fp8train.training.storage.rundir import record_write_failure
    err = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))
    assert record_write_failure(tmp_path, err, {"steps": 3, "status": "running"})
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "steps": 3, "status": "failed", "reason": f"cannot write {tmp_path / 'metrics.jsonl'}: No space left on device "
                                                  "(errno ENOSPC)"}
    assert not record_write_failure(tmp_path / "gone", err)


def test_the_lock_names_its_holder_and_takes_over_a_stale_one(tmp_path):
    """A second DirLock on the same folder (another open file: flock refuses it even in this process) is refused
    with the holder's PID, host and start time as the lock file records them; a lock file left by a process that
    is gone is taken over with a message; a released lock leaves an empty file."""
    import os
    import socket
    from fp8train.training.storage.rundir import LOCK_FILE, DirLock
    lock_file = tmp_path / LOCK_FILE
    lock_file.write_text(json.dumps({"pid": 4194999, "host": "elsewhere", "since": "2026-01-01T00:00:00+0000",
                                     "note": "a longer record than the new one" * 4}) + "\n")
    said = []
    with DirLock(tmp_path, log=said.append):
        assert said == [f"run directory {tmp_path}: took over the lock of PID 4194999, which is no longer running "
                        "(killed?)"]
        holder = json.loads(lock_file.read_text())
        assert lock_file.read_text().count("\n") == 1
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(ValueError) as raised:
            DirLock(tmp_path, what="validation directory").acquire()
        assert str(raised.value) == (
            f"validation directory {tmp_path} is in use by another fp8train process (PID {os.getpid()} on "
            f"{socket.gethostname()}, since {holder['since']}); wait for it to finish or stop it (nothing was changed)")
    assert lock_file.read_text() == ""
    with DirLock(tmp_path, log=said.append):  # released cleanly: nothing to take over
        pass
    assert len(said) == 1


def test_a_holder_that_recorded_nothing_is_named_with_question_marks(tmp_path):
    """The flock is held, but the holder's record lacks its fields (an older writer, or one killed before it
    wrote them): the refusal still says what it knows, '?' for the rest."""
    import fcntl
    import os
    from fp8train.training.storage.rundir import LOCK_FILE, DirLock
    (tmp_path / LOCK_FILE).write_text('{"host": "elsewhere"}\n')
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError) as raised:
            DirLock(tmp_path).acquire()
    finally:
        os.close(fd)
    assert str(raised.value) == (f"run directory {tmp_path} is in use by another fp8train process (PID ? on "
                                 "elsewhere, since ?); wait for it to finish or stop it (nothing was changed)")


def test_truncate_drops_records_the_check_refuses(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": "high"}\n{"step": 3, "loss": 1.0}\n')
    said = []
    def check(record):
        return None if isinstance(record.get("loss"), float) else "has a loss that is not a number"
    kept = truncate_jsonl(path, 3, check=check, log=said.append)
    assert kept == [{"step": 1, "loss": 2.0}, {"step": 3, "loss": 1.0}]
    assert said == [f"dropping a damaged line: {path}, line 2, has a loss that is not a number; the file is damaged"]


def _lock_reserve(tmp_path) -> int:
    """Bytes of blank space after the record in a held lock file of `tmp_path`."""
    from fp8train.training.storage.rundir import LOCK_FILE, DirLock
    with DirLock(tmp_path):
        data = (tmp_path / LOCK_FILE).read_bytes()
    record_end = data.index(b"\n") + 1
    assert set(data[record_end:]) <= {ord(" ")}
    return len(data) - record_end


def test_a_held_lock_keeps_64_kib_in_reserve_where_space_is_plenty(tmp_path):
    import os
    stat = os.statvfs(tmp_path)
    if stat.f_bavail * stat.f_frsize < 1 << 20:
        pytest.skip("less than 1 MiB free here")
    assert _lock_reserve(tmp_path) == 64 * 1024


def test_on_a_nearly_full_disk_the_reserve_is_at_most_half_of_what_is_free(small_fs):
    """A real small filesystem (a tmpfs; mounting needs root): with 56 KiB free the lock keeps half of that in
    whole 4 KiB pages, 28 KiB, and leaves the rest to the run."""
    import os
    from fp8train.training.storage.rundir import LOCK_FILE
    mount = small_fs("256k")
    (mount / "run").mkdir()
    (mount / "run" / LOCK_FILE).write_text("{}\n")  # the page its record will take, taken before measuring
    stat = os.statvfs(mount)
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * (stat.f_bavail * stat.f_frsize - 56 * 1024))
    stat = os.statvfs(mount)
    free = stat.f_bavail * stat.f_frsize
    assert free == 56 * 1024  # (tmpfs counts whole 4 KiB pages)
    assert _lock_reserve(mount / "run") == 28 * 1024  # half of 56 KiB: 7 whole pages


@pytest.mark.parametrize("writer", ["append_jsonl", "write_file_atomic"])
def test_a_write_under_a_file_names_the_path_and_writes_nothing(tmp_path, writer):
    """A path whose parent is a file (ENOTDIR: not the environment's failure) is a one-line ValueError naming the
    path the caller gave."""
    from fp8train.training.storage import files
    (tmp_path / "plain").write_text("x")
    target = tmp_path / "plain" / "log.jsonl"
    with pytest.raises(ValueError) as raised:
        if writer == "append_jsonl":
            files.append_jsonl(target, [{"step": 1}])
        else:
            files.write_file_atomic(target, lambda tmp: tmp.write_text("{}"))
    assert str(raised.value) == f"cannot write {target}: Not a directory (nothing was written there)"
    assert (tmp_path / "plain").read_text() == "x"


def test_dumps_writes_unknown_objects_as_their_text_and_non_finite_floats_as_null():
    from pathlib import Path
    import torch
    from fp8train.training.storage.files import dumps
    assert dumps({"path": Path("/runs/a"), "dtype": torch.bfloat16, "loss": float("nan"), "up": [float("inf"), 1.5]}) \
        == '{"path": "/runs/a", "dtype": "torch.bfloat16", "loss": null, "up": [null, 1.5]}'


def test_give_default_mode_is_0666_less_the_umask(tmp_path):
    import os
    import stat
    from fp8train.training.storage.files import give_default_mode
    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"x")
    os.chmod(path, 0o600)  # what safetensors creates
    before = os.umask(0o027)
    try:
        give_default_mode(path)
    finally:
        os.umask(before)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


def test_a_writer_that_fails_otherwise_leaves_the_old_file_and_no_temp_file(tmp_path):
    """Any other error of the writer (here a RuntimeError, after it wrote half of the temp file) propagates
    unchanged; the previous file stays whole and no temp file is left beside it."""
    from fp8train.training.storage.files import write_file_atomic
    target = tmp_path / "summary.json"
    target.write_text('{"old": true}')

    def half_then_fail(tmp):
        tmp.write_text('{"new": ')
        raise RuntimeError("the writer broke")

    with pytest.raises(RuntimeError, match="^the writer broke$"):
        write_file_atomic(target, half_then_fail)
    assert target.read_text() == '{"old": true}' and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_append_after_a_torn_one_byte_log_starts_it_over(tmp_path):
    """A log holding only the first byte of a torn record: the byte is cut off and the new records start the file."""
    from fp8train.training.storage.files import append_jsonl
    path = tmp_path / "m.jsonl"
    path.write_text("{")
    append_jsonl(path, [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.0}])
    assert path.read_text() == '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.0}\n'


def test_dumps_passes_its_options_to_json():
    from fp8train.training.storage.files import dumps
    assert dumps({"b": 1, "a": [2, 3]}, sort_keys=True, separators=(",", ":")) == '{"a":[2,3],"b":1}'


def test_truncate_without_a_log_refuses_a_damaged_line(tmp_path):
    """Without `log`, a damaged line is an error naming the file and the line (nothing is rewritten)."""
    from fp8train.training.storage.files import truncate_jsonl
    path = tmp_path / "m.jsonl"
    text = '{"step": 1, "loss": 2.0}\nnot json\n{"step": 3, "loss": 1.0}\n'
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}"):
        truncate_jsonl(path, last_step=2)
    assert path.read_text() == text
