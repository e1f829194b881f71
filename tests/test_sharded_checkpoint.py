"""Sharded checkpoints (train.parallel=fsdp2), in this process on a one-rank group; the 2-rank save, the
2 -> 1 and 1 -> 2 resumes and kill -9 during a save are in tests/test_fsdp2_multiprocess.py.

- what is on disk: safetensors shards (parsed here with safetensors itself), manifest.json and the COMPLETE
  marker; no pickle anywhere (no DCP .metadata, no .distcp);
- a sharded model's checkpoint loads into a plain model with exactly the weights and FP8 buffers it had, and
  back into a sharded model with its optimizer moments;
- a checkpoint without its marker, or with a corrupt shard, is skipped for the previous one; one missing a shard
  or made from another model is refused with one line naming the problem.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open

from fp8train.nn.convert import convert_to_fp8
from fp8train.training.parallel import fsdp2
from fp8train.training.runs.checkpoint import save_checkpoint
from fp8train.training.config import fp8_recipe_from_config, layer_policy_from_config, load_config
from fp8train.training.models.decoder import build_model
from fp8train.training.runs.checkpoint import latest_valid_checkpoint, load_checkpoint
from fp8train.training.runs.sharded_checkpoint import (COMPLETE_MARKER, MissingShardError, latest_loadable_checkpoint,
                                                  load_sharded_checkpoint, save_sharded_checkpoint,
                                                  verify_sharded_checkpoint)

from conftest import TINY_FSDP2_MODEL  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = TINY_FSDP2_MODEL
CPU = torch.device("cpu")


def _model(sharded: bool, overrides=(), seed: int = 0):
    cfg = load_config(None, [*TINY, "fp8.recipe=delayed", *overrides])
    torch.manual_seed(seed)
    model = build_model(cfg.model)
    convert_to_fp8(model, fp8_recipe_from_config(cfg), layer_policy_from_config(cfg))
    if sharded:
        fsdp2.apply_fsdp2(model, CPU)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _step(model, optimizer):
    x = torch.randint(0, 256, (2, 16))
    model(x, x)[1].backward()
    optimizer.step()
    optimizer.zero_grad()


def _full_state(model) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def _saved(tmp_path, steps=(1, 2)):
    model, optimizer = _model(sharded=True)
    states = {}
    for step in steps:
        _step(model, optimizer)
        save_sharded_checkpoint(tmp_path, step, model, optimizer, extra={"note": step})
        states[step] = _full_state(model)
    return model, optimizer, states


def test_files_are_safetensors_and_json_with_the_marker_last(one_rank_group, tmp_path):
    _saved(tmp_path, steps=(1,))
    ckpt = tmp_path / "step_000001"
    names = sorted(p.name for p in ckpt.iterdir())
    shards = [n for n in names if n.endswith(".safetensors")]
    assert names == sorted([COMPLETE_MARKER, "manifest.json", *shards]) and len(shards) == 1
    manifest = json.loads((ckpt / "manifest.json").read_text())
    stored = set()
    for shard in shards:
        with safe_open(str(ckpt / shard), "pt") as f:
            stored |= set(f.keys())
    assert stored == set(manifest["tensors"])
    assert "model.layers.0.attn.q_proj.weight_amax_history" in stored  # FP8 scaling state
    assert any(k.startswith("optim.") and k.endswith(".exp_avg_sq") for k in stored)
    assert manifest["step"] == 1 and manifest["world_size"] == 1 and manifest["extra"] == {"note": 1}
    assert not list(tmp_path.glob(".tmp-*"))


def test_sharded_checkpoint_loads_into_a_plain_model_and_back(one_rank_group, tmp_path):
    model, optimizer, states = _saved(tmp_path)
    plain, _ = _model(sharded=False, seed=1)
    load_sharded_checkpoint(tmp_path / "step_000002", plain)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, states[2][name]), name

    again, again_opt = _model(sharded=True, seed=2)
    manifest = load_sharded_checkpoint(tmp_path / "step_000002", again, again_opt)
    assert manifest["step"] == 2
    for name, value in _full_state(again).items():
        assert torch.equal(value, states[2][name]), name
    moments = {id(p): s for p, s in optimizer.state.items()}
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(again_opt.state[q]["exp_avg"].full_tensor(), moments[id(p)]["exp_avg"].full_tensor())
    assert again_opt.param_groups[0]["betas"] == optimizer.param_groups[0]["betas"]


def test_unfinished_or_corrupt_checkpoints_are_skipped(one_rank_group, tmp_path):
    _saved(tmp_path)
    newest = tmp_path / "step_000002"
    shard = next(newest.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the tensor data, same size
    shard.write_bytes(bytes(data))
    messages = []
    assert latest_valid_checkpoint(tmp_path, log=messages.append, verify=verify_sharded_checkpoint) == \
        tmp_path / "step_000001"
    assert "checksum mismatch" in messages[0]
    (newest / COMPLETE_MARKER).unlink()
    messages.clear()
    assert latest_loadable_checkpoint(tmp_path, log=messages.append) == tmp_path / "step_000001"
    assert "COMPLETE" in messages[0]


def test_missing_shard_is_refused_not_skipped(one_rank_group, tmp_path):
    _saved(tmp_path)
    next((tmp_path / "step_000002").glob("*.safetensors")).unlink()
    with pytest.raises(MissingShardError, match="missing shard file") as err:
        latest_loadable_checkpoint(tmp_path)
    assert "\n" not in str(err.value)
    plain, _ = _model(sharded=False)
    before = _full_state(plain)
    with pytest.raises(ValueError, match="missing shard"):
        load_sharded_checkpoint(tmp_path / "step_000002", plain)
    assert all(torch.equal(v, before[k]) for k, v in _full_state(plain).items())  # nothing loaded


@pytest.mark.parametrize("overrides, what", [(["model.d_model=128"], "embed.weight is \\(256, 64\\) there and \\(256, 128\\) here"),
                                             (["fp8.recipe=current"], "amax_history")])
def test_checkpoint_of_another_model_is_refused(one_rank_group, tmp_path, overrides, what):
    _saved(tmp_path, steps=(1,))
    other, other_opt = _model(sharded=True, overrides=overrides)
    with pytest.raises(ValueError, match=f"different model or FP8 recipe: .*{what}"):
        load_sharded_checkpoint(tmp_path / "step_000001", other, other_opt)


def test_ddp_format_is_found_by_the_same_function(tmp_path):
    model, optimizer = _model(sharded=False)
    _step(model, optimizer)
    path = save_checkpoint(tmp_path, 1, model, optimizer)
    plain, _ = _model(sharded=False, seed=3)
    load_checkpoint(path, plain)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in plain.state_dict().items())
    assert latest_loadable_checkpoint(tmp_path) == path


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("edit_step", [True, False])
def test_renamed_checkpoint_never_resumes_at_the_wrong_step(one_rank_group, tmp_path, edit_step):
    """step_000002 renamed step_000005, its manifest's (and marker's) step edited to 5 or not: it does not verify,
    so the newest checkpoint to resume from is step 1, and loading the renamed one is refused."""
    _saved(tmp_path)
    renamed = tmp_path / "step_000005"
    (tmp_path / "step_000002").rename(renamed)
    if edit_step:
        for name in ("manifest.json", COMPLETE_MARKER):
            record = json.loads((renamed / name).read_text())
            record["step"] = 5
            (renamed / name).write_text(json.dumps(record))
    messages = []
    assert latest_loadable_checkpoint(tmp_path, log=messages.append) == tmp_path / "step_000001"
    expected = "does not match its own checksum" if edit_step else "says step 2, but the folder is step_000005"
    assert len(messages) == 1 and expected in messages[0] and "step_000005" in messages[0], messages
    model, optimizer = _model(sharded=True)
    with pytest.raises(ValueError, match=expected):
        load_sharded_checkpoint(renamed, model, optimizer)


def test_edited_manifest_does_not_verify(one_rank_group, tmp_path):
    _saved(tmp_path, steps=(1,))
    manifest_path = tmp_path / "step_000001" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["extra"]["note"] = 7
    manifest_path.write_text(json.dumps(manifest))
    assert "own checksum" in verify_sharded_checkpoint(tmp_path / "step_000001")


def test_pruning_counts_only_checkpoints_that_verify_and_keeps_the_resumed_one(one_rank_group, tmp_path):
    """A corrupt newer "step" folder (a copy of step 2 with a flipped byte, renamed step 9) and keep_last=1: the
    save of step 3 keeps step 3 (newest that verifies) and step 1 (the one resumed from), removes step 2, and
    leaves the corrupt folder for inspection."""
    model, optimizer = _model(sharded=True)
    for step in (1, 2):
        _step(model, optimizer)
        save_sharded_checkpoint(tmp_path, step, model, optimizer, keep_last=0)
    shutil.copytree(tmp_path / "step_000002", tmp_path / "step_000009")
    _flip_a_byte(next((tmp_path / "step_000009").glob("*.safetensors")))
    _step(model, optimizer)
    pruned = []
    save_sharded_checkpoint(tmp_path, 3, model, optimizer, keep_last=1, protect=[tmp_path / "step_000001"],
                            log=pruned.append)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000003", "step_000009"]
    assert len(pruned) == 1 and "step_000002" in pruned[0]
    assert verify_sharded_checkpoint(tmp_path / "step_000003") is None


def test_pruning_keeps_a_checkpoint_missing_a_shard_uncounted(one_rank_group, tmp_path):
    model, optimizer = _model(sharded=True)
    for step in (1, 2):
        _step(model, optimizer)
        save_sharded_checkpoint(tmp_path, step, model, optimizer, keep_last=0)
    next((tmp_path / "step_000002").glob("*.safetensors")).unlink()  # lost data: never counted as good
    _step(model, optimizer)
    save_sharded_checkpoint(tmp_path, 3, model, optimizer, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000002", "step_000003"]
