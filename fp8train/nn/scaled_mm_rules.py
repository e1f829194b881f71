"""Planning one scaled-matmul call: which kernel kind takes a (M, K) @ b (K, N), with which arguments.

A pure function of the operands' shapes, dtypes, scale layouts and the target GPU's compute capability: it reads
no device and runs nothing, so the exact call fp8train would make on an sm90 or sm100 GPU can be planned (and
replayed against torch's meta checks) on any machine, meta tensors included.

| kind                     | scale_a                        | scale_b                          | needs                 |
|--------------------------|--------------------------------|----------------------------------|-----------------------|
| tensorwise               | () fp32                        | () fp32                          | K, N % 16             |
| rowwise                  | (M, 1) fp32, contiguous        | (1, N) fp32, contiguous          | K, N % 16             |
| blockwise_1x128_128x128  | (M, K/128), stride (1, M)      | (L4, N/128), stride (1, L4)      | K, N % 128, v2, sm90  |
| blockwise_1x128_1x128    | (M, K/128), stride (1, M)      | (N, K/128), stride (1, N)        | K % 128, v2, sm90     |
| blockwise_128x128_1x128  | (L4, M/128), stride (1, L4)    | (N, K/128), stride (1, N)        | M, K % 128, v2, sm90  |
| mx_1x32                  | E8M0, (M, K/32) swizzled       | E8M0, (N, K/32) swizzled         | K % 32, v2, sm100     |

L4 = K/128 rounded up to a multiple of 4. "Swizzled" is cuBLAS's 1D block-scaling-factor layout (torch's
SwizzleType.SWIZZLE_32_4_4): the scale grid padded to 128 rows x a multiple of 4 columns, cut into 128x4 tiles
stored one after the other, and inside a tile the element (32 i + j, c) stored at offset 16 j + 4 i + c.
The first operand is always passed row-major and the second column-major (sm90's cuBLAS takes only that).

Rules of torch's CUDA path that decide the plan (torch 2.11 / 2.13, aten/src/ATen/native/cuda/ScaledBlas.cpp and
aten/src/ATen/cuda/CUDABlas.cpp):
- e5m2 x e5m2 is refused ("Multiplication of two Float8_e5m2 matrices is not supported").
- Block (1x128 / 128x128) and MX (1x32) kinds take e4m3fn for BOTH operands (ScaledBlasUtils.cpp,
  check_deepseek_recipe / check_mxfp8_recipe: "both types must be fp8" tests `== Float8_e4m3fn`; anything else is
  "Invalid scaling configuration"), so an e5m2 gradient with block or MX scales has no kernel.
- Rowwise with an fp32 output runs only where cuBLAS takes rowwise scales: sm9x (cuBLAS >= 12.9). On sm89 and on
  sm100+ torch routes rowwise to CUTLASS, which gives bf16 / fp16 outputs only ("Only bf16 and fp16 high precision
  output types are supported for row-wise scaling", ScaledBlas.cpp): there an fp32 request is planned as a bf16
  output widened to fp32 (`rounds_to`), and `target_gpu` makes the emulation round the same way.
- Fast accumulation is refused with 1x128 and 128x128 block scales (CUDABlas.cpp get_scale_mode: "scaled_gemm
  doesn't support fast accum with 1x128 blockwise scaling"), and the MX path always runs without it: fast
  accumulation is requested for tensorwise and rowwise kinds only, whatever the recipe asks.
- The 1x128 / 128x128 ("DeepSeek") kinds run on sm90 only (`_check_deepseek_support`: "only supported in CUDA for
  SM90") with cuBLAS >= 12.9; MX (1x32, E8M0) scaling has cuBLAS kernels from sm100 (Blackwell) on.
- A bias is fused only into a bf16 / fp16 output, in that dtype ("Bias is not supported when out_dtype is set to
  Float32"; "Bias must be BFloat16 to compute BFloat16 output").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp8train.numerics.mx import e8m0_codes

__all__ = ["ScaledMmCall", "scaled_mm_call", "scaled_mm_kind", "scaled_mm_arguments", "swizzle_scales",
           "HAS_SCALED_MM_V2", "SCALED_MM_KINDS", "BLOCKWISE_KINDS", "FAST_ACCUM_KINDS"]

HAS_SCALED_MM_V2 = hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")
SCALED_MM_KINDS = ("tensorwise", "rowwise", "blockwise_1x128_128x128", "blockwise_1x128_1x128",
                   "blockwise_128x128_1x128", "mx_1x32")
BLOCKWISE_KINDS = SCALED_MM_KINDS[2:5]
FAST_ACCUM_KINDS = ("tensorwise", "rowwise")  # cuBLAS refuses fast accumulation with block scales
_TILES = {  # (a tile, b tile) in each operand's own orientation -> kind
    ((1, 128), (128, 128)): "blockwise_1x128_128x128",
    ((1, 128), (128, 1)): "blockwise_1x128_1x128",
    ((128, 128), (128, 1)): "blockwise_128x128_1x128",
    ((1, 32), (32, 1)): "mx_1x32",
}
_FUSABLE_BIAS_OUT = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ScaledMmCall:
    """One planned call. `kind` None: no kernel takes it, `reason` says why (the GEMM falls back).

    `requests`: (output dtype, fuse the bias) to try in order on the device (some builds give rowwise / blockwise
    kernels a bf16 output only); `fast_accum`: the accumulation switch actually passed; `rounds_to`: the dtype the
    kernel's result is rounded to before it is widened to the asked output dtype (the first request's)."""

    kind: str | None
    reason: str
    shape: tuple[int, int, int]
    args: dict | None = None
    requests: tuple = ()
    fast_accum: bool = False

    @property
    def rounds_to(self) -> torch.dtype | None:
        return self.requests[0][0] if self.requests else None


def scaled_mm_kind(a, b, capability: tuple[int, int] | None = None) -> tuple[str | None, str]:
    """(kind, '') when a scaled-matmul kernel takes a @ b as quantized, else (None, why not).

    `capability`: the target GPU's (major, minor); None leaves architecture limits to the device (CPU)."""
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
    if not a.data.dtype == b.data.dtype == torch.float8_e4m3fn:
        return None, (f"{kind} takes e4m3fn for both operands (torch's check_deepseek_recipe / check_mxfp8_recipe); "
                      f"got {_short(a.data.dtype)} x {_short(b.data.dtype)}")
    if not HAS_SCALED_MM_V2:
        return None, f"{kind} scales need torch.nn.functional.scaled_mm (torch >= 2.10)"
    if kind == "mx_1x32":
        if capability is not None and capability < (10, 0):
            return None, (f"mx_1x32 (MXFP8, E8M0 scales) needs sm100 (Blackwell) or newer; this GPU is "
                          f"sm{capability[0]}{capability[1]}")
        if k % 32:
            return None, f"mx_1x32 needs whole 32-blocks along K (K={k})"
        return kind, ""
    if capability is not None and capability[0] != 9:
        return None, (f"{kind} (DeepSeek-style 1x128 / 128x128 scales) needs sm90 (Hopper): torch runs it on "
                      f"sm90 only; this GPU is sm{capability[0]}{capability[1]}")
    if k % 128 or (kind.endswith("128x128") and n % 128) or (kind.startswith("blockwise_128x128") and m % 128):
        return None, f"{kind} needs whole 128-tiles (M={m}, K={k}, N={n})"
    return kind, ""


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.float8_")


def _tile_of(op) -> tuple[int, int] | None:
    """The operand's scale tile; per-row / per-column scales of a full dimension are not tiles."""
    return tuple(op.block) if op.block is not None else None


def scaled_mm_call(a, b, *, out_dtype: torch.dtype, bias: torch.Tensor | None, use_fast_accum: bool,
                   capability: tuple[int, int] | None = None) -> ScaledMmCall:
    """The call for `dequant(a) @ dequant(b) (+ bias)` in `out_dtype` on a GPU of `capability`."""
    (m, k), n = a.shape, b.shape[1]
    kind, reason = scaled_mm_kind(a, b, capability)
    if kind is None:
        return ScaledMmCall(None, reason, (m, k, n))
    if kind == "rowwise" and out_dtype == torch.float32 and capability is not None and capability[0] != 9:
        out_dtype = torch.bfloat16  # CUTLASS rowwise (sm89, sm100+): bf16 output only, widened by the caller
    return ScaledMmCall(kind, "", (m, k, n), scaled_mm_arguments(a, b, kind), _requests(out_dtype, bias),
                        bool(use_fast_accum) and kind in FAST_ACCUM_KINDS)


def _requests(out_dtype: torch.dtype, bias) -> tuple:
    """(output dtype, fuse the bias) in order: as asked, then the bias unfused, then a bf16 output."""
    requests = [(out_dtype, True)] if bias is not None and out_dtype in _FUSABLE_BIAS_OUT else []
    requests.append((out_dtype, False))
    if out_dtype != torch.bfloat16:
        requests.append((torch.bfloat16, False))
    return tuple(requests)


# ------------------------------------------------------------------------------------------------------------
# Argument layouts
# ------------------------------------------------------------------------------------------------------------
def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.t().is_contiguous() else t.t().contiguous().t()


def _operand_data(op, layout: str) -> torch.Tensor:
    """The operand's bytes row- or column-major. A copy is kept on the operand, so a cached weight operand (one
    per weight version) is copied once, not once per micro-batch."""
    data = op.data
    if (data.is_contiguous() if layout == "row" else data.t().is_contiguous()):
        return data
    # its own copy only: a transposed operand's source holds the other layout
    return op.memo(("layout", layout), lambda: _row_major(data) if layout == "row" else _col_major(data))


def _outer_major(scale: torch.Tensor) -> torch.Tensor:
    """(R, C) scale stored with stride (1, R): the outer dim varies fastest."""
    return scale.float().t().contiguous().t()


def _padded_outer_major(scale: torch.Tensor) -> torch.Tensor:
    """(C, R) tile grid of 128x128 scales -> (L4, C) with stride (1, L4), L4 = R rounded up to 4 (pad = 1)."""
    outer, inner = scale.shape
    padded = torch.ones(outer, -(-inner // 4) * 4, dtype=torch.float32, device=scale.device)
    padded[:, :inner] = scale
    return padded.t()


def swizzle_scales(grid: torch.Tensor) -> torch.Tensor:
    """(R, C) E8M0 scale grid (one per 1x32 block along C) -> cuBLAS's swizzled 1-D layout, as a contiguous
    (round_up(R, 128) * round_up(C, 4),) tensor; padding holds scale 1 and is never read for real rows."""
    rows, cols = grid.shape
    row_tiles, col_tiles = -(-rows // 128), -(-cols // 4)
    codes = torch.full((row_tiles * 128, col_tiles * 4), 127, dtype=torch.uint8, device=grid.device)
    codes[:rows, :cols] = grid.view(torch.uint8) if grid.dtype == torch.float8_e8m0fnu else e8m0_codes(grid)
    # (row tile, 4 row groups i, 32 rows j, col tile, 4 cols c) -> (row tile, col tile, j, i, c)
    tiles = codes.view(row_tiles, 4, 32, col_tiles, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(torch.float8_e8m0fnu)


def scaled_mm_arguments(a, b, kind: str) -> dict:
    """mat_a, mat_b, scale_a, scale_b, the ScalingType names and the swizzle for `kind`, in the kernel's layouts."""
    (m, _), n = a.shape, b.shape[1]
    args = dict(mat_a=_operand_data(a, "row"), mat_b=_operand_data(b, "col"), swizzle=None)
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
    elif kind == "mx_1x32":  # a.scale (M, K/32); b.scale (K/32, N): both swizzled from (outer dim, K/32)
        args.update(scale_a=swizzle_scales(a.scale), scale_b=swizzle_scales(b.scale.t()),
                    recipe_a="BlockWise1x32", recipe_b="BlockWise1x32", swizzle="SWIZZLE_32_4_4")
    else:
        raise ValueError(f"unknown scaled_mm kind {kind!r}; allowed: {', '.join(SCALED_MM_KINDS)}")
    return args
