"""Mutation testing of one layer folder (or one module) with mutmut, each mutant against that layer's tests only.

    python scripts/mutation.py LAYER [--jobs N] [--sample N] [--seed S] [--fresh] [--only NAME ...]

LAYER is a name of LAYERS below (numerics, nn, evidence, training-state) or a module path such as
fp8train/evidence/verdict.py (its layer's tests are used). The run happens in a copy of the tree under
.mutation/<layer>/ (mutmut writes its mutants/ folder there; a rerun reuses the results of unchanged functions),
with this tree's [tool.mutmut] settings plus the layer's modules (only_mutate) and test files. Within those,
mutmut runs for each mutant only the tests that called the mutated function in its first, clean run.

--sample N tests N mutants drawn uniformly at random (seeded by --seed) from mutmut's list of all the layer's
mutants, instead of all of them; the score is then over the sample, given with a 95% (Wilson) interval for the
layer's whole list. --only NAME... re-tests the named mutants (a survivor after its killing test was written).

The score counts killed (a test failed, or the mutant ran past its time limit) over all mutants less the
equivalent ones listed in docs/mutation-equivalents.md (one line each: `- `mutant name`: reason`). It is printed
and written to .mutation/<layer>/score.json with every survivor's name (`mutmut show NAME`, run in
.mutation/<layer>/, prints its diff). See docs/mutation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "docs" / "mutation-equivalents.md"
COPIED = ("fp8train", "tests", "recipes", "scripts", "pyproject.toml", "README.md")

# Per layer: the modules mutated and the test files that cover them (the in-process ones: a test that launches a
# subprocess imports the unmutated package, so it cannot kill a mutant and only costs time; those are left out
# by name or by the slow marker, see markers).
LAYERS = {
    "numerics": dict(
        modules=["fp8train/numerics/*.py"],
        # native_build.py drives the C compiler: plumbing whose mutants
        # show up as a failed build or a slower fallback, not as numbers a test can compare
        exclude=["fp8train/numerics/native_build.py"],
        tests=["tests/test_formats.py", "tests/test_quant.py", "tests/test_dialect.py", "tests/test_mx.py",
               "tests/test_native_cast.py", "tests/test_native_gemm.py"],
        markers="not slow and not compiled and not cuda"),
    "nn": dict(
        modules=["fp8train/nn/*.py"],
        exclude=[],
        tests=["tests/test_linear.py", "tests/test_gemm.py", "tests/test_scaled_gemm.py", "tests/test_accumulation.py",
               "tests/test_recipes.py", "tests/test_convert.py", "tests/test_overrides.py", "tests/test_mx.py",
               "tests/test_policy_defaults.py", "tests/test_te_mapping.py", "tests/test_fsdp2.py",
               "tests/test_native_gemm.py"],
        markers="not slow and not compiled and not cuda"),
    "evidence": dict(
        modules=["fp8train/evidence/*.py"],
        exclude=[],
        tests=["tests/test_verdict_threshold.py", "tests/test_validate.py", "tests/test_report.py",
               "tests/test_run_files.py", "tests/test_overrides.py", "tests/test_sequential.py",
               "tests/test_fork.py"],
        markers="not slow and not compiled and not cuda"),
    "training-state": dict(
        modules=["fp8train/training/runs/checkpoint.py", "fp8train/training/runs/resume.py",
                 "fp8train/training/storage/files.py", "fp8train/training/storage/rundir.py"],
        exclude=[],
        tests=["tests/test_checkpoint.py", "tests/test_run_files.py", "tests/test_resume_point.py",
               "tests/test_resume_rules.py", "tests/test_reliability.py"],
        # the slow-marked tests (in-process training runs) reach these modules too, but each costs minutes per
        # mutant on 2 shared cores: the run keeps to the direct tests of checkpoints, resume and run files
        markers="not slow and not compiled and not cuda"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target", help=f"one of {', '.join(LAYERS)}, or a module path under fp8train/")
    parser.add_argument("--jobs", type=int, default=2, help="mutants tested at once (default 2)")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="test N mutants drawn uniformly at random from all of the layer's (default 0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="re-test these mutants only")
    parser.add_argument("--report", action="store_true",
                        help="run nothing: score the last run's sample (or all mutants) from the saved results")
    parser.add_argument("--fresh", action="store_true", help="forget earlier results of this target")
    args = parser.parse_args(argv)
    name, layer = _layer_of(args.target)
    workdir = ROOT / ".mutation" / name
    if args.report:
        return _report(name, workdir, _modules(layer))
    if args.fresh and workdir.exists():
        shutil.rmtree(workdir)
    modules = _modules(layer)
    _copy_tree(workdir)
    _write_config(workdir, layer, modules)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # tests must import mutants/, not a tree
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    names = list(args.only)
    if args.sample:
        names = _sampled_mutants(workdir, env, modules, args.sample, args.seed)
        (workdir / "sample.json").write_text(json.dumps({"n": args.sample, "seed": args.seed, "mutants": names},
                                                        indent=1) + "\n")
    mutmut = Path(sys.executable).parent / "mutmut"
    run = subprocess.run([str(mutmut), "run", "--max-children", str(args.jobs), *names], cwd=workdir, env=env)
    if args.only:
        score = _score(workdir, modules, names)
        print(f"\nre-tested: {score['killed']} of {score['counted']} killed; still surviving: {score['survived']}")
        _report(name, workdir, modules)
    else:
        _report(name, workdir, modules)
    return run.returncode


def _report(name: str, workdir: Path, modules: list[str]) -> int:
    """Score the last sample (sample.json; all mutants without one) from mutmut's saved results."""
    sample = workdir / "sample.json"
    drawn = json.loads(sample.read_text()) if sample.exists() else {"n": 0, "seed": None, "mutants": []}
    score = _score(workdir, modules, drawn["mutants"])
    score.update(sample=drawn["n"], seed=drawn["seed"])
    (workdir / "score.json").write_text(json.dumps(score, indent=1) + "\n")
    low, high = score["interval_95"]
    print(f"\n{name}: {score['killed']} killed of {score['counted']} mutants ({score['score']:.1%}, 95% interval "
          f"{low:.1%}-{high:.1%}; {score['timeouts']} by timeout, {score['crashes']} by a crash); "
          f"{len(score['survived'])} survived, {score['no_tests']} without a covering test, "
          f"{score['equivalent']} equivalent (excluded), {score['not_checked']} not run; details in {workdir}")
    return 0


def _layer_of(target: str) -> tuple[str, dict]:
    if target in LAYERS:
        return target, LAYERS[target]
    path = Path(target).as_posix()
    if not (ROOT / path).is_file() or not path.startswith("fp8train/"):
        raise SystemExit(f"mutation target {target!r}: give one of {', '.join(LAYERS)} or a module path such as "
                         "fp8train/evidence/verdict.py")
    for layer in LAYERS.values():
        if any(Path(path).match(m) for m in layer["modules"]):
            return Path(path).stem, dict(layer, modules=[path], exclude=[])
    raise SystemExit(f"mutation target {target!r} is in no layer of {', '.join(LAYERS)}")


def _modules(layer: dict) -> list[str]:
    found = sorted({p.relative_to(ROOT).as_posix() for m in layer["modules"] for p in ROOT.glob(m)})
    return [m for m in found if m not in layer["exclude"] and not m.endswith("__init__.py")]


def _copy_tree(workdir: Path) -> None:
    """The tree's files into `workdir`, timestamps kept (mutmut reuses results of files that did not change)."""
    workdir.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for item in COPIED:
        source = ROOT / item
        if source.is_dir():
            shutil.copytree(source, workdir / item, dirs_exist_ok=True, ignore=ignore, copy_function=shutil.copy2)
        elif source.exists():
            shutil.copy2(source, workdir / item)


def _write_config(workdir: Path, layer: dict, modules: list[str]) -> None:
    """The copy's pyproject.toml: the tree's [tool.mutmut] plus this layer's modules and tests."""
    text = (ROOT / "pyproject.toml").read_text()
    settings = dict(tomllib.loads(text)["tool"]["mutmut"])
    settings["only_mutate"] = modules
    settings["pytest_add_cli_args_test_selection"] = list(layer["tests"])
    settings["pytest_add_cli_args"] = list(settings.get("pytest_add_cli_args", [])) + ["-m", layer["markers"]]
    table = "\n".join(f"{key} = {json.dumps(value)}" for key, value in settings.items())  # JSON is valid TOML here
    text = re.sub(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", "", text)
    (workdir / "pyproject.toml").write_text(text.rstrip() + "\n\n[tool.mutmut]\n" + table + "\n")


def _all_mutants(workdir: Path, env: dict, modules: list[str]) -> list[str]:
    """mutmut's names of every mutant of `modules`: generated (no test run) by mutmut's own first step."""
    generate = ("import mutmut.__main__ as m; m.copy_src_dir(); m.copy_also_copy_files(); m.setup_source_paths(); "
                "m.create_mutants(1)")
    subprocess.run([sys.executable, "-c", generate], cwd=workdir, env=env, check=True, stdout=subprocess.DEVNULL)
    names = []
    for module in modules:
        meta = workdir / "mutants" / f"{module}.meta"
        if not meta.exists():  # an interrupted earlier generation leaves a mutated copy without its list
            raise SystemExit(f"mutmut listed no mutants of {module} in {workdir}: rerun with --fresh")
        names += json.loads(meta.read_text())["exit_code_by_key"]
    return sorted(names)


def _sampled_mutants(workdir: Path, env: dict, modules: list[str], n: int, seed: int) -> list[str]:
    """N of the layer's mutants drawn uniformly without replacement; the same N and seed give the same draw."""
    names = _all_mutants(workdir, env, modules)
    print(f"{len(names)} mutants in {len(modules)} modules; testing {min(n, len(names))} drawn with seed {seed}")
    return sorted(random.Random(seed).sample(names, min(n, len(names))))


def _wilson_interval(killed: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a binomial proportion (a sample's score as an estimate of the whole list's)."""
    if n == 0:
        return 0.0, 1.0
    z = 1.959963984540054
    p = killed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _equivalents() -> dict[str, str]:
    if not EQUIVALENTS.exists():
        return {}
    found = re.findall(r"^- `([^`]+)`: (.+)$", EQUIVALENTS.read_text(), flags=re.M)
    return dict(found)


def _score(workdir: Path, modules: list[str], names: list[str]) -> dict:
    """Killed / (tested - equivalent) over the target's mutants (only `names` when given: a sample)."""
    codes: dict[str, int | None] = {}
    for module in modules:
        meta = workdir / "mutants" / f"{module}.meta"
        if meta.exists():
            codes.update(json.loads(meta.read_text())["exit_code_by_key"])
    if names:
        codes = {k: v for k, v in codes.items() if k in set(names)}
    equivalent = _equivalents()
    # mutmut's exit codes: a test failed (1, 3), the mutant ran past its time limit (the rest of the first set),
    # or the test process crashed (a segfault or an abort: the mutant broke the C kernel's inputs)
    timeout_codes, crash_codes = {36, -24, 24, 152, 255}, {-11, -9, -6}
    killed_codes = {1, 3} | timeout_codes | crash_codes
    counted = {k: v for k, v in codes.items() if k not in equivalent}
    killed = sorted(k for k, v in counted.items() if v in killed_codes)
    timeouts = sorted(k for k, v in counted.items() if v in timeout_codes)
    crashes = sorted(k for k, v in counted.items() if v in crash_codes)
    survived = sorted(k for k, v in counted.items() if v == 0)
    no_tests = sorted(k for k, v in counted.items() if v in (5, 33))
    unchecked = sorted(k for k, v in counted.items() if v is None)
    other = sorted(k for k, v in counted.items()
                   if k not in set(killed) | set(survived) | set(no_tests) | set(unchecked))
    tested = len(counted) - len(unchecked)
    return {"modules": modules, "mutants": len(codes), "interval_95": _wilson_interval(len(killed), tested),
            "equivalent": len(codes) - len(counted), "counted": tested, "killed": len(killed),
            "score": len(killed) / tested if tested else 0.0, "survived": survived, "no_tests": len(no_tests),
            "timeouts": len(timeouts), "timeout_names": timeouts, "crashes": len(crashes), "crash_names": crashes,
            "no_tests_names": no_tests, "not_checked": len(unchecked), "other": other}


if __name__ == "__main__":
    sys.exit(main())
