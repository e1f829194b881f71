"""Data files the way Hugging Face users hold them (issue 43, point 1): data.hf_dataset reads local .jsonl / .json /
.parquet / .csv files and globs through `datasets.load_dataset` (the text column data.text_field), the data
fingerprint follows their content, and data.path, which is text only, refuses them with one line naming
data.hf_dataset. References: the rows as written here, joined as bytes (byte-level text is the bytes)."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from fp8train.training.config import load_config
from fp8train.training.data.corpus import build_data
from hf_helpers import local_text

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _cfg(*overrides):
    return load_config(None, ["model.seq_len=32", "train.batch_size=4", "train.eval_batches=2",
                              "data.val_fraction=0.2", *overrides])


def _rows(n=24, width=1500) -> list[str]:
    text = local_text()
    return [text[i * width:(i + 1) * width] for i in range(n)]


def _write(path, rows, kind):
    table = {"body": rows, "n": list(range(len(rows)))}
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"body": r, "n": i}) + "\n" for i, r in enumerate(rows)))
    else:
        ds = datasets.Dataset.from_dict(table)
        {"json": lambda: ds.to_json(str(path), lines=False), "parquet": lambda: ds.to_parquet(str(path)),
         "csv": lambda: ds.to_csv(str(path), index=False)}[kind]()
    return path


def _expected(rows, names) -> np.ndarray:
    return np.frombuffer(b"".join(rows[int(n.split("/")[1])].encode() for n in names), dtype=np.uint8)


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv"])
def test_hf_dataset_reads_a_local_data_file(tmp_path, kind):
    rows = _rows()
    path = _write(tmp_path / f"data.{kind}", rows, kind)
    data = build_data(_cfg(f"data.hf_dataset={path}", "data.text_field=body"))
    assert data.byte_level and data.train_files and data.val_files
    assert not set(data.train_files) & set(data.val_files)
    np.testing.assert_array_equal(np.asarray(data.train_tokens), _expected(rows, data.train_files))
    np.testing.assert_array_equal(np.asarray(data.val_tokens), _expected(rows, data.val_files))


def test_hf_dataset_glob_reads_every_shard_in_order_and_the_fingerprint_follows_the_content(tmp_path):
    rows = _rows()
    for shard in range(3):
        _write(tmp_path / f"shard{shard}.jsonl", rows[shard * 8:(shard + 1) * 8], "jsonl")
    cfg = _cfg(f"data.hf_dataset={tmp_path}/shard*.jsonl", "data.text_field=body")
    data = build_data(cfg)
    names = data.train_files + data.val_files
    assert sorted(int(n.split("/")[1]) for n in names) == list(range(24))  # rows of all three shards, in order
    np.testing.assert_array_equal(np.asarray(data.train_tokens), _expected(rows, data.train_files))
    edited = rows[:8]
    edited[int(data.train_files[0].split("/")[1])] = "an edited row " * 40
    _write(tmp_path / "shard0.jsonl", edited, "jsonl")
    changed = build_data(cfg).fingerprint
    assert changed["train_sha256"] != data.fingerprint["train_sha256"]
    assert changed["val_sha256"] == data.fingerprint["val_sha256"]


@pytest.mark.parametrize("spec, match", [("nothing*.jsonl", "matches no file"),
                                         ("", r"not a dataset saved with save_to_disk \(for its data files give a "
                                              r"glob: data.hf_dataset='.*/\*.csv'\)"),
                                         ("mixed*", "not of one kind"),
                                         ("mixed.jsonl", "data.text_field 'text' is not a column")])
def test_hf_dataset_file_refusals_name_the_key(tmp_path, spec, match):
    _write(tmp_path / "mixed.jsonl", _rows(4), "jsonl")
    _write(tmp_path / "mixed.csv", _rows(4), "csv")
    with pytest.raises(ValueError, match=match):
        build_data(_cfg(f"data.hf_dataset={tmp_path / spec}"))


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv"])
def test_data_path_refuses_a_data_file_in_one_line_naming_hf_dataset(tmp_path, kind, capsys):
    from fp8train.cli import main

    path = _write(tmp_path / f"data.{kind}", _rows(), kind)
    capsys.readouterr()
    code = main(["train", "--quiet", "recipes/cpu_bf16.yaml", f"run.dir={tmp_path / 'runs'}", f"data.path={path}",
                 "log.wandb=disabled"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"data.hf_dataset={path}" in err and "text only" in err
    assert not (tmp_path / "runs").exists()


def test_data_path_refuses_binary_files_and_folders_of_dataset_files(tmp_path):
    blob = tmp_path / "weights.dat"
    blob.write_bytes(b"header" + bytes(range(256)) * 40)
    with pytest.raises(ValueError, match="is binary, and data.path reads text only.*data.hf_dataset"):
        build_data(_cfg(f"data.path={blob}"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    (folder / "notes.txt").write_text(local_text(20_000))
    _write(folder / "rows.parquet", _rows(), "parquet")
    with pytest.raises(ValueError, match=r"holds dataset files \(rows.parquet\).*data.hf_dataset="):
        build_data(_cfg(f"data.path={folder}"))
    (folder / "rows.parquet").unlink()
    assert build_data(_cfg(f"data.path={folder}")).byte_level  # a folder of text is still read
