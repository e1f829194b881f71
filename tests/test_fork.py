"""train.fork_from and validate.fork_from: runs that start from a checkpoint of another run.

References are the source run's own files: its logged learning rates and validation losses, its checkpoint's
tensors and AdamW step counts, read back with safetensors.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fp8train.training.config import load_config
from fp8train.training.loop import train

# the tiny model: a 16-step bf16 source run (checkpoints at 8 and 16), fp32 activations, one thread
TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.batch_size=8",
        "train.eval_every=4", "train.eval_batches=2", "optim.warmup_steps=2", "policy.min_features=16",
        "log.wandb=disabled", "log.every=1", "log.telemetry_every=0", "train.autocast=none", "train.threads=1",
        "train.lr=3e-3", "fp8.emulated_dtype=fp32"]


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny):
    """A bf16 run of 16 steps, checkpoints every 8, and a delayed-scaling FP8 run of the same shape."""
    root = tmp_path_factory.mktemp("fork_source")
    common = [f"run.dir={root}", f"data.path={tiny.corpus}", *TINY, "train.max_steps=16", "checkpoint.every=8",
              "checkpoint.keep_last=0"]
    for name, recipe in (("src", "none"), ("src_delayed", "delayed")):
        assert train(load_config(None, [*common, f"run.name={name}", f"fp8.recipe={recipe}"]),
                     show_progress=False)["status"] == "completed"
    return root


def _fork(root, tiny, name, checkpoint, recipe="none", seed=1337, steps=8, extra=()):
    cfg = load_config(None, [f"run.dir={root}", f"run.name={name}", f"data.path={tiny.corpus}", *TINY,
                             f"train.max_steps={steps}", f"train.fork_from={checkpoint}", f"fp8.recipe={recipe}",
                             f"train.seed={seed}", "checkpoint.every=4", "checkpoint.keep_last=0", *extra])
    return cfg, train(cfg, show_progress=False)


def test_fork_goes_on_with_the_source_weights_adamw_state_and_schedule(source, tiny, tmp_path):
    src = source / "src"
    _, summary = _fork(tmp_path, tiny, "fork", src / "checkpoints" / "step_000008")
    assert summary["status"] == "completed" and summary["steps"] == 8
    src_log = {r["step"]: r for r in _metrics(src)}
    fork_log = {r["step"]: r for r in _metrics(tmp_path / "fork")}
    # step 0 of the fork is step 8 of the source: the same weights on the same validation batches
    assert fork_log[0]["val_loss"] == src_log[8]["val_loss"]
    # the source's LR schedule goes on: fork step k runs at the source's rate of step 8 + k
    for k in range(1, 9):
        assert fork_log[k]["lr"] == pytest.approx(src_log[8 + k]["lr"], rel=1e-12)
    # AdamW state went on from step 8: the fork's checkpoint at its step 4 holds step counts of 12
    steps = {v.item() for k, v in load_file(str(tmp_path / "fork/checkpoints/step_000004/optimizer.safetensors"))
             .items() if k.endswith(".step")}
    assert steps == {12.0}
    # the same seed as the source: the fork sees the batches of steps 0..7 again, not the source's 8..15
    assert fork_log[1]["loss"] != src_log[9]["loss"]


def test_seeds_vary_only_the_data_order_after_the_fork(source, tiny, tmp_path):
    ckpt = source / "src" / "checkpoints" / "step_000008"
    _fork(tmp_path, tiny, "a", ckpt, seed=1, steps=4)
    _fork(tmp_path, tiny, "b", ckpt, seed=2, steps=4)
    a, b = ({r["step"]: r for r in _metrics(tmp_path / n)} for n in "ab")
    assert a[0]["val_loss"] == b[0]["val_loss"]  # the same start
    assert a[1]["loss"] != b[1]["loss"]  # other batches


def test_fp8_state_fresh_from_bf16_and_carried_from_the_same_recipe(source, tiny, tmp_path):
    from fp8train.nn.convert import fp8_layers
    from fp8train.training.runs.fork import open_fork
    from fp8train.training.loop import make_accelerator, start_from_fork
    from fp8train.training.setup import set_up

    ckpt = source / "src_delayed" / "checkpoints" / "step_000008"
    cfg, _ = _fork(tmp_path, tiny, "same", ckpt, recipe="delayed", steps=4)
    assert open_fork(cfg).fp8_state == "checkpoint"
    cfg_other, _ = _fork(tmp_path, tiny, "other", ckpt, recipe="current", steps=4)
    assert open_fork(cfg_other).fp8_state == "fresh"
    cfg_bf16, summary = _fork(tmp_path, tiny, "bf16", ckpt, recipe="none", steps=4)  # drops the FP8 state
    assert summary["status"] == "completed" and open_fork(cfg_bf16).fp8_state == "fresh"
    cfg_fresh, _ = _fork(tmp_path, tiny, "fresh", source / "src" / "checkpoints" / "step_000008",
                         recipe="delayed", steps=4)
    assert open_fork(cfg_fresh).fp8_state == "fresh"
    # Carried: at the fork's step 0 its delayed amax history is the source's at step 8 (a fresh one is zeros)
    saved = load_file(str(ckpt / "model.safetensors"))
    history = [k for k in saved if k.endswith("input_amax_history")]
    assert history and any(saved[k].abs().sum() > 0 for k in history)
    for name, expected in (("same", True), ("fresh", False)):
        c = cfg if name == "same" else cfg_fresh
        c2 = load_config(None, [f"run.dir={tmp_path}", f"run.name={name}_probe", f"data.path={tiny.corpus}", *TINY,
                                "train.max_steps=4", f"train.fork_from={c.train.fork_from}", "fp8.recipe=delayed"])
        run = set_up(c2, make_accelerator(c2), False)
        start_from_fork(run)
        run.lock.release()
        layers = dict(fp8_layers(run.model))
        for key in history:
            layer, buf = key.rsplit(".", 1)
            carried = torch.equal(getattr(layers[layer], buf), saved[key])
            assert carried is expected, (name, key)


@pytest.mark.parametrize("change, message", [
    ("train.lr=1e-3", "train.lr"), ("model.d_model=32", "model.d_model"), ("optim.warmup_steps=5", "optim"),
])
def test_fork_from_another_model_or_optimizer_is_refused_before_anything_is_written(source, tiny, tmp_path,
                                                                                    change, message):
    with pytest.raises(ValueError, match=message):
        _fork(tmp_path, tiny, "bad", source / "src", extra=[change] if "d_model" not in change else
              [change, "model.n_heads=2"])
    assert not (tmp_path / "bad").exists()


def test_fork_from_a_broken_or_missing_checkpoint_is_refused(source, tiny, tmp_path):
    with pytest.raises(ValueError, match=r"nowhere does not exist \(deleted\?\)$"):
        _fork(tmp_path, tiny, "none", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        _fork(tmp_path, tiny, "none", tmp_path / "empty")
    broken = tmp_path / "copy"
    shutil.copytree(source / "src", broken)
    data = broken / "checkpoints" / "step_000016" / "model.safetensors"
    data.write_bytes(data.read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(ValueError, match="does not verify"):
        _fork(tmp_path, tiny, "broken", broken / "checkpoints" / "step_000016")
    assert not (tmp_path / "broken").exists()


def test_fork_of_a_run_directory_takes_its_newest_checkpoint(source, tiny, tmp_path):
    from fp8train.training.runs.fork import resolve_fork_checkpoint

    assert resolve_fork_checkpoint(str(source / "src")).name == "step_000016"
    _, summary = _fork(tmp_path, tiny, "latest", source / "src", steps=2)
    src_log = {r["step"]: r for r in _metrics(source / "src")}
    assert {r["step"]: r for r in _metrics(tmp_path / "latest")}[0]["val_loss"] == src_log[16]["val_loss"]
    assert math.isfinite(summary["val_loss"])


# ------------------------------------------------------------------------------------------------------------
# validate.fork_from
# ------------------------------------------------------------------------------------------------------------
def _validate_cfg(root, tiny, fork_from, extra=()):
    return load_config(None, [f"run.dir={root}", "run.name=val", f"data.path={tiny.corpus}", *TINY,
                              "train.max_steps=4", "train.eval_every=2", "validate.final_window=1",
                              "validate.margin=0.05", "validate.workers=1", "validate.seeds=2",
                              f"validate.fork_from={fork_from}", *extra])


def test_a_plan_made_from_a_fork_is_finished_from_the_same_checkpoint_only(source, tmp_path):
    """check_fork_unchanged by hand: no planned fork (a first run, or a plan without one) accepts any record;
    a planned one refuses another checkpoint path, then other bytes under the same path."""
    from fp8train.evidence.fork_pinning import check_fork_unchanged

    record = {"checkpoint": "runs/src/checkpoints/step_16", "sha256": "1" * 64}
    check_fork_unchanged(tmp_path, record, None)
    check_fork_unchanged(tmp_path, record, {})
    check_fork_unchanged(tmp_path, record, dict(record))
    # a planned checkpoint still there and whole: the path now resolves to another one (a run directory's newest
    # changed)
    planned = tmp_path / "runs" / "src" / "checkpoints" / "step_000008"
    shutil.copytree(source / "src" / "checkpoints" / "step_000008", planned)
    with pytest.raises(ValueError) as caught:
        check_fork_unchanged(tmp_path, record, {**record, "checkpoint": str(planned)})
    assert str(caught.value).startswith(f"{tmp_path / 'plan.json'} was planned from the fork checkpoint "
                                        f"{planned}; validate.fork_from now resolves to "
                                        "runs/src/checkpoints/step_16")
    # still there but no longer whole: said so (issue 44, N3), not blamed on a run that trains on
    (planned / "manifest.json").unlink()
    with pytest.raises(ValueError) as caught:
        check_fork_unchanged(tmp_path, record, {**record, "checkpoint": str(planned)})
    assert f"{planned}, which no longer verifies (no manifest.json" in str(caught.value)
    assert "changes as it trains" not in str(caught.value)
    # one that is gone: said deleted, never offered as the path to pass
    with pytest.raises(ValueError) as caught:
        check_fork_unchanged(tmp_path, record, {**record, "checkpoint": str(tmp_path / "gone" / "step_8")})
    assert "which was deleted" in str(caught.value) and "pass validate.fork_from" not in str(caught.value)
    with pytest.raises(ValueError) as caught:
        check_fork_unchanged(tmp_path, record, {**record, "sha256": "2" * 64})
    assert str(caught.value).startswith("the fork checkpoint runs/src/checkpoints/step_16 changed since "
                                        f"{tmp_path / 'plan.json'} was planned (sha256 222222222222 then, "
                                        "111111111111 now)")


@pytest.mark.slow
def test_validation_from_a_fork_records_the_checkpoint_and_refuses_a_changed_or_missing_one(source, tiny, tmp_path):
    from fp8train.evidence.validate import run_validation

    src = tmp_path / "src_copy"
    shutil.copytree(source / "src", src)
    summary = run_validation(_validate_cfg(tmp_path, tiny, src), candidates=["current"], show_progress=False)
    assert summary["verdict"] in ("pass", "inconclusive")
    vdir = tmp_path / "val"
    plan = json.loads((vdir / "plan.json").read_text())
    fork = plan["fork"]
    assert fork["step"] == 16 and fork["checkpoint"].endswith("src_copy/checkpoints/step_000016")
    assert fork["fp8_state"] == {"bf16": "none", "current": "fresh"} and len(fork["sha256"]) == 64
    assert "Forked: every run of the plan starts from" in (vdir / "report.md").read_text()
    # every bf16 run starts where the source ended: step 0 is the source's step 16 on the same batches
    src_val = {r["step"]: r for r in _metrics(src)}[16]["val_loss"]
    for seed in (1337, 1338):
        assert _metrics(vdir / f"runs/bf16/seed{seed}")[0]["val_loss"] == src_val
    # the same checkpoint path, other bytes (a run of another seed): refused, nothing touched
    other = tmp_path / "other"
    assert train(load_config(None, [f"run.dir={tmp_path}", "run.name=other", f"data.path={tiny.corpus}", *TINY,
                                    "train.max_steps=16", "train.seed=7", "fp8.recipe=none"]),
                 show_progress=False)["status"] == "completed"
    shutil.rmtree(src)
    shutil.copytree(other, src)
    before = sorted(p.name for p in vdir.rglob("*"))
    with pytest.raises(ValueError, match="changed since"):
        run_validation(_validate_cfg(tmp_path, tiny, src), candidates=["current"], show_progress=False)
    shutil.rmtree(src)
    with pytest.raises(ValueError, match="step_000016 \(sha256 [0-9a-f]{12}\), which was deleted: "):
        run_validation(_validate_cfg(tmp_path, tiny, src), candidates=["current"], show_progress=False)
    assert sorted(p.name for p in vdir.rglob("*")) == before


# ------------------------------------------------------------------------------------------------------------
# Hugging Face models (model.hf_path)
# ------------------------------------------------------------------------------------------------------------
HF = ["model.seq_len=32", "train.batch_size=4", "train.eval_every=4", "train.eval_batches=2",
      "optim.warmup_steps=2", "policy.min_features=16", "log.wandb=disabled", "log.every=1",
      "log.telemetry_every=0", "train.autocast=none", "train.threads=1", "train.lr=1e-3",
      "fp8.emulated_dtype=fp32", "data.max_bytes=200000",
      "data.tokenizer=bytes"]  # make_pretrained's folders hold weights only: byte ids on purpose (issue 28's rule)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2 ties its embeddings: stored once in the checkpoint
def test_fork_of_a_fine_tune_of_a_pretrained_hf_model(tmp_path, tiny, arch):
    from hf_helpers import make_pretrained

    folder = make_pretrained(tmp_path / arch, arch, steps=3)
    common = [f"run.dir={tmp_path}", f"data.path={tiny.corpus}", f"model.hf_path={folder}", *HF]
    source = load_config(None, [*common, "run.name=src", "train.max_steps=8", "fp8.recipe=none"])
    assert train(source, show_progress=False)["status"] == "completed"
    src_log = {r["step"]: r for r in _metrics(tmp_path / "src")}
    for recipe in ("none", "current"):
        cfg = load_config(None, [*common, f"run.name=fork_{recipe}", "train.max_steps=4", f"fp8.recipe={recipe}",
                                 f"train.fork_from={tmp_path / 'src'}"])
        assert train(cfg, show_progress=False)["status"] == "completed"
        fork_log = {r["step"]: r for r in _metrics(tmp_path / f"fork_{recipe}")}
        if recipe == "none":
            assert fork_log[0]["val_loss"] == src_log[8]["val_loss"]
        else:  # the same weights evaluated through FP8 GEMMs: close to the source's, not equal
            assert fork_log[0]["val_loss"] == pytest.approx(src_log[8]["val_loss"], rel=0.02)
        # the source's schedule ended at step 8: the fork goes on at its final rate, min_lr_ratio x train.lr
        assert fork_log[1]["lr"] == pytest.approx(0.1 * 1e-3, rel=1e-12)


# ------------------------------------------------------------------------------------------------------------
# Under accelerate launch
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_validation_from_a_fork_under_accelerate_launch_of_two_processes(source, tiny, tmp_path, commands):
    """Both at once, on 2 processes: validate.fork_from and validate.seeds=auto (its rounds read the files on
    every rank)."""
    import sys

    overrides = [f"run.dir={tmp_path}", "run.name=val2", f"data.path={tiny.corpus}", *TINY, "train.max_steps=4",
                 "train.eval_every=2", "validate.final_window=1", "validate.margin=0.05", "validate.seeds=auto",
                 "validate.max_seeds=3", f"validate.fork_from={source / 'src'}", "validate.candidates=[current]"]
    config = tmp_path / "val.yaml"
    config.write_text("run:\n  name: val2\n")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "fp8train.cli",
           "validate", str(config), "--quiet", *overrides]
    proc = commands.run(cmd, env=commands.launch_env(tmp_path / "hf"), timeout=400)
    assert proc.returncode in (0, 3), proc.stderr[-4000:]
    vdir = tmp_path / "val2"
    assert json.loads((vdir / "plan.json").read_text())["fork"]["step"] == 16
    summary = json.loads((vdir / "summary.json").read_text())
    assert summary["seeds"][:2] == [1337, 1338] and summary["cost"]["runs"] in (4, 6)
    src_val = {r["step"]: r for r in _metrics(source / "src")}[16]["val_loss"]
    for seed in (1337, 1338):
        run = vdir / f"runs/bf16/seed{seed}"
        assert json.loads((run / "summary.json").read_text())["world_size"] == 2
        assert _metrics(run)[0]["val_loss"] == pytest.approx(src_val, rel=1e-6)
