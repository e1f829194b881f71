"""End to end on the CPU recipe: a bf16 run with recipe shadowing, `fp8train layer-recipes` from it (bad inputs refused
with exit 2 and nothing written), and the chosen recipes as a validation candidate. Real processes' code paths, tiny model."""

from __future__ import annotations

import json

import pytest

from fp8train import cli
from fp8train.training.config import load_config
from fp8train.training.loop import train

pytestmark = pytest.mark.slow
TINY = ["model.d_model=64", "model.n_layers=1", "model.n_heads=2", "model.seq_len=32", "train.max_steps=6",
        "train.batch_size=4", "train.eval_every=6", "train.eval_batches=1", "optim.warmup_steps=1",
        "log.wandb=disabled", "log.telemetry_every=3", "data.max_bytes=200000", "train.threads=1",
        "train.autocast=none", "checkpoint.save_final=false"]


@pytest.fixture(scope="module")
def shadowed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("layers")
    cfg = load_config(None, [f"run.dir={root}", "run.name=bf16", "fp8.recipe=none",
                             "log.shadow_recipes=[current,rowwise,mxfp8]", *TINY])
    assert train(cfg, show_progress=False)["status"] == "completed"
    return root / "bf16"


def test_shadow_telemetry_is_written_for_every_converted_layer(shadowed_run):
    lines = [json.loads(line) for line in (shadowed_run / "telemetry.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 6]
    shadow = lines[0]["shadow"]
    assert set(shadow) == {f"layers.0.{n}" for n in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
                                                      "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    for recipes in shadow.values():
        assert set(recipes) == {"current", "rowwise", "mxfp8"}
        assert all(set(roles) == {"input", "weight", "grad_output"} for roles in recipes.values())


def test_run_report_carries_the_shadow_table(shadowed_run):
    assert cli.main(["report", str(shadowed_run)]) == 0
    report = (shadowed_run / "report.md").read_text()
    assert "## Recipe shadowing" in report
    for recipe in ("current", "rowwise", "mxfp8"):
        assert f"| {recipe} | grad_output | " in report


def test_layer_recipes_then_validate(shadowed_run, tmp_path, capsys):
    out = tmp_path / "layers.yaml"
    # --min-speedup 0: decide on numerics only, so this CPU's choice has FP8 layers to validate (with the default
    # 1.05 the honest CPU answer is usually "no layer is faster in FP8 here")
    assert cli.main(["layer-recipes", str(shadowed_run), "--out", str(out), "--repeats", "1", "--min-speedup", "0"]) == 0
    text = out.read_text()
    assert "policy:" in text and text.count("  # ") == 7  # a comment per layer
    assert ": current  #" in text or ": rowwise  #" in text
    assert "mxfp8  #" not in text  # the OCP rule's clipping shows as overflow > 0.1% on these activations
    assert cli.main(["layer-recipes", str(shadowed_run), "--out", str(out), "--repeats", "1"]) == 2  # exists: refused
    assert cli.main(["layer-recipes", str(shadowed_run), "--out", str(out), "--repeats", "1", "--min-speedup", "0",
                     "--force"]) == 0  # its own earlier file: replaced (a user's file is not: test_output_safety.py)
    assert out.read_text().startswith("# fp8train layer-recipes for ") and out.read_text().count("  # ") == 7
    code = cli.main(["validate", "--config", "recipes/cpu_validate.yaml", f"run.dir={tmp_path}", "run.name=v",
                     f"validate.candidates=[layers=current:policy.overrides_file={out}]", "validate.seeds=2",
                     "--quiet", *TINY, "train.eval_every=3", "validate.final_window=1"])
    summary = json.loads((tmp_path / "v" / "summary.json").read_text())
    assert code in (0, 1, 3) and summary["verdict"] in ("pass", "fail", "inconclusive")
    assert "verdict" in summary["candidates"]["layers"]  # the chosen recipes got its own verdict against bf16


def test_layer_recipes_bad_inputs_exit_2_and_write_nothing(shadowed_run, tmp_path):
    out = tmp_path / "layers.yaml"
    assert cli.main(["layer-recipes", str(tmp_path / "nope"), "--out", str(out)]) == 2
    no_shadow = tmp_path / "run"
    no_shadow.mkdir()
    (no_shadow / "config.yaml").write_text((shadowed_run / "config.yaml").read_text())
    assert cli.main(["layer-recipes", str(no_shadow), "--out", str(out)]) == 2  # no telemetry.jsonl: no shadow data
    assert not out.exists()
    other = tmp_path / "other.yaml"
    other.write_text("policy:\n  overrides:\n    '^layers\\.9\\.mlp\\.up_proj$': rowwise\n")
    code = cli.main(["train", "--config", "recipes/cpu_validate.yaml", f"run.dir={tmp_path}", "run.name=t",
                     "fp8.recipe=current", f"policy.overrides_file={other}", "--quiet", *TINY])
    assert code == 2 and not (tmp_path / "t").exists()  # a file made for another model: refused, nothing written
