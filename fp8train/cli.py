"""The ``fp8train`` command line.

Each subcommand lives in the module that does the work: the module defines ``add_cli_arguments(parser)`` and
``cli_main(args) -> int``. Only the chosen subcommand's module is imported, so ``fp8train formats`` stays quick.
User mistakes (bad config keys, missing files, bad values, a missing optional package) end with a one-line
message and exit status 2, not a traceback. Anything else is a bug in fp8train (or in a library under it) and is
reported as one: exit status 1, its traceback written to a log file whose path is printed. A ValueError counts
as a user mistake only when fp8train raised it; one raised inside torch or accelerate is internal.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from fp8train import __version__
from fp8train.training.config import resolve_config_arguments
from fp8train.training.storage.files import write_error

# name -> (module, one-line help)
COMMANDS = {
    "formats": ("fp8train.numerics.formats_cli", "print the FP8 format table derived from the bit layouts"),
    "train": ("fp8train.training.loop", "train one run from a recipe YAML (also under accelerate launch)"),
    "validate": ("fp8train.evidence.validate", "paired bf16-vs-FP8 runs over seeds: bounds, PASS/FAIL/INCONCLUSIVE, report"),
    "layer-recipes": ("fp8train.evidence.layer_recipes", "a recipe per layer (policy.overrides) from a run's shadow "
                      "telemetry and timings on this device"),
    "report": ("fp8train.evidence.report", "(re)write the report of a validation or run directory"),
    "bench": ("fp8train.bench.suite", "benchmarks: quantize, Fp8Linear and train step vs bf16 (and torchao)"),
    "kv-eval": ("fp8train.serving.kvcache", "FP8 KV-cache quality by context length for a trained run"),
    "export": ("fp8train.serving.export", "export FP8 weights (OCP or FNUZ) to safetensors, and convert exports"),
}


class UserError(Exception):
    """Raised by subcommands for mistakes the user can fix; printed without a traceback."""


USER_ERRORS = (UserError, ValueError, FileNotFoundError, FileExistsError)
_PACKAGE_DIR = Path(__file__).resolve().parent


def _raised_by_fp8train(err: BaseException) -> bool:
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _PACKAGE_DIR in Path(tb.tb_frame.f_code.co_filename).resolve().parents


def _report_internal_error(command: str, err: BaseException) -> None:
    fd, log = tempfile.mkstemp(prefix=f"fp8train-{command}-error-", suffix=".log")
    with open(fd, "w") as f:
        f.write(f"fp8train {__version__}, command: {' '.join(sys.argv)}\n")
        traceback.print_exception(err, file=f)
    print(f"fp8train {command}: internal error (a bug, not a mistake in your input): {type(err).__name__}: "
          f"{' '.join(str(err).split())}; traceback written to {log}", file=sys.stderr)


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fp8train",
        description="FP8 mixed-precision training recipes for PyTorch, with paired bf16 validation.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return parser


def _refuse_repeated_options(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """An option that keeps one value given twice is refused (argparse keeps the last and drops the first without
    a word: `--format e4m3fn --format e5m2` would evaluate e5m2 only). Long options as written, `--name=value`
    and unambiguous prefixes; nothing after `--`."""
    # (private: argparse names its option table and its plain store action nowhere public; both unchanged for
    # over a decade, and a change shows here as an AttributeError in every command's tests)
    table = parser._option_string_actions
    store = argparse._StoreAction  # (private: as the line above says)
    single = {opt: action for opt, action in table.items() if type(action) is store and opt.startswith("--")}
    seen: dict = {}
    for i, token in enumerate(argv):
        if token == "--":
            break
        if not token.startswith("--"):
            continue
        name, equals, value = token.partition("=")
        matches = [single[name]] if name in single else \
            {action for opt, action in single.items() if opt.startswith(name)}
        if len(matches) != 1:
            continue
        action = next(iter(matches))
        value = value if equals else argv[i + 1] if i + 1 < len(argv) else ""
        if action.dest in seen:
            parser.error(f"{action.option_strings[-1]} is given twice ({seen[action.dest]!r}, then {value!r}); give "
                         "it once (where it takes several values, as one comma-separated list)")
        seen[action.dest] = value


def _parse_command(command: str, argv: list[str]) -> argparse.Namespace:
    module_name, help_text = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"fp8train {command}", description=help_text)
    importlib.import_module(module_name).add_cli_arguments(parser)
    _refuse_repeated_options(parser, argv)
    try:  # options may sit anywhere between key=value overrides (`train CFG --quiet a=1 b=2`)
        args = parser.parse_intermixed_args(argv)
    except TypeError:  # argparse cannot intermix some layouts; fall back to the plain parser
        args = parser.parse_args(argv)
    args.command = command
    if hasattr(args, "config_option"):  # a config-driven command: CONFIG or --config CONFIG
        try:
            resolve_config_arguments(args)
        except ValueError as err:
            parser.error(str(err))  # usage, the message, exit 2: as for any other malformed command line
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
    except ImportError as err:  # a missing optional dependency: the message says what to install
        print(f"fp8train {args.command}: error: {err}", file=sys.stderr)
        return 2
    except USER_ERRORS as err:
        if not _raised_by_fp8train(err):
            _report_internal_error(args.command, err)
            return 1
        print(f"fp8train {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fp8train formats --json | head`
        return 0
    except OSError as err:  # full disk, read-only or forbidden folder: the environment's, said in one line
        if write_error(err) is None:
            _report_internal_error(args.command, err)
            return 1
        print(f"fp8train {args.command}: error: {write_error(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM turned into an interrupt (training.lifetime)
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"fp8train {args.command}: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum  # what a shell reports for a process ended by that signal: 130, 143
    except Exception as err:  # noqa: BLE001  anything else is a bug, reported as one
        _report_internal_error(args.command, err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
