"""scripts/gpu_check.sh: the dry run on this CPU exercises every section end to end (subprocesses, time limits,
JSON written per section) with what the GPU image lacks (wandb, torchao, transformer_engine, transformers)
blocked in every process, sections whose modules are missing say so and the others still run, and bad usage
exits 2 before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fp8train.bench import gpu_check
from fp8train.bench.gpu_sections import SECTIONS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.sh"


def test_script_uses_python3_and_the_module():
    text = SCRIPT.read_text()
    assert 'PYTHON=${PYTHON:-python3}' in text and "-m fp8train.bench.gpu_check" in text
    assert "\npython " not in text and " python -" not in text  # never a bare `python`


IMAGE_LACKS = ("wandb", "torchao", "transformer_engine", "transformers")


def _blocking_env(tmp_path, names) -> dict:
    """An environment whose Python processes (the check and every section it starts) cannot import `names`: a
    sitecustomize on PYTHONPATH puts None for them in sys.modules, as for a package that is not installed."""
    site = tmp_path / "block_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{n!r}] = None\n" for n in names))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
            "PYTHON": sys.executable}


# nine section processes, ~45 s on 2 cores: with CI's extended tests. README's command keeps gpu_check.sh's dry run
# of the checks (test_carried_wheels_never_shadow_what_the_image_has), the checks, cuda_tests and train sections
# (the next test) and the parity section (tests/test_gpu_parity.py)
@pytest.mark.extended
def test_dry_run_runs_every_section_and_writes_json(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "--dry-run"], capture_output=True, text=True,
                          timeout=560, env=_blocking_env(tmp_path, IMAGE_LACKS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["sections"]) == list(SECTIONS)  # in the documented order
    for name, entry in summary["sections"].items():
        assert entry["status"] == "ok", (name, (out / f"{name}.log").read_text()[-2000:])
        result = json.loads((out / f"{name}.json").read_text())
        assert result["ok"] and result["section"] == name and result["device"] == "cpu"
    cells = json.loads((out / "capability.json").read_text())["cells"]
    tn = {(c["kind"], c["a"], c["b"], c["out"]): c for c in cells if c["layout"] == "TN"}
    # this CPU torch runs tensorwise e4m3 x e4m3 exactly (pow2 scales) and refuses blockwise with ValueError
    assert tn[("tensorwise", "e4m3", "e4m3", "float32")]["rel_err"] < 1e-6
    assert tn[("blockwise_1x128_128x128", "e4m3", "e4m3", "bfloat16")]["error"].startswith("ValueError")
    sync = json.loads((out / "sync.json").read_text())["recipes"]
    assert set(sync) >= {"current", "rowwise", "block", "mxfp8"}
    assert all(set(r["gemm_paths"]) == {"output", "grad_input", "grad_weight"} for r in sync.values())
    train = json.loads((out / "train.json").read_text())["runs"]["current"]
    assert train["status"] == "completed" and train["fp8_layers"] > 0
    e2e = json.loads((out / "e2e.json").read_text())["runs"]
    assert e2e["none"]["fp8_layers"] == 0 and e2e["delayed"]["fp8_layers"] > 0 and e2e["delayed"]["vs_bf16"] > 0
    planned = json.loads((out / "sync.json").read_text())["planned"]
    assert all("needs sm100" in p for p in planned["sm90"]["mxfp8"].values())
    assert planned["sm90"]["block"]["output"] == "scaled_mm:blockwise_1x128_128x128"
    modules = json.loads((out / "checks.json").read_text())["modules"]
    assert all(modules[n].startswith("missing") for n in ("wandb", "torchao"))


@pytest.mark.slow
def test_sections_without_their_modules_say_so_and_the_rest_run(tmp_path):
    out = tmp_path / "out"
    env = _blocking_env(tmp_path, IMAGE_LACKS + ("omegaconf", "pytest"))
    proc = subprocess.run([sys.executable, "-m", "fp8train.bench.gpu_check", str(out), "--dry-run", "--sections",
                           "checks,cuda_tests,train"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a section could not run
    summary = json.loads((out / "summary.json").read_text())["sections"]
    assert summary["checks"]["status"] == "ok"  # the check itself needs neither
    for name, module in (("cuda_tests", "pytest"), ("train", "omegaconf")):
        result = json.loads((out / f"{name}.json").read_text())
        assert not result["ok"] and module in result["error"] and "prepare_gpu_wheels" in result["error"], result
    problems = json.loads((out / "checks.json").read_text())["problems"]
    assert any("train cannot run without omegaconf" in p for p in problems), problems


def test_a_killed_section_still_has_its_json(tmp_path):
    """The section process is killed at its limit before it can write: the check writes the JSON for it."""
    result = gpu_check._run_section_process("checks", tmp_path, True, 0.5)
    assert result["status"] == "timeout"
    written = json.loads((tmp_path / "checks.json").read_text())
    assert written["ok"] is False and written["status"] == "timeout" and written["section"] == "checks"


def test_prepare_script_fetches_pure_python_wheels_only():
    text = (SCRIPT.parent / "prepare_gpu_wheels.sh").read_text()
    assert "--only-binary=:all:" in text and "--platform any" in text and "omegaconf" in text and "pytest" in text
    assert subprocess.run(["bash", "-n", str(SCRIPT.parent / "prepare_gpu_wheels.sh")]).returncode == 0


def test_budget_skips_sections_and_says_so(tmp_path):
    # 12 s: the checks get 10 s (enough on an idle CPU); every later section is skipped, and the exit is 1
    code = gpu_check.main([str(tmp_path), "--dry-run", "--budget", "12", "--sections", "checks,capability"])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["sections"]["capability"]["status"] == "skipped"
    assert code == 1


@pytest.mark.parametrize("argv", [["--sections", "nope"], ["--budget", "900"], ["--budget", "0"]])
def test_bad_usage_exits_2_before_running(tmp_path, argv):
    assert gpu_check.main([str(tmp_path / "o"), "--dry-run", *argv]) == 2
    assert not (tmp_path / "o").exists()


def test_module_runs_as_a_script_entry_point():
    proc = subprocess.run([sys.executable, "-m", "fp8train.bench.gpu_check", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout and "--dry-run" in proc.stdout and "--budget" in proc.stdout


def _unpacked_wheel(site: Path, dist: str, version: str, module: str, body: str) -> None:
    """A wheel as prepare_gpu_wheels.sh leaves it: the module, and a .dist-info whose RECORD lists both."""
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(body)
    info = site / f"{dist}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{module}/__init__.py,,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")


def test_carried_wheels_never_shadow_what_the_image_has(tmp_path):
    """A carried pytest 0.0.1 (which would break on import) next to a package the image lacks: gpu_check.sh puts
    only the missing one on the path; the checks then report the image's own pytest version."""
    site = tmp_path / "site"
    _unpacked_wheel(site, "pytest", "0.0.1", "pytest", "raise ImportError('the carried pytest shadowed the image')\n")
    _unpacked_wheel(site, "fp8train_absent_dist", "1.0", "fp8train_absent_mod", "VALUE = 7\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_SITE": str(site), "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(SCRIPT), str(out), "--dry-run", "--sections", "checks"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.strip().endswith("site: fp8train_absent_dist (the image has the rest)"), proc.stderr
    modules = json.loads((out / "checks.json").read_text())["modules"]
    assert modules["pytest"] == pytest.__version__  # the image's (this venv's), not 0.0.1
    (links,) = tmp_path.glob("fp8train_gpu_site.*")
    assert sorted(p.name for p in links.iterdir()) == ["fp8train_absent_dist-1.0.dist-info", "fp8train_absent_mod"]
    probe = subprocess.run([sys.executable, "-c", "import fp8train_absent_mod, pytest; print(fp8train_absent_mod.VALUE)"],
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(links)}, timeout=60)
    assert probe.returncode == 0 and probe.stdout.strip() == "7", probe.stderr
