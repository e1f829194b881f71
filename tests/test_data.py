"""Data: deterministic (seed, step) batches, by-file splits, folder/.bin/text inputs, clear errors."""

import numpy as np
import pytest
import torch

from fp8train.training.config import load_config
from fp8train.training.data.corpus import build_data, stdlib_files

T = 32


def cfg_for(path="", *extra):
    return load_config(None, [f"data.path={path}", f"model.seq_len={T}", "train.batch_size=4",
                              "train.eval_batches=3", *extra])


@pytest.fixture(scope="module")
def builtin():
    # 2 MB of the stdlib keeps the test fast; the default cap is data.max_bytes
    return build_data(cfg_for("", "data.max_bytes=2000000"))


def test_builtin_corpus_is_stdlib_source(builtin):
    assert builtin.vocab_size == 256 and builtin.byte_level
    assert builtin.train_tokens.dtype == np.uint8
    assert len(builtin.train_tokens) + len(builtin.val_tokens) <= 2_000_000
    text = builtin.decode(builtin.train_tokens[:20000])
    assert "def " in text and "import" in text
    root, files = stdlib_files()
    rels = [f.relative_to(root).as_posix() for f in files]
    assert rels == sorted(rels) and all("site-packages" not in r and "/test/" not in f"/{r}" for r in rels)


def test_batches_are_a_pure_function_of_seed_and_step(builtin):
    again = build_data(cfg_for("", "data.max_bytes=2000000"))
    for step in (0, 1, 57):
        x1, y1 = builtin.train_batch(step)
        x2, y2 = again.train_batch(step)
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    # order of calls does not matter (resume at step 57 sees the same batch)
    assert torch.equal(again.train_batch(57)[0], builtin.train_batch(57)[0])
    assert not torch.equal(builtin.train_batch(0)[0], builtin.train_batch(1)[0])
    other_seed = build_data(cfg_for("", "data.max_bytes=2000000", "train.seed=7"))
    assert not torch.equal(builtin.train_batch(3)[0], other_seed.train_batch(3)[0])


def test_batch_shape_and_shift(builtin):
    x, y = builtin.train_batch(5)
    assert x.shape == y.shape == (4, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < 256 and int(x.min()) >= 0
    # every row is a real window of the train stream (independent check by substring search)
    stream = builtin.train_tokens.tobytes()
    for row in range(4):
        assert bytes(x[row].tolist()) + bytes([int(y[row, -1])]) in stream


def test_val_batches_fixed_and_independent_of_train_seed(builtin):
    val = builtin.val_batches()
    assert len(val) == 3 and all(x.shape == (4, T) for x, _ in val)
    other = build_data(cfg_for("", "data.max_bytes=2000000", "train.seed=99")).val_batches()
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(val, other))
    stream = builtin.val_tokens.tobytes()
    assert all(bytes(x[0].tolist()) in stream for x, _ in val)


def test_builtin_split_is_by_file_and_disjoint(builtin):
    assert builtin.train_files and builtin.val_files
    assert not set(builtin.train_files) & set(builtin.val_files)
    assert 0.01 < len(builtin.val_files) / (len(builtin.train_files) + len(builtin.val_files)) < 0.15


def write_tree(root, n=12):
    for i in range(n):
        sub = root / f"d{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        (sub / f"f{i:02d}.txt").write_text(f"file {i}: " + "the quick brown fox jumps over the lazy dog. " * 20)
    (root / ".hidden").write_text("SECRET" * 100)
    (root / "blob.dat").write_bytes(b"\x00\x01\x02" * 100)


def test_folder_input_split_by_file(tmp_path):
    write_tree(tmp_path)
    data = build_data(cfg_for(str(tmp_path), "data.val_fraction=0.3"))
    files = {f"d{i % 3}/f{i:02d}.txt" for i in range(12)}
    assert set(data.train_files) | set(data.val_files) == files  # hidden and binary files skipped
    assert data.train_files and data.val_files and not set(data.train_files) & set(data.val_files)
    val_text = data.decode(data.val_tokens)
    for name in data.train_files:
        i = int(name[-6:-4])
        assert f"file {i}:" not in val_text
    # split_seed salts the hash: another seed gives another split
    other = build_data(cfg_for(str(tmp_path), "data.val_fraction=0.3", "data.split_seed=5"))
    assert other.val_files != data.val_files or other.train_files != data.train_files


def test_text_file_tail_split(tmp_path):
    path = tmp_path / "a.txt"
    text = "".join(f"line {i} says hello\n" for i in range(400))
    path.write_text(text)
    data = build_data(cfg_for(str(path), "data.val_fraction=0.1"))
    joined = data.train_tokens.tobytes() + data.val_tokens.tobytes()
    assert joined == text.encode() and len(data.val_tokens) == len(text) // 10


def test_unicode_encode_decode_roundtrip(builtin):
    s = "héllo, 世界 — ok"
    ids = builtin.encode(s)
    assert ids == list(s.encode("utf-8")) and builtin.decode(ids) == s
    assert builtin.decode(torch.tensor(ids)) == s


def test_bin_with_val_bin(tmp_path):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 1000, 5000, dtype=np.uint16)
    val = rng.integers(0, 1000, 500, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    for path in (tmp_path / "train.bin", tmp_path):  # the file, or the nanoGPT folder holding it
        data = build_data(cfg_for(str(path), "model.vocab_size=1024"))
        assert data.vocab_size == 1024 and not data.byte_level
        assert np.array_equal(data.train_tokens, train) and np.array_equal(data.val_tokens, val)
    x, y = data.train_batch(0)
    assert x.dtype == torch.int64 and int(x.max()) < 1000
    with pytest.raises(ValueError, match="external tokenizer"):
        data.encode("hi")


def test_bin_without_val_is_tail_split(tmp_path):
    tokens = np.arange(3000, dtype=np.uint16) % 500
    tokens.tofile(tmp_path / "corpus.bin")
    data = build_data(cfg_for(str(tmp_path / "corpus.bin"), "model.vocab_size=512", "data.val_fraction=0.1"))
    assert len(data.val_tokens) == 300
    assert np.array_equal(np.concatenate([data.train_tokens, data.val_tokens]), tokens)


def test_bin_token_ids_must_fit_vocab(tmp_path):
    np.array([1, 2, 3, 70000 % 65536, 300] * 100, dtype=np.uint16).tofile(tmp_path / "train.bin")
    with pytest.raises(ValueError, match=r"data.path.*token id 4464.*model.vocab_size"):
        build_data(cfg_for(str(tmp_path / "train.bin"), "model.vocab_size=256"))


@pytest.mark.parametrize("case", ["missing", "empty_folder", "empty_file", "too_short", "binary_only", "small_vocab"])
def test_bad_inputs_name_data_path(tmp_path, case):
    extra = []
    if case == "missing":
        path = tmp_path / "nope.txt"
    elif case == "empty_folder":
        path = tmp_path / "empty"
        path.mkdir()
    elif case == "empty_file":
        path = tmp_path / "e.txt"
        path.write_text("")
    elif case == "too_short":
        path = tmp_path / "s.txt"
        path.write_text("x" * (T + 5))
    elif case == "binary_only":
        path = tmp_path / "bin"
        path.mkdir()
        (path / "a.dat").write_bytes(b"\x00" * 1000)
    else:
        path = tmp_path / "ok.txt"
        path.write_text("hello world " * 100)
        extra = ["model.vocab_size=100"]
    with pytest.raises(ValueError) as e:
        build_data(cfg_for(str(path), *extra))
    msg = str(e.value)
    assert "data.path" in msg or "model.vocab_size" in msg
    if case == "too_short":
        assert str(T + 1) in msg


def test_fingerprint_hashes_each_split_and_names_a_validation_change(tmp_path):
    """The fingerprint of a train.bin/val.bin pair is sha256 of "uint16" + each split's bytes (hashlib on the
    arrays written here), and a val.bin rewritten at the same size changes only the validation half, which
    describe_fingerprint_change names."""
    import hashlib

    from fp8train.training.data.corpus import describe_fingerprint_change

    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 1000, 5000, dtype=np.uint16), rng.integers(0, 1000, 500, dtype=np.uint16)
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    before = build_data(cfg_for(str(tmp_path), "model.vocab_size=1024")).fingerprint
    assert before == {"train_tokens": 5000, "train_sha256": hashlib.sha256(b"uint16" + train.tobytes()).hexdigest(),
                      "val_tokens": 500, "val_sha256": hashlib.sha256(b"uint16" + val.tobytes()).hexdigest()}
    val[::-1].tofile(tmp_path / "val.bin")  # the same tokens in another order
    after = build_data(cfg_for(str(tmp_path), "model.vocab_size=1024")).fingerprint
    assert after["val_sha256"] == hashlib.sha256(b"uint16" + val[::-1].tobytes()).hexdigest()
    assert {k for k in before if before[k] != after[k]} == {"val_sha256"}
    assert describe_fingerprint_change(before, after, "corpus X") == (
        f"corpus X changed since this run was made: validation tokens {before['val_sha256'][:12]} -> "
        f"{after['val_sha256'][:12]}")
    shorter = dict(before, val_tokens=499)
    assert describe_fingerprint_change(before, shorter) == \
        "the data changed since this run was made: validation token count 500 -> 499"
    assert describe_fingerprint_change(before, dict(before)) is None
