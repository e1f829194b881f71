"""A model of an FP8 tensor core's narrow accumulator, for the emulated backend.

DeepSeek-V3 (section 3.3.2) reports that FP8 GEMMs on Hopper keep only about 14 bits of the accumulator, and
that promoting the partial sums to fp32 on the CUDA cores every N_C = 128 products along K (four 32-deep WGMMA
instructions) removes most of the resulting error. This module reproduces that arithmetic on any device:

- K is cut into MMA groups of `mma_k` (32) products; each group's products are summed exactly (FP8 x FP8
  products are exact in fp32 and 32 of them barely round);
- each group sum is added into a running accumulator that is then truncated toward zero to
  `accumulator_bits` significant bits (the tensor core aligns and truncates, it does not round);
- every `promotion_interval` products the running accumulator is added into an fp32 total and cleared
  (0 = never: one narrow accumulator over all of K, as with `use_fast_accum=True`).

It is a model, not a bit-exact replica of any GPU: it answers "would the ~14-bit accumulator, or promotion,
matter for this model?" on a CPU. It costs K / mma_k small GEMMs per call, so it is an analysis option, not a
training default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["HopperAccumulation", "hopper_accumulated_mm", "truncate_significand", "accumulation_error_bound"]


@dataclass(frozen=True)
class HopperAccumulation:
    """How the modelled tensor core accumulates."""

    accumulator_bits: int = 14
    """Significant bits (implicit leading one included) the accumulator keeps; fp32 keeps 24."""
    promotion_interval: int = 128
    """Products along K summed in the narrow accumulator before promotion to fp32; 0 = never promote."""
    mma_k: int = 32
    """Products per tensor-core instruction (Hopper FP8 WGMMA: K = 32), summed before each truncation."""

    def __post_init__(self) -> None:
        if isinstance(self.accumulator_bits, bool) or not isinstance(self.accumulator_bits, int) \
                or not 2 <= self.accumulator_bits <= 24:
            raise ValueError(f"accumulator_bits must be an int in [2, 24], got {self.accumulator_bits!r}")
        if isinstance(self.mma_k, bool) or not isinstance(self.mma_k, int) or self.mma_k < 1:
            raise ValueError(f"mma_k must be an int >= 1, got {self.mma_k!r}")
        p = self.promotion_interval
        if isinstance(p, bool) or not isinstance(p, int) or p < 0 or p % self.mma_k:
            raise ValueError(f"promotion_interval must be 0 (never) or a positive multiple of mma_k={self.mma_k}, "
                             f"got {p!r}")


def truncate_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp32 `x` truncated toward zero to `bits` significant bits (clears the low 24 - bits mantissa bits)."""
    if bits >= 24:
        return x
    mask = ~((1 << (24 - bits)) - 1)  # keeps sign, exponent and the top bits - 1 stored mantissa bits
    return (x.contiguous().view(torch.int32) & mask).view(torch.float32)


def hopper_accumulated_mm(a: torch.Tensor, b: torch.Tensor, acc: HopperAccumulation) -> torch.Tensor:
    """fp32 a (M, K) @ b (K, N) accumulated as `acc` describes (see the module docstring)."""
    a, b = a.float(), b.float()
    k = a.shape[1]
    total = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)
    narrow = torch.zeros_like(total)
    since_promotion = 0
    for start in range(0, k, acc.mma_k):
        stop = min(start + acc.mma_k, k)
        group_sum = a[:, start:stop] @ b[start:stop]  # one MMA instruction's exact-ish products
        narrow = truncate_significand(narrow + group_sum, acc.accumulator_bits)
        since_promotion += stop - start
        if acc.promotion_interval and since_promotion >= acc.promotion_interval:
            total += narrow  # promotion: the CUDA cores add the partial sum in fp32
            narrow.zero_()
            since_promotion = 0
    return total + narrow


FP32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def accumulation_error_bound(a: torch.Tensor, b: torch.Tensor, acc: HopperAccumulation | None,
                             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise float64 bound on |tensor-core result - fp32 emulation| for the same dequantized a (M, K) @ b (K, N).

    With S = |a| @ |b| (the sum of the absolute products, which bounds every partial sum):
    - the narrow accumulator truncates after each of the P / mma_k instructions between promotions (P = K when it
      never promotes: fast accumulation); each truncation loses < 2^(1 - bits) of a partial sum <= S of its
      promotion block, and the blocks' losses add: <= (P / mma_k) * 2^(1 - bits) * S;
    - fp32 summation in any order, on each side (the GPU's instruction sums and promotions, the emulation's GEMM),
      errs by <= K * 2^-24 * S to first order (the classic gamma_K bound): 2 K 2^-24 S for the two;
    - a bf16 output rounds each side once, by <= 2^-8 of its value (<= S): 2^-7 S more.
    `acc` None: an exact fp32 accumulator (only the summation orders differ)."""
    s = a.double().abs() @ b.double().abs()
    k = a.shape[1]
    rel = 2 * k * FP32_UNIT_ROUNDOFF
    if acc is not None:
        between = acc.promotion_interval or k
        rel += -(-min(between, k) // acc.mma_k) * 2.0 ** (1 - acc.accumulator_bits)
    if out_dtype in (torch.bfloat16, torch.float16):
        rel += 2 * (BF16_UNIT_ROUNDOFF if out_dtype == torch.bfloat16 else 2.0 ** -11)
    return s * rel
