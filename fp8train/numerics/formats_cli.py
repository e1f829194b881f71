"""``fp8train formats``: the derivation table, as text or JSON."""

from __future__ import annotations

import json

from fp8train.numerics.formats import FORMATS, format_table


def add_cli_arguments(parser) -> None:
    parser.add_argument("--json", action="store_true", help="print JSON keyed by format name")


def cli_main(args) -> int:
    if args.json:
        print(json.dumps({name: fmt.describe() for name, fmt in FORMATS.items()}, indent=2))
    else:
        print(format_table())
        print("\nmax is derived from the largest usable exponent and mantissa fields; binades = log2(max / min "
              "subnormal);\nmax rel err is half a step: the worst rounding error in the normal range.")
    return 0
