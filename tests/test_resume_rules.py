"""Resume rules and trackers, in-process on CPU with REAL wandb offline files and REAL TensorBoard event files.

- schedule-only keys (train.max_steps, train.eval_every) may change on resume: a finished 4-step run extended to 6
  steps continues from its final checkpoint, with the learning rate held at its final value (the documented
  rule: the schedule of the first run, then min_lr_ratio * lr);
- any other change is refused naming the key, the run's value and the new one, and nothing is written;
- train.resume=true without a checkpoint is refused; train.resume=auto starts; train.max_steps below the
  checkpoint's step is refused;
- a resumed run is one wandb run (the id in trackers.json is reused); every tracker gets step 0's validation
  loss, the resolved recipe fields, the conversion report and the model config.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import yaml

from fp8train.training.config import load_config
from fp8train.training.loop import train
from refs import write_stdlib_corpus

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]

LR, MIN_LR_RATIO, WARMUP = 3e-3, 0.1, 1
TINY = {
    "model": {"n_layers": 1, "d_model": 64, "n_heads": 2, "seq_len": 16},
    "train": {"max_steps": 4, "batch_size": 4, "eval_every": 2, "eval_batches": 1, "lr": LR, "device": "cpu",
              "autocast": "none"},
    "optim": {"warmup_steps": WARMUP, "min_lr_ratio": MIN_LR_RATIO},
    "fp8": {"recipe": "delayed"},
    "policy": {"min_features": 16},
    "log": {"wandb": "disabled", "every": 1, "telemetry_every": 0},
    "checkpoint": {"every": 2, "keep_last": 0},
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("resume_rules")
    write_stdlib_corpus(root / "corpus.txt")
    config = {**TINY, "run": {"dir": str(root / "runs"), "name": "base"}, "data": {"path": str(root / "corpus.txt")}}
    (root / "tiny.yaml").write_text(yaml.safe_dump(config))
    return root


@pytest.fixture
def wandb_home(workdir, monkeypatch):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(workdir / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


def cfg_of(workdir: Path, name: str, *overrides: str):
    return load_config(str(workdir / "tiny.yaml"), [f"run.name={name}", *overrides])


def metrics_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def files_of(run_dir: Path) -> dict:
    """Every file of the run with its bytes, except those in wandb's folder (wandb's service may still be
    flushing them after the run has finished; the offline runs are counted instead)."""
    return {p: p.read_bytes() for p in run_dir.rglob("*")
            if p.is_file() and "wandb" not in p.relative_to(run_dir).parts}


# ---- reading wandb's offline run file: LevelDB-style log of protobuf Records (wandb's own format) -----------
def wandb_records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", path
    chunks, pending, pos = [], b"", header  # a file header (":W&B", magic, version), then records
    while pos + header <= len(data):
        if block - pos % block < header:  # too little room left in the block for a record header: padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + header])
        if kind == 0:
            break
        payload, pos = data[pos + header:pos + header + length], pos + header + length
        if kind == 1:  # full
            chunks.append(payload)
        elif kind == 2:  # first
            pending = payload
        elif kind == 3:  # middle
            pending += payload
        else:  # last
            chunks.append(pending + payload)
    return [pb.Record.FromString(c) for c in chunks]


def wandb_history(path: Path) -> dict[int, dict]:
    steps: dict[int, dict] = {}
    for record in wandb_records(path):
        if record.HasField("history"):
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            step = int(items.get("_step", record.history.step.num))
            steps.setdefault(step, {}).update(items)
    return steps


def wandb_config(path: Path) -> dict:
    config: dict = {}
    for record in wandb_records(path):
        if record.HasField("config"):
            for item in record.config.update:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


# ------------------------------------------------------------------------------------------------------------
def test_max_steps_may_grow_on_resume_and_the_schedule_holds_its_final_rate(workdir, wandb_home):
    trackers = ["log.wandb=offline", "log.trackers=[wandb,tensorboard]"]
    first = train(cfg_of(workdir, "grow", *trackers), show_progress=False)
    run_dir = workdir / "runs" / "grow"
    assert first["status"] == "completed" and first["steps"] == 4
    before = metrics_of(run_dir)

    grown = train(cfg_of(workdir, "grow", *trackers, "train.resume=true", "train.max_steps=6", "train.eval_every=3"),
                  show_progress=False)
    assert grown["status"] == "completed" and grown["steps"] == 6
    assert grown["resumed_from"].endswith("step_000004")
    after = metrics_of(run_dir)
    assert [r["step"] for r in after] == list(range(7))
    assert after[:5] == before  # the first run's lines are kept as they were
    # Hand-computed schedule: warmup 1 step, cosine over the first run's 4 steps to 0.1 * lr, then held there.
    cosine = [MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * (s - WARMUP) / (4 - WARMUP)))
              for s in range(1, 5)]
    assert [r["lr"] for r in after[1:5]] == pytest.approx([LR * c for c in cosine], rel=1e-12)
    assert [r["lr"] for r in after[5:]] == pytest.approx([LR * MIN_LR_RATIO] * 2, rel=1e-12)
    assert [r["step"] for r in after if r.get("val_loss") is not None] == [0, 2, 4, 6]  # eval_every=3 from 4 on
    # Both runs' checkpoints name the same experiment (resume_hash) under different full configs (config_hash).
    extras = [json.loads((run_dir / "checkpoints" / f"step_00000{s}" / "manifest.json").read_text())["extra"]
              for s in (4, 6)]
    assert extras[0]["resume_hash"] == extras[1]["resume_hash"]
    assert extras[0]["config_hash"] != extras[1]["config_hash"]
    assert extras[0]["lr_schedule_steps"] == extras[1]["lr_schedule_steps"] == 4

    # One wandb run: both offline folders hold the run file of the id stored in trackers.json. (The folder name is
    # not the test: wandb names it by the second it started and appends "-1" when two starts share that second.)
    run_id = json.loads((run_dir / "trackers.json").read_text())["wandb_run_id"]
    folders = offline_runs(run_dir)
    assert len(folders) == 2 and all([p.name for p in f.glob("run-*.wandb")] == [f"run-{run_id}.wandb"]
                                     for f in folders), folders
    first_file = next(folders[0].glob("run-*.wandb"))
    history = wandb_history(first_file)
    assert history[0]["val_loss"] == pytest.approx(before[0]["val_loss"], rel=1e-6)  # step 0 reached wandb
    assert history[4]["loss"] == pytest.approx(before[4]["loss"], rel=1e-6)
    config = wandb_config(first_file)
    fp8 = config["fp8"]["value"] if "value" in config["fp8"] else config["fp8"]
    # Resolved recipe fields (the delayed preset's), not the nulls that mean "preset default".
    assert (fp8["margin"], fp8["amax_history_len"], fp8["grad_output_format"]) == (0, 1024, "e5m2")
    conversion = config["conversion"].get("value", config["conversion"])
    assert "layers.0.attn.q_proj" in [name for name, _ in conversion["converted"]]
    assert "lm_head" in [name for name, _ in conversion["skipped"]]
    model_config = config["model_config"].get("value", config["model_config"])
    assert model_config["d_model"] == 64 and model_config["ffn_dim"] == 176

    # TensorBoard got the same lines, step 0's validation loss included.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars = {}
    for events in sorted((run_dir / "tensorboard").rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    assert scalars["val_loss"][0] == pytest.approx(before[0]["val_loss"], rel=1e-6)
    assert sorted(scalars["loss"]) == [1, 2, 3, 4, 5, 6]


def test_a_refused_change_names_key_old_and_new_value(workdir):
    train(cfg_of(workdir, "refuse"), show_progress=False)
    run_dir = workdir / "runs" / "refuse"
    before = files_of(run_dir)
    with pytest.raises(ValueError) as err:
        train(cfg_of(workdir, "refuse", "train.resume=true", "train.lr=0.001", "train.max_steps=8"),
              show_progress=False)
    message = str(err.value)
    assert "train.lr" in message and "0.003" in message and "0.001" in message
    assert "train.max_steps" not in message.split("Only")[0]  # a schedule key is not a refused change
    assert files_of(run_dir) == before


def test_resume_true_needs_a_checkpoint_and_auto_starts(workdir):
    run_dir = workdir / "runs" / "fresh"
    with pytest.raises(ValueError, match=r"train.resume=true .* no valid checkpoint.*train.resume=auto"):
        train(cfg_of(workdir, "fresh", "train.resume=true"), show_progress=False)
    assert not run_dir.exists()
    summary = train(cfg_of(workdir, "fresh", "train.resume=auto"), show_progress=False)
    assert summary["status"] == "completed" and summary["resumed_from"] is None and summary["steps"] == 4
    # auto on a run with checkpoints resumes it (here: it is complete, so nothing changes)
    before = files_of(run_dir)
    again = train(cfg_of(workdir, "fresh", "train.resume=auto"), show_progress=False)
    assert again == json.loads((run_dir / "summary.json").read_text()) and files_of(run_dir) == before


def test_max_steps_below_the_checkpoint_is_refused(workdir):
    train(cfg_of(workdir, "shrink"), show_progress=False)
    run_dir = workdir / "runs" / "shrink"
    before = files_of(run_dir)
    with pytest.raises(ValueError, match=r"train.max_steps=3 is below the step of the checkpoint .*step 4"):
        train(cfg_of(workdir, "shrink", "train.resume=true", "train.max_steps=3"), show_progress=False)
    assert files_of(run_dir) == before


def test_finished_run_opens_no_new_wandb_run(workdir, wandb_home, capsys):
    train(cfg_of(workdir, "done", "log.wandb=offline"), show_progress=False)
    run_dir = workdir / "runs" / "done"
    before = files_of(run_dir)
    train(cfg_of(workdir, "done", "log.wandb=offline", "train.resume=true"), show_progress=False)
    assert "already complete" in capsys.readouterr().err
    assert files_of(run_dir) == before and len(offline_runs(run_dir)) == 1
