"""No module of fp8train reads another module's private names, or an object's private members from outside its class.

The package's source is read with `ast`. A private name starts with one underscore (dunders are not private). Checked:

- imports: `from fp8train.x import _name`, `fp8train.x._name`, and `m._name` where `m` is a module of the package
  bound by an import;
- members: `obj._name` where `obj` is not `self` / `cls` and `_name` is a private method or attribute that a
  class of the package defines (its methods, class attributes, `self._name = ...` assignments and `__slots__`),
  unless the access is inside a class of the same module that defines `_name` itself (its own instances);
- everything else private read from outside (torch's internals, say): allowed only with a comment on its line or
  the line above saying why.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import fp8train

PACKAGE = Path(fp8train.__file__).parent
# Documented public APIs that happen to start with an underscore, and aten operator names (not members).
PUBLIC_DESPITE_UNDERSCORE = {"os._exit"}
OPERATOR_NAMESPACES = ("torch.ops.aten",)


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def read_package(root: Path = PACKAGE) -> dict[str, tuple[ast.Module, list[str]]]:
    """{"nn/linear.py": (tree, source lines)} for every module under `root`."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        found[str(path.relative_to(root))] = (ast.parse(text), text.splitlines())
    return found


def module_name(root: Path, relative: str) -> str:
    parts = Path(relative).with_suffix("").parts
    return ".".join((root.name, *(parts[:-1] if parts[-1] == "__init__" else parts)))


def private_members(package) -> dict[str, set[tuple[str, str]]]:
    """{"_name": {(module, class), ...}}: the private members each class of the package defines."""
    members: dict[str, set[tuple[str, str]]] = {}
    for module, (tree, _) in package.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            names = [s.name for s in cls.body if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for stmt in cls.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
                names += [t.id for t in targets if isinstance(t, ast.Name)]
                if any(getattr(t, "id", None) == "__slots__" for t in targets):
                    names += [e.value for e in getattr(stmt.value, "elts", []) if isinstance(e, ast.Constant)]
            names += [n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                      and isinstance(n.value, ast.Name) and n.value.id == "self"]
            for name in filter(is_private, names):
                members.setdefault(name, set()).add((module, cls.name))
    return members


def _package_modules(root: Path, package) -> set[str]:
    return {module_name(root, m) for m in package}


def _classes_around(tree: ast.Module) -> dict[int, set[str]]:
    """id(node) -> names of the classes whose body holds it."""
    around: dict[int, set[str]] = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            around.setdefault(id(node), set()).add(cls.name)
    return around


def _bound_modules(tree: ast.Module, modules: set[str]) -> dict[str, str]:
    """Local names bound to a module of the package: `import fp8train.x as m`, `from fp8train.a import b`."""
    bound = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
        elif isinstance(node, ast.ImportFrom) and node.module in modules:
            bound.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                          if f"{node.module}.{a.name}" in modules})
    return bound


@functools.lru_cache(maxsize=None)
def private_reads(root: Path = PACKAGE) -> dict[str, list[str]]:
    """{"imports": [...], "members": [...], "uncommented": [...]} as "module:line what" strings."""
    package = read_package(root)
    members, modules = private_members(package), _package_modules(root, package)
    found = {"imports": [], "members": [], "uncommented": []}
    for module, (tree, lines) in package.items():
        around, bound = _classes_around(tree), _bound_modules(tree, modules)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(root.name):
                found["imports"] += [f"{module}:{node.lineno} from {node.module} import {a.name}"
                                     for a in node.names if is_private(a.name)]
            if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
                continue
            owner, where = ast.unparse(node.value), f"{module}:{node.lineno} {ast.unparse(node)}"
            if owner in ("self", "cls"):
                continue
            if owner in modules or owner in bound:
                found["imports"].append(where)
            elif node.attr in members:
                if not any(m == module and c in around.get(id(node), ()) for m, c in members[node.attr]):
                    found["members"].append(where)
            elif ast.unparse(node) not in PUBLIC_DESPITE_UNDERSCORE and owner not in OPERATOR_NAMESPACES \
                    and not _commented(lines, node.lineno):
                found["uncommented"].append(where)
    return {kind: sorted(hits, key=_place) for kind, hits in found.items()}


def _place(hit: str) -> tuple[str, int, str]:
    module, _, rest = hit.partition(":")
    line, _, what = rest.partition(" ")
    return module, int(line), what


def _commented(lines: list[str], lineno: int) -> bool:
    return "#" in lines[lineno - 1] or (lineno > 1 and lines[lineno - 2].strip().startswith("#"))


def test_no_module_imports_another_modules_private_names():
    assert private_reads()["imports"] == []


def test_no_module_reads_a_private_member_of_a_package_class_from_outside_it():
    assert private_reads()["members"] == []


def test_every_private_member_read_from_outside_the_package_says_why():
    assert private_reads()["uncommented"] == []


def test_the_scan_sees_each_kind_of_reach_in(tmp_path):
    """The three checks on a two-module package written here: each finds what it should, and only that."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "class Layer:\n"
        "    __slots__ = ('_slot',)\n"
        "    def _quantize(self, other):\n"
        "        return other._quantize(self)  # its own class: allowed\n"
        "    def scale(self):\n"
        "        self._cache = 1\n"
        "        return self._cache\n"
        "def _helper():\n"
        "    return 0\n")
    (package / "b.py").write_text(
        "import torch\n"
        "import pkg.a\n"
        "from pkg.a import Layer, _helper\n"
        "from pkg import a\n"
        "def run(layer):\n"
        "    layer._quantize(layer)\n"
        "    x = layer._cache, layer._slot\n"
        "    a._helper()\n"
        "    torch._foreach_add_([], 1)\n"
        "    # torch has no public form of this\n"
        "    torch._foreach_mul_([], 1)\n"
        "    return pkg.a._helper(), torch.ops.aten._to_copy\n")
    found = private_reads(package)
    assert found == {"imports": ["b.py:3 from pkg.a import _helper", "b.py:8 a._helper", "b.py:12 pkg.a._helper"],
                     "members": ["b.py:6 layer._quantize", "b.py:7 layer._cache", "b.py:7 layer._slot"],
                     "uncommented": ["b.py:9 torch._foreach_add_"]}
