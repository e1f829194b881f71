"""What `report`, `validate` and `train` say when there is one of something, of a run that has just started, and of a
folder they may not write in (issue 44's leftovers):

- a count of one is said in the singular ("1 run", "1 paired seed", "1 candidate"), never "1 runs";
- the report of a live run (or validation) that has only its step-0 evaluation draws its plots without a
  matplotlib warning (it used to set the zoomed axis to [0, 0]);
- `report` writes only into the folder it reports on: a read-only parent does not stop it, and a read-only folder
  is refused in one line naming the folder and what to do, with nothing left behind.

References: the English of the messages, written here; the folders and processes on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fp8train.training.storage.outputs import CLAIM_SUFFIX
from fp8train.training.storage.rundir import DirLock

# "1 runs", "1 paired seeds", "last 1 evaluation points": a one followed by at most two words and a plural noun
ONE_PLURAL = re.compile(r"(?<![\d.,\w-])1 (?:[a-z]+ ){0,2}(?:runs|seeds|steps|candidates|points|layers|checkpoints)"
                        r"\b")


def _validation_overrides(root: Path, tiny) -> list[str]:
    from test_fork import TINY

    return [f"run.dir={root}", "run.name=val", f"data.path={tiny.corpus}", *TINY, "train.max_steps=2",
            "train.eval_every=1", "validate.final_window=1", "validate.margin=0.05", "validate.workers=1",
            "validate.seeds=[1337,1338]", "validate.candidates=[current]"]


@pytest.fixture(scope="module")
def one_of_each(tmp_path_factory, tiny):
    """A finished validation of 2 seeds and 1 candidate (final window 1), and what it logged."""
    from fp8train.evidence.validate import run_validation, verdict_lines
    from fp8train.training.config import load_config

    root = tmp_path_factory.mktemp("one_of_each")
    said: list[str] = []
    summary = run_validation(load_config(None, _validation_overrides(root, tiny)), log=said.append,
                             show_progress=False)
    return root / "val", said, verdict_lines(summary)


def test_a_validation_of_one_candidate_says_it_in_the_singular(one_of_each):
    vdir, said, printed = one_of_each
    report = (vdir / "report.md").read_text()
    assert re.search(r"\(\d pass, \d fail, \d inconclusive of 1 candidate\)", report), report
    assert "2 paired seeds [1337, 1338]; final window: the last 1 evaluation point; 2 steps;" in report, report
    assert "Cost: **4 runs** ended" in report, report
    assert said[0].startswith(f"[validate] {vdir}: 4 runs (2 seeds x (fp32 + 1 candidate)), margin 0.05"), said[0]
    assert re.match(r"verdict: [A-Z]+ \(margin 5.00%, 2 paired seeds; one-sided", printed[0]), printed[0]
    for text in (report, *said, *printed):
        assert not ONE_PLURAL.search(text), ONE_PLURAL.search(text)


def test_one_missing_run_and_one_usable_seed_are_said_in_the_singular(one_of_each, tmp_path):
    """A seed whose candidate run was deleted (to re-train it): 1 missing run, 1 usable seed."""
    from fp8train.evidence.report import write_report

    vdir = tmp_path / "val"
    shutil.copytree(one_of_each[0], vdir)
    shutil.rmtree(vdir / "runs/current/seed1338")
    write_report(vdir)
    report = (vdir / "report.md").read_text()
    assert "runs not ended: 1 missing, of 4 planned" in report, report
    assert "1 of 2 seeds usable: seed 1338: candidate missing" in report, report
    assert not ONE_PLURAL.search(report), ONE_PLURAL.search(report)


def test_one_run_ended_is_said_as_one_run(one_of_each, tmp_path):
    from fp8train.evidence.report import write_report

    vdir = tmp_path / "val"
    shutil.copytree(one_of_each[0], vdir)
    for killed in ("current/seed1337", "bf16/seed1338", "current/seed1338"):  # before their end: 1 run ended
        (vdir / "runs" / killed / "summary.json").unlink()
    summary = write_report(vdir)
    assert summary["cost"]["runs"] == 1 and summary["cost"]["unfinished_runs"] == 3
    report = (vdir / "report.md").read_text()
    assert "Cost: **1 run** ended (besides: 3 unfinished: no summary.json and no process holds it" in report
    assert not ONE_PLURAL.search(report), ONE_PLURAL.search(report)


def test_a_run_of_one_step_says_one_step(tiny, tmp_path, commands, capsys):
    from fp8train.evidence.report import write_run_report

    config = tiny.write(tmp_path, train={"max_steps": 1}, fp8={"recipe": "current"})
    code, _, err = commands.main(["train", str(config), "--quiet"], capsys)
    assert code == 0 and "[tiny] completed: 1 step, val_loss " in err, err
    code, _, err = commands.main(["train", str(config), "train.resume=true", "--quiet"], capsys)  # left alone
    assert code == 0 and f"[tiny] already complete: 1 step in {tmp_path / 'runs/tiny'} " in err, err
    write_run_report(tmp_path / "runs/tiny")
    report = (tmp_path / "runs/tiny/report.md").read_text()
    assert "; 1 step; final loss" in report
    for text in (report, err):
        assert not ONE_PLURAL.search(text), ONE_PLURAL.search(text)


def _as_just_started(run: Path) -> None:
    """The run's files as they were while it ran its first steps: only the step-0 evaluation logged, no summary."""
    first = (run / "metrics.jsonl").read_text().splitlines()[0]
    assert json.loads(first)["step"] == 0 and "val_loss" in json.loads(first)
    (run / "metrics.jsonl").write_text(first + "\n")
    (run / "summary.json").unlink()


def test_the_report_of_a_live_run_with_one_evaluation_draws_without_a_warning(one_of_each, tmp_path):
    from fp8train.evidence.report import write_report

    run = tmp_path / "live"
    shutil.copytree(one_of_each[0] / "runs/current/seed1337", run)
    _as_just_started(run)
    with DirLock(run), warnings.catch_warnings():  # held, as its training process holds it: running
        warnings.simplefilter("error")  # before: "Attempting to set identical low and high xlims"
        summary = write_report(run)
    assert summary["status"] == "running"
    report = (run / "report.md").read_text()
    assert ("Status running; recipe `current:e4m3/e4m3/e5m2:m0`; 0 logged steps; final loss n/a, val loss n/a; "
            "wall time n/a; median") in report  # (it said "wall time n/a s")
    assert (run / "loss_curves.png").stat().st_size > 0


def test_the_report_of_a_live_validation_at_step_0_draws_without_a_warning(one_of_each, tmp_path):
    from fp8train.evidence.report import write_report

    vdir = tmp_path / "val"
    shutil.copytree(one_of_each[0], vdir)
    runs = sorted(vdir.glob("runs/*/seed*"))
    assert [f"{r.parent.name}/{r.name}" for r in runs] == ["bf16/seed1337", "bf16/seed1338", "current/seed1337",
                                                           "current/seed1338"]
    for run in runs:
        _as_just_started(run)
    with contextlib.ExitStack() as held:
        for run in runs:
            held.enter_context(DirLock(run))
        held.enter_context(warnings.catch_warnings())
        warnings.simplefilter("error")
        summary = write_report(vdir)
    assert {r["status"] for r in summary["runs"].values()} == {"running"}
    assert summary["cost"]["running_runs"] == 4 and "(besides: 4 running now)" in (vdir / "report.md").read_text()


# ------------------------------------------------------------------------------------------------------------
# A folder report may not write in
# ------------------------------------------------------------------------------------------------------------
def _report_without_override(folder: Path) -> subprocess.CompletedProcess:
    """`fp8train report FOLDER` in a child that folder permissions bind: as root, without the capabilities that
    let root write where it may not (setpriv), so a 0555 folder refuses it as it refuses anyone."""
    cmd = [sys.executable, "-m", "fp8train.cli", "report", str(folder)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("as root, setpriv (util-linux) is needed to run without root's permission override")
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--", *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.slow
def test_report_needs_only_its_folder_writable_and_names_a_read_only_one(one_of_each, tmp_path):
    parent = tmp_path / "archive"
    run = parent / "run"
    shutil.copytree(one_of_each[0] / "runs/current/seed1337", run)
    for name in ("report.md", "loss_curves.png", "health.png"):
        (run / name).unlink(missing_ok=True)
    before = _listing(tmp_path)
    parent.chmod(0o555)  # the parent takes no new file; the run folder does
    try:
        done = _report_without_override(run)
        assert done.returncode == 0, done.stderr  # before: "cannot write .../run: Permission denied" (its claim)
        assert (run / "report.md").is_file() and not list(run.glob(f"*{CLAIM_SUFFIX}"))
        made = {"run/report.md", "run/loss_curves.png"}  # no telemetry in these runs: no health.png
        assert set(_listing(parent)) == {p.removeprefix("archive/") for p in before if p != "archive"} | made
        parent.chmod(0o755)
        for name in made:
            (parent / name).unlink()
        run.chmod(0o555)  # now the folder itself takes no new file
        done = _report_without_override(run)
    finally:
        parent.chmod(0o755)
        run.chmod(0o755)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    assert err[0] == (f"fp8train report: error: report writes its files into {run}, which cannot be written "
                      "(Permission denied); make it writable (chmod u+w), or copy the folder to one you can write "
                      "(cp -r) and report the copy (nothing was written)")
    assert _listing(tmp_path) == before  # nothing left behind: no claim, no probe, no temp file


def test_a_run_before_its_first_log_line_is_running_while_held_and_unfinished_after(one_of_each, tmp_path):
    """config.yaml written, metrics.jsonl still empty (the model is being built, or the step-0 evaluation runs):
    running while its process holds the folder, unfinished once nothing does (killed); it used to be "missing"
    either way, and left out of the runs counted as running."""
    from fp8train.evidence.report import write_report

    vdir = tmp_path / "val"
    shutil.copytree(one_of_each[0], vdir)
    run = vdir / "runs/current/seed1337"
    (run / "metrics.jsonl").write_text("")
    (run / "summary.json").unlink()
    with DirLock(run):
        held = write_report(vdir)
    assert held["runs"]["current/seed1337"]["status"] == "running" and held["cost"]["running_runs"] == 1
    left = write_report(vdir)
    assert left["runs"]["current/seed1337"]["status"] == "unfinished" and left["cost"]["unfinished_runs"] == 1
    assert "| current/seed1337 | unfinished |" in (vdir / "report.md").read_text()


def _headline(vdir: Path) -> str:
    return next(line for line in (vdir / "report.md").read_text().splitlines() if line.startswith("**Verdict"))


def test_a_validation_with_runs_not_ended_is_reported_incomplete_not_inconclusive(one_of_each, tmp_path):
    """Issue 44, N5: the report of a validation still running, killed or never finished headlined "Verdict:
    INCONCLUSIVE", which the docs define as "more seeds would decide"."""
    from fp8train.evidence.report import write_report

    vdir = tmp_path / "val"
    shutil.copytree(one_of_each[0], vdir)
    finished = json.loads((one_of_each[0] / "summary.json").read_text())["verdict"]
    shutil.rmtree(vdir / "runs/current/seed1337")  # deleted to re-train it, as pairing's advice says: never run
    summary = write_report(vdir)
    assert summary["verdict"] == "incomplete" and summary["verdict_so_far"] == "inconclusive"
    assert summary["incomplete"] == {"running": 0, "unfinished": 0, "missing": 1, "planned": 4,
                                     "cannot_finish": None}
    assert _headline(vdir) == ("**Verdict: INCOMPLETE** (runs not ended: 1 missing, of 4 planned; no verdict until "
                               "they end; the runs that ended give INCONCLUSIVE so far). So far: 0 pass, 0 fail, 1 "
                               "inconclusive of 1 candidate.")
    # one killed (no summary.json, nothing holds it), one running (its process holds it)
    shutil.copytree(one_of_each[0] / "runs/current/seed1337", vdir / "runs/current/seed1337")
    (vdir / "runs/bf16/seed1337/summary.json").unlink()
    (vdir / "runs/current/seed1337/summary.json").unlink()
    with DirLock(vdir / "runs/current/seed1337"):
        summary = write_report(vdir)
    assert summary["incomplete"] == {"running": 1, "unfinished": 1, "missing": 0, "planned": 4,
                                     "cannot_finish": None}
    assert _headline(vdir).startswith("**Verdict: INCOMPLETE** (runs not ended: 1 running, 1 unfinished, of 4 "
                                      "planned; ")
    # every run ended: the verdict of the runs, as validate gave it
    shutil.rmtree(vdir)
    shutil.copytree(one_of_each[0], vdir)
    assert write_report(vdir)["verdict"] == finished != "incomplete" and "incomplete" not in _headline(vdir).lower()


def test_the_report_of_dot_is_titled_with_the_folders_name(one_of_each, tmp_path, commands, capsys, monkeypatch):
    """`fp8train report .` from inside the run (or validation) folder: its name, not an empty one (and the loss
    plot's legend had no label to show: a matplotlib warning)."""
    vdir = tmp_path / "val"
    shutil.copytree(one_of_each[0], vdir)
    for folder, title in ((vdir / "runs/current/seed1337", "# Run report: seed1337\n"),
                          (vdir, "# FP8 validation: val\n")):
        monkeypatch.chdir(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            code, out, err = commands.main(["report", "."], capsys)
        assert code == 0 and out.startswith("wrote report.md"), err
        assert (folder / "report.md").read_text().startswith(title)


def test_report_of_a_missing_path_says_it_does_not_exist(tmp_path, commands, capsys):
    (tmp_path / "notes.txt").write_text("x\n")
    code, _, err = commands.main(["report", str(tmp_path / "nope")], capsys)
    assert code == 2 and err == f"fp8train report: error: {tmp_path / 'nope'} does not exist\n"  # "not a directory"
    code, _, err = commands.main(["report", str(tmp_path / "notes.txt")], capsys)
    assert code == 2 and err == f"fp8train report: error: {tmp_path / 'notes.txt'} is not a directory\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
