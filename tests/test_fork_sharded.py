"""A fork of a sharded checkpoint is refused naming what sharded it, as the checkpoint records it (its manifest's
train.parallel and train.tp_size): an FSDP2 run's (one process, in this process) and a tensor-parallel run's
(train.tp_size=2 under train.parallel=ddp: a real 2-process `accelerate launch`), under train.fork_from and
validate.fork_from alike, before anything is written. The reference is the source run's own config.yaml and the
checkpoint folder it left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fp8train.cli import main
from fp8train.training.runs.fork import resolve_fork_checkpoint
from refs import write_stdlib_corpus

pytestmark = [pytest.mark.usefixtures("single_thread")]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train.py"
TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.batch_size=8",
        "train.eval_batches=1", "train.eval_every=2", "optim.warmup_steps=1", "policy.min_features=16",
        "log.wandb=disabled", "log.telemetry_every=0", "train.device=cpu", "train.max_steps=2", "checkpoint.every=2",
        "fp8.recipe=delayed"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    write_stdlib_corpus(path)
    return str(path)


def _refusals(capsys, tmp_path, corpus, source: Path) -> list[str]:
    """The refusal of `source` as train.fork_from (the train command, exit 2, one line, nothing written) and as
    validate.fork_from (resolved under that key)."""
    code = main(["train", "recipes/cpu_delayed.yaml", *TINY, f"data.path={corpus}", f"run.dir={tmp_path}",
                 "run.name=fork", "--quiet", f"train.fork_from={source}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert not (tmp_path / "fork").exists()
    with pytest.raises(ValueError) as caught:
        resolve_fork_checkpoint(str(source), "validate.fork_from")
    return [err[0], str(caught.value)]


def test_an_fsdp2_checkpoint_is_refused_as_one(capsys, tmp_path, corpus):
    assert main(["train", "recipes/cpu_delayed.yaml", *TINY, f"data.path={corpus}", f"run.dir={tmp_path}",
                 "run.name=src", "--quiet", "train.parallel=fsdp2"]) == 0
    capsys.readouterr()  # its summary line
    source = tmp_path / "src"
    config = yaml.safe_load((source / "config.yaml").read_text())["train"]
    assert (config["parallel"], config["tp_size"]) == ("fsdp2", 1)
    for message, key in zip(_refusals(capsys, tmp_path, corpus, source), ("train.fork_from", "validate.fork_from")):
        assert message.split("error: ", 1)[-1].startswith(f"{key}={source}: "), message
        assert "is a sharded (train.parallel=fsdp2, per its manifest) checkpoint" in message
        assert "tensor-parallel" not in message and "train.parallel=ddp and train.tp_size=1" in message


@pytest.mark.extended  # a 2-process launch (~17 s): with CI's other tensor-parallel tests
def test_a_tensor_parallel_checkpoint_is_refused_naming_tp_size_not_fsdp2(capsys, tmp_path, corpus, commands):
    argv = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(SCRIPT),
            "--config", "recipes/cpu_delayed.yaml", *TINY, f"data.path={corpus}", f"run.dir={tmp_path}",
            "run.name=tp2", "--quiet", "train.tp_size=2", "train.threads=1"]
    done = subprocess.run(argv, env=commands.launch_env(tmp_path / "hf"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, commands.launch_failure(done.returncode, done.stdout, done.stderr)
    source = tmp_path / "tp2"
    config = yaml.safe_load((source / "config.yaml").read_text())["train"]
    assert (config["parallel"], config["tp_size"]) == ("ddp", 2)  # ddp: the old message blamed fsdp2
    manifest = json.loads((source / "checkpoints" / "step_000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    for message in _refusals(capsys, tmp_path, corpus, source):
        assert ("is a tensor-parallel checkpoint (train.tp_size=2, train.parallel=ddp, per its manifest): its "
                "weights are split across the 2 processes that wrote it") in message, message
        assert "fsdp2" not in message and "train.parallel=ddp and train.tp_size=1" in message
