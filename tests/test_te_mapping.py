"""The fp8train -> Transformer Engine recipe mapping (pure; runs without TE or a GPU)."""

import importlib.util

import pytest
import torch.nn as nn

from fp8train.nn.te import make_te_linear, te_config_refusal, te_recipe_kwargs
from fp8train.nn.recipes import recipe

EXPECTED = {
    "delayed": ("DelayedScaling", dict(fp8_format="HYBRID", margin=0, amax_history_len=1024,
                                       amax_compute_algo="max"), True),
    "current": ("Float8CurrentScaling", dict(fp8_format="HYBRID"), True),
    "rowwise": ("MXFP8BlockScaling", dict(fp8_format="E4M3"), False),
    "block": ("Float8BlockScaling", dict(fp8_format="E4M3"), True),
    "mxfp8": ("MXFP8BlockScaling", dict(fp8_format="E4M3"), False),
}
BLACKWELL, HOPPER = (10, 0), (9, 0)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_preset_mapping(name):
    cls, kwargs, exact = EXPECTED[name]
    spec = te_recipe_kwargs(recipe(name), BLACKWELL)
    assert spec["recipe_class"] == cls
    assert spec["kwargs"] == kwargs
    assert spec["exact"] is exact
    assert exact or spec["note"]  # an inexact mapping says why


@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
@pytest.mark.parametrize("capability", [None, HOPPER, (8, 9)])
def test_mxfp8_mappings_refused_before_sm100(name, capability):
    with pytest.raises(ValueError, match="sm100"):
        te_recipe_kwargs(recipe(name), capability)


@pytest.mark.parametrize("name", ["delayed", "current", "block"])
def test_hopper_recipes_map_on_hopper(name):
    assert te_recipe_kwargs(recipe(name), HOPPER)["recipe_class"] == EXPECTED[name][0]


@pytest.mark.parametrize("name", ["current", "rowwise", "block", "mxfp8"])
def test_te_backend_refusal_says_why(name):
    message = te_config_refusal(recipe(name))
    assert "te.autocast" in message and "scaled_mm" in message


def test_delayed_carries_history_algo_margin():
    spec = te_recipe_kwargs(recipe("delayed", amax_history_len=16, amax_compute_algo="most_recent", margin=2))
    assert spec["kwargs"] == dict(fp8_format="HYBRID", margin=2, amax_history_len=16,
                                  amax_compute_algo="most_recent")


def test_all_e4m3_delayed_is_format_e4m3():
    assert te_recipe_kwargs(recipe("delayed", grad_output_format="e4m3fn"))["kwargs"]["fp8_format"] == "E4M3"


@pytest.mark.parametrize("r, match", [
    (recipe("current", margin=1), "margin"),
    (recipe("current", input_format="e5m2"), "HYBRID"),
    (recipe("block", grad_output_format="e5m2"), "e4m3fn"),
    (recipe("block", weight_block=(1, 128)), "128x128"),
    (recipe("current", input_format="e4m3fnuz", weight_format="e4m3fnuz", grad_output_format="e5m2fnuz"), "HYBRID"),
])
def test_unsupported_recipes_raise(r, match):
    with pytest.raises(ValueError, match=match):
        te_recipe_kwargs(r)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed")
def test_make_te_linear_without_te_says_what_to_install():
    with pytest.raises(ImportError, match=r"pip install fp8train\[te\]"):
        make_te_linear(nn.Linear(64, 64), recipe("delayed"))


@pytest.mark.parametrize("name", ["current", "rowwise", "mxfp8"])
def test_te_backend_refusal_adds_no_recipe_error_for_a_recipe_te_maps(name):
    """The recipe's own limits are checked as on an sm100 GPU (where every preset but a margin or FNUZ one maps):
    rowwise and mxfp8 map there, so the refusal gives only the training-loop reason, with no sm100 complaint."""
    assert te_config_refusal(recipe(name)).startswith(
        "fp8.backend=te is refused: fp8train's training loop does not run TE layers inside te.autocast(recipe=...)")


def test_te_backend_refusal_names_the_recipe_error_first():
    message = te_config_refusal(recipe("current", margin=1))
    assert message.startswith("fp8.backend=te is refused: margin=1: TE supports a margin only for delayed scaling; "
                              "set margin=0 or use backend='emulated'; and fp8train's training loop")


def test_block_mapping_notes_and_tile_refusal_exactly():
    """The block preset (power-of-two scales) maps exactly, with no note; non-pow2 scales say what TE does
    instead; other tiles are refused naming TE's tiles and the recipe's."""
    assert te_recipe_kwargs(recipe("block"), HOPPER) == dict(
        recipe_class="Float8BlockScaling", kwargs=dict(fp8_format="E4M3"), exact=True, note="")
    assert te_recipe_kwargs(recipe("block", pow2_scales=False), HOPPER) == dict(
        recipe_class="Float8BlockScaling", kwargs=dict(fp8_format="E4M3"), exact=False,
        note="TE's block recipe uses power-of-two scales by default")
    with pytest.raises(ValueError) as caught:
        te_recipe_kwargs(recipe("block", weight_block=(1, 128)), HOPPER)
    assert str(caught.value) == ("Float8BlockScaling uses 1x128 input/grad_output tiles and 128x128 weight tiles; "
                                 "recipe 'block' asks for (1, 128), (1, 128), (1, 128)")


@pytest.mark.parametrize("name, te_name", [("delayed", "delayed"), ("current", "current")])
def test_tensorwise_mapping_with_pow2_scales_is_inexact_and_says_why(name, te_name):
    plain = te_recipe_kwargs(recipe(name), HOPPER)
    assert plain["exact"] is True and plain["note"] == ""
    pow2 = te_recipe_kwargs(recipe(name, pow2_scales=True), HOPPER)
    assert pow2["exact"] is False
    assert pow2["note"] == f"TE's {te_name} scales are not rounded to powers of two"
