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
from fp8train.numerics.names import Granularity, StrName

__all__ = ["Fp8Recipe", "recipe", "RECIPE_NAMES", "SCALINGS", "BACKENDS", "ROLES", "GEMMS", "AMAX_COMPUTE_ALGOS",
           "FORMAT_NAMES", "ScalingKind", "GemmBackend", "OperandRole", "GemmRole", "RecipeFieldError", "DEFAULT_RECIPE",
           "BASELINE_RECIPE", "OVERRIDE_BF16", "TENSORWISE_SCALINGS", "MAX_MARGIN",
           "MAX_AMAX_HISTORY"]


class ScalingKind(StrName):
    """How an operand's scale is taken; each kind is also the name of its preset (`recipe(kind)`)."""

    DELAYED = "delayed"    # per tensor, from the amax history of earlier steps
    CURRENT = "current"    # per tensor, from the tensor itself
    ROWWISE = "rowwise"    # per token (input, grad_output), per output channel (weight)
    BLOCK = "block"        # tiles given by the *_block fields
    MXFP8 = "mxfp8"        # OCP MX: 1x32 blocks along the contracted dim, E8M0 scales

    @property
    def granularity(self) -> Granularity:
        """quant.quantize granularity: 'tensor', 'row' or 'block' (the Granularity member)."""
        return Granularity.TENSOR if self.is_tensorwise else Granularity.ROW if self is ScalingKind.ROWWISE \
            else Granularity.BLOCK

    @property
    def is_tensorwise(self) -> bool:
        """One scale per tensor (delayed, current)."""
        return self in (ScalingKind.DELAYED, ScalingKind.CURRENT)


class OperandRole(StrName):
    """The three operands of a linear layer (also the prefixes of its recipe fields and scaling buffers)."""

    INPUT = "input"
    WEIGHT = "weight"
    GRAD_OUTPUT = "grad_output"


class GemmRole(StrName):
    """The three GEMMs of a linear layer: output = input @ weight.T, grad_input = grad_output @ weight,
    grad_weight = grad_output.T @ input (the keys of `Fp8Linear.gemm_paths`)."""

    OUTPUT = "output"
    GRAD_INPUT = "grad_input"
    GRAD_WEIGHT = "grad_weight"


class GemmBackend(StrName):
    """Where a layer's GEMMs run: 'auto' picks per GEMM (nn/gemm.py), 'te' hands the layer to TransformerEngine."""

    AUTO = "auto"
    EMULATED = "emulated"    # FP8 values decoded to bf16/fp32 and multiplied there (any device)
    SCALED_MM = "scaled_mm"  # torch._scaled_mm where torch allows the call on the device
    TE = "te"                # TransformerEngine's modules (nn/te.py)


SCALINGS = tuple(ScalingKind)
TENSORWISE_SCALINGS = tuple(kind for kind in ScalingKind if kind.is_tensorwise)
BACKENDS = tuple(GemmBackend)
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
MX_BLOCK = (1, 32)  # OCP MX: 32 elements along the contracted dim share one E8M0 scale
ROLES = tuple(OperandRole)
GEMMS = tuple(GemmRole)
# E5M2, the widest format, spans 32 binades from min subnormal to max: a larger margin flushes every value.
MAX_MARGIN = 32
# The one list of each kind of name: config, bench, telemetry, GEMM and serving import these. Format names are
# those of fp8train.numerics.formats (FORMAT_NAMES, re-exported here; "e4m3" is an alias of "e4m3fn").
_CANONICAL_FORMAT = ALIASES
_SHORT_FORMAT = {"e4m3fn": "e4m3", "e5m2": "e5m2", "e4m3fnuz": "e4m3fnuz", "e5m2fnuz": "e5m2fnuz"}
# The default recipe of Fp8Recipe(), Fp8Linear, convert_to_fp8's callers, fp8.recipe and validate.candidates:
# TE's DelayedScaling default (hybrid formats, 1024-step history).
DEFAULT_RECIPE = ScalingKind.DELAYED.value
# High precision where a recipe name could stand. Both spellings are public: `fp8.recipe: none` is the baseline
# run (no layer converted); `bf16` is the policy.overrides choice that keeps a layer out of FP8, and the label of
# a validation's baseline runs.
BASELINE_RECIPE = "none"
OVERRIDE_BF16 = "bf16"


class RecipeFieldError(ValueError):
    """An Fp8Recipe field holds a value it cannot take: `field` names it (the config names it `fp8.<field>`)."""

    def __init__(self, field: str, value, allowed: str):
        self.field, self.value = field, value
        super().__init__(f"{field} must be {allowed}, got {value!r}")


# The longest amax history: 64x TransformerEngine's default of 1024. Every delayed layer holds one fp32 history
# per role (3 x 4 bytes x length) and every update rolls all of it, so 100,000,000 once meant a 1.2 GB
# allocation per layer before the first step; a window longer than any run's steps only holds zeros anyway.
MAX_AMAX_HISTORY = 65536


@dataclass(frozen=True)
class Fp8Recipe:
    """How an `Fp8Linear` quantizes its three operands. Build one with `recipe(name, **overrides)`."""

    name: str = DEFAULT_RECIPE
    """Preset this recipe came from (free text, shown in logs)."""
    scaling: ScalingKind = ScalingKind(DEFAULT_RECIPE)
    """A ScalingKind or its name: 'delayed' (per tensor, amax history of earlier steps), 'current' (per tensor,
    own amax), 'rowwise' (per token / per output channel), 'block' (tiles given by the *_block fields) or 'mxfp8'
    (1x32 blocks, E8M0 scales)."""
    input_format: str = "e4m3fn"
    """FP8 format of the layer input (forward activations)."""
    weight_format: str = "e4m3fn"
    """FP8 format of the weight."""
    grad_output_format: str = "e5m2"
    """FP8 format of the gradient flowing into the layer's output (backward)."""
    margin: int = 0
    """Scale headroom in powers of two, in [0, MAX_MARGIN]: scale = amax / fmt.max * 2**margin."""
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
    """Block scaling only: tile (rows, cols) of the input (M, K) sharing one scale (a list is taken too: YAML)."""
    weight_block: tuple[int, int] = (128, 128)
    """Block scaling only: tile (rows, cols) of the weight (N, K) sharing one scale."""
    grad_output_block: tuple[int, int] = (1, 128)
    """Block scaling only: tile (rows, cols) of grad_output (M, N) sharing one scale."""
    backend: str = "auto"
    """GEMM backend: 'auto' (scaled_mm on a capable CUDA GPU, else emulated), 'emulated', 'scaled_mm', 'te'."""
    fast_accum_forward: bool = True
    """scaled_mm only: the forward GEMM uses the tensor core's fast (never promoted) accumulation, as TE and
    torchao do by default; the two backward GEMMs always use the precise (promoted) accumulation. Block and MX
    scales always run precise: cuBLAS refuses fast accumulation with 1x128 / 128x128 tiles, and the MX kernel
    promotes per block (the request is dropped there, so the GEMM still runs in FP8)."""
    accumulator_bits: int = 0
    """emulated only: 0 = exact fp32 accumulation; 2..24 = model a tensor core that keeps this many significant
    bits of the accumulator (Hopper: ~14; see nn/accumulation.py). An analysis option: slow."""
    accumulator_promotion: int = 128
    """emulated with accumulator_bits > 0: products along K between promotions to fp32; 0 = never."""

    def __post_init__(self) -> None:
        """Every field's check, the one place a recipe is validated (the fp8 config section is checked here too):
        a RecipeFieldError names the field; strings and lists from YAML become ScalingKind and tuples here."""
        if self.scaling not in SCALINGS:
            raise RecipeFieldError("scaling", self.scaling, f"one of {', '.join(SCALINGS)}")
        object.__setattr__(self, "scaling", ScalingKind(self.scaling))
        _check_choice("amax_compute_algo", self.amax_compute_algo, AMAX_COMPUTE_ALGOS)
        _check_choice("backend", self.backend, BACKENDS)
        for role in ROLES:
            key = f"{role}_format"
            value = getattr(self, key)
            _check_choice(key, value, FORMAT_NAMES)
            object.__setattr__(self, key, _CANONICAL_FORMAT.get(value, value))
        if not isinstance(self.name, str) or not self.name:
            raise RecipeFieldError("name", self.name, "a non-empty string")
        if not is_int(self.margin) or not 0 <= self.margin <= MAX_MARGIN:
            raise RecipeFieldError("margin", self.margin, f"an int in [0, {MAX_MARGIN}] (powers of two of headroom; "
                                   f"above {MAX_MARGIN} every FP8 value of every format underflows to zero)")
        for key in ("pow2_scales", "fast_accum_forward"):
            if not isinstance(getattr(self, key), bool):
                raise RecipeFieldError(key, getattr(self, key), "a bool")
        if not is_int(self.amax_history_len) or not 1 <= self.amax_history_len <= MAX_AMAX_HISTORY:
            raise RecipeFieldError("amax_history_len", self.amax_history_len, f"an int in [1, {MAX_AMAX_HISTORY}] "
                                   "(steps of amax kept per layer and role; each is memory and work on every update)")
        factor = self.amax_outlier_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) \
                or not (factor == 0 or factor > 1):
            raise RecipeFieldError("amax_outlier_factor", factor, "0 (off) or a number > 1")
        object.__setattr__(self, "amax_outlier_factor", float(factor))
        for role in ROLES:
            key = f"{role}_block"
            block = getattr(self, key)
            if not (isinstance(block, (tuple, list)) and len(block) == 2 and all(
                    is_int(b) and b >= 1 for b in block)):
                raise RecipeFieldError(key, block, "two positive ints (rows, cols), e.g. [1, 128] or [128, 128]")
            object.__setattr__(self, key, tuple(block))
        bits, promotion = self.accumulator_bits, self.accumulator_promotion
        if not is_int(bits) or not (bits == 0 or 2 <= bits <= 24):
            raise RecipeFieldError("accumulator_bits", bits, "0 (exact fp32) or an int in [2, 24]")
        if not is_int(promotion) or promotion < 0 or promotion % 32:
            raise RecipeFieldError("accumulator_promotion", promotion,
                                   "0 (never) or a positive multiple of 32 (the MMA depth)")
        if self.is_mx:
            self._check_mxfp8()
        self._check_scaled_mm_formats()
        # Multi-field rule: FNUZ (MI300) and OCP formats cannot be mixed inside one GEMM.
        dialects = {self.format_of(r).endswith("fnuz") for r in ROLES}
        if len(dialects) > 1:
            raise ValueError("input_format, weight_format and grad_output_format must all be OCP (e4m3fn, e5m2) "
                             "or all FNUZ (e4m3fnuz, e5m2fnuz); got "
                             + ", ".join(self.format_of(r) for r in ROLES))

    def _check_scaled_mm_formats(self) -> None:
        """torch's block (1x128 / 128x128) and MX scaled-matmul kernels take e4m3fn for both operands of every GEMM
        (check_deepseek_recipe / check_mxfp8_recipe): asking the scaled_mm backend for another format there would
        only ever run the dequantized fallback, so the recipe is refused where it is built."""
        if self.backend != GemmBackend.SCALED_MM or self.scaling not in (ScalingKind.BLOCK, ScalingKind.MXFP8):
            return
        for role in ROLES:
            if self.format_of(role) != "e4m3fn":
                raise RecipeFieldError(f"{role}_format", self.format_of(role),
                                       f"e4m3fn with scaling={self.scaling.value!r} on backend='scaled_mm' (torch's "
                                       f"block and MX FP8 kernels take e4m3fn operands only; backend='emulated' "
                                       f"studies other formats)")

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

    def granularity_of(self, role: str) -> Granularity:
        """quant.quantize granularity of `role`: 'tensor', 'row' or 'block'."""
        return self.scaling.granularity

    def requantize_transposed(self, role: str) -> bool:
        """Whether `role` is quantized again along its other axis for the backward GEMM that contracts its
        first dim (weight in grad_input; input and grad_output in grad_weight): per-row scales and non-square
        tiles would otherwise vary along that GEMM's contracted dim."""
        if self.is_tensorwise:
            return False
        if self.scaling is ScalingKind.ROWWISE:
            return True
        rows, cols = self.block_of(role)
        return rows != cols

    def block_of(self, role: str) -> tuple[int, int]:
        """Tile of `role` for block scaling (ignored otherwise)."""
        return getattr(self, f"{role}_block")

    @property
    def is_delayed(self) -> bool:
        """Scales from the amax history of earlier steps (the layer keeps per-role history buffers)."""
        return self.scaling is ScalingKind.DELAYED

    @property
    def is_tensorwise(self) -> bool:
        """One scale per tensor (delayed, current): the only kind whose FP8 weight shards gather as codes."""
        return self.scaling.is_tensorwise

    @property
    def is_mx(self) -> bool:
        """OCP MX scaling (mxfp8): 1x32 blocks with E8M0 scales from the MX rule, not from margin or pow2."""
        return self.scaling is ScalingKind.MXFP8

    @property
    def is_tiled(self) -> bool:
        """Scales per tile (block, mxfp8): the *_block fields apply."""
        return self.scaling.granularity == Granularity.BLOCK

    def code(self) -> str:
        """Compact code for extra_repr and logs, e.g. 'delayed:e4m3/e4m3/e5m2:h1024max:m0'."""
        fmts = "/".join(_SHORT_FORMAT[self.format_of(r)] for r in ROLES)
        parts = [self.scaling, fmts]
        if self.is_delayed:
            parts.append(f"h{self.amax_history_len}{'max' if self.amax_compute_algo == 'max' else 'recent'}")
            if self.amax_outlier_factor:
                parts.append(f"o{self.amax_outlier_factor:g}")
        if self.is_tiled:
            parts.append("b" + ",".join(f"{r}x{c}" for r, c in (self.block_of(x) for x in ROLES)))
        parts.append(f"m{self.margin}")
        if self.pow2_scales:
            parts.append("pow2")
        if self.backend != GemmBackend.AUTO:
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


# One preset per scaling kind, named after it (its `scaling`); the field values each preset sets.
_PRESETS: dict[ScalingKind, dict] = {
    # TE's DelayedScaling defaults: HYBRID formats, 1024-step history, max.
    ScalingKind.DELAYED: dict(grad_output_format="e5m2", amax_history_len=1024, amax_compute_algo="max"),
    # torchao's default float8 recipe: dynamic tensorwise, E4M3 forward, E5M2 backward.
    ScalingKind.CURRENT: dict(grad_output_format="e5m2"),
    # torchao's "rowwise": per-row scales are narrow enough that E4M3 suffices for gradients too.
    ScalingKind.ROWWISE: dict(grad_output_format="e4m3fn", pow2_scales=True),
    # DeepSeek-V3: 1x128 activation/gradient tiles, 128x128 weight tiles, all E4M3, pow2 scales.
    ScalingKind.BLOCK: dict(grad_output_format="e4m3fn", pow2_scales=True,
                            input_block=(1, 128), weight_block=(128, 128), grad_output_block=(1, 128)),
    # OCP MX: E4M3 elements in 1x32 blocks along the contracted dim, one E8M0 (power-of-two) scale per block.
    ScalingKind.MXFP8: dict(grad_output_format="e4m3fn", input_block=MX_BLOCK, weight_block=MX_BLOCK,
                            grad_output_block=MX_BLOCK),
}
RECIPE_NAMES = tuple(kind.value for kind in _PRESETS)  # plain strings, in preset order


def recipe(name: str, **overrides) -> Fp8Recipe:
    """The preset `name` (one of RECIPE_NAMES) with `overrides` applied; validated."""
    if isinstance(name, Fp8Recipe):
        return name.replace(**overrides) if overrides else name
    if name not in _PRESETS:
        raise ValueError(f"unknown FP8 recipe {name!r}; allowed: {', '.join(RECIPE_NAMES)}")
    _check_fields(overrides)
    kind = ScalingKind(name)
    return Fp8Recipe(**{"name": kind.value, "scaling": kind, **_PRESETS[kind], **overrides})


def _check_fields(overrides: dict) -> None:
    valid = [f.name for f in dataclasses.fields(Fp8Recipe)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown Fp8Recipe field(s) {', '.join(unknown)}; valid fields: {', '.join(valid)}")


def is_int(x) -> bool:
    """An int that is not a bool (YAML's true/false must not pass as 1/0)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_choice(key: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise RecipeFieldError(key, value, f"one of {', '.join(allowed)}")

