"""The GPU check's parity section in its CPU form (fp8train.bench.gpu_parity): the integer operands give exact
results, the float64 reference follows the documented tile rule (checked here element by element with numpy),
a misplaced scale shows, every kind is planned and replayed on meta tensors for sm90 and sm100, and every recipe's
Fp8Linear planned for sm90 stays within the derived accumulation bound of the plain emulation."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fp8train.bench.gpu_parity import float64_reference, gemm_parity_cases, kind_operands, linear_parity_cases
from fp8train.nn.gemm import Fp8Operand, fp8_mm
from fp8train.nn.recipes import RECIPE_NAMES
from fp8train.nn.scaled_mm_rules import SCALED_MM_KINDS

pytestmark = pytest.mark.usefixtures("single_thread")

# which kind each planned GPU reaches (the rules of tests/test_scaled_mm_replay.py, R3 and R6)
SM90_KINDS = set(SCALED_MM_KINDS) - {"mx_1x32"}
SM100_KINDS = {"tensorwise", "rowwise", "mx_1x32"}


def test_every_kind_and_output_is_exact_on_the_emulation_and_in_each_planned_gpu():
    cases = gemm_parity_cases("cpu")
    assert {(c["kind"], c["out"]) for c in cases} == {(k, o) for k in SCALED_MM_KINDS for o in ("float32", "bfloat16")}
    for case in cases:
        assert case["ok"] and case["emulated_exact"], case
        for gpu, reached in (("sm90", SM90_KINDS), ("sm100", SM100_KINDS)):
            planned = case[gpu]
            assert (planned["kind"] == case["kind"]) == (case["kind"] in reached), (gpu, planned)
            if planned["kind"]:
                assert planned["modelled_exact"] and planned["meta_shape"] == [256, 256]
        # this CPU torch runs tensorwise exactly and has no blockwise / MX kernel
        assert case["cpu_scaled_mm"] == ("exact" if case["kind"] == "tensorwise" else case["cpu_scaled_mm"])
        assert case["cpu_scaled_mm"] in ("exact", "refused")
    rowwise_fp32 = next(c for c in cases if c["kind"] == "rowwise" and c["out"] == "float32")
    assert rowwise_fp32["sm90"]["rounds_to"] == "float32" and rowwise_fp32["sm100"]["rounds_to"] == "bfloat16"


@pytest.mark.parametrize("kind", SCALED_MM_KINDS)
def test_float64_reference_follows_the_documented_tiles(kind):
    """Element by element in numpy: a's scale for (i, k) is its tile's, b's for (k, j) likewise (b stored (N, K))."""
    m, k, n = 128, 256, 128
    a, b = kind_operands(kind, m, k, n, "cpu", seed=3)
    a_vals, b_vals = a.data.float().numpy().astype(np.float64), b.data.float().numpy().astype(np.float64)
    a_scale, b_scale = a.scale.numpy().astype(np.float64), b.scale.numpy().astype(np.float64)
    a_tile = a.block or (1, k) if a_scale.ndim else (m, k)
    b_tile = b.block or (k, 1) if b_scale.ndim else (k, n)
    expected = np.zeros((m, n))
    for i in range(0, m, 37):  # a spread of rows and columns is enough, and keeps this loop short
        for j in range(0, n, 29):
            for kk in range(k):
                sa = a_scale[i // a_tile[0], kk // a_tile[1]] if a_scale.ndim else a_scale
                sb = b_scale[kk // b_tile[0], j // b_tile[1]] if b_scale.ndim else b_scale
                expected[i, j] += a_vals[i, kk] * sa * b_vals[kk, j] * sb
    got = float64_reference(kind, a, b).numpy()
    assert np.array_equal(got[::37, ::29], expected[::37, ::29])


@pytest.mark.parametrize("kind", ["rowwise", "blockwise_1x128_128x128", "blockwise_1x128_1x128", "mx_1x32"])
def test_a_misplaced_scale_changes_the_result(kind):
    """The point of per-tile power-of-two scales: the emulation with b's scales permuted is not the reference."""
    a, b = kind_operands(kind, 256, 512, 256, "cpu")
    exact = float64_reference(kind, a, b)
    assert torch.equal(fp8_mm(a, b, "emulated").double(), exact)
    flipped = Fp8Operand(b.data, b.scale.flip(-1).contiguous(), b.block)  # scales of the wrong columns / tiles
    assert not torch.equal(fp8_mm(a, flipped, "emulated").double(), exact)


def test_every_recipe_planned_for_sm90_stays_within_the_accumulation_bound():
    cases = linear_parity_cases("cpu", tokens=128)
    assert {(c["recipe"], c["gemm"]) for c in cases} == {(r, g) for r in RECIPE_NAMES
                                                         for g in ("output", "grad_input", "grad_weight")}
    assert all(c["ok"] and 0 <= c["max_diff_over_bound"] <= 1 for c in cases), [c for c in cases if not c["ok"]]
    assert any(c["max_abs_diff"] > 0 for c in cases)  # the two sides are computed apart, not shared
    assert next(c for c in cases if c["recipe"] == "block" and c["gemm"] == "output")["path"] == \
        "scaled_mm:blockwise_1x128_128x128"


def test_the_parity_section_runs_in_the_dry_run_and_its_digest_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fp8train.bench.gpu_check", str(tmp_path), "--dry-run",
                           "--sections", "checks,parity"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "parity.json").read_text())
    lines = (tmp_path / "parity.jsonl").read_text().splitlines()
    assert result["ok"] and result["cases"] == len(lines) == 12 + 3 * len(RECIPE_NAMES)
    assert f"gpu_check: parity: {len(lines)}/{len(lines)} cases hold" in proc.stdout
