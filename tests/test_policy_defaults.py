"""One layer policy: `convert_to_fp8(model, recipe)` and `fp8train train` (config `policy` section left unset)
convert exactly the same layers of the same model, because the config takes its defaults from LayerPolicy."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml

from fp8train import cli
from fp8train.nn.convert import DEFAULT_EXCLUDE, LayerPolicy, convert_to_fp8
from fp8train.training.config import PolicyConfig, layer_policy_from_config, load_config
from fp8train.training.models.decoder import build_model

# d_model 128 and ffn 352: every block linear is >= 64 (LayerPolicy's min_features) but < 256 (what the config
# used to default to), so the two defaults disagreeing shows as a different set of converted layers.
MODEL = {"n_layers": 2, "d_model": 128, "n_heads": 2, "seq_len": 16}
BLOCK_LINEARS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj")


def test_policy_section_defaults_are_layer_policy_defaults():
    policy = layer_policy_from_config(load_config(None, []))
    assert policy == LayerPolicy()
    assert PolicyConfig().min_features == LayerPolicy().min_features
    assert tuple(PolicyConfig().exclude) == () and PolicyConfig().exclude_defaults is True
    assert LayerPolicy().exclude_patterns == DEFAULT_EXCLUDE


@pytest.mark.parametrize("name", ["score", "model.score", "classifier", "head.classifier", "output_proj",
                                  "layers.0.mlp.shared_expert_gate", "wte", "model.tok_embeddings"])
@pytest.mark.parametrize("match", [re.search, re.match, re.fullmatch])
def test_extra_default_excludes_hold_under_every_match(name, match):
    assert any(match(p, name) for p in DEFAULT_EXCLUDE)


@pytest.mark.slow
@pytest.mark.parametrize("fp8_recipe", ["delayed", "block"])
def test_train_converts_the_layers_convert_to_fp8_converts(tmp_path, fp8_recipe):
    config = {"run": {"dir": str(tmp_path / "runs"), "name": "same"}, "model": MODEL,
              "data": {"max_bytes": 200_000},
              "train": {"max_steps": 1, "batch_size": 2, "eval_batches": 1, "device": "cpu", "threads": 1,
                        "autocast": "none"},
              "optim": {"warmup_steps": 0}, "fp8": {"recipe": fp8_recipe},
              "log": {"wandb": "disabled", "telemetry_every": 0}, "checkpoint": {"save_final": False}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli.main(["train", str(path), "--quiet"]) == 0
    trained = json.loads((tmp_path / "runs" / "same" / "summary.json").read_text())["conversion"]

    torch.manual_seed(0)
    report = convert_to_fp8(build_model(load_config(str(path)).model), fp8_recipe)  # the library's default policy
    assert trained["converted"] == [n for n, _ in report.converted]
    assert trained["skipped"] == [[n, r] for n, r in report.skipped]
    # An independent statement of what the default policy means for this model: every block linear, no head.
    assert set(trained["converted"]) == {f"layers.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS}
    assert "lm_head" in dict(trained["skipped"])
