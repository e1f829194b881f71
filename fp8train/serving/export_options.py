"""`fp8train export`'s options that shape one kind of export only (--dtype, --activations, --weight-block,
--calib-batches, --allow-inexact, --allow-diverged, --tokenizer): refused when given to another kind, not ignored, and the
defaults of those not given."""

from __future__ import annotations

from fp8train.serving.dense_export import DENSE_FORMAT

__all__ = ["OPTION_DEFAULTS", "MAX_CALIB_BATCHES", "export_kind", "check_options"]

# Options that shape one kind of export only, and their defaults when not given. Given to another kind, each is
# refused rather than ignored: an export without the asked-for static scales or blocks would look like it had them.
OPTION_DEFAULTS = {"dtype": "float32", "activations": "dynamic", "weight_block": 0, "calib_batches": 4}
MAX_CALIB_BATCHES = 1024  # as train.eval_batches: a bound on minutes of calibration before anything is written


def export_kind(args) -> str:
    if args.convert is not None:
        return "--convert"
    if args.format == DENSE_FORMAT:
        return f"--format {DENSE_FORMAT}"
    return "a .safetensors file" if args.out.endswith(".safetensors") else "folder"


def check_options(args) -> None:
    kind = export_kind(args)
    applies = {"dtype": kind == f"--format {DENSE_FORMAT}", "activations": kind == "folder",
               "weight_block": kind == "folder", "calib_batches": kind == "folder" and args.activations == "static",
               "allow_inexact": kind == "--convert", "allow_diverged": kind != "--convert",
               "tokenizer": kind != "--convert"}
    for key, ok in applies.items():
        given = getattr(args, key) not in (None, False)
        if given and not ok:
            where = ("a folder export with --activations static" if key == "calib_batches" else
                     {"dtype": f"--format {DENSE_FORMAT}", "allow_inexact": "--convert",
                      "allow_diverged": "an export of a run",
                      "tokenizer": "an export of a Hugging Face folder"}.get(key, "a folder export"))
            raise ValueError(f"--{key.replace('_', '-')} applies to {where} only, not to {kind}; drop it "
                             "(nothing was written)")
    for key, default in OPTION_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    if not 1 <= args.calib_batches <= MAX_CALIB_BATCHES:
        raise ValueError(f"--calib-batches {args.calib_batches} must be in [1, {MAX_CALIB_BATCHES}]")
