"""Tokenized corpora: data.tokenizer (a local BPE tokenizer trained here on local text) and data.hf_dataset (local
`datasets` folders): ids against the tokenizer's own encoding, the cache, uint16/uint32, batches as a pure function
of (seed, step), and the refusals (vocab too large for a uint16 .bin, a missing text column)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from fp8train.training.config import load_config
from fp8train.training.data.corpus import build_data
from fp8train.training.data.tokenized import TokenEncoder
from hf_helpers import local_text, make_text_folder, make_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # each test starts with an empty token cache


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_text_folder(tmp_path_factory.mktemp("text") / "docs")


def _cfg(*overrides):
    return load_config(None, ["model.seq_len=32", "train.batch_size=4", "train.eval_batches=2", *overrides])


def _reference_ids(tokenizer_dir, texts) -> np.ndarray:
    """Each document encoded by the `tokenizers` library directly, joined with the EOS id (written from the rule)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    ids = []
    for text in texts:
        ids += tok.encode(text, add_special_tokens=False).ids + [eos]
    return np.asarray(ids)


def test_tokenized_folder_matches_the_tokenizer_and_is_cached(tokenizer_dir, text_dir, tmp_path):
    cfg = _cfg(f"data.path={text_dir}", f"data.tokenizer={tokenizer_dir}", "data.val_fraction=0.25")
    data = build_data(cfg)
    assert data.vocab_size == 300 and not data.byte_level
    assert data.train_tokens.dtype == np.uint16
    assert data.train_files and data.val_files and not set(data.train_files) & set(data.val_files)
    for files, tokens in ((data.train_files, data.train_tokens), (data.val_files, data.val_tokens)):
        expected = _reference_ids(tokenizer_dir, [(text_dir / f).read_text() for f in files])
        np.testing.assert_array_equal(np.asarray(tokens), expected)
    cached = sorted((tmp_path / "cache" / "fp8train" / "tokens").glob("*.npy"))
    assert len(cached) == 2  # train and validation, written once
    again = build_data(cfg)
    np.testing.assert_array_equal(np.asarray(again.train_tokens), np.asarray(data.train_tokens))
    assert sorted((tmp_path / "cache" / "fp8train" / "tokens").glob("*.npy")) == cached  # read, not re-encoded
    x1, y1 = data.train_batch(7)
    x2, y2 = again.train_batch(7)
    assert (x1 == x2).all() and (y1 == y2).all() and int(x1.max()) < 300
    assert not (data.train_batch(8)[0] == x1).all()


def test_editing_a_file_makes_a_new_cache_entry(tokenizer_dir, tmp_path):
    folder = make_text_folder(tmp_path / "docs")
    cfg = _cfg(f"data.path={folder}", f"data.tokenizer={tokenizer_dir}", "data.val_fraction=0.25")
    build_data(cfg)
    (folder / "doc0.txt").write_text((folder / "doc0.txt").read_text() + "\nclass Edited: pass\n")
    build_data(cfg)
    assert len(list((tmp_path / "cache" / "fp8train" / "tokens").glob("*.npy"))) == 3  # one split changed


def _word_level_tokenizer(folder, n_tokens: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(n_tokens - 1)} | {"<unk>": n_tokens - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(str(folder))
    return folder


def test_large_vocab_uses_uint32_and_is_refused_for_a_uint16_bin(tmp_path, capsys):
    from fp8train.cli import main

    big = _word_level_tokenizer(tmp_path / "big", 70_000)
    encoder = TokenEncoder(str(big))
    assert encoder.vocab_size == 70_000 and encoder.dtype == np.uint32
    ids = encoder([("a", b"w1 w69998 w5")])
    assert ids.dtype == np.uint32 and ids.tolist() == [1, 69998, 5]
    corpus = tmp_path / "train.bin"
    np.arange(2000, dtype=np.uint16).tofile(corpus)
    code = main(["train", "--quiet", "recipes/cpu_bf16.yaml", f"run.dir={tmp_path / 'runs'}", f"data.path={corpus}",
                 f"data.tokenizer={big}", "model.vocab_size=70000", "log.wandb=disabled"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "70000 tokens" in err and "uint16" in err
    assert not (tmp_path / "runs").exists()


def _dataset(rows):
    return datasets.Dataset.from_dict({"text": rows, "id": list(range(len(rows)))})


def test_hf_dataset_folder_and_splits(tokenizer_dir, tmp_path):
    text = local_text()
    rows = [text[i:i + 3000] for i in range(0, len(text), 3000)]
    _dataset(rows).save_to_disk(str(tmp_path / "single"))
    data = build_data(_cfg(f"data.hf_dataset={tmp_path / 'single'}", "data.val_fraction=0.2"))
    assert data.byte_level and len(data.val_files) >= 1
    joined = b"".join(rows[int(name.split("/")[1])].encode() for name in data.train_files)
    np.testing.assert_array_equal(np.asarray(data.train_tokens), np.frombuffer(joined, dtype=np.uint8))
    datasets.DatasetDict({"train": _dataset(rows[:-4]), "validation": _dataset(rows[-4:])}).save_to_disk(
        str(tmp_path / "dict"))
    data = build_data(_cfg(f"data.hf_dataset={tmp_path / 'dict'}", f"data.tokenizer={tokenizer_dir}"))
    np.testing.assert_array_equal(np.asarray(data.val_tokens), _reference_ids(tokenizer_dir, rows[-4:]))


def test_hf_dataset_without_the_text_field_exits_2(tmp_path, capsys):
    from fp8train.cli import main

    datasets.Dataset.from_dict({"content": ["some text"] * 50}).save_to_disk(str(tmp_path / "ds"))
    capsys.readouterr()  # datasets' own progress bar while saving
    code = main(["train", "--quiet", "recipes/cpu_bf16.yaml", f"run.dir={tmp_path / 'runs'}",
                 f"data.hf_dataset={tmp_path / 'ds'}", "data.path=", "log.wandb=disabled"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "data.text_field 'text'" in err and "content" in err
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("override, match", [("data.tokenizer={missing}", "data.tokenizer"),
                                             ("data.hf_dataset={missing}", "data.hf_dataset")])
def test_missing_tokenizer_or_dataset_folder(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        build_data(_cfg(override.format(missing=tmp_path / "nope")))
    assert not (tmp_path / "nope").exists()
