"""Gradient accumulation in one process: a step of train.grad_accum micro-batches takes the gradient of the whole
global batch, the mean over its rows, not the sum of the micro-batches' means. Adam all but ignores the scale of a
gradient, so losses alone do not show a missing division; the logged gradient norm of the first step (same
weights, same rows) does: it must not depend on how the batch is split."""

from __future__ import annotations

import json

import pytest

from fp8train.training.config import load_config
from fp8train.training.loop import train

pytestmark = pytest.mark.usefixtures("single_thread")


def _first_step(tiny, root, recipe: str, accum: int) -> dict:
    path = tiny.write(root, f"{recipe}{accum}.yaml")
    cfg = load_config(str(path), [f"run.name={recipe}-accum{accum}", f"fp8.recipe={recipe}", f"train.grad_accum={accum}",
                                  "train.max_steps=1", "train.autocast=none", "train.grad_clip=0",
                                  "checkpoint.every=0", "checkpoint.save_final=false"])
    assert train(cfg, show_progress=False)["status"] == "completed"
    records = [json.loads(line) for line in (root / "runs" / cfg.run.name / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if r.get("step") == 1 and "grad_norm" in r)


# fp32 (none): the same sums in another order; current: each micro-batch's grad_output has its own FP8 scale
@pytest.mark.parametrize("recipe, rel", [("none", 1e-5), ("current", 2e-2)])
def test_the_first_step_gradient_does_not_depend_on_how_the_batch_is_split(tiny, tmp_path, recipe, rel):
    whole = _first_step(tiny, tmp_path, recipe, 1)
    for accum in (2, 4):  # batch_size 8: micro-batches of 4 and of 2 rows
        split = _first_step(tiny, tmp_path, recipe, accum)
        assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=rel), (accum, split, whole)
        assert split["loss"] == pytest.approx(whole["loss"], rel=rel)
