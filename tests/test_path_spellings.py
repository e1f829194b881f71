"""One run, one folder, however its path is spelled (issue 44's leftovers): a path through a symbolic link, an
absolute path and a relative one (also from another working folder) that name the same run compare equal where
fp8train decides whether a run is the same or was deleted.

- a forked run resumed with train.fork_from naming its source another way (the real folder instead of a link to
  it, or a relative path from another folder) resumes; it used to be refused as "a different experiment";
  a different checkpoint is still refused;
- a run folder named through a link, deleted while kv-eval wrote into it by its real path, is said deleted and not
  made again;
- an output inside a folder that another process is replacing is refused also when named through a link.

References: the folders on disk and the run's own records (config.yaml, summary.json, metrics.jsonl).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp8train.training.storage.outputs import claim_output_path, write_output_set
from fp8train.training.storage.rundir import LockBusy

RECIPE = str(Path(__file__).resolve().parents[1] / "recipes" / "cpu_bf16.yaml")  # any working folder


@pytest.fixture
def source_and_link(tiny, tmp_path, commands, capsys):
    """A 4-step bf16 source run (checkpoints at 2 and 4) in tmp_path/a/runs/src, and a link to it, runs/link."""
    from test_fork import TINY

    home = tmp_path / "a"
    (home / "runs").mkdir(parents=True)
    base = [f"run.dir={home / 'runs'}", f"data.path={tiny.corpus}", *TINY, "checkpoint.every=2", "--quiet"]
    code, _, err = commands.main(["train", RECIPE, "run.name=src", "train.max_steps=4", *base],
                                 capsys)
    assert code == 0, err
    (home / "runs" / "link").symlink_to("src")
    return home, base


def test_a_forked_run_resumes_with_its_source_spelled_another_way(source_and_link, tmp_path, commands, capsys,
                                                                  monkeypatch):
    home, base = source_and_link
    recipe = RECIPE
    monkeypatch.chdir(home)  # forked with a relative path through the link, from the source's folder
    code, _, err = commands.main(["train", recipe, "run.name=fork", "train.fork_from=runs/link",
                                  "train.max_steps=4", *base], capsys)
    assert code == 0, err
    fork = home / "runs" / "fork"
    started = json.loads((fork / "summary.json").read_text())["fork"]
    assert started["checkpoint"] == str((home / "runs/src/checkpoints/step_000004").resolve())

    # the real folder, absolute, instead of the link: the same source
    code, _, err = commands.main(["train", recipe, "run.name=fork", f"train.fork_from={home / 'runs' / 'src'}",
                                  "train.max_steps=6", "train.resume=true", *base], capsys)
    assert code == 0 and "different experiment" not in err, err
    assert "[fork] completed: 6 steps" in err
    # the link, relative, from another folder: the same source
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, _, err = commands.main(["train", recipe, "run.name=fork", "train.fork_from=../a/runs/link",
                                  "train.max_steps=8", "train.resume=true", *base], capsys)
    assert code == 0 and "[fork] completed: 8 steps" in err, err
    # resumed, not started again: one run of 8 steps, step 0 once, from the one recorded start
    steps = [json.loads(line)["step"] for line in (fork / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(0, 9)) and json.loads((fork / "summary.json").read_text())["fork"] == started
    assert "  fork_from: runs/link\n" in (fork / "config.yaml").read_text()  # the run keeps its own spelling

    # another checkpoint of the source is another experiment, however spelled
    code, _, err = commands.main(["train", recipe, "run.name=fork",
                                  "train.fork_from=../a/runs/link/checkpoints/step_000002", "train.max_steps=10",
                                  "train.resume=true", *base], capsys)
    assert code == 2 and "was made from a different experiment: train.fork_from: 'runs/link' (run) -> " \
        "'../a/runs/link/checkpoints/step_000002' (now)" in err, err


def test_a_run_named_through_a_link_and_deleted_is_said_deleted_whatever_path_its_output_has(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.yaml").write_text("x: 1\n")
    (tmp_path / "link").symlink_to("real")
    shutil.rmtree(real)  # deleted while kv-eval (of `link`, --out real/kv_eval) ran
    with pytest.raises(ValueError, match=rf"^the run directory {re.escape(str(tmp_path / 'link'))} was deleted "
                                         r"while kv-eval ran; nothing was written$"):
        write_output_set(real / "kv_eval", {"a.md": lambda tmp: tmp.write_text("a\n")}, "kv-eval",
                         source=tmp_path / "link")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link"]  # real/ not made again


@pytest.mark.slow
def test_an_output_in_a_folder_being_replaced_is_refused_when_named_through_a_link(tmp_path, commands):
    """`export --force --out real` (a real second process holding real's claim) and `kv-eval link` (link -> real,
    so its output link/kv_eval is inside real): the kv-eval is refused naming the export, although the two paths
    are spelled differently."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    hold = ("import sys\nfrom fp8train.training.storage.outputs import claim_output_path\n"
            "with claim_output_path(sys.argv[1], 'export --out'):\n    print('held', flush=True)\n"
            "    sys.stdin.readline()\n")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / "real")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=commands.env())
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LockBusy) as refused:
            with claim_output_path(tmp_path / "link" / "kv_eval", "kv-eval --out"):
                pass
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    assert str(refused.value).startswith(f"kv-eval --out {tmp_path / 'link' / 'kv_eval'} is in use by another "
                                         f"fp8train process (PID {holder.pid} ")
    assert f"writing {tmp_path / 'real'}, which holds it" in str(refused.value)
    assert list((tmp_path / "real").iterdir()) == []  # its own claim given back
