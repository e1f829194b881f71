"""Tokenized corpora: a local Hugging Face tokenizer over text, and local `datasets` datasets as documents.

`data.tokenizer` (a folder with tokenizer.json, or the files transformers' AutoTokenizer reads): every document
(a file of `data.path`, a row of `data.hf_dataset`) is encoded on its own, documents are joined with the
tokenizer's EOS token when it has one, and the ids are kept as uint16 when the vocabulary fits (<= 65,536 ids),
else uint32. Encoding happens once: the array is cached under `$XDG_CACHE_HOME/fp8train/tokens/` (default
~/.cache), keyed by a SHA-256 of the tokenizer folder's files and of the documents (names and bytes), so editing
a file or the tokenizer makes a new entry and nothing stale is ever read. Batches stay a pure function of
(train.seed, step): the token array is the same whether it was encoded now or read from the cache.

`data.hf_dataset` (a folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or local .jsonl /
.json / .parquet / .csv files read with `datasets.load_dataset`: fp8train.training.data.data_files): the rows' text
column `data.text_field` are the documents. A DatasetDict with a "validation" (or "test") split uses it as the
validation split and "train" as the training split; a single Dataset is split by row on a hash of the row index,
as folders are split by file. Nothing is downloaded: tokenizers and datasets are read from local folders only.

Which tokenizer (`run_tokenizer`): `data.tokenizer` when set; `data.tokenizer: bytes` means byte-level text on
purpose. Left empty, a fine-tune of pretrained weights (`model.hf_path`) uses the tokenizer saved in that folder
(its vocabulary is the one the weights learned; bytes would feed them ids that mean other tokens), and a
model.hf_path folder without tokenizer files is refused, naming data.tokenizer. Otherwise (fp8train's Decoder, a
`model.hf_config` random init) empty means byte-level text. Pre-tokenized ids (a nanoGPT .bin) need none.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from fp8train.training.storage.rundir import refuse_run_directory_as_hf_folder
from fp8train.training.data.data_files import DATA_FILE_BUILDERS, data_file_docs, is_data_file_spec

__all__ = ["TokenEncoder", "dataset_docs", "UINT16_IDS", "BYTE_TOKENIZER", "TOKENIZER_FILES", "has_tokenizer",
           "run_tokenizer"]

UINT16_IDS = 2**16
BYTE_TOKENIZER = "bytes"  # data.tokenizer value: byte-level text, chosen on purpose
# Any of these makes a folder one that transformers' AutoTokenizer can read.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_VAL_SPLITS = ("validation", "valid", "val", "test")


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fp8train" / "tokens"


def has_tokenizer(folder) -> bool:
    path = Path(os.path.expanduser(str(folder)))
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)


def run_tokenizer(cfg, pretokenized: bool = False) -> str | None:
    """The tokenizer folder the run of ``cfg`` tokenizes its text with, or None for byte-level text (see the
    module docstring). ``pretokenized``: the corpus is already token ids (.bin), so no tokenizer is implied."""
    chosen, pretrained = cfg.data.tokenizer, cfg.model.hf_path
    if chosen == BYTE_TOKENIZER:
        return None
    if chosen:
        return chosen
    if not pretrained or pretokenized:
        return None
    if has_tokenizer(pretrained):
        return pretrained
    refuse_run_directory_as_hf_folder(pretrained, "model.hf_path")  # the wrong kind of folder is said first
    raise ValueError(f"config data.tokenizer is empty and model.hf_path {pretrained!r} holds no tokenizer "
                     f"({' / '.join(TOKENIZER_FILES)}): its pretrained weights would read byte-level ids as "
                     "other tokens. Set data.tokenizer to the model's tokenizer folder, or data.tokenizer=bytes "
                     "to train on raw bytes on purpose")


class TokenEncoder:
    """Documents [(name, bytes)] -> one token array, with the tokenizer of a local folder (cached on disk)."""

    def __init__(self, folder: str):
        path = Path(os.path.expanduser(folder))
        if not path.is_dir():
            raise ValueError(f"data.tokenizer: {folder!r} is not a folder; give a local tokenizer folder (with "
                             "tokenizer.json, as written by tokenizer.save_pretrained)")
        self.tokenizer = _load_tokenizer(path, folder)
        self.vocab_size = len(self.tokenizer)
        self.eos_id = self.tokenizer.eos_token_id
        self.dtype = np.uint16 if self.vocab_size <= UINT16_IDS else np.uint32
        self.fingerprint = _folder_digest(path)
        self.folder = folder

    def check_fits(self, dtype, source: str) -> None:
        """A pre-tokenized corpus of ``dtype`` ids cannot hold this tokenizer's ids: refuse it."""
        limit = int(np.iinfo(dtype).max) + 1
        if self.vocab_size > limit:
            raise ValueError(f"data.tokenizer {self.folder!r} has {self.vocab_size} tokens, more than the "
                             f"{np.dtype(dtype).name} ids of {source} can hold ({limit}); use a tokenizer of at most "
                             f"{limit} tokens, or re-tokenize the text with data.path pointing at the text")

    def __call__(self, docs) -> np.ndarray:
        digest = hashlib.sha256(f"fp8train-tokens-v1:{self.fingerprint}".encode())
        for name, raw in docs:
            digest.update(f"\n{name}\n{hashlib.sha256(raw).hexdigest()}".encode())
        cache = _cache_root() / f"{digest.hexdigest()}.npy"
        if cache.is_file():
            return np.load(cache, mmap_mode="r")
        tokens = self._encode(docs)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.tmp-{os.getpid()}")
        with open(tmp, "wb") as f:  # written aside and renamed: a killed run never leaves half an array
            np.save(f, tokens)
        os.replace(tmp, cache)
        return tokens

    def _encode(self, docs) -> np.ndarray:
        ids: list[int] = []
        for _, raw in docs:
            ids += self.tokenizer(raw.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
            if self.eos_id is not None:
                ids.append(self.eos_id)
        return np.asarray(ids, dtype=self.dtype)


def _load_tokenizer(path: Path, folder: str):
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise ImportError("data.tokenizer needs Hugging Face transformers: pip install transformers  "
                          "(or fp8train[hf])") from err
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"data.tokenizer: {folder!r} is not a readable tokenizer folder: "
                         f"{' '.join(str(err).split())[:200]}") from None


# A tokenizer folder may be a whole model folder (model.hf_path's own tokenizer): its weights are not the
# tokenizer, and hashing gigabytes of them on every run would be slow.
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx", ".index.json")


def _folder_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.name.endswith(_NOT_TOKENIZER)):
        digest.update(f"{file.relative_to(path).as_posix()}\n".encode())
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def dataset_docs(folder: str, text_field: str) -> tuple[list, list | None]:
    """(train docs, validation docs or None) of a `datasets` folder on disk; documents are (row name, utf-8)."""
    try:
        import datasets
    except ImportError as err:
        raise ImportError("data.hf_dataset needs Hugging Face datasets: pip install datasets  (or fp8train[hf])"
                          ) from err
    if is_data_file_spec(folder):  # local .jsonl / .json / .parquet / .csv files (data_files.py)
        return data_file_docs(folder, text_field, _rows), None
    path = Path(os.path.expanduser(folder))
    if not path.is_dir():
        raise ValueError(f"data.hf_dataset: {folder!r} is not a folder; give a dataset written by save_to_disk, or "
                         f"local {' / '.join(DATA_FILE_BUILDERS)} files (a file or a glob)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        kinds = sorted({p.suffix for p in path.iterdir() if p.suffix in DATA_FILE_BUILDERS})
        hint = f" (for its data files give a glob: data.hf_dataset='{folder}/*{kinds[0]}')" if kinds else ""
        raise ValueError(f"data.hf_dataset: {folder!r} is not a dataset saved with save_to_disk{hint}: "
                         f"{' '.join(str(err).split())[:200]}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"data.hf_dataset: {folder!r} has splits {list(loaded)} but no 'train' split")
        val_name = next((name for name in _VAL_SPLITS if name in loaded), None)
        val = _rows(loaded[val_name], text_field, folder, val_name) if val_name else None
        return _rows(loaded["train"], text_field, folder, "train"), val
    return _rows(loaded, text_field, folder, "row"), None


def _rows(dataset, text_field: str, folder: str, split: str) -> list:
    if text_field not in dataset.column_names:
        raise ValueError(f"data.text_field {text_field!r} is not a column of data.hf_dataset {folder!r}; its "
                         f"columns: {', '.join(dataset.column_names)}")
    texts = dataset[text_field]
    if texts and not isinstance(texts[0], str):
        raise ValueError(f"data.text_field {text_field!r} of {folder!r} holds {type(texts[0]).__name__}, not text")
    return [(f"{split}/{i}", text.encode("utf-8")) for i, text in enumerate(texts) if text]
