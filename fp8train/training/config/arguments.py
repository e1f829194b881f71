"""The command-line shape of config-driven commands (`fp8train train`, `fp8train validate`, scripts/train.py):

    CONFIG [KEY=VALUE ...] [--quiet]        or        --config CONFIG [KEY=VALUE ...] [--quiet]

The recipe YAML is required (positional, or as `--config` like accelerate scripts take it); overrides and
`--quiet` are optional and may come in any order after it.
"""

from __future__ import annotations

import argparse

__all__ = ["add_config_arguments", "resolve_config_arguments"]


def add_config_arguments(parser: argparse.ArgumentParser, example_config: str, example_override: str,
                         what: str = "progress bars") -> None:
    parser.add_argument("config", nargs="?", metavar="CONFIG",
                        help=f"recipe YAML (required, here or as --config), e.g. {example_config}")
    parser.add_argument("--config", dest="config_option", metavar="CONFIG",
                        help="the recipe YAML, as an option (the form scripts/train.py takes)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help=f"optional overrides of the YAML's values, e.g. {example_override}")
    parser.add_argument("--quiet", action="store_true", help=f"optional: no {what}")


def resolve_config_arguments(args: argparse.Namespace) -> argparse.Namespace:
    """`args.config` set from whichever form was used; ValueError when it is missing or given twice."""
    option = getattr(args, "config_option", None)
    if option is not None:
        if args.config is not None and "=" in args.config:  # the positional slot caught the first override
            args.overrides = [args.config, *args.overrides]
        elif args.config is not None:
            raise ValueError(f"the config YAML is given twice ({args.config!r} and --config {option!r}); give one")
        args.config = option
    if args.config is None:
        raise ValueError("the following arguments are required: config (the recipe YAML, as CONFIG or "
                         "--config CONFIG; KEY=VALUE overrides are optional)")
    return args
