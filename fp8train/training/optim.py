"""AdamW that skips a step decided on the device: the training loop never reads a gradient norm on the host.

The loop (fp8train.training.loop) decides on the device whether a step's update is applied (a non-finite
gradient norm under train.skip_nonfinite_grads, or a run that has diverged) and hands the decision to the
optimizer as torch's GradScaler does: `optimizer.found_inf`, a () float32 tensor on the parameters' device, 1.0
= leave this step out. A step left out changes nothing: no parameter, no moment, no step counter.

- fused (CUDA: one kernel for all parameters): torch's fused AdamW reads `found_inf` itself.
- not fused (CPU): torch's other AdamW paths refuse `found_inf`, and its fused CPU kernel rounds differently
  from the per-parameter loop the CPU runs were made with (measured on torch 2.13: different bits after one
  step with weight decay). So the per-parameter update is written out here, op for op as torch's
  `_single_tensor_adam` computes it (the same kernels on the same operands, so the same bits), and applied
  through `torch.where(found_inf == 0, new, old)`. Its bias corrections come from the step counter on the
  device ((), 0-dim ops, so the same libm pow as the host's `beta ** step`), not from the host.

Without `found_inf` (None), `step()` is torch's AdamW unchanged. State and state_dict are torch's AdamW's, so
checkpoints load either way.
"""

from __future__ import annotations

import torch

from fp8train.training.fsdp2 import local_tensor

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW plus `found_inf` on every device (see the module docstring)."""

    found_inf: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        if self.found_inf is None or all(group["fused"] for group in self.param_groups):
            return super().step(closure)  # torch's own: fused honours found_inf, unfused has none to honour
        if closure is not None:
            raise ValueError("AdamW.step with found_inf takes no closure")
        apply = self.found_inf == 0
        for group in self.param_groups:
            _check_masked_group(group)
            for param in group["params"]:
                if param.grad is not None:
                    self._masked_update(param, group, apply)
        return None

    def _masked_update(self, param: torch.Tensor, group: dict, apply: torch.Tensor) -> None:
        state = self.state[param]
        if not state:  # what torch's _init_group makes for an unfused, non-capturable AdamW
            dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=dtype)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        step_t = state["step"]
        if step_t.device != apply.device:
            raise ValueError(f"AdamW with found_inf on {param.device} needs fused=True (torch's fused AdamW); the "
                             "written-out update runs where the step counters live (CPU)")
        weight, grad = local_tensor(param), local_tensor(param.grad)
        exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]

        step_new = step_t + 1
        weight_new = weight.mul(1 - lr * weight_decay) if weight_decay != 0 else weight
        exp_avg_new = torch.lerp(exp_avg, grad, 1 - beta1)
        exp_avg_sq_new = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
        step_f64 = step_new.double()
        bias_correction1 = torch.rsub(torch.pow(beta1, step_f64), 1)
        bias_correction2_sqrt = torch.rsub(torch.pow(beta2, step_f64), 1).sqrt_()
        step_size = torch.full_like(step_f64, lr).div_(bias_correction1)  # lr / bc1, an IEEE division as on the host
        denom = exp_avg_sq_new.sqrt().div_(bias_correction2_sqrt).add_(eps)
        # addcdiv_(exp_avg, denom, value=-step_size) computes weight + (value * exp_avg) / denom in fp32, the value
        # rounded to fp32 first: the same three roundings, in the same order.
        weight_new = weight_new.add(exp_avg_new.mul(step_size.neg().float()).div_(denom))

        for old, new in ((weight, weight_new), (exp_avg, exp_avg_new), (exp_avg_sq, exp_avg_sq_new),
                         (step_t, step_new)):
            old.copy_(torch.where(apply, new, old))


def _check_masked_group(group: dict) -> None:
    unsupported = [key for key in ("amsgrad", "maximize", "capturable", "differentiable") if group.get(key)]
    if unsupported or isinstance(group["lr"], torch.Tensor):
        raise ValueError(f"AdamW with found_inf and fused=False supports plain AdamW only; got "
                         f"{unsupported or ['a tensor lr']} (use fused=True)")
