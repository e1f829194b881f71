"""No module of fp8train over 400 lines: a module has one concern, and a reader holds it in one sitting.

Two modules over the limit are being split by the cast-path work of the same issue (gemm.py by concern: operand,
backend choice, CPU capabilities, the GEMM; linear.py's delayed-scaling machinery into one module); they are
listed so the check holds meanwhile, and each must still be over the limit (the list only shrinks).
"""

from __future__ import annotations

from pathlib import Path

import fp8train

PACKAGE = Path(fp8train.__file__).parent
MAX_LINES = 400
BEING_SPLIT = {"nn/gemm.py", "nn/linear.py"}


def line_counts(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}


def test_no_module_is_over_400_lines():
    counts = line_counts(PACKAGE)
    assert {name: n for name, n in counts.items() if n > MAX_LINES and name not in BEING_SPLIT} == {}


def test_the_modules_being_split_are_still_listed_only_while_over_the_limit():
    counts = line_counts(PACKAGE)
    assert {name for name in BEING_SPLIT if counts.get(name, 0) <= MAX_LINES} == set()
