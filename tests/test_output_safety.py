"""Outputs of every command are safe to write: nothing fp8train did not write is removed (`--force` replaces only
its own marked folders, never the source run or a folder holding it, never a file with a folder), nothing is
written through a symbolic link, an existing report is not overwritten without --force, and an output path that
cannot be written (`/proc/x`, `/dev/null/...`, `''`, a folder where a file goes) is one line, exit 2, before the
work. Driven through the real CLI on a real tiny run (the session's `tiny_fp8_run`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from fp8train.training.storage.files import append_jsonl

pytestmark = pytest.mark.usefixtures("single_thread")

OUTPUT_MARKER = ".fp8train-output"  # the documented marker of a folder fp8train wrote
KV_FAST = ["--batches", "1", "--gen-prompts", "0", "--format", "e4m3fn", "--calib-batches", "1"]


def tree_digest(root: Path) -> dict:
    """{relative path: sha256 of the bytes, or the link target, or 'dir'} of everything under root."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_symlink():
            found[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            found[rel] = "dir"
        else:
            found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def one_line_error(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "internal error" not in lines[0], err
    return lines[0]


@pytest.fixture
def run_copy(tiny_fp8_run, tmp_path) -> Path:
    """A copy of the tiny run under tmp_path/holder/runs/tiny, beside other people's files in holder/."""
    holder = tmp_path / "holder"
    (holder / "notes").mkdir(parents=True)
    (holder / "notes" / "thesis.txt").write_text("not fp8train's\n")
    run = holder / "runs" / "tiny"
    shutil.copytree(tiny_fp8_run, run)
    return run


# ------------------------------------------------------------------------------------------------------------
# --force removes only what fp8train wrote
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["run", "runs", "holder", "notes", "metrics.jsonl", "checkpoint"])
def test_export_force_never_removes_what_fp8train_did_not_write(run_copy, target, commands, capsys):
    holder = run_copy.parent.parent
    out = {"run": run_copy, "runs": run_copy.parent, "holder": holder, "notes": holder / "notes",
           "metrics.jsonl": run_copy / "metrics.jsonl",
           "checkpoint": sorted((run_copy / "checkpoints").iterdir())[-1]}[target]
    before = tree_digest(holder)
    code, _, err = commands.main(["export", str(run_copy), "--format", "e4m3fn", "--out", str(out), "--force",
                                  "--no-check"], capsys)
    line = one_line_error(code, err)
    assert str(out) in line
    assert tree_digest(holder) == before


def test_export_single_file_never_replaces_a_run_file(run_copy, commands, capsys):
    before = tree_digest(run_copy)
    for name in ("metrics.jsonl", "summary.json", "config.yaml"):
        code, _, err = commands.main(["export", str(run_copy), "--format", "e4m3fn", "--out",
                                      str(run_copy / name), "--force", "--no-check"], capsys)
        assert name in one_line_error(code, err)
    assert tree_digest(run_copy) == before


def test_export_force_replaces_its_own_folder_and_only_that(tiny_fp8_run, tmp_path, commands, capsys):
    export = tmp_path / "export"
    argv = ["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(export), "--no-check"]
    assert commands.main(argv, capsys)[0] == 0
    assert (export / OUTPUT_MARKER).is_file()
    (export / "model.safetensors").write_bytes(b"stale")  # a file fp8train wrote there: replaced
    assert commands.main([*argv, "--force"], capsys)[0] == 0
    assert sorted(p.name for p in export.iterdir()) == [OUTPUT_MARKER, "config.json", "generation_config.json",
                                                        "model.safetensors"]
    assert (export / "model.safetensors").read_bytes() != b"stale"
    (export / OUTPUT_MARKER).unlink()  # without the marker, the folder is no longer provably fp8train's
    code, _, err = commands.main([*argv, "--force"], capsys)
    assert "did not write" in one_line_error(code, err)
    assert (export / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp or old folders left


@pytest.mark.parametrize("added", ["a file", "a run", "a planted marker"])
def test_force_keeps_what_someone_added_to_an_export_folder(tiny_fp8_run, tmp_path, added, commands, capsys):
    """The marker lists what fp8train wrote; a folder holding anything else is not replaced, whatever --force:
    a user's notes, a run moved into it, or a folder of someone's files with a marker hard-linked into it."""
    export = tmp_path / "export"
    argv = ["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(export), "--no-check"]
    if added == "a planted marker":
        export.mkdir()
        (export / "data.csv").write_text("1,2\n")
        (tmp_path / "marker").write_text('{"written_by": "fp8train", "files": []}\n')
        os.link(tmp_path / "marker", export / OUTPUT_MARKER)
    else:
        assert commands.main(argv, capsys)[0] == 0
        if added == "a file":
            (export / "NOTES.md").write_text("mine\n")
        else:
            shutil.copytree(tiny_fp8_run, export / "myrun")
    before = tree_digest(export)
    code, _, err = commands.main([*argv, "--force"], capsys)
    line = one_line_error(code, err)
    assert str(export) in line and ({"a file": "NOTES.md", "a run": "myrun"}.get(added, "did not write") in line)
    assert tree_digest(export) == before


def test_force_over_an_export_holding_a_kv_eval_of_it_names_that_output(tiny_fp8_run, tmp_path, commands, capsys):
    """kv-eval of an export folder writes its report into it (FOLDER/kv_eval/, fp8train's own output): export
    --force over the folder keeps it and says whose it is, not that fp8train did not write it."""
    export = tmp_path / "export"
    argv = ["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(export), "--no-check"]
    assert commands.main(argv, capsys)[0] == 0
    assert commands.main(["kv-eval", str(export), *KV_FAST], capsys)[0] == 0
    before = tree_digest(export)
    assert "kv_eval/kv_eval.json" in before
    code, _, err = commands.main([*argv, "--force"], capsys)
    line = one_line_error(code, err)
    assert f"--out {export} holds kv_eval/ (written by fp8train kv-eval)" in line
    assert "fp8train did not write" not in line
    assert tree_digest(export) == before


@pytest.mark.parametrize("command", ["layer-recipes", "bench"])
def test_force_replaces_only_a_file_the_same_command_wrote(tiny_fp8_run, tmp_path, command, commands, capsys):
    """As for an export (test_export.py): `--out FILE --force` of layer-recipes and bench replaces an earlier
    output of that command, never a user's file of the same name (even one that looks a little like it)."""
    argv = {"layer-recipes": ["layer-recipes", str(tiny_fp8_run), "--repeats", "1"],
            "bench": ["bench", "--quick", "--sections", "quant", "--quant-numel", "4096", "--repeats", "1",
                      "--warmup", "0", "--no-torchao", "--no-malloc-tuning", "--threads", "1"]}[command]
    mine = tmp_path / "mine.out"
    for text in ("precious\n", '{"machine": {}, "sections": {}}\n', "# fp8train\npolicy: {}\n"):
        mine.write_text(text)
        code, _, err = commands.main([*argv, "--out", str(mine), "--force"], capsys)
        line = one_line_error(code, err)
        assert f"{mine} is a file that fp8train did not write" in line and "nothing was written" in line, line
        assert mine.read_text() == text
    if command == "bench":  # layer-recipes replacing its own file: test_layer_recipes_e2e.py (it needs shadow data)
        ours = tmp_path / "ours.out"
        assert commands.main([*argv, "--out", str(ours)], capsys)[0] == 0
        first = json.loads(ours.read_text())
        code, _, err = commands.main([*argv, "--out", str(ours), "--force"], capsys)
        assert code == 0, err
        assert json.loads(ours.read_text())["sections"]["quant"] != first["sections"]["quant"]  # timed again


@pytest.mark.parametrize("target", ["summary.json", "config.yaml", "plan.json", "checkpoint"])
def test_an_output_file_never_replaces_another_runs_records(tiny_fp8_run, tmp_path, target, commands, capsys):
    """Not only the source run's: no --out, --force or not, replaces a file that some other run or validation
    (a folder holding fp8train's lock file) keeps, or writes under its checkpoints."""
    other = tmp_path / "other"
    shutil.copytree(tiny_fp8_run, other)
    if target == "plan.json":
        (other / "plan.json").write_text("{}\n")  # as in a validation folder
    else:
        (other / ".fp8train.lock").unlink(missing_ok=True)  # copied without its hidden lock file: still a run
    out = (sorted((other / "checkpoints").iterdir())[-1] / "model.safetensors" if target == "checkpoint"
           else other / target)
    before = tree_digest(other)
    for argv in (["export", str(tiny_fp8_run), "--format", "e4m3fn", "--no-check"], ["layer-recipes", str(tiny_fp8_run)]):
        code, _, err = commands.main([*argv, "--out", str(out), "--force"], capsys)
        assert str(out) in one_line_error(code, err)
    assert tree_digest(other) == before


# ------------------------------------------------------------------------------------------------------------
# No write through a symbolic link
# ------------------------------------------------------------------------------------------------------------
@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "outside.txt"
    path.write_text("precious\n")
    return path


@pytest.mark.parametrize("name", ["loss_curves.png", "report.md"])  # health.png: no telemetry here
def test_report_refuses_a_linked_output(run_copy, outside, name, commands, capsys):
    (run_copy / name).unlink(missing_ok=True)
    (run_copy / name).symlink_to(outside)
    code, _, err = commands.main(["report", str(run_copy)], capsys)
    line = one_line_error(code, err)
    assert "symbolic link" in line and name in line
    assert outside.read_text() == "precious\n"


@pytest.mark.parametrize("name", ["kv_eval.md", "kv_eval.json", "kv_eval.png"])
def test_kv_eval_refuses_a_linked_output(tiny_fp8_run, tmp_path, outside, name, commands, capsys):
    out = tmp_path / "kv"
    out.mkdir()
    (out / name).symlink_to(outside)
    for force in ([], ["--force"]):
        code, _, err = commands.main(["kv-eval", str(tiny_fp8_run), "--out", str(out), *KV_FAST, *force], capsys)
        line = one_line_error(code, err)
        assert "symbolic link" in line and name in line
    assert outside.read_text() == "precious\n" and sorted(p.name for p in out.iterdir()) == [name]


@pytest.mark.parametrize("command", ["export-file", "export-folder", "layer-recipes", "kv-eval"])
def test_linked_out_is_refused_even_with_force(tiny_fp8_run, tmp_path, outside, command, commands, capsys):
    target_dir = tmp_path / "target_dir"
    target_dir.mkdir()
    (target_dir / "theirs.txt").write_text("theirs\n")
    link = tmp_path / ("link.safetensors" if command == "export-file" else "link")
    link.symlink_to(outside if command in ("export-file", "layer-recipes") else target_dir)
    argv = {"export-file": ["export", str(tiny_fp8_run), "--format", "e4m3fn", "--no-check"],
            "export-folder": ["export", str(tiny_fp8_run), "--format", "e4m3fn", "--no-check"],
            "layer-recipes": ["layer-recipes", str(tiny_fp8_run)],
            "kv-eval": ["kv-eval", str(tiny_fp8_run), *KV_FAST]}[command]
    code, _, err = commands.main([*argv, "--out", str(link), "--force"], capsys)
    line = one_line_error(code, err)
    assert "symbolic link" in line and str(link) in line
    assert outside.read_text() == "precious\n" and sorted(p.name for p in target_dir.iterdir()) == ["theirs.txt"]


def test_a_linked_run_folder_is_not_trained_into(tmp_path, commands, capsys, tiny):
    """A run folder planted as a link (a validation's runs/<label>/<seed>, say) is refused, not followed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny").symlink_to(elsewhere)
    config = tiny.write(tmp_path, train={"max_steps": 2, "eval_every": 2})
    code, _, err = commands.main(["train", str(config), "--quiet"], capsys)
    line = one_line_error(code, err)
    assert "symbolic link" in line and "run.name" in line
    assert list(elsewhere.iterdir()) == []


# ------------------------------------------------------------------------------------------------------------
# kv-eval: an earlier report is kept unless --force
# ------------------------------------------------------------------------------------------------------------
def test_kv_eval_keeps_an_earlier_report_without_force(tiny_fp8_run, tmp_path, commands, capsys):
    out = tmp_path / "kv"
    argv = ["kv-eval", str(tiny_fp8_run), "--out", str(out), *KV_FAST]
    assert commands.main(argv, capsys)[0] == 0
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "kv_eval.json", "kv_eval.md", "kv_eval.png"]
    before = tree_digest(out)
    code, _, err = commands.main(argv, capsys)
    assert "already exists" in one_line_error(code, err) and tree_digest(out) == before
    (out / "kv_eval.md").write_text("edited by hand\n")
    assert commands.main([*argv, "--force"], capsys)[0] == 0
    assert (out / "kv_eval.md").read_text().startswith("# FP8 KV-cache evaluation")
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]


# ------------------------------------------------------------------------------------------------------------
# Paths that cannot be written: one line, exit 2, before the work
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["export-file", "export-folder", "layer-recipes", "kv-eval"])
@pytest.mark.parametrize("where", ["/proc/x", "/dev/null/x", "", "existing-folder", "existing-file"])
def test_unwritable_out_is_one_line_before_the_work(tiny_fp8_run, tmp_path, command, where, commands, capsys):
    if command == "kv-eval" and where == "existing-folder":
        pytest.skip("kv-eval adds its three files to an existing folder (test_kv_eval_keeps_an_earlier_report...)")
    suffix = ".safetensors" if command == "export-file" else ""
    if where == "existing-folder":
        out = tmp_path / f"folder{suffix}"
        out.mkdir()
        (out / "theirs.txt").write_text("theirs\n")
    elif where == "existing-file":
        out = tmp_path / f"file{suffix}"
        out.write_text("theirs\n")
    else:
        out = where + suffix if where else ""
    argv = {"export-file": ["export", str(tiny_fp8_run), "--format", "e4m3fn", "--no-check"],
            "export-folder": ["export", str(tiny_fp8_run), "--format", "e4m3fn", "--no-check"],
            "layer-recipes": ["layer-recipes", str(tiny_fp8_run)],
            "kv-eval": ["kv-eval", str(tiny_fp8_run), *KV_FAST]}[command]
    before = tree_digest(tmp_path)
    code, stdout, err = commands.main([*argv, "--out", str(out)], capsys)
    line = one_line_error(code, err)
    assert (str(out) in line) if out else ("--out" in line and "empty" in line)
    assert stdout == ""  # and one line on stderr: refused before the evaluation started (it logs to stderr)
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("run_dir", ["/proc/x", "/dev/null"])
def test_unwritable_run_dir_is_one_line(tmp_path, run_dir, commands, capsys, tiny):
    config = tiny.write(tmp_path, train={"max_steps": 2, "eval_every": 2})
    code, _, err = commands.main(["train", str(config), f"run.dir={run_dir}", "--quiet"], capsys)
    line = one_line_error(code, err)
    assert f"run.dir={run_dir}" in line


# ------------------------------------------------------------------------------------------------------------
# The writer's own promises
# ------------------------------------------------------------------------------------------------------------
def test_a_full_disk_during_an_append_names_the_file():
    """/dev/full answers every write with ENOSPC: the error names the log, so the CLI's one line does too."""
    with pytest.raises(OSError) as caught:
        append_jsonl("/dev/full", [{"step": 1, "loss": 1.0}])
    assert caught.value.filename == "/dev/full" and caught.value.errno == 28


FILLING_RUN = {"train": {"max_steps": 100000, "eval_every": 100000}, "log": {"every": 1, "telemetry_every": 0},
               "checkpoint": {"every": 0, "save_final": False}}  # only metrics.jsonl grows, a line per step


def _stopped_by_a_full_log(result, run: Path, errname: str) -> None:
    """One line naming metrics.jsonl and the errno, exit 2, and summary.json saying the run failed and why."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert str(run / "metrics.jsonl") in lines[0] and errname in lines[0], lines[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "failed" and str(run / "metrics.jsonl") in summary["reason"], summary
    assert errname in summary["reason"] and summary["config_hash"]


def test_a_file_size_limit_during_a_metrics_append_stops_the_run_with_a_summary(tmp_path, tiny, commands):
    """RLIMIT_FSIZE (a quota on one file's size): the append fails with EFBIG, which is the environment's, not a
    bug or a bad value: one line naming the log, and summary.json says why the run stopped."""
    import resource

    config = tiny.write(tmp_path, **FILLING_RUN)
    limit = 16 << 10
    result = commands.run(commands.fp8train("train", str(config), "--quiet"), cwd=tmp_path,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    _stopped_by_a_full_log(result, tmp_path / "runs" / "tiny", "EFBIG")


def test_a_full_filesystem_during_a_metrics_append_stops_the_run_with_a_summary(tmp_path, tiny, commands, small_fs):
    """A real full disk: a small tmpfs, nearly filled. The summary still fits because the run's lock file held
    back from the start (rundir.DirLock.free_reserve: 64 KiB, at most half of what is free). Needs root
    (mount); skipped elsewhere."""
    mount = small_fs("1m")
    stat = os.statvfs(mount)
    with open(mount / "filler", "wb") as f:  # leave 320 KiB: 64 of them the lock's reserve
        f.write(b"\0" * (stat.f_bavail * stat.f_frsize - (320 << 10)))
    config = tiny.write(tmp_path, **{**FILLING_RUN, "run": {"dir": str(mount), "name": "tiny"}})
    result = commands.run(commands.fp8train("train", str(config), "--quiet"), cwd=tmp_path)
    _stopped_by_a_full_log(result, mount / "tiny", "ENOSPC")


def test_temp_names_are_unique_per_write(tmp_path):
    from fp8train.training.storage.files import temp_path

    names = {temp_path(tmp_path / "summary.json").name for _ in range(100)}
    assert len(names) == 100 and all(n.startswith(f".summary.json.tmp-{os.getpid()}-") for n in names)


# ------------------------------------------------------------------------------------------------------------
# Bad input: one line naming the key or file and what is allowed, before anything is written
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("override,named", [
    ("fp8.amax_history_len=100000000", r"fp8.amax_history_len=100000000.*\[1, 65536\]"),
    ("train.eval_batches=100000", r"train.eval_batches=100000.*\[1, 1024\]"),
    ("fp8.input_block=abc", r"fp8.input_block='abc'.*expected a list"),
    ("log.trackers=wandb", r"log.trackers='wandb'.*expected a list"),
])
def test_config_bounds_and_shapes_are_one_line_before_any_write(tmp_path, override, named, tiny, commands, capsys):
    config = tiny.write(tmp_path, fp8={"recipe": "delayed"})
    code, _, err = commands.main(["train", str(config), override, "--quiet"], capsys)
    assert re.search(named, one_line_error(code, err)), err
    assert not (tmp_path / "runs").exists()


def test_the_largest_amax_history_is_allowed_by_the_python_api_too():
    from fp8train.nn.recipes import recipe

    assert recipe("delayed", amax_history_len=65536).amax_history_len == 65536
    with pytest.raises(ValueError, match=r"\[1, 65536\]"):
        recipe("delayed", amax_history_len=65537)


def test_a_foreign_config_in_a_run_folder_is_named(tmp_path, tiny, commands, capsys):
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("my: 1\n")
    config = tiny.write(tmp_path)
    for argv in (["train", str(config), "train.resume=true", "--quiet"],
                 ["export", str(run), "--format", "e4m3fn", "--out", str(tmp_path / "x.safetensors"), "--no-check"]):
        code, _, err = commands.main(argv, capsys)
        line = one_line_error(code, err)
        assert str(run / "config.yaml") in line and "'my'" in line
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("text", ["", "\n# to be filled in\n"])
def test_an_empty_config_file_is_refused_not_trained_on_defaults(tmp_path, text, commands, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the defaults would train into ./runs
    (tmp_path / "empty.yaml").write_text(text)
    code, _, err = commands.main(["train", "empty.yaml", "--quiet"], capsys)
    assert "is empty" in one_line_error(code, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.yaml"]


def test_layer_recipes_refuses_a_nan_threshold(tiny_fp8_run, tmp_path, commands, capsys):
    code, _, err = commands.main(["layer-recipes", str(tiny_fp8_run), "--out", str(tmp_path / "layers.yaml"),
                                  "--sqnr-db-min", "nan"], capsys)
    assert "--sqnr-db-min=nan" in one_line_error(code, err)


@pytest.mark.parametrize("option, value", [("--underflow-frac-max", "-1"), ("--overflow-frac-max", "1.5"),
                                           ("--min-speedup", "-1"), ("--repeats", "1000000000")])
def test_layer_recipes_refuses_thresholds_outside_their_range(tiny_fp8_run, tmp_path, option, value, commands, capsys):
    """A fraction below 0 or above 1, or a speedup below 0 (0 is documented: numerics alone), makes every layer
    fail (or pass) its check: a plan that looks like a measurement. A billion timing rounds would run for days. One line, exit 2, nothing written."""
    out = tmp_path / "layers.yaml"
    code, _, err = commands.main(["layer-recipes", str(tiny_fp8_run), "--out", str(out), option, value], capsys)
    assert option in one_line_error(code, err)
    assert not out.exists()


@pytest.mark.parametrize("override", ["model.d_model=1048576", "model.n_layers=100000",
                                      "train.batch_size=1000000000"])
def test_a_model_that_cannot_fit_is_one_line_before_anything(tmp_path, override, tiny, commands, capsys):
    """A lower bound of the memory training needs, against the machine's: refused by name before data, model or
    run folder (d_model=1048576 was an allocation traceback; a hundred million layers or a billion-sequence
    batch, minutes of building or batching before that)."""
    import signal

    config = tiny.write(tmp_path)
    previous = signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt("took too long")))
    signal.alarm(60)
    try:
        code, _, err = commands.main(["train", str(config), override, "--quiet"], capsys)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert override.split("=")[0] in one_line_error(code, err)
    assert not (tmp_path / "runs").exists()
