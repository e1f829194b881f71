"""convert_to_fp8 and LayerPolicy on a small transformer-shaped stack; a few training steps per recipe."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8train.nn.convert import ConversionReport, LayerPolicy, block_index, convert_to_fp8, fp8_layers
from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.nn.recipes import RECIPE_NAMES, recipe

RECIPES = RECIPE_NAMES  # every preset, mxfp8 included


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny tensors: a second OpenMP thread only adds sync


class TinyLM(nn.Module):
    """Llama-shaped names: embed, layers.{i}.attn.{q,k,v,o}_proj, layers.{i}.mlp.{gate_proj,up_proj,down_proj},
    an MoE-style router layers.{i}.mlp.gate, a small and an odd-sized Linear, lm_head."""

    def __init__(self, vocab=96, d=64, hidden=128, n_layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList()
        for _ in range(n_layers):
            block = nn.Module()
            block.attn = nn.Module()
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(block.attn, name, nn.Linear(d, d, bias=False))
            block.mlp = nn.Module()
            block.mlp.gate_proj = nn.Linear(d, hidden, bias=False)
            block.mlp.up_proj = nn.Linear(d, hidden, bias=False)
            block.mlp.down_proj = nn.Linear(hidden, d, bias=False)
            block.mlp.gate = nn.Linear(d, 64, bias=False)  # router: 64 "experts", only used for its norm
            self.layers.append(block)
        self.small = nn.Linear(d, 32)    # < min_features
        self.odd = nn.Linear(d, 72)      # 72 is not a multiple of 16
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)  # (B, T, d)
        for block in self.layers:
            a = block.attn
            q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
            att = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)  # (B, T, T); no mask, fine for a test
            x = x + a.o_proj(att @ v)
            m = block.mlp
            gate_weight = torch.sigmoid(m.gate(x).mean(-1, keepdim=True))
            x = x + gate_weight * m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
        x = x + 0 * (self.small(x).sum() + self.odd(x).sum())
        return self.lm_head(x)


BLOCK_LINEARS = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                 "mlp.down_proj"]


def test_default_policy_report():
    model = TinyLM()
    linear_params = {name: m.weight for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    report = convert_to_fp8(model, recipe("current"))
    assert isinstance(report, ConversionReport)
    converted = [name for name, _ in report.converted]
    assert converted == [f"layers.{i}.{n}" for i in range(3) for n in BLOCK_LINEARS]
    skipped = dict(report.skipped)
    assert set(skipped) == {"layers.0.mlp.gate", "layers.1.mlp.gate", "layers.2.mlp.gate", "small", "odd",
                            "lm_head"}
    assert "excluded by pattern" in skipped["layers.1.mlp.gate"] and "gate" in skipped["layers.1.mlp.gate"]
    assert "excluded by pattern" in skipped["lm_head"]
    assert skipped["small"] == "out_features=32 < min_features=64"
    assert skipped["odd"] == "out_features=72 is not a multiple of 16"
    # Swapped in place, reusing the very same Parameter objects.
    for name, layer in fp8_layers(model):
        assert isinstance(layer, Fp8Linear) and layer.weight is linear_params[name]
    assert [n for n, _ in fp8_layers(model)] == converted
    assert type(model.lm_head) is nn.Linear and type(model.layers[0].mlp.gate) is nn.Linear
    text = str(report)
    assert "21 converted, 6 skipped" in text and "layers.2.mlp.down_proj" in text and "lm_head" in text
    assert 0 < report.converted_frac < 1


def test_report_text_line_by_line():
    """The printed report: a header with the counts and the FP8 share of linear weights, then one row per layer,
    names padded to the longest (here 11 characters), kind 'fp8' or 'skip' in 4 columns."""
    report = ConversionReport(recipe=recipe("current"), converted=[("a.q", "why a")],
                              skipped=[("long.name.x", "why x")], converted_params=3, skipped_params=1)
    assert str(report).split("\n") == [
        "FP8 conversion (current:e4m3/e4m3/e5m2:m0): 1 converted, 1 skipped, 75.0% of GEMM weights in FP8",
        "layer" + " " * 6 + "  " + " " * 4 + "  reason",
        "a.q" + " " * 8 + "  fp8   why a",
        "long.name.x  skip  why x",
    ]


def test_a_transformers_conv1d_is_converted_with_its_weight_transposed_and_its_layout_kept():
    from transformers.pytorch_utils import Conv1D  # GPT-2's layer: y = x @ weight + bias, weight (in, out)

    torch.manual_seed(0)
    model = nn.Module()
    model.c_fc = Conv1D(128, 64)  # nf=128 outputs, nx=64 inputs
    model.plain = nn.Linear(64, 64)
    weight, bias = model.c_fc.weight.detach().clone(), model.c_fc.bias.detach().clone()
    x = torch.randn(4, 64)
    expected = x @ weight + bias  # what the Conv1D computed, before the swap
    report = convert_to_fp8(model, recipe("current", backend="emulated"))
    assert [name for name, _ in report.converted] == ["c_fc", "plain"]
    layer = model.c_fc
    assert isinstance(layer, Fp8Linear) and layer.conv1d_layout and not model.plain.conv1d_layout
    assert (layer.in_features, layer.out_features) == (64, 128)
    assert torch.equal(layer.weight, weight.t()) and torch.equal(layer.bias, bias)
    assert torch.equal(layer.state_dict()["weight"], weight)  # the state dict keeps Conv1D's (in, out)
    torch.testing.assert_close(layer(x), expected, rtol=0.1, atol=0.1)  # FP8 numerics: same map, not bits


def test_skip_first_and_last_blocks():
    model = TinyLM(n_layers=4)
    report = convert_to_fp8(model, "delayed", LayerPolicy(skip_first_blocks=1, skip_last_blocks=1))
    assert {block_index(n) for n, _ in report.converted} == {1, 2}
    reasons = dict(report.skipped)
    assert reasons["layers.0.attn.q_proj"] == "block 0 is in the first 1 (skip_first_blocks)"
    assert reasons["layers.3.mlp.up_proj"] == "block 3 is in the last 1 of 4 (skip_last_blocks)"


def test_custom_policy_exclude_and_sizes():
    model = TinyLM()
    policy = LayerPolicy(min_features=16, divisible_by=8, exclude=[r"\.attn\."], exclude_defaults=False)
    names = [n for n, _ in convert_to_fp8(model, "current", policy).converted]
    assert "small" in names and "odd" in names and "lm_head" in names and "layers.0.mlp.gate" in names
    assert not any(".attn." in n for n in names)


def test_block_index():
    assert block_index("layers.12.mlp.up_proj") == 12
    assert block_index("model.layers.3.self_attn.q_proj") == 3
    assert block_index("lm_head") is None and block_index("mylayers.3.x") is None


def test_nothing_eligible_warns_and_reports():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.warns(UserWarning, match="no nn.Linear was eligible"):
        report = convert_to_fp8(model, "current")
    assert report.converted == [] and len(report.skipped) == 2
    assert all(type(m) is not Fp8Linear for m in model)


def test_already_converted_and_subclasses_are_skipped():
    model = nn.Sequential(nn.Linear(64, 64))
    convert_to_fp8(model, "current")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = convert_to_fp8(model, "current")
    assert again.skipped == [("0", "already Fp8Linear")]
    mha = nn.MultiheadAttention(64, 4)  # its out_proj is a Linear subclass used through its weight only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = convert_to_fp8(nn.Sequential(mha), "current")
    assert "subclass of nn.Linear" in dict(report.skipped)["0.out_proj"]
    with pytest.warns(UserWarning):
        report = convert_to_fp8(nn.Linear(64, 64), "current")
    assert "wrap it in a container" in report.skipped[0][1]


@pytest.mark.parametrize("kwargs, key", [(dict(min_features=-1), "min_features"), (dict(divisible_by=0), "divisible_by"),
                                         (dict(exclude=["(unclosed"]), "exclude"),
                                         (dict(skip_last_blocks=1.5), "skip_last_blocks")])
def test_policy_validation(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LayerPolicy(**kwargs)


def test_report_on_fp8train_decoder():
    from fp8train.training import config
    from fp8train.training.models import decoder as model_mod

    model = model_mod.Decoder(config.ModelConfig(n_layers=2, d_model=64, n_heads=4, seq_len=16, vocab_size=64))
    report = convert_to_fp8(model, "current")
    names = {n for n, _ in report.converted}
    assert {f"layers.{i}.{n}" for i in range(2) for n in BLOCK_LINEARS} == names
    assert "lm_head" in dict(report.skipped)


@pytest.mark.parametrize("name", RECIPES)
def test_tiny_model_trains_with_each_recipe(name):
    torch.manual_seed(0)
    model = TinyLM()
    convert_to_fp8(model, recipe(name, amax_history_len=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 96, (8, 33))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    losses = []
    for _ in range(12):
        for micro in range(2):  # gradient accumulation over two micro-batches
            logits = model(inputs[micro * 4:(micro + 1) * 4])
            loss = F.cross_entropy(logits.reshape(-1, 96), targets[micro * 4:(micro + 1) * 4].reshape(-1)) / 2
            loss.backward()
            losses.append(loss.item() * 2) if micro == 0 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_fp8_scales(model)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses
    if name == "delayed":
        layer = model.layers[0].attn.q_proj
        assert layer.input_initialized.item() and layer.grad_output_initialized.item()
        assert (layer.input_amax_history > 0).sum().item() == 12


def test_the_report_counts_every_converted_parameter():
    """converted_params sums the weights of every converted layer, skipped_params those of the skipped ones
    (here two 16x32 / 32x16 layers converted, a 32x8 one skipped: 8 is not a multiple of 16)."""
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16, bias=False), nn.Linear(16, 8))
    report = convert_to_fp8(model, recipe("current"), LayerPolicy(min_features=1))
    assert report.converted_params == 16 * 32 + 32 * 16 and report.skipped_params == 16 * 8
