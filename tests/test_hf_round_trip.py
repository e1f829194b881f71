"""The Hugging Face user's round trip with nothing silently wrong: the pretrained folder's own tokenizer (or a
refusal), policy.exclude adding to the defaults and matching the names users see, HF's own save_pretrained of a
converted GPT-2 in Conv1D's layout, folders holding scaling buffers accepted by model.hf_path, the dense export,
delayed scaling under a real transformers.Trainer, and the FP8 export read by compressed-tensors itself. Tiny
models built from local configs; nothing is downloaded."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch

from fp8train.training.config import load_config
from fp8train.training.data.corpus import build_data
from hf_helpers import VOCAB, hf_config, local_text, make_pretrained, make_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("round_trip")
    make_tokenizer(root / "tokenizer")
    out = {"root": root, "tokenizer": root / "tokenizer"}
    for arch in ("llama", "gpt2"):
        bare = make_pretrained(root / f"{arch}_bare", arch)  # weights and config only, as in tests/test_hf.py
        with_tokenizer = root / f"{arch}_full"
        shutil.copytree(bare, with_tokenizer)
        shutil.copytree(root / "tokenizer", with_tokenizer, dirs_exist_ok=True)
        out[f"{arch}_bare"], out[arch] = bare, with_tokenizer
    (root / "text.txt").write_text(local_text(40_000))
    return out


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# ------------------------------------------------------------------------------------------------------------
# 2. The tokenizer of a pretrained folder
# ------------------------------------------------------------------------------------------------------------
def _data(folders, hf_path, *extra):
    return build_data(load_config(None, [f"model.hf_path={hf_path}", "model.seq_len=32",
                                         f"data.path={folders['root'] / 'text.txt'}", *extra]))


def test_pretrained_folder_tokenizer_is_used_when_data_tokenizer_is_empty(folders):
    from transformers import AutoTokenizer

    data = _data(folders, folders["llama"])
    text = (folders["root"] / "text.txt").read_text()
    ids = AutoTokenizer.from_pretrained(str(folders["tokenizer"]))(text, add_special_tokens=False)["input_ids"]
    tokens = np.concatenate([data.train_tokens, data.val_tokens])
    assert not data.byte_level and tokens.tolist() == ids + [0]  # + EOS (id 0, the first special token)


def test_pretrained_folder_without_tokenizer_is_refused_naming_data_tokenizer(folders):
    with pytest.raises(ValueError, match=r"data\.tokenizer is empty and model\.hf_path .* holds no tokenizer.*"
                                         r"data\.tokenizer=bytes"):
        _data(folders, folders["llama_bare"])
    explicit = _data(folders, folders["llama_bare"], f"data.tokenizer={folders['tokenizer']}")
    assert not explicit.byte_level
    raw = _data(folders, folders["llama_bare"], "data.tokenizer=bytes")  # bytes on purpose
    text = (folders["root"] / "text.txt").read_bytes()
    assert raw.byte_level and np.concatenate([raw.train_tokens, raw.val_tokens]).tobytes() == \
        np.frombuffer(text, dtype=np.uint8).astype(raw.train_tokens.dtype).tobytes()


# ------------------------------------------------------------------------------------------------------------
# 5. policy.exclude: adds to the defaults, unmatched patterns refused, names with and without `hf.`
# ------------------------------------------------------------------------------------------------------------
def _converted(folders, *policy):
    from fp8train import convert_to_fp8
    from fp8train.training.config import layer_policy_from_config
    from fp8train.training.models.decoder import build_model

    cfg = load_config(None, [f"model.hf_path={folders['llama']}", "model.seq_len=32", "policy.min_features=16",
                             *policy])
    report = convert_to_fp8(build_model(cfg.model), "current", layer_policy_from_config(cfg), dry_run=True)
    return [name for name, _ in report.converted]


def test_policy_exclude_adds_to_the_defaults(folders):
    every = _converted(folders)
    assert "hf.lm_head" not in every and len(every) == 14
    fewer = _converted(folders, r"policy.exclude=[q_proj]")
    assert "hf.lm_head" not in fewer  # the default output-head pattern still applies
    assert sorted(fewer) == sorted(n for n in every if not n.endswith("q_proj"))
    replaced = _converted(folders, "policy.exclude_defaults=false", r"policy.exclude=[q_proj]")
    assert "hf.lm_head" in replaced and not any(n.endswith("q_proj") for n in replaced)


@pytest.mark.parametrize("pattern", [r"^model\.layers\.0\.", r"^hf\.model\.layers\.0\."])
def test_policy_patterns_match_names_with_and_without_the_hf_prefix(folders, pattern):
    kept = _converted(folders, f"policy.exclude=['{pattern}']")
    assert kept and not any(n.startswith("hf.model.layers.0.") for n in kept)
    assert all(n.startswith("hf.model.layers.1.") for n in kept)
    overridden = _converted(folders, f"policy.overrides={{'{pattern}': bf16}}")
    assert overridden == kept


def test_policy_exclude_pattern_matching_nothing_is_refused(folders):
    with pytest.raises(ValueError, match=r"policy\.exclude: 'q_prj' matches no nn\.Linear"):
        _converted(folders, "policy.exclude=[q_prj]")


# ------------------------------------------------------------------------------------------------------------
# 3 and 6. transformers' own save_pretrained of a converted model; model.hf_path of such a folder
# ------------------------------------------------------------------------------------------------------------
def _converted_gpt2(steps=2):
    """A GPT-2 with its Conv1D layers (square attn.c_proj included) trained a few steps in FP8 (delayed)."""
    from transformers import AutoModelForCausalLM

    from fp8train import LayerPolicy, convert_to_fp8, update_fp8_scales

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("gpt2"), dtype=torch.float32)
    originals = {n: m for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    convert_to_fp8(model, "delayed", LayerPolicy(min_features=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        update_fp8_scales(model)
    return model.eval(), sorted(originals)


def test_transformers_save_pretrained_of_converted_gpt2_keeps_conv1d_layout(tmp_path):
    from transformers import AutoModelForCausalLM

    model, conv_names = _converted_gpt2()
    assert "transformer.h.0.attn.c_proj" in conv_names  # square: 64 -> 64, a transposed load would fit silently
    model.save_pretrained(str(tmp_path / "saved"))  # transformers' own, not fp8train's
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32).eval()
    for name in conv_names:
        conv, trained = plain.get_submodule(name), model.get_submodule(name)
        assert type(conv).__name__ == "Conv1D"
        assert torch.equal(conv.weight, trained.weight.detach().t()), name  # (in, out) = the (out, in) master^T
    # the plain model computes what the FP8 model's master weights compute in high precision
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        fp8_logits, plain_logits = model(input_ids=x).logits, plain(input_ids=x).logits
    assert torch.nn.functional.kl_div(plain_logits.log_softmax(-1), fp8_logits.log_softmax(-1), log_target=True,
                                      reduction="batchmean") < 1e-2


def test_converted_state_dict_round_trips_into_a_converted_model(tmp_path):
    from safetensors.torch import load_file, save_file

    model, _ = _converted_gpt2()
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied to wte
    assert tuple(state["transformer.h.0.attn.c_attn.weight"].shape) == (64, 192)  # Conv1D's (in, out)
    save_file(state, str(tmp_path / "s.safetensors"))
    again, _ = _converted_gpt2(steps=0)
    again.load_state_dict(load_file(str(tmp_path / "s.safetensors")), strict=False)
    for name, module in model.named_modules():
        if hasattr(module, "conv1d_layout"):
            assert torch.equal(again.get_submodule(name).weight, module.weight), name
    for key, value in model.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key


def test_hf_path_accepts_a_folder_saved_from_a_converted_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from fp8train.training.config import ModelConfig
    from fp8train.training.models.decoder import build_model

    model, conv_names = _converted_gpt2()
    model.save_pretrained(str(tmp_path / "saved"))
    loaded = build_model(ModelConfig(hf_path=str(tmp_path / "saved"), seq_len=32)).eval()  # buffers dropped
    assert not any(hasattr(m, "recipe") for m in loaded.modules())
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    for name in conv_names:
        assert torch.equal(loaded.hf.get_submodule(name).weight, plain.get_submodule(name).weight), name


def test_hf_path_refuses_a_run_directory_saying_how_to_export_it(tmp_path):
    from fp8train.training.config import ModelConfig
    from fp8train.training.models.decoder import build_model

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("run: {}\n")
    with pytest.raises(ValueError, match=r"fp8train run directory.*fp8train export .* --format hf --out DIR"):
        build_model(ModelConfig(hf_path=str(tmp_path / "run"), seq_len=32))


# ------------------------------------------------------------------------------------------------------------
# 1. The dense export: a folder from_pretrained loads and the next run fine-tunes from
# ------------------------------------------------------------------------------------------------------------
def _recipe(folders, name, hf_path, *, steps=3, recipe="current", **sections) -> str:
    import yaml

    root = folders["root"]
    config = {"run": {"dir": str(root / "runs"), "name": name}, "model": {"hf_path": str(hf_path), "seq_len": 32},
              "data": {"path": str(root / "text.txt")},
              "train": {"max_steps": steps, "batch_size": 2, "eval_every": steps, "eval_batches": 1, "lr": 3e-3,
                        "device": "cpu", "threads": 1, "autocast": "none"},
              "optim": {"warmup_steps": 1}, "fp8": {"recipe": recipe}, "policy": {"min_features": 16},
              "log": {"wandb": "disabled", "telemetry_every": 0}}
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module")
def runs(folders):
    from fp8train.cli import main

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(folders["root"] / "cache"))
        for arch in ("llama", "gpt2"):
            assert main(["train", "--quiet", _recipe(folders, f"ft_{arch}", folders[arch])]) == 0
    return {arch: folders["root"] / "runs" / f"ft_{arch}" for arch in ("llama", "gpt2")}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dense_export_loads_in_transformers_and_is_the_next_hf_path(runs, folders, tmp_path, arch, capsys):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fp8train.cli import main
    from fp8train.serving.export import load_run
    from fp8train.training.config import ModelConfig
    from fp8train.training.models.decoder import build_model

    out = tmp_path / "dense"
    assert main(["export", str(runs[arch]), "--format", "hf", "--out", str(out)]) == 0
    assert "transformers_vs_source" in capsys.readouterr().out
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= files
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and "torch_dtype" not in config
    run = load_run(runs[arch])
    own = {k[len("hf."):]: v for k, v in run.model.state_dict().items()}  # the plain model: Conv1D for GPT-2
    saved = load_file(str(out / "model.safetensors"))
    assert not any(k.startswith("hf.") or "amax" in k for k in saved)
    for key, value in saved.items():
        assert value.dtype == torch.float32 and torch.equal(value, own[key]), key
    if arch == "gpt2":
        assert tuple(saved["transformer.h.0.attn.c_attn.weight"].shape) == (64, 192)  # Conv1D's (in, out)
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True).eval()
    nxt = build_model(ModelConfig(hf_path=str(out), seq_len=32)).eval()  # the next run's model.hf_path
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        reference = run.model(x)[0]
        assert torch.equal(theirs(input_ids=x).logits, reference) and torch.equal(nxt(x)[0], reference)
    text = "def main(argv):\n    return 0\n"
    assert AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(folders["tokenizer"]))(text)["input_ids"]


@pytest.mark.slow
def test_gpt2_fp8_export_is_refused_offering_the_dense_folder(runs, tmp_path, capsys):
    from fp8train.cli import main

    assert main(["export", str(runs["gpt2"]), "--format", "e4m3fn", "--out", str(tmp_path / "fp8")]) == 2
    err = capsys.readouterr().err.strip()
    assert "Conv1D" in err and f"fp8train export {runs['gpt2']} --format hf --out DIR" in err
    assert not (tmp_path / "fp8").exists()


# ------------------------------------------------------------------------------------------------------------
# 4. Delayed scaling under a real transformers.Trainer
# ------------------------------------------------------------------------------------------------------------
class _Windows(torch.utils.data.Dataset):
    def __init__(self, n=8, length=16):
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (n, length), generator=gen)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp_path, model, callbacks, steps=3, accumulation=2, **args):
    from transformers import Trainer, TrainingArguments

    arguments = TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=steps, per_device_train_batch_size=2,
                                  gradient_accumulation_steps=accumulation, learning_rate=1e-3, use_cpu=True,
                                  report_to="none", logging_strategy="no", dataloader_num_workers=0,
                                  save_strategy=args.pop("save_strategy", "no"), **args)
    return Trainer(model=model, args=arguments, train_dataset=_Windows(), callbacks=callbacks)


def _delayed_llama():
    from transformers import AutoModelForCausalLM

    from fp8train import LayerPolicy, convert_to_fp8

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("llama"), dtype=torch.float32)
    convert_to_fp8(model, "delayed", LayerPolicy(min_features=16))
    return model


def test_trainer_without_the_callback_warns_once_that_scales_never_update(tmp_path, monkeypatch):
    monkeypatch.setattr("fp8train.nn.delayed_scaling._missing_update_warned", False)
    model = _delayed_llama()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, model, callbacks=[]).train()
    ours = [w for w in caught if "update_fp8_scales" in str(w.message)]
    assert len(ours) == 1 and "Fp8ScalingCallback" in str(ours[0].message)
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert not bool(layer.input_initialized) and float(layer.input_pending_amax) > 0  # what the warning is about


def test_trainer_with_the_callback_updates_scales_from_the_max_over_micro_batches(tmp_path, monkeypatch):
    import fp8train

    monkeypatch.setattr("fp8train.nn.delayed_scaling._missing_update_warned", False)
    model = _delayed_llama()
    layer = model.get_submodule("model.layers.0.self_attn.q_proj")
    seen = []
    layer.register_forward_pre_hook(lambda module, args: seen.append(float(args[0].detach().abs().max())))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, model, callbacks=[fp8train.Fp8ScalingCallback()]).train()
    assert not [w for w in caught if "update_fp8_scales" in str(w.message)]
    assert len(seen) == 6  # 3 optimizer steps x 2 micro-batches
    step_amax = [max(seen[i:i + 2]) for i in range(0, 6, 2)]  # the documented rule, written out
    history = layer.input_amax_history.tolist()
    assert history[:3] == pytest.approx(step_amax[::-1], rel=0, abs=0) and not any(history[3:])
    assert bool(layer.input_initialized) and float(layer.input_pending_amax) == -1.0
    assert float(layer.input_scale) == pytest.approx(max(step_amax) / 448, rel=1e-6)  # history "max", margin 0


def test_trainer_checkpoint_of_a_converted_gpt2_loads_in_its_own_layout(tmp_path):
    """A Trainer checkpoint (transformers' save_pretrained inside) of an FP8 GPT-2: from_pretrained reads the
    Conv1D weights right, and model.hf_path fine-tunes from the folder (its scaling buffers dropped)."""
    from transformers import AutoModelForCausalLM

    import fp8train
    from fp8train.training.config import ModelConfig
    from fp8train.training.models.decoder import build_model

    model, conv_names = _converted_gpt2(steps=0)
    model.train()
    _trainer(tmp_path, model, callbacks=[fp8train.Fp8ScalingCallback()], steps=2, accumulation=1,
             save_strategy="steps", save_steps=2).train()
    folder = tmp_path / "trainer" / "checkpoint-2"
    plain = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    for name in conv_names:
        assert torch.equal(plain.get_submodule(name).weight, model.get_submodule(name).weight.detach().t()), name
    loaded = build_model(ModelConfig(hf_path=str(folder), seq_len=16))
    assert torch.equal(loaded.hf.get_submodule(conv_names[0]).weight, plain.get_submodule(conv_names[0]).weight)


@pytest.mark.parametrize("recipe_name", ["current", "rowwise"])
def test_fused_adamw_step_is_seen_by_the_weight_cache(recipe_name):
    """Fused AdamW (the Trainer's default optimizer) writes weights without bumping tensor._version: the next
    forward must still quantize the new weight, as a layer with no cache does."""
    from fp8train import Fp8Linear

    torch.manual_seed(0)
    layer = Fp8Linear(64, 64, recipe=recipe_name)
    layer.emulated_dtype = "fp32"
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
    x = torch.randn(8, 64)
    layer(x).sum().backward()
    optimizer.step()
    with torch.no_grad():
        cached = layer(x)
        layer.forget_weight_fp8()  # what a fresh layer would compute from the same weight
        fresh = layer(x)
    assert torch.equal(cached, fresh)


# ------------------------------------------------------------------------------------------------------------
# 7. Minor: the summary line of a run with no FP8 layer; export from a Hugging Face folder
# ------------------------------------------------------------------------------------------------------------
def test_summary_line_says_when_no_layer_ran_in_fp8():
    from fp8train.training.runs.run_log import summary_line

    base = {"status": "completed", "steps": 3, "val_loss": 1.0, "wall_time_s": 1.0, "recipe": "delayed:e4m3"}
    assert "0 FP8 layers" in summary_line("r", {**base, "fp8_layers": 0})
    assert "FP8 layers" not in summary_line("r", {**base, "fp8_layers": 4})
    assert "FP8 layers" not in summary_line("r", {**base, "recipe": "none", "fp8_layers": 0})


@pytest.mark.slow
def test_fp8_export_of_a_hugging_face_folder(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from fp8train.serving.dense_export import export_dense_folder
    from fp8train.serving.export import compare_logits
    from fp8train.serving.hf_export import export_hf_folder, load_hf_export

    dense = tmp_path / "dense"
    export_dense_folder(runs["llama"], dense)
    result = export_hf_folder(dense, tmp_path / "fp8")  # a folder, not a run directory
    assert result["fp8_layers"] == 10 and result["step"] == 0  # the default policy: k/v_proj (32 wide) < 64
    qkv = "model.layers.{0}.self_attn.q_proj + model.layers.{0}.self_attn.k_proj + model.layers.{0}.self_attn.v_proj"
    assert result["vllm_mixed_fused"] == [qkv.format(i) for i in range(2)]  # q in FP8, k and v in bf16
    assert export_hf_folder(runs["llama"], tmp_path / "all")["vllm_mixed_fused"] == []  # min_features 16: all FP8
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config
    assert (tmp_path / "fp8" / "generation_config.json").is_file() and (tmp_path / "fp8" / "tokenizer.json").is_file()
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32)
    x = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    agreement = compare_logits(load_hf_export(tmp_path / "fp8"), theirs, [(x, None)], autocast=False)
    assert agreement["max_abs_logit_diff"] < 1e-3


# ------------------------------------------------------------------------------------------------------------
# The FP8 export read by compressed-tensors' own decompression
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("weight_block", [0, 32], ids=["channel", "block32"])
def test_fp8_export_decompresses_with_compressed_tensors_model_compressor(runs, tmp_path, weight_block):
    import ml_dtypes
    from compressed_tensors.compressors import ModelCompressor
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    from fp8train.serving.export import load_run
    from fp8train.serving.hf_export import export_hf_folder

    out = tmp_path / "fp8"
    export_hf_folder(runs["llama"], out, weight_block=weight_block)
    scheme = json.loads((out / "config.json").read_text())["quantization_config"]
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True)
    ModelCompressor.from_compression_config(CompressedTensorsConfig(**scheme)).decompress_model(model)
    files = load_file(str(out / "model.safetensors"))
    master = load_run(runs["llama"]).model
    names = [k[:-len(".weight_scale")] for k in files if k.endswith(".weight_scale")]
    assert len(names) == 14
    for name in names:
        codes = files[f"{name}.weight"].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        scale = files[f"{name}.weight_scale"].numpy()
        if weight_block:  # one scale per b x b tile, written out
            scale = np.repeat(np.repeat(scale, weight_block, axis=0), weight_block, axis=1)[:codes.shape[0],
                                                                                           :codes.shape[1]]
        decompressed = model.get_submodule(name).weight.detach()
        assert decompressed.dtype == torch.float32
        np.testing.assert_array_equal(decompressed.numpy(), codes * scale)  # the scheme, read back exactly
        w = master.get_submodule(f"hf.{name}").weight.detach()
        assert float((decompressed - w).norm() / w.norm()) < 0.04  # E4M3: half a step of 2**-3 at worst, per value


@pytest.mark.slow
def test_kv_eval_names_fp32_weights_fp32(runs, tmp_path):
    from fp8train.serving.kv_report import write_report
    from fp8train.serving.kvcache import KvEvalOptions, kv_eval

    result = kv_eval(runs["llama"], KvEvalOptions(formats=("e4m3fn",), gen_prompts=0), log=lambda m: None)
    assert result["weights_dtype"] == "fp32"  # the run trained with train.autocast=none
    text = open(write_report(result, tmp_path / "kv")["md"]).read()
    assert "| fp32 | bf16 |" in text and "| bf16 | bf16 |" not in text  # weights fp32, K/V through a bf16 cache


def test_checkpoint_from_before_the_layout_rule_still_loads_its_rectangular_conv1d_weights():
    """Checkpoints written before state dicts held Conv1D's layout stored these weights (out, in): a rectangular
    one is recognised by its shape and loads right."""
    model, _ = _converted_gpt2()
    old_style = {k: v.clone() for k, v in model.state_dict().items()}
    key = "transformer.h.0.attn.c_attn.weight"
    old_style[key] = old_style[key].t().contiguous()  # (192, 64): the (out, in) layout it trained in
    again, _ = _converted_gpt2(steps=0)
    again.load_state_dict(old_style)
    assert torch.equal(again.get_submodule("transformer.h.0.attn.c_attn").weight,
                       model.get_submodule("transformer.h.0.attn.c_attn").weight)
