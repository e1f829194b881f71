"""The opt-in for nn.Linear subclasses (issue 43, point 11): `policy.linear_subclasses` converts Falcon's
FalconLinear like nn.Linear, after checking on a random input that its forward is x @ W.T + b; a subclass that
computes something else, or a class name the model lacks, is refused before anything is swapped. References:
each layer's output before the swap (a plain matmul), compared by SQNR as nn.Linear is in test_linear.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import fp8train
from fp8train.nn.convert import LayerPolicy
from fp8train.nn.linear import Fp8Linear
from fp8train.training.config import layer_policy_from_config, load_config

pytestmark = pytest.mark.usefixtures("single_thread")
FALCON_LINEARS = ("self_attention.query_key_value", "self_attention.dense", "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")


def _falcon():
    torch.manual_seed(0)
    config = AutoConfig.for_model("falcon", vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  max_position_embeddings=64)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()))


def test_falcon_linear_is_skipped_by_default_naming_the_key():
    report = fp8train.convert_to_fp8(_falcon(), "current", dry_run=True)
    assert not report.converted
    reasons = dict(report.skipped)
    assert "policy.linear_subclasses: [FalconLinear]" in reasons["transformer.h.0.mlp.dense_h_to_4h"]


@pytest.mark.parametrize("recipe_name", ["current", "delayed", "rowwise"])
def test_falcon_linear_converts_when_named_and_computes_its_matmul_in_fp8(recipe_name):
    model = _falcon()
    originals = {f"transformer.h.{i}.{n}": model.get_submodule(f"transformer.h.{i}.{n}")
                 for i in range(2) for n in FALCON_LINEARS}
    assert {type(m).__name__ for m in originals.values()} == {"FalconLinear"}
    with torch.no_grad():
        before = {name: m(torch.randn(4, m.in_features, generator=torch.Generator().manual_seed(2)))
                  for name, m in originals.items()}
    report = fp8train.convert_to_fp8(model, recipe_name, LayerPolicy(linear_subclasses=("FalconLinear",)))
    assert sorted(n for n, _ in report.converted) == sorted(originals)
    for name, old in originals.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, Fp8Linear) and layer.weight is old.weight  # the same Parameter, no copy
        with torch.no_grad():
            got = layer(torch.randn(4, old.in_features, generator=torch.Generator().manual_seed(2)))
        assert _sqnr_db(before[name], got) > 20, name  # E4M3 inputs and weights: ~30 dB on Gaussian data
    ids = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and model.get_submodule("transformer.h.0.mlp.dense_4h_to_h").weight.grad is not None


class _DoubledLinear(nn.Linear):
    """Not a plain linear: twice x @ W.T + b."""

    def forward(self, x):
        return 2 * F.linear(x, self.weight, self.bias)


def test_a_named_subclass_that_is_not_linear_is_refused_before_any_swap():
    model = nn.Sequential(nn.Linear(64, 64), _DoubledLinear(64, 64))
    with pytest.raises(ValueError, match=r"policy.linear_subclasses: 1 \(_DoubledLinear\) does not compute"):
        fp8train.convert_to_fp8(model, "current", LayerPolicy(linear_subclasses=("_DoubledLinear",)))
    assert type(model[0]) is nn.Linear and type(model[1]) is _DoubledLinear


def test_a_class_name_the_model_lacks_is_refused():
    with pytest.raises(ValueError, match=r"'FalconLinaer' is no nn.Linear subclass of this model.*FalconLinear"):
        fp8train.convert_to_fp8(_falcon(), "current", LayerPolicy(linear_subclasses=("FalconLinaer",)))


def test_the_config_key_reaches_the_layer_policy():
    policy = layer_policy_from_config(load_config(None, ["policy.linear_subclasses=[FalconLinear]"]))
    assert policy.linear_subclasses == ("FalconLinear",)
    with pytest.raises(ValueError, match=r"policy.linear_subclasses\[0\]='not a name'"):
        load_config(None, ["policy.linear_subclasses=[not a name]"])
