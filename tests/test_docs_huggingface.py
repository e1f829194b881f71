"""docs/huggingface.md's commands, run as written (in this process, with fewer steps): the Llama and GPT-2
round trips train -> dense folder -> from_pretrained -> second fine-tune -> FP8 export (or its refusal) -> load,
and a transformers.Trainer checkpoint of a converted model -> FP8 export with --tokenizer -> load.
A command whose comment says `exit 2` must be refused; every other one must succeed."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest

from fp8train.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "huggingface.md"
# Fewer steps and less text than the page's defaults, so the whole page runs in about a minute.
FAST_TRAIN = ["train.max_steps=3", "train.eval_every=3", "train.eval_batches=1", "data.max_bytes=200000"]


def doc_commands() -> list[tuple[list[str], int]]:
    """(argv, expected exit code) for every line of the page's bash blocks."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    commands = []
    for line in "\n".join(blocks).splitlines():
        if line.strip():
            comment = line.split("  #", 1)[1] if "  #" in line else ""
            commands.append((shlex.split(line, comments=True), 2 if "exit 2" in comment else 0))
    return commands


def _run(argv: list[str]) -> int:
    if argv[:2] == ["python", "-c"]:
        exec(compile(argv[2], "<docs/huggingface.md>", "exec"), {})
        return 0
    if argv[0] == "python":
        spec = importlib.util.spec_from_file_location("doc_script", REPO / argv[1])
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        previous = sys.argv
        # make_tiny_hf's pretraining shortened; trainer_fp8 keeps its 20 steps: the page names checkpoint-20
        sys.argv = [argv[1], *argv[2:], *(["--steps", "2"] if argv[1].endswith("make_tiny_hf.py") else [])]
        try:
            script.main()
        finally:
            sys.argv = previous
        return 0
    assert argv[0] == "fp8train", argv
    args = [str(REPO / a) if a.startswith("recipes/") else a for a in argv[1:]]
    if args[0] == "train":
        return main(["train", "--quiet", *args[1:], *FAST_TRAIN])
    return main(args)


@pytest.mark.slow
def test_the_pages_commands_run(tmp_path, monkeypatch, capsys):
    commands = doc_commands()
    assert sum(a[:2] == ["fp8train", "train"] for a, _ in commands) == 4  # two fine-tunes per architecture
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for argv, expected in commands:
        assert _run(argv) == expected, " ".join(argv)
        said = capsys.readouterr()
        if expected == 2:
            assert "--format hf" in said.err  # the refusal names the dense export
        assert "vLLM fuses" not in said.out  # the page's FP8 export is one vLLM can load
    for folder in ("hf_tiny/ft1", "hf_tiny/ft2-fp8", "hf_tiny/trainer-fp8", "hf_gpt2/ft1", "hf_gpt2/ft2"):
        assert (tmp_path / folder / "config.json").is_file() and (tmp_path / folder / "tokenizer.json").is_file()
    assert not (tmp_path / "hf_gpt2" / "ft2-fp8").exists()
