"""FP8 weight export for serving, its loader, and conversion between the OCP and FNUZ dialects.

    fp8train export RUN_DIR --format e4m3fn --out model-fp8/              a folder transformers and vLLM load
    fp8train export RUN_DIR --format e4m3fn --out model-fp8.safetensors   one file, fp8train's own layout
    fp8train export --convert model-fp8.safetensors --format e4m3fnuz --out model-fnuz.safetensors
    fp8train export RUN_DIR --format hf --out model/                      dense: from_pretrained, next model.hf_path

An --out ending in `.safetensors` writes the single-file export below; any other --out writes a Hugging Face
folder (fp8train.serving.hf_export), and `--format hf` the dense one (fp8train.serving.dense_export). Which
model: fp8train.serving.run_loading (the newest valid checkpoint, loaded once).

Layout of a single-file export (the serving-engine convention for per-channel FP8 weights):

    <name>.weight        float8 (e4m3fn or e4m3fnuz), shape (out_features, in_features)
    <name>.weight_scale  float32, shape (out_features, 1): one DEQUANT scale per output channel (row),
                         w ~= weight.float() * weight_scale; weight_scale = amax(|w[row]|) / fmt.max
    <name>.bias          bfloat16 (only if the layer has one)
    everything else      bfloat16 (embeddings, lm_head, norms, and Linears the run's policy kept out of FP8)

for every Linear `<name>` that the run's layer policy puts in FP8 (the same rule whether the run trained in FP8 or
bf16). Tensor names are the model's state_dict names (no prefix). A tied lm_head is stored once, as
`embed.weight`. Metadata (all strings): see `_metadata`; `fp8train.serving.export` marks the file, `fp8_format` and
`fp8_dialect` say how to read the bytes, and a loader never reads one dialect's bytes as the other's: the float8
dtype of every weight must match `fp8_format`, and `load_export(expect_format=...)` refuses a mismatch.

The loader rebuilds the model from the `model_config` in the metadata and runs each FP8 Linear as a weight-only
FP8 GEMM (emulated): bf16 activations times the exact FP8 weight values, accumulated in fp32, then the
per-channel scale, then one rounding to the output dtype (`Fp8WeightLinear`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fp8train.numerics.formats import get_format
from fp8train.numerics.quant import Fp8Tensor, convert_dialect, quantize
from fp8train.serving.fp8_weights import (ACTIVATION_SCHEMES, Fp8WeightLinear, dequantized_weight_model,
                                          fp8_weight_model, quantize_weight_per_channel)
from fp8train.serving.dense_export import DENSE_DTYPES, DENSE_FORMAT, export_dense_folder
from fp8train.serving.expert_export import split_expert_names
from fp8train.serving.export_checks import compare_logits, fidelity_bounds, print_check, refuse_failed_source
from fp8train.serving.export_file import EXPORT_MARK, check_export_file
from fp8train.serving.export_options import check_options
from fp8train.serving.hf_export import export_hf_folder, export_notes, load_hf_export
from fp8train.serving.run_loading import (LoadedRun, fp8_linear_names, fp8_policy_names, load_run, loaded_run,
                                          package_version, source_dir, tied_aliases)
from fp8train.training.config import ModelConfig
from fp8train.training.data.corpus import build_data
from fp8train.training.models.decoder import build_model
from fp8train.training.storage.outputs import claim_output_path
from fp8train.training.storage.files import as_os_error, give_default_mode, write_failure, write_file_atomic

__all__ = [
    "EXPORT_FORMATS", "SCALE_CONVENTION", "LoadedRun", "load_run", "fp8_policy_names", "quantize_weight_per_channel",
    "Fp8WeightLinear", "fp8_weight_model", "export_run", "read_export_metadata", "load_export", "convert_export",
    "compare_logits", "check_export", "add_cli_arguments", "cli_main", "export_hf_folder", "load_hf_export",
    "export_dense_folder",
]

EXPORT_FORMATS = ("e4m3fn", "e4m3fnuz")
SCALE_CONVENTION = "dequant: w = weight.float() * weight_scale"
SCALE_LAYOUT = "per-output-channel: weight_scale float32 shape (out_features, 1), amax(|row|) / fmt.max"


def _dialect(fmt_name: str) -> str:  # ocp | fnuz
    return "fnuz" if fmt_name.endswith("fnuz") else "ocp"


def _export_format(name: str):
    fmt = get_format(name) if isinstance(name, str) and name in ("e4m3", *EXPORT_FORMATS) else None
    if fmt is None:
        raise ValueError(f"export --format {name!r} is not supported; allowed: {', '.join(EXPORT_FORMATS)} "
                         "(E4M3 weights: OCP e4m3fn, or e4m3fnuz for AMD MI300)")
    return fmt


# ------------------------------------------------------------------------------------------------------------
# Export, metadata, loader, conversion
# ------------------------------------------------------------------------------------------------------------
def _write_atomically(tensors: dict, metadata: dict, out: Path) -> None:
    # Written next to the target and renamed (storage.files.write_file_atomic): a failure never leaves a
    # half-written file at `out`, and with --force the old file is replaced only once the new one is complete.
    def save(tmp: Path) -> None:
        try:
            save_file(tensors, str(tmp), metadata=metadata)
        except Exception as err:  # safetensors' own error type: its OSError (full disk) only in the text
            raise as_os_error(err, out) or err
        give_default_mode(tmp)  # safetensors writes 0600

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise write_failure(err, out) from None
    write_file_atomic(out, save)


def _metadata(fmt, run: LoadedRun, fp8_names: list) -> dict:
    return {
        "fp8train.serving.export": EXPORT_MARK,
        "fp8_format": fmt.name,  # how to read the float8 bytes
        "fp8_dialect": _dialect(fmt.name),  # ocp | fnuz
        "fp8train_version": package_version(),
        "scale_convention": SCALE_CONVENTION,
        "scale_layout": SCALE_LAYOUT,
        "high_precision_dtype": "bfloat16",
        "fp8_layers": json.dumps(fp8_names),
        "model_config": json.dumps(_model_config_dict(run.cfg.model)),
        "tie_embeddings": str(bool(run.cfg.model.tie_embeddings)).lower(),
        "source_run": str(run.run_dir.resolve()),
        "source_checkpoint": run.checkpoint.name,
        "source_step": str(run.step),
        "source_recipe": run.cfg.fp8.recipe,
        "converted_from": "",
    }


def _model_config_dict(model_cfg) -> dict:
    return {f.name: getattr(model_cfg, f.name) for f in dataclasses.fields(model_cfg)}


def export_run(run_dir, out, fmt="e4m3fn", force: bool = False, tokenizer: str | None = None) -> dict:
    """Write the FP8 export of ``run_dir``'s newest valid checkpoint (or of a LoadedRun) to ``out`` (see the module
    docstring)."""
    fmt = _export_format(fmt)
    out = check_export_file(out, force, sources=[source_dir(run_dir)])
    run = loaded_run(run_dir, tokenizer)  # (tokenizer: a Hugging Face folder without one)
    names = fp8_linear_names(run)
    tensors, aliases = {}, tied_aliases(run.model)
    fp8_params = {f"{n}.weight" for n in names} | {f"{n}.bias" for n in names}
    for name in names:
        linear = run.model.get_submodule(name)
        q = quantize_weight_per_channel(linear.weight, fmt)
        tensors[f"{name}.weight"] = q.data.contiguous()  # (out, in) float8
        tensors[f"{name}.weight_scale"] = q.scale.reshape(-1, 1).float().contiguous()  # (out, 1) fp32
        if linear.bias is not None:
            tensors[f"{name}.bias"] = linear.bias.detach().to(torch.bfloat16).contiguous()
    for key, value in run.model.state_dict().items():
        if key in fp8_params or key in aliases:
            continue
        value = value.detach()
        tensors[key] = (value.to(torch.bfloat16) if value.is_floating_point() else value).contiguous()
    _write_atomically(tensors, _metadata(fmt, run, names), out)
    return {"path": str(out), "format": fmt.name, "fp8_layers": len(names), "step": run.step,
            "bytes": out.stat().st_size, "experts_bf16": len(split_expert_names(run.model, run.fp8_names)[1])}


def read_export_metadata(path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"export {str(path)!r} is a folder; --convert converts a single-file export (written with "
                         "--out FILE.safetensors): export the run again in the other format for a folder")
    if not path.is_file():
        raise ValueError(f"export {str(path)!r} does not exist (or is not a file)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except Exception as err:  # safetensors raises its own error types for non-safetensors files
        raise ValueError(f"{str(path)!r} is not a readable safetensors file: {err}") from None
    if meta.get("fp8train.serving.export") != EXPORT_MARK:
        raise ValueError(f"{str(path)!r} is not an fp8train FP8 export (metadata 'fp8train.serving.export' is "
                         f"{meta.get('fp8train.serving.export')!r}, expected {EXPORT_MARK!r})")
    return meta


def load_export(path, expect_format=None, device="cpu") -> nn.Module:
    """The model of an export, ready to run (eval mode; run it under bf16 autocast as in training).

    ``expect_format`` (e.g. "e4m3fnuz" on an MI300 path): refuse an export of another format. Bytes are never
    reinterpreted: every FP8 weight's dtype must be the one its metadata names.
    """
    meta = read_export_metadata(path)
    fmt = get_format(meta["fp8_format"])
    if expect_format is not None and get_format(expect_format).name != fmt.name:
        want = get_format(expect_format).name
        raise ValueError(f"export {str(path)!r} holds {fmt.name} ({_dialect(fmt.name).upper()}) weights but "
                         f"{want} ({_dialect(want).upper()}) was expected; reading its bytes as {want} would be "
                         f"wrong (off by 2x or worse). Convert it: fp8train export --convert {path} --format {want} "
                         "--out NEW_PATH")
    tensors = load_file(str(path), device=str(device))
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(ModelConfig(**json.loads(meta["model_config"])))
    fp8_names = json.loads(meta["fp8_layers"])
    for name in fp8_names:
        weight, scale = tensors.pop(f"{name}.weight"), tensors.pop(f"{name}.weight_scale")
        if weight.dtype != fmt.torch_dtype:
            raise ValueError(f"export {str(path)!r}: {name}.weight is {weight.dtype} but the metadata says "
                             f"{fmt.name}; refusing to reinterpret the bytes")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Fp8WeightLinear(weight, scale, tensors.pop(f"{name}.bias", None), fmt))
    expected = model.state_dict()
    fp8_keys = {f"{n}.{t}" for n in fp8_names for t in ("weight", "weight_scale", "bias")}
    aliases = tied_aliases(model)
    unexpected = [k for k in tensors if k not in expected]
    missing = [k for k in expected if k not in tensors and k not in aliases and k not in fp8_keys]
    if unexpected or missing:
        raise ValueError(f"export {str(path)!r} does not fit its model_config: missing {missing}, "
                         f"unexpected {unexpected}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in tensors.items()}, strict=False)
    model.export_metadata = meta
    return model.eval()


def convert_export(src, out, fmt, force: bool = False, allow_inexact: bool = False) -> dict:
    """Re-encode an export in another dialect (e4m3fn <-> e4m3fnuz), adjusting scales so every dequantized weight
    is kept: e4m3fn -> e4m3fnuz halves the values and doubles the scales, exactly (quant.convert_dialect).
    A conversion that would change any dequantized value is refused unless ``allow_inexact``."""
    target = _export_format(fmt)
    out = Path(out)
    if str(out) and Path(src).resolve() == out.resolve():
        raise ValueError(f"--convert source and --out are the same file {str(out)!r}; write to a new path")
    meta = read_export_metadata(src)
    source = get_format(meta["fp8_format"])
    if source.name == target.name:
        raise ValueError(f"export {str(src)!r} is already {target.name}; nothing to convert")
    out = check_export_file(out, force)
    tensors = load_file(str(src))
    changed_total = 0
    for name in json.loads(meta["fp8_layers"]):
        weight, scale = tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"]
        if weight.dtype != source.torch_dtype:
            raise ValueError(f"export {str(src)!r}: {name}.weight is {weight.dtype}, metadata says {source.name}")
        q = Fp8Tensor(weight, scale, source, granularity="row", axis=1)
        moved = _fill_range(convert_dialect(q, target))
        before, after = q.dequantize(torch.float32), moved.dequantize(torch.float32)
        changed = int((before != after).sum())
        if changed and not allow_inexact:
            raise ValueError(f"converting {name} from {source.name} to {target.name} would change {changed} "
                             f"weight values (not exactly representable); pass --allow-inexact to round them "
                             f"(nothing was written)")
        changed_total += changed
        tensors[f"{name}.weight"] = moved.data.contiguous()
        tensors[f"{name}.weight_scale"] = moved.scale.float().reshape(-1, 1).contiguous()
    meta.update({"fp8_format": target.name, "fp8_dialect": _dialect(target.name), "fp8train_version": package_version(),
                 "converted_from": f"{source.name} ({str(Path(src).resolve())})",
                 "conversion_changed_values": str(changed_total)})
    _write_atomically(tensors, meta, out)
    return {"path": str(out), "format": target.name, "from": source.name, "changed_values": changed_total,
            "bytes": out.stat().st_size}


def _fill_range(q: Fp8Tensor) -> Fp8Tensor:
    """Move the FP8 values up by binades (halving the scale) while that stays exact and within max.

    convert_dialect keeps the first exact power-of-two factor, so e4m3fnuz -> e4m3fn can land one binade low
    (values up to 224 of 448, the same values in OCP bytes). Moving them up gives the canonical encoding, so
    OCP -> FNUZ -> OCP returns the original bytes and scales, not just the same dequantized values."""
    values = q.unscaled(torch.float32)
    finite = torch.isfinite(values)
    amax = float(values[finite].abs().max()) if bool(finite.any()) else 0.0
    while 0 < amax * 2 <= q.fmt.max:
        up = quantize(values * 2, q.fmt, scale=torch.ones(()), keep_values=True)
        if not torch.equal(up.values[finite], (values * 2)[finite]):
            break
        q = Fp8Tensor(up.data, (q.scale / 2).float(), q.fmt, q.granularity, q.block, q.axis, q.amax)
        values, amax = up.values, amax * 2
    return q


# ------------------------------------------------------------------------------------------------------------
# Logit agreement (the export check; export_checks.py holds the comparison and its bounds)
# ------------------------------------------------------------------------------------------------------------
def check_export(path, run_dir, batches: int = 2) -> dict:
    """Logits of the reloaded export against the source model (bf16 weights) and against the source model with
    the same per-channel FP8 weights (which must agree up to bf16 rounding), on the run's validation batches.
    ``run_dir``: the LoadedRun the export was made from (a path is read again: a live run may have moved on)."""
    run = loaded_run(run_dir)
    exported = load_export(path)
    fmt = exported.export_metadata["fp8_format"]
    val = build_data(run.cfg).val_batches()[:batches]
    autocast = run.cfg.train.autocast == "bf16"
    same_quant = dequantized_weight_model(run.model, fp8_linear_names(run), fmt)
    return {"vs_source": compare_logits(run.model, exported, val, autocast),
            "vs_source_same_quantization": compare_logits(same_quant, exported, val, autocast)}


# ------------------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------------------
def add_cli_arguments(parser) -> None:
    parser.add_argument("run_dir", nargs="?", help="run directory to export (its newest valid checkpoint), or a "
                        "Hugging Face folder (config.json + safetensors)")
    parser.add_argument("--format", required=True, help=f"FP8 weight format: {' | '.join(EXPORT_FORMATS)}, or "
                        f"{DENSE_FORMAT} (a dense Hugging Face folder, no FP8)")
    parser.add_argument("--dtype", choices=list(DENSE_DTYPES),
                        help=f"--format {DENSE_FORMAT}: dtype of the weights (float32: the master weights exactly)")
    parser.add_argument("--out", required=True,
                        help="output folder (Hugging Face, compressed-tensors), or a .safetensors file")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--activations", choices=ACTIVATION_SCHEMES,
                        help="folder export: FP8 inputs scaled per token at run time (dynamic) or by a calibrated "
                             "static input_scale per layer")
    parser.add_argument("--weight-block", type=int,
                        help="folder export: one weight scale per BxB tile (e.g. 128) instead of per output channel")
    parser.add_argument("--calib-batches", type=int,
                        help="folder export with --activations static: calibration batches (train split)")
    parser.add_argument("--convert", metavar="SRC", help="convert the export SRC to --format instead of exporting a run")
    parser.add_argument("--allow-inexact", action="store_true",
                        help="with --convert: round values that the target dialect cannot hold exactly")
    parser.add_argument("--tokenizer", metavar="PATH", help="the tokenizer folder of a Hugging Face folder that "
                        "holds none (a Trainer checkpoint): used to check the export, and saved in it")
    parser.add_argument("--allow-diverged", action="store_true",
                        help="export a run whose summary.json says it diverged or was stopped as diverging")
    parser.add_argument("--no-check", action="store_true",
                        help="skip reloading the export and comparing its logits with the source model")


def _cli_folder(args, run: LoadedRun) -> int:
    result = export_hf_folder(run, args.out, args.format, args.activations, args.weight_block,
                              args.calib_batches, force=args.force)
    scales = f"{args.weight_block}x{args.weight_block} weight blocks" if args.weight_block else "per-channel weights"
    experts = f" and {result['fp8_experts']} FP8 expert projections (per expert)" if result["fp8_experts"] else ""
    print(f"exported step {result['step']} of {args.run_dir}: {result['fp8_layers']} FP8 Linears{experts} (e4m3fn, "
          f"{scales}, {result['activations']} input scales) -> {result['path']}/ (compressed-tensors, "
          f"{result['bytes']} bytes of weights)")
    for note in export_notes(result):
        print(f"  note: {note}")
    if args.no_check:
        return 0
    val = build_data(run.cfg).val_batches()[:2]  # the source as exported, not the run folder read again
    return print_check({"vs_source": compare_logits(run.model, load_hf_export(args.out), val,
                                                    run.cfg.train.autocast == "bf16")}, args.out,
                       fidelity_bounds(run.model))


def _cli_dense(args, run: LoadedRun) -> int:
    if args.out.endswith(".safetensors"):
        raise ValueError(f"--format {DENSE_FORMAT} writes a Hugging Face folder; give --out a folder path, not "
                         f"{args.out!r}")
    result = export_dense_folder(run, args.out, args.dtype, force=args.force)
    print(f"exported step {result['step']} of {args.run_dir}: {result['tensors']} {result['dtype']} tensors in the "
          f"model's own names and layout -> {result['path']}/ ({result['bytes']} bytes of weights; "
          "from_pretrained loads it, model.hf_path fine-tunes from it)")
    if args.no_check:
        return 0
    from transformers import AutoModelForCausalLM

    val = build_data(run.cfg).val_batches()[:2]
    loaded = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32, local_files_only=True).eval()
    return print_check({"transformers_vs_source": compare_logits(run.model, loaded, val, autocast=False)}, args.out,
                       fidelity_bounds(run.model))


def cli_main(args) -> int:
    if (args.run_dir is None) == (args.convert is None):
        raise ValueError("give either RUN_DIR (export a run) or --convert SRC (convert an export), not both/neither")
    check_options(args)
    # --out is held from its check to the logit check of what was written there: a second export to the same path
    # meanwhile is refused, never written over this one (or under its check)
    with claim_output_path(args.out, "export --out"):
        return _cli_export(args)


def _cli_export(args) -> int:
    if args.convert is not None:
        result = convert_export(args.convert, args.out, args.format, force=args.force,
                                allow_inexact=args.allow_inexact)
        print(f"converted {args.convert} ({result['from']}) -> {result['path']} ({result['format']}), "
              f"{result['changed_values']} values changed, {result['bytes']} bytes")
        return 0
    if args.format != DENSE_FORMAT:
        _export_format(args.format)  # refused before the run is read
    refuse_failed_source(args.run_dir, args.allow_diverged)
    # read once: a live run may write and prune checkpoints while this exports
    # a newer checkpoint passed over (damaged: its checksum no longer matches) is said, as kv-eval says it
    run = load_run(args.run_dir, tokenizer=args.tokenizer, log=lambda message: print(message, file=sys.stderr))
    if args.format == DENSE_FORMAT:
        return _cli_dense(args, run)
    if not args.out.endswith(".safetensors"):
        return _cli_folder(args, run)
    result = export_run(run, args.out, args.format, force=args.force)
    print(f"exported step {result['step']} of {args.run_dir}: {result['fp8_layers']} FP8 Linears "
          f"({result['format']}, per-output-channel scales) -> {result['path']} ({result['bytes']} bytes)"
          + (f"; {result['experts_bf16']} FP8 expert projections written in bf16 (this file holds FP8 Linears; "
             "--out DIR writes experts in FP8)" if result["experts_bf16"] else ""))
    return 0 if args.no_check else print_check(check_export(args.out, run), args.out, fidelity_bounds(run.model))
