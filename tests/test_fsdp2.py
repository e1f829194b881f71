"""FSDP2 sharding and FP8 weight all-gather, in this process (a one-rank group on an in-memory store).

Cheap checks of the machinery; tests/test_fsdp2_multiprocess.py proves the 2-process claims with real launches.
- FSDP2 (world 1) trains exactly like the plain model, and with fp8.all_gather exactly like FSDP2 without it;
- the all-gathered FP8 weight is the weight quantized with ONE tensorwise scale, checked against ml_dtypes;
- rowwise/block recipes and a bf16 run are refused for fp8.all_gather, and config says so before anything runs;
- per-rank bytes of parameters, gradients and AdamW state are what the parameter count says.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.nn.convert import convert_to_fp8, fp8_layers
from fp8train.nn.fp8_all_gather import Fp8GatheredWeight, check_fp8_all_gather_recipe
from fp8train.nn.linear import update_fp8_scales
from fp8train.numerics.formats import get_format
from fp8train.training.parallel import fsdp2
from fp8train.training.config import fp8_recipe_from_config, layer_policy_from_config, load_config
from fp8train.training.models.decoder import build_model

from conftest import TINY_FSDP2_MODEL  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = TINY_FSDP2_MODEL
CPU = torch.device("cpu")


def _model(recipe_name: str, mode: str):
    cfg = load_config(None, [*TINY, f"fp8.recipe={recipe_name}"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    convert_to_fp8(model, fp8_recipe_from_config(cfg), layer_policy_from_config(cfg))
    if mode != "plain":
        fsdp2.apply_fsdp2(model, CPU, fp8_all_gather=mode == "fp8_all_gather")
    return model


def _train(model, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False)
    gen, losses = torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x = torch.randint(0, 256, (4, 16), generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, x)
        loss.backward()
        fsdp2.clip_grad_norm_tensor(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        update_fp8_scales(model)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "rowwise"])
def test_fsdp2_trains_exactly_like_the_plain_model(one_rank_group, recipe_name):
    assert _train(_model(recipe_name, "fsdp2")) == _train(_model(recipe_name, "plain"))


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_fp8_all_gather_gives_the_same_losses_and_fp8_state(one_rank_group, recipe_name):
    plain, gathered = _model(recipe_name, "fsdp2"), _model(recipe_name, "fp8_all_gather")
    seen = []
    for _, layer in fp8_layers(gathered):
        layer.register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
    assert _train(gathered) == _train(plain)
    assert seen and set(seen) == {Fp8GatheredWeight}  # every Fp8Linear forward got the FP8 gathered weight
    for (_, a), (_, b) in zip(fp8_layers(plain), fp8_layers(gathered)):
        for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
            assert torch.equal(x, y), name


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_gathered_weight_is_the_tensorwise_quantized_weight(one_rank_group, recipe_name):
    model = _model(recipe_name, "fp8_all_gather")
    captured = {}
    layer = dict(fp8_layers(model))["layers.0.mlp.up_proj"]
    # cloned: FSDP2 frees the gathered storage after the block's forward (and gathers again for backward)
    layer.register_forward_pre_hook(lambda m, args: captured.update(
        codes=m.weight.fp8_tensor().data.view(torch.uint8).clone(), scale=m.weight.fp8_tensor().scale.clone()))
    full = layer.weight.to_local()._weight_fp32.detach().clone()  # one rank: the whole fp32 master weight
    _train(model, steps=1)
    amax = np.abs(full.numpy().astype(np.float64)).max()
    expected_scale = np.float32(amax / 448.0)  # first step: the weight's own amax, e4m3fn max 448, margin 0
    assert captured["scale"].item() == pytest.approx(float(expected_scale), rel=1e-6)
    expected = (full.numpy() / captured["scale"].numpy()).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(captured["codes"].numpy(), expected)


@pytest.mark.parametrize("recipe_name", ["rowwise", "block"])
def test_fp8_all_gather_refuses_per_row_and_per_tile_recipes(one_rank_group, recipe_name):
    with pytest.raises(ValueError, match="tensorwise"):
        _model(recipe_name, "fp8_all_gather")
    with pytest.raises(ValueError, match="fp8.all_gather"):
        load_config(None, [*TINY, f"fp8.recipe={recipe_name}", "fp8.all_gather=true", "train.parallel=fsdp2"])


def test_fp8_all_gather_config_needs_fsdp2_and_an_fp8_recipe():
    with pytest.raises(ValueError, match="train.parallel=fsdp2"):
        load_config(None, ["fp8.all_gather=true"])
    with pytest.raises(ValueError, match="fp8.all_gather"):
        load_config(None, ["fp8.all_gather=true", "train.parallel=fsdp2", "fp8.recipe=none"])
    with pytest.raises(ValueError, match="needs an FP8 recipe"):
        check_fp8_all_gather_recipe(None)
    assert load_config(None, ["fp8.all_gather=true", "train.parallel=fsdp2"]).fp8.all_gather is True
    with pytest.raises(ValueError, match="train.parallel"):
        load_config(None, ["train.parallel=fsdp"])


def test_gathered_weight_cannot_be_read_as_fp32():
    codes = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
    weight = Fp8GatheredWeight(codes, torch.ones(()), torch.ones(()), get_format("e4m3fn"), torch.float32)
    with pytest.raises(RuntimeError, match="only Fp8Linear"):
        weight + 1


def test_per_rank_state_bytes_count_params_grads_and_adamw_moments(one_rank_group):
    model = _model("current", "fsdp2")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    x = torch.randint(0, 256, (2, 16))
    model(x, x)[1].backward()
    optimizer.step()
    n = sum(p.numel() for p in build_model(load_config(None, TINY).model).parameters())
    n_tensors = len(list(model.parameters()))
    got = fsdp2.per_rank_state_bytes(model, optimizer)
    # fp32 weights and grads; AdamW: two fp32 moments per element plus one fp32 step count per tensor
    assert got == {"params": 4 * n, "grads": 4 * n, "optimizer": 8 * n + 4 * n_tensors,
                   "total": 16 * n + 4 * n_tensors}


def test_decoder_blocks_are_the_largest_module_list():
    model = build_model(load_config(None, TINY).model)
    assert fsdp2.decoder_blocks(model) == list(model.layers)
    with pytest.raises(ValueError, match="decoder blocks"):
        fsdp2.decoder_blocks(torch.nn.Linear(4, 4))


@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_grad_norm_is_the_float64_norm_whatever_the_chunking(monkeypatch, chunk):
    """The norm sums float64 squares a slice at a time (never a float64 copy of a whole gradient): the same fp32
    value as numpy's float64 norm over all gradients, for slices that split tensors and for whole tensors."""
    monkeypatch.setattr(fsdp2, "GRAD_NORM_CHUNK", chunk)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e3
    reference = np.sqrt(sum(np.sum(p.grad.numpy().astype(np.float64) ** 2) for p in model.parameters()))
    assert fsdp2.grad_norm(model) == float(np.float32(reference))
