"""A finished run whose newest checkpoint no longer verifies (issue 44, hostile pass N3): export, kv-eval and a fork
fall back to the newest checkpoint that verifies, as documented, and say in one line which one they passed over
and why; a validation planned on the damaged checkpoint is refused on a re-run naming that it no longer verifies,
not "a run directory's newest checkpoint changes as it trains".

References: the checkpoint folders on disk, one byte of the newest's model.safetensors flipped here.
"""

from __future__ import annotations

import shutil

import pytest

from fp8train.training.config import load_config
from test_fork import TINY, source  # noqa: F401  (source: a 16-step bf16 run, checkpoints at 8 and 16)

MISMATCH = "model.safetensors checksum mismatch"


def _damaged_copy(source, tmp_path):
    """The source run with one byte of its newest checkpoint's weights flipped (the folder and manifest stay)."""
    run = tmp_path / "src"
    shutil.copytree(source / "src", run)
    weights = run / "checkpoints" / "step_000016" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    return run


def test_a_fork_of_a_run_whose_newest_checkpoint_is_damaged_says_which_it_passed_over(source, tmp_path, capsys):
    from fp8train.training.runs.fork import resolve_fork_checkpoint

    run = _damaged_copy(source, tmp_path)
    capsys.readouterr()
    assert resolve_fork_checkpoint(str(run)) == (run / "checkpoints" / "step_000008").resolve()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"train.fork_from={run}: skipping checkpoint "
                                               f"{run / 'checkpoints' / 'step_000016'}: {MISMATCH}"), err
    assert err[0].endswith("; using step_000008")


@pytest.mark.parametrize("command", ["export", "kv-eval"])
def test_export_and_kv_eval_say_the_damaged_checkpoint_they_passed_over(source, tmp_path, commands, capsys, command):
    run = _damaged_copy(source, tmp_path)
    out = tmp_path / "out"
    argv = ([command, str(run), "--format", "e4m3fn", "--out", str(out), "--no-check"] if command == "export"
            else [command, str(run), "--out", str(out), "--batches", "1"])
    code, stdout, err = commands.main(argv, capsys)
    assert code == 0, err
    said = [line for line in err.splitlines() if "step_000016" in line]
    assert said == [f"skipping checkpoint {run / 'checkpoints' / 'step_000016'}: {MISMATCH} (corrupt)"], err
    if command == "export":
        assert stdout.startswith(f"exported step 8 of {run}")


@pytest.mark.slow
def test_a_re_run_planned_on_a_checkpoint_now_damaged_says_it_no_longer_verifies(source, tiny, tmp_path):
    from fp8train.evidence.validate import run_validation

    run = tmp_path / "src"
    shutil.copytree(source / "src", run)
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=val", f"data.path={tiny.corpus}", *TINY,
                             "train.max_steps=2", "train.eval_every=2", "validate.final_window=1",
                             "validate.workers=1", "validate.seeds=2", "validate.candidates=[current]",
                             f"validate.fork_from={run}"])
    run_validation(cfg, log=lambda _: None, show_progress=False, write_report=False)
    shutil.rmtree(run)
    assert _damaged_copy(source, tmp_path) == run  # the same run, its step-16 checkpoint now damaged
    with pytest.raises(ValueError) as caught:
        run_validation(cfg, log=lambda _: None, show_progress=False, write_report=False)
    message = str(caught.value)
    newest = (run / "checkpoints" / "step_000016").resolve()
    assert f"planned from the fork checkpoint {newest}, which no longer verifies ({MISMATCH}" in message
    assert f"now resolves to {(run / 'checkpoints' / 'step_000008').resolve()}" in message
    assert "changes as it trains" not in message
