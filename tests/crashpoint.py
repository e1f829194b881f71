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
    after-run-lock:FOLDER     SIGKILL once a run has taken the lock of its folder FOLDER (a path ending so, e.g.
                              runs/bf16/seed1338), before it writes anything there (not even config.yaml)
    after-run-config:FOLDER   SIGKILL once that run has written its config.yaml, before its first log line
    inside-output-set:NAME    SIGKILL once a command writing a set of files (report, kv-eval) has written the temp
                              file of NAME, before the set is moved into place (a report killed mid-write)

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


def _plant_in_run_claim(kind: str, folder: str) -> None:
    """Kill in the claim of the run folder ending with `folder`: after its lock (before first_writes) or after
    first_writes (config.yaml)."""
    import fp8train.training.runs.claim as claim

    original_claim = claim.claim_run_dir

    @functools.wraps(original_claim)
    def claim_run_dir(run_dir, accelerator, expected_state, first_writes, log):
        def writes():
            if kind == "after-run-lock":
                _die()
            first_writes()
            if kind == "after-run-config":
                _die()
        return original_claim(run_dir, accelerator, expected_state,
                              writes if Path(run_dir).as_posix().endswith(folder) else first_writes, log)

    _replace_everywhere(original_claim, claim_run_dir)


def _plant_in_output_set(name: str) -> None:
    import fp8train.training.storage.outputs as outputs

    original_write = outputs.write_output_set

    @functools.wraps(original_write)
    def write_output_set(folder, writers, *args, **kwargs):
        def killing(write):
            def wrote(tmp):
                result = write(tmp)
                _die()
                return result
            return wrote
        writers = {n: (killing(w) if n == name else w) for n, w in writers.items()}
        return original_write(folder, writers, *args, **kwargs)

    _replace_everywhere(original_write, write_output_set)


def main(argv: list[str]) -> int:
    kind, _, rest = argv[0].partition(":")
    # Import the commands' modules (cli imports them lazily) so their by-name imports can be patched.
    for command in ("train", "validate", "report", "kv-eval"):
        __import__(cli.COMMANDS[command][0])
    if kind in ("after-run-lock", "after-run-config"):
        _plant_in_run_claim(kind, rest)
    elif kind == "inside-output-set":
        _plant_in_output_set(rest)
    elif kind in ("before-checkpoint", "inside-checkpoint", "marker-after-checkpoint"):
        step_text, _, marker = rest.partition(":")
        _plant(kind, int(step_text), Path(marker) if marker else None)
    else:
        raise SystemExit(f"crashpoint.py: unknown KILL_AT {argv[0]!r}")
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
