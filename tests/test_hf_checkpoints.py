"""Checkpoints of converted models that round-trip with transformers (issue 43, points 5, 6, 7): a Trainer
checkpoint and transformers' own save_pretrained of a converted model load back with fp8train.from_pretrained bit
for bit, and with a plain AutoModelForCausalLM.from_pretrained without an UNEXPECTED-keys report; export takes a
Trainer checkpoint (which holds no tokenizer) with --tokenizer PATH, keeps the FP8 layers the model recorded, and
notes FP8 layers whose outputs are not a multiple of --weight-block; model.hf_path=<a run directory> says so
before anything about tokenizers. References: the trained model's own state_dict and logits, transformers'
loading info, compressed-tensors' scheme as documented."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import fp8train
from fp8train.cli import main
from fp8train.nn.linear import Fp8Linear
from fp8train.serving.hf_export import load_hf_export
from hf_helpers import VOCAB, hf_config, make_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


class _Windows(torch.utils.data.Dataset):
    def __init__(self, n=8, length=16):
        self.ids = torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _converted(arch="llama", recipe_name="delayed"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    fp8train.convert_to_fp8(model, recipe_name, fp8train.LayerPolicy(min_features=16))  # k_proj (32 wide) in FP8
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(trained model, its Trainer checkpoint folder, a tokenizer folder): 2 delayed-scaling steps."""
    root = tmp_path_factory.mktemp("trainer")
    model = _converted()
    args = TrainingArguments(output_dir=str(root / "out"), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-3, use_cpu=True, report_to="none", logging_strategy="no",
                             dataloader_num_workers=0, save_strategy="steps", save_steps=2)
    Trainer(model=model, args=args, train_dataset=_Windows(), callbacks=[fp8train.Fp8ScalingCallback()]).train()
    return model.eval(), root / "out" / "checkpoint-2", make_tokenizer(root / "tok")


def _assert_same_fp8_model(loaded, model):
    expected = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key  # weights and every scaling buffer, bit for bit
    for name, layer in model.named_modules():
        if isinstance(layer, Fp8Linear):
            restored = loaded.get_submodule(name)
            assert isinstance(restored, Fp8Linear) and restored.recipe == layer.recipe
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)


def test_from_pretrained_restores_a_trainer_checkpoint_of_a_converted_model(checkpoint):
    model, folder, _ = checkpoint
    assert not any(folder.glob("tokenizer*"))  # the Trainer saved none: the habit export must meet
    layer = model.get_submodule("model.layers.0.self_attn.k_proj")
    assert bool(layer.input_initialized) and float(layer.input_amax_history[0]) > 0  # the callback ran
    _assert_same_fp8_model(fp8train.from_pretrained(folder), model)


@pytest.mark.parametrize("arch, recipe_name", [("llama", "delayed"), ("gpt2", "current"), ("qwen2", "rowwise")])
def test_from_pretrained_restores_transformers_own_save_pretrained(tmp_path, arch, recipe_name):
    model = _converted(arch, recipe_name).eval()
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=x)  # a forward: amaxes and scales that are not the initial ones
    model.save_pretrained(str(tmp_path / "saved"))
    loaded = fp8train.from_pretrained(tmp_path / "saved")
    _assert_same_fp8_model(loaded, model)
    loaded.save_pretrained(str(tmp_path / "again"))  # a restored model saves what restores it again
    _assert_same_fp8_model(fp8train.from_pretrained(tmp_path / "again"), model)


def test_a_plain_transformers_load_of_the_folder_is_quiet(checkpoint, capfd):
    model, folder, _ = checkpoint
    capfd.readouterr()
    plain, info = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    err = capfd.readouterr().err
    assert not info["unexpected_keys"] and not info["missing_keys"], info
    assert "UNEXPECTED" not in err and "LOAD REPORT" not in err, err[:500]
    for name, param in plain.named_parameters():
        assert torch.equal(param, model.get_parameter(name)), name  # the fp32 master weights
    assert not any(isinstance(m, Fp8Linear) for m in plain.modules())


def test_a_folder_with_scaling_buffers_but_no_record_says_what_to_do(checkpoint, tmp_path):
    _, folder, _ = checkpoint
    old = tmp_path / "old"
    old.mkdir()
    config = json.loads((folder / "config.json").read_text())
    del config["fp8train"]  # as saved before convert_to_fp8 recorded its layers
    (old / "config.json").write_text(json.dumps(config))
    (old / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"records no FP8 layers.*model.hf_path fine-tunes from it"):
        fp8train.from_pretrained(old)


def test_export_of_a_trainer_checkpoint_needs_and_takes_a_tokenizer(checkpoint, tmp_path, capsys):
    model, folder, tokenizer = checkpoint
    out = tmp_path / "fp8"
    assert main(["export", str(folder), "--format", "e4m3fn", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer PATH" in err and not out.exists()
    assert main(["export", str(folder), "--format", "e4m3fn", "--tokenizer", str(tokenizer), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "exported step 2 of" in said and "top-1 agreement" in said
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    ignore = config["quantization_config"]["ignore"]
    assert ignore == ["lm_head"]  # the recorded FP8 layers (k_proj, v_proj: 32 wide) are FP8, not the defaults'
    exported = load_hf_export(out)
    x = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        top1 = (exported(input_ids=x).logits.argmax(-1) == model(input_ids=x).logits.argmax(-1)).float().mean()
    assert float(top1) >= 0.9
    assert AutoModelForCausalLM.from_pretrained(str(out)).config.vocab_size == VOCAB  # transformers reads it


def test_dense_export_of_a_trainer_checkpoint_is_the_master_weights(checkpoint, tmp_path):
    model, folder, tokenizer = checkpoint
    out = tmp_path / "dense"
    assert main(["export", str(folder), "--format", "hf", "--tokenizer", str(tokenizer), "--out", str(out),
                 "--no-check"]) == 0
    dense = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    for name, param in dense.named_parameters():
        assert torch.equal(param, model.get_parameter(name)), name
    assert "fp8train" not in json.loads((out / "config.json").read_text())  # a plain folder claims no FP8 layers


def test_weight_block_export_notes_layers_whose_outputs_are_not_a_multiple(checkpoint, tmp_path, capsys):
    _, folder, tokenizer = checkpoint
    source = tmp_path / "with-tokenizer"  # the checkpoint with its tokenizer beside it, as a published folder has
    shutil.copytree(folder, source)
    for file in tokenizer.iterdir():
        shutil.copy(file, source / file.name)
    out = tmp_path / "block"
    assert main(["export", str(source), "--format", "e4m3fn", "--weight-block", "64", "--out", str(out),
                 "--no-check"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "note:" in line]
    assert len(notes) == 1, notes
    # k_proj and v_proj of both layers: 32 outputs (one KV head of 32), every other FP8 layer 64 or 128
    assert "model.layers.0.self_attn.k_proj has 32 outputs, not a multiple of 64 (and 3 more layers)" in notes[0]
    assert "vLLM" in notes[0]
    scale = load_hf_export(out).get_submodule("model.layers.0.self_attn.k_proj")
    assert scale is not None  # the folder is still written and loads: transformers reads a partial last tile


def test_tokenizer_is_refused_where_it_does_not_apply(tiny_fp8_run, tmp_path, capsys):
    assert main(["export", str(tiny_fp8_run), "--format", "hf", "--tokenizer", str(tmp_path), "--out",
                 str(tmp_path / "x")]) == 2
    assert "tokenizes with its own" in capsys.readouterr().err
    assert main(["export", "--convert", str(tmp_path / "a.safetensors"), "--format", "e4m3fnuz", "--tokenizer",
                 str(tmp_path), "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "--tokenizer applies to an export of a Hugging Face folder only" in capsys.readouterr().err


def test_hf_path_of_a_run_directory_says_so_before_the_tokenizer(tiny_fp8_run, tmp_path, capsys):
    code = main(["train", "--quiet", "recipes/hf_tiny.yaml", f"run.dir={tmp_path}", f"model.hf_path={tiny_fp8_run}",
                 "data.tokenizer=", "log.wandb=disabled"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "is an fp8train run directory" in err and f"fp8train export {tiny_fp8_run} --format hf" in err
    assert "tokenizer" not in err
