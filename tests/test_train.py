"""The training system end to end, in-process on CPU: loss goes down, runs are deterministic and resumable bit for
bit, the run directory holds what docs/design.md promises, user mistakes fail before anything is written, and a
diverging run stops with its step, reason, layer telemetry and the last good checkpoint.

Every run here is tiny (d_model 64, 2 layers, seq_len 32, batch 8, <= 12 steps) on a ~200 KB corpus cut from the
Python standard library, one intra-op thread, so the whole file takes well under a minute on 2 cores.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fp8train import cli
from fp8train.training.runs.checkpoint import list_checkpoints, verify_checkpoint
from fp8train.training.config import config_hash, load_config
from fp8train.training.loop import MAX_CONSECUTIVE_SKIPS, train

# One intra-op thread: these models are so small that a second OpenMP thread only adds synchronization, and on a
# loaded 2-core machine it makes every step several times slower (conftest's `single_thread` fixture).
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]

# What a resumed run must reproduce exactly (timings aside).
EXACT_KEYS = ("step", "loss", "val_loss", "lr", "grad_norm", "skipped_steps", "fp8/input/nonfinite_amax_events",
              "fp8/weight/nonfinite_amax_events", "fp8/grad_output/nonfinite_amax_events", "fp8/input/sqnr_min_db")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny) -> Path:
    """The shared tiny config (conftest's TINY_CONFIG, on its ~200 KB standard-library corpus) for the module's runs."""
    root = tmp_path_factory.mktemp("train")
    tiny.write(root)
    return root


# lr=100 overflows the tiny model's bf16 forward within this many steps on every CPU tried (2 to 8 of them)
DIVERGE_WITHIN = 20


def cfg_of(workdir: Path, name: str, *overrides: str):
    return load_config(str(workdir / "tiny.yaml"), [f"run.name={name}", *overrides])


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exact(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in EXACT_KEYS if k in r} for r in records]


@pytest.fixture(scope="module")
def runs(workdir, single_thread):
    """The module's shared runs: a straight delayed-FP8 run, the same seed again (stopped halfway, then resumed),
    another seed, and a bf16 run. Each summary is paired with its run directory."""
    out = {}
    out["straight"] = train(cfg_of(workdir, "straight"), show_progress=False)
    # Same seed, stopped after step 6 (as validate's guard would), then resumed from its step-4 checkpoint.
    out["stopped"] = train(cfg_of(workdir, "again"), show_progress=False,
                           should_stop=lambda r: "test stop" if r["step"] == 6 else None)
    out["again_before_resume"] = metrics_of(workdir / "runs" / "again")
    out["resumed"] = train(cfg_of(workdir, "again", "train.resume=true"), show_progress=False)
    out["other_seed"] = train(cfg_of(workdir, "other_seed", "train.seed=7", "train.max_steps=3"), show_progress=False)
    out["bf16"] = train(cfg_of(workdir, "bf16", "fp8.recipe=none", "checkpoint.every=0"), show_progress=False)
    return out


# ------------------------------------------------------------------------------------------------------------
# Learning, determinism, resume
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["straight", "bf16"])
def test_validation_loss_goes_down(workdir, runs, name):
    vals = [r["val_loss"] for r in metrics_of(workdir / "runs" / name) if "val_loss" in r]
    assert len(vals) == 3  # steps 0, 6, 12
    assert vals[0] == pytest.approx(math.log(256), abs=0.1)  # uniform predictions at init
    assert vals[2] < vals[1] < vals[0]
    assert vals[2] < vals[0] - 0.8
    assert runs[name]["status"] == "completed" and runs[name]["steps"] == 12


def test_fp8_run_tracks_bf16(workdir, runs):
    """Same seed, init and batches: delayed FP8 and bf16 differ only by quantization, so they stay close."""
    fp8, bf16 = runs["straight"]["val_loss"], runs["bf16"]["val_loss"]
    assert abs(fp8 - bf16) / bf16 < 0.02
    assert runs["straight"]["fp8_layers"] == 14 and runs["bf16"]["fp8_layers"] == 0


def test_same_seed_identical_other_seed_not(workdir, runs):
    straight = metrics_of(workdir / "runs" / "straight")
    again = runs["again_before_resume"]
    assert len(again) == 7  # step 0 (val) + steps 1..6 before the stop
    assert exact(again) == exact(straight[:7])  # exact float equality, not approx
    # Another seed: other initial weights and batches, so no loss matches (validation batches are the same ones).
    other = metrics_of(workdir / "runs" / "other_seed")
    assert other[0]["val_loss"] != straight[0]["val_loss"]
    assert all(o["loss"] != s["loss"] for o, s in zip(other[1:], straight[1:4]))


def test_resume_reproduces_uninterrupted_run_exactly(workdir, runs):
    assert runs["stopped"]["status"] == "stopped" and runs["stopped"]["reason"] == "test stop"
    resumed = runs["resumed"]
    assert resumed["resumed_from"].endswith("step_000004")
    assert resumed["status"] == "completed" and resumed["steps"] == 12
    straight_metrics = metrics_of(workdir / "runs" / "straight")
    resumed_metrics = metrics_of(workdir / "runs" / "again")
    assert [r["step"] for r in resumed_metrics] == list(range(13))  # steps 5, 6 rewritten, not duplicated
    assert exact(resumed_metrics) == exact(straight_metrics)
    for key in ("loss", "val_loss", "fp8_state_sha256"):
        assert resumed[key] == runs["straight"][key]
    # The final weights and FP8 scaling state are bit-identical.
    a = load_file(str(workdir / "runs" / "straight" / "checkpoints" / "step_000012" / "model.safetensors"))
    b = load_file(str(workdir / "runs" / "again" / "checkpoints" / "step_000012" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # telemetry.jsonl is rewritten from the checkpoint on, too: one line per sampled step (4, 8, 12).
    steps = [json.loads(line)["step"] for line in (workdir / "runs" / "again" / "telemetry.jsonl").open()]
    assert steps == [4, 8, 12]


def test_resuming_a_finished_run_keeps_its_results(workdir, runs, capsys):
    """A finished run resumed is "already complete": nothing is trained and no file changes (summary.json
    included), and its stored summary is returned."""
    shutil.copytree(workdir / "runs" / "straight", workdir / "runs" / "finished")  # run.name is not in the hash
    run_dir = workdir / "runs" / "finished"
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    again = train(cfg_of(workdir, "finished", "train.resume=true"), show_progress=False)
    assert "already complete" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert again["status"] == "completed" and again["steps"] == 12
    for key in ("loss", "val_loss", "fp8_state_sha256"):
        assert again[key] == runs["straight"][key]
    assert metrics_of(run_dir) == metrics_of(workdir / "runs" / "straight")


@pytest.mark.parametrize("warmup, horizon, factors", [
    # linear warmup: step s < warmup trains at (s + 1) / warmup of train.lr, reaching the full rate on its last
    # warmup step; then cosine from 1 at step `warmup` to min_lr_ratio (0.1) at `horizon`: halfway 0.55
    (4, 10, {0: 0.25, 1: 0.5, 2: 0.75, 3: 1.0, 4: 1.0, 7: 0.55, 10: 0.1, 11: 0.1, 50: 0.1}),
    (1, 5, {0: 1.0, 1: 1.0, 3: 0.55, 5: 0.1}),
    (0, 4, {0: 1.0, 2: 0.55, 4: 0.1}),  # no warmup: the cosine starts at step 0
])
def test_learning_rate_schedule_by_hand(warmup, horizon, factors):
    from fp8train.training.setup import lr_at

    cfg = load_config(None, [f"optim.warmup_steps={warmup}", "optim.min_lr_ratio=0.1"])
    assert {step: lr_at(step, cfg, horizon) for step in factors} == pytest.approx(factors, rel=1e-12, abs=0)


def test_logged_learning_rate_warms_up_then_decays(workdir, runs):
    """metrics.jsonl's `lr` at step k is the rate of the next step (k + 1): train.lr 3e-3, 2 warmup steps (steps
    1 and 2 train at 1.5e-3 and 3e-3), then cosine over steps 2..12 to 0.1 x 3e-3."""
    lrs = [r["lr"] for r in metrics_of(workdir / "runs" / "straight")]
    cosine = [3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (k - 2) / 10))) for k in range(2, 13)]
    assert lrs[:3] == pytest.approx([1.5e-3, 3e-3, 3e-3], rel=1e-12, abs=0)
    assert lrs[7] == pytest.approx(1.65e-3, rel=1e-12) and lrs[12] == pytest.approx(3e-4, rel=1e-12)
    assert lrs[2:] == pytest.approx(cosine, rel=1e-12, abs=0)


# ------------------------------------------------------------------------------------------------------------
# The run directory
# ------------------------------------------------------------------------------------------------------------
def test_run_dir_layout(workdir, runs):
    run_dir = workdir / "runs" / "straight"
    cfg = cfg_of(workdir, "straight")
    # config.yaml is the resolved config: it loads back to the same experiment.
    assert config_hash(load_config(str(run_dir / "config.yaml"))) == config_hash(cfg)
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["d_model"] == 64
    records = metrics_of(run_dir)
    assert [r["step"] for r in records] == list(range(13))
    for r in records[1:]:
        assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "skipped_steps"} <= r.keys()
        assert r["tokens_per_s"] > 0 and math.isfinite(r["loss"])
        assert ("val_loss" in r) == (r["step"] in (6, 12))
    assert "val_loss" in records[0]
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == \
        ["step_000004", "step_000008", "step_000012"]
    assert all(verify_checkpoint(p) is None for p in list_checkpoints(run_dir / "checkpoints"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == json.loads(json.dumps(runs["straight"], default=str))
    for key in ("loss", "val_loss", "steps", "world_size", "wall_time_s", "status", "fp8_state_sha256"):
        assert summary[key] is not None, key
    assert summary["world_size"] == 1 and summary["steps"] == 12 and summary["tokens"] == 12 * 8 * 32
    assert summary["last_good_checkpoint"].endswith("step_000012")
    assert summary["loss"] == records[-1]["loss"] and summary["val_loss"] == records[-1]["val_loss"]
    telemetry = [json.loads(line) for line in (run_dir / "telemetry.jsonl").open()]
    assert [t["step"] for t in telemetry] == [4, 8, 12]
    assert set(telemetry[0]["layers"]["layers.0.mlp.up_proj"]) == {"input", "weight", "grad_output"}


def test_existing_run_dir_is_not_overwritten(workdir, runs, capsys):
    run_dir = workdir / "runs" / "straight"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    with pytest.raises(FileExistsError, match="train.resume=true"):
        train(cfg_of(workdir, "straight"), show_progress=False)
    assert cli.main(["train", str(workdir / "tiny.yaml"), "run.name=straight", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a run" in err[0] and "train.resume=true" in err[0]
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_wandb_offline_writes_its_run_files(workdir, monkeypatch):
    """log.wandb=offline: wandb's offline-run folder lands under the run directory (no network). Also covers
    train.eval_every=0 (evaluate only at the end)."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(workdir / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    summary = train(cfg_of(workdir, "wandb", "log.wandb=offline", "fp8.recipe=none", "train.max_steps=2",
                           "train.eval_every=0", "checkpoint.every=0", "checkpoint.save_final=false"),
                    show_progress=False)
    assert summary["status"] == "completed"
    run_dir = workdir / "runs" / "wandb"
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir())
    assert list(offline[0].glob("run-*.wandb")), list(offline[0].iterdir())
    assert [("val_loss" in r) for r in metrics_of(run_dir)] == [True, False, True]


# ------------------------------------------------------------------------------------------------------------
# Failing early and clearly
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["short", "missing", "empty"])
def test_bad_corpus_fails_before_training(workdir, capsys, case):
    path = workdir / f"corpus-{case}.txt"
    if case == "short":
        path.write_text("too short for one sequence")  # 26 bytes < seq_len + 1 = 33
    elif case == "empty":
        path.write_text("")
    name = f"bad-{case}"
    with pytest.raises(ValueError, match="data.path"):
        train(cfg_of(workdir, name, f"data.path={path}"), show_progress=False)
    code = cli.main(["train", str(workdir / "tiny.yaml"), f"run.name={name}", f"data.path={path}", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data.path" in err[0] and str(path.name) in err[0], err
    assert not (workdir / "runs" / name).exists()  # nothing written: a corrected rerun just works


def test_batch_not_divisible_by_grad_accum_fails(workdir, capsys):
    code = cli.main(["train", str(workdir / "tiny.yaml"), "run.name=bad-accum", "train.grad_accum=3", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "train.batch_size" in err[0]


def test_unsupported_distributed_type_is_refused(workdir):
    from accelerate.utils import DistributedType

    class FsdpAccelerator:  # what accelerate's FSDP plugin would hand us on GPUs
        distributed_type = DistributedType.FSDP

    with pytest.raises(ValueError, match="FSDP"):
        train(cfg_of(workdir, "fsdp"), accelerator=FsdpAccelerator(), show_progress=False)
    assert not (workdir / "runs" / "fsdp").exists()


# ------------------------------------------------------------------------------------------------------------
# Divergence
# ------------------------------------------------------------------------------------------------------------
def _assert_last_good_checkpoint(run_dir: Path, summary: dict, expected_step: int) -> None:
    last_good = Path(summary["last_good_checkpoint"])
    assert last_good.name == f"step_{expected_step:06d}" and verify_checkpoint(last_good) is None
    weights = load_file(str(last_good / "model.safetensors"))
    assert all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    assert newest == last_good  # nothing was written at or after the failing step
    assert max(r["step"] for r in metrics_of(run_dir)) == summary["steps"]


def test_nan_loss_stops_with_step_telemetry_and_last_good_checkpoint(workdir):
    """From step 4 on, the first block's MLP outputs NaN (a test hook standing in for a model that blows up):
    the run stops at step 4, before applying it, with the layer telemetry of that step."""
    from fp8train.training.models.decoder import build_model

    def build_poisoned(model_cfg):
        model = build_model(model_cfg)
        calls = {"train": 0}

        def poison(module, args, output):
            if module.training:
                calls["train"] += 1
                if calls["train"] >= 4:
                    return output * float("nan")
            return None

        model.layers[0].mlp.register_forward_hook(poison)
        return model

    summary = train(cfg_of(workdir, "nan-loss", "checkpoint.every=1", "checkpoint.keep_last=2"), show_progress=False,
                    model_factory=build_poisoned)
    run_dir = workdir / "runs" / "nan-loss"
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 4 and summary["steps"] == 3
    assert summary["reason"] == "loss became nan at step 4"
    assert json.loads((run_dir / "summary.json").read_text())["reason"] == summary["reason"]
    _assert_last_good_checkpoint(run_dir, summary, 3)
    # Telemetry of the failing step: the NaN enters at block 1's inputs; block 0's attention is still clean.
    tele = summary["divergence_telemetry"]
    assert tele["layers.1.attn.q_proj"]["input"]["nonfinite"] is True
    assert tele["layers.0.attn.q_proj"]["input"]["nonfinite"] is False
    assert summary["fp8/input/nonfinite_amax_events"] > 0


@pytest.mark.parametrize("guard", [False, True])
def test_enormous_lr_diverges_and_keeps_last_good_checkpoint(workdir, guard):
    """A real blow-up: lr=100, no clipping. The first updates send the weights to ~1e2 and within a few steps the
    gradients are non-finite. WHICH step first overflows is the bf16 arithmetic of this CPU's GEMMs (step 2 on a
    2-core AVX2 or avx512_bf16 EPYC, step 8 on an AMX Xeon, fp8.recipe=none), so the test asserts what holds on
    any CPU: it diverges within DIVERGE_WITHIN steps; without the guard the run stops at the first non-finite
    step D, before applying it, with the checkpoint of step D - 1 as the last good one; with the guard that step
    and the next ones are skipped until MAX_CONSECUTIVE_SKIPS in a row prove the run is no longer training."""
    name = f"huge-lr-{guard}"
    summary = train(cfg_of(workdir, name, "train.lr=100", "train.grad_clip=0", "optim.warmup_steps=0",
                           "checkpoint.every=1", "checkpoint.keep_last=2", "fp8.recipe=none",
                           f"train.max_steps={DIVERGE_WITHIN + MAX_CONSECUTIVE_SKIPS}",
                           f"train.skip_nonfinite_grads={str(guard).lower()}", "train.eval_every=0"),
                    show_progress=False)
    run_dir = workdir / "runs" / name
    assert summary["status"] == "diverged"
    if not guard:
        first_bad = summary["diverged_at_step"]
        assert 2 <= first_bad <= DIVERGE_WITHIN
        assert summary["steps"] == first_bad - 1 and summary["skipped_steps"] == 0
        assert any(summary["reason"].startswith(f"{what} became {value} at step {first_bad}")
                   for what in ("gradient norm", "loss") for value in ("nan", "inf")), summary["reason"]
        _assert_last_good_checkpoint(run_dir, summary, first_bad - 1)
    else:
        last = summary["diverged_at_step"]
        first_bad = last - MAX_CONSECUTIVE_SKIPS + 1
        assert 2 <= first_bad <= DIVERGE_WITHIN and summary["skipped_steps"] == MAX_CONSECUTIVE_SKIPS - 1
        assert f"non-finite for {MAX_CONSECUTIVE_SKIPS} steps in a row" in summary["reason"]
        records = metrics_of(run_dir)
        # no skip before first_bad, then one more skipped step per step
        skipped = {r["step"]: r["skipped_steps"] for r in records if "skipped_steps" in r}  # (eval lines have none)
        assert [skipped[s] for s in range(1, last)] == [0] * (first_bad - 1) + list(range(1, last - first_bad + 1))
        _assert_last_good_checkpoint(run_dir, summary, last - 1)
        # The skipped steps changed nothing: the last two checkpoints hold the same (step 1) weights.
        a, b = (load_file(str(p / "model.safetensors")) for p in list_checkpoints(run_dir / "checkpoints"))
        assert all(torch.equal(a[k], b[k]) for k in a)
