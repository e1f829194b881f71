"""The training loop syncs only at its sync points (issue 18, build item 3), and nothing users rely on changed.

- Host syncs are counted at the dispatcher (a TorchDispatchMode sees every `aten._local_scalar_dense` - .item(),
  float(), int(), bool() of a tensor - and the data-dependent-shape ops that sync on CUDA: nonzero,
  masked_select, unique) and in Python (Tensor.tolist / numpy / __array__ read memory without a dispatcher
  op). A step that is not a logging, evaluation, checkpoint, telemetry or last step must count zero, a NaN
  gradient step included; logging steps still read back.
- A run that skips or diverges between sync points reports exactly what it reports when every step is a sync
  point (log.every=1): same message, step, counters, FP8 state digest, divergence telemetry, metrics and final
  weights - the reference is the loop that syncs every step, which decides on the host as it always did.
- The pieces, each against an independent reference: the on-device skip of fp8train.training.optim.AdamW
  against torch's own AdamW that is simply not stepped on a skipped step; clip_grad_norm_tensor against the
  clipping rule written out in numpy float64.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

import fp8train.training.loop as loop_module
from fp8train.training.config import load_config
from fp8train.training.parallel.fsdp2 import clip_grad_norm_tensor
from fp8train.training.models.decoder import build_model
from fp8train.training.optim import AdamW

pytestmark = pytest.mark.usefixtures("single_thread")

HOST_DATA_MODULES = {"corpus.py", "tokenized.py"}  # fp8train.training's host-side batch builders
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive"}
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.seq_len=16", "train.batch_size=4",
         "train.eval_batches=1", "policy.min_features=16", "log.telemetry_every=0", "train.threads=1",
         "data.max_bytes=100000"]


class SyncCounter(TorchDispatchMode):
    """Counts host syncs: dispatcher ops that read a tensor's value on the host, and Python-level reads."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNC_OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def counted(monkeypatch):
    """(counter, per-step counts): the counter is active inside `with counter:`; counts[i] is what step i + 1
    (its optimizer_step and everything the loop does after it, until the next step starts) synced."""
    counter, marks = SyncCounter(), []
    for name in ("tolist", "numpy", "__array__"):
        real = getattr(torch.Tensor, name)

        def reading(self, *args, _real=real, **kwargs):
            # The data pipeline builds batches in host memory by design (a CPU generator's indices, numpy
            # tokens; then copied to the device): its reads are not device syncs on any device.
            if Path(sys._getframe(1).f_code.co_filename).name not in HOST_DATA_MODULES:
                counter.count += 1
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, reading)
    real_step = loop_module.optimizer_step

    def marked(run, state, step):
        marks.append(counter.count)
        return real_step(run, state, step)
    monkeypatch.setattr(loop_module, "optimizer_step", marked)

    def per_step():
        marks.append(counter.count)
        return [b - a for a, b in zip(marks, marks[1:])]
    return counter, per_step


def _poison_gradient_at(forward_number: int, last: int | None = None):
    """A model factory: at the model's `forward_number`-th training forward (through `last`), one element of a
    block's output gradient is NaN (what tests/test_hostile.py injects): that step's gradient norm is NaN, the
    guard skips it."""

    def poison(grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad

    def build(model_cfg):
        model, calls = build_model(model_cfg), {"n": 0}

        def hook(module, args, output):
            if module.training:
                calls["n"] += 1
                if forward_number <= calls["n"] <= (last or forward_number):
                    output.register_hook(poison)
        model.layers[1].mlp.register_forward_hook(hook)
        return model
    return build


def _poison_loss_from(forward_number: int):
    """A model factory: from the `forward_number`-th training forward on, the first block's MLP outputs NaN."""
    def build(model_cfg):
        model, calls = build_model(model_cfg), {"n": 0}

        def hook(module, args, output):
            if module.training:
                calls["n"] += 1
                if calls["n"] >= forward_number:
                    return output * float("nan")
            return None
        model.layers[0].mlp.register_forward_hook(hook)
        return model
    return build


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_only_sync_points_sync(tmp_path, counted, recipe):
    counter, per_step = counted
    build = _poison_gradient_at(2 * 6 - 1)  # step 6's first micro-batch (grad_accum=2): a skipped step
    cfg = load_config(None, [f"run.dir={tmp_path}", "run.name=count", *SMALL, "train.max_steps=8",
                             "train.grad_accum=2", "train.eval_every=0", "log.every=4", "log.wandb=disabled",
                             "checkpoint.save_final=false", f"fp8.recipe={recipe}"])
    with counter:
        summary = loop_module.train(cfg, show_progress=False, model_factory=build)
    counts = per_step()
    assert summary["status"] == "completed" and summary["skipped_steps"] == 1
    # Steps 1-3 and 5-7 are no sync points (the NaN-gradient step 6 among them). Step 1 of a delayed recipe
    # reads its freshly initialized scales once (update_fp8_scales, until every role is initialized).
    first = 1 if recipe == "delayed" else 0
    assert counts[0] <= first and counts[1:3] == [0, 0] and counts[4:7] == [0, 0, 0], counts
    assert counts[3] > 0 and counts[7] > 0, counts  # logging steps 4 and 8 read their losses back
    records = [json.loads(line) for line in (tmp_path / "count" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["skipped_steps"]) for r in records[1:]] == [(4, 0), (8, 1)]


def _run(root: Path, name: str, every: int, *extra: str, model_factory=None) -> tuple[dict, list, str | None]:
    cfg = load_config(None, [f"run.dir={root}", f"run.name={name}", *SMALL, "train.max_steps=10",
                             "train.eval_every=5", "log.wandb=disabled", "checkpoint.every=4",
                             "checkpoint.save_final=true", f"log.every={every}", *extra])
    summary = loop_module.train(cfg, show_progress=False, model_factory=model_factory)
    for key in ("wall_time_s", "cpu_time_s", "peak_memory_mb", "config_hash", "resume_hash", "last_good_checkpoint"):
        summary.pop(key)
    summary = json.loads(json.dumps(summary))  # one NaN object for every NaN (NaN != NaN otherwise)
    run_dir = root / name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        for key in ("tokens_per_s", "step_s", "elapsed_s"):
            r.pop(key, None)
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    digest = None
    if checkpoints:
        h = hashlib.sha256(checkpoints[-1].name.encode())
        for file in ("model.safetensors", "optimizer.safetensors"):
            tensors = load_file(str(checkpoints[-1] / file))
            for key in sorted(tensors):
                h.update(key.encode() + tensors[key].reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        digest = h.hexdigest()
    return summary, records, digest


# (poison, what happens, config). Steps are 1-based; log.every=4 makes steps 1-3, 5-7, 9 no sync points
# (checkpoint.every=4, eval_every=5 add 5; the last step is 10).
CASES = {
    "nan_gradient_skipped": (lambda: _poison_gradient_at(3), "completed", ["fp8.recipe=delayed"]),
    "nan_loss_at_step_6": (lambda: _poison_loss_from(6), "diverged", ["fp8.recipe=delayed"]),
    "nan_gradient_unguarded": (lambda: _poison_gradient_at(7), "diverged",
                               ["fp8.recipe=current", "train.skip_nonfinite_grads=false"]),
    "five_skips_in_a_row": (lambda: _poison_gradient_at(2, 99), "diverged", ["fp8.recipe=none"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deferred_decision_reports_what_the_every_step_sync_reports(tmp_path, case):
    poison, status, extra = CASES[case]
    results = {}
    for every in (1, 4):  # a fresh factory (its forward counter at 0) per run
        results[every] = _run(tmp_path, f"{case}_{every}", every, *extra, model_factory=poison())
    (summary1, records1, final1), (summary4, records4, final4) = results[1], results[4]
    assert summary1["status"] == status and summary4 == summary1
    logged = {r["step"] for r in records4}
    assert records4 == [r for r in records1 if r["step"] in logged] and len(records4) < len(records1)
    assert final4 == final1  # the final checkpoint's weights and AdamW state (None: no final checkpoint)
    if status == "diverged":  # no checkpoint at or after the divergent step, whichever step reported it
        for every in (1, 4):
            saved = [int(p.name[5:]) for p in (tmp_path / f"{case}_{every}" / "checkpoints").glob("step_*")]
            assert all(s < summary1["diverged_at_step"] for s in saved), saved
    if case == "nan_loss_at_step_6":
        assert summary4["reason"] == "loss became nan at step 6" and summary4["steps"] == 5
    if case == "five_skips_in_a_row":
        assert summary4["skipped_steps"] == 4 and "(steps 2-6)" in summary4["reason"]


# ------------------------------------------------------------------------------------------------------------
# The pieces
# ------------------------------------------------------------------------------------------------------------
SHAPES = [(96, 80), (80,), (1000,), (33, 17), (7,), (1,)]


def _adamw_run(masked: bool, skipped: set[int], weight_decay: float):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = (AdamW if masked else torch.optim.AdamW)(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
                                                         foreach=False)
    g = torch.Generator().manual_seed(1)
    for i in range(24):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * (1 + i % 5) / 5  # a schedule, as LambdaLR sets it
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 10.0 ** (i % 7 - 3)
        if i in skipped:
            params[0].grad.view(-1)[3] = float("nan")
        if masked:
            optimizer.found_inf = torch.tensor(1.0 if i in skipped else 0.0)
            optimizer.step()
        elif i not in skipped:  # the reference: torch's AdamW, not stepped at all on a skipped step
            optimizer.step()
    return params, optimizer


@pytest.mark.parametrize("skipped", [set(), {0, 4, 5, 17}])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_found_inf_matches_torch_adamw_not_stepped(skipped, weight_decay):
    ref_params, ref = _adamw_run(False, skipped, weight_decay)
    params, optimizer = _adamw_run(True, skipped, weight_decay)
    bits = lambda t: t.detach().view(torch.int32)  # noqa: E731  (bit for bit: -0.0 is not 0.0 here)
    for ref_p, p in zip(ref_params, params):
        assert torch.equal(bits(ref_p), bits(p))
        ref_state, state = ref.state[ref_p], optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(bits(ref_state[key]), bits(state[key])), key
        assert state["step"].item() == 24 - len(skipped)


def test_adamw_without_found_inf_is_torch_adamw():
    ref_params, _ = _adamw_run(False, set(), 0.1)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                       {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                      lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    assert optimizer.found_inf is None and type(optimizer).__mro__[1] is torch.optim.AdamW


@pytest.mark.parametrize("max_norm", [1e-3, 0.5, 1e6])
@pytest.mark.parametrize("poison", [None, float("nan"), float("inf")])
def test_clip_grad_norm_tensor_follows_the_float64_rule(max_norm, poison):
    model = torch.nn.Sequential(torch.nn.Linear(12, 9), torch.nn.Linear(9, 5))
    g = torch.Generator().manual_seed(3)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    if poison is not None:
        model[1].bias.grad[2] = poison
    before = [p.grad.clone().numpy() for p in model.parameters()]
    norm = clip_grad_norm_tensor(model, max_norm)
    # the rule, in numpy: float64 sum of squares, its root rounded to fp32; factor min(1, max / (norm + 1e-6))
    # in float64, rounded to fp32 and applied only to finite norms
    expect_norm = np.float32(math.sqrt(sum(float((b.astype(np.float64) ** 2).sum()) for b in before)))
    assert norm.dtype == torch.float32 and (norm.item() == expect_norm or (np.isnan(expect_norm) and norm.isnan()))
    factor = min(1.0, max_norm / (float(expect_norm) + 1e-6)) if np.isfinite(expect_norm) else 1.0
    for b, p in zip(before, model.parameters()):
        np.testing.assert_array_equal(p.grad.numpy(), b * np.float32(factor) if factor < 1.0 else b)


def test_a_role_whose_amax_stays_zero_reads_its_flags_back_only_at_powers_of_two(monkeypatch):
    """A zero weight (a zero-initialized projection) never gets a usable amax, so its role never initializes;
    the host mirror of the flags is read back on updates 1, 2, 4, 8, ..., not every step, and the forward's
    bits are those of a layer whose mirror is read back every step."""
    from fp8train.nn.linear import Fp8Linear, update_fp8_scales
    torch.manual_seed(0)
    layers = [Fp8Linear(32, 16, recipe="delayed") for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    for layer in layers:
        with torch.no_grad():
            layer.weight.zero_()
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self, *a, **k: reads.append(1) or real_tolist(self, *a, **k))
    synced, outputs = [], {0: [], 1: []}
    for step in range(1, 41):
        x = torch.randn(8, 32)
        for i, layer in enumerate(layers):
            out = layer(x.clone().requires_grad_())
            out.float().sum().backward()
            outputs[i].append(out.detach())
            before = len(reads)
            with SyncCounter() as counter:
                update_fp8_scales(layer)
            if i == 0 and (len(reads) > before or counter.count):
                synced.append(step)
            if i == 1:  # the reference: its mirror forgotten every step, so the forward always falls back
                for quantizer in layer.quantizers.values():
                    quantizer.initialized_on_host = False
    assert synced == [1, 2, 4, 8, 16, 32]
    assert {role: q.initialized_on_host for role, q in layers[0].quantizers.items()} == \
        {"input": True, "weight": False, "grad_output": True}
    assert all(torch.equal(a, b) for a, b in zip(outputs[0], outputs[1]))
