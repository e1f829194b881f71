"""fp8train's optimizer step hook (nn/linear.py): importing the package or building layers registers nothing on
torch.optim; the first forward that caches a weight registers it once, and from then on a fused in-place optimizer
step (no tensor._version bump) still makes the next forward re-quantize the weight. Each case runs in a fresh
process, since the hook is process-wide."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fp8train.nn.recipes import RECIPE_NAMES

SCRIPT = """
import torch
from torch.optim.optimizer import _global_optimizer_post_hooks as hooks
import fp8train
from fp8train import Fp8Linear, recipe
layers = [Fp8Linear(64, 64, recipe=recipe(name)) for name in {names!r}]
print("after build", len(hooks))
layer = Fp8Linear(64, 64, recipe=recipe({name!r}))
x = torch.randn(8, 64)
layer(x).sum().backward()
print("after forward", len(hooks))
layer(x).sum().backward()
print("after second forward", len(hooks))
opt = torch.optim.SGD(layer.parameters(), lr=1.0)
before = layer(x).detach().clone()
with torch.no_grad():  # what a fused optimizer does: write in place without bumping weight._version
    layer.weight.data.mul_(-1.0)
print("stale", torch.equal(layer(x).detach(), before))  # no version bump, no step: the cached FP8 weight
opt.zero_grad(set_to_none=True)
opt.step()  # a step with no grads: the weights stay, the hook counts it
print("changed", not torch.equal(layer(x).detach(), before))
"""


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_no_hook_at_import_or_build_one_after_the_first_forward(name):
    code = SCRIPT.format(names=list(RECIPE_NAMES), name=name)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[:3] == ["after build 0", "after forward 1", "after second forward 1"], lines
    assert lines[3:] == ["stale True", "changed True"], lines
