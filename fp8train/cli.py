"""The ``fp8train`` command line.

Each subcommand lives in the module that does the work: the module defines ``add_cli_arguments(parser)`` and
``cli_main(args) -> int``. Only the chosen subcommand's module is imported, so ``fp8train formats`` stays quick.
User mistakes (bad config keys, missing files, bad values) end with a one-line message and exit status 2,
not a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fp8train.training.rundir import write_error

# name -> (module, one-line help)
COMMANDS = {
    "formats": ("fp8train.numerics.formats_cli", "print the FP8 format table derived from the bit layouts"),
    "train": ("fp8train.training.loop", "train one run from a recipe YAML (also under accelerate launch)"),
    "validate": ("fp8train.evidence.validate", "paired bf16-vs-FP8 runs over seeds: bounds, PASS/FAIL/INCONCLUSIVE, report"),
    "report": ("fp8train.evidence.report", "(re)write the report of a validation or run directory"),
    "bench": ("fp8train.bench.suite", "benchmarks: quantize, Fp8Linear and train step vs bf16 (and torchao)"),
    "kv-eval": ("fp8train.serving.kvcache", "FP8 KV-cache quality by context length for a trained run"),
    "export": ("fp8train.serving.export", "export FP8 weights (OCP or FNUZ) to safetensors, and convert exports"),
}


class UserError(Exception):
    """Raised by subcommands for mistakes the user can fix; printed without a traceback."""


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8train",
        description="FP8 mixed-precision training recipes for PyTorch, with paired bf16 validation.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fp8train")
    except PackageNotFoundError:
        return "unknown"


def _parse_command(command: str, argv: list[str]) -> argparse.Namespace:
    module_name, help_text = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"fp8train {command}", description=help_text)
    importlib.import_module(module_name).add_cli_arguments(parser)
    try:  # options may sit anywhere between key=value overrides (`train CFG --quiet a=1 b=2`)
        args = parser.parse_intermixed_args(argv)
    except TypeError:  # argparse cannot intermix some layouts; fall back to the plain parser
        args = parser.parse_args(argv)
    args.command = command
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _top_parser()
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        subparsers.add_parser(name, help=help_text)
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv)  # prints help/version, or the error for an unknown command
        parser.print_help()
        return 2
    args = _parse_command(argv[0], argv[1:])
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.cli_main(args) or 0)
    except (UserError, ValueError, FileNotFoundError, FileExistsError, ImportError) as err:
        print(f"fp8train {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # full disk, read-only or forbidden folder: the environment's, said in one line
        if write_error(err) is None:
            raise
        print(f"fp8train {args.command}: error: {write_error(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fp8train {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `fp8train formats --json | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
