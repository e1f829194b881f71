"""Every recipe field, recipe name, default and high-precision sentinel is declared in one place.

The package's source is read with `ast` (not imported names checked against themselves): the fp8 config section
declares none of Fp8Recipe's fields, no module re-spells a recipe name or the `none` / `bf16` sentinels, no code
compares `scaling`, a granularity, a quantize kernel or a GEMM backend with a string, and every default that names
a recipe or a quantize kernel is the one constant.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from pathlib import Path

import pytest

import fp8train
from fp8train.nn.convert import fp8_from_conv1d
from fp8train.nn.gemm import AUTO_EMULATED_DTYPE, emulated_compute_dtype
from fp8train.nn.linear import Fp8Linear, configure_execution
from fp8train.nn.recipes import (BASELINE_RECIPE, DEFAULT_RECIPE, OVERRIDE_BF16, RECIPE_NAMES, Fp8Recipe,
                                 RecipeFieldError, recipe)
from fp8train.numerics.cast_kernels import DEFAULT_QUANTIZE_KERNEL
from fp8train.training.config import Fp8Config, ValidateConfig, load_config

PACKAGE = Path(fp8train.__file__).parent
RECIPE_FIELDS = [f.name for f in dataclasses.fields(Fp8Recipe)]
CHOSEN_BY_PRESET = {"name", "scaling"}  # fp8.recipe picks both; every other field is an fp8.* key


def _modules(root: Path = PACKAGE) -> dict[str, ast.Module]:
    return {str(p.relative_to(root)): ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}


def _str_literals(node: ast.AST | None) -> list[str] | None:
    """The strings of a declaration's value: "x", ("x", "y"), ["x"], {"x": ...} (its keys), or a default_factory
    lambda returning one."""
    if isinstance(node, ast.Call) and any(k.arg == "default_factory" for k in node.keywords):
        node = next(k.value for k in node.keywords if k.arg == "default_factory")
    if isinstance(node, ast.Lambda):
        node = node.body
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    elements = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", None)  # a dict: its keys
    if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and elements and all(
            isinstance(e, ast.Constant) and isinstance(e.value, str) for e in elements):
        return [e.value for e in elements]
    return None


def _declarations(tree: ast.Module, module_level_only: bool = False):
    """(line, strings) of each module- or class-level assignment and each function parameter default."""
    bodies = [tree.body] if module_level_only else [tree.body] + [
        n.body for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for body in bodies:
        for stmt in body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                yield stmt.lineno, _str_literals(stmt.value)
    if not module_level_only:
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for default in fn.args.defaults + [d for d in fn.args.kw_defaults if d is not None]:
                yield default.lineno, _str_literals(default)


def declarations_of(literals, module_level_only: bool = False, root: Path = PACKAGE) -> dict[str, list[str]]:
    """{literal: ["module:line", ...]} of the declarations whose value holds only watched `literals`."""
    found = {name: [] for name in literals}
    for module, tree in _modules(root).items():
        for line, strings in _declarations(tree, module_level_only):
            if strings and all(s in found for s in strings):
                for s in strings:
                    found[s].append(f"{module}:{line}")
    return found


def scaling_string_comparisons(root: Path = PACKAGE) -> list[str]:
    """`x.scaling == "..."`, `scaling in ("...", ...)` and the like: the ScalingKind enum or a recipe property
    (is_delayed, is_tensorwise, is_mx, is_tiled) says it instead."""
    hits = []
    for module, tree in _modules(root).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = [s.attr if isinstance(s, ast.Attribute) else getattr(s, "id", None) for s in sides]
                if "scaling" in names and any(_str_literals(s) for s in sides):
                    hits.append(f"{module}:{node.lineno}")
    return hits


ENUM_NAMED = ("granularity", "kernel", "backend")  # numerics.names.Granularity, QuantizeKernel; recipes.GemmBackend


def _compared_name(node: ast.AST) -> str:
    """The name a side of a comparison reads: `x`, `obj.x`, `f(...)`'s `f`, `x[...]`'s `x` ("" for a literal)."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, (ast.Call, ast.Subscript)):
        return _compared_name(node.func if isinstance(node, ast.Call) else node.value)
    return ""


def enum_string_comparisons(root: Path = PACKAGE) -> list[str]:
    """Comparisons of a granularity, quantize kernel or GEMM backend (a name containing one of ENUM_NAMED:
    `granularity`, `r.granularity_of(role)`, `kernel`, `layer.kernel_for(n)`, `recipe.backend`) with a string
    literal or a tuple/list/set of them: `granularity == "row"`, `kernel in ("native", "eager")`, `backend != "te"`.
    The enum member says it instead (`== Granularity.ROW`), so each name is spelled once."""
    hits = []
    for module, tree in _modules(root).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = [_compared_name(s).lower() for s in sides]
                if any(word in name for name in names for word in ENUM_NAMED) and any(_str_literals(s) for s in sides):
                    hits.append(f"{module}:{node.lineno}")
    return hits


def _mentions_emulated(node: ast.AST) -> bool:
    words = [getattr(n, "id", None) or getattr(n, "attr", None) or getattr(n, "arg", None) for n in ast.walk(node)]
    keys = [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return any(w and "emulated" in w.lower() for w in words) or any("emulated_dtype" in k for k in keys)


def _is_auto(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value == AUTO_EMULATED_DTYPE


def emulated_auto_spellings(root: Path = PACKAGE) -> list[str]:
    """Where the literal "auto" stands for the emulated dtype: in a statement (a compound statement's header)
    that names it, as the default of an `*emulated*` parameter, or anywhere in an `*emulated*` function."""
    hits = []
    for module, tree in _modules(root).items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args
                pairs = list(zip(args[len(args) - len(node.args.defaults):], node.args.defaults))
                pairs += list(zip(node.args.kwonlyargs, node.args.kw_defaults))
                hits += [f"{module}:{d.lineno}" for a, d in pairs
                         if _is_auto(d) and "emulated" in f"{node.name} {a.arg}".lower()]
                if "emulated" in node.name.lower():
                    hits += [f"{module}:{n.lineno}" for stmt in node.body for n in ast.walk(stmt) if _is_auto(n)]
                continue
            headers = [node.test] if isinstance(node, (ast.If, ast.While)) else \
                [node.target, node.iter] if isinstance(node, ast.For) else \
                [node] if isinstance(node, ast.stmt) and not isinstance(node, (ast.ClassDef, ast.With, ast.Try)) \
                else []
            hits += [f"{module}:{h.lineno}" for h in headers
                     if _mentions_emulated(h) and any(_is_auto(n) for n in ast.walk(h))]
    return sorted(set(hits))


# ---- recipe fields: declared on Fp8Recipe only ------------------------------------------------------------------
def test_the_fp8_section_declares_no_recipe_field():
    tree = ast.parse((PACKAGE / "training" / "config" / "fp8.py").read_text())
    declared = {stmt.target.id for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef) for stmt in cls.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)}
    assert not declared & set(RECIPE_FIELDS), sorted(declared & set(RECIPE_FIELDS))


def test_no_other_class_redeclares_the_recipe():
    """A class with three or more of Fp8Recipe's field names would be a second copy of it (one, e.g.
    validate.margin, is another idea that happens to share a word)."""
    copies = {}
    for module, tree in _modules().items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name != "Fp8Recipe"):
            names = {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
            if len(names & set(RECIPE_FIELDS)) >= 3:
                copies[f"{module}:{cls.name}"] = sorted(names & set(RECIPE_FIELDS))
    assert copies == {}


def test_every_recipe_field_but_the_preset_choice_is_an_fp8_key_typed_as_the_field():
    keys = {f.name: f for f in dataclasses.fields(Fp8Config)}
    hints, recipe_hints = typing.get_type_hints(Fp8Config), typing.get_type_hints(Fp8Recipe)
    for name in RECIPE_FIELDS:
        if name in CHOSEN_BY_PRESET:
            assert name not in keys
            continue
        field_type = recipe_hints[name]
        yaml_type = typing.List[int] if typing.get_origin(field_type) is tuple else field_type  # YAML: no tuples
        assert hints[name] in (yaml_type, typing.Optional[yaml_type]), (name, hints[name])
        default = Fp8Recipe.__dataclass_fields__[name].default
        assert keys[name].default in (None, default), name


@pytest.mark.parametrize("key, bad", [("margin", 33), ("amax_history_len", 0), ("amax_outlier_factor", 0.5),
                                      ("weight_block", [0, 128]), ("accumulator_bits", 25),
                                      ("accumulator_promotion", 100), ("input_format", "e3m4"),
                                      ("amax_compute_algo", "mean"), ("backend", "cuda")])
def test_the_config_reports_the_recipes_own_check(key, bad):
    """One validation: the config's error for fp8.<key> is Fp8Recipe's message, with the dotted key."""
    with pytest.raises(RecipeFieldError) as from_recipe:
        recipe(DEFAULT_RECIPE, **{key: bad})
    with pytest.raises(ValueError) as from_config:
        load_config(None, [f"fp8.{key}={bad}".replace(" ", "")])
    assert f"fp8.{key}=" in str(from_config.value) and str(from_recipe.value) in str(from_config.value)


# ---- names, defaults and sentinels: spelled once -------------------------------------------------------------
def test_each_recipe_name_is_declared_once():
    found = declarations_of(RECIPE_NAMES)
    # Granularity.BLOCK (numerics/names.py) is the cast's tile granularity, which the block and mxfp8 recipes both
    # use: the same word for another idea, declared once as that idea.
    found["block"] = [place for place in found["block"] if not place.startswith("numerics/names.py")]
    assert all(len(places) == 1 and places[0].startswith("nn/recipes.py") for places in found.values()), found


@pytest.mark.parametrize("sentinel", [BASELINE_RECIPE, OVERRIDE_BF16])
def test_each_high_precision_sentinel_is_one_module_constant(sentinel):
    """`fp8.recipe: none` and the policy.overrides value `bf16` (both public spellings): one constant each.
    Class-level defaults are not counted: train.autocast's `bf16` / `none` are autocast modes, another idea."""
    assert len(declarations_of([sentinel], module_level_only=True)[sentinel]) == 1


def test_one_default_recipe_everywhere():
    defaults = {
        "Fp8Recipe()": Fp8Recipe().name,
        "Fp8Recipe().scaling": Fp8Recipe().scaling,
        "Fp8Linear()": inspect.signature(Fp8Linear.__init__).parameters["recipe"].default,
        "Fp8Linear.from_linear": inspect.signature(Fp8Linear.from_linear).parameters["recipe"].default,
        "fp8_from_conv1d": inspect.signature(fp8_from_conv1d).parameters["recipe"].default,
        "fp8.recipe": Fp8Config().recipe,
        "validate.candidates": ValidateConfig().candidates[0],
    }
    assert set(defaults.values()) == {DEFAULT_RECIPE}, defaults
    assert Fp8Recipe() == recipe(DEFAULT_RECIPE) and ValidateConfig().candidates == [DEFAULT_RECIPE]


def test_one_quantize_kernel_default():
    defaults = {"Fp8Linear": Fp8Linear(16, 16).quantize_kernel, "fp8.quantize_kernel": Fp8Config().quantize_kernel,
                "configure_execution": inspect.signature(configure_execution).parameters["quantize_kernel"].default}
    assert set(defaults.values()) == {DEFAULT_QUANTIZE_KERNEL}, defaults


def test_emulated_dtype_auto_is_spelled_once():
    """`emulated_dtype: auto` is gemm_choice.AUTO_EMULATED_DTYPE everywhere: the layer's default,
    configure_execution's, fp8.emulated_dtype's and its allowed values, and emulated_compute_dtype's."""
    where = PACKAGE / "nn" / "gemm_choice.py"
    assert emulated_auto_spellings() == [f"nn/gemm_choice.py:{_line_of('AUTO_EMULATED_DTYPE', where)}"]
    defaults = {"Fp8Linear": Fp8Linear(16, 16).emulated_dtype, "fp8.emulated_dtype": Fp8Config().emulated_dtype,
                "configure_execution": inspect.signature(configure_execution).parameters["emulated_dtype"].default,
                "emulated_compute_dtype": inspect.signature(emulated_compute_dtype).parameters["choice"].default}
    assert set(defaults.values()) == {AUTO_EMULATED_DTYPE}, defaults


def _line_of(name: str, path: Path) -> int:
    return next(n.lineno for n in ast.parse(path.read_text()).body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == name for t in n.targets))


def test_no_scaling_compared_with_a_string():
    assert scaling_string_comparisons() == []


def test_no_granularity_kernel_or_backend_compared_with_a_string():
    assert enum_string_comparisons() == []


def test_the_enum_comparison_check_finds_each_form(tmp_path):
    """The check above sees each way such a comparison is written (so its empty answer means something), and
    leaves alone comparisons with enum members and unrelated names."""
    (tmp_path / "bad.py").write_text(
        'if granularity == "row": pass\n'
        'if r.granularity_of(role) != "block": pass\n'
        'if kernel in ("native", "eager"): pass\n'
        'if layer.kernel_for(n) == "native": pass\n'
        'if "te" == self.recipe.backend: pass\n'
        'if backend not in ["auto"]: pass\n')
    (tmp_path / "good.py").write_text(
        'if granularity == Granularity.ROW: pass\n'
        'if kernel is QuantizeKernel.NATIVE: pass\n'
        'if backend in GEMM_BACKENDS: pass\n'
        'if mode == "row": pass\n')
    assert enum_string_comparisons(tmp_path) == [f"bad.py:{line}" for line in range(1, 7)]
