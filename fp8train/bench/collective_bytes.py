"""Bytes through the real collectives, counted as they run: every c10d and functional collective a process issues
(DDP, FSDP2, DTensor's redistributes, tensor-parallel styles, fp8train's own all-reduces and all-gathers) passes
torch's dispatcher as an op (`c10d.allreduce_`, `_c10d_functional.all_gather_into_tensor`, ...), where a
TorchDispatchMode sees its tensors. Each call is recorded with its buffer's bytes, dtype, whether it ran in
backward, and the innermost module running (torch's ModuleTracker), so a report can say which collective moved
what: nothing is derived from a formula.

Bytes of a call: the whole buffer the collective produces or reduces, as seen by this rank: an all-gather's
gathered output (every rank's part, its own included), a reduce-scatter's input (before the scatter), an
all-reduce's or broadcast's tensor.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.module_tracker import ModuleTracker

__all__ = ["CollectiveCall", "CollectiveBytes"]

# (torch's functional collectives, which DTensor issues, are registered only under this private op namespace)
_c10d, _funcol = torch.ops.c10d, torch.ops._c10d_functional


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _first_dtype(tensors) -> torch.dtype:
    return tensors.dtype if isinstance(tensors, torch.Tensor) else _first_dtype(tensors[0])


# op -> (kind, which argument holds the buffer, a multiplier argument index (group size) or None)
_OPS = {
    _c10d.allreduce_.default: ("all_reduce", 0, None),
    _c10d.broadcast_.default: ("broadcast", 0, None),
    _c10d.allgather_.default: ("all_gather", 0, None),  # output lists
    _c10d._allgather_base_.default: ("all_gather", 0, None),  # output tensor
    _c10d.reduce_scatter_.default: ("reduce_scatter", 1, None),  # input lists
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 1, None),  # input tensor
    _funcol.all_reduce.default: ("all_reduce", 0, None),
    _funcol.all_gather_into_tensor.default: ("all_gather", 0, 1),  # input x group size
    _funcol.reduce_scatter_tensor.default: ("reduce_scatter", 0, None),
}


@dataclass(frozen=True)
class CollectiveCall:
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast
    dtype: str  # the buffer's element type (uint8: fp8train's packed FP8 codes and scales)
    nbytes: int
    backward: bool
    module: str  # the innermost module running (ModuleTracker's fully qualified name), "" outside any


class CollectiveBytes(TorchDispatchMode):
    """`with CollectiveBytes() as counter:` records every collective in `counter.calls`; `by(key)` sums bytes."""

    def __init__(self):
        super().__init__()
        self.calls: list[CollectiveCall] = []
        self._tracker = ModuleTracker()

    def __enter__(self):
        self._tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._tracker.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = _OPS.get(func)
        if known is not None:
            kind, where, times = known
            buffer = args[where]
            scale = 1 if times is None else int(args[times])
            parents = [p for p in self._tracker.parents if p != "Global"]
            module = max(parents, key=lambda p: p.count("."), default="")
            self.calls.append(CollectiveCall(kind, str(_first_dtype(buffer)).removeprefix("torch."),
                                             _nbytes(buffer) * scale, self._tracker.is_bw, module))
        return func(*args, **(kwargs or {}))

    def by(self, key) -> dict:
        """{key(call): summed bytes} over the calls recorded."""
        sums = defaultdict(int)
        for call in self.calls:
            sums[key(call)] += call.nbytes
        return dict(sums)
