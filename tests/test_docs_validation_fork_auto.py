"""docs/validation-fork.md's seeds: auto flow, run as written (small; tests/validation_fork_doc.py): two
repetitions from scratch whose seeds do not overlap."""

from __future__ import annotations

import json

import pytest

from validation_fork_doc import run_flow


@pytest.mark.slow
def test_seeds_auto_and_its_independent_repetition_run_on_cpu(tmp_path, tiny, commands, capsys, monkeypatch):
    runs = run_flow("auto", tmp_path, tiny, commands, capsys, monkeypatch)
    auto = json.loads((runs / "auto" / "summary.json").read_text())
    assert auto["sequential"]["rule"] == "pocock" and auto["cost"]["runs"] >= 4
    # the page's second repetition (train.seed moved on) plans seeds that the first never uses
    first, second = (json.loads((runs / name / "plan.json").read_text())["seeds"] for name in ("auto", "auto_rep2"))
    assert first[0] == 1337 and second[0] == 1343 and not set(first) & set(second)
