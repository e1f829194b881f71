"""train.parallel=fsdp2 from the command line, in one process (fp8train makes a one-rank group itself):
bad input exits 2 with one line and writes nothing, `fp8train validate` reaches the same verdict under fsdp2
as under ddp, and export and kv-eval read sharded checkpoints. The 2-process claims are in tests/test_fsdp2_multiprocess.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from fp8train.cli import main
from fp8train.evidence.validate import run_validation
from fp8train.training.config import load_config
from fp8train.training.parallel.distributed import check_launch_settings
from refs import write_stdlib_corpus

pytestmark = [pytest.mark.usefixtures("single_thread")]

TINY = ["model.d_model=64", "model.n_layers=2", "model.n_heads=2", "model.seq_len=32", "train.batch_size=8",
        "train.eval_batches=2", "optim.warmup_steps=2", "policy.min_features=16", "log.wandb=disabled",
        "log.telemetry_every=0", "train.device=cpu"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    write_stdlib_corpus(path)
    return str(path)


def _train(capsys, tmp_path, corpus, *overrides):
    code = main(["train", "recipes/cpu_delayed.yaml", *TINY, f"data.path={corpus}", f"run.dir={tmp_path}",
                 "run.name=r", "--quiet", *overrides])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("overrides, named", [
    (["train.parallel=fsdp2", "fp8.all_gather=true", "fp8.recipe=rowwise"], "fp8.all_gather"),
    (["train.parallel=fsdp2", "fp8.all_gather=true", "fp8.recipe=none"], "fp8.all_gather"),
    (["fp8.all_gather=true"], "train.parallel=fsdp2"),
    (["train.parallel=zero3"], "train.parallel"),
])
def test_bad_parallel_settings_exit_2_in_one_line_before_anything_is_written(capsys, tmp_path, corpus,
                                                                              overrides, named):
    code, err = _train(capsys, tmp_path, corpus, *overrides)
    assert code == 2 and len(err) == 1 and named in err[0], err
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_missing_shard_on_resume_exits_2_and_changes_nothing(capsys, tmp_path, corpus):
    code, _ = _train(capsys, tmp_path, corpus, "train.parallel=fsdp2", "train.max_steps=4", "checkpoint.every=2")
    assert code == 0
    run = tmp_path / "r"
    shard = next((run / "checkpoints" / "step_000004").glob("shard-*.safetensors"))
    shard.unlink()
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    code, err = _train(capsys, tmp_path, corpus, "train.parallel=fsdp2", "train.max_steps=6",
                       "checkpoint.every=2", "train.resume=true")
    assert code == 2 and len(err) == 1 and "missing shard file" in err[0] and shard.name in err[0], err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_resume_skips_a_renamed_checkpoint_and_pruning_keeps_the_resumed_one(capsys, tmp_path, corpus):
    """A run with keep_last=1 holds step 4; beside it, a copy renamed step 7 with its manifest's step edited to 7
    and a corrupt copy named step 9. The resume skips both (naming why), continues from step 4, and pruning
    keeps step 4 (resumed from) and the newest good one, never counting the broken folders (left in place)."""
    ckpt = ["train.parallel=fsdp2", "checkpoint.every=2", "checkpoint.keep_last=1", "log.every=1"]
    assert _train(capsys, tmp_path, corpus, *ckpt, "train.max_steps=4")[0] == 0
    checkpoints = tmp_path / "r" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004"]
    renamed, corrupt = checkpoints / "step_000007", checkpoints / "step_000009"
    shutil.copytree(checkpoints / "step_000004", renamed)
    for name in ("manifest.json", "COMPLETE"):
        record = json.loads((renamed / name).read_text())
        record["step"] = 7
        (renamed / name).write_text(json.dumps(record))
    shutil.copytree(checkpoints / "step_000004", corrupt)
    shard = next(corrupt.glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    code, err = _train(capsys, tmp_path, corpus, *ckpt, "train.max_steps=8", "train.resume=true")
    assert code == 0, err
    text = "\n".join(err)
    assert f"skipping checkpoint {corrupt}: manifest.json says step 4, but the folder is step_000009" in text
    assert f"skipping checkpoint {renamed}: manifest.json does not match its own checksum" in text
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["resumed_from"] == str(checkpoints / "step_000004") and summary["steps"] == 8
    steps = [json.loads(line)["step"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-4:] == [5, 6, 7, 8]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000004", "step_000007", "step_000008",
                                                             "step_000009"]


@pytest.mark.slow
def test_validate_verdict_does_not_change_under_fsdp2(tmp_path, corpus):
    verdicts = {}
    for parallel in ("ddp", "fsdp2"):
        cfg = load_config(None, [*TINY, f"data.path={corpus}", f"run.dir={tmp_path / parallel}", "run.name=v",
                                 "train.max_steps=20", "train.eval_every=10", "log.every=5",
                                 "validate.margin=0.05", "validate.final_window=2", "validate.seeds=2",
                                 f"train.parallel={parallel}"])
        summary = run_validation(cfg, candidates=["current"], show_progress=False)
        verdicts[parallel] = (summary["verdict"], {k: (v.get("verdict", v.get("pass")), v.get("gap_mean",
                                                       v.get("gap_rel"))) for k, v in summary["candidates"].items()})
        runs = tmp_path / parallel / "v" / "runs"
        assert all(json.loads((d / "summary.json").read_text())["status"] == "completed" for d in runs.glob("*/seed*"))
        assert any((runs / "current" / "seed1337" / "checkpoints").glob("*/COMPLETE")) == (parallel == "fsdp2")
    assert verdicts["fsdp2"] == verdicts["ddp"]


@pytest.mark.slow
def test_export_and_kv_eval_read_sharded_checkpoints(capsys, tmp_path, corpus):
    """One process trains the same run twice, ddp and fsdp2 (bit for bit the same training at world size 1):
    the export of the sharded checkpoint holds exactly the tensors of the DDP checkpoint's export, and kv-eval
    measures the same."""
    for parallel in ("ddp", "fsdp2"):
        code = main(["train", "recipes/cpu_delayed.yaml", *TINY, f"data.path={corpus}", f"run.dir={tmp_path}",
                     f"run.name={parallel}", "train.max_steps=4", f"train.parallel={parallel}", "--quiet"])
        assert code == 0
        assert main(["export", str(tmp_path / parallel), "--format", "e4m3fn", "--out",
                     str(tmp_path / f"export_{parallel}")]) == 0
        assert main(["kv-eval", str(tmp_path / parallel), "--out", str(tmp_path / f"kv_{parallel}"), "--format",
                     "e4m3fn", "--batches", "1", "--calib-batches", "1", "--gen-prompts", "2",
                     "--gen-tokens", "4"]) == 0
    capsys.readouterr()
    assert any((tmp_path / "fsdp2" / "checkpoints").glob("*/COMPLETE"))
    exports = {p: {f.name: f for f in (tmp_path / f"export_{p}").glob("*.safetensors")} for p in ("ddp", "fsdp2")}
    assert exports["ddp"].keys() == exports["fsdp2"].keys() and exports["ddp"]
    for name, path in exports["ddp"].items():
        with safe_open(str(path), "pt") as a, safe_open(str(exports["fsdp2"][name]), "pt") as b:
            assert set(a.keys()) == set(b.keys())
            for key in a.keys():
                assert torch.equal(a.get_tensor(key).view(torch.uint8), b.get_tensor(key).view(torch.uint8)), key
    cells = {p: json.loads((tmp_path / f"kv_{p}" / "kv_eval.json").read_text())["cells"] for p in ("ddp", "fsdp2")}
    assert cells["ddp"] == cells["fsdp2"]


def test_accelerate_fsdp_plugin_is_accepted_only_with_fsdp2():
    env = {"ACCELERATE_USE_FSDP": "true"}
    check_launch_settings(load_config(None, ["train.parallel=fsdp2"]), env)  # fp8train shards it itself
    with pytest.raises(ValueError, match="train.parallel=fsdp2"):
        check_launch_settings(load_config(None, []), env)
    with pytest.raises(ValueError, match="DeepSpeed"):
        check_launch_settings(load_config(None, ["train.parallel=fsdp2"]), {"ACCELERATE_USE_DEEPSPEED": "true"})
