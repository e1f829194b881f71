"""update_fp8_scales on FP8 experts (nn/delayed_scaling.py, nn/experts_scaling.py): a grouped layer's per-expert
delayed state is updated a buffer at a time, and every expert's history, scale and flags step for step equal a
dense Fp8Linear's fed that expert's tokens (the dense layers updated in the same call, in one group with the
experts or in groups of their own); the update's op count does not grow with the number of experts."""

from __future__ import annotations

import pytest
import torch

from fp8train.bench.harness import count_top_level_ops
from fp8train.nn.experts import Fp8GroupedLinear
from fp8train.nn.linear import Fp8Linear, update_fp8_scales
from fp8train.nn.recipes import recipe

pytestmark = pytest.mark.usefixtures("single_thread")

K, N = 64, 48
BUFFERS = ("amax_history", "scale", "scale_amax", "initialized", "stale_scale_steps", "pending_amax",
           "nonfinite_amax_count")
ROLES = ("input", "weight", "grad_output")


@pytest.mark.parametrize("history_len, other_len", [(4, 4), (4, 2)])  # one group with the dense layers, or two
def test_every_experts_state_equals_its_dense_layers_step_for_step(history_len, other_len):
    torch.manual_seed(0)
    sizes_per_step = [[7, 1, 20, 3], [2, 9, 9, 1], [30, 4, 1, 6]]
    experts = Fp8GroupedLinear(4, K, N, recipe=recipe("delayed", amax_history_len=history_len))
    dense = [Fp8Linear(K, N, bias=False, recipe=recipe("delayed", amax_history_len=history_len))
             for _ in range(4)]
    other = Fp8Linear(K, N, recipe=recipe("delayed", amax_history_len=other_len))  # a dense layer updated too
    with torch.no_grad():
        experts.weight.mul_(torch.tensor([0.5, 1.0, 3.0, 8.0]).view(-1, 1, 1))
        for e, layer in enumerate(dense):
            layer.weight.copy_(experts.weight[e])
    model = torch.nn.ModuleList([other, experts, *dense])
    for step, sizes in enumerate(sizes_per_step):
        x = torch.randn(sum(sizes), K) * (step + 1) * torch.linspace(0.2, 5.0, sum(sizes)).view(-1, 1)
        grad = torch.randn(sum(sizes), N) * 10.0 ** -step
        experts(x, torch.tensor(sizes).cumsum(0).to(torch.int32)).backward(grad)
        other(x).sum().backward()
        for layer, x_e, grad_e in zip(dense, x.split(sizes), grad.split(sizes)):
            layer(x_e).backward(grad_e)
        update_fp8_scales(model)
        s = experts.scaling
        for e, layer in enumerate(dense):
            for role in ROLES:
                for name in BUFFERS:
                    mine, theirs = getattr(s, f"{role}_{name}")[e], getattr(layer, f"{role}_{name}")
                    assert torch.equal(mine, theirs), (step, e, role, name, mine, theirs)
                assert s.experts[e].quantizers[role].initialized_on_host == \
                    layer.quantizers[role].initialized_on_host
        assert bool(s.input_initialized.all()) and float(s.grad_output_scale[3]) > 0
        assert s.scale_generation == step + 1


def _update_ops(num_experts: int) -> int:
    layer = Fp8GroupedLinear(num_experts, K, N, recipe="delayed")
    sizes = [3] * num_experts
    layer(torch.randn(sum(sizes), K), torch.tensor(sizes).cumsum(0).to(torch.int32)).sum().backward()
    update_fp8_scales(layer)  # (the first update reads the host mirror back; the steady state is timed below)
    layer(torch.randn(sum(sizes), K), torch.tensor(sizes).cumsum(0).to(torch.int32)).sum().backward()
    return count_top_level_ops(lambda: update_fp8_scales(layer))


def test_the_update_costs_the_same_ops_for_4_or_32_experts():
    ops = _update_ops(4)
    assert ops == _update_ops(32)
    assert ops <= 90  # (each expert's rows read and written one by one: 117 top-level ops at 4 experts, 333 at 16)
