"""The built-in decoder's mixture-of-experts option (training/models/moe.py): routing against a per-token loop
written from the documented rule, the load-balancing loss by hand, experts that get no token, FP8 conversion of
the grouped experts, config checks, and the routing agreement the validation report uses."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fp8train.cli import main as cli_main
from fp8train.evidence import advisor
from fp8train.evidence.report import write_report
from fp8train.evidence.validate import run_validation
from fp8train.nn.convert import LayerPolicy, convert_to_fp8
from fp8train.nn.experts import Fp8GroupedLinear, GroupedLinear
from fp8train.nn.linear import update_fp8_scales
from fp8train.training.config import config_hash, layer_policy_from_config, load_config
from fp8train.training.models.decoder import build_model
from fp8train.training.models.moe import MoE, moe_blocks, routing_agreement, routing_snapshot
from fp8train.training.models.decoder import SwiGLU
from fp8train.training.loop import train

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
MOE = ["model.n_experts=4", "model.top_k=2", "model.d_model=64", "model.n_heads=2", "model.seq_len=16",
       "model.n_layers=2", "model.moe_ffn_hidden=64"]


def _moe(top_k: int, n_shared: int = 0, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(d_model=32, n_experts=4, top_k=top_k, hidden=16, n_shared=n_shared, shared_cls=SwiGLU)
    with torch.no_grad():  # weights big enough that the router's choice is far from ties
        layer.router.weight.normal_(0, 1.0)
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> tuple[np.ndarray, float]:
    """Per token, in float64: softmax of the router logits, the top_k experts, renormalized weights (top_k > 1),
    sum of weight x down(silu(gate) * up) of each chosen expert, plus the shared expert; and the aux loss
    E * sum_e f_e p_e with f_e = assignments / (N top_k), p_e = mean router probability."""
    E, k = layer.n_experts, layer.top_k
    router = layer.router.weight.detach().double().numpy()
    gate_up = layer.experts.gate_up.weight.detach().double().numpy()  # (E, 2H, C)
    down = layer.experts.down.weight.detach().double().numpy()  # (E, C, H)
    hidden = down.shape[2]
    tokens = x.detach().double().reshape(-1, x.shape[-1]).numpy()
    out = np.zeros_like(tokens)
    assignments, prob_sum = np.zeros(E), np.zeros(E)
    for n, t in enumerate(tokens):
        logits = router @ t
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        prob_sum += probs
        chosen = sorted(range(E), key=lambda e: -probs[e])[:k]
        weights = probs[chosen] / (probs[chosen].sum() if k > 1 else 1.0)
        for w, e in zip(weights, chosen):
            assignments[e] += 1
            h = gate_up[e] @ t
            g, u = h[:hidden], h[hidden:]
            out[n] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    if layer.shared is not None:
        s = layer.shared
        g = s.gate_proj.weight.detach().double().numpy() @ tokens.T
        u = s.up_proj.weight.detach().double().numpy() @ tokens.T
        out += (s.down_proj.weight.detach().double().numpy() @ (g / (1 + np.exp(-g)) * u)).T
    N = len(tokens)
    aux = E * float(np.sum(assignments / (N * k) * prob_sum / N))
    return out.reshape(x.shape), aux


@pytest.mark.parametrize("top_k, n_shared", [(1, 0), (2, 0), (2, 1), (4, 1)])
def test_routing_output_and_aux_loss_match_a_per_token_loop(top_k, n_shared):
    layer = _moe(top_k, n_shared)
    x = torch.randn(3, 5, 32)
    y = layer(x)
    expected, aux = _reference(layer, x)
    np.testing.assert_allclose(y.detach().double().numpy(), expected, rtol=1e-4, atol=1e-5)
    assert math.isclose(layer.aux_loss.item(), aux, rel_tol=1e-5)
    assert layer.expert_tokens.sum().item() == 15 * top_k


def test_aux_loss_is_one_for_uniform_routing_and_n_experts_for_collapsed():
    layer = _moe(top_k=1)
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        layer.router.weight.zero_()  # every logit 0: p_e = 1/4; ties go to expert 0, so f = (1, 0, 0, 0)
    layer(x)
    assert layer.expert_tokens.tolist() == [16, 0, 0, 0]
    assert math.isclose(layer.aux_loss.item(), 4 * (1.0 * 0.25), rel_tol=1e-6)  # E * f_0 p_0 = 1
    with torch.no_grad():
        layer.router.weight[0].fill_(100.0)  # x > 0 below: expert 0 takes every token with probability ~1
    layer(x.abs() + 0.1)
    assert math.isclose(layer.aux_loss.item(), 4.0, rel_tol=1e-5)


@pytest.mark.parametrize("recipe", [None, "current", "delayed"])
def test_an_expert_that_gets_no_token_has_zero_gradient_and_the_rest_is_right(recipe):
    layer = _moe(top_k=2)
    with torch.no_grad():  # positive inputs; expert 3's router row is very negative: it never wins
        layer.router.weight[3].fill_(-50.0)
    container = torch.nn.Sequential(layer)
    if recipe is not None:
        convert_to_fp8(container, recipe, LayerPolicy(min_features=16))
        assert isinstance(layer.experts.gate_up, Fp8GroupedLinear)
    x = torch.rand(2, 6, 32) + 0.05
    y = layer(x)
    assert layer.expert_tokens[3].item() == 0
    y.square().sum().backward()
    for grouped in (layer.experts.gate_up, layer.experts.down):
        assert torch.count_nonzero(grouped.weight.grad[3]) == 0
        assert torch.count_nonzero(grouped.weight.grad[:3]) > 0
    expected, _ = _reference(layer, x)
    tolerance = 1e-5 if recipe is None else 0.1  # FP8: a few % relative error per GEMM
    scale = np.abs(expected).max()
    assert np.abs(y.detach().double().numpy() - expected).max() <= tolerance * scale
    if recipe == "delayed":
        update_fp8_scales(container)  # the zero-token expert's input history records nothing and stays valid
        assert torch.isfinite(layer.experts.gate_up.scaling.input_scale).all()


def test_decoder_moe_blocks_convert_to_fp8_with_the_same_parameters_and_train():
    cfg = load_config(None, MOE + ["model.n_shared_experts=1", "model.moe_every=2"])
    model = build_model(cfg.model)
    assert [name for name, _ in moe_blocks(model)] == ["layers.1.mlp"]  # every 2nd block
    grouped = model.layers[1].mlp.experts.gate_up
    assert isinstance(grouped, GroupedLinear) and tuple(grouped.weight.shape) == (4, 128, 64)
    weight = grouped.weight
    report = convert_to_fp8(model, "current", layer_policy_from_config(cfg))
    fp8 = model.layers[1].mlp.experts.gate_up
    assert isinstance(fp8, Fp8GroupedLinear) and fp8.weight is weight
    assert ("layers.1.mlp.router", ) == tuple(n for n, r in report.skipped if "router" in n)
    assert report.kinds["experts"][0] == 2 * 4 * 128 * 64 - 4 * 64 * 64  # gate_up + down, all in FP8
    x = torch.randint(0, 256, (2, 16))
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, x)
        lm_only = F.cross_entropy(model(x)[0].float().reshape(-1, 256), x.reshape(-1))
    # training loss = LM loss + coef x aux (aux of the one MoE block, ~1 for a balanced router)
    assert math.isclose(loss.item() - lm_only.item(), 0.01 * model.last_aux_loss.item(), rel_tol=1e-3)
    loss.backward()
    assert weight.grad is not None and torch.count_nonzero(weight.grad) > 0
    model.eval()
    _, val_loss = model(x, x)
    assert math.isclose(val_loss.item(), F.cross_entropy(model(x)[0].float().reshape(-1, 256),
                                                         x.reshape(-1)).item(), rel_tol=1e-6)


@pytest.mark.parametrize("override, key", [
    ("model.top_k=5", "model.top_k"), ("model.top_k=0", "model.top_k"), ("model.moe_every=3", "model.moe_every"),
    ("model.n_experts=-1", "model.n_experts"), ("model.n_shared_experts=-1", "model.n_shared_experts"),
    ("model.aux_loss_coef=-0.1", "model.aux_loss_coef"), ("model.moe_ffn_hidden=-4", "model.moe_ffn_hidden"),
])
def test_bad_moe_settings_are_refused_naming_the_key(override, key):
    with pytest.raises(ValueError) as caught:
        load_config(None, MOE + [override])
    assert key in str(caught.value) and "\n" not in str(caught.value)


def test_moe_keys_do_not_change_a_dense_config_hash_and_do_change_an_moe_one():
    # the hash of the default (dense) config as the tree before the MoE (and tensor-parallel) keys computed it
    assert config_hash(load_config(None)) == "da179398c629a8ea3defb0490ae6a8bcd861f4e4b4c31cab6443d061211e3514"
    assert config_hash(load_config(None, ["model.top_k=3"])) == config_hash(load_config(None))
    moe = load_config(None, MOE)
    assert config_hash(moe) != config_hash(load_config(None, MOE + ["model.top_k=1"]))
    assert config_hash(moe) != config_hash(load_config(None, MOE[1:] + ["model.n_experts=8"]))


def test_routing_agreement_counts_changed_decisions_per_token_as_sets():
    base = {"b": {"expert_tokens": [2, 1, 1, 0], "routing": [[0, 1], [0, 2]]}}
    same_sets = {"b": {"expert_tokens": [2, 1, 1, 0], "routing": [[0, 1], [0, 2]]}}
    one_flip = {"b": {"expert_tokens": [2, 1, 0, 1], "routing": [[0, 1], [0, 3]]}}
    assert routing_agreement(base, same_sets)["b"]["flipped"] == 0.0
    row = routing_agreement(base, one_flip)["b"]
    assert row["flipped"] == 1 / 4 and row["token_diff"] == [0, 0, -1, 1]


def test_routing_snapshot_records_each_tokens_experts_and_leaves_the_mode():
    cfg = load_config(None, MOE)
    model = build_model(cfg.model)
    model.train()
    snap = routing_snapshot(model, torch.randint(0, 256, (2, 16)), lambda: torch.autocast("cpu", torch.bfloat16))
    assert model.training and set(snap) == {"layers.0.mlp", "layers.1.mlp"}
    for block in snap.values():
        assert len(block["routing"]) == 32 and all(len(set(r)) == 2 for r in block["routing"])
        assert block["expert_tokens"] == [sum(e in r for r in block["routing"]) for e in range(4)]


# A tiny MoE decoder trained 40 steps; 4 paired seeds at a 2% margin. Measured on this config (AMD EPYC Zen 4,
# 2 cores; CPU runs are deterministic):
# - current:  paired gaps -0.13, +0.23, +0.14, +0.51% -> PASS;
# - broken:   scale margin 2**20 with the routers and the output head in FP8 too (exclude_defaults=false):
#             every value flushes to zero, the loss stays at ln(256) = 5.55 while bf16 falls to ~3.3, so the
#             divergence guard stops every seed at step 15-20 -> FAIL;
# - m18:      current with a scale margin of 2**18 (values below ~0.6 x amax of each tensor flush to zero):
#             gaps +2.8, +14.1, +11.2, +4.0%, mean +8%, not a PASS (its lower bound, +1.6%, needs a 5th seed to
#             clear the margin: INCONCLUSIVE, "about 5 seeds would decide").
TINY_MOE = MOE[:4] + ["model.seq_len=32", "train.batch_size=8", "train.max_steps=40", "train.eval_every=10",
                      "train.eval_batches=4", "optim.warmup_steps=5", "policy.min_features=16", "log.wandb=disabled",
                      "log.every=5", "log.telemetry_every=10", "data.max_bytes=300000", "validate.margin=0.02",
                      "validate.final_window=2", "validate.seeds=4", "model.n_layers=2", "model.moe_ffn_hidden=32",
                      "train.threads=1"]


# 16 runs of 40 steps, ~45 s on 2 cores: with CI's extended tests. README's command keeps the MoE job's design
# (test_the_moe_validation_job_is_the_main_jobs_design_on_an_moe_model), MoE training, routing agreement and
# telemetry (the tests around this one) and the harness's own real PASS / FAIL (tests/test_validate.py)
@pytest.mark.extended
def test_moe_validation_passes_current_and_fails_a_harmful_margin(tmp_path):
    cfg = load_config(None, TINY_MOE + [f"run.dir={tmp_path}", "run.name=val", "validate.workers=2"])
    summary = run_validation(cfg, candidates=["current", "broken=current:margin=20,policy.exclude_defaults=false",
                                              "m18=current:margin=18"], show_progress=False)
    c = summary["candidates"]
    assert c["current"]["verdict"] == "pass", c["current"]
    assert c["broken"]["verdict"] == "fail" and "diverged" in c["broken"]["reason"], c["broken"]
    assert c["m18"]["verdict"] != "pass" and c["m18"]["gap_mean"] > 0.02, c["m18"]
    assert summary["verdict"] == "fail"
    _assert_routing_agreement_reported(tmp_path / "val", summary["seeds"])


def _assert_routing_agreement_reported(vdir: Path, seeds: list[int]) -> None:
    """`current`'s routing agreement with bf16, per seed and MoE block, in summary.json and the report."""
    agreement = json.loads((vdir / "summary.json").read_text())["moe"]["current"]
    assert set(agreement) == {str(s) for s in seeds}
    for blocks in agreement.values():
        assert set(blocks) == {"layers.0.mlp", "layers.1.mlp"}
        for row in blocks.values():
            assert 0.0 <= row["flipped"] <= 1.0 and sum(row["baseline_tokens"]) == sum(row["candidate_tokens"])
    report = (vdir / "report.md").read_text()
    assert "## Mixture of experts: routing agreement" in report and (vdir / "experts.png").stat().st_size
    assert "layers.0.mlp.experts.gate_up" in report  # per-expert health names the grouped layers


@pytest.mark.slow
def test_a_short_moe_validation_reports_routing_agreement_per_block(tmp_path):
    """README's command's share of the MoE job (the verdicts are the extended test's above): two seeds of `current`
    for 10 steps on the same tiny MoE, whose summary and report carry every block's routing agreement."""
    cfg = load_config(None, TINY_MOE + [f"run.dir={tmp_path}", "run.name=val", "validate.workers=1",
                                        "validate.seeds=2", "train.max_steps=10", "train.eval_every=5",
                                        "log.telemetry_every=5", "validate.final_window=1"])
    summary = run_validation(cfg, candidates=["current"], show_progress=False)
    assert summary["seeds"] == [1337, 1338] and summary["cost"]["runs"] == 4
    _assert_routing_agreement_reported(tmp_path / "val", summary["seeds"])


@pytest.mark.parametrize("name", ["cpu_moe", "cpu_moe_validate", "gpu_moe"])
def test_moe_recipes_put_every_expert_and_block_linear_in_fp8(name):
    cfg = load_config(str(RECIPES / f"{name}.yaml"), ["fp8.recipe=current"])
    assert cfg.model.n_experts > 1 and cfg.model.top_k >= 1
    with torch.device("meta"):
        model = build_model(cfg.model)
    report = convert_to_fp8(model, "current", layer_policy_from_config(cfg), dry_run=True)
    skipped = {n for n, _ in report.skipped}
    assert skipped == {"lm_head"} | {f"{b}.router" for b, _ in moe_blocks(model)}, skipped
    assert report.kinds["experts"][1] == 0 and report.kinds["experts"][0] > 0


def test_advisor_folds_expert_telemetry_into_its_grouped_layer():
    flagged = {"layers.1.mlp.experts.down.expert3": ["grad_output mean SQNR 9.0 dB < 15"],
               "layers.1.mlp.experts.down.expert0": ["input mean underflow 12.0% > 10.0%"],
               "layers.0.attn.q_proj": ["weight mean SQNR 1.0 dB < 15"]}
    folded = advisor.by_policy_layer(flagged)
    assert folded == {"layers.1.mlp.experts.down": ["expert3: grad_output mean SQNR 9.0 dB < 15",
                                                    "expert0: input mean underflow 12.0% > 10.0%"],
                      "layers.0.attn.q_proj": ["weight mean SQNR 1.0 dB < 15"]}
    # the pasted pattern excludes the whole grouped layer, and convert_to_fp8 accepts it
    cfg = load_config(None, MOE + [f"policy.exclude=['{advisor.exclude_regex('layers.1.mlp.experts.down')}']"])
    model = build_model(cfg.model)
    report = convert_to_fp8(model, "current", layer_policy_from_config(cfg))
    assert isinstance(model.layers[1].mlp.experts.down, GroupedLinear)
    assert isinstance(model.layers[0].mlp.experts.down, Fp8GroupedLinear)
    assert any(n == "layers.1.mlp.experts.down" and "excluded" in r for n, r in report.skipped)


def test_a_delayed_moe_run_resumed_from_its_checkpoint_equals_the_straight_run(tmp_path):
    """Per-expert amax histories, scales and the routers' state travel in the checkpoint: a run stopped after
    step 5, then resumed from its step-3 checkpoint, ends bit for bit where 6 straight steps do (losses,
    validation loss, routing of the validation batch)."""
    common = MOE + ["model.seq_len=32", "train.batch_size=4", "fp8.recipe=delayed", "train.eval_every=3",
                    "checkpoint.every=3", "log.wandb=disabled", "train.eval_batches=2", "policy.min_features=16",
                    "data.max_bytes=200000", "optim.warmup_steps=2", "train.threads=1",
                    "train.max_steps=6", f"run.dir={tmp_path}", "log.every=1"]
    straight = train(load_config(None, common + ["run.name=a"]), show_progress=False)
    stopped = train(load_config(None, common + ["run.name=b"]), show_progress=False,
                    should_stop=lambda record: "test stop" if record["step"] == 5 else None)
    assert stopped["steps"] == 5  # its last checkpoint: step 3
    resumed = train(load_config(None, common + ["run.name=b", "train.resume=true"]), show_progress=False)
    assert resumed["resumed_from"] is not None and resumed["steps"] == straight["steps"] == 6
    for key in ("loss", "val_loss", "moe"):
        assert resumed[key] == straight[key], key


def test_an_moe_run_logs_aux_loss_load_and_per_expert_telemetry(tmp_path):
    cfg = load_config(None, MOE + ["model.seq_len=32", "train.batch_size=4", "fp8.recipe=current",
                                   "train.max_steps=4", "log.every=2", "log.telemetry_every=2", "log.wandb=disabled",
                                   "policy.min_features=16", "data.max_bytes=200000", "train.eval_batches=2",
                                   f"run.dir={tmp_path}", "run.name=moe", "train.threads=1"])
    train(cfg, show_progress=False)
    run_dir = tmp_path / "moe"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in metrics if "loss" in m and "moe/aux_loss" in m]
    assert logged and all(0.5 < m["moe/aux_loss"] < 2 * 4 and 1.0 <= m["moe/max_load"] <= 4.0 for m in logged)
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    layers = records[-1]["layers"]
    for grouped in ("layers.0.mlp.experts.gate_up", "layers.1.mlp.experts.down"):
        for e in range(4):
            stats = layers[f"{grouped}.expert{e}"]
            assert "weight" in stats and 0 < stats["weight"]["amax"] < 1  # every expert's weight, routed or not
    routed = [layers[f"layers.0.mlp.experts.gate_up.expert{e}"] for e in range(4)]
    assert any("input" in s and s["input"]["sqnr_db"] > 20 for s in routed)
    summary = json.loads((run_dir / "summary.json").read_text())
    write_report(run_dir)  # the single run's report shows its routing
    report = (run_dir / "report.md").read_text()
    for block in ("layers.0.mlp", "layers.1.mlp"):
        counts = summary["moe"][block]["expert_tokens"]
        assert sum(counts) == 2 * 4 * 32 and f"| {block} | {counts} |" in report


def test_the_moe_validation_job_is_the_main_jobs_design_on_an_moe_model():
    cfg = load_config(str(RECIPES / "cpu_moe_validate.yaml"))
    main = load_config(str(RECIPES / "cpu_validate.yaml"))
    assert cfg.fp8.recipe == "none" and list(cfg.validate.candidates) == ["delayed", "current", "rowwise", "block"]
    assert (cfg.validate.margin, cfg.validate.seeds, cfg.train.lr) == (main.validate.margin, main.validate.seeds,
                                                                       main.train.lr)
    assert cfg.model.n_experts == 4 and cfg.model.top_k == 2 and cfg.train.device == "cpu"


def test_serving_commands_on_a_built_in_moe_run(tmp_path, capsys):
    """kv-eval and the fp8train-format .safetensors export work on an MoE run; a Hugging Face folder (a Llama,
    which has no experts) is refused in one line before anything is written."""
    cfg = load_config(None, MOE + ["model.seq_len=32", "train.batch_size=4", "fp8.recipe=current",
                                   "train.max_steps=2", "log.wandb=disabled", "policy.min_features=16",
                                   "data.max_bytes=200000", "train.eval_batches=2", f"run.dir={tmp_path}",
                                   "run.name=moe", "train.threads=1"])
    train(cfg, show_progress=False)
    run_dir = str(tmp_path / "moe")
    for fmt, out in (("hf", "dense"), ("e4m3fn", "folder")):
        assert cli_main(["export", run_dir, "--format", fmt, "--out", str(tmp_path / out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "model.n_experts=4" in err[0] and not (tmp_path / out).exists()
    assert cli_main(["export", run_dir, "--format", "e4m3fn", "--out", str(tmp_path / "moe.safetensors")]) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    assert cli_main(["kv-eval", run_dir]) == 0
    assert (tmp_path / "moe" / "kv_eval" / "kv_eval.json").is_file()
