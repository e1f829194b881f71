"""docs/validation-fork.md's Hugging Face flow, run as written (small; tests/validation_fork_doc.py): the tiny
HF model, its bf16 fine-tune, and a validation forked from the fine-tune's checkpoint with seeds: auto."""

from __future__ import annotations

import json

import pytest

from validation_fork_doc import run_flow


@pytest.mark.slow
def test_the_fork_of_a_hf_fine_tune_runs_on_cpu(tmp_path, tiny, commands, capsys, monkeypatch):
    runs = run_flow("hf", tmp_path, tiny, commands, capsys, monkeypatch)
    hf_plan = json.loads((runs / "hf_from_step60" / "plan.json").read_text())
    assert hf_plan["fork"]["step"] == 4 and hf_plan["sequential"]["looks"] == [2, 3]
    hf_summary = json.loads((runs / "hf_from_step60" / "summary.json").read_text())
    assert hf_summary["cost"]["runs"] in (4, 6)
