"""Planning a validation at scale (evidence/run_plan.py): derived run configs are built in memory, so 1000 seeds plan
in seconds; every derived config equals the one the documented rule gives (the base config written to YAML and
loaded with the run's overrides); the same strict checks refuse a bad candidate key; a plan over
validate.max_plan_steps is refused with its size before anything is written."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fp8train.evidence.run_plan import derive_config, fingerprint_runs, plan_runs, validation_plan
from fp8train.training.config import HASH_EXCLUDE, config_hash, config_to_yaml, load_config

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


def _reference(cfg, overrides: list[str], tmp_path: Path):
    """The rule: the base config as YAML, loaded with the run's overrides (load_config reads a file)."""
    path = tmp_path / "base.yaml"
    path.write_text(config_to_yaml(cfg))
    return load_config(str(path), overrides)


def test_a_thousand_seeds_plan_in_seconds_and_every_config_is_the_rule(tmp_path):
    cfg = load_config(str(RECIPES / "cpu_validate.yaml"), [
        f"run.dir={tmp_path}", "validate.seeds=auto", "validate.max_seeds=1000", "validate.max_plan_steps=0",
        "validate.candidates=[current,slow=delayed:fp8.amax_history_len=4]"])
    started = time.monotonic()
    runs = plan_runs(cfg)
    fingerprint_runs(runs)
    plan = validation_plan(cfg, runs)
    took = time.monotonic() - started
    assert len(runs) == 3000 and len(plan["runs"]) == 3000
    assert took < 60, f"planning 1000 seeds took {took:.1f} s"  # ~6 s on 2 loaded Zen 4 cores; was ~20 min
    vdir = tmp_path / "cpu_validate" / "runs"
    every = f"checkpoint.every={max(1, cfg.train.max_steps // 4)}"
    label_overrides = {"bf16": ["fp8.recipe=none"], "current": ["fp8.recipe=current"],
                       "slow": ["fp8.recipe=delayed", "fp8.amax_history_len=4"]}
    by_key = {r.key: r for r in runs}
    for seed in (1337, 1338, 1337 + 517, 1337 + 999):
        for label, extra in label_overrides.items():
            run = by_key[f"{label}/seed{seed}"]
            shown, recipe_name = {"bf16": ("bf16", "none"), "current": ("current", "current"),
                                  "slow": ("slow", "delayed")}[label]
            wandb = [f"log.wandb_name=cpu_validate/{shown}/seed{seed}", "log.wandb_group=cpu_validate",
                     f"log.wandb_job_type={'baseline' if label == 'bf16' else 'candidate'}",
                     f"log.wandb_tags=[recipe:{recipe_name},seed:{seed}]"]
            want = _reference(cfg, ["train.resume=auto", every, f"run.dir={vdir / label}", f"run.name=seed{seed}",
                                    f"train.seed={seed}", *extra, *wandb], tmp_path)
            assert run.cfg == want, (label, seed)
            assert plan["runs"][run.key]["config_hash"] == config_hash(want)
    # runs do not share mutable sections: changing one run's config leaves the others as they were
    by_key["bf16/seed1338"].cfg.train.lr = 123.0
    assert by_key["bf16/seed1339"].cfg.train.lr == cfg.train.lr


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_config_hash_is_sha256_of_the_resolved_config(recipe):
    """The documented rule, written out: sha256 of OmegaConf's resolved mapping without the excluded sections."""
    cfg = load_config(str(RECIPES / recipe))
    container = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    for section in ("run", "log", "checkpoint", "validate"):
        container.pop(section)
    container["train"].pop("resume")
    if container["model"]["n_experts"] == 0:  # a dense model: the MoE fields are not part of it
        for key in ("n_experts", "top_k", "n_shared_experts", "moe_every", "moe_ffn_hidden", "aux_loss_coef"):
            container["model"].pop(key)
    # keys added after runs were made, at the value that means "as before"
    for section, key, default in (("train", "tp_size", 1), ("train", "sequence_parallel", True),
                                  ("policy", "linear_subclasses", [])):
        if container[section][key] == default:
            container[section].pop(key)
    # a key renamed after runs were made is hashed under its old name
    container["policy"]["plan"] = container["policy"].pop("overrides_file")
    assert set(HASH_EXCLUDE) == {"run", "train.resume", "log", "checkpoint", "validate"}
    assert config_hash(cfg) == hashlib.sha256(json.dumps(container, sort_keys=True).encode()).hexdigest()


# The shipped recipes' hashes as the tree before the MoE, tensor-parallel and policy keys computed them: runs made
# then still resume, fork and export (a hash is what a checkpoint and a validation plan are matched by).
HASHES_BEFORE_NEW_KEYS = {
    "cpu_bf16.yaml": "ca090ddc871ee7e3", "cpu_block.yaml": "d7217a6c49255f10", "cpu_current.yaml": "1f2fd7d83b9a39e7",
    "cpu_delayed.yaml": "d5a5c47440eb6d8e", "cpu_gemm_bound.yaml": "202003e4597430ff",
    "cpu_rowwise.yaml": "fc909a3ed2230482", "cpu_validate.yaml": "7a2144ec07ce6bf6", "gpu_125m.yaml": "aeff5ba60ee01719",
    "gpu_1b.yaml": "0ab1cd6f2e39b4db", "hf_tiny.yaml": "3bbf9df2eeb21815"}


@pytest.mark.parametrize("recipe", sorted(HASHES_BEFORE_NEW_KEYS))
def test_shipped_recipes_keep_their_config_hash(recipe):
    assert config_hash(load_config(str(RECIPES / recipe)))[:16] == HASHES_BEFORE_NEW_KEYS[recipe]


@pytest.mark.parametrize("override, said", [("fp8.amax_histroy_len=4", "unknown config key 'fp8.amax_histroy_len'"),
                                            ("train.lr=fast", "train.lr"),
                                            ("fp8.all_gather=yes", "fp8.all_gather='yes' is invalid")])
def test_derived_configs_keep_the_strict_checks(override, said, tmp_path):
    cfg = load_config(None, [f"run.dir={tmp_path}"])
    with pytest.raises(ValueError) as in_memory:
        derive_config(cfg, [override], "'x'")
    with pytest.raises(ValueError) as from_file:
        _reference(cfg, [override], tmp_path)
    assert said in str(in_memory.value) and str(in_memory.value).startswith("validate.candidates: 'x': ")
    assert str(in_memory.value) == f"validate.candidates: 'x': {from_file.value}"


@pytest.mark.slow
def test_a_plan_over_the_bound_is_refused_with_its_size_before_anything_is_written(tmp_path):
    command = [sys.executable, "-m", "fp8train.cli", "validate", "--config", str(RECIPES / "cpu_validate.yaml"),
               f"run.dir={tmp_path}", "validate.seeds=auto", "validate.max_seeds=1000",
               "validate.candidates=[current,delayed]"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr  # a user error, not an internal one
    assert ("the plan is 3000 runs x train.max_steps=200 = 600000 training steps, over "
            "validate.max_plan_steps=500000; if you mean it, set validate.max_plan_steps=600000") in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.parametrize("overrides, said", [
    # a huge max_steps is refused by its size at once (it used to exhaust memory listing evaluation points)
    (["validate.seeds=2", "train.max_steps=1000000000000"],
     "the plan is 10 runs x train.max_steps=1000000000000 = 10000000000000 training steps"),
    # many runs of one step each are within max_plan_steps, but planning them alone would take minutes and GBs
    (["validate.seeds=100000", "train.max_steps=1", "train.eval_every=1", "validate.final_window=1"],
     "the plan is 500000 runs (seeds x (1 + candidates)), over 20000"),
])
def test_plans_too_big_to_plan_are_refused_before_any_run_is_derived(overrides, said, tmp_path):
    cfg = load_config(str(RECIPES / "cpu_validate.yaml"), [f"run.dir={tmp_path}", *overrides])
    started = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(said)):
        plan_runs(cfg)
    assert time.monotonic() - started < 5 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seeds", ["100000001", "100001"])
def test_a_seed_count_over_the_absolute_bound_is_refused_at_config_even_with_no_plan_bound(seeds, tmp_path):
    """validate.max_plan_steps=0 lifts the plan-size bounds, not this one: 1e8 seeds planned silently past 4 GB."""
    started = time.monotonic()
    with pytest.raises(ValueError) as caught:
        load_config(str(RECIPES / "cpu_validate.yaml"), [f"run.dir={tmp_path}", f"validate.seeds={seeds}",
                                                          "validate.max_plan_steps=0"])
    message = str(caught.value)
    assert message.startswith("config validate.seeds=") and "a count in [2, 100000]" in message
    assert f"validate.seeds={seeds} " in message
    assert time.monotonic() - started < 10 and not list(tmp_path.iterdir())
    assert load_config(str(RECIPES / "cpu_validate.yaml"), ["validate.seeds=100000"]).validate.seeds == 100_000


def test_a_seed_list_over_the_absolute_bound_is_refused_with_its_length():
    from fp8train.training.config.validation import ValidateConfig

    with pytest.raises(ValueError, match=r"^config validate.seeds='\[100001 seeds\]' is invalid: .*at most 100000"):
        ValidateConfig(seeds=list(range(100_001)))
    assert len(ValidateConfig(seeds=list(range(100_000))).seeds) == 100_000


def test_a_plan_over_the_planned_runs_bound_says_how_many_runs_it_plans(tmp_path, monkeypatch):
    import fp8train.evidence.run_plan as run_plan

    monkeypatch.setattr(run_plan, "MAX_PLANNED_RUNS", 10)  # the line's threshold, without planning 20000 runs here
    cfg = load_config(str(RECIPES / "cpu_validate.yaml"), [f"run.dir={tmp_path}", "validate.seeds=6",
                                                          "validate.max_plan_steps=0", "validate.candidates=[current]"])
    lines = []
    assert len(plan_runs(cfg, log=lines.append)) == 12
    assert lines == ["[validate] planning 12 runs (6 seeds x 2 labels; validate.max_plan_steps=0): about 1 ms and "
                     "5 kB each, before anything runs"]
    lines.clear()
    plan_runs(load_config(str(RECIPES / "cpu_validate.yaml"), [f"run.dir={tmp_path}", "validate.seeds=5",
                                                               "validate.candidates=[current]"]), log=lines.append)
    assert lines == []  # 10 runs: not over the bound
