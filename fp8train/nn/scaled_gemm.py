"""The `scaled_mm` GEMM backend: FP8 tensor-core GEMMs through torch's scaled matmul.

For a (M, K) @ b (K, N) with dequantization scales, this module decides which scaled-matmul kernel can take the
operands as they are, builds the exact argument layouts that kernel documents, and calls it:

| kind                     | scale_a                        | scale_b                          | needs             |
|--------------------------|--------------------------------|----------------------------------|-------------------|
| tensorwise               | () fp32                        | () fp32                          | K, N % 16         |
| rowwise                  | (M, 1) fp32, contiguous        | (1, N) fp32, contiguous          | K, N % 16         |
| blockwise_1x128_128x128  | (M, K/128), stride (1, M)      | (L4, N/128), stride (1, L4)      | K, N % 128, v2    |
| blockwise_1x128_1x128    | (M, K/128), stride (1, M)      | (N, K/128), stride (1, N)        | K % 128, v2       |
| blockwise_128x128_1x128  | (L4, M/128), stride (1, L4)    | (N, K/128), stride (1, N)        | M, K % 128, v2    |

L4 = K/128 rounded up to a multiple of 4 (the kernel reads scale columns in fours). The layouts are those that
torch's own checks (`torch._meta_registrations._check_scaled_mm_sizes_v2`) state; the tests hold the arguments
built here to those checks and to explicit stride assertions, because the CPU kernel accepts layouts the CUDA
kernels reject. In every case the first operand is row-major and the second column-major; an operand in the
other layout is copied once (fp8train quantizes backward operands straight into the layout their GEMM needs, so
this copy does not happen on its hot path).

"v2" is the public `torch.nn.functional.scaled_mm` (torch >= 2.10); without it, `torch._scaled_mm` serves
tensorwise and rowwise, and blockwise scales fall back. A fallback dequantizes both operands and runs a bf16 GEMM
with fp32 accumulation (fp32 on CPU): what the tensor core computes, up to accumulation order, but not FP8 speed.
Every call can report which path it took (`record`), so telemetry and the bench say per GEMM whether it ran FP8.

Kernel quirks handled by retrying a smaller request once per configuration (and remembering the answer): some
torch builds give rowwise/blockwise kernels a bf16 output only, and none fuses a bias into an fp32 output. What
torch raises for an unsupported request: ValueError (TORCH_CHECK_VALUE: bad scale shapes, CPU blockwise),
RuntimeError (TORCH_CHECK), NotImplementedError (missing kernels); out-of-memory is re-raised, never hidden.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["scaled_mm_kind", "scaled_mm_arguments", "scaled_mm_gemm", "scaled_mm_available", "fp8_dialect_of",
           "HAS_SCALED_MM_V2", "SCALED_MM_KINDS", "check_dialect", "call_scaled_mm"]

HAS_SCALED_MM_V2 = hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
SCALED_MM_KINDS = ("tensorwise", "rowwise", "blockwise_1x128_128x128", "blockwise_1x128_1x128",
                   "blockwise_128x128_1x128")
_TILES = {  # (a tile, b tile) in each operand's own orientation -> kind
    ((1, 128), (128, 128)): "blockwise_1x128_128x128",
    ((1, 128), (128, 1)): "blockwise_1x128_1x128",
    ((128, 128), (128, 1)): "blockwise_128x128_1x128",
}
_KERNEL_ERRORS = (RuntimeError, ValueError, NotImplementedError)
_FNUZ_DTYPES = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
# (device type, kind, dtypes, out dtype, bias fused, fast accum) -> None (works) or the reason it does not
_kernel_answers: dict = {}


# ------------------------------------------------------------------------------------------------------------
# Which device, which dialect
# ------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def scaled_mm_available(device: torch.device | str) -> bool:
    """True on a CUDA device of compute capability 8.9+ (Ada, Hopper, Blackwell) whose torch has _scaled_mm."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


@functools.lru_cache(maxsize=None)
def fp8_dialect_of(device_type: str, index: int = 0) -> str:
    """'fnuz' on AMD MI300-class GPUs (gfx94x: FNUZ FP8 only), 'ocp' on every other FP8 GPU."""
    if device_type == "cuda" and torch.version.hip and torch.cuda.is_available():
        arch = getattr(torch.cuda.get_device_properties(index), "gcnArchName", "")
        return "fnuz" if arch.startswith("gfx94") else "ocp"
    return "ocp"


def check_dialect(format_names, device: torch.device | str) -> None:
    """Refuse FP8 formats that this GPU's tensor cores do not implement (FNUZ on OCP hardware and back)."""
    device = torch.device(device)
    fnuz = any(name.endswith("fnuz") for name in format_names)
    dialect = fp8_dialect_of(device.type, device.index or 0)
    if fnuz and dialect == "ocp":
        raise ValueError(f"formats {'/'.join(format_names)} are FNUZ (AMD MI300): this GPU's FP8 tensor cores use "
                         f"OCP formats; use e4m3fn/e5m2, or backend='emulated' to study FNUZ numerics")
    if not fnuz and dialect == "fnuz":
        raise ValueError(f"formats {'/'.join(format_names)} are OCP: this GPU (MI300) has FNUZ FP8 tensor cores; "
                         f"use e4m3fnuz/e5m2fnuz, or backend='emulated'")


# ------------------------------------------------------------------------------------------------------------
# Which kernel, which arguments
# ------------------------------------------------------------------------------------------------------------
def scaled_mm_kind(a, b) -> tuple[str | None, str]:
    """(kind, '') when a scaled-matmul kernel takes a @ b as quantized, else (None, why not)."""
    (m, k), n = a.shape, b.shape[1]
    if a.data.dtype == b.data.dtype == torch.float8_e5m2:
        return None, "no e5m2 x e5m2 kernel"
    if k % 16 or n % 16:  # M may be anything; K and N must be multiples of 16 (torch's size check)
        return None, f"K={k} and N={n} must be multiples of 16"
    if a.block is None and b.block is None and a.scale.numel() == 1 and b.scale.numel() == 1:
        return "tensorwise", ""
    if a.scale_outer_rows and b.scale_outer_cols:
        return "rowwise", ""
    kind = _TILES.get((_tile_of(a), _tile_of(b)))
    if kind is None:
        return None, f"scales vary along K in tiles {_tile_of(a)} x {_tile_of(b)}, which no kernel takes"
    if not HAS_SCALED_MM_V2:
        return None, "blockwise scales need torch.nn.functional.scaled_mm (torch >= 2.10)"
    if k % 128 or (kind.endswith("128x128") and n % 128) or (kind.startswith("blockwise_128x128") and m % 128):
        return None, f"{kind} needs whole 128-tiles (M={m}, K={k}, N={n})"
    return kind, ""


def _tile_of(op) -> tuple[int, int] | None:
    """The operand's scale tile; per-row / per-column scales of a full dimension are not tiles."""
    return tuple(op.block) if op.block is not None else None


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.t().is_contiguous() else t.t().contiguous().t()


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """(R, C) scale stored with stride (1, R): the outer dim varies fastest."""
    return scale.float().t().contiguous().t()


def _padded_outer_major(scale: torch.Tensor) -> torch.Tensor:
    """(C, R) tile grid of 128x128 scales -> (L4, C) with stride (1, L4), L4 = R rounded up to 4 (pad = 1)."""
    outer, inner = scale.shape
    padded = torch.ones(outer, -(-inner // 4) * 4, dtype=torch.float32, device=scale.device)
    padded[:, :inner] = scale
    return padded.t()


def scaled_mm_arguments(a, b, kind: str) -> dict:
    """mat_a, mat_b, scale_a, scale_b and the ScalingType names for `kind`, in the layouts the kernel needs."""
    (m, _), n = a.shape, b.shape[1]
    args = dict(mat_a=_row_major(a.data), mat_b=_col_major(b.data))
    if kind == "tensorwise":
        args.update(scale_a=a.scale.reshape(()).float(), scale_b=b.scale.reshape(()).float(),
                    recipe_a="TensorWise", recipe_b="TensorWise")
    elif kind == "rowwise":
        args.update(scale_a=a.scale.float().expand(m, 1).contiguous(),
                    scale_b=b.scale.float().expand(1, n).contiguous(), recipe_a="RowWise", recipe_b="RowWise")
    elif kind == "blockwise_1x128_128x128":  # a.scale (M, K/128); b.scale (K/128, N/128)
        args.update(scale_a=_outer_major(a.scale), scale_b=_padded_outer_major(b.scale.t()),
                    recipe_a="BlockWise1x128", recipe_b="BlockWise128x128")
    elif kind == "blockwise_1x128_1x128":  # b.scale (K/128, N): the kernel wants (N, K/128), stride (1, N)
        args.update(scale_a=_outer_major(a.scale), scale_b=b.scale.float().contiguous().t(),
                    recipe_a="BlockWise1x128", recipe_b="BlockWise1x128")
    elif kind == "blockwise_128x128_1x128":  # a.scale (M/128, K/128)
        args.update(scale_a=_padded_outer_major(a.scale), scale_b=b.scale.float().contiguous().t(),
                    recipe_a="BlockWise128x128", recipe_b="BlockWise1x128")
    else:
        raise ValueError(f"unknown scaled_mm kind {kind!r}; allowed: {', '.join(SCALED_MM_KINDS)}")
    return args


def call_scaled_mm(args: dict, out_dtype: torch.dtype, bias: torch.Tensor | None, fast_accum: bool):
    if HAS_SCALED_MM_V2:
        return F.scaled_mm(args["mat_a"], args["mat_b"], args["scale_a"], getattr(F.ScalingType, args["recipe_a"]),
                           args["scale_b"], getattr(F.ScalingType, args["recipe_b"]), bias=bias,
                           output_dtype=out_dtype, use_fast_accum=fast_accum)
    return torch._scaled_mm(args["mat_a"], args["mat_b"], args["scale_a"], args["scale_b"], bias=bias,
                            out_dtype=out_dtype, use_fast_accum=fast_accum)


# ------------------------------------------------------------------------------------------------------------
# The GEMM
# ------------------------------------------------------------------------------------------------------------
def scaled_mm_gemm(a, b, *, out_dtype: torch.dtype = torch.float32, bias: torch.Tensor | None = None,
                   use_fast_accum: bool = False, record: dict | None = None, gemm: str = "") -> torch.Tensor:
    """`dequant(a) @ dequant(b) (+ bias)` in `out_dtype` on the FP8 kernel where one takes the operands.

    `record[gemm]` (when given) is set to 'scaled_mm:<kind>' or 'fallback:<reason>'."""
    kind, reason = scaled_mm_kind(a, b)
    if kind is not None:
        args = scaled_mm_arguments(a, b, kind)
        for request_dtype, fused_bias in _requests(out_dtype, bias):
            key = (a.data.device.type, kind, a.data.dtype, b.data.dtype, request_dtype, fused_bias is not None,
                   bool(use_fast_accum))
            if _kernel_answers.get(key, None) is not None:
                reason = _kernel_answers[key]
                continue
            try:
                out = call_scaled_mm(args, request_dtype, fused_bias, bool(use_fast_accum))
            except torch.OutOfMemoryError:
                raise
            except _KERNEL_ERRORS as err:  # remember, so later steps do not pay for the exception
                reason = _kernel_answers[key] = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
                continue
            _kernel_answers[key] = None
            if bias is not None and fused_bias is None:
                out = out + bias.to(out.dtype)
            if record is not None:
                record[gemm] = f"scaled_mm:{kind}"
            return out if out.dtype == out_dtype else out.to(out_dtype)
    if record is not None:
        record[gemm] = f"fallback:{reason}"
    return _dequantized_gemm(a, b, out_dtype, bias)


def _requests(out_dtype: torch.dtype, bias):
    """(output dtype, bias to fuse) to try in order: as asked, then the bias unfused, then a bf16 output."""
    fusable = bias is not None and out_dtype != torch.float32  # no kernel fuses a bias into an fp32 output
    if fusable:
        yield out_dtype, bias.to(out_dtype)
    yield out_dtype, None
    if out_dtype != torch.bfloat16:
        yield torch.bfloat16, None


def _dequantized_gemm(a, b, out_dtype: torch.dtype, bias) -> torch.Tensor:
    """Fallback: dequantize, bf16 GEMM with fp32 accumulation on CUDA (fp32 elsewhere), in `out_dtype`."""
    cuda = a.data.is_cuda
    compute = torch.bfloat16 if cuda else torch.float32
    a_hp, b_hp = a.dequantize(compute), b.dequantize(compute)
    if cuda and out_dtype == torch.float32:
        try:  # torch >= 2.8 returns the fp32 accumulator of a bf16 GEMM without rounding it to bf16
            out = torch.mm(a_hp, b_hp, out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            out = torch.mm(a_hp, b_hp).float()
    else:
        out = torch.mm(a_hp, b_hp)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out if out.dtype == out_dtype else out.to(out_dtype)
