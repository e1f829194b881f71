"""kv-eval's report is one set (serving/kv_report.py, storage/outputs.write_output_set): on a disk that fills
while it is written, none of kv_eval.json/.md/.png is left, nor a marker or folder that would refuse a plain
re-run; once there is room the same command writes all three."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from fp8train.serving.kv_report import REPORT_FILES, check_report_folder, write_report
from fp8train.serving.kvcache import KvEvalOptions, kv_eval
from fp8train.training.storage.outputs import OUTPUT_MARKER, replace_output_folder, write_output_set

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def kv_result(tiny_fp8_run):
    return kv_eval(tiny_fp8_run, KvEvalOptions(formats=("e4m3fn",), batches=1, calib_batches=1, gen_prompts=0),
                   log=lambda _: None)


def _fill(folder: Path, leave: int) -> Path:
    """A filler file taking all but about ``leave`` bytes of the filesystem of ``folder``."""
    stat = os.statvfs(folder)
    filler = folder / "filler"
    filler.write_bytes(b"\0" * max(0, stat.f_bavail * stat.f_frsize - leave))
    return filler


def test_a_report_that_does_not_fit_leaves_nothing_and_the_same_command_then_writes_it(kv_result, tmp_path,
                                                                                         small_fs):
    sizes = {name: len(Path(path).read_bytes()) for name, path in
             ((REPORT_FILES[k], p) for k, p in write_report(kv_result, tmp_path / "sizes").items())}
    fs = small_fs("2m")
    # room for the json and the markdown (and their folder), not for the plot after them
    filler = _fill(fs, sizes["kv_eval.json"] + sizes["kv_eval.md"] + 3 * 4096)
    out = fs / "kv_eval"
    check_report_folder(out, force=False, run_dir=tmp_path)
    with pytest.raises(OSError, match="No space left|no space left"):
        write_report(kv_result, out)
    assert not out.exists()  # no partial set, no marker: a plain re-run is not refused
    assert sorted(p.name for p in fs.iterdir()) == ["filler"]
    filler.unlink()
    check_report_folder(out, force=False, run_dir=tmp_path)  # the same command, no --force
    paths = write_report(kv_result, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([*REPORT_FILES.values(), OUTPUT_MARKER])
    assert json.loads(Path(paths["json"]).read_text()) == json.loads(json.dumps(kv_result))


def test_a_replaced_report_is_the_old_set_or_the_new_one(kv_result, tmp_path, small_fs):
    fs = small_fs("2m")
    out = fs / "kv_eval"
    write_report(kv_result, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    changed = json.loads(json.dumps(kv_result))
    changed["manifest"]["seed"] = 4242
    _fill(fs, 8192)
    with pytest.raises(OSError):
        write_report(changed, out)  # --force was given: the old set stays whole until the new one is
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _copy_run(source: Path, run: Path) -> Path:
    run.mkdir()
    for name in ("config.yaml", "metrics.jsonl", "summary.json"):  # what a report reads
        (run / name).write_bytes((source / name).read_bytes())
    return run


def test_a_run_report_that_does_not_fit_leaves_the_run_folder_as_it_was(tiny_fp8_run, tmp_path, small_fs):
    from fp8train.evidence.report import write_run_report

    sized = _copy_run(tiny_fp8_run, tmp_path / "sized")
    write_run_report(sized)
    plot_pages = -(-(sized / "loss_curves.png").stat().st_size // 4096)
    fs = small_fs("2m")
    run = _copy_run(tiny_fp8_run, fs / "tiny")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    filler = _fill(fs, plot_pages * 4096 + 1024)  # room for the plot (written first), not for report.md
    with pytest.raises(OSError):
        write_run_report(run)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # no plot without its report.md, no temp
    filler.unlink()
    write_run_report(run)
    written = {p.name for p in run.iterdir()} - set(before)
    assert {"report.md", "loss_curves.png"} <= written and not [n for n in written if n.startswith(".")]


def test_a_run_folder_deleted_while_kv_eval_ran_is_not_made_again_for_its_report(kv_result, tiny_fp8_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(tiny_fp8_run, run)
    out = check_report_folder(run / "kv_eval", False, run)  # the default --out, checked while the run was there
    shutil.rmtree(run)  # `rm -rf` of the run while the evaluation ran
    with pytest.raises(ValueError, match=rf"^the run directory {re.escape(str(run))} was deleted while kv-eval ran; "
                                         r"nothing was written$"):
        write_report(kv_result, out, run)
    assert list(tmp_path.iterdir()) == []  # not copy/ holding only kv_eval/


@pytest.mark.parametrize("where", ["the folder itself", "a folder in it"])
def test_a_source_folder_deleted_while_its_files_were_written_is_said_and_left_gone(tmp_path, where):
    source = tmp_path / "run"
    source.mkdir()
    (source / "config.yaml").write_text("x: 1\n")
    folder = source if where == "the folder itself" else source / "kv_eval"

    def deleting(tmp: Path) -> None:  # the first file is written, then the run goes (a report of a run folder)
        tmp.write_text("first\n")
        shutil.rmtree(source)

    with pytest.raises(ValueError, match=r"^the run directory .* was deleted while report ran; nothing was written$"):
        write_output_set(folder, {"a.md": deleting, "b.md": lambda tmp: tmp.write_text("second\n")}, "report",
                         source=source)
    assert list(tmp_path.iterdir()) == []


def test_an_output_beside_a_deleted_source_is_still_written(tmp_path):
    source, out = tmp_path / "run", tmp_path / "kv"  # --out outside the run: its deletion does not matter
    write_output_set(out, {"a.md": lambda tmp: tmp.write_text("a\n")}, "kv-eval", source=source)
    assert (out / "a.md").read_text() == "a\n" and not source.exists()


def test_an_export_into_a_run_folder_deleted_meanwhile_does_not_make_it_again(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    out = run / "exported"  # `export RUN --out RUN/exported`, RUN deleted while the model loaded
    shutil.rmtree(run)
    with pytest.raises(ValueError, match=rf"^the folder {re.escape(str(run))} was deleted while export ran; "
                                         r"nothing was written$"):
        replace_output_folder(out, "export", lambda folder: (folder / "model.safetensors").write_bytes(b"x"))
    assert list(tmp_path.iterdir()) == []


def test_a_report_killed_mid_write_leaves_temp_files_that_the_next_report_removes(tiny_fp8_run, tmp_path, commands):
    """`fp8train report` killed (SIGKILL) once its files were written aside (a plot and report.md; this run logs no
    telemetry, so no health plot), before they were moved into place: their temp files stay (the visible set is
    the old one). The next report removes them, and only them: temp files of a live process,
    or names of another pattern, are left alone."""
    import subprocess
    import sys

    from fp8train.evidence.report import write_run_report

    run = _copy_run(tiny_fp8_run, tmp_path / "tiny")
    proc = commands.run(commands.crashpoint("inside-output-set:report.md", "report", str(run)))
    assert proc.returncode == -9, proc.stderr[-2000:]
    killed = sorted(p.name for p in run.iterdir() if ".tmp-" in p.name)
    assert [re.sub(r"tmp-\d+-[0-9a-f]{8}", "tmp-PID-HEX", n) for n in killed] == \
        [".loss_curves.png.tmp-PID-HEX", ".report.md.tmp-PID-HEX"]
    (dead,) = {re.search(r"tmp-(\d+)-", n).group(1) for n in killed}  # the killed report's PID
    # a report.md being written by a live process (its atomic write's own temp too), and names of other patterns
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        kept = [f".report.md.tmp-{live.pid}-0123abcd", f"..report.md.tmp-{live.pid}-0123abcd.tmp-{live.pid}-89abcdef",
                f".notes.md.tmp-{dead}-0123abcd", ".report.md.tmp-mine", f"report.md.tmp-{dead}-0123abcd"]
        dead_nested = f"..report.md.tmp-{dead}-0123abcd.tmp-{dead}-89abcdef"
        for name in (*kept, dead_nested):
            (run / name).write_text("x")
        write_run_report(run)
        left = sorted(p.name for p in run.iterdir() if ".tmp-" in p.name)
    finally:
        live.kill()
        live.wait()
    assert left == sorted(kept)
    assert (run / "report.md").is_file() and (run / "loss_curves.png").is_file()
