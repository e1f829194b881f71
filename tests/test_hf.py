"""Hugging Face models: pretrained loading (model.hf_path) and its refusals, Decoder-only fields refused, GPT-2
Conv1D conversion against nn.Linear, FP8 scaling state kept fp32 under dtype casts, a run that converts nothing
refused, and save_pretrained / from_pretrained round trips (exact) on tiny local models."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

import fp8train
from fp8train import LayerPolicy, convert_to_fp8, recipe, update_fp8_scales
from fp8train.nn.linear import Fp8Linear
from fp8train.training.config import ModelConfig, load_config
from fp8train.training.models.decoder import build_model
from hf_helpers import TINY_ARCHS, VOCAB, hf_config, make_pretrained

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    return {arch: make_pretrained(root / arch, arch) for arch in TINY_ARCHS}


def _tokens(seed=0, batch=2, length=16):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------------
# model.hf_path
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_hf_path_loads_the_pretrained_weights(pretrained, arch):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(pretrained[arch]), dtype=torch.float32).eval()
    torch.manual_seed(123)  # a different seed: random init would differ
    model = build_model(ModelConfig(hf_path=str(pretrained[arch]), seq_len=32)).eval()
    saved = load_file(str(pretrained[arch] / "model.safetensors"))
    ours = {k[len("hf."):]: v for k, v in model.state_dict().items()}
    for key, value in saved.items():
        assert torch.equal(ours[key], value), key
    x = _tokens()
    logits, loss = model(x, x)
    assert torch.equal(logits, reference(input_ids=x).logits) and loss.dtype == torch.float32
    random_init = build_model(ModelConfig(hf_config=str(pretrained[arch]), seq_len=32))
    assert not torch.equal(random_init.state_dict()[next(iter(model.state_dict()))], next(iter(ours.values())))


def _partial_copy(src, dst, drop: str | None = None, config_edit: dict | None = None):
    dst.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    if drop:
        tensors = {k: v for k, v in tensors.items() if drop not in k}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text()) | (config_edit or {})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("case, match", [
    ("missing", "does not exist"),
    ("no_weights", "no safetensors weights"),
    ("partial", "partial or do not match"),
    ("wrong_shape", "do not fit its config.json|partial or do not match"),
])
def test_hf_path_bad_folders_are_refused(pretrained, tmp_path, case, match):
    src = pretrained["llama"]
    folder = {"missing": lambda: tmp_path / "nope",
              "no_weights": lambda: _partial_copy(src, tmp_path / "cfg") and
              ((tmp_path / "cfg" / "model.safetensors").unlink() or tmp_path / "cfg"),
              "partial": lambda: _partial_copy(src, tmp_path / "part", drop="layers.1.mlp.up_proj"),
              "wrong_shape": lambda: _partial_copy(src, tmp_path / "shape", config_edit={"intermediate_size": 96}),
              }[case]()
    with pytest.raises(ValueError, match=match) as err:
        build_model(ModelConfig(hf_path=str(folder), seq_len=32))
    assert "model.hf_path" in str(err.value) and "\n" not in str(err.value)


def test_bad_hf_path_exits_2_with_one_line_and_writes_nothing(pretrained, tmp_path, capsys):
    from fp8train.cli import main

    folder = _partial_copy(pretrained["llama"], tmp_path / "part", drop="lm_head")
    recipe_file = tmp_path / "hf.yaml"
    recipe_file.write_text(f"run:\n  dir: {tmp_path / 'runs'}\nmodel:\n  hf_path: {folder}\n  seq_len: 32\n"
                           "data:\n  tokenizer: bytes\nlog:\n  wandb: disabled\nfp8:\n  recipe: none\n")
    assert main(["train", "--quiet", str(recipe_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.hf_path" in err and "lm_head" in err
    assert not (tmp_path / "runs").exists()


def test_decoder_fields_are_refused_with_an_hf_model(pretrained):
    with pytest.raises(ValueError, match=r"model.d_model=64 does not apply to a Hugging Face model"):
        load_config(None, [f"model.hf_path={pretrained['llama']}", "model.d_model=64"])
    with pytest.raises(ValueError, match="both set"):
        load_config(None, [f"model.hf_path={pretrained['llama']}", f"model.hf_config={pretrained['llama']}"])
    cfg = load_config(None, [f"model.hf_path={pretrained['llama']}", "model.seq_len=32"])  # data fields are fine
    assert cfg.model.hf_path == str(pretrained["llama"])


def test_decoder_fields_are_not_recorded_for_an_hf_model(pretrained):
    from fp8train.training.runs.tracking import tracked_config  # the config the trackers (wandb, ...) store

    cfg = load_config(None, [f"model.hf_path={pretrained['llama']}", "model.seq_len=32"])
    model = build_model(cfg.model)
    recorded = tracked_config(cfg, None, None, model)
    assert recorded["model"]["hf_path"] == str(pretrained["llama"]) and recorded["model"]["seq_len"] == 32
    assert not {"d_model", "n_layers", "n_heads", "rope_theta"} & set(recorded["model"])
    assert recorded["model_config"]["hidden_size"] == 64  # what the model really is: its config.json
    decoder_cfg = load_config(None, [])
    assert tracked_config(decoder_cfg, None, None, build_model(decoder_cfg.model))["model"]["d_model"] == 128


# ------------------------------------------------------------------------------------------------------------
# GPT-2 Conv1D
# ------------------------------------------------------------------------------------------------------------
def test_conv1d_converts_like_the_transposed_linear():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(96, 64))  # nf=96 out, nx=64 in: weight (64, 96)
    conv = model[0]
    x = torch.randn(8, 64, requires_grad=True)
    reference = x @ conv.weight.detach() + conv.bias.detach()  # Conv1D's definition, written out
    linear = nn.Sequential(nn.Linear(64, 96))
    linear[0].weight.data.copy_(conv.weight.detach().t())
    linear[0].bias.data.copy_(conv.bias.detach())
    report = convert_to_fp8(model, recipe("current"), LayerPolicy(min_features=16))
    convert_to_fp8(linear, recipe("current"), LayerPolicy(min_features=16))
    assert report.converted == [("0", "64->96")] and isinstance(model[0], Fp8Linear)
    out = model(x)
    assert torch.equal(out, linear(x))  # bit-identical to the nn.Linear holding weight.T
    error = (out.detach() - reference).double()
    assert 10 * torch.log10(reference.double().pow(2).sum() / error.pow(2).sum()) > 25  # SQNR in dB
    out.sum().backward()
    assert model[0].weight.grad.shape == (96, 64) and torch.isfinite(model[0].weight.grad).all()


def test_gpt2_reports_its_conv1d_layers(pretrained):
    model = build_model(ModelConfig(hf_path=str(pretrained["gpt2"]), seq_len=32))
    report = convert_to_fp8(model, recipe("delayed"), LayerPolicy(min_features=16))
    converted = [name for name, _ in report.converted]
    assert converted == [f"hf.transformer.h.{i}.{m}" for i in range(2)
                         for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert [name for name, _ in report.skipped] == ["hf.lm_head"]


def test_fp8_run_that_converts_nothing_is_refused(tmp_path, capsys):
    from fp8train.cli import main

    args = ["train", "--quiet", "recipes/cpu_current.yaml", f"run.dir={tmp_path}", "run.name=r", "log.wandb=disabled",
            "model.d_model=32", "model.n_heads=2", "model.n_layers=1", "model.seq_len=16", "train.max_steps=1",
            "train.batch_size=2", "train.eval_batches=1", "data.max_bytes=200000", "policy.min_features=256"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no layer converted" in err and "allow_no_fp8" in err
    assert "layers.0.attn.q_proj: in_features=32 < min_features=256" in err
    assert not (tmp_path / "r").exists()
    assert main(args + ["policy.allow_no_fp8=true"]) == 0
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["fp8_layers"] == 0


# ------------------------------------------------------------------------------------------------------------
# dtype casts
# ------------------------------------------------------------------------------------------------------------
def _trained_fp8_model(arch="llama", recipe_name="delayed", steps=2):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)
    convert_to_fp8(model, recipe(recipe_name), LayerPolicy(min_features=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        x = _tokens(seed=step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        update_fp8_scales(model)
    return model


@pytest.mark.parametrize("cast", ["half", "bfloat16", "to_float16", "to_bfloat16"])
def test_dtype_casts_keep_every_scaling_buffer_fp32(cast):
    model = _trained_fp8_model()
    before = {name: buf.clone() for name, buf in model.named_buffers() if name.rpartition(".")[2].startswith(
        ("input_", "weight_", "grad_output_"))}  # every scaling buffer: scales, histories, pending amaxes, counters
    assert sum(buf.is_floating_point() for buf in before.values()) == 14 * 3 * 4  # history, scale, scale_amax, pending
    assert all(buf.dtype == torch.float32 for buf in before.values() if buf.is_floating_point())
    target = {"half": torch.float16, "to_float16": torch.float16}.get(cast, torch.bfloat16)
    model = {"half": model.half, "bfloat16": model.bfloat16, "to_float16": lambda: model.to(torch.float16),
             "to_bfloat16": lambda: model.to(torch.bfloat16)}[cast]()
    after = dict(model.named_buffers())
    for name, buf in before.items():
        assert after[name].dtype == buf.dtype and torch.equal(after[name], buf), name
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert layer.weight.dtype == target
    assert float(layer.grad_output_scale) > 0  # a tiny scale that fp16 would flush to 0 stays what it was
    assert float(before["model.layers.0.self_attn.q_proj.grad_output_scale"]) < 2.0**-14  # fp16's min normal


def test_half_model_keeps_training_with_finite_gradients():
    """The issue's failure: after model.half() the first step's grad_output scale (~1e-9) flushed to 0 in fp16."""
    model = _trained_fp8_model().half()
    x = _tokens(seed=9)
    for _ in range(2):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)
        model.zero_grad()
        update_fp8_scales(model)
    scale = model.get_submodule("model.layers.0.self_attn.q_proj").grad_output_scale
    assert scale.dtype == torch.float32 and 0 < float(scale) < 2.0**-24  # below fp16's smallest subnormal


# ------------------------------------------------------------------------------------------------------------
# save_pretrained / from_pretrained
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch, recipe_name", [("llama", "delayed"), ("gpt2", "delayed"), ("qwen2", "rowwise")])
def test_save_and_restore_round_trip_exactly(tmp_path, arch, recipe_name):
    from transformers import AutoModelForCausalLM

    model = _trained_fp8_model(arch, recipe_name).eval()
    fp8train.save_pretrained(model, tmp_path / "saved")
    restored = fp8train.from_pretrained(tmp_path / "saved")
    original, back = model.state_dict(), restored.state_dict()
    assert list(original) == list(back)
    for key in original:
        assert original[key].dtype == back[key].dtype and torch.equal(original[key], back[key]), key
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert layers and {n for n, m in restored.named_modules() if isinstance(m, Fp8Linear)} == set(layers)
    assert all(restored.get_submodule(n).recipe == m.recipe for n, m in layers.items())
    x = _tokens(seed=5)
    assert torch.equal(model(input_ids=x).logits, restored(input_ids=x).logits)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["fp8train"]["recipes"][0]["scaling"] == recipe_name
    # transformers' own loader reads the master weights in the Hugging Face layout (Conv1D (in, out) again).
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    for name, layer in layers.items():
        weight = plain.get_submodule(name).weight
        expected = layer.weight.t() if getattr(layer, "conv1d_layout", False) else layer.weight
        assert torch.equal(weight, expected), name


def test_fine_tune_from_an_fp8train_saved_folder(tmp_path):
    model = _trained_fp8_model("llama")
    fp8train.save_pretrained(model, tmp_path / "saved")
    loaded = build_model(ModelConfig(hf_path=str(tmp_path / "saved"), seq_len=32))  # scaling buffers skipped
    assert torch.equal(loaded.hf.lm_head.weight, model.lm_head.weight)
    assert not any(isinstance(m, Fp8Linear) for m in loaded.modules())
