"""The sequence-parallel all-gather in FP8: a module's input gathered as FP8 codes plus scales, not bf16 / fp32.

Under sequence parallelism (Megatron-SP; training/parallel/tp_mesh.sequence_parallel_styles) each rank holds
T / tp positions of a block's normed input x (B, T, D) and all-gathers it along T before the colwise projections
(q/k/v, gate/up) read it. Those projections only ever read x as FP8 (their input quantizers), so each rank can
quantize its own positions first and gather 1-byte codes (torchao's PrepareFloat8ModuleInput does this for
tensorwise scaling; TransformerEngine likewise). What every projection then reads is bit for bit what quantizing
the gathered high-precision x gives, because each scale is the one the whole x gets:

- tensorwise (delayed, current): one scale from amax(x) = max over ranks of amax(own positions). Current scaling
  and delayed scaling's first step (the scale is x's own) all-gather the per-rank amaxes (tp floats; a gather, not
  a MAX all-reduce, so that a NaN propagates as compute_amax's does) before the cast. Delayed scaling with stored
  scales casts at once, and the per-rank amaxes ride along in the same all-gather as the codes: every rank then
  records amax(x), as the projections would have.
- rowwise: the forward operand's scales are per position (a row of the (B*T, D) view): local. The copy that
  grad_weight reads (recipes.requantize_transposed) has one scale per feature over all positions: its column
  amaxes are all-gathered (D floats per rank) first. Both copies travel, 2 bytes per element: what a bf16 gather
  moves (half of fp32's); the scales are 4 bytes per position.
- block: tiles lie inside one rank's positions when their extent along the positions divides T / tp (the forward
  tile's rows; the transposed copy's columns): then local, else this module's input is gathered in high precision.
- mxfp8, consumers that are not Fp8Linear or differ in recipe, delayed consumers whose stored input scales differ:
  gathered in high precision (torch's own redistribute), as before.

The gathered input is an `Fp8GatheredInput`: a tensor of x's shape and dtype that holds the FP8 operand(s) of its
(B*T, D) view and nothing else; Fp8Linear's input quantizer takes them as they are (counting a non-finite amax and
recording delayed amaxes as it would have; no telemetry of the input, whose high-precision values were not
gathered). Views of it (reshape, DTensor's wrapping) keep it; any other use raises. Backward: the projections'
input gradients are partial sums over their output features; added locally, they are reduce-scattered along T
once per module, as torch's styles do (the same collective, the same bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from fp8train.nn.recipes import OperandRole
from fp8train.numerics.names import Granularity
from fp8train.numerics.quant import Fp8Tensor, compute_amax, quantize
from fp8train.numerics.scaling import format_scale

__all__ = ["Fp8GatheredInput", "Fp8SequenceGather", "fp8_gather_refusal"]

SEQUENCE_DIM = 1  # x is (B, T, D): positions along dim 1


def fp8_gather_refusal(consumers: list, local_positions: int) -> str | None:
    """Why this module's input cannot be gathered in FP8 (then it is gathered in high precision), or None."""
    from fp8train.nn.linear import Fp8Linear  # (linear imports the quantizer, which imports this module's type)

    if not consumers or not all(isinstance(c, Fp8Linear) for c in consumers):
        return "a projection reading the input is not an Fp8Linear"
    r = consumers[0].recipe
    if any(c.recipe != r for c in consumers[1:]):
        return "its projections differ in recipe"
    if r.is_mx:
        return "mxfp8 tiles"
    if r.granularity_of(OperandRole.INPUT) == Granularity.BLOCK:
        rows, cols = r.block_of(OperandRole.INPUT)
        extents = {rows} | ({cols} if r.requantize_transposed(OperandRole.INPUT) else set())
        if any(local_positions % e for e in extents):
            return f"scaling tiles of {sorted(extents)} positions span the {local_positions}-position shards"
    return None


class Fp8GatheredInput(torch.Tensor):
    """The gathered input (B, T, D) of a module's colwise projections, as their FP8 operands: `fp8` (B*T, D) and,
    for recipes whose grad_weight reads it along the other axis, `fp8_t` (D, B*T); `amax` the whole input's
    (tensorwise) or None; `nonfinite` a 0-d bool, whether any of its amaxes is NaN/inf."""

    @staticmethod
    def __new__(cls, shape, dtype, device, fp8, fp8_t, amax, nonfinite, requires_grad=False):
        # torch's way to make a tensor subclass that wraps other tensors (no public constructor for one)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device,
                                                   requires_grad=requires_grad)

    def __init__(self, shape, dtype, device, fp8, fp8_t, amax, nonfinite, requires_grad=False):
        self.fp8, self.fp8_t, self.amax, self.nonfinite = fp8, fp8_t, amax, nonfinite

    def __repr__(self) -> str:
        return f"Fp8GatheredInput(shape={tuple(self.shape)}, fmt={self.fp8.fmt.name}, {self.fp8.granularity})"

    def take(self, quantizer, transposed: bool = False) -> Fp8Tensor:
        """The operand `quantizer` (a consumer's input quantizer) would have made from the gathered values,
        with the bookkeeping its quantize does (non-finite counter; delayed scaling's pending amax)."""
        if transposed:
            if self.fp8_t is None:
                raise RuntimeError("internal error: the FP8-gathered input has no transposed copy (gathered "
                                   "without grad?) but a projection's grad_weight asked for it")
            return self.fp8_t
        if quantizer.delayed:
            quantizer.record_amax(self.amax)  # counts a non-finite amax too
        else:
            quantizer.buffer("nonfinite_amax_count").add_(self.nonfinite)
        return self.fp8

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # DTensor wraps it (view_as), Fp8Linear flattens it (reshape -> view); views that keep the last dim keep
        # the operands. Anything that would compute with its values is a bug: refuse it.
        if func in (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.alias.default,
                    torch.ops.aten.detach.default):
            self = args[0]
            shape = tuple(self.shape) if len(args) < 2 else tuple(args[1])
            shape = torch.Size(shape if -1 not in shape else _infer(shape, self.numel()))
            if shape.numel() != self.numel() or shape[-1] != self.shape[-1]:
                raise RuntimeError(f"an FP8-gathered input {tuple(self.shape)} was viewed as {tuple(shape)}: only "
                                   "views that keep the last dim are supported")
            return cls(shape, self.dtype, self.device, self.fp8, self.fp8_t, self.amax, self.nonfinite)
        raise RuntimeError(f"an FP8-gathered input (sequence parallelism) was used by {func}; only the module's "
                           "Fp8Linear projections can read it")


def _infer(shape, numel: int) -> tuple:
    known = 1
    for s in shape:
        known *= s if s != -1 else 1
    return tuple(numel // known if s == -1 else s for s in shape)


@dataclass
class _Piece:
    """One tensor a rank contributes to the packed all-gather; `positions`: its axis that runs over this rank's
    (B * T/tp) positions (merged into the whole sequence after the gather), None: kept per rank, (tp, *shape)."""

    tensor: torch.Tensor
    positions: int | None


def _gather_pieces(pieces: list[_Piece], batch: int, group, tp: int) -> list[torch.Tensor]:
    """All-gather every piece in ONE collective (their bytes packed), then put the positions back in order."""
    flat = [p.tensor.contiguous().reshape(-1).view(torch.uint8) for p in pieces]
    packed = torch.cat(flat)
    gathered = funcol.wait_tensor(funcol.all_gather_single(packed, 0, group)).view(tp, -1)
    out, start = [], 0
    for piece, raw in zip(pieces, flat):
        t = piece.tensor
        chunk = gathered[:, start:start + raw.numel()].contiguous().view(t.dtype).view(tp, *t.shape)
        start += raw.numel()
        if piece.positions is not None:  # (tp, ..., B*L, ...) -> (..., B, tp, L, ...) -> (..., B*tp*L, ...)
            a = piece.positions
            local = t.shape[a]
            split = chunk.view(tp, *t.shape[:a], batch, local // batch, *t.shape[a + 1:])
            chunk = split.movedim(0, a + 1).reshape(*t.shape[:a], local * tp, *t.shape[a + 1:])
        out.append(chunk)
    return out


def _gather_amax(amax: torch.Tensor, group, tp: int) -> torch.Tensor:
    """max over ranks of `amax` (0-d or per feature), NaN-propagating as compute_amax on the whole tensor is."""
    gathered = funcol.wait_tensor(funcol.all_gather_single(amax.reshape(1, -1).contiguous(), 0, group))
    return gathered.view(tp, *amax.shape).amax(0)


def gather_fp8(x_local: torch.Tensor, layer, group, tp: int, transposed: bool) -> tuple:
    """Quantize this rank's positions x_local (B, T/tp, D) with `layer`'s input rule and the whole input's scales;
    all-gather the codes and scales (module docstring). Returns Fp8GatheredInput's (fp8, fp8_t, amax, nonfinite);
    `transposed`: make the copy grad_weight reads along the other axis too."""
    q = layer.quantizers[OperandRole.INPUT]
    batch, _, width = x_local.shape
    x2 = x_local.reshape(-1, width)
    kernel = layer.kernel_for(x2.numel() * tp)  # the consumers' kernel for the whole input (the same bytes anyway)
    fmt, margin, pow2 = q.format, q.margin, q.pow2
    amax = None
    if q.tensorwise:
        if q.delayed and q.initialized_on_host:  # the stored scale: cast now, the amaxes travel with the codes
            local = quantize(x2, fmt, scale=q.buffer("scale"), validate_scale=False, kernel=kernel, with_amax=True)
            codes, amaxes = _gather_pieces([_Piece(local.data, 0), _Piece(local.amax.reshape(1), None)], batch,
                                           group, tp)
            amax = amaxes.amax()
        else:
            amax = _gather_amax(compute_amax(x2, kernel=kernel), group, tp)
            scale = q.tensorwise_scale(amax)
            local = quantize(x2, fmt, scale=scale, validate_scale=False, kernel=kernel)
            (codes,) = _gather_pieces([_Piece(local.data, 0)], batch, group, tp)
        fp8 = Fp8Tensor(codes, local.scale, fmt, amax=amax)
        return fp8, None, amax, amax.isfinite().logical_not()
    granularity, block = q.granularity, q.block
    local = quantize(x2, fmt, granularity=granularity, block=block, axis=-1, margin=margin, pow2=pow2, kernel=kernel)
    pieces = [_Piece(local.data, 0), _Piece(local.scale, 0), _Piece(local.amax.amax().reshape(1), None)]
    if transposed:
        x2_t = x2.t()
        if granularity == Granularity.ROW:  # one scale per feature, over all positions: the whole input's column amaxes
            col_amax = _gather_amax(compute_amax(x2_t, "row", axis=-1, kernel=kernel), group, tp)
            local_t = quantize(x2_t, fmt, granularity="row", axis=-1, kernel=kernel, validate_scale=False,
                               scale=format_scale(col_amax, fmt, margin, pow2))
            pieces.append(_Piece(local_t.data, 1))
        else:  # block tiles inside this rank's positions (fp8_gather_refusal): local
            local_t = quantize(x2_t, fmt, granularity="block", block=block, margin=margin, pow2=pow2, kernel=kernel)
            pieces += [_Piece(local_t.data, 1), _Piece(local_t.scale, 1)]
    gathered = _gather_pieces(pieces, batch, group, tp)
    fp8 = Fp8Tensor(gathered[0], gathered[1], fmt, granularity, block, -1)
    fp8_t = None
    if transposed:
        scale_t = local_t.scale if granularity == Granularity.ROW else gathered[4]
        fp8_t = Fp8Tensor(gathered[3], scale_t, fmt, granularity, block, -1)
    return fp8, fp8_t, None, gathered[2].amax().isfinite().logical_not()


class _Fp8SequenceAllGather(torch.autograd.Function):
    """x_local (B, T/tp, D) -> Fp8GatheredInput (B, T, D); backward: the summed partial input gradients
    reduce-scattered along T (torch's funcol, as DTensor's Partial -> Shard(1) redistribute does)."""

    @staticmethod
    def forward(ctx, x_local, layer, group, tp, transposed):
        ctx.group = group
        with torch.autocast(x_local.device.type, enabled=False):
            fp8, fp8_t, amax, nonfinite = gather_fp8(x_local, layer, group, tp, transposed)
        batch, local, width = x_local.shape
        return Fp8GatheredInput(torch.Size((batch, local * tp, width)), x_local.dtype, x_local.device, fp8, fp8_t,
                                amax, nonfinite)

    @staticmethod
    def backward(ctx, grad):
        grad_local = funcol.wait_tensor(funcol.reduce_scatter_single(grad.contiguous(), "sum", SEQUENCE_DIM,
                                                                     ctx.group))
        return grad_local, None, None, None, None


class Fp8SequenceGather(ParallelStyle):
    """For a module (attention, MLP) whose first input is sequence-sharded (Shard(1) DTensor from a
    SequenceParallel norm) and read by its colwise projections `consumers` (names under the module): hands them
    the input gathered along T as FP8 (module docstring) when `fp8` and the projections allow, else gathered in
    high precision (torch's PrepareModuleInput(Shard(1) -> Replicate), the gathered input kept a DTensor so the
    projections' partial input gradients go back as one reduce-scatter)."""

    def __init__(self, consumers: tuple[str, ...], fp8: bool = True, high_precision_dtype=None):
        super().__init__()
        self.consumers, self.fp8 = consumers, fp8
        # the dtype of a high-precision gather (None: the input's own); bf16 under an fp32 residual stream is a
        # comparison (the bench's), not a training mode: the projections then quantize bf16-rounded inputs
        self.high_precision_dtype = high_precision_dtype
        self._checked = None  # (the delayed input scales' versions, whether they agreed)

    def _apply(self, module, device_mesh):
        module.register_forward_pre_hook(partial(self._gather, device_mesh))
        return module

    def _gather(self, mesh, module, args):
        x, rest = args[0], args[1:]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Shard(SEQUENCE_DIM)], run_check=False)
        consumers = [module.get_submodule(name) for name in self.consumers]
        tp = mesh.size()
        local_positions = x.shape[SEQUENCE_DIM] // tp
        if not self.fp8 or x.dim() != 3 or x.shape[SEQUENCE_DIM] % tp or \
                fp8_gather_refusal(consumers, local_positions) or not self._delayed_scales_agree(consumers):
            return (x.redistribute(mesh, [Replicate()], forward_dtype=self.high_precision_dtype), *rest)
        x_local = x.to_local()  # its gradient comes back as this rank's Shard(1) part (reduce-scattered)
        # the copy grad_weight reads along the other axis, where the recipe has one and a backward will run
        transposed = torch.is_grad_enabled() and consumers[0].recipe.requantize_transposed(OperandRole.INPUT)
        gathered = _Fp8SequenceAllGather.apply(x_local, consumers[0], mesh.get_group(), tp, transposed)
        # the projections' gradients stay Partial (no all-reduce): summed locally, reduce-scattered once above
        return (DTensor.from_local(gathered, mesh, [Replicate()], run_check=False, grad_placements=[Partial()]),
                *rest)

    def _delayed_scales_agree(self, consumers: list) -> bool:
        """Delayed scaling casts with one consumer's stored input scale: the others' must be the same (they are, by
        construction: they record the same amaxes every step). Checked when a scale changes (one host sync then)."""
        first = consumers[0]
        if not first.recipe.is_delayed or len(consumers) == 1:
            return True
        buffers = [(c.input_scale, c.input_initialized) for c in consumers]
        on_host = tuple(c.quantizers[OperandRole.INPUT].initialized_on_host for c in consumers)
        # tensor._version: torch's in-place write counter, the one signal that a scale buffer was written
        key = (tuple((s._version, i._version, s.data_ptr()) for s, i in buffers), on_host)
        known = self._checked
        if known is not None and known[0] == key:
            return known[1]
        agree = all(torch.equal(s, buffers[0][0]) and torch.equal(i, buffers[0][1]) for s, i in buffers[1:])
        agree = agree and len(set(on_host)) == 1
        self._checked = (key, agree)
        return agree
