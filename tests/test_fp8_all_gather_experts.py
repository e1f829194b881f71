"""fp8.all_gather for FP8 experts (nn/fp8_all_gather_experts.py), in one process on a one-rank FSDP2 group: a
tiny Qwen3-MoE trains exactly as under FSDP2's fp32 gather, every experts forward receives the FP8-gathered
weight, each expert's gathered codes are its weight quantized with that expert's own scale (ml_dtypes reference),
and any other use of the gathered bytes raises. (Two real processes: tests/test_moe_fsdp2.py.)"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from fp8train.nn.convert import LayerPolicy, convert_to_fp8, fp8_layers, update_fp8_scales
from fp8train.nn.fp8_all_gather_experts import Fp8GatheredExperts
from fp8train.training.parallel import fsdp2
from hf_helpers import VOCAB, hf_config

pytestmark = pytest.mark.usefixtures("single_thread")
CPU = torch.device("cpu")


def _model(recipe: str, fp8_all_gather: bool):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("qwen3_moe"), dtype=torch.float32)
    convert_to_fp8(model, recipe, LayerPolicy(min_features=32))
    return fsdp2.apply_fsdp2(model, CPU, fp8_all_gather=fp8_all_gather)


def _train(model, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    gen, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (4, 16), generator=gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        update_fp8_scales(model)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_gathered_experts_train_exactly_like_the_fp32_gather(one_rank_group, recipe):
    plain, gathered = _model(recipe, False), _model(recipe, True)
    seen = []
    experts = gathered.model.layers[0].mlp.experts
    experts.register_forward_pre_hook(lambda m, args: seen.append(type(m.gate_up_proj)))
    assert _train(gathered) == _train(plain)
    assert seen and set(seen) == {Fp8GatheredExperts}
    for (name, a), (_, b) in zip(plain.named_buffers(), gathered.named_buffers()):
        assert torch.equal(a, b), name  # the same per-expert scaling state, amax histories included


def test_each_expert_is_gathered_with_its_own_scale(one_rank_group):
    model = _model("current", True)
    experts = model.model.layers[1].mlp.experts
    captured = {}

    def capture(module, args):  # while gathered (FSDP2 frees the unsharded storage after the forward)
        weight = module.gate_up_proj
        captured["experts"] = [(w.fp8_tensor().data.clone(), w.fp8_tensor().scale.clone()) for w in weight.unbind(0)]
        try:
            weight.sum()
        except RuntimeError as exc:
            captured["refused"] = str(exc)

    experts.register_forward_pre_hook(capture)
    with torch.no_grad():
        model(input_ids=torch.randint(0, VOCAB, (2, 8)))
    full = experts.gate_up_proj.to_local().weight_fp32.detach().numpy()  # one rank: its shard is the whole (E, N, K)
    assert len(captured["experts"]) == 4
    for e, (codes, scale) in enumerate(captured["experts"]):
        amax = np.abs(full[e]).max()
        expected_scale = np.float32(amax) / np.float32(448.0)  # current scaling, margin 0: amax / E4M3 max
        assert float(scale) == pytest.approx(float(expected_scale), rel=1e-6)
        expected = (full[e] / np.float32(scale)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        np.testing.assert_array_equal(codes.float().numpy(), expected)
    assert "only the FP8 experts forward" in captured["refused"]


def test_a_model_with_fp8_experts_only_gathers_them_and_rowwise_is_refused(one_rank_group):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config("qwen3_moe"), dtype=torch.float32)
    convert_to_fp8(model, "current", LayerPolicy(min_features=32, exclude=(r"self_attn\.",)))
    assert not fp8_layers(model)  # no Fp8Linear at all: the experts alone are FP8
    fsdp2.apply_fsdp2(model, CPU, fp8_all_gather=True)
    assert type(model.model.layers[0].mlp.experts.down_proj.to_local()).__name__ == "Fp8AllGatherExperts"
    model = AutoModelForCausalLM.from_config(hf_config("qwen3_moe"), dtype=torch.float32)
    convert_to_fp8(model, "rowwise", LayerPolicy(min_features=32, exclude=(r"self_attn\.",)))
    assert not fp8_layers(model)
    with pytest.raises(ValueError, match="fp8.recipe=rowwise has per-row/per-tile weight scales"):
        fsdp2.apply_fsdp2(model, CPU, fp8_all_gather=True)
