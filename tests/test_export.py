"""FP8 weight export: bytes against an independent per-channel reference (numpy + ml_dtypes), reload and logits,
OCP <-> FNUZ conversion, refusal to read one dialect's bytes as the other's, and refusal to overwrite."""

from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file, save_file

from fp8train.serving.export import (SCALE_CONVENTION, compare_logits, convert_export, export_run, load_export, load_run,
                             read_export_metadata)
from refs import ML_DTYPES

FMT_MAX = {"e4m3fn": 448.0, "e4m3fnuz": 240.0}


@pytest.fixture(scope="module")
def tiny_run(tiny_fp8_run):
    return tiny_fp8_run  # conftest: a 30-step FP8 (current) run of a 2-layer, 64-wide model


@pytest.fixture(scope="module")
def exports(tiny_run, tmp_path_factory):
    folder = tmp_path_factory.mktemp("exports")
    paths = {fmt: folder / f"{fmt}.safetensors" for fmt in ("e4m3fn", "e4m3fnuz")}
    for fmt, path in paths.items():
        export_run(tiny_run, path, fmt)
    return paths


def _checkpoint_weights(run_dir) -> dict:
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return load_numpy(str(ckpt / "model.safetensors"))


FP8_LINEARS = [f"layers.{i}.{m}" for i in range(2) for m in
               ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj")]


# ------------------------------------------------------------------------------------------------------------
# Layout and bytes
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_export_bytes_match_independent_reference(tiny_run, exports, fmt):
    master = _checkpoint_weights(tiny_run)  # fp32 master weights as trained
    exported = load_file(str(exports[fmt]))
    for name in FP8_LINEARS:
        w = master[f"{name}.weight"]  # (out, in) fp32
        amax = np.abs(w).max(axis=1, keepdims=True)
        scale = (amax.astype(np.float64) / FMT_MAX[fmt]).astype(np.float32)  # (out, 1)
        codes = np.clip(w / scale, -FMT_MAX[fmt], FMT_MAX[fmt]).astype(ML_DTYPES[fmt]).view(np.uint8)
        data, data_scale = exported[f"{name}.weight"], exported[f"{name}.weight_scale"]
        assert data.dtype == {"e4m3fn": torch.float8_e4m3fn, "e4m3fnuz": torch.float8_e4m3fnuz}[fmt]
        assert tuple(data.shape) == w.shape
        assert data_scale.dtype == torch.float32 and tuple(data_scale.shape) == (w.shape[0], 1)
        np.testing.assert_array_equal(data_scale.numpy(), scale)
        np.testing.assert_array_equal(data.view(torch.uint8).numpy(), codes)
    # Outside the FP8 policy: bf16 copies of the master weights.
    kept = [k for k in exported if not k.startswith(tuple(FP8_LINEARS))]
    assert sorted(kept) == sorted(["embed.weight", "lm_head.weight", "norm.weight"]
                                  + [f"layers.{i}.{n}.weight" for i in range(2) for n in ("attn_norm", "mlp_norm")])
    for key in kept:
        assert exported[key].dtype == torch.bfloat16
        ref = master[key].astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(exported[key].float().numpy(), ref)


def test_export_metadata(tiny_run, exports):
    meta = read_export_metadata(exports["e4m3fn"])
    assert meta["fp8_format"] == "e4m3fn" and meta["fp8_dialect"] == "ocp"
    assert meta["scale_convention"] == SCALE_CONVENTION == "dequant: w = weight.float() * weight_scale"
    assert meta["source_step"] == "30" and meta["source_run"] == str(tiny_run.resolve())
    assert json.loads(meta["fp8_layers"]) == FP8_LINEARS
    assert json.loads(meta["model_config"])["d_model"] == 64
    assert read_export_metadata(exports["e4m3fnuz"])["fp8_dialect"] == "fnuz"


# ------------------------------------------------------------------------------------------------------------
# Reload and logits
# ------------------------------------------------------------------------------------------------------------
def _weights_quantized_like_export(model, path):
    """Independent check model: the plain source model holding the file's values, each FP8 layer's weight as
    weight.float() * weight_scale (a plain nn.Linear on the dequantized weights), the rest as the bf16 values."""
    import copy

    model = copy.deepcopy(model)
    tensors = load_file(str(path))
    values = {k: v.float() for k, v in tensors.items() if v.dtype == torch.bfloat16}
    values |= {f"{n}.weight": tensors[f"{n}.weight"].float() * tensors[f"{n}.weight_scale"] for n in FP8_LINEARS}
    model.load_state_dict(values)
    return model


@pytest.mark.parametrize("fmt", ["e4m3fn", "e4m3fnuz"])
def test_reloaded_export_logits(tiny_run, exports, fmt):
    from fp8train.training.data.corpus import build_data

    run = load_run(tiny_run)
    batches = build_data(run.cfg).val_batches()[:1]
    reloaded = load_export(exports[fmt])
    same_quant = _weights_quantized_like_export(run.model, exports[fmt])
    # fp32: the export's GEMM (x @ q.T) * scale equals x @ (q * scale).T up to fp32 rounding order.
    exact = compare_logits(same_quant, reloaded, batches, autocast=False)
    assert exact["max_abs_logit_diff"] < 1e-4 and exact["top1_agreement"] == 1.0
    # bf16 autocast (as in training): bf16 rounding of activations/outputs on both sides.
    bf16 = compare_logits(same_quant, reloaded, batches, autocast=True)
    assert bf16["max_abs_logit_diff"] < 0.1 and bf16["mean_kl"] < 1e-4
    # Against the unquantized source: FP8 weight error, measured and bounded.
    source = compare_logits(run.model, reloaded, batches, autocast=False)
    assert source["mean_kl"] < 1e-3 and source["top1_agreement"] > 0.95 and source["max_abs_logit_diff"] < 0.5


# ------------------------------------------------------------------------------------------------------------
# Dialects
# ------------------------------------------------------------------------------------------------------------
def _dequantized(path) -> dict:
    tensors = load_file(str(path))
    return {n: tensors[f"{n}.weight"].float() * tensors[f"{n}.weight_scale"] for n in FP8_LINEARS}


def test_ocp_fnuz_ocp_round_trip_is_exact(exports, tmp_path):
    ocp, fnuz, back = exports["e4m3fn"], tmp_path / "fnuz.safetensors", tmp_path / "back.safetensors"
    assert convert_export(ocp, fnuz, "e4m3fnuz")["changed_values"] == 0
    assert convert_export(fnuz, back, "e4m3fn")["changed_values"] == 0
    original, moved, returned = _dequantized(ocp), _dequantized(fnuz), _dequantized(back)
    a, b = load_file(str(ocp)), load_file(str(fnuz))
    for name in FP8_LINEARS:
        assert torch.equal(original[name], moved[name]) and torch.equal(original[name], returned[name])
        assert torch.equal(b[f"{name}.weight_scale"], 2 * a[f"{name}.weight_scale"])  # exactly doubled
        assert b[f"{name}.weight"].dtype == torch.float8_e4m3fnuz
    c = load_file(str(back))
    for key in a:  # bytes come back too (OCP -0 would come back as +0: FNUZ has no -0)
        if a[key].dtype == torch.float8_e4m3fn:
            assert torch.equal(a[key].float(), c[key].float())
        else:
            assert torch.equal(a[key], c[key])
    meta = read_export_metadata(fnuz)
    assert meta["fp8_format"] == "e4m3fnuz" and meta["fp8_dialect"] == "fnuz"
    assert meta["converted_from"].startswith("e4m3fn ")
    assert load_export(fnuz, expect_format="e4m3fnuz") is not None


def test_loading_ocp_as_fnuz_is_refused(exports, tmp_path):
    with pytest.raises(ValueError, match="e4m3fnuz.*expected"):
        load_export(exports["e4m3fn"], expect_format="e4m3fnuz")
    with pytest.raises(ValueError, match="e4m3fn.*expected"):
        load_export(exports["e4m3fnuz"], expect_format="e4m3fn")
    # OCP bytes whose metadata claims FNUZ: the dtype check catches it, nothing is reinterpreted.
    tensors = load_file(str(exports["e4m3fn"]))
    meta = read_export_metadata(exports["e4m3fn"]) | {"fp8_format": "e4m3fnuz", "fp8_dialect": "fnuz"}
    forged = tmp_path / "forged.safetensors"
    save_file(tensors, str(forged), metadata=meta)
    with pytest.raises(ValueError, match="refusing to reinterpret"):
        load_export(forged)
    with pytest.raises(ValueError, match="not an fp8train FP8 export"):
        save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
        load_export(tmp_path / "plain.safetensors")


def test_inexact_conversion_is_refused(exports, tmp_path):
    fnuz = tmp_path / "fnuz.safetensors"
    convert_export(exports["e4m3fn"], fnuz, "e4m3fnuz")
    tensors = load_file(str(fnuz))
    meta = read_export_metadata(fnuz)
    weight = tensors[f"{FP8_LINEARS[0]}.weight"].view(torch.uint8).clone()
    weight[0, 0], weight[0, 1] = 0x7F, 0x01  # FNUZ max 240 and min subnormal 2^-10: no OCP scaling holds both
    tensors[f"{FP8_LINEARS[0]}.weight"] = weight.view(torch.float8_e4m3fnuz)
    crafted = tmp_path / "crafted.safetensors"
    save_file(tensors, str(crafted), metadata=meta)
    with pytest.raises(ValueError, match="would change"):
        convert_export(crafted, tmp_path / "out.safetensors", "e4m3fn")
    assert not (tmp_path / "out.safetensors").exists()
    result = convert_export(crafted, tmp_path / "out.safetensors", "e4m3fn", allow_inexact=True)
    assert result["changed_values"] >= 1
    with pytest.raises(ValueError, match="already e4m3fnuz"):
        convert_export(fnuz, tmp_path / "same.safetensors", "e4m3fnuz")


# ------------------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------------------
def test_existing_path_refused_without_force(tiny_run, exports, tmp_path, capsys):
    from fp8train.cli import main

    target = tmp_path / "existing.safetensors"
    target.write_bytes(b"precious")
    before = os.stat(target).st_mtime_ns
    with pytest.raises(FileExistsError, match="existing.safetensors"):
        export_run(tiny_run, target, "e4m3fn")
    with pytest.raises(FileExistsError):
        convert_export(exports["e4m3fn"], target, "e4m3fnuz")
    assert main(["export", str(tiny_run), "--format", "e4m3fn", "--out", str(target), "--no-check"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert target.read_bytes() == b"precious" and os.stat(target).st_mtime_ns == before
    # --force replaces only an fp8train export (the mark in its safetensors header): a file of the user's, or a
    # safetensors file another tool wrote, is refused with one line and left as it was
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.ones(2, 2)}, str(foreign), metadata={"format": "pt"})
    for path in (target, foreign):
        content = path.read_bytes()
        assert main(["export", str(tiny_run), "--format", "e4m3fn", "--out", str(path), "--force", "--no-check"]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--out {path} is a file that fp8train did not write" in err and "nothing was written" in err, err
        assert len(err.splitlines()) == 1 and path.read_bytes() == content
        with pytest.raises(ValueError, match="fp8train did not write"):
            convert_export(exports["e4m3fn"], path, "e4m3fnuz", force=True)
        assert path.read_bytes() == content
    target.unlink()
    foreign.unlink()
    shutil.copyfile(exports["e4m3fnuz"], target)  # fp8train's own export: replaced
    assert main(["export", str(tiny_run), "--format", "e4m3fn", "--out", str(target), "--force"]) == 0
    assert read_export_metadata(target)["fp8_format"] == "e4m3fn"
    assert "top-1 agreement" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir()] == ["existing.safetensors"]  # no temporary files left
    converted = tmp_path / "converted.safetensors"
    shutil.copyfile(exports["e4m3fn"], converted)  # a conversion's --force replaces an export too
    assert convert_export(exports["e4m3fn"], converted, "e4m3fnuz", force=True)["format"] == "e4m3fnuz"
    assert read_export_metadata(converted)["fp8_format"] == "e4m3fnuz"


def test_bad_run_dir_and_format(tiny_run, tmp_path):
    with pytest.raises(ValueError, match="e5m2"):
        export_run(tiny_run, tmp_path / "x.safetensors", "e5m2")
    no_ckpt = tmp_path / "no_ckpt"
    no_ckpt.mkdir()
    shutil.copy(tiny_run / "config.yaml", no_ckpt / "config.yaml")
    with pytest.raises(ValueError, match="no valid checkpoint"):
        export_run(no_ckpt, tmp_path / "x.safetensors", "e4m3fn")
    with pytest.raises(ValueError, match="no config.yaml"):
        export_run(tmp_path, tmp_path / "x.safetensors", "e4m3fn")
    assert not (tmp_path / "x.safetensors").exists()


def test_fp8_names_match_the_runs_conversion(tiny_run):
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert load_run(tiny_run).fp8_names == summary["conversion"]["converted"] == FP8_LINEARS
    with safe_open(str(sorted((tiny_run / "checkpoints").glob("step_*"))[-1] / "model.safetensors"), "pt") as f:
        assert any(k.endswith("_nonfinite_amax_count") for k in f.keys())  # an FP8 checkpoint was mapped


def test_tied_embeddings_run_exports_and_reloads(tmp_path):
    # A hand-made run directory (config.yaml + one checkpoint) with a tied output head, no training needed.
    from fp8train.training.runs.checkpoint import save_checkpoint
    from fp8train.training.config import config_to_yaml, load_config
    from fp8train.training.models.decoder import build_model

    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=tied", "model.d_model=32", "model.n_layers=1",
                             "model.n_heads=2", "model.seq_len=16", "model.tie_embeddings=true",
                             "policy.min_features=16", "fp8.recipe=none"])
    run_dir = tmp_path / "tied"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    save_checkpoint(run_dir / "checkpoints", 1, model, torch.optim.AdamW(model.parameters()))
    export_run(run_dir, tmp_path / "tied.safetensors", "e4m3fn")
    names = set(load_file(str(tmp_path / "tied.safetensors")))
    assert "embed.weight" in names and "lm_head.weight" not in names  # stored once
    reloaded = load_export(tmp_path / "tied.safetensors")
    assert reloaded.lm_head.weight is reloaded.embed.weight
    x = torch.randint(0, 256, (2, 16))
    stats = compare_logits(model.eval(), reloaded, [(x, None)], autocast=False)
    assert stats["mean_kl"] < 1e-3


@pytest.mark.parametrize("edit", [("  seed: 1337\n", "  seed: 7\n"), ("  d_model: 64\n", "  d_model: 32\n")],
                         ids=["seed", "d_model"])
@pytest.mark.parametrize("command", ["export", "kv-eval"])
def test_a_checkpoint_not_written_by_the_runs_config_is_refused(tiny_run, tmp_path, edit, command, commands,
                                                                capsys):
    """The checkpoint must come from a run of the folder's config.yaml (its manifest's resume_hash, as a resume
    requires): an edited config.yaml (or, equally, a checkpoint folder copied in from a run with another seed)
    would export or evaluate weights that are not this run's (seed: silently), or fail deep in load_state_dict
    (d_model: a traceback). One line naming the checkpoint, exit 2, nothing written."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    config = run / "config.yaml"
    assert edit[0] in config.read_text()
    config.write_text(config.read_text().replace(*edit))
    out = tmp_path / "out"
    argv = {"export": ["export", str(run), "--format", "e4m3fn", "--out", str(out), "--no-check"],
            "kv-eval": ["kv-eval", str(run), "--out", str(out), "--batches", "1", "--gen-prompts", "0",
                        "--calib-batches", "1", "--format", "e4m3fn"]}[command]
    code, _, err = commands.main(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "resume_hash" in lines[0] and "checkpoints" in lines[0], err
    assert not out.exists()


@pytest.mark.parametrize("extra, out_name, named", [
    (["--format", "hf", "--weight-block", "16"], "o", "--weight-block"),
    (["--format", "hf", "--activations", "static"], "o", "--activations"),
    (["--format", "e4m3fn", "--activations", "static"], "o.safetensors", "--activations"),
    (["--format", "e4m3fn", "--weight-block", "16"], "o.safetensors", "--weight-block"),
    (["--format", "e4m3fn", "--dtype", "bfloat16"], "o", "--dtype"),
    (["--format", "e4m3fn", "--calib-batches", "2"], "o", "--calib-batches"),
    (["--format", "e4m3fn", "--allow-inexact"], "o", "--allow-inexact"),
    (["--format", "e4m3fn", "--activations", "static", "--calib-batches", "100000000"], "o", "--calib-batches"),
], ids=["hf-block", "hf-static", "file-static", "file-block", "fp8-dtype", "dynamic-calib", "run-inexact",
        "calib-bound"])
def test_an_option_that_does_not_apply_is_refused_not_ignored(tiny_run, tmp_path, extra, out_name, named, commands,
                                                              capsys):
    """Each of these options shapes one kind of export; given to another kind it was silently ignored (an hf
    folder without the asked-for blocks looks like it has them), and a huge --calib-batches calibrated for hours.
    One line naming the option, exit 2, nothing written."""
    out = tmp_path / out_name
    code, _, err = commands.main(["export", str(tiny_run), *extra, "--out", str(out), "--no-check"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and named in lines[0], err
    assert not out.exists()


@pytest.mark.parametrize("damaged", ["manifest.json", "model.safetensors"])
def test_export_says_why_no_checkpoint_is_valid(tiny_run, tmp_path, damaged, commands, capsys):
    """The only checkpoint damaged: the one line names the file that failed its check (it said only "no valid
    checkpoint")."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]
    for old in sorted((run / "checkpoints").iterdir())[:-1]:
        shutil.rmtree(old)
    (checkpoint / damaged).write_bytes(b"")
    code, _, err = commands.main(["export", str(run), "--format", "e4m3fn", "--out", str(tmp_path / "o"),
                                  "--no-check"], capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and damaged in lines[0], err


def test_convert_of_a_folder_export_says_it_is_a_folder(exports, tmp_path, commands, capsys):
    folder = tmp_path / "folder_export"
    folder.mkdir()
    code, _, err = commands.main(["export", "--convert", str(folder), "--format", "e4m3fnuz", "--out",
                                  str(tmp_path / "o.safetensors"), "--no-check"], capsys)
    assert code == 2 and "is a folder" in err and "does not exist" not in err, err
