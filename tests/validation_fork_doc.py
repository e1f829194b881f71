"""docs/validation-fork.md's commands, run as written with fewer steps appended (later overrides win), one flow
of the page at a time (tests/test_docs_validation_fork*.py: one file per flow, so the suite's workers run them
side by side).

Every `fp8train ...` and `python scripts/make_tiny_hf.py ...` line of the page's bash blocks runs, in order,
from a folder holding links to recipes/ and scripts/ (so the page's relative paths resolve as in a checkout):
the fork of the built-in decoder, the fork of the HF tiny fine-tune with seeds: auto, and seeds: auto from
scratch (two independent repetitions). What is appended only shrinks them: steps, seeds, candidates, the corpus;
the fork checkpoints the page names (step_000200, step_000060) become the small sources' step_000004.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "validation-fork.md"
# Appended to every command of the page, by its run.name: the small version.
SMALL_RUN = ["train.eval_batches=2", "train.batch_size=8", "log.every=2"]
SMALL_VALIDATE = ["train.max_steps=4", "train.eval_every=2", "validate.final_window=1", "validate.seeds=2",
                  "validate.workers=1", "validate.candidates=[current]", "validate.margin=0.2"]
SMALL = {
    "my_bf16": ["train.max_steps=8", "checkpoint.every=4"],
    "from_step200": SMALL_VALIDATE,
    "hf_bf16": ["train.max_steps=8", "checkpoint.every=4", "train.eval_every=4"],
    "hf_from_step60": SMALL_VALIDATE + ["validate.seeds=auto", "validate.max_seeds=3"],
    "auto": SMALL_VALIDATE + ["validate.seeds=auto", "validate.max_seeds=3"],
    "auto_rep2": SMALL_VALIDATE + ["validate.seeds=auto", "validate.max_seeds=3"],
}
# The page's three flows, by the run names of their commands (the tiny HF model's script belongs to "hf").
FLOWS = {"fork": ("my_bf16", "from_step200"), "hf": ("hf_bf16", "hf_from_step60"), "auto": ("auto", "auto_rep2")}
FORK_STEPS = {"step_000200": "step_000004", "step_000060": "step_000004"}


def doc_commands() -> list[str]:
    """The command lines of the page's ```bash blocks, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def run_flow(flow: str, tmp_path: Path, tiny, commands, capsys, monkeypatch) -> Path:
    """Run the page's commands of one flow, small; returns the runs/ folder they wrote."""
    for folder in ("recipes", "scripts"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    monkeypatch.chdir(tmp_path)
    for line in doc_commands():
        for big, small in FORK_STEPS.items():
            line = line.replace(big, small)
        argv = shlex.split(line)
        if argv[0] == "python":  # the tiny HF model and tokenizer, a few pretraining steps
            if flow == "hf":
                proc = commands.run([sys.executable, *argv[1:], "--steps", "3"], cwd=tmp_path, timeout=300)
                assert proc.returncode == 0, proc.stderr[-3000:]
            continue
        name = re.search(r"run\.name=(\S+)", line).group(1)
        if name not in FLOWS[flow]:
            continue
        extra = SMALL_RUN + SMALL[name]
        # the tiny corpus (seconds, not a stdlib scan); for the HF runs the head of the built-in one, tokenized
        extra = [f"data.path={tiny.corpus}" if "hf_tiny" not in argv[2] else "data.max_bytes=200000", *extra]
        code, out, err = commands.main([*argv[1:], *extra, "--quiet"], capsys)
        assert code in (0, 3), f"{line}\n{err[-3000:]}"  # a validation may end PASS (0) or INCONCLUSIVE (3)
    return tmp_path / "runs"
