"""Names that are their own strings: the base of every enum of names from YAML to kernel.

A member equals, hashes, formats and prints as its value, so a YAML value, a dict key written as a plain string
and an f-string keep working, while code compares members (``granularity is Granularity.ROW``) instead of
spelling the string again (enum.StrEnum would do the same on Python 3.11+ only).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["StrName", "Granularity", "QuantizeKernel"]


class StrName(str, Enum):
    """An enum whose members are their own string values."""

    # printed, formatted and repr'd as the plain string, so messages listing the choices read as before
    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__


class Granularity(StrName):
    """How many scales a cast takes: one per tensor, one per row along an axis, or one per block tile."""

    TENSOR = "tensor"
    ROW = "row"
    BLOCK = "block"


class QuantizeKernel(StrName):
    """The quantize kernels (numerics/cast_kernels.py says which runs where); all give the same bits."""

    EAGER = "eager"        # torch ops one by one: the reference
    NATIVE = "native"      # fp8train's C kernel, CPU
    COMPILED = "compiled"  # the eager chain through torch.compile, for devices without the native kernel
