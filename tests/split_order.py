"""One process that sums in tensor parallelism's order (tests/test_tensor_parallel.py's reference; not a test).

tp ranks add the same exact FP8 products as one process, but two GEMMs of each split layer contract the split
dim: a rowwise layer's output (K split) and a colwise layer's grad_input (N split). Rank r computes its part of
the contraction as its own GEMM (its operands contiguous, in its own layout, the scales applied), and the
collective adds the tp partial results in fp32 (for 2 ranks p0 + p1, which addition order cannot change). Inside
`tp_reduction_order(tp)`, fp8train's one-process Fp8Linear does the same for those two GEMMs of the decoder's
projections (o_proj / down_proj: output; q/k/v, gate/up: grad_input), and every other GEMM as before: the tp run
without sequence parallelism must then log the same numbers bit for bit. The patches are made here, from outside
the package, and undone on exit.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

import fp8train.nn.linear_dispatch as linear_dispatch
from fp8train.nn.gemm import Fp8Operand
from fp8train.nn.linear import Fp8Linear
from fp8train.nn.linear_dispatch import NO_DISPATCH

ROWWISE, COLWISE = ("o_proj", "down_proj"), ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _slice(op: Fp8Operand, axis: int, lo: int, hi: int) -> Fp8Operand:
    """Elements lo:hi along `axis` of a 2-D operand, built as a rank builds its own: its source's slice made
    contiguous (then transposed, where the operand is a transposed view), the scales that run along it sliced."""
    source, transposed = (op._transposed_from, True) if op._transposed_from is not None else (op, False)
    axis = 1 - axis if transposed else axis
    data = source.data.narrow(axis, lo, hi - lo).contiguous()
    scale = source.scale
    if source.block is not None:  # tiles along the split axis: theirs only (the split falls on a tile boundary)
        tile = source.block[axis]
        scale = scale.narrow(axis, lo // tile, (hi - lo) // tile).contiguous()
    elif scale.dim() == 2 and scale.shape[axis] == source.data.shape[axis]:  # per row / column along it
        scale = scale.narrow(axis, lo, hi - lo).contiguous()
    part = Fp8Operand(data, scale, source.block)
    return part.t() if transposed else part


@contextmanager
def tp_reduction_order(tp: int):
    original_resolve = linear_dispatch._resolve

    def split(mm):
        """A layer's GEMM callable (nn/linear_dispatch.py) run as tp parts along its contracted dim, added in
        rank order as the collective adds them."""
        def split_mm(a, b, bias=None, **kwargs):
            width = a.data.shape[1] // tp
            total = None
            for r in range(tp):
                part = mm(_slice(a, 1, r * width, (r + 1) * width), _slice(b, 0, r * width, (r + 1) * width),
                          **kwargs)
                total = part if total is None else total + part  # the collective's addition, in rank order
            return total if bias is None else total + bias  # (a rowwise bias is added once, after the sum)
        return split_mm

    def resolve(layer, *args, **kwargs):
        dispatch = original_resolve(layer, *args, **kwargs)
        kind = getattr(layer, "_tp_kind", None)
        if kind == "rowwise":    # output = input @ weight.T contracts the split K
            dispatch.output_mm = split(dispatch.output_mm)
        elif kind == "colwise":  # grad_input = grad_output @ weight contracts the split N
            dispatch.grad_input_mm = split(dispatch.grad_input_mm)
        return dispatch

    def mark(module, args):  # names under a block: which split each projection has under tp
        for name, child in module.named_children():
            if isinstance(child, Fp8Linear) and (name in ROWWISE or name in COLWISE):
                kind = "rowwise" if name in ROWWISE else "colwise"
                if getattr(child, "_tp_kind", None) != kind:
                    child._tp_kind = kind
                    child.dispatch_table = NO_DISPATCH  # (resolved again, with the split)

    handle = register_module_forward_pre_hook(mark)
    linear_dispatch._resolve = resolve
    try:
        yield
    finally:
        handle.remove()
        linear_dispatch._resolve = original_resolve
