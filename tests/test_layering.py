"""training/ is layered by concern, and each part imports only the parts below it.

    config  <  storage  <  data  <  parallel  <  models  <  runs  <  the loop (training/'s own modules)

The source is read with `ast` (every import, at module level or inside a function, absolute or relative), so an
import that Python would only run late still counts. A sub-folder may import from itself and from the sub-folders
before it in TRAINING_ORDER, never from a later one or from the loop; the loop may import any of them. The check
is also run on a copy of training/ with an upward import planted, to see that it would catch one.
"""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import fp8train

PACKAGE = Path(fp8train.__file__).parent
TRAINING = "fp8train.training"
TRAINING_ORDER = ("config", "storage", "data", "parallel", "models", "runs")
LOOP = "loop"  # training/'s own modules: the loop and its helpers, above every sub-folder


def _module_name(path: Path, package_root: Path) -> str:
    parts = path.relative_to(package_root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `path` imports; `from a import b` gives a.b (b may be a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def part_of(dotted: str) -> str | None:
    """Which part of training/ a dotted name lies in: a sub-folder's name, LOOP, or None (outside training/)."""
    if not dotted.startswith(TRAINING + "."):
        return None
    first = dotted[len(TRAINING) + 1:].split(".")[0]
    return first if first in TRAINING_ORDER else LOOP


def _rank(part: str) -> int:
    return TRAINING_ORDER.index(part) if part in TRAINING_ORDER else len(TRAINING_ORDER)


def upward_imports(package_root: Path = PACKAGE) -> list[str]:
    """Every import inside training/ from a part above the importer's, as 'file:line: a -> b'."""
    problems = []
    for path in sorted((package_root / "training").rglob("*.py")):
        module = _module_name(path, package_root)
        source = part_of(module) if module != TRAINING else None
        if source is None:
            continue  # training/__init__.py: a docstring, part of no layer
        for line, target in _imported(path, module):
            part = part_of(target)
            if part is not None and _rank(part) > _rank(source):
                problems.append(f"{path.relative_to(package_root)}:{line}: {source} -> {part} ({target})")
    return problems


def module_cycles(package_root: Path = PACKAGE) -> list[list[str]]:
    """Cycles among training/'s modules (imports anywhere in a file), each as the list of modules on it."""
    modules = {_module_name(p, package_root): p for p in (package_root / "training").rglob("*.py")}
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for _, target in _imported(path, module):
            while target and target not in modules:  # `from pkg.mod import name` -> pkg.mod
                target = target.rpartition(".")[0]
            if target and target != module and target != TRAINING and not module.startswith(target + "."):
                graph[module].add(target)  # a package's __init__ imported on the way to a submodule is no edge
    cycles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_every_sub_folder_of_training_has_a_place_in_the_order():
    folders = {p.name for p in (PACKAGE / "training").iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(TRAINING_ORDER)


def test_training_sub_folders_import_only_downward():
    assert upward_imports() == []


def test_no_import_cycle_among_training_modules():
    assert module_cycles() == []


@pytest.mark.parametrize("planted_in, planted, part", [
    ("storage/rundir.py", "from fp8train.training.loop import train", "loop"),
    ("config/base.py", "from fp8train.training.models.decoder import build_model", "models"),
    ("data/corpus.py", "from ..runs import checkpoint", "runs"),
    ("models/hf.py", "    import fp8train.training.runs.resume", "runs"),
])
def test_the_check_catches_a_planted_upward_import(tmp_path, planted_in, planted, part):
    root = tmp_path / "fp8train"
    shutil.copytree(PACKAGE / "training", root / "training")
    target = root / "training" / planted_in
    body = f"def planted():\n{planted}\n" if planted.startswith(" ") else planted + "\n"
    target.write_text(target.read_text() + "\n" + body)
    problems = upward_imports(root)
    assert len(problems) == 1 and problems[0].startswith(f"training/{planted_in}:") and f"-> {part} " in problems[0]
