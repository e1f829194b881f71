"""Export and kv-eval of sources that change or should not be served, with real runs and real processes: a run
still training (saving every step, keeping one checkpoint) is exported and checked against the one checkpoint it
was read at; a checkpoint pruned while read is said to be pruned, never damaged; a diverged run is refused unless
--allow-diverged, and then its fidelity, outside the documented bounds, is exit 1 with the figures; fp8train's
dense export of the built-in (byte-level) decoder exports again."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import TINY_FP8_RUN

pytestmark = pytest.mark.slow

LIVE = [*(o for o in TINY_FP8_RUN if not o.startswith(("train.max_steps=", "train.eval_every="))),
        "train.max_steps=100000", "train.eval_every=100000", "checkpoint.every=1", "checkpoint.keep_last=1",
        "log.every=1"]


def _figures(text: str) -> list[tuple[str, float, float, float]]:
    """(comparison, max|diff|, mean KL, top-1 %) of each `logits ...` line export prints."""
    return [(m[1], float(m[2]), float(m[3]), float(m[4])) for m in re.finditer(
        r"logits (\S+): max\|diff\| (\S+), mean KL (\S+), top-1 agreement (\S+)%", text)]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory, commands):
    """A run training in another process, writing a checkpoint every step and pruning the one before (one for
    the module's tests: each reads it while it moves on)."""
    tmp_path = tmp_path_factory.mktemp("live")
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    proc = subprocess.Popen(commands.fp8train("train", str(config), f"run.dir={tmp_path}", "run.name=live", *LIVE,
                                              "--quiet"), env=commands.env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    run = tmp_path / "live"
    try:
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob("step_*")):
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "the run wrote no checkpoint in 120 s"
            time.sleep(0.2)
        yield run
        assert proc.poll() is None, "the live run ended before the test did"
    finally:
        proc.kill()
        proc.communicate()


def test_a_live_run_is_exported_and_checked_at_one_checkpoint(live_run, tmp_path, commands):
    out = tmp_path / "dense"
    done = commands.run(commands.fp8train("export", str(live_run), "--format", "hf", "--out", str(out)),
                        timeout=300)
    assert done.returncode == 0, done.stderr
    (name, max_diff, kl, top1), = _figures(done.stdout)
    # float32 weights, compared in float32 with the very model they were written from
    assert name == "transformers_vs_source" and max_diff < 1e-4 and kl < 1e-8 and top1 == 100.0, done.stdout
    step = json.loads((out / "config.json").read_text())["fp8train_export"]["source_step"]
    assert f"exported step {step} of {live_run}" in done.stdout
    later = max(int(p.name.split("_")[1]) for p in (live_run / "checkpoints").glob("step_*"))
    assert later > step  # the run moved on while it was exported: the check did not follow it


def test_a_live_run_pruning_every_checkpoint_is_evaluated_never_called_damaged(live_run, tmp_path, commands):
    """kv-eval reads a checkpoint that the run prunes about a step later: the read is whole, or the pruned
    checkpoint is named as pruned and a newer one read; never a missing manifest or an internal error."""
    out = tmp_path / "kv"
    done = commands.run(commands.fp8train("kv-eval", str(live_run), "--out", str(out), "--batches", "1",
                                          "--format", "e4m3fn", "--calib-batches", "1", "--gen-prompts", "0"),
                        timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no manifest.json" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert json.loads((out / "kv_eval.json").read_text())["manifest"]["checkpoint_step"] >= 1


def test_load_run_of_a_live_run_never_reports_a_pruned_checkpoint_as_damaged(live_run):
    from fp8train.serving.run_loading import load_run

    said, steps = [], []
    for _ in range(20):  # each load races the run's next save and prune
        steps.append(load_run(live_run, log=said.append).step)
    assert not [m for m in said if "no manifest.json" in m or "unreadable" in m], said
    assert steps == sorted(steps) and steps[-1] > steps[0]  # the run moved on, each load a whole checkpoint


@pytest.mark.parametrize("keep_last", [0, 2])
def test_a_finished_run_whose_manifests_were_removed_is_said_deleted_never_pruned(tmp_path, keep_last):
    """Pruned means removed by the run's keep_last rotation; manifests removed otherwise (by hand, in a finished
    run, whether it rotates or keeps all) are said missing, and the run is not called still training."""
    from fp8train.serving.run_loading import load_run
    from fp8train.training.config import load_config
    from fp8train.training.loop import train

    options = [o for o in TINY_FP8_RUN if not o.startswith(("train.max_steps=", "train.eval_every="))]
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=r", *options, "train.max_steps=6",
                             "train.eval_every=6", "checkpoint.every=2", f"checkpoint.keep_last={keep_last}"])
    assert train(cfg, show_progress=False)["status"] == "completed"
    checkpoints = sorted((tmp_path / "r" / "checkpoints").glob("step_*"))
    assert len(checkpoints) >= 2
    for checkpoint in checkpoints:
        (checkpoint / "manifest.json").unlink()
    said = []
    with pytest.raises(ValueError) as caught:
        load_run(tmp_path / "r", log=said.append)
    message = str(caught.value)
    assert "pruned" not in message and "still training" not in message, message
    assert not [m for m in said if "pruned" in m], said
    assert f"{checkpoints[-1]}: no manifest.json (deleted" in message, message


def test_a_validation_directory_given_as_the_run_is_named_with_one_of_its_runs(tmp_path):
    from fp8train.serving.run_loading import load_run

    (tmp_path / "plan.json").write_text("{}\n")
    run = tmp_path / "runs" / "bf16" / "seed1337"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    with pytest.raises(ValueError, match=f"is a validation directory \\(plan.json\\), not a run: give one of its "
                                         f"runs, e.g. {run}"):
        load_run(tmp_path)


@pytest.fixture(scope="module")
def diverged_run(tmp_path_factory, commands):
    root = tmp_path_factory.mktemp("diverged")
    (root / "empty.yaml").write_text("{}\n")
    options = [o for o in TINY_FP8_RUN if not o.startswith(("train.lr=", "train.max_steps=", "train.eval_every="))]
    done = commands.run(commands.fp8train("train", str(root / "empty.yaml"), f"run.dir={root}", "run.name=div",
                                          *options, "train.lr=30", "train.max_steps=14", "train.eval_every=7",
                                          "checkpoint.every=2", "--quiet"))
    summary = json.loads((root / "div" / "summary.json").read_text())
    assert summary["status"] == "diverged" and list((root / "div" / "checkpoints").glob("step_*")), done.stderr
    (root / "train.stderr").write_text(done.stderr)  # its summary line, for the step numbering below
    return root / "div", summary


def test_every_message_of_a_diverged_run_numbers_its_steps_alike(diverged_run, tmp_path, commands, capsys):
    """Steps are numbered from 1; a diverged run stops at the step that diverged (summary.json diverged_at_step,
    not applied) after taking the ones before it (summary.json steps). The run's own summary line, its reason,
    its metrics and checkpoints, and export's and kv-eval's refusals all say the same two numbers."""
    run, summary = diverged_run
    at, steps = summary["diverged_at_step"], summary["steps"]
    assert steps == at - 1
    line = [l for l in (run.parent / "train.stderr").read_text().splitlines() if l.startswith("[div] ")]
    assert len(line) == 1 and line[0].startswith(f"[div] diverged at step {at} after {steps} steps, "), line
    logged = [json.loads(l)["step"] for l in (run / "metrics.jsonl").read_text().splitlines()]
    saved = [int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*")]
    assert max(logged) <= steps and max(saved) <= steps
    ranged = re.search(r"non-finite for (\d+) steps in a row \(steps (\d+)-(\d+)\): ", summary["reason"])
    if ranged:  # the skip rule: the steps before the last were skipped (counted in `steps`), the last stopped it
        count, first, last = map(int, ranged.groups())
        assert (last, last - first + 1) == (at, count)
        assert summary["reason"].endswith(f"the run stopped at step {at}")
        assert summary["skipped_steps"] >= count - 1
    for argv in (["export", str(run), "--format", "e4m3fn", "--out", str(tmp_path / "e.safetensors")],
                 ["kv-eval", str(run), "--out", str(tmp_path / "kv")]):
        code, _, err = commands.main(argv, capsys)  # in this process: the refusal comes before any model is read
        assert code == 2 and f"ended diverged at step {at} (after {steps} steps; {summary['reason']})" in err, err
    assert not any(tmp_path.iterdir())


def test_a_diverged_run_is_refused_unless_allowed_and_its_fidelity_fails_with_figures(diverged_run, tmp_path,
                                                                                       commands, capsys):
    run, summary = diverged_run  # the commands in this process: what they print is what the command prints
    out = tmp_path / "div.safetensors"
    code, _, err = commands.main(["export", str(run), "--format", "e4m3fn", "--out", str(out)], capsys)
    assert code == 2 and not out.exists()
    assert f"ended diverged at step {summary['diverged_at_step']}" in err, err
    assert "--allow-diverged" in err
    code, stdout, err = commands.main(["export", str(run), "--format", "e4m3fn", "--out", str(out),
                                       "--allow-diverged"], capsys)
    assert out.exists()
    figures = _figures(stdout)
    over = [f for f in figures if f[1] > 0.5 or f[2] > 1e-3]  # the documented bounds (docs/serving.md)
    assert over and code == 1, (stdout, err)
    assert "outside the documented bounds" in err
    for name, max_diff, kl, _ in over:
        assert f"{name}: max|diff| {max_diff:.4g} > 0.5" in err or f"{name}: mean KL {kl:.4g} > 0.001" in err, err
    # kv-eval refuses it the same way (its losses would measure the divergence), before writing anything
    code, _, err = commands.main(["kv-eval", str(run), "--out", str(tmp_path / "kv")], capsys)
    assert code == 2 and not (tmp_path / "kv").exists(), err
    assert f"ended diverged at step {summary['diverged_at_step']}" in err
    assert "--allow-diverged to evaluate it" in err


def test_a_dense_export_of_the_built_in_decoder_exports_again(tiny_fp8_run, tmp_path, commands, capsys):
    dense = tmp_path / "dense"  # the three exports in this process: what they print is what the command prints
    code, _, err = commands.main(["export", str(tiny_fp8_run), "--format", "hf", "--out", str(dense)], capsys)
    assert code == 0, err
    for fmt, out in (("hf", tmp_path / "again"), ("e4m3fn", tmp_path / "again.safetensors")):
        code, stdout, err = commands.main(["export", str(dense), "--format", fmt, "--out", str(out)], capsys)
        assert code == 0 and "data.tokenizer" not in err, err
        figures = _figures(stdout)
        assert figures and all(f[1] <= 0.5 and f[2] <= 1e-3 for f in figures), stdout


def test_a_diverged_run_without_a_checkpoint_says_it_has_none_not_to_pass_allow_diverged(diverged_run, tmp_path,
                                                                                          commands, capsys):
    run = tmp_path / "div"
    shutil.copytree(diverged_run[0], run, ignore=shutil.ignore_patterns("checkpoints"))
    for argv, action in ((["export", str(run), "--format", "e4m3fn", "--out", str(tmp_path / "m.safetensors")],
                          "export"),
                         (["kv-eval", str(run), "--format", "e4m3fn", "--out", str(tmp_path / "kv")], "evaluate")):
        code, _, err = commands.main(argv, capsys)
        assert code == 2 and err.count("\n") == 1, err
        assert f"ended diverged at step {diverged_run[1]['diverged_at_step']}" in err, err
        assert f"has no checkpoint under checkpoints/: nothing to {action}" in err and "--allow-diverged" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["div"]  # nothing written
