"""A fork source pinned once is pinned for good (issue 44): what a validation (validate.fork_from) or a single run
(train.fork_from) started from is checked against the pin and recorded, while the source changes underneath.

References: the sha256 of the checkpoint's files computed here from the documented rule (hashlib over
"name:sha256(file)" lines of manifest.json, model.safetensors, optimizer.safetensors), the source run's own logged
validation losses, and the run folders on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

import fp8train
from fp8train.training.config import load_config
from fp8train.training.loop import train
from test_fork import TINY, _metrics, source  # noqa: F401  (source: the module's 16-step bf16 source run)


def _sha256_rule(checkpoint: Path) -> str:
    lines = [f"{name}:{hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()}"
             for name in ("manifest.json", "model.safetensors", "optimizer.safetensors")]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _validate_cfg(root, tiny, fork_from, extra=(), name="val"):
    return load_config(None, [f"run.dir={root}", f"run.name={name}", f"data.path={tiny.corpus}", *TINY,
                              "train.max_steps=2", "train.eval_every=2", "validate.final_window=1",
                              "validate.margin=0.05", "validate.workers=1", "validate.seeds=2",
                              "validate.candidates=[current]", *([f"validate.fork_from={fork_from}"] if fork_from
                                                                 else []), *extra])


def _other_source(root, tiny) -> Path:
    """The source's config with a longer schedule (24 steps, a key a resume may change): its step-16 checkpoint
    verifies, passes every check of the source's config.yaml, and holds other weights."""
    assert train(load_config(None, [f"run.dir={root}", "run.name=other", f"data.path={tiny.corpus}", *TINY,
                                    "train.max_steps=24", "checkpoint.every=8", "checkpoint.keep_last=0", "fp8.recipe=none"]),
                 show_progress=False)["status"] == "completed"
    return root / "other"


def _summaries(vdir: Path) -> dict:
    return {p.parent.relative_to(vdir / "runs").as_posix(): json.loads(p.read_text())
            for p in sorted((vdir / "runs").glob("*/*/summary.json"))}


# ------------------------------------------------------------------------------------------------------------
# 1, 9: the source replaced or deleted while the validation runs
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("change", ["replaced", "deleted", "config edited"])
def test_a_source_changed_during_a_validation_ends_it_before_the_next_run(source, tiny, tmp_path, change):
    from fp8train.evidence.report import write_report
    from fp8train.evidence.validate import run_validation

    src = tmp_path / "src"
    shutil.copytree(source / "src", src)
    pinned = src / "checkpoints" / "step_000016"
    other = _other_source(tmp_path, tiny) if change == "replaced" else None

    def log(line: str) -> None:  # the first run ended: the source changes under the validation
        if "bf16/seed1337: completed" in line and change == "config edited":  # the checkpoint stays as it was
            config = src / "config.yaml"
            config.write_text(config.read_text().replace("lr: 0.003\n", "lr: 0.006\n"))
        elif "bf16/seed1337: completed" in line:
            shutil.rmtree(pinned)
            if other is not None:
                shutil.copytree(other / "checkpoints" / "step_000016", pinned)

    with pytest.raises(ValueError) as caught:
        run_validation(_validate_cfg(tmp_path, tiny, src), log=log, show_progress=False)
    message = str(caught.value)
    assert "\n" not in message and message.startswith("validation stopped before bf16/seed1338: ")  # baselines first
    if change == "deleted":
        assert f"the fork checkpoint {pinned} pinned in plan.json was deleted" in message
    elif change == "config edited":  # named as the source's config.yaml, not as a train.fork_from problem
        assert (f"the fork source's config.yaml {src / 'config.yaml'} was edited after the checkpoint step_000016 "
                "was pinned") in message and "train.fork_from" not in message
    else:
        assert f"the fork checkpoint {pinned} was replaced or edited since plan.json pinned it" in message
    vdir = tmp_path / "val"
    # nothing mixed: the one run made is kept, started from the pinned bytes; no later run, no verdict
    plan = json.loads((vdir / "plan.json").read_text())
    assert list(_summaries(vdir)) == ["bf16/seed1337"]
    assert _summaries(vdir)["bf16/seed1337"]["fork"]["sha256"] == plan["fork"]["sha256"]
    assert not (vdir / "runs" / "current").exists() and not (vdir / "summary.json").exists()
    # its report (of a copy: the folder stays as the stop left it): no verdict, and it cannot be finished
    copy = tmp_path / "val_copy"
    shutil.copytree(vdir, copy)
    summary = write_report(copy)
    assert summary["verdict"] == "incomplete" and summary["incomplete"]["missing"] == 3
    problem = message.removeprefix("validation stopped before bf16/seed1338: ").split(". The runs made")[0]
    assert summary["incomplete"]["cannot_finish"] == problem
    headline = next(line for line in (copy / "report.md").read_text().splitlines() if line.startswith("**Verdict"))
    assert headline.startswith("**Verdict: INCOMPLETE** (runs not ended: 3 missing, of 4 planned; ")
    assert f"It cannot be finished: {problem}; restore the source" in headline
    if change == "replaced":
        # the candidate re-trained by hand from its planned config.yaml loads the replacement: its config hashes
        # as planned, but report refuses it by the sha256 it recorded
        cand_cfg = load_config(str(vdir / "runs/bf16/seed1337/config.yaml"),
                               [f"run.dir={vdir / 'runs/current'}", "fp8.recipe=current"])
        assert train(cand_cfg, show_progress=False)["fork"]["sha256"] == _sha256_rule(pinned) != plan["fork"]["sha256"]
        with pytest.raises(ValueError, match=r"runs/current/seed1337: it started from the fork checkpoint .*step_000016"
                                             r" with sha256 [0-9a-f]{12}, not the one plan.json pinned"):
            write_report(vdir)
        assert not (vdir / "summary.json").exists()


@pytest.mark.slow
def test_a_source_config_edited_during_the_last_run_is_said_by_validate_and_report_alike(source, tiny, tmp_path):
    """Issue 44, N6: the edit came after the last run's own check: validate gave PASS, `report` PASS, and only a
    validate re-run refused it. Now the report written at the end checks the source once more: the verdict stands
    (every run started from the pinned bytes) and validate and report say the source changed; a re-run is refused."""
    from fp8train.evidence.report import write_report
    from fp8train.evidence.validate import run_validation, verdict_lines

    src = tmp_path / "src"
    shutil.copytree(source / "src", src)
    ended = []

    def log(line: str) -> None:  # the last run ended, its check long done: the source's config.yaml is edited
        ended.extend([line] if ": completed" in line else [])
        if len(ended) == 4 and ": completed" in line:
            config = src / "config.yaml"
            config.write_text(config.read_text().replace("lr: 0.003\n", "lr: 0.006\n"))

    summary = run_validation(_validate_cfg(tmp_path, tiny, src), log=log, show_progress=False)
    assert len(ended) == 4 and summary["verdict"] in ("pass", "inconclusive", "fail")  # a verdict, as the runs gave
    problem = (f"the fork source's config.yaml {src / 'config.yaml'} was edited after the checkpoint step_000016 "
               "was pinned")
    assert summary["fork_source_changed"].startswith(problem)
    note = [line for line in verdict_lines(summary) if line.startswith("Note: ")]
    assert len(note) == 1 and note[0].startswith(f"Note: {problem}") and "is refused" in note[0]
    vdir = tmp_path / "val"
    assert note[0] in (vdir / "report.md").read_text()
    again = write_report(vdir)  # a later report says the same, with the same verdict
    assert again["verdict"] == summary["verdict"] and again["fork_source_changed"] == summary["fork_source_changed"]
    with pytest.raises(ValueError, match="config.yaml was edited after training"):  # as the note says
        run_validation(_validate_cfg(tmp_path, tiny, src), log=lambda _: None, show_progress=False)


@pytest.mark.slow
def test_a_source_replaced_under_a_worker_pool_is_refused_in_the_worker(source, tiny, tmp_path):
    from fp8train.evidence.validate import run_validation

    src = tmp_path / "src"
    shutil.copytree(source / "src", src)
    pinned = src / "checkpoints" / "step_000016"
    other = _other_source(tmp_path, tiny)
    replaced = []

    def log(line: str) -> None:
        if ": completed" in line and not replaced:
            shutil.rmtree(pinned)
            shutil.copytree(other / "checkpoints" / "step_000016", pinned)
            replaced.append(line)

    # (either the worker's check before loading refuses it, or, where the other worker hashed the source just before
    # the replacement and loaded it just after, the check of what it loaded, after its run: see below)
    refused = "was replaced or edited since plan.json pinned it|not the checkpoint plan.json pinned"
    with pytest.raises(ValueError, match=refused) as caught:
        run_validation(_validate_cfg(tmp_path, tiny, src, ["validate.workers=2"]), log=log, show_progress=False)
    # raised again by fp8train in the validate process: the command line says it in one line, exit 2
    assert Path(fp8train.__file__).parent in Path(caught.traceback[-1].path).resolve().parents
    plan = json.loads((tmp_path / "val" / "plan.json").read_text())
    made = _summaries(tmp_path / "val")
    assert made
    # The other worker's run may have hashed the source just before the replacement and loaded it just after (a
    # window of milliseconds): its summary records the sha256 of what it loaded, which the validation checked after
    # the run (the error above), and which report refuses: nothing from the replaced source enters a verdict.
    if any(s["fork"]["sha256"] != plan["fork"]["sha256"] for s in made.values()):
        from fp8train.evidence.report import write_report

        with pytest.raises(ValueError, match="pinned"):
            write_report(tmp_path / "val")
        assert not (tmp_path / "val" / "summary.json").exists()


# ------------------------------------------------------------------------------------------------------------
# 2: train.fork_from inside a validation
# ------------------------------------------------------------------------------------------------------------
def test_train_fork_from_in_a_validation_is_the_pinned_fork_or_refused(source, tiny, tmp_path):
    from fp8train.evidence.fork_pinning import fork_config

    src = source / "src"
    ckpt16, ckpt8 = src / "checkpoints" / "step_000016", src / "checkpoints" / "step_000008"
    alone = _validate_cfg(tmp_path, tiny, None, [f"train.fork_from={src}"])
    with pytest.raises(ValueError, match=rf"^train.fork_from={src} in a validation: use validate.fork_from={src} "):
        fork_config(alone)
    both = _validate_cfg(tmp_path, tiny, src, [f"train.fork_from={ckpt8}"])
    with pytest.raises(ValueError, match=rf"train.fork_from={ckpt8} \({ckpt8}\) and validate.fork_from={src} "
                                         rf"\({ckpt16}\) are different checkpoints"):
        fork_config(both)
    same, record = fork_config(_validate_cfg(tmp_path, tiny, src, [f"train.fork_from={ckpt16}"]))
    assert same.train.fork_from == str(ckpt16) == record["checkpoint"]
    assert record["sha256"] == _sha256_rule(ckpt16)
    assert not (tmp_path / "val").exists()


# ------------------------------------------------------------------------------------------------------------
# 3: a source whose config.yaml was edited after training
# ------------------------------------------------------------------------------------------------------------
def test_a_source_whose_config_yaml_was_edited_is_refused(source, tiny, tmp_path):
    from fp8train.evidence.fork_pinning import fork_config

    src = tmp_path / "src"
    shutil.copytree(source / "src", src)
    config = src / "config.yaml"
    assert "lr: 0.003\n" in config.read_text()
    config.write_text(config.read_text().replace("lr: 0.003\n", "lr: 0.006\n"))
    single = load_config(None, [f"run.dir={tmp_path}", "run.name=fork", f"data.path={tiny.corpus}", *TINY,
                                "train.lr=6e-3", "train.max_steps=2", f"train.fork_from={src}"])
    expected = rf"checkpoint {src}/checkpoints/step_000016 was not written by a run of {config} "
    with pytest.raises(ValueError, match=expected):
        train(single, show_progress=False)
    assert not (tmp_path / "fork").exists()
    with pytest.raises(ValueError, match=expected):
        fork_config(_validate_cfg(tmp_path, tiny, src, ["train.lr=6e-3"]))
    assert not (tmp_path / "val").exists()


# ------------------------------------------------------------------------------------------------------------
# 14: a single forked run records its fork
# ------------------------------------------------------------------------------------------------------------
def test_a_single_fork_records_its_checkpoint_step_and_sha256_through_a_resume(source, tiny, tmp_path):
    from fp8train.evidence.report import write_report

    ckpt = (source / "src" / "checkpoints" / "step_000016").resolve()
    common = [f"run.dir={tmp_path}", "run.name=fork", f"data.path={tiny.corpus}", *TINY,
              f"train.fork_from={source / 'src'}", "checkpoint.every=2", "checkpoint.keep_last=0", "train.resume=auto"]
    expected = {"checkpoint": str(ckpt), "step": 16, "sha256": _sha256_rule(ckpt)}
    assert train(load_config(None, [*common, "train.max_steps=2"]), show_progress=False)["fork"] == expected
    run = tmp_path / "fork"
    assert json.loads((run / "checkpoints/step_000002/manifest.json").read_text())["extra"]["fork"] == expected
    config = (run / "config.yaml").read_text()
    assert f"fork_from: {source / 'src'}\n" in config  # as given: a resume compares it
    assert f"# train.fork_from resolved to {ckpt} (step 16)\n" in config
    # resumed for 2 more steps: the second segment reads the fork record from its own checkpoint
    summary = train(load_config(None, [*common, "train.max_steps=4"]), show_progress=False)
    assert summary["resumed_from"] and summary["fork"] == expected
    write_report(run)
    assert f"Forked from `{ckpt}` (step 16, files sha256 `{expected['sha256'][:12]}`)." in \
        (run / "report.md").read_text()


# ------------------------------------------------------------------------------------------------------------
# 16: a relative validate.fork_from re-run from another folder
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_relative_fork_from_re_run_elsewhere_is_refused_for_resolving_elsewhere(source, tiny, tmp_path,
                                                                                 monkeypatch):
    from fp8train.evidence.validate import run_validation

    here, there = tmp_path / "here", tmp_path / "there"
    shutil.copytree(source / "src", here / "src")
    shutil.copytree(_other_source(tmp_path, tiny), there / "src")  # "src" from there: another run's folder
    monkeypatch.chdir(here)
    cfg = _validate_cfg(tmp_path, tiny, "src")
    assert run_validation(cfg, show_progress=False)["verdict"] in ("pass", "inconclusive")
    before = sorted(p.name for p in (tmp_path / "val").rglob("*"))
    pinned = here / "src" / "checkpoints" / "step_000016"
    for folder, what in ((there, "another run"), (tmp_path, "nothing")):
        monkeypatch.chdir(folder)
        with pytest.raises(ValueError) as caught:
            run_validation(cfg, show_progress=False)
        assert f"the relative validate.fork_from=src resolves elsewhere from {folder} ({folder / 'src'})" in \
            str(caught.value), what
        assert f"pass validate.fork_from={pinned}" in str(caught.value)
    # another relative path altogether (issue 44, N9): not the folder's fault; said so, with the plan's path
    shutil.copytree(here / "src", there / "src_pristine")
    monkeypatch.chdir(there)
    for given in ("src_pristine", "gone/src_pristine"):  # an identical copy elsewhere, and nothing at all
        with pytest.raises(ValueError) as caught:
            run_validation(_validate_cfg(tmp_path, tiny, given), show_progress=False)
        message = str(caught.value)
        assert (f"but validate.fork_from={given} names a different source than the plan's (neither {pinned} nor its "
                f"run {here / 'src'} ends in {given}): pass validate.fork_from={pinned} to finish") in message
        assert "resolves elsewhere" not in message
    assert sorted(p.name for p in (tmp_path / "val").rglob("*")) == before
    monkeypatch.chdir(here)  # from where it was planned it is the same validation: finished, nothing to run
    assert run_validation(cfg, show_progress=False)["verdict"] in ("pass", "inconclusive")


# ------------------------------------------------------------------------------------------------------------
# 18: forked runs use plan.json's checkpoint, never validate.fork_from resolved again
# ------------------------------------------------------------------------------------------------------------
def test_every_planned_run_forks_from_the_recorded_checkpoint_not_the_run_directory(source, tiny, tmp_path):
    from fp8train.evidence.fork_pinning import fork_config
    from fp8train.evidence.run_plan import plan_runs

    forked, record = fork_config(_validate_cfg(tmp_path, tiny, source / "src"))
    assert record["checkpoint"] == str((source / "src/checkpoints/step_000016").resolve())
    runs = plan_runs(forked)
    assert len(runs) == 4 and {r.cfg.train.fork_from for r in runs} == {record["checkpoint"]}


@pytest.mark.slow
def test_a_source_that_trains_on_during_a_validation_does_not_move_its_runs(source, tiny, tmp_path):
    """validate.fork_from names a run directory whose newest checkpoint changes mid-validation (the source trains
    on): every run still starts from the checkpoint plan.json recorded, and the verdict stands."""
    from fp8train.evidence.validate import run_validation

    src = tmp_path / "src"
    shutil.copytree(source / "src", src)
    src_cfg = load_config(str(src / "config.yaml"), [f"run.dir={tmp_path}", "train.max_steps=20", "train.resume=auto",
                                                     "checkpoint.every=4"])

    def log(line: str) -> None:
        if "bf16/seed1337: completed" in line:
            assert train(src_cfg, show_progress=False)["steps"] == 20  # step_000020 is now its newest
    summary = run_validation(_validate_cfg(tmp_path, tiny, src), log=log, show_progress=False)
    assert (src / "checkpoints" / "step_000020").is_dir() and summary["verdict"] in ("pass", "inconclusive")
    vdir = tmp_path / "val"
    plan = json.loads((vdir / "plan.json").read_text())
    assert plan["fork"]["step"] == 16
    made = _summaries(vdir)
    assert len(made) == 4 and all(s["fork"] == {k: plan["fork"][k] for k in ("checkpoint", "step", "sha256")}
                                  for s in made.values())
    src16 = {r["step"]: r for r in _metrics(src)}[16]["val_loss"]
    for seed in (1337, 1338):
        assert _metrics(vdir / f"runs/bf16/seed{seed}")[0]["val_loss"] == src16
    assert os.path.samefile(plan["fork"]["checkpoint"], src / "checkpoints" / "step_000016")


def test_a_checkpoint_folder_under_another_name_is_refused_saying_why(source, tmp_path):
    """A copy (or a link) of a checkpoint under a name of one's own: one line naming the rule, not a parse error."""
    from fp8train.training.runs.fork import resolve_fork_checkpoint

    copy = tmp_path / "mybest"
    shutil.copytree(source / "src" / "checkpoints" / "step_000016", copy)
    link = tmp_path / "lnk"
    link.symlink_to(source / "src" / "checkpoints" / "step_000016")
    with pytest.raises(ValueError, match=r"train.fork_from=.*mybest: .* is not named step_NNNNNN"):
        resolve_fork_checkpoint(str(copy))
    assert resolve_fork_checkpoint(str(link)).name == "step_000016"  # a link names the checkpoint it points to
