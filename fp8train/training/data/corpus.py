"""Real text, byte-level tokens, deterministic batches.

Corpora (`data.path`):
- "" (default): the running Python's own standard library .py sources (site-packages and test folders left
  out), read in sorted path order up to `data.max_bytes`. Real, varied text that every machine has; note that
  it differs between Python versions, so compare runs made on the same interpreter.
- a text file: byte-level tokens; the last `val_fraction` of them is the validation split. A .jsonl / .json /
  .parquet / .csv or binary file is refused, naming data.hf_dataset, which reads such files
  (fp8train.training.data.data_files).
- a folder: every non-hidden text file below it (recursive, sorted; files with NUL bytes are skipped as
  binary), up to `data.max_bytes`; if the folder holds a nanoGPT `train.bin`, that is used instead.
- a nanoGPT uint16 `.bin`: token ids from some other tokenizer (model.vocab_size must exceed them all);
  a `val.bin` beside a `train.bin` is the validation split, otherwise the tail of the file.
- `data.hf_dataset`: a local `datasets` dataset or local data files (its `data.text_field` rows are the documents), and
  `data.tokenizer`: a local HF tokenizer instead of bytes (both in fp8train.training.data.tokenized).

Folders and the built-in corpus are split into train and validation BY FILE, on a hash of each file's
relative path (salted with `data.split_seed`): the split does not move when files are added elsewhere, and
no validation text is ever trained on.

Provenance: `TextData.fingerprint` is a content fingerprint of what a run trains and validates on: a sha256
of the train tokens and of the validation tokens (and, for the built-in corpus, of its file list and the Python
version it came from). It goes into the run's config hash, the validation plan and every checkpoint manifest,
so a resume or a re-run validation refuses data that changed under the same `data.path`
(`describe_fingerprint_change` says what changed). Only regular files are read (a device such as /dev/zero
or a FIFO is refused), and never more than `data.max_bytes` of a text file.

`train_batch(step)` is the GLOBAL batch of an optimizer step, a pure function of (train.seed, step): resumed
runs and any number of processes see the same sequences. `val_batches()` is a fixed list that does not depend
on train.seed, so paired runs are evaluated on identical tokens.
"""

from __future__ import annotations

import hashlib
import os
import platform
import stat
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fp8train.training.data.data_files import refuse_dataset_files_in_folder, refuse_non_text
from fp8train.training.data.tokenized import TokenEncoder, dataset_docs, run_tokenizer

__all__ = ["TextData", "build_data", "stdlib_files", "data_fingerprint", "describe_fingerprint_change"]

BYTE_VOCAB = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class TextData:
    """Token streams plus the batching rules. Token arrays are uint8 (bytes) or uint16 (.bin) numpy arrays."""

    train_tokens: np.ndarray
    val_tokens: np.ndarray
    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int
    eval_batches: int
    byte_level: bool = True
    source: str = ""
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    fingerprint: dict = field(default_factory=dict)
    """What the tokens are (see the module docstring): source, token counts and sha256 of each split."""
    _val_cache: list | None = field(default=None, repr=False)

    def _windows(self, tokens: np.ndarray, starts: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]  # (B, T+1)
        chunk = torch.from_numpy(tokens[idx].astype(np.int64))
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # x, y: (B, T)

    def train_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (train.batch_size, seq_len) int64: random windows drawn from a generator seeded by
        hash(seed, step) alone, so the batch of a step never depends on what ran before it."""
        digest = hashlib.sha256(f"fp8train-batch:{self.seed}:{step}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        high = len(self.train_tokens) - self.seq_len  # last valid start + 1 (a window needs T+1 tokens)
        starts = torch.randint(0, high, (self.batch_size,), generator=gen).numpy()
        return self._windows(self.train_tokens, starts)

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """eval_batches fixed batches of windows spread evenly over the validation tokens (no randomness)."""
        if self._val_cache is None:
            n_windows = self.eval_batches * self.batch_size
            last = len(self.val_tokens) - self.seq_len - 1
            starts = np.linspace(0, last, n_windows).round().astype(np.int64)
            self._val_cache = [
                self._windows(self.val_tokens, starts[i * self.batch_size:(i + 1) * self.batch_size])
                for i in range(self.eval_batches)
            ]
        return self._val_cache

    def encode(self, text: str) -> list[int]:
        if not self.byte_level:
            raise ValueError(f"encode: {self.source} holds ids of an external tokenizer; only byte-level text "
                             "corpora can encode strings")
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        if not self.byte_level:
            raise ValueError(f"decode: {self.source} holds ids of an external tokenizer; only byte-level text "
                             "corpora can decode")
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------------
# Corpus readers


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library root and its .py files, sorted, without site-packages and test folders."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _text_files(folder: Path) -> list[Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        files += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _is_val_file(rel: str, val_fraction: float, split_seed: int) -> bool:
    h = hashlib.sha256(f"{split_seed}:{rel}".encode()).digest()
    return int.from_bytes(h[:8], "little") / 2**64 < val_fraction


def _regular_file(path: Path, source: str) -> None:
    """Refuse anything but a regular file: /dev/zero or a FIFO would be read without end."""
    try:
        mode = path.stat().st_mode
    except OSError as err:  # a dangling link in a data folder, a file removed meanwhile, no permission
        what = f"a symbolic link to {os.readlink(path)}, which does not exist" if path.is_symlink() and \
            not path.exists() else err.strerror
        raise ValueError(f"{source}: {path} cannot be read ({what}); remove it or choose other data") from None
    if not stat.S_ISREG(mode):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise ValueError(f"{source}: {path} is {kind}; data.path must be a regular text file, a folder or a .bin")


def _read_head(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of `path` (0 = all): a capped corpus never reads a huge file whole."""
    with open(path, "rb") as f:
        return f.read(limit) if limit else f.read()


def _read_files(root: Path, files: list[Path], max_bytes: int, check_binary: bool, source: str = "data.path"):
    """Read regular files in order up to max_bytes; returns [(relative path, bytes)]."""
    out, total = [], 0
    for path in files:
        _regular_file(path, source)
        raw = _read_head(path, max_bytes + 1 if max_bytes else 0)
        if not raw or (check_binary and b"\x00" in raw[:8192]):
            continue
        if max_bytes and total + len(raw) > max_bytes:
            if total:
                break
            raw = raw[:max_bytes]  # a single huge first file: take its head
        out.append((path.relative_to(root).as_posix(), raw))
        total += len(raw)
    return out


def _split_by_file(docs, val_fraction: float, split_seed: int):
    train = [(r, b) for r, b in docs if not _is_val_file(r, val_fraction, split_seed)]
    val = [(r, b) for r, b in docs if _is_val_file(r, val_fraction, split_seed)]
    return train, val


def _join(docs) -> np.ndarray:
    return np.frombuffer(b"".join(b for _, b in docs), dtype=np.uint8)


def _tail_split(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    n_val = max(int(len(tokens) * val_fraction), seq_len + 1)
    return tokens[:-n_val], tokens[-n_val:]


def _uint16_memmap(path: Path, source: str) -> np.ndarray:
    _regular_file(path, source)
    size = path.stat().st_size
    if size % 2:
        raise ValueError(f"{source}: {path} is {size} bytes, an odd number, so it is not an array of uint16 token "
                         "ids (nanoGPT .bin); is it truncated, or a text file named .bin?")
    return np.memmap(path, dtype=np.uint16, mode="r")


def _load_bin(path: Path, vocab_size: int, val_fraction: float, seq_len: int, source: str):
    tokens = _uint16_memmap(path, source)
    val_path = path.with_name("val.bin")
    if path.name == "train.bin" and val_path.exists():
        val = _uint16_memmap(val_path, source)
        train = tokens
    else:
        train, val = _tail_split(tokens, val_fraction, seq_len)
    for name, arr in ((str(path), tokens), (str(val_path), val)):
        top = int(arr.max()) if len(arr) else 0
        if top >= vocab_size:
            raise ValueError(f"data.path {name}: token id {top} >= model.vocab_size {vocab_size}; set "
                             f"model.vocab_size above the largest id (e.g. {top + 1}, or 50304 for GPT-2 ids)")
    return train, val


def is_pretokenized(d) -> bool:
    """True when data section ``d`` reads token ids (a nanoGPT .bin), not text."""
    path = Path(os.path.expanduser(d.path)) if d.path and not d.hf_dataset else None
    return path is not None and (path.suffix == ".bin" or (path.is_dir() and (path / "train.bin").exists()))


def build_data(cfg) -> TextData:
    """The corpus of `cfg.data` batched per `cfg.train` and `cfg.model` (see the module docstring)."""
    d, T = cfg.data, cfg.model.seq_len
    # Byte-level text, or a local HF tokenizer's ids (fp8train.training.data.tokenized; cached on disk): a
    # pretrained model's own tokenizer unless data.tokenizer says otherwise, never bytes by default under its weights.
    tokenizer = run_tokenizer(cfg, pretokenized=is_pretokenized(d))
    encoder = TokenEncoder(tokenizer) if tokenizer else None
    encode = encoder or _join
    byte_level, train_files, val_files, presplit, tokens = encoder is None, [], [], None, None
    if d.hf_dataset:
        source = f"data.hf_dataset {d.hf_dataset!r}"
        docs, val_docs = dataset_docs(d.hf_dataset, d.text_field)
        presplit = (docs, val_docs) if val_docs else None
    elif not d.path:
        root, files = stdlib_files()
        source = f"built-in corpus (Python stdlib at {root})"
        docs = _read_files(root, files, d.max_bytes, check_binary=False, source=source)
    else:
        source, docs, tokens, byte_level = _read_path(cfg, encoder, encode)
    if docs is not None:
        train_docs, val_docs = presplit or _split_by_file(docs, d.val_fraction, d.split_seed)
        tokens = encode(train_docs), encode(val_docs)
        if len(tokens[0]) <= T or len(tokens[1]) <= T:  # too few files for a by-file split: fall back to the tail
            tokens = _tail_split(encode(docs), d.val_fraction, T)
        else:
            train_files, val_files = [r for r, _ in train_docs], [r for r, _ in val_docs]
    train, val = tokens
    if byte_level and cfg.model.vocab_size < BYTE_VOCAB:
        raise ValueError(f"model.vocab_size {cfg.model.vocab_size} is too small for byte-level text from {source}: "
                         f"needs >= {BYTE_VOCAB}")
    if len(train) <= T or len(val) <= T:
        raise ValueError(f"{source} is too short: {len(train)} train and {len(val)} validation tokens, but each "
                         f"split needs at least model.seq_len + 1 = {T + 1}")
    fingerprint = data_fingerprint(train, val, builtin=not (d.path or d.hf_dataset), train_files=train_files,
                                   val_files=val_files)
    return TextData(
        train_tokens=train, val_tokens=val,
        vocab_size=encoder.vocab_size if encoder else cfg.model.vocab_size if not byte_level else BYTE_VOCAB,
        seq_len=T, batch_size=cfg.train.batch_size, seed=cfg.train.seed, eval_batches=cfg.train.eval_batches,
        byte_level=byte_level, source=source, train_files=train_files, val_files=val_files, fingerprint=fingerprint,
    )


def _read_path(cfg, encoder, encode) -> tuple[str, list | None, tuple | None, bool]:
    """`data.path`: a .bin of token ids, a folder of text files, or one text file. Returns (source, documents to
    split by file, or None; (train, val) tokens when already split, or None; byte_level)."""
    d, T = cfg.data, cfg.model.seq_len
    path = Path(os.path.expanduser(d.path))
    source = f"data.path {d.path!r}"
    if not path.exists():
        raise ValueError(f"{source} does not exist; give a text file, a folder of text files or a .bin "
                         "(empty string = built-in corpus)")
    if path.is_dir() and (path / "train.bin").exists():
        path = path / "train.bin"
    if path.suffix == ".bin":
        if path.stat().st_size < 2:
            raise ValueError(f"{source} is empty; a .bin needs uint16 token ids")
        if encoder is not None:
            encoder.check_fits(np.uint16, source)
        return source, None, _load_bin(path, cfg.model.vocab_size, d.val_fraction, T, source), False
    if path.is_dir():
        files = _text_files(path)
        refuse_dataset_files_in_folder(path, files, source)
        docs = _read_files(path, files, d.max_bytes, check_binary=True, source=source)
        if not docs:
            raise ValueError(f"{source} is a folder with no non-empty text files")
        return source, docs, None, encoder is None
    docs = _read_files(path.parent, [path], d.max_bytes, check_binary=False, source=source)
    if docs:
        refuse_non_text(path, docs[0][1], source)
    if not docs:
        raise ValueError(f"{source} is an empty file")
    return source, None, _tail_split(encode(docs), d.val_fraction, T), encoder is None


# ---------------------------------------------------------------------------------------------------------
# Provenance


def _sha256_tokens(tokens: np.ndarray) -> str:
    digest = hashlib.sha256(str(tokens.dtype).encode())
    step = 1 << 24  # hash in 16M-token slices: a memmapped .bin is never copied into memory whole
    for start in range(0, len(tokens), step):
        digest.update(np.ascontiguousarray(tokens[start:start + step]).tobytes())
    return digest.hexdigest()


def data_fingerprint(train: np.ndarray, val: np.ndarray, builtin: bool = False, train_files=(), val_files=()) -> dict:
    """The content fingerprint of a corpus split (see the module docstring): what the tokens are, not where they
    came from (data.path is in the config already). Plain JSON values only."""
    fingerprint = {
        "train_tokens": int(len(train)), "train_sha256": _sha256_tokens(train),
        "val_tokens": int(len(val)), "val_sha256": _sha256_tokens(val),
    }
    if builtin:  # the built-in corpus is this interpreter's standard library: another Python, other text
        files = "\n".join(["train:", *train_files, "val:", *val_files])
        fingerprint["python"] = platform.python_version()
        fingerprint["files_sha256"] = hashlib.sha256(files.encode()).hexdigest()
    return fingerprint


_FINGERPRINT_WORDS = {"train_sha256": "training tokens", "val_sha256": "validation tokens",
                      "train_tokens": "training token count", "val_tokens": "validation token count",
                      "python": "Python version of the built-in corpus",
                      "files_sha256": "file list of the built-in corpus"}


def describe_fingerprint_change(old: dict | None, new: dict, source: str = "the data") -> str | None:
    """None if `old` and `new` fingerprint the same data, else a sentence naming what changed."""
    if not old:
        return None
    changed = [k for k in _FINGERPRINT_WORDS if old.get(k) != new.get(k)]
    if not changed:
        return None
    parts = []
    for key in changed:
        before, after = old.get(key), new.get(key)
        if key.endswith("sha256"):
            before, after = (str(v)[:12] if v else "none" for v in (before, after))
        parts.append(f"{_FINGERPRINT_WORDS[key]} {before} -> {after}")
    return f"{source} changed since this run was made: " + "; ".join(parts)
