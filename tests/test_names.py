"""One name, one meaning: no two modules of fp8train share a file name (two fork.py modules read as one concern in
tracebacks, imports and docs while they are two).

Package `__init__.py` files are the one name every folder has. The check is also run on a copy of the package
with a second module of an existing name planted, to see that it would catch one.
"""

from __future__ import annotations

import collections
import shutil
from pathlib import Path

import fp8train

PACKAGE = Path(fp8train.__file__).parent


def shared_basenames(root: Path) -> dict[str, list[str]]:
    """{file name: [paths under root]} for every module file name used more than once (``__init__.py`` aside)."""
    by_name = collections.defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        if path.name != "__init__.py":
            by_name[path.name].append(str(path.relative_to(root)))
    return {name: paths for name, paths in by_name.items() if len(paths) > 1}


def test_no_two_modules_share_a_file_name():
    assert shared_basenames(PACKAGE) == {}


def test_the_check_catches_a_second_module_of_one_name(tmp_path):
    root = tmp_path / "fp8train"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h"))
    (root / "evidence" / "fork.py").write_text('"""planted"""\n')
    (root / "training" / "runs" / "fork.py").write_text('"""planted"""\n')
    assert shared_basenames(root) == {"fork.py": ["evidence/fork.py", "training/runs/fork.py"]}
