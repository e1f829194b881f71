#!/usr/bin/env python
"""Run the benchmark suite from a checkout, installed or not: the same as ``fp8train bench ...``.

    python scripts/bench.py --quick
    python scripts/bench.py --device cuda --json --out bench.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's fp8train, not an installed one

from fp8train.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
