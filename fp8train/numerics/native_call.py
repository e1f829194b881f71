"""How fp8train's native ops are called: through torch's dispatcher, or as the plain Python call it would make.

Each native kernel is a torch.library op (native_cast.py, native_gemm.py) so that torch.compile can trace it
(its fake impl), a profiler or a dispatch mode sees it as one op, and a tensor subclass can intercept it. On a
plain eager call none of that happens, yet the dispatcher still boxes every argument into a stack and back into
Python: about 7 us a call (AMD EPYC Zen 4, torch 2.13), a third of the cast of a 1024x64 tensor and more than the
GEMM epilogue of one. `plain_call(*tensors)` says when the op's CPU implementation may be called directly instead: when
the dispatcher would only have called it.
"""

from __future__ import annotations

import torch
import torch.autograd.profiler as autograd_profiler

__all__ = ["plain_call"]


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # (a Parameter has no dispatch or torch-function override)
# torch has no public query for the dispatch-mode stack, the profiler's state or functorch's transforms: the three
# names read here are private (torch 2.11-2.14 have them; a torch without one of them calls every op through the
# dispatcher, as before)
_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)  # (private: see above)
_TRANSFORMS = getattr(torch._C, "_are_functorch_transforms_active", None)  # (private: see above)
_KNOWN = _MODES is not None and _TRANSFORMS is not None and hasattr(autograd_profiler, "_is_profiler_enabled")


def plain_call(*tensors: torch.Tensor | None) -> bool:
    """True when a native op on `tensors` (its tensor arguments; None for one not given) would reach its CPU
    implementation and nothing else: plain tensors (not a FakeTensor, DTensor or other subclass; an nn.Parameter
    is plain), eager (not traced by torch.compile), no torch dispatch mode pushed (FakeTensorMode, a FLOP
    counter), no profiler recording ops by name, no functorch transform (vmap, grad) active."""
    if not _KNOWN or torch.compiler.is_compiling():
        return False
    for t in tensors:  # (a loop, not a generator: asked on every native op)
        if t is not None and type(t) not in _PLAIN_TYPES:
            return False
    profiling = autograd_profiler._is_profiler_enabled  # (private: see the names above)
    return _MODES() == 0 and not profiling and not _TRANSFORMS()
