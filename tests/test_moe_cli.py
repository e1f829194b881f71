"""A local Hugging Face mixture-of-experts model (tiny Qwen3-MoE: 4 experts, top-2, saved by transformers'
save_pretrained) through every fp8train command: train (model.hf_path) with FP8 experts, validate (2 candidates),
export --format hf and --format e4m3fn (each loaded back by transformers 5.25 + compressed-tensors and compared on
logits) as real `fp8train` processes; the single-file export, kv-eval, report, layer-recipes and the refusals through the
same CLI entry point in this process. What cannot be done for experts is refused in one line with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import Commands
from hf_helpers import make_pretrained, make_text_folder, make_tokenizer

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow, pytest.mark.extended]

EXPERTS = "model.layers.{layer}.mlp.experts"


def _config(root: Path, **changes) -> dict:
    config = {
        "run": {"dir": str(root / "runs"), "name": "moe"},
        "model": {"hf_path": str(root / "pretrained"), "seq_len": 32},
        "data": {"tokenizer": str(root / "tokenizer"), "path": str(root / "text")},
        "train": {"max_steps": 12, "batch_size": 4, "lr": 1e-3, "eval_every": 4, "eval_batches": 2,
                  "device": "cpu", "threads": 1, "autocast": "none"},
        "optim": {"warmup_steps": 2},
        "fp8": {"recipe": "current"},
        "policy": {"min_features": 32},
        "log": {"wandb": "disabled", "telemetry_every": 4, "shadow_recipes": ["rowwise"]},
        "validate": {"candidates": ["current", "delayed"], "seeds": 2, "final_window": 2},
    }
    for section, values in changes.items():
        config[section] = {**config.get(section, {}), **values}
    return config


def _fp8train(*args: str, ok: bool = True):
    proc = Commands.run(Commands.fp8train(*args), timeout=600)
    if ok:
        assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _in_process(capsys, *args: str) -> tuple[int, str, str]:
    """The same command through fp8train's CLI entry point in this process (saves a process start of imports)."""
    from fp8train.cli import main

    capsys.readouterr()
    code = main(list(args))
    said = capsys.readouterr()
    return code, said.out, said.err


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cli")
    make_pretrained(root / "pretrained", "qwen3_moe", steps=10)
    make_tokenizer(root / "tokenizer")
    make_text_folder(root / "text")
    (root / "moe.yaml").write_text(yaml.safe_dump(_config(root)))
    _fp8train("train", str(root / "moe.yaml"))
    return root


def _source_and_val(root: Path):
    from fp8train.serving.run_loading import load_run
    from fp8train.training.data.corpus import build_data

    run = load_run(root / "runs" / "moe")
    return run, [x for x, _ in build_data(run.cfg).val_batches()[:2]]


def test_the_fine_tune_trains_every_expert_in_fp8_and_checkpoints_their_state(moe):
    run = moe / "runs" / "moe"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 12
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in metrics if "val_loss" in r]
    assert val[-1] < val[0]  # fine-tuning moved the pretrained weights the right way
    from fp8train.training.runs.sharded_checkpoint import latest_loadable_checkpoint, read_model_state
    state = read_model_state(latest_loadable_checkpoint(run / "checkpoints"))
    for layer in (0, 1):
        for proj in ("gate_up_proj", "down_proj"):
            amax = state[f"hf.{EXPERTS.format(layer=layer)}.{proj}_fp8.weight_nonfinite_amax_count"]
            assert tuple(amax.shape) == (4,)  # one scaling slot per expert


def test_validate_on_the_moe_model_gives_a_verdict_per_candidate(moe):
    proc = _fp8train("validate", str(moe / "moe.yaml"), "run.name=moe_val", "train.max_steps=4",
                     "train.eval_every=2", ok=False)
    assert proc.returncode in (0, 1, 3), proc.stderr[-3000:]  # PASS / FAIL / INCONCLUSIVE, not an error
    rows = {line.split()[0]: line.split()[-1] for line in proc.stdout.splitlines()
            if line.strip().startswith(("current ", "delayed "))}
    assert set(rows) == {"current", "delayed"} and set(rows.values()) <= {"PASS", "FAIL", "INCONCLUSIVE"}, proc.stdout
    assert (moe / "runs" / "moe_val" / "report.md").is_file()
    # 2 seeds x (baseline + 2 candidates), every one a finished run of the MoE model
    summaries = list((moe / "runs" / "moe_val" / "runs").rglob("summary.json"))
    assert len(summaries) == 6 and all(json.loads(p.read_text())["status"] == "completed" for p in summaries)


def test_dense_hf_export_loads_in_transformers_with_the_same_logits(moe):
    from transformers import AutoModelForCausalLM

    _fp8train("export", str(moe / "runs" / "moe"), "--format", "hf", "--out", str(moe / "dense"))
    run, batches = _source_and_val(moe)
    loaded = AutoModelForCausalLM.from_pretrained(str(moe / "dense"), dtype=torch.float32).eval()
    assert tuple(loaded.model.layers[0].mlp.experts.gate_up_proj.shape) == (4, 128, 64)  # the fused layout
    with torch.no_grad():
        for x in batches:
            assert torch.equal(loaded(x).logits, run.model(x)[0] if isinstance(run.model(x), tuple)
                               else run.model(x).logits)


def _e4m3_per_channel(weight: np.ndarray) -> np.ndarray:
    """Reference: one scale per row, amax / 448, values rounded to e4m3fn by ml_dtypes, dequantized (float64)."""
    scale = np.abs(weight).max(axis=1, keepdims=True).astype(np.float32) / np.float32(448.0)
    scale = np.where(scale == 0, np.float32(1.0), scale)
    codes = (weight.astype(np.float32) / scale).astype(ml_dtypes.float8_e4m3fn)
    return codes.astype(np.float64) * scale.astype(np.float64)


def test_fp8_export_writes_experts_that_transformers_loads(moe):
    from transformers import AutoModelForCausalLM

    from fp8train.serving.export import compare_logits
    from fp8train.serving.hf_export import load_hf_export

    proc = _fp8train("export", str(moe / "runs" / "moe"), "--format", "e4m3fn", "--out", str(moe / "fp8"))
    assert "4 FP8 expert projections" in proc.stdout
    tensors = load_file(str(moe / "fp8" / "model.safetensors"))
    key = f"{EXPERTS.format(layer=1)}.3.up_proj"
    assert tensors[f"{key}.weight"].dtype == torch.float8_e4m3fn and tuple(tensors[f"{key}.weight_scale"].shape) == (64, 1)
    assert not any(k.endswith("experts.gate_up_proj") for k in tensors)
    run, batches = _source_and_val(moe)
    loaded = AutoModelForCausalLM.from_pretrained(str(moe / "fp8"), dtype=torch.float32).eval()
    # transformers fused the per-expert FP8 weights back, dequantized: equal to the reference rounding of the source
    source = getattr(run.model.hf.model.layers[1].mlp.experts, "gate_up_proj").detach().double().numpy()
    got = loaded.model.layers[1].mlp.experts.gate_up_proj.detach().double().numpy()
    for e in range(4):
        expected = np.concatenate([_e4m3_per_channel(source[e, :64]), _e4m3_per_channel(source[e, 64:])])
        np.testing.assert_allclose(got[e], expected, rtol=1e-6, atol=0)
    assert not np.array_equal(got, source)  # (FP8 rounding did change the weights)
    ours = load_hf_export(moe / "fp8")
    pairs = [(x, None) for x in batches]
    theirs_vs_ours = compare_logits(loaded, ours, pairs, autocast=False)
    assert theirs_vs_ours["max_abs_logit_diff"] < 1e-3 and theirs_vs_ours["top1_agreement"] >= 0.99, theirs_vs_ours
    vs_source = compare_logits(run.model, loaded, pairs, autocast=False)
    assert vs_source["mean_kl"] < 2e-3 and vs_source["top1_agreement"] >= 0.9, vs_source


@pytest.mark.parametrize("arch", ["qwen2_moe", "olmoe", "deepseek_v3"])
def test_fp8_export_of_other_moe_types_loads_in_transformers(moe, tmp_path, arch):
    """The same per-expert layout for the other model types transformers converts the same way, exported straight
    from a pretrained folder (in this process): transformers' load equals fp8train's own loader's."""
    from transformers import AutoModelForCausalLM

    from fp8train.serving.export import compare_logits
    from fp8train.serving.hf_export import export_hf_folder, load_hf_export
    from fp8train.serving.run_loading import load_run

    make_pretrained(tmp_path / "pre", arch, steps=3)
    result = export_hf_folder(tmp_path / "pre", tmp_path / "fp8", tokenizer=str(moe / "tokenizer"))
    assert result["fp8_experts"] == 4  # 2 layers x (gate_up_proj, down_proj)
    source = load_run(tmp_path / "pre", tokenizer=str(moe / "tokenizer")).model
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fp8"), dtype=torch.float32).eval()
    pairs = [(torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0)), None)]
    theirs_vs_ours = compare_logits(theirs, load_hf_export(tmp_path / "fp8"), pairs, autocast=False)
    assert theirs_vs_ours["max_abs_logit_diff"] < 1e-3, theirs_vs_ours
    vs_source = compare_logits(source, theirs, pairs, autocast=False)
    assert vs_source["mean_kl"] < 2e-2 and vs_source["top1_agreement"] >= 0.9, vs_source
    experts = theirs.model.layers[0].mlp.experts.down_proj.detach()
    original = source.hf.model.layers[0].mlp.experts.down_proj.detach()
    ratio = (experts / original)[original.abs() > 1e-3]
    assert not torch.equal(experts, original) and float((ratio - 1).abs().max()) <= 2 ** -4  # E4M3's rounding


def test_what_the_fp8_export_cannot_do_for_experts_is_refused_in_one_line(moe, tmp_path, capsys):
    code, _, err = _in_process(capsys, "export", str(moe / "runs" / "moe"), "--format", "e4m3fn", "--activations",
                               "static", "--out", str(tmp_path / "static"))
    assert code == 2 and "routed tokens" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "static").exists()
    # a model type whose per-expert layout was not checked against transformers (Mixtral: w1/w2/w3), exported
    # straight from its pretrained folder (export reads Hugging Face folders too)
    make_pretrained(tmp_path / "mixtral", "mixtral", steps=1)
    code, _, err = _in_process(capsys, "export", str(tmp_path / "mixtral"), "--format", "e4m3fn", "--tokenizer",
                               str(moe / "tokenizer"), "--out", str(tmp_path / "mixtral_fp8"))
    assert code == 2 and "'mixtral' is not" in err and "--format hf" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "mixtral_fp8").exists()


def test_single_file_export_says_the_experts_stay_bf16(moe, capsys):
    code, out, _ = _in_process(capsys, "export", str(moe / "runs" / "moe"), "--format", "e4m3fn", "--out",
                               str(moe / "one.safetensors"))
    assert code == 0 and "4 FP8 expert projections written in bf16" in out
    tensors = load_file(str(moe / "one.safetensors"))
    assert tensors[f"hf.{EXPERTS.format(layer=0)}.gate_up_proj"].dtype == torch.bfloat16


def test_kv_eval_report_and_layer_recipes_run_on_the_moe_run(moe, capsys):
    run = str(moe / "runs" / "moe")
    assert _in_process(capsys, "kv-eval", run)[0] == 0
    assert (moe / "runs" / "moe" / "kv_eval" / "kv_eval.json").is_file()
    assert _in_process(capsys, "report", run)[0] == 0
    assert (moe / "runs" / "moe" / "report.md").is_file()
    assert _in_process(capsys, "layer-recipes", run, "--out", str(moe / "layers.yaml"), "--repeats", "1")[0] == 0
    plan = (moe / "layers.yaml").read_text()
    assert "# experts: 4 FP8 expert projections are not chosen per layer" in plan
    overrides = yaml.safe_load(plan)["policy"]["overrides"]
    assert len(overrides) == 8 and not any("experts" in k for k in overrides)  # the 8 attention Linears


def test_a_converted_moe_folder_exports_the_experts_its_record_names(moe, tmp_path):
    """A folder saved by transformers' save_pretrained after convert_to_fp8 records its FP8 experts in
    config.fp8train; the export takes them from there (a policy that would differ is not consulted), and a record
    naming no experts projection of the model is refused before anything is written."""
    import json

    from transformers import AutoModelForCausalLM

    from fp8train.nn.convert import LayerPolicy, convert_to_fp8
    from fp8train.serving.hf_export import export_hf_folder

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(moe / "pretrained"), dtype=torch.float32)
    # only layer 1's down_proj in FP8 (and no Linear): the default policy would convert every projection
    convert_to_fp8(model, "current", LayerPolicy(min_features=32, exclude=(r"self_attn\.", r"layers\.0\.",
                                                                           r"gate_up_proj$")))
    model.save_pretrained(str(tmp_path / "saved"))
    result = export_hf_folder(tmp_path / "saved", tmp_path / "fp8", tokenizer=str(moe / "tokenizer"))
    tensors = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    fp8_keys = sorted(k for k, v in tensors.items() if v.dtype == torch.float8_e4m3fn)
    assert result["fp8_experts"] == 1 and fp8_keys == [f"{EXPERTS.format(layer=1)}.{e}.down_proj.weight"
                                                       for e in range(4)]
    assert tensors[f"{EXPERTS.format(layer=1)}.gate_up_proj"].dtype == torch.bfloat16  # kept in high precision
    from fp8train.serving.export import export_run
    with pytest.raises(ValueError, match="are all experts, which this single-file format does not hold"):
        export_run(tmp_path / "saved", tmp_path / "one.safetensors", tokenizer=str(moe / "tokenizer"))
    assert not (tmp_path / "one.safetensors").exists()
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    config["fp8train"]["experts"] = ["model.layers.1.mlp.experts.router_proj"]
    (tmp_path / "saved" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="records FP8 experts 'model.layers.1.mlp.experts.router_proj'"):
        export_hf_folder(tmp_path / "saved", tmp_path / "fp8_bad", tokenizer=str(moe / "tokenizer"))
    assert not (tmp_path / "fp8_bad").exists()
