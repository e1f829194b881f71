"""The compiled quantize divides as eager does: inductor is told to emit IEEE round-to-nearest fp32 division.

Triton's plain `x / y` is an approximate division (div.full); with a scale that is not a power of two a quotient
one ulp off can round to the neighbouring FP8 code. Checked here by inductor's own Triton code generator (it runs
without a GPU): with fp8train's compile options an fp32 division is generated as div_rn, without them it is not.
On a GPU, tests/test_cuda.py compares compiled and eager bytes directly."""

from __future__ import annotations

import pytest
import torch

from fp8train.numerics.quant import eager_division_options


def _triton_division(options: dict) -> str:
    triton = pytest.importorskip("torch._inductor.codegen.triton")
    import torch._inductor.config as inductor_config
    from torch.utils._sympy.value_ranges import ValueRanges

    x = triton.TritonCSEVariable("tmp0", ValueRanges.unknown(), torch.float32, shape=(1,))
    with inductor_config.patch(options):
        return str(triton.TritonOverrides.truediv(x, x))


def test_options_name_an_inductor_switch_of_this_torch():
    options = eager_division_options()
    assert options == {"eager_numerics.division_rounding": True}  # torch 2.11 and 2.13 both have it
    import torch._inductor.config as inductor_config
    assert set(options) <= set(inductor_config.get_config_copy())


def test_compiled_fp32_division_is_round_to_nearest_with_the_options():
    assert "div_rn" in _triton_division(eager_division_options())
    assert "div_rn" not in _triton_division({})  # inductor's default: the approximate division
