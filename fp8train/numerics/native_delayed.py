"""Delayed scaling's per-quantizer state, read and written by the native kernel (native_cast.c) on the CPU.

- ``share_delayed_cast``: whether one layer's cast of a tensor with its stored scale is another layer's cast too
  (their stored scales have the same bits), recording the amax in the other layer's state if so.
- ``delayed_update``: the update step of nn/delayed_scaling.update_group for a group of quantizers, each reading
  and writing its own buffers in place through pointers (``update_plan``: their arrays, made once and reused).
  The torch ops of update_group stack ~200 one-value buffers into a few tensors and unbind and copy them back,
  about 0.7 ms a step for the 14 FP8 layers of the 64-wide CPU recipe on a 2-core AMD EPYC (Zen 4), ~3% of its
  step; this is one call.
Both read CPU memory the caller owns: no device, no host sync, no dispatcher.
"""

from __future__ import annotations

import ctypes
import operator
from typing import Optional

import torch
from torch.autograd.graph import increment_version

from fp8train.numerics.native_build import library

__all__ = ["share_delayed_cast", "UpdatePlan", "update_plan", "delayed_update"]


def share_delayed_cast(cast_scale: torch.Tensor, cast_amax: torch.Tensor, scale: torch.Tensor,
                       nonfinite_count: torch.Tensor, pending_amax: torch.Tensor | None) -> bool:
    """Whether a delayed-scaling cast made with the stored scale `cast_scale` (its amax `cast_amax`) is the cast
    of the same tensor by a layer whose stored scale is `scale`: the same bits, read in C. If so that layer's
    `nonfinite_count` and `pending_amax` (None: not recorded) record the cast's amax as its own cast would have, in
    the same call. All one-value CPU tensors: fp32, and int64 for the count."""
    for state, dtype in ((cast_scale, torch.float32), (cast_amax, torch.float32), (scale, torch.float32),
                         (nonfinite_count, torch.int64), (pending_amax, torch.float32)):
        if state is not None and (state.dtype != dtype or state.numel() != 1 or not state.is_cpu):
            raise RuntimeError(f"internal error: share_delayed_cast takes one-value {dtype} CPU tensors; got "
                               f"{state.dtype} of shape {tuple(state.shape)} on {state.device}")
    return library().fp8_share_delayed_cast(cast_scale.data_ptr(), scale.data_ptr(), cast_amax.data_ptr(),
                                            nonfinite_count.data_ptr(),
                                            None if pending_amax is None else pending_amax.data_ptr()) == 1


# The C call's order of the per-quantizer buffers, with each one's dtype and element count (None: the history's)
_BUFFER_KINDS = (("pending_amax", torch.float32, 1), ("amax_history", torch.float32, None),
                 ("scale", torch.float32, 1), ("scale_amax", torch.float32, 1), ("initialized", torch.bool, 1),
                 ("stale_scale_steps", torch.int64, 1))


class UpdatePlan:
    """The C call's pointer arrays for one group of quantizers, made once and reused while each buffer is the
    same tensor at the same address (checked on every update: `.to()`, `load_state_dict(assign=True)` and FSDP2
    replace the tensors behind a layer's buffer names). It holds the quantizers and their buffers, as the layers
    do (the caller keeps it with them)."""

    __slots__ = ("quantizers", "buffers", "addresses", "arrays", "history_len")

    def __init__(self, quantizers: list, buffers: list, addresses: list, arrays: tuple, history_len: int):
        self.quantizers, self.buffers, self.addresses = quantizers, buffers, addresses
        self.arrays, self.history_len = arrays, history_len

    def holds(self, quantizers: list, buffers: list) -> bool:
        """Whether this plan is these quantizers' with these buffers (the same objects, at the same addresses)."""
        return len(quantizers) == len(self.quantizers) and all(map(operator.is_, quantizers, self.quantizers)) \
            and all(map(operator.is_, buffers, self.buffers)) and [t.data_ptr() for t in buffers] == self.addresses


def update_plan(quantizers: list, buffers: list, names: tuple,
                previous: Optional[UpdatePlan] = None) -> Optional[UpdatePlan]:
    """The plan for `quantizers` whose `names` buffers are `buffers` (quantizer after quantizer: each one's
    buffers in `names` order): `previous` where it still holds them, else a new one; None where one buffer is not
    a plain contiguous CPU tensor of its dtype and size (a DTensor under tensor parallelism, a buffer replaced by
    another kind): the caller runs the torch ops. `names` holds every name of _BUFFER_KINDS."""
    if not quantizers:
        return None
    if previous is not None and previous.holds(quantizers, buffers):
        return previous
    per = len(names)
    history_len = buffers[names.index("amax_history")].numel()
    arrays = []
    for name, dtype, numel in _BUFFER_KINDS:
        column = buffers[names.index(name)::per]
        numel = history_len if numel is None else numel
        if not all(type(t) is torch.Tensor and t.dtype is dtype and t.is_cpu and t.numel() == numel
                   and t.is_contiguous() for t in column):
            return None
        arrays.append((ctypes.c_void_p * len(column))(*(t.data_ptr() for t in column)))
    return UpdatePlan(list(quantizers), list(buffers), [t.data_ptr() for t in buffers], tuple(arrays), history_len)


def delayed_update(plan: UpdatePlan, step_amax: Optional[torch.Tensor], fmt_max: torch.Tensor,
                   min_normal: torch.Tensor, cap: torch.Tensor, margin: int, most_recent: bool,
                   outlier_factor: float) -> Optional[torch.Tensor]:
    """The update for the plan's n quantizers in place (native_cast.c, fp8_delayed_update: update_group's
    operations, row by row): `step_amax` their (n,) all-reduced pending amaxes, or None (one process: each
    quantizer's own pending amax is its row's); `fmt_max`, `min_normal`, `cap` (n,) float64 per row
    (delayed_scaling's per-format constants), `margin` the recipe's. Returns the (n,) new `initialized` flags, or
    None (nothing written) where a row vector is not a plain contiguous CPU tensor of its dtype."""
    n = len(plan.quantizers)
    rows = (fmt_max, min_normal, cap) if step_amax is None else (step_amax, fmt_max, min_normal, cap)
    if any(not (t.is_cpu and t.is_contiguous() and t.numel() == n) for t in rows) \
            or (step_amax is not None and step_amax.dtype != torch.float32) \
            or any(t.dtype != torch.float64 for t in (fmt_max, min_normal, cap)):
        return None
    flags = torch.empty(n, dtype=torch.bool)
    rc = library().fp8_delayed_update(n, plan.history_len, None if step_amax is None else step_amax.data_ptr(),
                                      *plan.arrays, fmt_max.data_ptr(), min_normal.data_ptr(), cap.data_ptr(),
                                      int(margin), int(most_recent), float(outlier_factor or 0.0), flags.data_ptr())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native delayed update returned {rc}")
    # written in place behind autograd's back: their version counters move as torch's in-place ops move them (a
    # scale saved for a backward and updated before it is then an error, not a silently different gradient)
    increment_version(plan.buffers)
    return flags
