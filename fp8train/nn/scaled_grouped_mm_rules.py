"""Planning the grouped GEMMs of FP8 experts (nn/experts.py) for torch's grouped FP8 kernel, `torch._scaled_grouped_mm`.

A pure function of the recipe, the token groups, the shapes and the target GPU: it reads no device and runs
nothing, so every call fp8train would make on an sm90 or sm100 GPU can be planned on any machine and replayed on
meta tensors (tests/test_scaled_grouped_mm_replay.py). Where the kernel cannot take a GEMM exactly as the
emulation computes it, the plan is a fallback with its reason: the per-expert loop of nn/experts.py, each expert
through the dense scaled_mm path (nn/scaled_mm_rules.py) or the emulation. nn/experts_scaled_gemm.py makes the
planned calls (rowwise kind). Nothing here has run on a GPU.

The three GEMMs, tokens T sorted by expert with offs (E,) int32, weight W (E, N, K):

| GEMM        | layout  | mat_a (row-major)        | mat_b (column-major)         | scale_a           | scale_b          |
|-------------|---------|--------------------------|------------------------------|-------------------|------------------|
| output      | 2d x 3d | input (T, K)             | W^T (E, K, N): W contiguous  | (T,) per token    | (E, N)           |
| grad_input  | 2d x 3d | grad_output (T, N)       | W (E, N, K): W^T contiguous  | (T,) per token    | (E, K)           |
| grad_weight | 2d x 2d | grad_output^T (N, T)     | input (T, K): input^T contig. | (E * N,)          | (E * K,)         |

A tensorwise scale (delayed, current) is one value per expert and token group: it is passed as these rowwise
vectors with every entry of a group (or expert) equal, which the kernel multiplies exactly as the emulation does.

Rules of torch 2.13 that decide the plan, and where torch states them:
- G1 Both operands float8_e4m3fn (`_meta_grouped_mm_common`: "Expected inputs of E4M3 FP8 type"), so a GEMM
  reading an e5m2 gradient (the hybrid delayed / current recipes' grad_input and grad_weight) has no kernel.
- G2 Scales float32 rowwise, shapes as in the table, or float8_e8m0fnu (MXFP8) for both (same function); there
  is no 1x128 / 128x128 block form, so the block recipe always falls back.
- G3 Every stride of a non-unit dim a multiple of 16 bytes (check_valid_strides): K and N multiples of 16, and
  for grad_weight (stride T) the routed token count a multiple of 16.
- G4 No bias ("Bias tensor provided, but it is not supported yet"); output dtype bf16 only ("If output dtype
  provided, it must be torch.bfloat16"): an fp32 result (grad_weight of fp32 master weights, any GEMM of fp32
  activations) or a fused bias is the fallback's, which rounds once as the emulation does.
- G5 Architecture (torch/testing/_internal/common_cuda.py): float32-scaled FP8 grouped GEMMs on sm90 only
  (PLATFORM_SUPPORTS_FP8_GROUPED_GEMM = SM90OrLater and not SM100OrLater), MXFP8 grouped GEMMs on sm100 in a torch
  built with MSLK (PLATFORM_SUPPORTS_MXFP8_GROUPED_GEMM).
- G6 MXFP8 blocks run along K; a 2d x 2d grad_weight contracts the tokens, so 1x32 blocks along tokens must not
  straddle two experts: planned only when every group size is a multiple of 32. (The per-group swizzled layout
  of a 2-D MX scale is not modelled by torch's meta function; the replay checks its rank only.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8train.nn.recipes import GemmRole, OperandRole, ScalingKind

__all__ = ["GroupedGemmCall", "grouped_gemm_call", "GROUPED_KINDS"]

GROUPED_KINDS = ("rowwise", "mx_1x32")
_OPERANDS = {GemmRole.OUTPUT: (OperandRole.INPUT, OperandRole.WEIGHT),
             GemmRole.GRAD_INPUT: (OperandRole.GRAD_OUTPUT, OperandRole.WEIGHT),
             GemmRole.GRAD_WEIGHT: (OperandRole.GRAD_OUTPUT, OperandRole.INPUT)}


@dataclass(frozen=True)
class GroupedGemmCall:
    """One grouped GEMM: `kind` (one of GROUPED_KINDS) and its call's shapes, or kind None and the `reason`."""

    gemm: str
    kind: str | None
    reason: str = ""
    mat_a: tuple = ()          # (shape, stride) of each argument as passed
    mat_b: tuple = ()
    scale_a: tuple = ()        # shape
    scale_b: tuple = ()
    scale_dtype: torch.dtype = torch.float32
    experts: int = 0

    def arguments(self, device="meta") -> dict:
        """The call's keyword arguments for torch._scaled_grouped_mm (input = mat_a, mat2 = mat_b), as empty
        tensors with the planned shapes and strides."""
        def strided(shape_stride):
            shape, stride = shape_stride
            return torch.empty_strided(shape, stride, dtype=torch.float8_e4m3fn, device=device)
        return dict(input=strided(self.mat_a), mat2=strided(self.mat_b),
                    scale_a=torch.empty(self.scale_a, dtype=self.scale_dtype, device=device),
                    scale_b=torch.empty(self.scale_b, dtype=self.scale_dtype, device=device),
                    offs=torch.empty(self.experts, dtype=torch.int32, device=device), out_dtype=torch.bfloat16)


def _layouts(gemm: str, tokens: int, n: int, k: int, experts: int, mx: bool):
    """(mat_a, mat_b, scale_a shape, scale_b shape) of the table in the module docstring."""
    def row_major(rows, cols):
        return (rows, cols), (cols, 1)

    def col_major_3d(rows, cols):  # (E, rows, cols) whose transpose (E, cols, rows) is contiguous
        return (experts, rows, cols), (rows * cols, 1, rows)
    mx_k = lambda c: -(-(-(-c // 32)) // 4) * 4   # noqa: E731  K/32 rounded up to 4 (the blocked layout)
    mx_rows = lambda r: -(-r // 128) * 128        # noqa: E731
    if gemm == GemmRole.OUTPUT:
        scales = ((tokens, mx_k(k)), (experts, mx_k(k) * mx_rows(n))) if mx else ((tokens,), (experts, n))
        return row_major(tokens, k), col_major_3d(k, n), *scales
    if gemm == GemmRole.GRAD_INPUT:
        scales = ((tokens, mx_k(n)), (experts, mx_k(n) * mx_rows(k))) if mx else ((tokens,), (experts, k))
        return row_major(tokens, n), col_major_3d(n, k), *scales
    scales = ((n * experts, mx_k(tokens)), (k * experts, mx_k(tokens))) if mx else ((experts * n,), (experts * k,))
    return row_major(n, tokens), ((tokens, k), (1, tokens)), *scales


def grouped_gemm_call(recipe, gemm: str, group_sizes: list[int], n: int, k: int, out_dtype: torch.dtype,
                      bias: bool, capability: tuple[int, int], mslk: bool = False) -> GroupedGemmCall:
    """The plan of one grouped GEMM of an experts layer with weight (E, N, K) (module docstring's rules)."""
    gemm = GemmRole(gemm)
    tokens, experts = sum(group_sizes), len(group_sizes)

    def fallback(reason):
        return GroupedGemmCall(gemm, None, reason, experts=experts)
    if recipe.scaling is ScalingKind.BLOCK:
        return fallback("block scales (1x128 / 128x128): the grouped kernel takes rowwise or MX scales only (G2)")
    mx = recipe.is_mx
    if mx and not (capability >= (10, 0) and mslk):
        return fallback("MXFP8 grouped GEMMs need sm100 and a torch built with MSLK (G5)")
    if not mx and not (9, 0) <= capability < (10, 0):
        return fallback("float32-scaled FP8 grouped GEMMs run on sm90 only (G5)")
    for role in _OPERANDS[gemm]:
        if recipe.format_of(role) != "e4m3fn":
            return fallback(f"{role} is {recipe.format_of(role)}; the grouped kernel takes e4m3fn only (G1)")
    if n % 16 or k % 16 or (gemm == GemmRole.GRAD_WEIGHT and tokens % 16):
        return fallback(f"N={n}, K={k}, T={tokens}: strides must be multiples of 16 bytes (G3)")
    if bias and gemm == GemmRole.OUTPUT:
        return fallback("a per-expert bias: the grouped kernel takes none (G4)")
    if out_dtype != torch.bfloat16:
        return fallback(f"a {out_dtype} result: the grouped kernel writes bf16 only (G4)")
    if mx and gemm == GemmRole.GRAD_WEIGHT and any(size % 32 for size in group_sizes):
        return fallback("MXFP8 grad_weight with a group size not a multiple of 32 (G6)")
    mat_a, mat_b, scale_a, scale_b = _layouts(gemm, tokens, n, k, experts, mx)
    return GroupedGemmCall(gemm, "mx_1x32" if mx else "rowwise", "", mat_a, mat_b, scale_a, scale_b,
                           torch.float8_e8m0fnu if mx else torch.float32, experts)
