"""Checkpoints: an exact round trip of weights, FP8 scaling state, optimizer and scheduler; atomic writes; and every
kind of damage (truncated, corrupt, missing or garbled manifest) detected, named and skipped in favour of the previous
checkpoint, never loaded and never a traceback."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fp8train.training.runs.checkpoint import (MANIFEST, latest_valid_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint,
                                 verify_checkpoint)
from fp8train.nn.linear import Fp8Linear, update_fp8_scales

pytestmark = pytest.mark.usefixtures("single_thread")


class Tiny(nn.Module):
    """Two delayed-scaling Fp8Linears, a norm and a tied embedding/head (safetensors stores tied weights once)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.fc1 = Fp8Linear(16, 32, recipe="delayed")
        self.fc2 = Fp8Linear(32, 16, bias=False, recipe="delayed")
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        return self.head(self.norm(self.fc2(torch.relu(self.fc1(self.embed(idx))))))


def trained(seed: int = 0, steps: int = 3):
    torch.manual_seed(seed)
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    for _ in range(steps):
        idx = torch.randint(0, 32, (4, 8))
        loss = nn.functional.cross_entropy(model(idx).reshape(-1, 32), idx.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        update_fp8_scales(model)
    return model, optimizer, scheduler


def test_round_trip_is_exact_and_includes_fp8_state(tmp_path):
    model, optimizer, scheduler = trained()
    path = save_checkpoint(tmp_path, 3, model, optimizer, scheduler, extra={"note": "x"})
    assert path.name == "step_000003" and verify_checkpoint(path) is None
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST, "model.safetensors", "optimizer.safetensors"]
    fresh, fresh_opt, fresh_sched = trained(seed=1, steps=1)
    manifest = load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    assert manifest["step"] == 3 and manifest["extra"] == {"note": "x"}
    for (name, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    assert fresh.head.weight is fresh.embed.weight  # still tied
    assert int(fresh.fc1.input_initialized) == 1 and float(fresh.fc1.input_amax_history[0]) > 0
    assert fresh_sched.state_dict()["last_epoch"] == 3 and fresh_sched.get_last_lr() == scheduler.get_last_lr()
    a, b = optimizer.state_dict(), fresh_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for index, state in a["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][index][key])), (index, key)
    # And training on from either gives the same next step.
    for m, o in ((model, optimizer), (fresh, fresh_opt)):
        idx = torch.arange(32).reshape(4, 8)
        nn.functional.cross_entropy(m(idx).reshape(-1, 32), idx.reshape(-1)).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))


def test_rng_state_round_trip(tmp_path):
    """load_checkpoint puts torch's global RNG back where save_checkpoint found it: the draws after a load are the
    draws the saving process made next (dropout masks, random batches), not those of the loading process."""
    model, optimizer, scheduler = trained()
    fresh, fresh_opt, fresh_sched = trained(seed=1, steps=0)
    torch.manual_seed(2024)
    torch.rand(7)  # move the generator off a fresh seed: the saved state is a mid-stream one
    path = save_checkpoint(tmp_path, 3, model, optimizer, scheduler)
    expected = torch.rand(1000)  # what the saving process draws next
    torch.manual_seed(99)  # the loading process is elsewhere in its stream
    assert not torch.equal(torch.rand(1000), expected)
    load_checkpoint(path, fresh, fresh_opt, fresh_sched)
    assert torch.equal(torch.rand(1000), expected)


def _damage(path: Path, how: str) -> str:
    """Damage checkpoint `path`; returns a fragment of the message that must name the damage."""
    model_file = path / "model.safetensors"
    if how == "truncated":
        data = model_file.read_bytes()
        model_file.write_bytes(data[: len(data) // 2])
        return "truncated"
    if how == "bitflip":
        data = bytearray(model_file.read_bytes())
        data[len(data) // 2] ^= 0x01
        model_file.write_bytes(bytes(data))
        return "checksum mismatch"
    if how == "missing_file":
        (path / "optimizer.safetensors").unlink()
        return "missing optimizer.safetensors"
    if how == "no_manifest":
        (path / MANIFEST).unlink()
        return "no manifest.json"
    garbage = {"torn_manifest": '{"step": 6, "files": {"model.saf', "null_manifest": "null", "list_manifest": "[1, 2]",
               "empty_files": '{"step": 6, "files": {}}', "bad_sizes": None}[how]
    if garbage is None:  # valid JSON, wrong types inside
        manifest = json.loads((path / MANIFEST).read_text())
        manifest["files"]["model.safetensors"]["bytes"] = "many"
        garbage = json.dumps(manifest)
    (path / MANIFEST).write_text(garbage)
    return "unreadable manifest.json"


@pytest.mark.parametrize("how", ["truncated", "bitflip", "missing_file", "no_manifest", "torn_manifest",
                                 "null_manifest", "list_manifest", "empty_files", "bad_sizes"])
def test_damaged_checkpoint_is_named_and_skipped_for_the_previous_one(tmp_path, how):
    model, optimizer, scheduler = trained()
    save_checkpoint(tmp_path, 3, model, optimizer, scheduler, keep_last=0)
    newest = save_checkpoint(tmp_path, 6, model, optimizer, scheduler, keep_last=0)
    expected = _damage(newest, how)
    problem = verify_checkpoint(newest)
    assert problem is not None and expected in problem
    messages = []
    assert latest_valid_checkpoint(tmp_path, log=messages.append) == tmp_path / "step_000003"
    assert len(messages) == 1 and str(newest) in messages[0] and expected in messages[0]
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_checkpoint(newest, trained(seed=1, steps=0)[0])


def test_all_damaged_means_start_over(tmp_path):
    model, optimizer, _ = trained()
    path = save_checkpoint(tmp_path, 1, model, optimizer)
    _damage(path, "bitflip")
    messages = []
    assert latest_valid_checkpoint(tmp_path, log=messages.append) is None and len(messages) == 1
    assert latest_valid_checkpoint(tmp_path / "nowhere") is None


def test_leftovers_of_a_killed_writer_are_ignored_then_removed(tmp_path):
    model, optimizer, _ = trained()
    good = save_checkpoint(tmp_path, 2, model, optimizer)
    half = tmp_path / ".tmp-step_000004-99999"  # what a kill -9 inside save_checkpoint leaves
    half.mkdir()
    shutil.copy(good / "model.safetensors", half / "model.safetensors")
    (tmp_path / "step_notanumber").mkdir()  # foreign folders are not checkpoints either
    assert list_checkpoints(tmp_path) == [good]
    assert latest_valid_checkpoint(tmp_path) == good
    save_checkpoint(tmp_path, 4, model, optimizer)
    assert not half.exists() and [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004"]


def test_keep_last_prunes_oldest_and_resave_replaces_whole(tmp_path):
    model, optimizer, _ = trained()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, optimizer, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    (tmp_path / "step_000004" / "stray.txt").write_text("from an earlier attempt")
    other, other_opt, _ = trained(seed=5)
    save_checkpoint(tmp_path, 4, other, other_opt, keep_last=2)
    assert not (tmp_path / "step_000004" / "stray.txt").exists()
    assert verify_checkpoint(tmp_path / "step_000004") is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    fresh = trained(seed=1, steps=0)[0]
    load_checkpoint(tmp_path / "step_000004", fresh)
    assert torch.equal(fresh.fc1.weight, other.fc1.weight)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    model, optimizer, _ = trained()
    path = save_checkpoint(tmp_path, 1, model, optimizer)
    wrong = nn.Sequential(nn.Linear(16, 16))
    with pytest.raises(ValueError, match="does not fit this model"):
        load_checkpoint(path, wrong)


def test_what_verify_and_prune_say_exactly(tmp_path):
    from fp8train.training.runs.checkpoint import prune_checkpoints
    model, optimizer, _ = trained(steps=1)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, optimizer, keep_last=0)
    (tmp_path / "step_000003" / MANIFEST).unlink()
    assert verify_checkpoint(tmp_path / "step_000003") == ("no manifest.json (deleted: fp8train renames a "
                                                           "checkpoint into place only once it is whole)")
    said = []
    assert prune_checkpoints(tmp_path, 1, log=said.append) == [tmp_path / "step_000001"]
    assert said == [f"pruned checkpoint {tmp_path / 'step_000001'} (checkpoint.keep_last=1)"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]  # unverified: kept


def test_a_moved_aside_folder_of_a_killed_save_is_removed_too(tmp_path):
    model, optimizer, _ = trained(steps=1)
    save_checkpoint(tmp_path, 1, model, optimizer)
    aside = tmp_path / ".old-step_000001-4242"  # a re-save killed between its two renames leaves this
    aside.mkdir()
    save_checkpoint(tmp_path, 2, model, optimizer)
    assert not aside.exists()


def test_another_configs_checkpoint_is_refused_with_both_hashes(tmp_path):
    from fp8train.training.runs.checkpoint import check_checkpoint_origin
    fingerprint = {"train_sha256": "c" * 64}
    manifest = {"extra": {"config_hash": "a" * 64, "data_fingerprint": fingerprint}}
    check_checkpoint_origin(tmp_path, manifest, "a" * 64, fingerprint)  # the same config: fine
    with pytest.raises(ValueError) as raised:
        check_checkpoint_origin(tmp_path, manifest, "b" * 64, fingerprint)
    assert str(raised.value) == (f"cannot resume from {tmp_path}: it was made from a different config (config_hash "
                                 f"{'a' * 12}, now {'b' * 12}: model, data, optimizer, train or FP8 settings differ); "
                                 "resume with the run's own config, or use a new run.name (nothing was changed)")


def test_a_model_with_more_weights_than_the_checkpoint_is_refused(tmp_path):
    """Missing weights that are not a tied alias (here a whole extra layer, nothing unexpected) do not fit."""
    model, optimizer, _ = trained(steps=1)
    path = save_checkpoint(tmp_path, 1, model, optimizer)
    bigger = trained(seed=1, steps=0)[0]
    bigger.extra = nn.Linear(16, 16)
    with pytest.raises(ValueError) as raised:
        load_checkpoint(path, bigger)
    message = str(raised.value)  # safetensors reports the missing names as a set: their order varies
    assert message.startswith(f"checkpoint {path} does not fit this model: missing ")
    assert "'extra.bias'" in message and "'extra.weight'" in message and "unexpected []" in message
