"""A fork of a run that went wrong (issue 44): a source run whose summary.json says it diverged or was stopped is
refused as validate.fork_from / train.fork_from, and a validation whose runs skipped (nearly) all their steps on
non-finite gradients is never a PASS.

References: the source run's own summary.json (its status and diverged_at_step) and the checkpoint folders it
left on disk; the runs' own summary.json skipped_steps.
"""

from __future__ import annotations

import json
import shutil

import pytest

from fp8train.training.config import load_config
from fp8train.training.loop import train
from test_fork import TINY, source  # noqa: F401  (source: a 16-step bf16 run, checkpoints at 8 and 16)

LR = "train.lr=1000"  # diverges a tiny model within a few steps (non-finite gradients, every one skipped)


@pytest.fixture(scope="module")
def diverged(tmp_path_factory, tiny):
    """A run trained at lr 1000 until it diverged, a checkpoint every step, all kept."""
    root = tmp_path_factory.mktemp("diverged_source")
    summary = train(load_config(None, [f"run.dir={root}", "run.name=src", f"data.path={tiny.corpus}", *TINY, LR,
                                       "train.max_steps=20", "checkpoint.every=1", "checkpoint.keep_last=0",
                                       "fp8.recipe=none"]), show_progress=False)
    assert summary["status"] == "diverged" and summary["diverged_at_step"] >= 3
    return root / "src"


def _validate_cfg(root, tiny, fork_from, name="val"):
    return load_config(None, [f"run.dir={root}", f"run.name={name}", f"data.path={tiny.corpus}", *TINY, LR,
                              "train.max_steps=3", "train.eval_every=3", "validate.final_window=1",
                              "validate.workers=1", "validate.seeds=2", "validate.candidates=[current]",
                              f"validate.fork_from={fork_from}"])


def _in_a_row(checkpoint) -> int:
    """The skipped steps in a row up to a checkpoint, as its run recorded them in its manifest."""
    return json.loads((checkpoint / "manifest.json").read_text())["extra"]["consecutive_skips"]


def _streak(diverged):
    """(first step of the non-finite run, its checkpoints, the last checkpoint before it), read from the run's
    summary.json and each checkpoint's manifest."""
    at = json.loads((diverged / "summary.json").read_text())["diverged_at_step"]
    checkpoints = sorted((diverged / "checkpoints").glob("step_*"))
    inside = [c for c in checkpoints if _in_a_row(c) > 0]
    first = int(inside[-1].name[5:]) - _in_a_row(inside[-1]) + 1 if inside else at
    clean = [c for c in checkpoints if int(c.name[5:]) < first]
    return first, inside, clean[-1]


def test_a_diverged_source_run_is_refused_naming_its_step_and_the_last_clean_checkpoint(diverged, tiny, tmp_path):
    from fp8train.evidence.fork_pinning import fork_config

    at = json.loads((diverged / "summary.json").read_text())["diverged_at_step"]
    first, inside, clean = _streak(diverged)
    assert inside and first < at  # lr 1000: gradients non-finite several steps in a row before it stopped
    with pytest.raises(ValueError) as caught:
        fork_config(_validate_cfg(tmp_path, tiny, diverged))
    message = str(caught.value)
    assert message.startswith(f"validate.fork_from={diverged}: run {diverged} ended diverged at step {at} (")
    assert f"non-finite steps began at step {first} " in message
    assert message.endswith(f"pass validate.fork_from={clean}; nothing was written") and "\n" not in message
    assert not (tmp_path / "val").exists()
    # a single forked run: the same refusal under its own key, before its run directory exists
    single = load_config(None, [f"run.dir={tmp_path}", "run.name=fork", f"data.path={tiny.corpus}", *TINY, LR,
                                "train.max_steps=2", f"train.fork_from={diverged}"])
    with pytest.raises(ValueError, match=rf"^train.fork_from={diverged}: run {diverged} ended diverged at step {at}"):
        train(single, show_progress=False)
    assert not (tmp_path / "fork").exists()


def test_a_checkpoint_written_after_the_non_finite_steps_began_is_refused_by_name(diverged, tiny, tmp_path):
    """Issue 44, N2: a checkpoint given directly that was written inside the non-finite run (before the step the
    run stopped at) forked every run into skipping every step, the bf16 baseline's too."""
    from fp8train.evidence.fork_pinning import fork_config
    from fp8train.training.runs.fork import resolve_fork_checkpoint

    first, inside, clean = _streak(diverged)
    for checkpoint in inside:
        with pytest.raises(ValueError) as caught:
            fork_config(_validate_cfg(tmp_path, tiny, checkpoint))
        message = str(caught.value)
        assert f"{checkpoint.name} was written after its non-finite steps began at step {first} " in message
        assert message.endswith(f"pass validate.fork_from={clean}; nothing was written")
        link = tmp_path / "link"  # named another way: through a link to the checkpoint folder
        link.unlink(missing_ok=True)
        link.symlink_to(checkpoint)
        with pytest.raises(ValueError, match=f"began at step {first} "):
            resolve_fork_checkpoint(str(link))
    assert not (tmp_path / "val").exists()
    assert resolve_fork_checkpoint(str(clean)) == clean.resolve()  # written before it went wrong: the user's choice


def test_a_checkpoint_given_directly_is_refused_at_or_after_the_divergence(diverged, tmp_path):
    from fp8train.training.runs.fork import resolve_fork_checkpoint

    at = json.loads((diverged / "summary.json").read_text())["diverged_at_step"]
    _, _, clean = _streak(diverged)
    step = int(clean.name[5:])
    # a copy whose summary says it diverged at the clean checkpoint's step: refused, the one before named
    copy = tmp_path / "src"
    shutil.copytree(diverged, copy)
    summary = json.loads((copy / "summary.json").read_text())
    (copy / "summary.json").write_text(json.dumps({**summary, "diverged_at_step": step}))
    earlier = sorted(c for c in (copy / "checkpoints").glob("step_*") if int(c.name[5:]) < step)
    hint = f"train.fork_from={earlier[-1]};" if earlier else "no checkpoint from before"
    with pytest.raises(ValueError, match=rf"ended diverged at step {step} .*{hint}"):
        resolve_fork_checkpoint(str(copy / "checkpoints" / clean.name))
    assert at > step
    # stopped by a validation's divergence guard (no step recorded): the run directory is refused
    (copy / "summary.json").write_text(json.dumps({**summary, "status": "stopped", "diverged_at_step": None,
                                                   "reason": "loss 9.1 > 1.5 x baseline"}))
    with pytest.raises(ValueError, match=rf"run {copy} ended stopped \(loss 9.1 > 1.5 x baseline\)"):
        resolve_fork_checkpoint(str(copy))


def _unrecorded_copy(diverged, tmp_path):
    """The diverged source without its summary.json (as while it still trained): its checkpoints inside the
    non-finite run are then not refused, which is how a validation gets runs that skip their steps."""
    copy = tmp_path / "still_training"
    shutil.copytree(diverged, copy)
    (copy / "summary.json").unlink()
    return copy


@pytest.mark.slow
def test_runs_that_skipped_all_their_steps_make_the_verdict_inconclusive(diverged, tiny, tmp_path):
    from fp8train.evidence.validate import run_validation

    at = json.loads((diverged / "summary.json").read_text())["diverged_at_step"]
    source = _unrecorded_copy(diverged, tmp_path)
    result = run_validation(_validate_cfg(tmp_path, tiny, source / "checkpoints" / f"step_{at - 1:06d}"),
                            log=lambda _: None, show_progress=False)
    runs = {p.parent.relative_to(tmp_path / "val" / "runs").as_posix(): json.loads(p.read_text())
            for p in (tmp_path / "val" / "runs").glob("*/*/summary.json")}
    assert len(runs) == 4 and all(s["status"] == "completed" and s["skipped_steps"] == s["steps"] == 3
                                  for s in runs.values())  # what the verdict must not count as evidence
    candidate = result["candidates"]["current"]
    assert result["verdict"] != "pass" and candidate["verdict"] == "inconclusive"
    for seed in (1337, 1338):
        assert f"runs/bf16/seed{seed} skipped 3 of 3 steps" in candidate["reason"]
    assert "runs/bf16/seed1337 skipped 3 of 3 steps" in (tmp_path / "val" / "report.md").read_text()


@pytest.mark.slow
def test_a_seed_whose_bf16_baseline_diverged_judges_no_candidate(diverged, tiny, tmp_path):
    """Issue 44, N2: every run of the seed diverged, the bf16 baseline too; the verdict was FAIL, naming the FP8
    candidate's layers. A baseline that did not train can judge nothing: INCONCLUSIVE, its reason said."""
    from fp8train.evidence.validate import run_validation

    first, inside, _ = _streak(diverged)
    source = _unrecorded_copy(diverged, tmp_path)
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=val", f"data.path={tiny.corpus}", *TINY, LR,
                             "train.max_steps=6", "train.eval_every=3", "validate.final_window=1",
                             "validate.workers=1", "validate.seeds=2", "validate.candidates=[current]",
                             f"validate.fork_from={source / 'checkpoints' / inside[-1].name}"])
    result = run_validation(cfg, log=lambda _: None, show_progress=False)
    runs = {p.parent.relative_to(tmp_path / "val" / "runs").as_posix(): json.loads(p.read_text())
            for p in (tmp_path / "val" / "runs").glob("*/*/summary.json")}
    assert sorted(runs) == ["bf16/seed1337", "bf16/seed1338", "current/seed1337", "current/seed1338"]
    assert all(s["status"] == "diverged" for s in runs.values())  # what happened, from the runs' own files
    candidate = result["candidates"]["current"]
    assert result["verdict"] == candidate["verdict"] == "inconclusive"
    precision = result["baseline_precision"]  # the baseline's folder is bf16/; TINY's autocast is fp32
    for seed in (1337, 1338):
        assert f"seed {seed}: the {precision} baseline did not train (" in candidate["reason"]
    assert candidate["divergence"] == []  # no FP8 layers blamed
    report = (tmp_path / "val" / "report.md").read_text()
    assert f"the {precision} baseline did not train" in report and "**Verdict: INCONCLUSIVE**" in report


@pytest.mark.slow
def test_a_rerun_whose_pinned_checkpoint_was_pruned_says_it_was_deleted(source, tiny, tmp_path):
    from fp8train.evidence.validate import run_validation

    src = tmp_path / "src"
    shutil.copytree(source / "src", src)
    shutil.rmtree(src / "checkpoints" / "step_000016")  # the run directory's newest is step 8 when planned
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=val", f"data.path={tiny.corpus}", *TINY,
                             "train.max_steps=2", "train.eval_every=2", "validate.final_window=1",
                             "validate.workers=1", "validate.seeds=2", "validate.candidates=[current]",
                             f"validate.fork_from={src}"])
    run_validation(cfg, log=lambda _: None, show_progress=False, write_report=False)
    pinned = json.loads((tmp_path / "val" / "plan.json").read_text())["fork"]["checkpoint"]
    assert pinned == str((src / "checkpoints" / "step_000008").resolve())
    # the source trained on and pruned its step-8 checkpoint: the run directory now resolves to step 16
    shutil.copytree(source / "src" / "checkpoints" / "step_000016", src / "checkpoints" / "step_000016")
    shutil.rmtree(src / "checkpoints" / "step_000008")
    with pytest.raises(ValueError) as caught:
        run_validation(cfg, log=lambda _: None, show_progress=False, write_report=False)
    message = str(caught.value)
    assert f"the fork checkpoint {pinned}, which was deleted" in message
    assert f"now resolves to {(src / 'checkpoints' / 'step_000016').resolve()}" in message
    assert f"pass validate.fork_from={pinned}" not in message  # it is gone: passing it cannot work
