r"""Swap a model's eligible `nn.Linear` layers for `Fp8Linear`, following a `LayerPolicy`, and say what was done.

    report = convert_to_fp8(model, recipe("delayed"))
    print(report)             # every Linear: converted, or skipped with the reason

The swap is in place and reuses the Linear's Parameter objects, so an optimizer built before the swap still
updates the right tensors and the model's parameter count does not change.

The default policy keeps out of FP8 what usually hurts or does not pay (docs/design.md): embeddings, the output
head (its logits feed a softmax over the vocabulary), MoE routers (a small top-k decision that flips under
rounding) and layers too small or oddly shaped for FP8 tensor cores (dims must be multiples of 16).

`LayerPolicy.exclude` ADDS patterns to `DEFAULT_EXCLUDE`; `exclude_defaults=False` drops the defaults, so the
patterns given are the whole list. A given pattern that matches no Linear of the model is an error (a typo, or a
pattern written for another model), raised before anything is swapped; the defaults may match nothing.

Which names patterns see: the dotted module names of the model converted, and, for a model that wraps another
under a prefix (fp8train's HFCausalLM holds the transformers model as `hf.`, declared by its
`wrapped_name_prefix`), the same names without that prefix too: `^model\.layers\.0\.` and
`^hf\.model\.layers\.0\.` both match `hf.model.layers.0.mlp.up_proj`. A layer matches when any of its names
does (exclude and policy.overrides alike).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import torch.nn as nn

from fp8train.nn.convert_experts import (attach_experts, attach_grouped, count_other_weights, is_grouped,
                                         choose_expert_swaps, choose_grouped_swaps)
from fp8train.nn.linear import Fp8Linear, update_fp8_scales  # noqa: F401  (update_fp8_scales re-exported)
from fp8train.nn.fp8_record import attach_fp8_record
from fp8train.nn.linear_subclasses import check_plain_linear
from fp8train.nn.master_weights import DEFAULT_MASTER_WEIGHTS, check_master_weights_choice, ensure_fp32_masters
from fp8train.nn.overrides import OVERRIDE_BF16, first_override, normalize_overrides, unmatched_patterns
from fp8train.nn.recipes import DEFAULT_RECIPE, Fp8Recipe, recipe as make_recipe

__all__ = ["LayerPolicy", "ConversionReport", "convert_to_fp8", "fp8_layers", "update_fp8_scales",
           "DEFAULT_EXCLUDE", "block_index", "fp8_from_conv1d", "is_conv1d", "policy_names"]

# THE default exclude list (fp8train.training.config's policy.exclude defaults to it). Each pattern is anchored
# on a whole name component, ^(.*\.)?NAME$, so it means the same under re.search, re.match and re.fullmatch:
# `mlp.gate` (an MoE router) is excluded while `mlp.gate_proj` (a SwiGLU projection) is not.
DEFAULT_EXCLUDE: tuple[str, ...] = (
    r"^(.*\.)?(embed|embed_tokens|embeddings|tok_embeddings|wte|wpe)$",  # embeddings (when wrapped as Linear)
    r"^(.*\.)?(lm_head|output|head|output_proj|classifier|score)$",  # output heads: logits feed a softmax
    r"^(.*\.)?(router|gate|shared_expert_gate)$",  # MoE routers: a top-k decision that flips under rounding
)

_BLOCK_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class LayerPolicy:
    """Which nn.Linear layers become FP8. Its defaults are THE layer-policy defaults: the config's `policy`
    section takes its defaults from here, so `fp8train train` converts what `convert_to_fp8` converts."""

    min_features: int = 64
    """Skip layers whose in_features or out_features is smaller: too little work to gain from FP8."""
    divisible_by: int = 16
    """Skip layers whose in_features or out_features is not a multiple (FP8 tensor-core GEMMs need 16)."""
    exclude: tuple[str, ...] = ()
    """Regexes (re.search on the dotted module name) ADDED to DEFAULT_EXCLUDE; a match keeps the layer in high
    precision. Each must match some Linear of the model converted."""
    exclude_defaults: bool = True
    """Apply DEFAULT_EXCLUDE as well; False: `exclude` is the whole list (e.g. to put the output head in FP8)."""
    skip_first_blocks: int = 0
    """Keep the first N transformer blocks (names matching r'layers\\.(\\d+)\\.') in high precision."""
    skip_last_blocks: int = 0
    """Keep the last N transformer blocks in high precision."""
    overrides: tuple[tuple[str, str], ...] = ()
    """Per-layer recipes: ordered (regex, recipe name or 'bf16') pairs, or a {regex: choice} mapping; the first
    pattern that re.searches a converted layer's name decides its recipe (nn/overrides.py)."""
    linear_subclasses: tuple[str, ...] = ()
    """Class names of nn.Linear subclasses whose forward is plain x @ W.T + b (e.g. 'FalconLinear'), converted
    like nn.Linear; each is checked on a random input first (nn/linear_subclasses.py). Others are skipped."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", normalize_overrides(self.overrides))
        for key in ("min_features", "divisible_by", "skip_first_blocks", "skip_last_blocks"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"LayerPolicy.{key} must be an int >= 0, got {value!r}")
        if self.divisible_by == 0:
            raise ValueError("LayerPolicy.divisible_by must be >= 1 (use 1 to accept any size)")
        exclude = (self.exclude,) if isinstance(self.exclude, str) else tuple(self.exclude)
        for pattern in exclude:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ValueError(f"LayerPolicy.exclude: invalid regex {pattern!r}: {exc}") from None
        object.__setattr__(self, "exclude", exclude)
        classes = self.linear_subclasses
        classes = (classes,) if isinstance(classes, str) else tuple(classes)
        if not all(isinstance(c, str) and c.isidentifier() for c in classes):
            raise ValueError(f"LayerPolicy.linear_subclasses must be class names, got {self.linear_subclasses!r}")
        object.__setattr__(self, "linear_subclasses", classes)
        if not isinstance(self.exclude_defaults, bool):
            raise ValueError(f"LayerPolicy.exclude_defaults must be true or false, got {self.exclude_defaults!r}")

    @property
    def exclude_patterns(self) -> tuple[str, ...]:
        """Every pattern applied: the defaults (unless exclude_defaults=False), then `exclude`, each once."""
        return tuple(dict.fromkeys((DEFAULT_EXCLUDE if self.exclude_defaults else ()) + self.exclude))

    @property
    def checked_exclude(self) -> tuple[str, ...]:
        """The given patterns that must match a Linear: `exclude` without copies of a default pattern (a run
        config written when the defaults were spelled out in policy.exclude loads as it did)."""
        return tuple(p for p in self.exclude if p not in DEFAULT_EXCLUDE)

    def skip_reason(self, name, linear: nn.Linear, n_blocks: int) -> str | None:
        """Why `linear` (called `name`: a dotted name, or a tuple of the names it goes by) stays in high
        precision, or None when it converts."""
        names = (name,) if isinstance(name, str) else tuple(name)
        for pattern in self.exclude_patterns:
            if any(re.search(pattern, n) for n in names):
                return f"excluded by pattern {pattern!r}"
        name = names[0]
        idx = block_index(name)
        if idx is not None and idx < self.skip_first_blocks:
            return f"block {idx} is in the first {self.skip_first_blocks} (skip_first_blocks)"
        if idx is not None and idx >= n_blocks - self.skip_last_blocks:
            return f"block {idx} is in the last {self.skip_last_blocks} of {n_blocks} (skip_last_blocks)"
        dims = {"in_features": linear.in_features, "out_features": linear.out_features}
        for dim_name, size in dims.items():
            if size < self.min_features:
                return f"{dim_name}={size} < min_features={self.min_features}"
        for dim_name, size in dims.items():
            if size % self.divisible_by:
                return f"{dim_name}={size} is not a multiple of {self.divisible_by}"
        return None


@dataclass
class ConversionReport:
    """What `convert_to_fp8` did: (name, reason) for every nn.Linear it saw."""

    recipe: Fp8Recipe
    converted: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    converted_params: int = 0
    skipped_params: int = 0
    kinds: dict[str, list[int]] = field(default_factory=dict)
    """Per module kind ('linear', 'experts', 'other'): [FP8 params, high-precision params, FP8 GEMM FLOPs per
    token, high-precision GEMM FLOPs per token]; experts' FLOPs count the top-k experts a token runs."""

    @property
    def converted_frac(self) -> float:
        """Fraction of the weight elements feeding GEMMs (nn.Linear, experts, other >= 2-D weights) now in FP8."""
        total = self.converted_params + self.skipped_params
        return self.converted_params / total if total else 0.0

    @property
    def converted_flops_frac(self) -> float | None:
        """Fraction of the GEMM FLOPs per token that run in FP8 (None for a report without per-kind counts)."""
        fp8, high = sum(k[2] for k in self.kinds.values()), sum(k[3] for k in self.kinds.values())
        return fp8 / (fp8 + high) if fp8 + high else None

    def count(self, kind: str, in_fp8: bool, params: int, flops: int) -> None:
        row = self.kinds.setdefault(kind, [0, 0, 0, 0])
        row[0 if in_fp8 else 1] += params
        row[2 if in_fp8 else 3] += flops
        if in_fp8:
            self.converted_params += params
        else:
            self.skipped_params += params

    def to_dict(self) -> dict:
        return dict(recipe=self.recipe.code(), converted=[list(x) for x in self.converted],
                    skipped=[list(x) for x in self.skipped], converted_frac=self.converted_frac,
                    converted_flops_frac=self.converted_flops_frac,
                    kinds={kind: dict(zip(("fp8_params", "high_precision_params", "fp8_flops_per_token",
                                           "high_precision_flops_per_token"), row))
                           for kind, row in self.kinds.items()})

    def __str__(self) -> str:
        rows = [(n, "fp8", r) for n, r in self.converted] + [(n, "skip", r) for n, r in self.skipped]
        width = max([len(n) for n, _, _ in rows] + [len("layer")])
        flops = self.converted_flops_frac
        lines = [f"FP8 conversion ({self.recipe.code()}): {len(self.converted)} converted, "
                 f"{len(self.skipped)} skipped, {100 * self.converted_frac:.1f}% of GEMM weights in FP8"
                 + (f", {100 * flops:.1f}% of GEMM FLOPs per token" if flops is not None else "")]
        lines += [f"  {kind}: FP8 {row[0]:,} params, {row[2]:,} FLOPs/token; high precision {row[1]:,} params, "
                  f"{row[3]:,} FLOPs/token" for kind, row in self.kinds.items()]
        lines += [f"{'layer':<{width}}  {'':4}  reason"]
        lines += [f"{n:<{width}}  {kind:4}  {r}" for n, kind, r in rows]
        return "\n".join(lines)


def block_index(name: str) -> int | None:
    """Transformer block index of a dotted module name ('layers.3.mlp.up_proj' -> 3), or None."""
    match = _BLOCK_RE.search(name + ".")
    return int(match.group(1)) if match else None


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | str, policy: LayerPolicy | None = None,
                   dry_run: bool = False, master_weights: str = DEFAULT_MASTER_WEIGHTS) -> ConversionReport:
    """Replace, in place, every nn.Linear (and transformers Conv1D) of `model` that `policy` allows by an
    Fp8Linear using `recipe`, and run the 3-D experts of transformers' experts modules as FP8 grouped GEMMs
    (nn/convert_experts.py). ``dry_run``: only report what would be converted; the model is left as it is.
    ``master_weights``: a model whose parameters are not float32 is cast to float32 with a one-line warning
    ("cast") or refused ("refuse"): FP8 training keeps fp32 master weights (nn/master_weights.py)."""
    check_master_weights_choice(master_weights)
    recipe = make_recipe(recipe) if isinstance(recipe, str) else recipe
    policy = policy or LayerPolicy()
    names = [name for name, _ in model.named_modules()]
    block_ids = [i for i in map(block_index, names) if i is not None]
    n_blocks = max(block_ids) + 1 if block_ids else 0
    report = ConversionReport(recipe=recipe)

    def seen_as(name: str) -> tuple[str, ...]:
        return policy_names(model, name)

    # Collect first, swap after: named_modules must not see a half-modified tree.
    swaps = []
    for name, module in model.named_modules():
        if isinstance(module, Fp8Linear):
            report.skipped.append((name, "already Fp8Linear"))
            report.count("linear", True, module.weight.numel(), 2 * module.in_features * module.out_features)
            continue
        linear = _as_linear_shape(module)
        if linear is None:
            continue
        numel = module.weight.numel()
        if name == "":
            reason = "the model itself is an nn.Linear: wrap it in a container to swap it in place"
        elif linear is module and type(module) is not nn.Linear \
                and type(module).__name__ not in policy.linear_subclasses:
            reason = (f"{type(module).__name__} is a subclass of nn.Linear; only plain nn.Linear is swapped "
                      f"(policy.linear_subclasses: [{type(module).__name__}] opts in one whose forward is x @ W.T + b)")
        else:
            reason = policy.skip_reason(seen_as(name), linear, n_blocks)
        override = first_override(policy.overrides, seen_as(name)) if reason is None else None
        layer_recipe = recipe
        if override is not None and override[1] == OVERRIDE_BF16:
            reason = f"policy.overrides {override[0]!r} -> bf16"
        elif override is not None:
            layer_recipe = make_recipe(override[1], backend=recipe.backend)
        if reason is None:
            swaps.append((name, module, layer_recipe))
            via = f" {layer_recipe.name} (policy.overrides {override[0]!r})" if override is not None else ""
            report.converted.append((name, f"{linear.in_features}->{linear.out_features}{via}"))
        else:
            report.skipped.append((name, reason))
        report.count("linear", reason is None, numel, 2 * linear.in_features * linear.out_features)
    experts_swaps = choose_expert_swaps(model, recipe, policy, report, n_blocks, seen_as)
    grouped_swaps = choose_grouped_swaps(model, recipe, policy, report, n_blocks, seen_as)
    other_names = count_other_weights(model, report, policy, seen_as)
    linear_names = [n for n, m in model.named_modules() if _as_linear_shape(m) is not None]
    linear_names += [n for name, _, choices in experts_swaps for n in (name, *(f"{name}.{p}" for p in choices))]
    linear_names += [n for n, m in model.named_modules() if is_grouped(m)]
    seen_names = [n for name in linear_names for n in seen_as(name)]
    listed = f"its Linear layers: {', '.join(linear_names[:8])}" + (", ..." if len(linear_names) > 8 else "")
    unmatched = unmatched_patterns(policy.overrides, seen_names)
    if unmatched:  # before any swap: the model is left as it was
        raise ValueError(f"policy.overrides: {', '.join(map(repr, unmatched))} matches no nn.Linear of this model "
                         f"(a plan made for another model?); {listed}")
    # exclude may name every weight the policy governs: the Linears and experts, and the other GEMM weights (a
    # router outside nn.Linear, which the defaults already keep out: naming it again is redundant, not a typo)
    governed = linear_names + [n for n in other_names if n not in linear_names]
    governed_seen = [n for name in governed for n in seen_as(name)]
    unmatched = [p for p in policy.checked_exclude if not any(re.search(p, n) for n in governed_seen)]
    if unmatched:
        listed = (f"the weights it governs: {', '.join(governed[:8])}" + (", ..." if len(governed) > 8 else ""))
        raise ValueError(f"policy.exclude: {', '.join(map(repr, unmatched))} matches no nn.Linear, experts or other "
                         f"GEMM weight (a router) of this model (a typo, or a pattern for another model?); {listed}")
    classes = {type(m).__name__ for _, m in model.named_modules() if isinstance(m, nn.Linear)}
    unmatched = [c for c in policy.linear_subclasses if c not in classes]
    if unmatched:
        raise ValueError(f"policy.linear_subclasses: {', '.join(map(repr, unmatched))} is no nn.Linear subclass of "
                         f"this model; its Linear classes: {', '.join(sorted(classes))}")
    if dry_run:
        return report
    ensure_fp32_masters(model, master_weights)
    for name, module, _ in swaps:
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            check_plain_linear(name, module)
    for name, module, layer_recipe in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        swap = fp8_from_conv1d if is_conv1d(module) else Fp8Linear.from_linear
        setattr(parent, child, swap(module, layer_recipe))
    attach_experts(experts_swaps)
    attach_grouped(model, grouped_swaps)
    attach_fp8_record(model)  # any save of a transformers model now says which layers are FP8 (nn/fp8_record.py)

    if not report.converted and not dry_run:
        warnings.warn(f"convert_to_fp8: no nn.Linear was eligible for FP8 ({len(report.skipped)} skipped); "
                      f"the model runs in high precision. Skip reasons:\n{report}", stacklevel=2)
    return report


def policy_names(model: nn.Module, name: str) -> tuple[str, ...]:
    """The names layer-policy patterns see for module `name` of `model`: itself, and without the model's
    `wrapped_name_prefix` (module docstring)."""
    prefix = getattr(model, "wrapped_name_prefix", "")
    return (name, name[len(prefix):]) if prefix and name.startswith(prefix) else (name,)


def fp8_layers(model: nn.Module) -> list[tuple[str, Fp8Linear]]:
    """(name, layer) for every Fp8Linear in `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8Linear)]


# ------------------------------------------------------------------------------------------------------------
# transformers' Conv1D (GPT-2, GPT-J's predecessors): y = x @ weight + bias with weight stored (in, out), the
# transpose of nn.Linear's (out, in). Recognised by class name so this module never imports transformers.
# ------------------------------------------------------------------------------------------------------------
class _LinearShape:
    def __init__(self, in_features: int, out_features: int):
        self.in_features, self.out_features = in_features, out_features


def is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers") \
        and hasattr(module, "nx") and hasattr(module, "nf")


def _as_linear_shape(module: nn.Module):
    """The module itself for an nn.Linear, its (in, out) shape for a Conv1D, None for anything else."""
    if isinstance(module, nn.Linear):
        return module
    if is_conv1d(module):
        return _LinearShape(module.nx, module.nf)
    return None


def fp8_from_conv1d(conv: nn.Module, recipe: Fp8Recipe | str = DEFAULT_RECIPE) -> Fp8Linear:
    """An Fp8Linear computing what `conv` computes. Its weight is a NEW Parameter holding conv.weight.T (the
    nn.Linear layout, so the three GEMMs are the ones written in linear.py); build the optimizer after the swap.
    `conv1d_layout = True`: its state_dict holds the weight in Conv1D's (in, out) layout (Fp8Linear)."""
    weight = nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=conv.weight.requires_grad)
    layer = Fp8Linear.from_parameters(weight, conv.bias, recipe)
    layer.train(conv.training)
    layer.conv1d_layout = True
    return layer
