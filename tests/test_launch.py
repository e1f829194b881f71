"""What accelerate users do, for real: `accelerate launch` of scripts/train.py (2 gloo CPU processes), accelerate
config files and flags that fp8train cannot honour, and the command line's shape and exit statuses.

- README's 2-process command exits 0 with the default wandb offline tracker (it used to train to the end and
  then fail in every rank: accelerate's end_training destroyed the process group before the last barrier);
- an accelerate config with FSDP (on CPU, where accelerate itself would silently run DDP) and `--mixed_precision
  fp8` (as the launcher exports it) are refused with a message before anything is written; the other
  --mixed_precision values by rule;
- an internal error exits 1 with its traceback in a log file whose path is printed; a ValueError raised inside
  torch is internal too; user errors keep exit 2;
- `fp8train train --config PATH` works like the positional form, `--quiet` keeps the one-line summary, and the
  help says what is required and what is optional.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import fp8train.training.loop as loop_module
from fp8train import cli
from fp8train.training.config import load_config
from fp8train.training.parallel.distributed import check_launch_settings

pytestmark = [pytest.mark.usefixtures("single_thread")]

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train.py"
SECTIONS = dict(model={"n_layers": 1, "seq_len": 16},
                train={"max_steps": 4, "batch_size": 4, "eval_every": 2, "autocast": "none", "threads": 1},
                optim={"warmup_steps": 1}, log={"telemetry_every": 0}, checkpoint={"every": 0, "save_final": False})
SUMMARY_LINE = re.compile(r"^\[(\w+)\] completed: 4 steps, val_loss \d+\.\d{4}, \d+\.\ds, recipe delayed:")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny) -> Path:
    root = tmp_path_factory.mktemp("launch")
    tiny.write(root, **SECTIONS)
    return root


def launch(commands, root: Path, accelerate_args: list[str], *script_args: str) -> subprocess.CompletedProcess:
    """`accelerate launch ACCELERATE_ARGS scripts/train.py SCRIPT_ARGS` on CPU processes, wandb files kept in the
    test's folder; conftest's launch_env: no user accelerate config is read, and the rendezvous port comes from
    torch's own store (no port is probed and released)."""
    wandb_home = str(root / "wandb-home")
    env = commands.launch_env(root / "hf", WANDB_CONFIG_DIR=wandb_home, WANDB_CACHE_DIR=wandb_home,
                              WANDB_DATA_DIR=wandb_home, WANDB_SILENT="true")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args, str(SCRIPT), *script_args]
    return commands.run(cmd, env=env, timeout=300)


# ------------------------------------------------------------------------------------------------------------
# Real launches
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_processes_with_wandb_offline_exit_0(workdir, commands):
    proc = launch(commands, workdir, ["--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                                      "--mixed_precision", "no", "--dynamo_backend", "no"],
                  "--config", str(workdir / "tiny.yaml"), "run.name=two", "log.wandb=offline", "--quiet")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "process group" not in proc.stderr
    assert "asked for several processes but started 1" not in proc.stderr  # it did start 2
    run_dir = workdir / "runs" / "two"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 4
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb")), list((run_dir / "wandb").iterdir())
    lines = [line for line in proc.stderr.splitlines() if SUMMARY_LINE.match(line)]
    assert len(lines) == 1 and lines[0].startswith("[two]"), proc.stderr  # --quiet keeps it; rank 0 only


ACCELERATE_FSDP_CONFIG = {
    "compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "use_cpu": True, "num_machines": 1,
    "num_processes": 2, "machine_rank": 0, "mixed_precision": "no", "main_training_function": "main",
    "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_auto_wrap_policy": "NO_WRAP",
                    "fsdp_state_dict_type": "FULL_STATE_DICT", "fsdp_version": 1},
}


@pytest.mark.slow
def test_accelerate_fsdp_config_is_refused(workdir, commands):
    config_file = workdir / "accelerate_fsdp.yaml"
    config_file.write_text(yaml.safe_dump(ACCELERATE_FSDP_CONFIG))
    proc = launch(commands, workdir, ["--config_file", str(config_file)], "--config", str(workdir / "tiny.yaml"),
                  "run.name=fsdp")
    assert proc.returncode != 0
    refusals = [line for line in proc.stderr.splitlines() if line.startswith("fp8train train: error:")]
    assert refusals and all("FSDP" in line and "--multi_gpu" in line for line in refusals), proc.stderr[-3000:]
    assert not (workdir / "runs" / "fsdp").exists()


@pytest.mark.slow
def test_accelerate_mixed_precision_fp8_is_refused(workdir, commands):
    """On this machine (no TransformerEngine, MS-AMP or torchao) `accelerate launch --mixed_precision fp8` stops in
    the launcher itself; where one is installed the launcher exports ACCELERATE_MIXED_PRECISION=fp8 to the script,
    which is what this process gets."""
    proc = commands.run([sys.executable, str(SCRIPT), "--config", str(workdir / "tiny.yaml"), "run.name=mp_fp8"],
                        env=commands.env(ACCELERATE_MIXED_PRECISION="fp8"))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith("fp8train train: error: accelerate --mixed_precision fp8")
    assert "fp8train is the FP8 layer" in err[0] and "fp8.recipe" in err[0]
    assert not (workdir / "runs" / "mp_fp8").exists()


@pytest.mark.parametrize("env, autocast, refused", [
    ({}, "bf16", None), ({"ACCELERATE_MIXED_PRECISION": "no"}, "none", None),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "bf16", None),
    ({"ACCELERATE_MIXED_PRECISION": "bf16"}, "none", "train.autocast=none"),
    ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "bf16", "fp16 is not supported"),
    ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "bf16", "fp8train is the FP8 layer"),
    ({"ACCELERATE_USE_FSDP": "true"}, "bf16", "FSDP"),
    ({"ACCELERATE_USE_DEEPSPEED": "true"}, "bf16", "DeepSpeed"),
])
def test_launcher_settings_are_honoured_or_refused(env, autocast, refused):
    cfg = load_config(None, [f"train.autocast={autocast}"])
    if refused is None:
        check_launch_settings(cfg, env)
    else:
        with pytest.raises(ValueError, match=re.escape(refused)):
            check_launch_settings(cfg, env)


# ------------------------------------------------------------------------------------------------------------
# Exit statuses: internal errors are internal
# ------------------------------------------------------------------------------------------------------------
def _barrier_without_a_process_group(*args, **kwargs):
    torch.distributed.barrier()  # ValueError from torch: "Default process group has not been initialized"


def _bug(*args, **kwargs):
    raise RuntimeError("an fp8train bug")


@pytest.mark.slow
@pytest.mark.parametrize("broken, text", [(_bug, "RuntimeError: an fp8train bug"),
                                          (_barrier_without_a_process_group, "ValueError: Default process group")])
def test_internal_error_exits_1_with_its_traceback_in_a_log(workdir, monkeypatch, capsys, broken, text):
    monkeypatch.setattr(loop_module, "summarize", broken)
    code = cli.main(["train", str(workdir / "tiny.yaml"), f"run.name=bug{len(text)}", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("fp8train train: internal error") and text in err[0]
    log = Path(err[0].rsplit("traceback written to ", 1)[1])
    trace = log.read_text()
    assert "Traceback (most recent call last)" in trace and text.split(": ")[1] in trace
    log.unlink()


def test_user_error_keeps_exit_2(workdir, capsys):
    assert cli.main(["train", str(workdir / "tiny.yaml"), "train.lr=-1", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fp8train train: error: config train.lr=-1")


# ------------------------------------------------------------------------------------------------------------
# The command line's shape
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("form", ["positional", "option", "option_last"])
def test_config_as_option_or_positional_and_quiet_keeps_the_summary(workdir, capsys, form):
    config, name = str(workdir / "tiny.yaml"), f"run.name=form_{form}"
    argv = {"positional": ["train", config, name, "--quiet"],
            "option": ["train", "--config", config, name, "--quiet"],
            "option_last": ["train", name, "--quiet", "--config", config]}[form]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and SUMMARY_LINE.match(err[0]) and err[0].startswith(f"[form_{form}]"), err
    assert json.loads((workdir / "runs" / f"form_{form}" / "summary.json").read_text())["steps"] == 4


@pytest.mark.parametrize("argv, message", [
    (["train"], "the following arguments are required: config"),
    (["train", "a.yaml", "--config", "b.yaml"], "the config YAML is given twice"),
])
def test_config_missing_or_twice_is_a_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "usage: fp8train train" in err
    assert "overrides are optional" in err or "twice" in err


@pytest.mark.parametrize("command", ["train", "validate"])
def test_help_says_what_is_required_and_what_is_optional(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "recipe YAML (required, here or as --config)" in text
    assert "optional overrides" in text and "--quiet optional:" in text
