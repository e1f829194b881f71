"""No module of fp8train over 400 lines: a module has one concern, and a reader holds it in one sitting."""

from __future__ import annotations

from pathlib import Path

import fp8train

PACKAGE = Path(fp8train.__file__).parent
MAX_LINES = 400


def line_counts(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}


def test_no_module_is_over_400_lines():
    counts = line_counts(PACKAGE)
    assert {name: n for name, n in counts.items() if n > MAX_LINES} == {}


def test_the_count_sees_a_long_module(tmp_path):
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert {name for name, n in line_counts(tmp_path).items() if n > MAX_LINES} == {"long.py"}
