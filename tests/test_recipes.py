"""Fp8Recipe presets, overrides and validation errors."""

import dataclasses

import pytest

from fp8train.nn.recipes import RECIPE_NAMES, Fp8Recipe, recipe

# Expected preset fields, written out (not read back from the code).
PRESETS = {
    "delayed": dict(scaling="delayed", input_format="e4m3fn", weight_format="e4m3fn", grad_output_format="e5m2",
                    amax_history_len=1024, amax_compute_algo="max", margin=0, pow2_scales=False),
    "current": dict(scaling="current", input_format="e4m3fn", weight_format="e4m3fn", grad_output_format="e5m2",
                    margin=0, pow2_scales=False),
    "rowwise": dict(scaling="rowwise", input_format="e4m3fn", weight_format="e4m3fn",
                    grad_output_format="e4m3fn", pow2_scales=True),
    "block": dict(scaling="block", input_format="e4m3fn", weight_format="e4m3fn", grad_output_format="e4m3fn",
                  pow2_scales=True, input_block=(1, 128), weight_block=(128, 128), grad_output_block=(1, 128)),
    "mxfp8": dict(scaling="mxfp8", input_format="e4m3fn", weight_format="e4m3fn", grad_output_format="e4m3fn",
                  margin=0, pow2_scales=False, input_block=(1, 32), weight_block=(1, 32), grad_output_block=(1, 32)),
}


def test_recipe_names():
    assert set(RECIPE_NAMES) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_fields(name):
    r = recipe(name)
    assert r.name == name
    for key, value in PRESETS[name].items():
        assert getattr(r, key) == value, key


@pytest.mark.parametrize("name, granularity", [("delayed", "tensor"), ("current", "tensor"), ("rowwise", "row"),
                                               ("block", "block"), ("mxfp8", "block")])
def test_granularity_per_role(name, granularity):
    r = recipe(name)
    assert all(r.granularity_of(role) == granularity for role in ("input", "weight", "grad_output"))


# Which roles are quantized again along their other axis for the backward GEMM contracting their first dim,
# written out: per-row scales (rowwise) and non-square tiles vary along that dim; tensorwise scales and square
# tiles do not.
REQUANTIZE_TRANSPOSED = {
    "delayed": dict(input=False, weight=False, grad_output=False),
    "current": dict(input=False, weight=False, grad_output=False),
    "rowwise": dict(input=True, weight=True, grad_output=True),
    "block": dict(input=True, weight=False, grad_output=True),  # 1x128, 128x128, 1x128
    "mxfp8": dict(input=True, weight=True, grad_output=True),  # 1x32 everywhere
}


@pytest.mark.parametrize("name", sorted(REQUANTIZE_TRANSPOSED))
def test_requantize_transposed_per_role(name):
    r = recipe(name)
    assert {role: r.requantize_transposed(role) for role in REQUANTIZE_TRANSPOSED[name]} == \
        REQUANTIZE_TRANSPOSED[name]


def test_requantize_transposed_follows_the_tile_shape():
    r = recipe("block", weight_block=(1, 128), input_block=(32, 32), grad_output_block=(128, 1))
    assert [r.requantize_transposed(role) for role in ("input", "weight", "grad_output")] == [False, True, True]


def test_code_strings():
    assert recipe("delayed").code() == "delayed:e4m3/e4m3/e5m2:h1024max:m0"
    assert recipe("delayed", amax_history_len=16, amax_compute_algo="most_recent", margin=1).code() == \
        "delayed:e4m3/e4m3/e5m2:h16recent:m1"
    assert recipe("current").code() == "current:e4m3/e4m3/e5m2:m0"
    assert recipe("rowwise").code() == "rowwise:e4m3/e4m3/e4m3:m0:pow2"
    assert recipe("block", backend="emulated").code() == "block:e4m3/e4m3/e4m3:b1x128,128x128,1x128:m0:pow2:emulated"


def test_overrides_and_alias():
    r = recipe("delayed", amax_history_len=16, margin=2, input_format="e4m3")
    assert (r.amax_history_len, r.margin, r.input_format) == (16, 2, "e4m3fn")
    assert r.replace(margin=0).margin == 0


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe("current").margin = 3


def test_unknown_recipe_name_lists_allowed():
    with pytest.raises(ValueError, match="allowed: delayed, current, rowwise, block"):
        recipe("tensorwise")


def test_unknown_override_lists_fields():
    with pytest.raises(ValueError, match=r"unknown Fp8Recipe field\(s\) history_len; valid fields: .*amax_history_len"):
        recipe("delayed", history_len=4)


@pytest.mark.parametrize("overrides, field", [
    (dict(scaling="stochastic"), "scaling"),
    (dict(amax_compute_algo="mean"), "amax_compute_algo"),
    (dict(backend="cuda"), "backend"),
    (dict(grad_output_format="e3m4"), "grad_output_format"),
    (dict(amax_history_len=0), "amax_history_len"),
    (dict(margin=0.5), "margin"),
    (dict(pow2_scales="yes"), "pow2_scales"),
    (dict(weight_block=(128,)), "weight_block"),
    (dict(input_block=(0, 128)), "input_block"),
])
def test_invalid_values_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        recipe("delayed", **overrides)


def test_mixed_dialects_rejected():
    with pytest.raises(ValueError, match=r"must all be OCP .* or all FNUZ"):
        recipe("current", grad_output_format="e5m2fnuz")
    r = recipe("current", input_format="e4m3fnuz", weight_format="e4m3fnuz", grad_output_format="e5m2fnuz")
    assert r.code().startswith("current:e4m3fnuz/e4m3fnuz/e5m2fnuz")


def test_direct_construction_validates():
    with pytest.raises(ValueError, match="scaling"):
        Fp8Recipe(scaling="rowwize")


def test_amax_history_length_bounds_are_inclusive():
    """1 (the latest amax alone) and MAX_AMAX_HISTORY are both allowed; 0 and one past the maximum are not."""
    from fp8train.nn.recipes import MAX_AMAX_HISTORY
    assert recipe("delayed", amax_history_len=1).amax_history_len == 1
    assert recipe("delayed", amax_history_len=MAX_AMAX_HISTORY).amax_history_len == MAX_AMAX_HISTORY
    for bad in (0, MAX_AMAX_HISTORY + 1):
        with pytest.raises(ValueError, match="amax_history_len"):
            recipe("delayed", amax_history_len=bad)


@pytest.mark.parametrize("overrides, message", [
    (dict(weight_block=(1, 128)), "scaling='mxfp8' uses 1x32 blocks for every operand (OCP MX); got "
                                  "input_block=(1, 32), weight_block=(1, 128), grad_output_block=(1, 32)"),
    (dict(margin=1), "scaling='mxfp8' takes its E8M0 scales from the OCP MX rule: margin must be 0 and pow2_scales "
                     "False (the scales are powers of two already)"),
    (dict(input_format="e4m3fnuz", weight_format="e4m3fnuz", grad_output_format="e4m3fnuz"),
     "scaling='mxfp8' elements are OCP formats (e4m3fn, e5m2), not FNUZ"),
])
def test_mxfp8_refusals_say_which_rule(overrides, message):
    with pytest.raises(ValueError) as caught:
        recipe("mxfp8", **overrides)
    assert str(caught.value) == message


@pytest.mark.parametrize("overrides, message", [
    (dict(amax_compute_algo="mean"), "amax_compute_algo must be one of max, most_recent, got 'mean'"),
    (dict(backend="cublas"), "backend must be one of auto, emulated, scaled_mm, te, got 'cublas'"),
    (dict(name=""), "name must be a non-empty string, got ''"),
    (dict(name=7), "name must be a non-empty string, got 7"),
    (dict(amax_history_len=0), "amax_history_len must be an int in [1, 65536] (steps of amax kept per layer and "
                               "role; each is memory and work on every update), got 0"),
    (dict(accumulator_promotion=48), "accumulator_promotion must be 0 (never) or a positive multiple of 32 "
                                     "(the MMA depth), got 48"),
])
def test_field_errors_name_the_field_the_allowed_values_and_the_value(overrides, message):
    with pytest.raises(ValueError) as caught:
        Fp8Recipe(**overrides)
    assert str(caught.value) == message
