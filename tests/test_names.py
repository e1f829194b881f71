"""Names that mean one thing, and no function that only tests call.

- No two modules of fp8train share a file name (two fork.py modules read as one concern in tracebacks, imports and
  docs while they are two). Package `__init__.py` files are the one name every folder has.
- Every public module-level function of fp8train is used by fp8train itself or by scripts/ (read with `ast`: a
  name or attribute of that spelling anywhere but its own definition), unless it is public API: a name of
  `fp8train.__all__`, or one of the few documented entry points of DOCUMENTED_API, each on the page named.

Both checks are also run on a copy of the package with a violation planted, to see that they would catch one.
"""

from __future__ import annotations

import ast
import collections
import shutil
from pathlib import Path

import fp8train

PACKAGE = Path(fp8train.__file__).parent
ROOT = PACKAGE.parent
# Public functions nothing in fp8train or scripts/ calls, because users call them: {name: the page documenting it}.
DOCUMENTED_API = {
    "set_cpu_bf16_gemm": "docs/testing.md",  # the process-wide switches that force one CPU path (tests, benches)
    "set_enabled": "docs/testing.md",
    "set_mode": "docs/testing.md",
    "make_te_linear": "docs/recipes.md",  # recipes mapped for your own Transformer Engine loop
}


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


def uncalled_public_functions(package: Path, others: list[Path]) -> dict[str, str]:
    """{name: module path} of the public module-level functions under `package` whose name no code under `package`
    or `others` uses (as a name or an attribute) outside a definition; an import alone is not a use."""
    defined, used = {}, collections.Counter()
    for path in sorted(package.rglob("*.py")) + [p for folder in others for p in sorted(folder.rglob("*.py"))]:
        tree = ast.parse(path.read_text())
        if package in path.parents:
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                    defined.setdefault(node.name, str(path.relative_to(package.parent)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                used[node.id] += 1
            elif isinstance(node, ast.Attribute):
                used[node.attr] += 1
    return {name: where for name, where in sorted(defined.items()) if used[name] == 0}


def test_every_public_function_has_a_caller_or_is_documented_api():
    public = set(fp8train.__all__) | set(DOCUMENTED_API)
    uncalled = uncalled_public_functions(PACKAGE, [ROOT / "scripts"])
    assert {name: where for name, where in uncalled.items() if name not in public} == {}


def test_documented_api_is_on_its_page_and_still_uncalled():
    """The allowlist stays small and true: each name is on the page that documents it, and is not called (a name
    that gained a caller leaves the list)."""
    uncalled = uncalled_public_functions(PACKAGE, [ROOT / "scripts"])
    for name, page in DOCUMENTED_API.items():
        assert name in (ROOT / page).read_text(), (name, page)
        assert name in uncalled, f"{name} has a caller now: remove it from DOCUMENTED_API"


def test_the_check_catches_a_function_only_tests_call(tmp_path):
    root = tmp_path / "fp8train"
    shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h"))
    (root / "evidence" / "planted.py").write_text("def only_tests_call_me():\n    return 1\n\n\n"
                                                 "def called():\n    return only_tests_call_me\n")
    found = uncalled_public_functions(root, [ROOT / "scripts"])
    assert found.get("called") == "fp8train/evidence/planted.py" and "only_tests_call_me" not in found
