"""The Hugging Face flow end to end on CPU, nothing downloaded: fine-tune a tiny local pretrained Llama with a
local BPE tokenizer, validate it, export it as a compressed-tensors FP8 folder, and load that folder with
transformers' AutoModelForCausalLM (its logits against fp8train's own loader: max |diff| < 1e-3, top-1 >= 99%);
the export's bytes against an independent numpy reference; export refusals; kv-eval on an HF model."""

from __future__ import annotations

import json
import math
import re

import ml_dtypes
import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from fp8train.cli import main
from fp8train.serving.export import compare_logits, load_run
from fp8train.serving.hf_export import export_hf_folder, load_hf_export
from fp8train.serving.kvcache import KvEvalOptions, bf16_cache, kv_eval, kv_transforms
from fp8train.training.data.corpus import build_data
from hf_helpers import make_pretrained, make_text_folder, make_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 8


def _recipe_yaml(path, root, name, **extra) -> str:
    """A recipe for the HF run: the model comes from model.hf_path, so no Decoder fields are set."""
    lines = {"run": {"dir": str(root), "name": name},
             "model": {"hf_path": str(root / "pretrained"), "seq_len": 32},
             "data": {"path": str(root / "docs"), "tokenizer": str(root / "tokenizer"), "val_fraction": 0.25},
             "train": {"max_steps": STEPS, "batch_size": 4, "eval_every": STEPS, "eval_batches": 2, "lr": 3e-3,
                       "device": "cpu", "threads": 1, "autocast": "none"},
             "optim": {"warmup_steps": 2}, "fp8": {"recipe": "current"}, "policy": {"min_features": 16},
             "log": {"wandb": "disabled", "telemetry_every": 0}}
    for key, value in extra.items():
        section, field = key.split("__")
        lines.setdefault(section, {})[field] = value
    path.write_text(yaml.safe_dump(lines))
    return str(path)


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_flow")
    make_pretrained(root / "pretrained", "llama")
    make_tokenizer(root / "tokenizer")
    make_text_folder(root / "docs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))  # the token cache of these runs stays in the test folder
        yield root


@pytest.fixture(scope="module")
def hf_run(hf_root):
    torch.set_num_threads(1)
    assert main(["train", "--quiet", _recipe_yaml(hf_root / "ft.yaml", hf_root, "ft")]) == 0
    return hf_root / "ft"


def _hf_logits_loss(model, batches) -> float:
    """Mean next-token cross entropy computed from a transformers model's logits (independent of fp8train)."""
    losses = [torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
              for x, y in batches]
    return float(torch.stack(losses).mean())


@pytest.mark.slow
def test_fine_tune_starts_from_the_pretrained_weights(hf_root, hf_run):
    from transformers import AutoModelForCausalLM

    metrics = [json.loads(line) for line in (hf_run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((hf_run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["fp8_layers"] == 14
    pretrained = AutoModelForCausalLM.from_pretrained(str(hf_root / "pretrained"), dtype=torch.float32).eval()
    run_cfg = load_run(hf_run).cfg
    with torch.no_grad():
        expected = _hf_logits_loss(pretrained, build_data(run_cfg).val_batches())
    # Step 0 is evaluated with the FP8 layers in place: the pretrained loss up to FP8 rounding, far from the
    # log(vocab) of a random init.
    assert metrics[0]["step"] == 0 and metrics[0]["val_loss"] == pytest.approx(expected, rel=2e-3)
    assert abs(expected - math.log(320)) > 0.1
    assert metrics[-1]["val_loss"] < metrics[0]["val_loss"]  # it trained


@pytest.mark.slow
def test_validate_an_hf_fine_tune(hf_root):
    path = _recipe_yaml(hf_root / "val.yaml", hf_root, "val", validate__candidates=["current"],
                        validate__seeds=2, validate__margin=0.5, validate__final_window=2,
                        train__eval_every=4)
    code = main(["validate", "--quiet", path])
    summary = json.loads((hf_root / "val" / "summary.json").read_text())
    assert code in (0, 1, 3) and summary["verdict"] in ("pass", "fail", "inconclusive")
    assert {"current"} <= set(summary["candidates"])


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"activations": "static"}, {"weight_block": 32}], ids=["dynamic",
                                                                                                  "static", "block"])
def test_export_folder_loads_in_transformers(hf_root, hf_run, tmp_path, options):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "fp8"
    result = export_hf_folder(hf_run, out, **options)
    assert result["fp8_layers"] == 14
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True)
    ours = load_hf_export(out)
    run = load_run(hf_run)
    batches = build_data(run.cfg).val_batches()
    agreement = compare_logits(ours, theirs, batches, autocast=False)
    assert agreement["max_abs_logit_diff"] < 1e-3 and agreement["top1_agreement"] >= 0.99
    source = compare_logits(run.model, ours, batches, autocast=False)
    assert source["mean_kl"] < 1e-3 and source["top1_agreement"] > 0.9
    text = (hf_root / "docs" / "doc0.txt").read_text()[:500]
    assert AutoTokenizer.from_pretrained(str(out))(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(hf_root / "tokenizer"))(text)["input_ids"]


@pytest.mark.slow
def test_export_layout_against_numpy(hf_run, tmp_path):
    out = tmp_path / "fp8"
    export_hf_folder(hf_run, out)
    config = json.loads((out / "config.json").read_text())
    scheme = config["quantization_config"]
    group = scheme["config_groups"]["group_0"]
    assert scheme["quant_method"] == "compressed-tensors" and scheme["format"] == "float-quantized"
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["strategy"] == "token"
    assert group["input_activations"]["dynamic"] is True and scheme["ignore"] == ["lm_head"]
    tensors = load_file(str(out / "model.safetensors"))
    master = load_file(str(sorted((hf_run / "checkpoints").glob("step_*"))[-1] / "model.safetensors"))
    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        w = master[f"hf.{layer}.weight"].numpy()  # fp32 master weights, (out, in)
        scale = (np.abs(w).max(axis=1, keepdims=True).astype(np.float64) / 448).astype(np.float32)
        codes = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        assert tensors[f"{layer}.weight"].dtype == torch.float8_e4m3fn
        np.testing.assert_array_equal(tensors[f"{layer}.weight_scale"].numpy(), scale)
        np.testing.assert_array_equal(tensors[f"{layer}.weight"].view(torch.uint8).numpy(), codes)
    assert tensors["lm_head.weight"].dtype == torch.bfloat16 and "hf.lm_head.weight" not in tensors


def test_decoder_run_exports_as_llama(tiny_fp8_run, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "llama"
    assert main(["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(out), "--no-check"]) == 0
    theirs = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True)
    assert type(theirs).__name__ == "LlamaForCausalLM"
    run = load_run(tiny_fp8_run)
    batches = build_data(run.cfg).val_batches()[:1]
    agreement = compare_logits(load_hf_export(out), theirs, batches, autocast=False)
    assert agreement["max_abs_logit_diff"] < 1e-3 and agreement["top1_agreement"] >= 0.99
    assert compare_logits(run.model, theirs, batches, autocast=False)["mean_kl"] < 1e-3  # the mapping is right


@pytest.mark.parametrize("args, match", [(["--format", "e4m3fnuz"], "no FNUZ"),
                                         (["--format", "e4m3fn", "--weight-block", "40"], "multiple of 16"),
                                         (["--format", "e4m3fn", "--weight-block", "128"], "must divide")])
def test_export_folder_refusals(tiny_fp8_run, tmp_path, capsys, args, match):
    out = tmp_path / "out"
    assert main(["export", str(tiny_fp8_run), "--out", str(out), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(match, err)
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_is_not_replaced_without_force(tiny_fp8_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    assert main(["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(out), "--no-check"]) == 2
    assert "already exists" in capsys.readouterr().err and (out / "keep.txt").read_text() == "precious"
    # --force replaces only a folder fp8train wrote: this one is the user's, and stays
    assert main(["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(out), "--force"]) == 2
    assert "did not write" in capsys.readouterr().err and (out / "keep.txt").read_text() == "precious"
    export = tmp_path / "export"
    assert main(["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(export), "--no-check"]) == 0
    assert main(["export", str(tiny_fp8_run), "--format", "e4m3fn", "--out", str(export), "--force"]) == 0
    assert sorted(p.name for p in export.iterdir()) == [".fp8train-output", "config.json", "generation_config.json",
                                                       "model.safetensors"]
    assert "top-1 agreement" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "out"]  # no temporary folders left


@pytest.mark.slow
def test_kv_eval_on_an_hf_model(hf_run):
    run = load_run(hf_run)
    model = run.model
    x, _ = build_data(run.cfg).val_batches()[0]
    seen = []

    def identity(k, v, layer_idx):
        seen.append((layer_idx, tuple(k.shape), tuple(v.shape)))
        return k, v

    with torch.no_grad():
        plain = model(x)[0]
        with kv_transforms(model, identity):
            hooked = model(x)[0]
        with kv_transforms(model, bf16_cache):
            bf16 = model(x)[0]
    assert torch.equal(plain, hooked)  # the hook itself changes nothing
    assert seen == [(i, (4, 1, 32, 32), (4, 1, 32, 32)) for i in range(2)]  # (B, n_kv_heads, T, head_dim)
    assert not torch.equal(plain, bf16)  # and what it returns is what attention reads
    result = kv_eval(hf_run, KvEvalOptions(formats=("e4m3fn",), gen_prompts=2, gen_tokens=4), log=lambda m: None)
    assert result["model"] == {"n_layers": 2, "n_kv_heads": 1, "head_dim": 32, "seq_len": 32}
    cells = {c["cache"]: c for c in result["cells"]}
    fp8 = next(c for label, c in cells.items() if label.startswith("e4m3fn"))
    assert cells["bf16"]["overall"]["kl"]["mean"] == 0.0
    assert 0 < fp8["overall"]["kl"]["mean"] < 1e-2


@pytest.mark.slow
def test_readme_flow_with_the_shipped_script_and_recipe(tmp_path, monkeypatch):
    """README's HF flow, shortened: scripts/make_tiny_hf.py, recipes/hf_tiny.yaml, export, transformers."""
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("make_tiny_hf", repo / "scripts" / "make_tiny_hf.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr("sys.argv", ["make_tiny_hf.py", "hf_tiny", "--steps", "2"])
    script.main()
    recipe = str(repo / "recipes" / "hf_tiny.yaml")
    assert main(["train", "--quiet", recipe, "train.max_steps=4", "train.eval_every=4", "data.max_bytes=300000"]) == 0
    assert json.loads((tmp_path / "runs" / "hf_tiny" / "summary.json").read_text())["fp8_layers"] == 14
    assert main(["export", "runs/hf_tiny", "--format", "e4m3fn", "--out", "hf_tiny/fp8", "--no-check"]) == 0
    tokenizer = AutoTokenizer.from_pretrained("hf_tiny/fp8")
    model = AutoModelForCausalLM.from_pretrained("hf_tiny/fp8", dtype=torch.float32)
    ids = tokenizer("def main(", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)
    x = torch.tensor([tokenizer("import os\nimport sys\n" * 4)["input_ids"][:32]])
    agreement = compare_logits(load_hf_export("hf_tiny/fp8"), model, [(x, None)], autocast=False)
    assert agreement["max_abs_logit_diff"] < 1e-3 and agreement["top1_agreement"] >= 0.99


@pytest.mark.slow
def test_gpt2_fp8_run_loads_back_to_conv1d_and_its_folder_export_is_refused(hf_root, tmp_path, capsys):
    """GPT-2 trains with its Conv1D layers in FP8 (weights held (out, in)); loading the run puts them back in
    Conv1D's (in, out) layout. FP8 weight exports hold nn.Linear weights only (compressed-tensors quantizes
    nn.Linear), so both exports say so instead of writing Conv1D bytes in the wrong layout."""
    make_pretrained(tmp_path / "gpt2", "gpt2")
    path = _recipe_yaml(tmp_path / "gpt2.yaml", hf_root, "gpt2", model__hf_path=str(tmp_path / "gpt2"),
                        train__max_steps=2, train__eval_every=2)
    assert main(["train", "--quiet", path]) == 0
    run = load_run(hf_root / "gpt2")
    master = load_file(str(sorted((hf_root / "gpt2" / "checkpoints").glob("step_*"))[-1] / "model.safetensors"))
    conv = run.model.get_submodule("hf.transformer.h.0.attn.c_attn")
    assert type(conv).__name__ == "Conv1D" and "hf.transformer.h.0.attn.c_attn" in run.fp8_names
    assert torch.equal(conv.weight, master["hf.transformer.h.0.attn.c_attn.weight"])  # checkpointed as (in, out)
    capsys.readouterr()
    assert main(["export", str(hf_root / "gpt2"), "--format", "e4m3fn", "--out", str(tmp_path / "fp8")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Conv1D" in err and not (tmp_path / "fp8").exists()
    assert main(["export", str(hf_root / "gpt2"), "--format", "e4m3fn", "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "Conv1D" in capsys.readouterr().err and not (tmp_path / "x.safetensors").exists()
