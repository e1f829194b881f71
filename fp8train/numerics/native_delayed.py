"""Delayed scaling's per-quantizer state, read and written by the native kernel (native_cast.c) on the CPU.

- ``share_delayed_cast``: whether one layer's cast of a tensor with its stored scale is another layer's cast too
  (their stored scales have the same bits), recording the amax in the other layer's state if so.
- ``delayed_update``: the update step of nn/delayed_scaling.update_group for a group of quantizers, each reading
  and writing its own buffers in place through pointers. The torch ops of update_group stack ~200 one-value
  buffers into a few tensors and unbind and copy them back, about 0.7 ms a step for the 14 FP8 layers of the
  64-wide CPU recipe on a 2-core AMD EPYC (Zen 4), ~3% of its step; this is one call.
Both read CPU memory the caller owns: no device, no host sync, no dispatcher.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch
from torch.autograd.graph import increment_version

from fp8train.numerics.native_build import library

__all__ = ["share_delayed_cast", "delayed_update"]


def _pointers(tensors: list, dtype: torch.dtype, numel: int) -> Optional[ctypes.Array]:
    """The data pointers of `tensors`, each a plain contiguous CPU tensor of `dtype` with `numel` elements, or
    None when one is not (a DTensor under tensor parallelism, a buffer replaced by another kind): the caller then
    runs the torch ops. (Asked for ~200 tensors a step: one comprehension, `is` for the dtype singletons.)"""
    found = [t.data_ptr() for t in tensors if type(t) is torch.Tensor and t.dtype is dtype and t.is_cpu
             and t.numel() == numel and t.is_contiguous()]
    return (ctypes.c_void_p * len(found))(*found) if len(found) == len(tensors) else None


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


def delayed_update(step_amax: torch.Tensor, state: dict, fmt_max: torch.Tensor, min_normal: torch.Tensor,
                   cap: torch.Tensor, margin: int, most_recent: bool, outlier_factor: float) -> Optional[torch.Tensor]:
    """The update for n quantizers in place (native_cast.c, fp8_delayed_update: update_group's operations, row by
    row): `step_amax` their (n,) all-reduced pending amaxes; `state` maps each of pending_amax, amax_history,
    scale, scale_amax, initialized, stale_scale_steps to their n buffers; `fmt_max`, `min_normal`, `cap` (n,)
    float64 per row (delayed_scaling's per-format constants), `margin` the recipe's. Returns the (n,) new `initialized` flags, or None (nothing written) where a buffer is not a
    plain CPU tensor of its kind."""
    n = step_amax.numel()
    history_len = state["amax_history"][0].numel() if n else 1
    pointers = [_pointers(state[name], dtype, numel) for name, dtype, numel in (
        ("pending_amax", torch.float32, 1), ("amax_history", torch.float32, history_len),
        ("scale", torch.float32, 1), ("scale_amax", torch.float32, 1), ("initialized", torch.bool, 1),
        ("stale_scale_steps", torch.int64, 1))]
    rows = (step_amax, fmt_max, min_normal, cap)
    if any(p is None for p in pointers) or any(not (t.is_cpu and t.is_contiguous()) for t in rows) \
            or step_amax.dtype != torch.float32 or any(t.dtype != torch.float64 for t in rows[1:]):
        return None
    flags = torch.empty(n, dtype=torch.bool)
    rc = library().fp8_delayed_update(n, history_len, step_amax.data_ptr(), *pointers, fmt_max.data_ptr(),
                                      min_normal.data_ptr(), cap.data_ptr(), int(margin), int(most_recent),
                                      float(outlier_factor or 0.0), flags.data_ptr())
    if rc != 0:
        raise RuntimeError(f"internal error: fp8train native delayed update returned {rc}")
    # written in place behind autograd's back: their version counters move as torch's in-place ops move them (a
    # scale saved for a backward and updated before it is then an error, not a silently different gradient)
    increment_version([t for tensors in state.values() for t in tensors])
    return flags
