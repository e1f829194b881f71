"""Data the way Hugging Face users hold it: local .jsonl / .json / .parquet / .csv files, read through `datasets`.

    data.hf_dataset: train.jsonl              one file
    data.hf_dataset: "shards/*.parquet"       a glob (sorted; every match must be of one kind)

`datasets.load_dataset(<json|parquet|csv>, data_files=...)` reads them as one dataset; its `data.text_field`
column holds the documents, split into train and validation by row on a hash of the row index, as a single
`save_to_disk` dataset is. Its Arrow cache goes under `$XDG_CACHE_HOME/fp8train/datasets/` (default ~/.cache),
beside fp8train's token cache. The run's data fingerprint is of the tokens, so editing a row changes it.

`data.path` is text only: a file of one of these kinds (or any file with NUL bytes in its head: parquet, arrow,
an archive) is refused with one line naming data.hf_dataset, rather than trained on as JSON syntax or as bytes
decoded with replacement characters. A folder of text files holding such dataset files is refused the same way.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

__all__ = ["DATA_FILE_BUILDERS", "is_data_file_spec", "data_file_docs", "refuse_non_text",
           "refuse_dataset_files_in_folder"]

# suffix -> the `datasets` packaged builder that reads it
DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
# Dataset kinds never taken as prose in a data.path folder (a .json there is more often a config file of a code tree).
_FOLDER_DATASET_SUFFIXES = (".jsonl", ".parquet", ".csv", ".arrow")
_GLOB_CHARS = "*?["


def is_data_file_spec(spec: str) -> bool:
    """True when data.hf_dataset names local data files (a file or a glob), not a save_to_disk folder."""
    return any(c in spec for c in _GLOB_CHARS) or Path(os.path.expanduser(spec)).suffix.lower() in DATA_FILE_BUILDERS


def _matched_files(spec: str) -> tuple[list[str], str]:
    files = sorted(p for p in glob.glob(os.path.expanduser(spec), recursive=True) if os.path.isfile(p))
    if not files:
        raise ValueError(f"data.hf_dataset: {spec!r} matches no file; give a .jsonl / .json / .parquet / .csv file, "
                         "a glob of them, or a folder written by save_to_disk")
    builders = [DATA_FILE_BUILDERS.get(Path(f).suffix.lower()) for f in files]
    odd = next((f for f, b in zip(files, builders) if b is None or b != builders[0]), None)
    if odd is not None:
        raise ValueError(f"data.hf_dataset: {spec!r} matches {odd}, not of one kind with {files[0]}; allowed: "
                         f"{', '.join(DATA_FILE_BUILDERS)} files, all read by one builder")
    return files, builders[0]


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return str(Path(base) / "fp8train" / "datasets")


def data_file_docs(spec: str, text_field: str, rows_of) -> list:
    """The documents [(row name, utf-8)] of the data files ``spec`` names; ``rows_of(dataset, text_field, spec,
    split)`` turns a loaded dataset into them (tokenized._rows: the column check lives there once)."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("data.hf_dataset needs Hugging Face datasets: pip install datasets  (or fp8train[hf])"
                          ) from err
    files, builder = _matched_files(spec)
    try:
        loaded = datasets.load_dataset(builder, data_files=files, split="train", cache_dir=_cache_dir())
    except Exception as err:  # noqa: BLE001  pyarrow's and datasets' parse errors share no base class
        raise ValueError(f"data.hf_dataset: {spec!r} could not be read as {builder}: "
                         f"{' '.join(str(err).split())[:200]}") from None
    return rows_of(loaded, text_field, spec, "row")


def refuse_non_text(path: Path, head: bytes, source: str) -> None:
    """Refuse a data.path file that is structured data (by suffix) or binary (NUL bytes in its head)."""
    suffix = path.suffix.lower()
    if suffix in DATA_FILE_BUILDERS or suffix == ".arrow" or b"\x00" in head[:8192]:
        kind = f"a {suffix} data file" if suffix in DATA_FILE_BUILDERS or suffix == ".arrow" else "binary"
        raise ValueError(f"{source}: {path} is {kind}, and data.path reads text only; read its text column with "
                         f"data.hf_dataset={path} (data.text_field names the column)")


def refuse_dataset_files_in_folder(folder: Path, files: list[Path], source: str) -> None:
    """A data.path folder holding dataset files (.jsonl, .parquet, ...) is refused: they are not prose."""
    found = [f for f in files if f.suffix.lower() in _FOLDER_DATASET_SUFFIXES]
    if found:
        raise ValueError(f"{source} holds dataset files ({found[0].relative_to(folder)}"
                         f"{f' and {len(found) - 1} more' if len(found) > 1 else ''}), and data.path reads text "
                         f"only; read them with data.hf_dataset='{folder}/**/*{found[0].suffix}'")
