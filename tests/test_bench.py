"""The CPU-runnable parts of ``fp8train bench`` and the prepared GPU check script.

A tiny eager run (--compile off, a few thousand elements, two repeats) checks the JSON schema and the printed
tables against it; the timings themselves are not asserted (a shared machine), only their structure, the ratios'
definition and the target statuses.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch

from fp8train.bench import suite as bench
from fp8train.cli import main
from fp8train.numerics import native_cast

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"


@pytest.mark.parametrize("text, expected", [
    ("4096x1024x1024", [(4096, 1024, 1024)]),
    ("1024x256x256, 64X128x32", [(1024, 256, 256), (64, 128, 32)]),
])
def test_parse_shapes(text, expected):
    assert bench.parse_shapes(text) == expected


@pytest.mark.parametrize("bad", ["12x", "axbxc", "1x2x3x4", "0x128x128", "128x-1x128", "", "64x64x64,,"])
def test_parse_shapes_names_the_bad_item(bad):
    with pytest.raises(ValueError, match="cannot parse") as err:
        bench.parse_shapes(bad)
    assert "MxKxN" in str(err.value)


def test_cli_bad_shape_exits_2_naming_it(capsys):
    assert main(["bench", "--shapes", "1024x256x256,12x"]) == 2
    err = capsys.readouterr().err
    assert "'12x'" in err and "MxKxN" in err


@pytest.mark.parametrize("args, word", [(["--recipes", "current,nope"], "nope"),
                                        (["--sections", "quant,gpu"], "gpu"),
                                        (["--repeats", "0"], "--repeats")])
def test_cli_bad_lists_exit_2(capsys, args, word):
    assert main(["bench", *args]) == 2
    assert word in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when no GPU is present")
def test_cli_cuda_without_gpu_exits_2(capsys):
    assert main(["bench", "--device", "cuda", "--quick"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_torchao_missing_is_a_note_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # makes `import torchao...` raise ImportError
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    module, why = bench._torchao_linear(torch.nn.Linear(32, 32), "cpu")
    assert module is None and "pip install torchao" in why


def test_ratio_is_median_over_baseline_with_paired_spread():
    base, other = bench.Timing([1.0, 2.0, 4.0]), bench.Timing([2.0, 2.0, 2.0])
    r = bench._ratio(other, base)
    assert r["ratio"] == pytest.approx(1.0)  # median 2 / median 2
    assert r["ratio_q1"] <= 1.0 <= r["ratio_q3"]  # paired ratios 2, 1, 0.5


def test_saved_tensor_bytes_counts_fp8_inputs_as_one_byte():
    from fp8train.nn.linear import Fp8Linear

    torch.manual_seed(0)
    x = torch.randn(64, 128, requires_grad=True)

    class Wrap(torch.nn.Module):  # saved_tensor_bytes calls model(x, y) -> (logits, loss)
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            out = self.inner(x)
            return out, out.float().pow(2).mean()

    linear = torch.nn.Linear(128, 128, bias=False)
    bf16 = bench.saved_tensor_bytes(Wrap(linear), x, None, "cpu")
    fp8 = bench.saved_tensor_bytes(Wrap(Fp8Linear.from_linear(linear, "current")), x, None, "cpu")
    # bf16 autocast saves the bf16 input and the bf16 weight copy; FP8 saves 1-byte input and weight.
    assert bf16["by_dtype"]["bfloat16"] == 2 * (64 * 128 + 128 * 128)
    assert fp8["by_dtype"]["float8_e4m3fn"] == 64 * 128 + 128 * 128
    assert "bfloat16" not in fp8["by_dtype"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny eager run of every section through the CLI, JSON to stdout and to --out."""
    root = tmp_path_factory.mktemp("bench")
    out = root / "bench.json"
    (root / "corpus.txt").write_text("def f(x):\n    return x * 2  # a tiny corpus\n" * 400)
    (root / "tiny.yaml").write_text(
        "model: {n_layers: 1, d_model: 64, n_heads: 2, seq_len: 32}\n"
        f"data: {{path: {root / 'corpus.txt'}}}\n"
        "train: {batch_size: 4}\n"
        "policy: {min_features: 64}\n"
        "fp8: {input_block: [1, 32], weight_block: [32, 32], grad_output_block: [1, 32]}\n")
    stdout, stderr = io.StringIO(), io.StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        rc = main(["bench", "--json", "--out", str(out), "--quick", "--compile", "off", "--no-torchao",
                   "--no-malloc-tuning", "--quant-numel", "16384", "--shapes", "64x128x128",
                   "--recipes", "current,block", "--warmup", "1", "--repeats", "2", "--threads", "1",
                   "--train-config", str(root / "tiny.yaml")])
    return rc, stdout.getvalue(), stderr.getvalue(), out


def test_tiny_run_json_schema(tiny_run):
    rc, stdout, stderr, out = tiny_run
    assert rc == 0, stderr
    results = json.loads(stdout)
    assert json.loads(out.read_text()) == results
    assert {"machine", "settings", "sections", "notes", "errors", "targets"} <= set(results)
    assert results["errors"] == {}
    assert {"cpu", "cores", "torch", "load_average"} <= set(results["machine"])
    # --compile off: no torch.compile; the native C kernel compiles nothing of torch's, so it runs where it builds
    assert results["settings"]["fp8_path"].startswith("native" if native_cast.available() else "eager")
    sections = results["sections"]
    assert set(sections) == set(bench.SECTIONS)
    timing_keys = {"median_s", "min_s", "max_s", "q1_s", "q3_s", "repeats", "ratio", "ratio_q1", "ratio_q3"}
    quant = sections["quant"]["rows"]
    paths = {r["path"] for r in quant}
    assert {"naive eager", "fp8train eager"} <= paths and not any("compiled" in p for p in paths)  # --compile off
    assert ("fp8train native" in paths) is native_cast.available()
    assert all(timing_keys <= set(r) and r["gelem_per_s"] > 0 and r["repeats"] == 2 for r in quant)  # --repeats
    assert results["settings"]["quant_repeats"] == 2
    linear = sections["linear"]["rows"]
    assert [r["contender"] for r in linear] == ["bf16", "fp32", "current", "block"]
    for r in linear:
        assert timing_keys | {"ratio_fp32", "tflops", "shape"} <= set(r) and r["shape"] == [64, 128, 128]
        assert r["min_s"] <= r["median_s"] <= r["max_s"] and r["repeats"] == 2
    assert linear[0]["ratio"] == pytest.approx(1.0) and linear[1]["ratio_fp32"] == pytest.approx(1.0)
    train = {r["contender"]: r for r in sections["train"]["rows"]}
    assert set(train) == {"bf16", "fp32", "current", "block"} and train["bf16"]["fp8_layers"] == 0
    assert train["fp32"]["fp8_layers"] == 0 and train["current"]["fp8_layers"] > 0
    assert train["bf16"]["ratio"] == pytest.approx(1.0) and train["fp32"]["ratio_fp32"] == pytest.approx(1.0)
    assert all(r["tokens_per_s"] > 0 and r["step_peak_mb"] > 0 and r["resident_mb"] > 0 for r in train.values())
    assert sections["train"]["threads"] == 1  # --threads 1
    memory = {r["contender"]: r for r in sections["memory"]["rows"]}
    assert memory["current"]["saved_mb"] < memory["bf16"]["saved_mb"]  # FP8 inputs kept for backward
    assert any("torchao" in n for n in results["notes"])
    targets = {t["target"]: t for t in results["targets"]}
    # A target's status is its measured figure against docs/benchmarks.md's threshold (train step: <= 1.3x bf16 for the
    # tensorwise recipes, <= 1.5x for block), recomputed here from the section's own row.
    for name, threshold in (("current", 1.3), ("block", 1.5)):
        target = targets[f"train step {name} (x bf16)"]
        assert target["value"] == train[name]["ratio"] and target["threshold"] == threshold
        assert target["met"] is (train[name]["ratio"] <= threshold)
    assert targets["Fp8Linear current fwd+bwd 4096x1024x1024 (x fastest high-precision)"]["met"] is None  # not run
    ops = {r["contender"]: r for r in sections["ops"]["rows"]}
    assert set(ops) == {"nn.Linear bf16", "current", "block"} and all(r["ops"] > 0 for r in ops.values())
    target = targets["aten ops fwd+bwd 512x256->256 current"]
    assert target["value"] == ops["current"]["ops"] and target["met"] is (ops["current"]["ops"] <= 50)


def test_tiny_run_prints_the_tables(tiny_run):
    """The printed tables hold the measured figures of the JSON, row by row (not just their headings)."""
    _, stdout, stderr, _ = tiny_run
    results = json.loads(stdout)
    lines = [line.split() for line in stderr.splitlines()]

    def row(first, *tokens):  # the one table line that starts with `first` and holds all `tokens`
        found = [line for line in lines if line and line[0] == first and all(t in line for t in tokens)]
        assert len(found) == 1, (first, tokens, found)
        return found[0]

    for heading in ("machine:", "quantize,", "top-level aten ops", "linear forward+backward", "train step",
                    "activation memory", "targets"):
        assert heading in stderr
    for r in results["sections"]["linear"]["rows"]:
        assert row("64x128x128", r["contender"])[2] == f"{r['median_s'] * 1e3:.1f}"
    for r in results["sections"]["train"]["rows"]:
        assert row(r["contender"], f"{r['tokens_per_s']:.0f}")[1:3] == [str(r["fp8_layers"]),
                                                                        f"{r['median_s'] * 1e3:.1f}"]
    for r in results["sections"]["memory"]["rows"]:
        assert row(r["contender"], f"{r['saved_mb']:.2f}", f"{r['ratio']:.2f}x")
    for t in results["targets"]:
        status = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        assert status in " ".join(row(*t["target"].split(), f"{t['op']}", str(t["threshold"])))


def test_the_train_section_runs_with_the_train_configs_threads(tmp_path):
    """Without --threads the train step runs with the train config's `train.threads` (as its training runs do),
    reports them, and leaves torch's thread count as it found it; --threads overrides the config."""
    from fp8train.bench.options import BenchOptions
    from fp8train.bench.train_section import bench_train

    (tmp_path / "corpus.txt").write_text("def f(x):\n    return x * 2  # a tiny corpus\n" * 400)
    (tmp_path / "tiny.yaml").write_text(
        "model: {n_layers: 1, d_model: 64, n_heads: 2, seq_len: 16}\n"
        f"data: {{path: {tmp_path / 'corpus.txt'}}}\n"
        "train: {batch_size: 2, threads: 1}\n")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for asked, expected in ((None, 1), (2, 2)):
            if asked:
                torch.set_num_threads(asked)  # (run_bench sets --threads before the sections)
            opts = BenchOptions(recipes=("current",), sections=("train",), train_config=str(tmp_path / "tiny.yaml"),
                                threads=asked)
            result = bench_train(opts, warmup=1, repeats=1, kernel="eager")
            assert result["threads"] == expected and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_gpu_check_usage():
    proc = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_explains_when_no_gpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(GPU_CHECK), str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2
    assert "checks failed" in proc.stderr
    checks = json.loads((tmp_path / "out" / "checks.json").read_text())
    assert "no CUDA GPU of sm89+ visible to torch" in checks["problems"] and checks["torch"] == torch.__version__
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(summary["sections"]) == ["checks"]  # nothing else was attempted
    assert not (tmp_path / "out" / "capability.json").exists()


def test_bench_wrapper_script_runs(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--shapes", "12x"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "scripts" / "bench.py"), run_name="__main__")
    assert exit_.value.code == 2 and "'12x'" in capsys.readouterr().err


def test_linear_timing_makes_every_contender_recast_its_weight():
    """Each timed call starts from a changed weight, as after an optimizer step: the FP8 layer's cached copy is
    remade every call (its key holds the weight's version), as bf16 autocast re-casts its weight."""
    from fp8train.bench.linear_section import _fwd_bwd
    from fp8train.nn.linear import Fp8Linear

    layer = Fp8Linear(64, 32, bias=False, recipe="current")
    step = _fwd_bwd(layer, torch.randn(16, 64), torch.randn(16, 32), False, "cpu")
    keys = []
    for _ in range(3):
        step()
        keys.append(layer._weight_cache.key)
    assert len(set(keys)) == 3, keys


@pytest.mark.parametrize("where", ["existing file", "link", "run file", "folder", "proc"])
def test_out_is_checked_before_the_work_and_never_written_through(tmp_path, where, tiny_fp8_run, capsys):
    """--out goes through the guarded writer like every command's outputs: an existing file needs --force, a link
    or a run's records never (with --force too), a folder or /proc/x is one line, exit 2, before any timing."""
    target = tmp_path / "mine.txt"
    target.write_text("mine\n")
    run = tmp_path / "run"
    if where == "run file":
        import shutil
        shutil.copytree(tiny_fp8_run, run)
    out = {"existing file": target, "link": tmp_path / "bench.json", "run file": run / "metrics.jsonl",
           "folder": tmp_path, "proc": Path("/proc/bench.json")}[where]
    if where == "link":
        out.symlink_to(target)
    before = out.read_bytes() if out.is_file() else None
    forces = [[], ["--force"]]  # an existing file that is not a bench result: refused with --force too
    for force in forces:
        rc = main(["bench", "--out", str(out), *force, "--quick", "--sections", "quant", "--quant-numel", "4096",
                   "--repeats", "1", "--warmup", "0", "--no-torchao"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and str(out) in err[0], err
        assert "section" not in err[0]  # refused before any section ran
    assert target.read_text() == "mine\n"
    if before is not None:
        assert out.read_bytes() == before


def test_force_replaces_an_earlier_result(tmp_path, capsys):
    out = tmp_path / "bench.json"
    out.write_text('{"machine": {}, "settings": {}, "sections": {"linear": {}}}\n')  # an earlier result's shape
    rc = main(["bench", "--out", str(out), "--force", "--quick", "--sections", "quant", "--quant-numel", "4096",
               "--repeats", "1", "--warmup", "0", "--no-torchao", "--no-malloc-tuning", "--threads", "1"])
    assert rc == 0, capsys.readouterr().err
    assert "quant" in json.loads(out.read_text())["sections"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]  # no temp file left


@pytest.mark.parametrize("argv, named", [(["--train-config", "/nonexistent/recipe.yaml", "--sections", "train"],
                                          "/nonexistent/recipe.yaml"),
                                         (["--quant-numel", str(10 ** 14), "--sections", "quant"], "--quant-numel")])
def test_bad_input_is_one_line_before_any_section(argv, named, capsys):
    """A missing --train-config was a failed section (exit 1, after the others ran); a --quant-numel of 10^14 an
    allocation failure inside the section. Both are the user's: one line, exit 2, before any section."""
    rc = main(["bench", "--quick", "--no-torchao", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and named in err[0], err
