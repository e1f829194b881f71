"""FP8 formats defined by their bits.

A format is four facts: exponent bits, mantissa bits, exponent bias, and where its special values live. Every
other number (max, smallest normal, smallest subnormal, spacing, binades) is derived from those, so the table
printed by ``fp8train formats`` is a consequence of the bit layout rather than a list of remembered constants.

Three special-value conventions exist among the FP8 formats in use:

- ``ieee``  (OCP e5m2): the all-ones exponent is reserved, mantissa 0 is +-inf, anything else is NaN.
- ``fn``    (OCP e4m3fn, "finite"): no inf; only S.1111.111 is NaN, so the top binade keeps 7 of its 8 codes.
- ``fnuz``  (AMD MI300 e4m3fnuz / e5m2fnuz, "finite, no negative zero"): no inf, no -0; the code 0x80 that
  would be -0 is the single NaN, and every exponent field is an ordinary binade.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["Fp8Format", "FORMATS", "ALIASES", "FORMAT_NAMES", "get_format", "format_table"]


@dataclass(frozen=True)
class Fp8Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    special: str  # "ieee" | "fn" | "fnuz", see the module docstring
    # Derived in __post_init__ (read on every cast: plain attributes, which torch.compile also reads as constants)
    max: float = field(init=False, repr=False, compare=False)
    step_at_max: float = field(init=False, repr=False, compare=False)  # spacing of the two largest finite values
    torch_dtype: torch.dtype = field(init=False, repr=False, compare=False)  # None where torch has no such dtype

    def __post_init__(self):
        e, m = self._max_fields
        object.__setattr__(self, "max", math.ldexp(1.0 + m / (1 << self.mantissa_bits), e - self.bias))
        # half of it is the rounding slack above max
        object.__setattr__(self, "step_at_max", math.ldexp(1.0, e - self.bias - self.mantissa_bits))
        object.__setattr__(self, "torch_dtype", _TORCH_DTYPES.get(self.name))

    # ---- special-value rules -----------------------------------------------------------------------------------
    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_negative_zero(self) -> bool:
        return self.special != "fnuz"

    @property
    def nan_codes(self) -> tuple[int, ...]:
        exp_ones, man_ones = self._exp_field_max, self._man_mask
        if self.special == "fnuz":
            return (0x80,)
        if self.special == "fn":
            return tuple(s << 7 | exp_ones << self.mantissa_bits | man_ones for s in (0, 1))
        return tuple(
            s << 7 | exp_ones << self.mantissa_bits | m for s in (0, 1) for m in range(1, man_ones + 1)
        )

    # ---- derived numbers --------------------------------------------------------------------------------------
    @property
    def _exp_field_max(self) -> int:
        return (1 << self.exponent_bits) - 1

    @property
    def _man_mask(self) -> int:
        return (1 << self.mantissa_bits) - 1

    @property
    def _max_fields(self) -> tuple[int, int]:
        """(exponent field, mantissa field) of the largest finite value."""
        if self.special == "ieee":  # top exponent reserved for inf/NaN
            return self._exp_field_max - 1, self._man_mask
        if self.special == "fn":  # top exponent usable except the all-ones mantissa (NaN)
            return self._exp_field_max, self._man_mask - 1
        return self._exp_field_max, self._man_mask  # fnuz: NaN lives at 0x80, the top binade is whole

    @property
    def max_derivation(self) -> str:
        e, m = self._max_fields
        frac = f"{(1 << self.mantissa_bits) + m}/{1 << self.mantissa_bits}"
        return f"2^({e}-{self.bias}) * {frac}"

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return math.ldexp(1.0, 1 - self.bias - self.mantissa_bits)

    @property
    def step(self) -> float:
        """Spacing of representable values in [1, 2)."""
        return math.ldexp(1.0, -self.mantissa_bits)

    @property
    def max_rel_error(self) -> float:
        """Worst relative rounding error in the normal range: half a step at the bottom of a binade."""
        return self.step / 2

    @property
    def binades(self) -> float:
        """Dynamic range in powers of two, from the smallest subnormal to the max."""
        return math.log2(self.max / self.min_subnormal)

    # ---- reference encode / decode (pure Python, exact) -----------------------------------------------------
    def decode(self, code: int) -> float:
        if not 0 <= code <= 0xFF:
            raise ValueError(f"code must be an int in [0, 255], got {code!r}")
        if code in self.nan_codes:
            return math.nan
        sign = -1.0 if code & 0x80 else 1.0
        exp_field = (code >> self.mantissa_bits) & self._exp_field_max
        man_field = code & self._man_mask
        if self.special == "ieee" and exp_field == self._exp_field_max:
            return sign * math.inf
        if exp_field == 0:  # subnormal: no implicit leading one
            return sign * man_field * self.min_subnormal
        return sign * math.ldexp(1.0 + man_field / (1 << self.mantissa_bits), exp_field - self.bias)

    def encode(self, value: float, saturate: bool = True) -> int:
        """Round to nearest, ties to even. ``saturate``: out-of-range values clip to +-max; otherwise they become
        inf (ieee) or NaN. inf itself saturates to max as well (the OCP saturating-conversion rule)."""
        value = float(value)
        if math.isnan(value):
            return self.nan_codes[0]
        sign_bit = 0x80 if math.copysign(1.0, value) < 0 else 0
        mag = abs(value)
        if mag == 0.0:
            return sign_bit if self.has_negative_zero else 0
        if math.isinf(mag):
            return self._overflow_code(sign_bit, saturate)
        # Quantum (spacing) at this magnitude: fixed below min normal, 2^(e - mantissa_bits) above.
        if mag < self.min_normal:
            quantum = self.min_subnormal
        else:
            quantum = math.ldexp(1.0, math.frexp(mag)[1] - 1 - self.mantissa_bits)
        rounded = round(mag / quantum) * quantum  # exact division by a power of 2; round() is ties-to-even
        if rounded > self.max:
            return self._overflow_code(sign_bit, saturate)
        if rounded == 0.0:
            return sign_bit if self.has_negative_zero else 0
        return sign_bit | self._magnitude_code(rounded)

    def _overflow_code(self, sign_bit: int, saturate: bool) -> int:
        if saturate:
            return sign_bit | self._magnitude_code(self.max)
        if self.has_inf:
            return sign_bit | self._exp_field_max << self.mantissa_bits
        return self.nan_codes[0]

    def _magnitude_code(self, mag: float) -> int:
        """Code of an exactly representable positive value."""
        if mag < self.min_normal:
            return int(mag / self.min_subnormal)
        exponent = math.frexp(mag)[1] - 1
        man_field = int((mag / math.ldexp(1.0, exponent) - 1.0) * (1 << self.mantissa_bits))
        return (exponent + self.bias) << self.mantissa_bits | man_field

    def describe(self) -> dict:
        """Everything the derivation table shows, as plain JSON-able values."""
        return {
            "name": self.name,
            "exponent_bits": self.exponent_bits,
            "mantissa_bits": self.mantissa_bits,
            "bias": self.bias,
            "max": self.max,
            "max_derivation": self.max_derivation,
            "min_normal": self.min_normal,
            "min_normal_log2": math.log2(self.min_normal),
            "min_subnormal": self.min_subnormal,
            "min_subnormal_log2": math.log2(self.min_subnormal),
            "step": self.step,
            "max_rel_error": self.max_rel_error,
            "binades": round(self.binades, 1),
            "has_inf": self.has_inf,
            "has_negative_zero": self.has_negative_zero,
            "nan_codes": [f"0x{c:02X}" for c in self.nan_codes],
            "torch_dtype": str(self.torch_dtype),
        }


_TORCH_DTYPES = {
    "e4m3fn": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "e4m3fnuz": torch.float8_e4m3fnuz,
    "e5m2fnuz": torch.float8_e5m2fnuz,
}

FORMATS: dict[str, Fp8Format] = {
    "e4m3fn": Fp8Format("e4m3fn", exponent_bits=4, mantissa_bits=3, bias=7, special="fn"),
    "e5m2": Fp8Format("e5m2", exponent_bits=5, mantissa_bits=2, bias=15, special="ieee"),
    # FNUZ biases are one higher: the freed 0x80 code costs no binade, so the range shifts down by 2x.
    "e4m3fnuz": Fp8Format("e4m3fnuz", exponent_bits=4, mantissa_bits=3, bias=8, special="fnuz"),
    "e5m2fnuz": Fp8Format("e5m2fnuz", exponent_bits=5, mantissa_bits=2, bias=16, special="fnuz"),
}
ALIASES = {"e4m3": "e4m3fn"}
FORMAT_NAMES: tuple[str, ...] = (*FORMATS, *ALIASES)  # every name get_format accepts


def get_format(name: str | Fp8Format) -> Fp8Format:
    """Look a format up by name (``e4m3fn``/``e4m3``, ``e5m2``, ``e4m3fnuz``, ``e5m2fnuz``) or pass one through."""
    if isinstance(name, Fp8Format):
        return name
    key = ALIASES.get(name, name) if isinstance(name, str) else None
    if key not in FORMATS:
        allowed = ", ".join(FORMAT_NAMES)
        raise ValueError(f"unknown FP8 format {name!r}; allowed: {allowed}")
    return FORMATS[key]


def _pow2(value: float) -> str:
    return f"2^{int(math.log2(value))}"


def format_table() -> str:
    """The derivation table as aligned text."""
    header = ["format", "E/M", "bias", "max (= derivation)", "min normal", "min subnormal", "step [1,2)",
              "max rel err", "binades", "inf", "-0", "NaN codes"]
    rows = []
    for fmt in FORMATS.values():
        rows.append([
            fmt.name, f"{fmt.exponent_bits}/{fmt.mantissa_bits}", str(fmt.bias),
            f"{fmt.max:g} = {fmt.max_derivation}", _pow2(fmt.min_normal), _pow2(fmt.min_subnormal),
            _pow2(fmt.step), f"{fmt.max_rel_error:.2%}", f"{fmt.binades:.1f}",
            "yes" if fmt.has_inf else "no", "yes" if fmt.has_negative_zero else "no",
            ",".join(f"0x{c:02X}" for c in fmt.nan_codes[:2]) + (",..." if len(fmt.nan_codes) > 2 else ""),
        ])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
