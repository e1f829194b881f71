"""One Fp8Recipe per run: built where the config is read (the fp8 section's check), and that same object handed to
every part of the run that asks for it (set-up, conversion, fork, plan.json). Counted, not assumed: every call of
Fp8Recipe.__init__ (the factory `recipe()`, `dataclasses.replace`, a direct construction) is seen through
sys.setprofile while a real config is read and a real tiny run trains; nothing in fp8train is patched.
"""

from __future__ import annotations

import sys

import pytest

from fp8train.nn.recipes import Fp8Recipe
from fp8train.training.config import load_config


def _recipes_built(work) -> int:
    init = Fp8Recipe.__init__.__code__
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is init:
            calls.append(frame)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        work()
    finally:
        sys.setprofile(previous)
    return len(calls)


@pytest.mark.parametrize("fp8_recipe", ["delayed", "current", "block"])
def test_reading_the_config_and_training_a_run_build_one_recipe(tiny, tmp_path, fp8_recipe):
    from fp8train.training.loop import train

    path = tiny.write(tmp_path, fp8={"recipe": fp8_recipe}, train={"max_steps": 2, "eval_every": 2},
                      checkpoint={"every": 0}, log={"telemetry_every": 0, "wandb": "disabled", "every": 1})
    load_config(str(path))  # the schema's defaults are built once per process: not this run's recipe
    built = []
    assert _recipes_built(lambda: built.append(load_config(str(path)))) == 1
    cfg = built[0]
    assert cfg.fp8.to_recipe() is cfg.fp8.to_recipe()  # asked again: the same object, nothing rebuilt
    assert _recipes_built(lambda: train(cfg, show_progress=False)) == 0


def test_a_changed_field_builds_the_recipe_it_now_describes(tiny, tmp_path):
    cfg = load_config(str(tiny.write(tmp_path)))
    before = cfg.fp8.to_recipe()
    cfg.fp8.margin = 3
    assert cfg.fp8.to_recipe().margin == 3 and before.margin != 3


def test_a_validation_builds_one_recipe_per_label_not_per_seed(tiny, tmp_path):
    from fp8train.evidence.run_plan import plan_runs

    cfg = load_config(str(tiny.write(tmp_path, validate={"seeds": 4, "candidates": ["current", "rowwise"],
                                                         "final_window": 2})))
    runs = []
    # one per label: bf16 (its fp8 section's default preset, checked all the same), current, rowwise; and for each
    # FP8 label the copy with backend=emulated that converts a meta-device skeleton to check the policy before
    # anything runs (evidence/layer_recipes.check_fp8_conversion). None per seed.
    assert _recipes_built(lambda: runs.extend(plan_runs(cfg))) == 3 + 2
    assert len(runs) == 12
    by_label = {}
    for run in runs:
        by_label.setdefault(run.label, set()).add(id(run.cfg.fp8.to_recipe()))
    assert {label: len(ids) for label, ids in by_label.items()} == {"bf16": 4, "current": 4, "rowwise": 4}
