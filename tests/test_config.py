"""Config: shipped recipes load, strict keys with suggestions, typed and range-checked values, merge order."""

import re
from pathlib import Path

import pytest

from fp8train.training.config import (
    DEFAULT_EXCLUDE, FullConfig, ModelConfig, config_hash, config_to_yaml, fp8_recipe_from_config,
    layer_policy_from_config, load_config,
)

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
SHIPPED = ["cpu_bf16", "cpu_delayed", "cpu_current", "cpu_rowwise", "cpu_block", "cpu_validate", "gpu_125m", "gpu_1b"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_recipe_loads(name):
    cfg = load_config(str(RECIPES / f"{name}.yaml"))
    assert isinstance(cfg, FullConfig)
    assert cfg.run.name
    if name.startswith("cpu_") and name not in ("cpu_bf16", "cpu_validate"):
        assert cfg.fp8.recipe == name[4:]


def test_every_yaml_in_recipes_loads():
    paths = sorted(RECIPES.glob("*.yaml"))
    assert {p.stem for p in paths} >= set(SHIPPED)
    for p in paths:
        load_config(str(p))


def test_cpu_recipes_convert_every_block_linear():
    """CPU sizes: every block linear is FP8-eligible (multiples of 16, >= policy.min_features)."""
    for name in SHIPPED:
        if not name.startswith("cpu_"):
            continue
        cfg = load_config(str(RECIPES / f"{name}.yaml"))
        m, p = cfg.model, cfg.policy
        dims = [m.d_model, m.kv_heads() * m.d_model // m.n_heads, m.ffn_dim()]
        assert all(d % p.divisible_by == 0 and d >= p.min_features for d in dims), (name, dims)


def test_cpu_validate_job():
    cfg = load_config(str(RECIPES / "cpu_validate.yaml"))
    assert cfg.validate.candidates == ["delayed", "current", "rowwise", "block"]
    assert cfg.validate.seeds >= 2 and cfg.validate.margin > 0
    assert cfg.fp8.recipe == "none"


def test_defaults():
    cfg = load_config(None)
    assert cfg == FullConfig()
    # log.wandb "" = WANDB_MODE if set, else offline (tests/test_trackers_env.py runs both)
    assert cfg.log.wandb == "" and cfg.model.vocab_size == 256 and cfg.validate.seeds == 4
    assert cfg.train.resume is False and cfg.data.path == ""


def test_merge_order_overrides_beat_yaml_beat_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1.0e-3\n  max_steps: 7\nmodel:\n  d_model: 64\n")
    cfg = load_config(str(path), ["train.lr=5e-4", "fp8.recipe=block", "validate.candidates=[rowwise,block]"])
    assert cfg.train.lr == 5e-4  # override beats YAML
    assert cfg.train.max_steps == 7  # YAML beats default
    assert cfg.model.d_model == 64
    assert cfg.train.batch_size == FullConfig().train.batch_size  # default kept
    assert cfg.fp8.recipe == "block" and cfg.validate.candidates == ["rowwise", "block"]


def test_resolved_yaml_round_trips(tmp_path):
    cfg = load_config(str(RECIPES / "cpu_block.yaml"), ["fp8.input_block=[1,32]", "fp8.margin=1"])
    path = tmp_path / "config.yaml"
    path.write_text(config_to_yaml(cfg))
    again = load_config(str(path))
    assert again == cfg
    assert again.fp8.input_block == [1, 32]
    assert config_hash(again) == config_hash(cfg)


def test_config_hash_tracks_what_is_trained():
    base = load_config(None)
    assert config_hash(base) == config_hash(load_config(None, ["run.name=other", "train.resume=true"]))
    assert config_hash(base) == config_hash(load_config(None, ["log.wandb=disabled", "checkpoint.every=5"]))
    assert config_hash(base) != config_hash(load_config(None, ["fp8.recipe=block"]))
    assert config_hash(base) != config_hash(load_config(None, ["train.seed=1"]))
    assert config_hash(base, exclude=()) != config_hash(load_config(None, ["run.name=x"]), exclude=())
    assert re.fullmatch(r"[0-9a-f]{64}", config_hash(base))


# ---- strict keys ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, path, suggestion",
    [
        ("train.lrr=1", "train.lrr", "lr"),
        ("model.d_modle=64", "model.d_modle", "d_model"),
        ("modle.d_model=64", "modle", "model"),
        ("lr=1", "lr", "train.lr"),
        ("fp8.recipie=block", "fp8.recipie", "recipe"),
        ("validate.candidate=[block]", "validate.candidate", "candidates"),
    ],
)
def test_unknown_override_key_names_path_and_suggests(override, path, suggestion):
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert f"'{path}'" in msg and f"'{suggestion}'" in msg


def test_unknown_yaml_keys_nested_and_top_level(tmp_path):
    nested = tmp_path / "nested.yaml"
    nested.write_text("train:\n  batch_szie: 8\n")
    with pytest.raises(ValueError, match=r"'train\.batch_szie'.*'batch_size'"):
        load_config(str(nested))
    top = tmp_path / "top.yaml"
    top.write_text("trian:\n  lr: 0.1\n")
    with pytest.raises(ValueError, match=r"'trian'.*'train'"):
        load_config(str(top))


# ---- types and values -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, key",
    [
        ("train.lr=abc", "train.lr"),
        ("train.lr=-1e-3", "train.lr"),
        ("train.lr=0", "train.lr"),
        ("train.lr=null", "train.lr"),
        ("train.max_steps=0", "train.max_steps"),
        ("train.max_steps=1.5", "train.max_steps"),
        ("train.batch_size=-4", "train.batch_size"),
        ("train.grad_accum=4 train.batch_size=10", "train.batch_size"),
        ("train.resume=maybe", "train.resume"),
        ("train.device=tpu", "train.device"),
        ("train.autocast=fp16", "train.autocast"),
        ("train.grad_clip=-1", "train.grad_clip"),
        ("model.n_heads=8 model.d_model=100", "model.d_model"),
        ("model.d_model=64 model.n_heads=64", "model.n_heads"),  # head_dim 1: RoPE needs channel pairs
        ("model.seq_len=1", "model.seq_len"),
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("model.n_layers=0", "model.n_layers"),
        ("model.vocab_size=1", "model.vocab_size"),
        ("model.d_model=[1]", "model.d_model"),
        ("fp8.recipe=fp4", "fp8.recipe"),
        ("fp8.backend=cudnn", "fp8.backend"),
        ("fp8.margin=-1", "fp8.margin"),
        ("fp8.input_format=e3m4", "fp8.input_format"),
        ("fp8.amax_compute_algo=mean", "fp8.amax_compute_algo"),
        ("fp8.amax_history_len=0", "fp8.amax_history_len"),
        ("fp8.weight_block=[128]", "fp8.weight_block"),
        ("fp8.weight_block=[0,128]", "fp8.weight_block"),
        ("log.wandb=maybe", "log.wandb"),
        ("log.every=0", "log.every"),
        ("validate.candidates=[]", "validate.candidates"),
        ("validate.candidates=[none]", "validate.candidates"),
        ("validate.candidates=[delayed,fp4]", "validate.candidates"),
        ("validate.candidates=[block,block]", "validate.candidates"),
        ("validate.margin=-0.1", "validate.margin"),
        ("validate.seeds=0", "validate.seeds"),
        ("validate.seeds=[3,3]", "validate.seeds"),
        ("validate.workers=0", "validate.workers"),
        ("validate.final_window=0", "validate.final_window"),
        ("validate.divergence_factor=1.0", "validate.divergence_factor"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("optim.betas=[0.9,1.5]", "optim.betas"),
        ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
        ("optim.eps=0", "optim.eps"),
        ("data.val_fraction=0", "data.val_fraction"),
        ("policy.exclude=['(unclosed']", "policy.exclude"),
        ("policy.divisible_by=0", "policy.divisible_by"),
        ("checkpoint.every=-1", "checkpoint.every"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ValueError) as e:
        load_config(None, overrides.split(" "))
    assert key in str(e.value)


def test_value_error_mentions_value_and_allowed():
    with pytest.raises(ValueError, match=r"fp8\.recipe='fp4'.*none.*delayed.*current.*rowwise.*block"):
        load_config(None, ["fp8.recipe=fp4"])
    with pytest.raises(ValueError, match=r"log\.wandb='maybe'.*disabled.*offline.*online"):
        load_config(None, ["log.wandb=maybe"])
    with pytest.raises(ValueError, match=r"train\.lr.*abc"):
        load_config(None, ["train.lr=abc"])


def test_head_dim_must_be_even_and_divide():
    with pytest.raises(ValueError, match="even"):
        ModelConfig(d_model=36, n_heads=12)  # head_dim 3
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=100, n_heads=8)
    assert ModelConfig(d_model=128, n_heads=4, n_kv_heads=0).kv_heads() == 4


def test_ffn_auto_size_is_a_multiple_of_16():
    for d in (64, 96, 128, 768, 2048):
        f = ModelConfig(d_model=d, n_heads=4).ffn_dim()
        assert f % 16 == 0 and 8 * d / 3 <= f < 8 * d / 3 + 16


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml"):
        load_config(str(bad))
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(str(listy))
    empty = tmp_path / "empty.yaml"
    for nothing in ("", "\n# settings to come\n"):  # a truncated or wrong file: refused, never every default
        empty.write_text(nothing)
        with pytest.raises(ValueError, match=r"empty.yaml' is empty.*\{\}"):
            load_config(str(empty))
    empty.write_text("{}\n")  # every default, on purpose
    assert load_config(str(empty)) == FullConfig()
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["train.lr"])
    with pytest.raises(ValueError, match="mapping"):
        load_config(None, ["train=3"])


# ---- policy and recipe objects ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, excluded",
    [
        ("embed", True), ("hf.model.embed_tokens", True), ("lm_head", True), ("hf.lm_head", True),
        ("output", True), ("layers.0.block_sparse_moe.gate", True), ("model.layers.3.mlp.router", True),
        ("layers.0.mlp.gate_proj", False), ("layers.0.mlp.up_proj", False), ("layers.0.attn.q_proj", False),
        ("layers.2.attn.o_proj", False), ("hf.model.layers.0.self_attn.k_proj", False), ("gated_head_proj", False),
    ],
)
@pytest.mark.parametrize("match", [re.search, re.fullmatch, re.match])
def test_default_exclude_patterns(name, excluded, match):
    assert any(match(p, name) for p in DEFAULT_EXCLUDE) == excluded


def test_fp8_recipe_none_needs_no_fp8_stack():
    assert fp8_recipe_from_config(load_config(None, ["fp8.recipe=none"])) is None


def test_fp8_recipe_from_config_applies_overrides():
    cfg = load_config(None, ["fp8.recipe=delayed", "fp8.margin=1", "fp8.amax_history_len=16", "fp8.backend=emulated"])
    r = fp8_recipe_from_config(cfg)
    assert (r.scaling, r.margin, r.amax_history_len, r.backend) == ("delayed", 1, 16, "emulated")
    cfg = load_config(None, ["fp8.recipe=block", "fp8.input_block=[1,32]"])
    assert tuple(fp8_recipe_from_config(cfg).input_block) == (1, 32)


def test_layer_policy_from_config():
    cfg = load_config(None, ["policy.min_features=32", "policy.skip_first_blocks=1"])
    policy = layer_policy_from_config(cfg)
    assert policy.min_features == 32 and policy.skip_first_blocks == 1 and policy.divisible_by == 16
    assert list(policy.exclude) == [] and policy.exclude_patterns == DEFAULT_EXCLUDE  # exclude adds to these


def test_empty_override_value_is_the_empty_string():
    assert load_config(None, ["data.path=/x", "data.path="]).data.path == ""
    assert load_config(None, ["fp8.margin=2", "fp8.margin=null"]).fp8.margin is None


class _Blocked(BaseException):
    """Not an Exception: no `except Exception` / `except OSError` in the code under test can turn it into an error."""


def _alarm(signum, frame):
    raise _Blocked("blocked reading the file")


@pytest.mark.parametrize("kind", ["fifo", "oversized", "device"])
@pytest.mark.parametrize("where", ["config file", "policy.overrides_file"])
def test_a_settings_file_that_blocks_or_never_ends_is_refused_unopened(tmp_path, kind, where):
    """A FIFO nobody writes (open blocks forever), a device such as /dev/zero (read never ends: memory fills) or
    a file far larger than any config (a data file given by mistake) is one ValueError naming the path, before
    it is opened. The alarm turns a hang into a failure instead of a stuck test."""
    import os
    import signal

    path = {"fifo": tmp_path / "settings.yaml", "oversized": tmp_path / "big.yaml", "device": Path("/dev/zero")}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(17 << 20)  # sparse: no disk used
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(10)
    try:
        with pytest.raises(ValueError) as caught:
            if where == "config file":
                load_config(str(path))
            else:
                load_config(None, [f"policy.overrides_file={path}"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    message = str(caught.value)
    assert str(path) in message and where in message and "\n" not in message
    assert {"fifo": "not a regular file", "device": "not a regular file", "oversized": "MiB"}[kind] in message
