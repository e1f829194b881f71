"""FP8 training recipes: one general, validated `Fp8Recipe` and the named presets built over it.

A recipe says, for each operand role of a linear layer (input, weight, grad_output), which FP8 format it is
cast to and at which granularity its scale is taken, plus how scales are computed:

| preset    | scaling                               | input  / weight / grad_output   | scales           |
|-----------|---------------------------------------|---------------------------------|------------------|
| delayed   | per tensor, from an amax history      | e4m3fn / e4m3fn / e5m2 (hybrid) | fp32             |
| current   | per tensor, from the tensor itself    | e4m3fn / e4m3fn / e5m2 (hybrid) | fp32             |
| rowwise   | per token (input, grad_output),       | e4m3fn / e4m3fn / e4m3fn        | powers of two    |
|           | per output channel (weight)           |                                 |                  |
| block     | 1x128 tiles (input, grad_output),     | e4m3fn / e4m3fn / e4m3fn        | powers of two    |
|           | 128x128 tiles (weight); DeepSeek-V3   |                                 |                  |
| mxfp8     | 1x32 blocks along the contracted dim  | e4m3fn / e4m3fn / e4m3fn        | E8M0 (OCP MX)    |
|           | of every GEMM, every operand          |                                 |                  |

Each GEMM wants its operands' scales along its NON-contracted dims (or tiles along K). The forward GEMM contracts
the input's and weight's last dim, but grad_input contracts the weight's first dim and grad_weight the first dim
of input and grad_output. For rowwise, mxfp8, and block tiles that are not square, those backward operands are
therefore quantized a second time, from high precision, along the other axis (`Fp8Recipe.requantize_transposed`),
as torchao (rowwise), DeepSeek-V3 (1x128 -> 128x1) and the MX training recipe do.

`recipe("delayed", amax_history_len=16)` builds a preset with overrides; unknown names and invalid values raise a
`ValueError` that says what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fp8train.numerics.formats import ALIASES, FORMAT_NAMES

__all__ = ["Fp8Recipe", "recipe", "RECIPE_NAMES", "SCALINGS", "BACKENDS", "ROLES", "AMAX_COMPUTE_ALGOS", "FORMAT_NAMES",
           "MAX_AMAX_HISTORY"]

SCALINGS = ("delayed", "current", "rowwise", "block", "mxfp8")
RECIPE_NAMES = SCALINGS  # one preset per scaling kind
BACKENDS = ("auto", "emulated", "scaled_mm", "te")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
MX_BLOCK = (1, 32)  # OCP MX: 32 elements along the contracted dim share one E8M0 scale
ROLES = ("input", "weight", "grad_output")
# The one list of each kind of name: config, bench, telemetry, GEMM and serving import these. Format names are
# those of fp8train.numerics.formats (FORMAT_NAMES, re-exported here; "e4m3" is an alias of "e4m3fn").
_CANONICAL_FORMAT = ALIASES
_SHORT_FORMAT = {"e4m3fn": "e4m3", "e5m2": "e5m2", "e4m3fnuz": "e4m3fnuz", "e5m2fnuz": "e5m2fnuz"}


# The longest amax history: 64x TransformerEngine's default of 1024. Every delayed layer holds one fp32 history
# per role (3 x 4 bytes x length) and every update rolls all of it, so 100,000,000 once meant a 1.2 GB
# allocation per layer before the first step; a window longer than any run's steps only holds zeros anyway.
MAX_AMAX_HISTORY = 65536


@dataclass(frozen=True)
class Fp8Recipe:
    """How an `Fp8Linear` quantizes its three operands. Build one with `recipe(name, **overrides)`."""

    name: str = "current"
    """Preset this recipe came from (free text, shown in logs)."""
    scaling: str = "current"
    """'delayed' (per tensor, amax history of earlier steps), 'current' (per tensor, own amax),
    'rowwise' (per token / per output channel) or 'block' (tiles given by the *_block fields)."""
    input_format: str = "e4m3fn"
    """FP8 format of the layer input (forward activations)."""
    weight_format: str = "e4m3fn"
    """FP8 format of the weight."""
    grad_output_format: str = "e5m2"
    """FP8 format of the gradient flowing into the layer's output (backward)."""
    margin: int = 0
    """Scale headroom in powers of two: scale = amax / fmt.max * 2**margin."""
    pow2_scales: bool = False
    """Round every scale up to a power of two (exact rescaling, nothing clips)."""
    amax_history_len: int = 1024
    """Delayed scaling only: number of earlier steps whose amax is kept."""
    amax_compute_algo: str = "max"
    """Delayed scaling only: 'max' of the history or its 'most_recent' entry."""
    amax_outlier_factor: float = 0.0
    """Delayed scaling with 'max' only, opt-in (0 = off; else > 1): when the largest history entry is more than
    this factor times the second largest (> 0), the scale comes from the second largest, so one outlier step
    does not flush the next amax_history_len steps to zero (see fp8train.nn.linear)."""
    input_block: tuple[int, int] = (1, 128)
    """Block scaling only: tile (rows, cols) of the input (M, K) sharing one scale."""
    weight_block: tuple[int, int] = (128, 128)
    """Block scaling only: tile (rows, cols) of the weight (N, K) sharing one scale."""
    grad_output_block: tuple[int, int] = (1, 128)
    """Block scaling only: tile (rows, cols) of grad_output (M, N) sharing one scale."""
    backend: str = "auto"
    """GEMM backend: 'auto' (scaled_mm on a capable CUDA GPU, else emulated), 'emulated', 'scaled_mm', 'te'."""
    fast_accum_forward: bool = True
    """scaled_mm only: the forward GEMM uses the tensor core's fast (never promoted) accumulation, as TE and
    torchao do by default; the two backward GEMMs always use the precise (promoted) accumulation."""
    accumulator_bits: int = 0
    """emulated only: 0 = exact fp32 accumulation; 2..24 = model a tensor core that keeps this many significant
    bits of the accumulator (Hopper: ~14; see nn/accumulation.py). An analysis option: slow."""
    accumulator_promotion: int = 128
    """emulated with accumulator_bits > 0: products along K between promotions to fp32; 0 = never."""

    def __post_init__(self) -> None:
        _check_choice("scaling", self.scaling, SCALINGS)
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _check_choice("backend", self.backend, BACKENDS)
        for role in ROLES:
            key = f"{role}_format"
            value = getattr(self, key)
            _check_choice(key, value, FORMAT_NAMES)
            object.__setattr__(self, key, _CANONICAL_FORMAT.get(value, value))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if isinstance(self.margin, bool) or not isinstance(self.margin, int):
            raise ValueError(f"margin must be an int (powers of two of headroom), got {self.margin!r}")
        if not isinstance(self.pow2_scales, bool):
            raise ValueError(f"pow2_scales must be a bool, got {self.pow2_scales!r}")
        if isinstance(self.amax_history_len, bool) or not isinstance(self.amax_history_len, int) \
                or not 1 <= self.amax_history_len <= MAX_AMAX_HISTORY:
            raise ValueError(f"amax_history_len must be an int in [1, {MAX_AMAX_HISTORY}], got "
                             f"{self.amax_history_len!r}")
        factor = self.amax_outlier_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or not (factor == 0 or factor > 1):
            raise ValueError(f"amax_outlier_factor must be 0 (off) or a number > 1, got {factor!r}")
        object.__setattr__(self, "amax_outlier_factor", float(factor))
        for role in ROLES:
            key = f"{role}_block"
            block = getattr(self, key)
            ok = isinstance(block, (tuple, list)) and len(block) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)
            if not ok:
                raise ValueError(f"{key} must be two positive ints (rows, cols), got {block!r}")
            object.__setattr__(self, key, tuple(block))
        for key in ("fast_accum_forward",):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key} must be a bool, got {getattr(self, key)!r}")
        bits, promotion = self.accumulator_bits, self.accumulator_promotion
        if isinstance(bits, bool) or not isinstance(bits, int) or not (bits == 0 or 2 <= bits <= 24):
            raise ValueError(f"accumulator_bits must be 0 (exact fp32) or an int in [2, 24], got {bits!r}")
        if isinstance(promotion, bool) or not isinstance(promotion, int) or promotion < 0 or promotion % 32:
            raise ValueError(f"accumulator_promotion must be 0 (never) or a positive multiple of 32 (the MMA "
                             f"depth), got {promotion!r}")
        if self.scaling == "mxfp8":
            self._check_mxfp8()
        # Multi-field rule: FNUZ (MI300) and OCP formats cannot be mixed inside one GEMM.
        dialects = {self.format_of(r).endswith("fnuz") for r in ROLES}
        if len(dialects) > 1:
            raise ValueError("input_format, weight_format and grad_output_format must all be OCP (e4m3fn, e5m2) "
                             "or all FNUZ (e4m3fnuz, e5m2fnuz); got "
                             + ", ".join(self.format_of(r) for r in ROLES))

    def _check_mxfp8(self) -> None:
        tiles = {r: self.block_of(r) for r in ROLES}
        if any(t != MX_BLOCK for t in tiles.values()):
            raise ValueError(f"scaling='mxfp8' uses 1x32 blocks for every operand (OCP MX); got "
                             + ", ".join(f"{r}_block={t}" for r, t in tiles.items()))
        if self.margin != 0 or self.pow2_scales:
            raise ValueError("scaling='mxfp8' takes its E8M0 scales from the OCP MX rule: margin must be 0 and "
                             "pow2_scales False (the scales are powers of two already)")
        if any(self.format_of(r).endswith("fnuz") for r in ROLES):
            raise ValueError("scaling='mxfp8' elements are OCP formats (e4m3fn, e5m2), not FNUZ")

    # --- per-role views used by Fp8Linear -------------------------------------------------------------------
    def format_of(self, role: str) -> str:
        """Format name of operand `role` ('input', 'weight' or 'grad_output')."""
        return getattr(self, f"{role}_format")

    def granularity_of(self, role: str) -> str:
        """quant.quantize granularity of `role`: 'tensor', 'row' or 'block'."""
        return {"delayed": "tensor", "current": "tensor", "rowwise": "row", "block": "block",
                "mxfp8": "block"}[self.scaling]

    def requantize_transposed(self, role: str) -> bool:
        """Whether `role` is quantized again along its other axis for the backward GEMM that contracts its
        first dim (weight in grad_input; input and grad_output in grad_weight): per-row scales and non-square
        tiles would otherwise vary along that GEMM's contracted dim."""
        if self.is_tensorwise:
            return False
        if self.scaling == "rowwise":
            return True
        rows, cols = self.block_of(role)
        return rows != cols

    def block_of(self, role: str) -> tuple[int, int]:
        """Tile of `role` for block scaling (ignored otherwise)."""
        return getattr(self, f"{role}_block")

    @property
    def is_delayed(self) -> bool:
        return self.scaling == "delayed"

    @property
    def is_tensorwise(self) -> bool:
        return self.scaling in ("delayed", "current")

    def code(self) -> str:
        """Compact code for extra_repr and logs, e.g. 'delayed:e4m3/e4m3/e5m2:h1024max:m0'."""
        fmts = "/".join(_SHORT_FORMAT[self.format_of(r)] for r in ROLES)
        parts = [self.scaling, fmts]
        if self.scaling == "delayed":
            parts.append(f"h{self.amax_history_len}{'max' if self.amax_compute_algo == 'max' else 'recent'}")
            if self.amax_outlier_factor:
                parts.append(f"o{self.amax_outlier_factor:g}")
        if self.scaling in ("block", "mxfp8"):
            parts.append("b" + ",".join(f"{r}x{c}" for r, c in (self.block_of(x) for x in ROLES)))
        parts.append(f"m{self.margin}")
        if self.pow2_scales:
            parts.append("pow2")
        if self.backend != "auto":
            parts.append(self.backend)
        if not self.fast_accum_forward:
            parts.append("precisefwd")
        if self.accumulator_bits:
            parts.append(f"acc{self.accumulator_bits}p{self.accumulator_promotion}")
        return ":".join(parts)

    def replace(self, **overrides) -> "Fp8Recipe":
        """A copy with some fields changed (validated like `recipe`)."""
        _check_fields(overrides)
        return dataclasses.replace(self, **overrides)


_PRESETS: dict[str, dict] = {
    # TE's DelayedScaling defaults: HYBRID formats, 1024-step history, max.
    "delayed": dict(scaling="delayed", grad_output_format="e5m2", amax_history_len=1024, amax_compute_algo="max"),
    # torchao's default float8 recipe: dynamic tensorwise, E4M3 forward, E5M2 backward.
    "current": dict(scaling="current", grad_output_format="e5m2"),
    # torchao's "rowwise": per-row scales are narrow enough that E4M3 suffices for gradients too.
    "rowwise": dict(scaling="rowwise", grad_output_format="e4m3fn", pow2_scales=True),
    # DeepSeek-V3: 1x128 activation/gradient tiles, 128x128 weight tiles, all E4M3, pow2 scales.
    "block": dict(scaling="block", grad_output_format="e4m3fn", pow2_scales=True,
                  input_block=(1, 128), weight_block=(128, 128), grad_output_block=(1, 128)),
    # OCP MX: E4M3 elements in 1x32 blocks along the contracted dim, one E8M0 (power-of-two) scale per block.
    "mxfp8": dict(scaling="mxfp8", grad_output_format="e4m3fn", input_block=(1, 32), weight_block=(1, 32),
                  grad_output_block=(1, 32)),
}


def recipe(name: str, **overrides) -> Fp8Recipe:
    """The preset `name` (one of RECIPE_NAMES) with `overrides` applied; validated."""
    if isinstance(name, Fp8Recipe):
        return name.replace(**overrides) if overrides else name
    if name not in _PRESETS:
        raise ValueError(f"unknown FP8 recipe {name!r}; allowed: {', '.join(RECIPE_NAMES)}")
    _check_fields(overrides)
    return Fp8Recipe(**{"name": name, **_PRESETS[name], **overrides})


def _check_fields(overrides: dict) -> None:
    valid = [f.name for f in dataclasses.fields(Fp8Recipe)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown Fp8Recipe field(s) {', '.join(unknown)}; valid fields: {', '.join(valid)}")


def _check_choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{key} must be one of {', '.join(allowed)}; got {value!r}")
