"""transformers 5's 3-D experts (Qwen3-MoE, Mixtral, gpt-oss) in FP8 through the experts interface: converted by
convert_to_fp8 with the report counting them, trained with falling loss, round-tripped through save_pretrained,
and each experts module bit for bit equal to its experts' tokens through dense Fp8Linear layers. Tiny models
built from local configs; nothing is downloaded."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from fp8train.nn.convert import LayerPolicy, convert_to_fp8
from fp8train.nn.experts_scaling import ExpertScaling
from fp8train.nn.hf_experts import EXPERTS_IMPLEMENTATION
from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from hf_helpers import TINY_MOE_ARCHS, VOCAB, hf_config

pytestmark = pytest.mark.usefixtures("single_thread")
ARCHS = ["qwen3_moe", "mixtral", "gpt_oss"]   # every test; the other MoE layouts: the smoke test below
MORE_ARCHS = [arch for arch in TINY_MOE_ARCHS if arch not in ARCHS]


def _model(arch, seed=0):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(arch), dtype=torch.float32)


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (4, 32), generator=g)
    x[:, ::2] = 7
    return x


def _experts(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.experts")]


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_convert_train_and_the_report_counts_them(arch):
    model = _model(arch)
    before = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    params = {name: p for name, p in model.named_parameters()}
    report = convert_to_fp8(model, "delayed")
    cfg = model.config
    # what the report must say, from the config alone: 2 layers x 4 experts x (gate_up + down) weights
    h, i, e, k = cfg.hidden_size, (cfg.moe_intermediate_size if arch == "qwen3_moe" else cfg.intermediate_size), 4, 2
    expert_params = cfg.num_hidden_layers * e * (2 * i * h + h * i)
    assert report.kinds["experts"] == [expert_params, 0, cfg.num_hidden_layers * 2 * k * (2 * i * h + h * i), 0]
    converted = [name for name, _ in report.converted]
    for layer in range(2):
        assert f"model.layers.{layer}.mlp.experts.gate_up_proj" in converted
        assert f"model.layers.{layer}.mlp.experts.down_proj" in converted
    # the routers stay high precision and are named; nothing >= 2-D is left out of the percentages
    router = "router" if arch == "gpt_oss" else "gate"
    skipped = dict(report.skipped)
    assert "excluded by pattern" in skipped[f"model.layers.0.mlp.{router}.weight"]
    embed = model.model.embed_tokens.weight.numel()
    gemm_weights = sum(p.numel() for n, p in model.named_parameters()
                       if p.dim() >= 2 and not n.endswith("_bias")) - embed   # (gpt-oss: (E, N) expert biases)
    assert report.converted_params + report.skipped_params == gemm_weights
    assert "of GEMM FLOPs per token" in str(report) and "experts: FP8" in str(report)
    # the Parameters are the same objects, keys and layout; the scaling state is added beside them
    assert {name: p for name, p in model.named_parameters()} == params
    after = model.state_dict()
    assert all(after[key].shape == shape and after[key].dtype == dtype for key, (shape, dtype) in before.items())
    assert isinstance(_experts(model)[0].gate_up_proj_fp8, ExpertScaling)
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, losses = _batch(), []
    for _ in range(5):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        update_fp8_scales(model)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    scaling = _experts(model)[0].down_proj_fp8
    assert scaling.weight_initialized.all() and scaling.input_initialized.any()
    assert (scaling.weight_amax_history[:, :5] > 0).all()  # every expert's weight: one entry per step


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_round_trip_gives_identical_logits(arch, tmp_path):
    model = _model(arch)
    convert_to_fp8(model, "current")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _batch()
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(tmp_path)
    assert "experts_implementation" not in json.loads((tmp_path / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)  # a plain transformers model
    for key, value in reloaded.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
    convert_to_fp8(reloaded, "current")
    model.eval()
    reloaded.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, reloaded(input_ids=x).logits)


def _route(num_tokens, top_k, num_experts, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)])
    index[: num_tokens // 2, 0] = 0   # skewed: expert 0 takes half the tokens; the last expert none
    index[index == num_experts - 1] = 1
    index[: num_tokens // 2, 1] = torch.where(index[: num_tokens // 2, 1] == 0, 2, index[: num_tokens // 2, 1])
    weights = torch.rand(num_tokens, top_k, generator=g)
    return index, weights


@pytest.mark.parametrize("name", ["current", "block"])
@pytest.mark.parametrize("arch", ARCHS)
def test_an_experts_module_equals_its_experts_through_dense_fp8_layers(arch, name):
    """The reference routes by hand: each expert's tokens (in token order) through an Fp8Linear holding that
    expert's gate_up weight (gpt-oss: transposed, with its bias), the model's own gate, an Fp8Linear for down,
    the routing weight, and the fp32 sum over each token's experts."""
    model = _model(arch)
    convert_to_fp8(model, name)
    experts = _experts(model)[0]
    hidden = torch.randn(19, model.config.hidden_size)
    index, weights = _route(19, 2, experts.num_experts)
    got = experts(hidden, index, weights)

    def dense(param, e):
        w = getattr(experts, param)[e].detach()
        w = w.t() if experts.is_transposed else w
        layer = Fp8Linear(w.shape[1], w.shape[0], bias=experts.has_bias, recipe=name)
        with torch.no_grad():
            layer.weight.copy_(w)
            if experts.has_bias:
                layer.bias.copy_(getattr(experts, param + "_bias")[e])
        return layer

    pairs = torch.zeros(19, 2, model.config.hidden_size)
    for e in range(experts.num_experts):
        tok, slot = torch.nonzero(index == e, as_tuple=True)   # token order
        if tok.numel() == 0:
            continue
        out = dense("down_proj", e)(experts._apply_gate(dense("gate_up_proj", e)(hidden[tok])))
        pairs[tok, slot] = out * weights[tok, slot].unsqueeze(-1)
    assert torch.equal(got, pairs.sum(1, dtype=torch.float32))


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_experts_stay_close_to_the_high_precision_experts(arch):
    model = _model(arch)
    experts = _experts(model)[0]
    hidden = torch.randn(64, model.config.hidden_size)
    index, weights = _route(64, 2, experts.num_experts)
    expected = experts(hidden, index, weights)   # transformers' own implementation
    convert_to_fp8(model, "current")
    got = experts(hidden, index, weights)
    sqnr = 10 * torch.log10(expected.pow(2).sum() / (got - expected).pow(2).sum())
    assert sqnr > 20, f"{sqnr:.1f} dB"


def test_policy_keeps_a_projection_out_and_the_report_says_so():
    model = _model("qwen3_moe")
    experts = _experts(model)[0]
    hidden = torch.randn(16, 64)
    index, weights = _route(16, 2, 4)
    report = convert_to_fp8(model, "current", LayerPolicy(exclude=(r"experts\.down_proj$",)))
    skipped = dict(report.skipped)
    assert "excluded by pattern" in skipped["model.layers.0.mlp.experts.down_proj"]
    assert report.kinds["experts"][1] == 2 * 4 * 64 * 64 and report.kinds["experts"][3] == 2 * 2 * 2 * 64 * 64
    assert not hasattr(experts, "down_proj_fp8") and hasattr(experts, "gate_up_proj_fp8")
    out = experts(hidden, index, weights)
    out.sum().backward()
    assert experts.down_proj.grad is not None and torch.isfinite(out).all()


def test_dry_run_leaves_the_experts_and_bad_top_k_is_refused():
    model = _model("mixtral")
    report = convert_to_fp8(model, "current", dry_run=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(report.converted)
    assert not hasattr(_experts(model)[0], "gate_up_proj_fp8") and model.config._experts_implementation != \
        EXPERTS_IMPLEMENTATION
    model.config.num_experts_per_tok = 5
    with pytest.raises(ValueError, match="top-k = 5"):
        convert_to_fp8(model, "current")


def test_an_experts_module_left_out_runs_what_it_ran_before():
    model = _model("qwen3_moe")
    kept = _experts(model)[1]
    hidden = torch.randn(16, 64)
    index, weights = _route(16, 2, 4)
    expected = kept(hidden, index, weights)
    report = convert_to_fp8(model, "current", LayerPolicy(exclude=(r"layers\.1\.mlp\.experts$",)))
    assert model.config._experts_implementation == EXPERTS_IMPLEMENTATION      # layer 0's experts are FP8
    assert "excluded by pattern" in dict(report.skipped)["model.layers.1.mlp.experts.down_proj"]
    assert not hasattr(kept, "gate_up_proj_fp8")
    assert torch.equal(kept(hidden, index, weights), expected)


def test_a_saved_converted_moe_folder_loads_through_model_hf_path(tmp_path):
    """fp8train's own loader takes the folder of a converted MoE model: its per-expert scaling buffers are known
    FP8 state (dropped: the run starts its own), the expert weights load as saved."""
    from fp8train.training.config import ModelConfig
    from fp8train.training.models.decoder import build_model

    model = _model("qwen3_moe")
    convert_to_fp8(model, "delayed")
    x = _batch()
    model(input_ids=x, labels=x).loss.backward()
    update_fp8_scales(model)
    model.save_pretrained(tmp_path)
    loaded = build_model(ModelConfig(hf_path=str(tmp_path), seq_len=32))
    ours = {k[len("hf."):]: v for k, v in loaded.state_dict().items()}
    assert torch.equal(ours["model.layers.1.mlp.experts.down_proj"], model.model.layers[1].mlp.experts.down_proj)


@pytest.mark.parametrize("saver", ["fp8train", "transformers"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_fp8train_save_and_from_pretrained_restore_the_experts_state(arch, saver, tmp_path):
    """fp8train.from_pretrained restores the experts' FP8 state from fp8train's save and from transformers' own
    save_pretrained (what a Trainer checkpoint writes): convert_to_fp8 recorded the expert projections in the
    model's config (config.fp8train["experts"])."""
    import fp8train

    model = _model(arch)
    convert_to_fp8(model, "delayed")
    x = _batch()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        update_fp8_scales(model)
    if saver == "fp8train":
        fp8train.save_pretrained(model, tmp_path)
    else:
        model.save_pretrained(tmp_path)
        assert set(json.loads((tmp_path / "config.json").read_text())["fp8train"]["experts"]) == {
            f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")}
    restored = fp8train.from_pretrained(tmp_path)
    scaling = _experts(restored)[0].gate_up_proj_fp8
    assert isinstance(scaling, ExpertScaling) and scaling.recipe == _experts(model)[0].gate_up_proj_fp8.recipe
    for key, value in model.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
    model.eval()
    with torch.no_grad():
        assert torch.equal(restored(input_ids=x).logits, model(input_ids=x).logits)


@pytest.mark.parametrize("arch", MORE_ARCHS)
def test_other_moe_layouts_convert_and_train(arch):
    """Qwen2-MoE (with a shared expert), OLMoE and DeepSeek-V3 (shared experts, MLA attention): every routed
    expert in FP8, two steps with finite, falling loss."""
    model = _model(arch)
    report = convert_to_fp8(model, "current")
    assert report.kinds["experts"][1] == 0 and report.kinds["experts"][0] == 2 * 4 * 3 * 64 * 64
    assert all(hasattr(m, "gate_up_proj_fp8") and hasattr(m, "down_proj_fp8") for m in _experts(model))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, losses = _batch(), []
    for _ in range(3):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def test_policy_exclude_may_name_the_router_that_is_no_nn_linear():
    """transformers 5's Qwen3-MoE router `mlp.gate` is a module of its own holding a (experts, hidden) weight, not an
    nn.Linear: an exclude pattern naming it names a weight the policy governs (the defaults already keep it out),
    so it is accepted, not called a typo; a pattern that names nothing at all is still refused, naming the key."""
    model = _model("qwen3_moe")
    routers = {name: m for name, m in model.named_modules() if name.endswith("mlp.gate")}
    assert routers and not any(isinstance(m, torch.nn.Linear) for m in routers.values())
    report = convert_to_fp8(model, "current", LayerPolicy(exclude=(r"experts\.down_proj$", "lm_head$", "gate$")),
                            dry_run=True)
    skipped = dict(report.skipped)
    for name, router in routers.items():
        assert router.weight.dim() == 2 and skipped[f"{name}.weight"].startswith("excluded by pattern")
    assert "excluded by pattern" in skipped["model.layers.0.mlp.experts.down_proj"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(report.converted)  # `gate$` left the experts alone
    with pytest.raises(ValueError, match=r"^policy\.exclude: 'gaet\$' matches no nn\.Linear, experts or other GEMM "
                                         r"weight \(a router\)"):
        convert_to_fp8(_model("qwen3_moe"), "current", LayerPolicy(exclude=("gaet$",)), dry_run=True)
