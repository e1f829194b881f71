"""Run the real `fp8train` command line with a crash planted at a point the test chooses (crash tests only).

    python tests/crashpoint.py KILL_AT fp8train-arguments...

KILL_AT is one of
    before-checkpoint:N       SIGKILL on entering save_checkpoint for step N (so the run has logged step N and
                              written no part of its checkpoint)
    inside-checkpoint:N       SIGKILL inside save_checkpoint for step N, after its first tensor file is written and
                              before the second (a half-written checkpoint)
    marker-after-checkpoint:N:PATH
                              no kill here: once checkpoint N is complete, create the file PATH and carry on; the
                              test that waits for PATH then sends SIGKILL itself, landing wherever the run is by then

The process kills itself with SIGKILL (no clean-up, no flushing: exactly what `kill -9` does), so the kill lands at
the chosen point whatever the machine's load. Everything is patched here, from outside the package: fp8train ships
no test hooks.
"""

from __future__ import annotations

import functools
import inspect
import os
import signal
import sys
from pathlib import Path

import fp8train.cli as cli
import fp8train.training.runs.checkpoint as checkpoint

_TENSOR_WRITERS = ("save_file", "save_model")  # safetensors writers that checkpoint.py calls


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _replace_everywhere(original, replacement) -> None:
    """Point every fp8train module's reference to `original` (imported by name) at `replacement`."""
    for name, module in list(sys.modules.items()):
        if name.startswith("fp8train") and module is not None:
            for attr, value in list(vars(module).items()):
                if value is original:
                    setattr(module, attr, replacement)


def _plant(kind: str, step: int, marker: Path | None) -> None:
    original_save = checkpoint.save_checkpoint
    state = {"step": None, "writes": 0}

    signature = inspect.signature(original_save)

    @functools.wraps(original_save)
    def save_checkpoint(*args, **kwargs):
        save_step = signature.bind(*args, **kwargs).arguments["step"]
        if kind == "before-checkpoint" and save_step == step:
            _die()
        state["step"], state["writes"] = save_step, 0
        try:
            path = original_save(*args, **kwargs)
        finally:
            state["step"] = None
        if kind == "marker-after-checkpoint" and save_step == step:
            marker.write_text(str(path))
        return path

    def counting(writer):
        @functools.wraps(writer)
        def write(*args, **kwargs):
            if kind == "inside-checkpoint" and state["step"] == step:
                state["writes"] += 1
                if state["writes"] == 2:
                    _die()
            return writer(*args, **kwargs)
        return write

    for name in _TENSOR_WRITERS:
        setattr(checkpoint, name, counting(getattr(checkpoint, name)))
    _replace_everywhere(original_save, save_checkpoint)


def main(argv: list[str]) -> int:
    kind, _, rest = argv[0].partition(":")
    if kind not in ("before-checkpoint", "inside-checkpoint", "marker-after-checkpoint"):
        raise SystemExit(f"crashpoint.py: unknown KILL_AT {argv[0]!r}")
    step_text, _, marker = rest.partition(":")
    # Import the train command's module (cli imports it lazily) so its by-name imports can be patched.
    __import__(cli.COMMANDS["train"][0])
    _plant(kind, int(step_text), Path(marker) if marker else None)
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
