"""Per-layer recipes (policy.overrides, policy.overrides_file) and the layer-recipes choice rule and file format."""

from __future__ import annotations

import json
import re

import pytest
import torch.nn as nn

from fp8train.evidence.layer_recipes import DEFAULT_THRESHOLDS, choose, layer_recipes_yaml
from fp8train.nn.convert import LayerPolicy, convert_to_fp8
from fp8train.nn.linear import Fp8Linear
from fp8train.training.config import layer_policy_from_config, load_config
from fp8train.training.config.fp8 import read_overrides_file


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.up_proj, self.down_proj = nn.Linear(64, 64), nn.Linear(64, 128), nn.Linear(128, 64)


def _model():
    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    return model


def test_first_matching_override_decides_and_bf16_keeps_high_precision():
    model = _model()
    policy = LayerPolicy(overrides={r"layers\.0\.": "bf16", r"up_proj$": "rowwise", r"proj$": "mxfp8"})
    report = convert_to_fp8(model, "current", policy)
    assert not isinstance(model.layers[0].q_proj, Fp8Linear)  # the first pattern wins over the later ones
    assert model.layers[1].up_proj.recipe.name == "rowwise"
    assert model.layers[1].q_proj.recipe.name == "mxfp8"
    skipped = dict(report.skipped)
    assert skipped["layers.0.up_proj"] == r"policy.overrides 'layers\\.0\\.' -> bf16"
    assert "rowwise (policy.overrides 'up_proj$')" in dict(report.converted)["layers.1.up_proj"]


def test_override_cannot_force_a_layer_the_policy_excludes():
    model = _model()
    with pytest.warns(UserWarning, match="no nn.Linear was eligible for FP8"):  # and it says so
        convert_to_fp8(model, "current", LayerPolicy(min_features=100, overrides={"q_proj": "rowwise"}))
    assert not isinstance(model.layers[1].q_proj, Fp8Linear)  # 64 < min_features: overrides choose among converted


def test_pattern_matching_no_layer_is_refused_before_any_swap():
    model = _model()
    with pytest.raises(ValueError, match=r"q_proj\$' matches no nn.Linear of this model"):
        convert_to_fp8(model, "current", LayerPolicy(overrides={r"^layers\.7\.q_proj$": "bf16"}))
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())  # nothing was swapped


@pytest.mark.parametrize("overrides, match", [({"(unclosed": "bf16"}, "not a valid regex"),
                                              ({"q_proj": "fp16"}, "allowed bf16, delayed")])
def test_bad_overrides_name_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        LayerPolicy(overrides=overrides)



def test_normalize_overrides_errors_name_the_default_key():
    from fp8train.nn.overrides import normalize_overrides
    with pytest.raises(ValueError) as caught:
        normalize_overrides({"q_proj": "fp16"})
    assert str(caught.value) == "policy.overrides['q_proj']='fp16': allowed bf16, delayed, current, rowwise, block, mxfp8"
    with pytest.raises(ValueError) as caught:
        normalize_overrides([("q_proj", "bf16", "extra")])
    assert str(caught.value) == "policy.overrides: each entry must map a regex to a recipe, got ('q_proj', 'bf16', 'extra')"
    with pytest.raises(ValueError) as caught:
        normalize_overrides({"(unclosed": "bf16"})
    assert str(caught.value).startswith("policy.overrides: '(unclosed' is not a valid regex: ")
    assert normalize_overrides({"q_proj$": "bf16", "up": "current"}) == (("q_proj$", "bf16"), ("up", "current"))


def _choices(choices):
    rows = [dict(layer=name, shape=[1, 2, 3], choice=c, comment=f"because {name}") for name, c in choices]
    return dict(run_dir="runs/x", device="cpu", device_name="test cpu", baseline="bf16", repeats=3,
                thresholds=DEFAULT_THRESHOLDS, recipes=["current"], layers=rows,
                fp8_layers=sum(c != "bf16" for _, c in choices))


def test_layer_recipes_file_round_trips_through_policy_overrides_file(tmp_path):
    names = [("layers.0.q_proj", "bf16"), ("layers.1.up_proj", "rowwise"), ("it's.odd", "current")]
    path = tmp_path / "layers.yaml"
    path.write_text(layer_recipes_yaml(_choices(names)))
    pairs = read_overrides_file(str(path))
    assert [c for _, c in pairs] == [c for _, c in names]
    for (pattern, _), (name, _) in zip(pairs, names):  # anchored: matches exactly its layer
        assert re.search(pattern, name) and not re.search(pattern, name + "x") and not re.search(pattern, "a" + name)
    cfg = load_config(None, [f"policy.overrides_file={path}", "policy.overrides={down_proj: block}"])
    assert layer_policy_from_config(cfg).overrides == pairs + (("down_proj", "block"),)  # the file first
    assert "no layer is faster in FP8 here" in layer_recipes_yaml(_choices([("a", "bf16")]))


def _shadow(sqnr=30.0, overflow=0.0, underflow=0.0):
    stats = dict(sqnr_db=sqnr, overflow_frac=overflow, underflow_frac=underflow)
    return {role: dict(stats) for role in ("input", "weight", "grad_output")}


@pytest.mark.parametrize("timing, shadow, expected", [
    # fastest passing recipe wins
    ({"fp32": 2.0, "bf16": 1.0, "current": 0.5, "rowwise": 0.6}, {"current": _shadow(), "rowwise": _shadow()},
     "current"),
    # the fastest fails its numerics (SQNR), the next one passes
    ({"fp32": 2.0, "bf16": 1.0, "current": 0.5, "rowwise": 0.6}, {"current": _shadow(sqnr=10.0),
                                                                "rowwise": _shadow()}, "rowwise"),
    # overflow above 0.1%
    ({"fp32": 2.0, "bf16": 1.0, "current": 0.5}, {"current": _shadow(overflow=0.01)}, "bf16"),
    # passing but not 5% faster than bf16
    ({"fp32": 2.0, "bf16": 1.0, "current": 0.97}, {"current": _shadow()}, "bf16"),
])
def test_choice_rule(timing, shadow, expected):
    choice, comment = choose(timing, shadow, "bf16", DEFAULT_THRESHOLDS)
    assert choice == expected, comment
    assert "speedup over bf16" in comment and "over fp32" in comment


def test_choice_comment_lists_speedups_fastest_first_and_the_other_baseline():
    """The comment behind a choice, by hand: speedups over the deciding baseline, fastest first; the fastest
    recipe's speedup over the other baseline; the chosen recipe's SQNR per role."""
    timing = {"fp32": 2.0, "bf16": 1.0, "current": 0.5, "rowwise": 0.4}
    shadow = {"current": _shadow(), "rowwise": _shadow(sqnr=31.25)}  # current first: not the sorted order
    assert choose(timing, shadow, "bf16", DEFAULT_THRESHOLDS) == (
        "rowwise", "speedup over bf16: rowwise 2.50x, current 2.00x; over fp32: rowwise 5.00x; "
                   "rowwise SQNR in/w/grad 31.2/31.2/31.2 dB")
    assert choose(timing, shadow, "fp32", DEFAULT_THRESHOLDS) == (
        "rowwise", "speedup over fp32: rowwise 5.00x, current 4.00x; over bf16: rowwise 2.50x; "
                   "rowwise SQNR in/w/grad 31.2/31.2/31.2 dB")


def test_shadow_table_means_maxima_and_a_resumed_step_counted_once():
    from fp8train.evidence.layer_recipes import shadow_table

    def record(step, sqnr, overflow, underflow):
        stats = dict(sqnr_db=sqnr, overflow_frac=overflow, underflow_frac=underflow)
        return {"step": step, "shadow": {"l": {"current": {"input": stats}}}}

    records = [record(10, 20.0, 0.0, 0.1), record(20, "inf", 0.004, 0.2), {"step": 25},  # no shadow at 25
               record(30, 40.0, 0.001, 0.6), record(30, 30.0, 0.002, 0.3)]  # step 30 again (resumed): the last
    assert shadow_table(records) == {"l": {"current": {"input": {
        "sqnr_db": 25.0,  # mean of the finite 20 and 30 (inf: an exact quantization, left out)
        "overflow_frac": 0.004,  # the worst step
        "underflow_frac": pytest.approx(0.2),  # mean of 0.1, 0.2, 0.3
    }}}}


def test_layer_recipes_command_on_a_hand_written_run(tmp_path, capsys):
    """`fp8train layer-recipes` from a run directory written by hand: its config and shadow telemetry saying that one
    layer's gradients lose too much in FP8 (SQNR 5 dB). With --min-speedup 0 the numerics alone decide (this
    CPU's timings do not), so every other layer gets the one shadowed recipe."""
    import argparse

    from fp8train.evidence.layer_recipes import add_cli_arguments, cli_main
    from fp8train.training.config import config_to_yaml

    cfg = load_config(None, ["model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.seq_len=32",
                             "train.batch_size=4"])
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(config_to_yaml(cfg))
    names = [f"layers.0.attn.{p}_proj" for p in "qkvo"] + [f"layers.0.mlp.{p}_proj" for p in ("gate", "up",
                                                                                              "down")]
    good = dict(sqnr_db=30.0, overflow_frac=0.0, underflow_frac=0.01)
    shadow = {n: {"current": {"input": good, "weight": good,
                              "grad_output": dict(good, sqnr_db=5.0) if n.endswith("down_proj") else good}}
              for n in names}
    (run / "telemetry.jsonl").write_text("".join(json.dumps({"step": step, "layers": {}, "shadow": shadow}) + "\n"
                                                 for step in (10, 20)))
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    assert "where to time the layer shapes (default: cuda if available)" in " ".join(parser.format_help().split())
    out = tmp_path / "layers.yaml"
    args = parser.parse_args([str(run), "--out", str(out), "--repeats", "1", "--min-speedup", "0"])
    assert cli_main(args) == 0
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("6 of 7 layers in FP8 on ") and printed.endswith(f"; written to {out}")
    text = out.read_text()
    assert text.splitlines()[0].endswith(" (cpu)")  # device auto on a machine without CUDA
    assert read_overrides_file(str(out)) == tuple(
        ("^" + re.escape(n) + "$", "bf16" if n.endswith("down_proj") else "current") for n in names)
    down = next(line for line in text.splitlines() if "down_proj" in line)
    assert "# 128x176x64 speedup over bf16: current " in down  # 4 sequences x 32 tokens, in 176, out 64
    assert down.endswith("; no recipe passes the numerics; current: grad_output SQNR 5.0 dB < 15")
