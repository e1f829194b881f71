"""docs/validation-fork.md: the page's three flows are all there, and its first, the fork of the built-in
decoder from a checkpoint of the user's own bf16 run, runs as written (small; tests/validation_fork_doc.py).
The HF flow and the seeds: auto flow run in test_docs_validation_fork_hf.py and _auto.py."""

from __future__ import annotations

import json
import re

import pytest

from validation_fork_doc import FLOWS, SMALL, doc_commands, run_flow


def test_the_page_has_the_three_flows():
    lines = doc_commands()
    names = [re.search(r"run\.name=(\S+)", line).group(1) for line in lines if line.startswith("fp8train")]
    assert names == list(SMALL) == [name for flow in FLOWS.values() for name in flow]
    assert any(line.startswith("python scripts/make_tiny_hf.py") for line in lines)


@pytest.mark.slow
def test_the_fork_of_the_built_in_decoder_runs_on_cpu(tmp_path, tiny, commands, capsys, monkeypatch):
    runs = run_flow("fork", tmp_path, tiny, commands, capsys, monkeypatch)
    fork = json.loads((runs / "from_step200" / "plan.json").read_text())["fork"]
    assert fork["checkpoint"].endswith("my_bf16/checkpoints/step_000004") and fork["step"] == 4
