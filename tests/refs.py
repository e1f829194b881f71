"""Shared by the tests: the ml_dtypes and torch dtypes of each FP8 format (independent references), and a small
real-text corpus writer."""

from pathlib import Path

import ml_dtypes
import torch

ALL_FORMATS = ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"]
ML_DTYPES = {
    "e4m3fn": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}
TORCH_DTYPES = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
}


def write_stdlib_corpus(path: Path, n_chars: int = 200_000) -> None:
    """The first ``n_chars`` characters of the standard library sources (the built-in corpus's files, in order)."""
    from fp8train.training.data.corpus import stdlib_files

    _, files = stdlib_files()
    chunks, size = [], 0
    for file in files:
        chunks.append(file.read_text(errors="replace"))
        size += len(chunks[-1])
        if size > n_chars:
            break
    Path(path).write_text("".join(chunks)[:n_chars])
