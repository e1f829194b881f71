"""The Hugging Face user's round trip with nothing silently wrong: the pretrained folder's own tokenizer (or a
refusal), policy.exclude adding to the defaults and matching the names users see, HF's own save_pretrained of a
converted GPT-2 in Conv1D's layout, folders holding scaling buffers accepted by model.hf_path, the dense export,
delayed scaling under a real transformers.Trainer, and the FP8 export read by compressed-tensors itself. Tiny
models built from local configs; nothing is downloaded."""

from __future__ import annotations

import json
import shutil
import warnings

import numpy as np
import pytest
import torch

from fp8train.training.config import load_config
from fp8train.training.data import build_data
from hf_helpers import VOCAB, hf_config, local_text, make_pretrained, make_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("round_trip")
    make_tokenizer(root / "tokenizer")
    out = {"root": root, "tokenizer": root / "tokenizer"}
    for arch in ("llama", "gpt2"):
        bare = make_pretrained(root / f"{arch}_bare", arch)  # weights and config only, as in tests/test_hf.py
        with_tokenizer = root / f"{arch}_full"
        shutil.copytree(bare, with_tokenizer)
        shutil.copytree(root / "tokenizer", with_tokenizer, dirs_exist_ok=True)
        out[f"{arch}_bare"], out[arch] = bare, with_tokenizer
    (root / "text.txt").write_text(local_text(40_000))
    return out


@pytest.fixture(autouse=True)
def _token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


# ------------------------------------------------------------------------------------------------------------
# 2. The tokenizer of a pretrained folder
# ------------------------------------------------------------------------------------------------------------
def _data(folders, hf_path, *extra):
    return build_data(load_config(None, [f"model.hf_path={hf_path}", "model.seq_len=32",
                                         f"data.path={folders['root'] / 'text.txt'}", *extra]))


def test_pretrained_folder_tokenizer_is_used_when_data_tokenizer_is_empty(folders):
    from transformers import AutoTokenizer

    data = _data(folders, folders["llama"])
    text = (folders["root"] / "text.txt").read_text()
    ids = AutoTokenizer.from_pretrained(str(folders["tokenizer"]))(text, add_special_tokens=False)["input_ids"]
    tokens = np.concatenate([data.train_tokens, data.val_tokens])
    assert not data.byte_level and tokens.tolist() == ids + [0]  # + EOS (id 0, the first special token)


def test_pretrained_folder_without_tokenizer_is_refused_naming_data_tokenizer(folders):
    with pytest.raises(ValueError, match=r"data\.tokenizer is empty and model\.hf_path .* holds no tokenizer.*"
                                         r"data\.tokenizer=bytes"):
        _data(folders, folders["llama_bare"])
    explicit = _data(folders, folders["llama_bare"], f"data.tokenizer={folders['tokenizer']}")
    assert not explicit.byte_level
    raw = _data(folders, folders["llama_bare"], "data.tokenizer=bytes")  # bytes on purpose
    text = (folders["root"] / "text.txt").read_bytes()
    assert raw.byte_level and np.concatenate([raw.train_tokens, raw.val_tokens]).tobytes() == \
        np.frombuffer(text, dtype=np.uint8).astype(raw.train_tokens.dtype).tobytes()


# ------------------------------------------------------------------------------------------------------------
# 5. policy.exclude: adds to the defaults, unmatched patterns refused, names with and without `hf.`
# ------------------------------------------------------------------------------------------------------------
def _converted(folders, *policy):
    from fp8train import convert_to_fp8
    from fp8train.training.config import layer_policy_from_config
    from fp8train.training.model import build_model

    cfg = load_config(None, [f"model.hf_path={folders['llama']}", "model.seq_len=32", "policy.min_features=16",
                             *policy])
    report = convert_to_fp8(build_model(cfg.model), "current", layer_policy_from_config(cfg), dry_run=True)
    return [name for name, _ in report.converted]


def test_policy_exclude_adds_to_the_defaults(folders):
    every = _converted(folders)
    assert "hf.lm_head" not in every and len(every) == 14
    fewer = _converted(folders, r"policy.exclude=[q_proj]")
    assert "hf.lm_head" not in fewer  # the default output-head pattern still applies
    assert sorted(fewer) == sorted(n for n in every if not n.endswith("q_proj"))
    replaced = _converted(folders, "policy.exclude_defaults=false", r"policy.exclude=[q_proj]")
    assert "hf.lm_head" in replaced and not any(n.endswith("q_proj") for n in replaced)


@pytest.mark.parametrize("pattern", [r"^model\.layers\.0\.", r"^hf\.model\.layers\.0\."])
def test_policy_patterns_match_names_with_and_without_the_hf_prefix(folders, pattern):
    kept = _converted(folders, f"policy.exclude=['{pattern}']")
    assert kept and not any(n.startswith("hf.model.layers.0.") for n in kept)
    assert all(n.startswith("hf.model.layers.1.") for n in kept)
    overridden = _converted(folders, f"policy.overrides={{'{pattern}': bf16}}")
    assert overridden == kept


def test_policy_exclude_pattern_matching_nothing_is_refused(folders):
    with pytest.raises(ValueError, match=r"policy\.exclude: 'q_prj' matches no nn\.Linear"):
        _converted(folders, "policy.exclude=[q_prj]")
