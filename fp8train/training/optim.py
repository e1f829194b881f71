"""AdamW that skips a step decided on the device: the training loop never reads a gradient norm on the host.

The loop (fp8train.training.loop) decides on the device whether a step's update is applied (a non-finite
gradient norm under train.skip_nonfinite_grads, or a run that has diverged) and hands the decision to the
optimizer as torch's GradScaler does: `optimizer.found_inf`, a () float32 tensor on the parameters' device, 1.0
= leave this step out. A step left out changes nothing: no parameter, no moment, no step counter.

- fused (CUDA: one kernel for all parameters): torch's fused AdamW reads `found_inf` itself.
- not fused (CPU): torch's other AdamW paths refuse `found_inf`, and its fused CPU kernel rounds differently
  from the per-parameter loop the CPU runs were made with (measured on torch 2.13: different bits after one
  step with weight decay). So `_masked_step` runs torch's `_single_tensor_adam` op for op (the same kernels on
  the same operands: the same bits), with every host number that depends on the step made a device tensor:
  * the step counter grows by (found_inf == 0);
  * a left-out step's factors are the neutral ones (weight decay x1, beta2 x1, lerp weight 0, step size 0) and
    its gradients are zeroed first (a NaN times 0 is still NaN), so every value is left as it was (a -0.0
    can come back as +0.0: the only difference, and only on a left-out step);
  * the bias corrections are looked up in a table computed on the host exactly as torch computes them
    (1 - beta1 ** step, sqrt(1 - beta2 ** step) in Python floats), indexed by the step counters on the device;
  * the final addcdiv takes its per-parameter step size from a tensor (torch's `_foreach_addcdiv_` overload).

Without `found_inf` (None), `step()` is torch's AdamW unchanged. State and state_dict are torch's AdamW's, so
checkpoints load either way.
"""

from __future__ import annotations

import math

import torch

from fp8train.training.parallel.fsdp2 import local_tensor

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW plus `found_inf` on every device (see the module docstring)."""

    found_inf: torch.Tensor | None = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._step_bound = 0  # no step counter can exceed this: the loaded maximum + step() calls since
        self._tables: dict = {}
        self.register_load_state_dict_post_hook(AdamW._bound_after_load)

    @torch.no_grad()
    def step(self, closure=None):
        self._step_bound += 1
        if self.found_inf is None or all(group["fused"] for group in self.param_groups):
            return super().step(closure)  # torch's own: fused honours found_inf, unfused has none to honour
        if closure is not None:
            raise ValueError("AdamW.step with found_inf takes no closure")
        apply = self.found_inf == 0
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self._masked_step(group, params, apply)
        return None

    def _bound_after_load(self) -> None:
        steps = [float(s["step"]) for s in self.state.values() if "step" in s]  # at load time, not in a step
        self._step_bound = int(max(steps, default=0.0))

    def _masked_step(self, group: dict, params: list, apply: torch.Tensor) -> None:
        _check_masked_group(group)
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        states = [self._state_of(p, apply.device) for p in params]
        steps = [s["step"] for s in states]
        increment = apply.to(steps[0].dtype)
        for step in steps:  # per tensor: the _foreach_add_ overload taking a tensor reads it with .item() on CPU
            step.add_(increment)
        apply_f = apply.to(params[0].grad.dtype)
        bias_correction1, bias_correction2_sqrt = self._bias_corrections(beta1, beta2, steps[0].device)
        index = torch.stack(steps).long()
        step_sizes = torch.full((len(params),), lr, dtype=torch.float64).div_(bias_correction1[index])
        neg_step_sizes = torch.where(apply, step_sizes.neg_(), 0.0)
        bc2_sqrt = bias_correction2_sqrt[index].unbind(0)
        decay = _unless_left_out(apply, 1 - lr * weight_decay, 1.0)
        beta2_factor = _unless_left_out(apply, beta2, 1.0)
        lerp_weight = _unless_left_out(apply, 1 - beta1, 0.0)
        for i, (param, state, bc2) in enumerate(zip(params, states, bc2_sqrt)):
            weight, grad = local_tensor(param), local_tensor(param.grad)
            exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
            # a left-out step's gradients become 0 (NaN/inf first, as 0 x NaN is NaN); an applied step's are finite,
            # so both ops leave them as they are. The gradient is consumed here (zero_grad follows).
            grad.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).mul_(apply_f)
            if weight_decay != 0:
                weight.mul_(decay)
            exp_avg.lerp_(grad, lerp_weight)
            exp_avg_sq.mul_(beta2_factor).addcmul_(grad, grad, value=1 - beta2)
            denom = exp_avg_sq.sqrt().div_(bc2).add_(eps)
            # addcdiv_(exp_avg, denom, value=-step_size) with the value read from a tensor (0 on a left-out step)
            torch._foreach_addcdiv_([weight], [exp_avg], [denom], neg_step_sizes[i:i + 1])

    def _state_of(self, param: torch.Tensor, device: torch.device) -> dict:
        state = self.state[param]
        if not state:  # what torch's _init_group makes for an unfused, non-capturable AdamW
            dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=dtype)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        if state["step"].device != device:
            raise ValueError(f"AdamW with found_inf on {param.device} needs fused=True (torch's fused AdamW); the "
                             "written-out update runs where the step counters live (CPU)")
        return state

    def _bias_corrections(self, beta1: float, beta2: float, device: torch.device):
        """(1 - beta1 ** k, sqrt(1 - beta2 ** k)) for k = 0 .. beyond any step counter, as Python computes them."""
        table = self._tables.get((beta1, beta2))
        if table is None or len(table[0]) <= self._step_bound:
            size = max(1024, 2 * (self._step_bound + 1))
            # k = 0 only ever serves a left-out step whose counter is still 0: 1.0 keeps its (zero) update finite
            table = tuple(torch.tensor([1.0] + values, dtype=torch.float64, device=device) for values in (
                [1 - beta1 ** float(k) for k in range(1, size)],
                [math.sqrt(1 - beta2 ** float(k)) for k in range(1, size)]))
            self._tables[(beta1, beta2)] = table
        return table


def _unless_left_out(apply: torch.Tensor, value: float, neutral: float) -> torch.Tensor:
    """() fp32: `value` (rounded to fp32 as a Python scalar argument is) on an applied step, else `neutral`."""
    return torch.where(apply, value, neutral).float()


def _check_masked_group(group: dict) -> None:
    unsupported = [key for key in ("amsgrad", "maximize", "capturable", "differentiable") if group.get(key)]
    if unsupported or isinstance(group["lr"], torch.Tensor):
        raise ValueError(f"AdamW with found_inf and fused=False supports plain AdamW only; got "
                         f"{unsupported or ['a tensor lr']} (use fused=True)")
