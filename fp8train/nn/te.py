"""Transformer Engine backend: map an `Fp8Recipe` onto a TE recipe and swap a Linear for `te.pytorch.Linear`.

`te_recipe_kwargs` is pure (no TE import), so the mapping is tested on any machine. The mapping, per preset:

| fp8train  | TE recipe class       | fp8_format | notes                                                        |
|-----------|-----------------------|------------|--------------------------------------------------------------|
| delayed   | DelayedScaling        | HYBRID     | amax_history_len, amax_compute_algo, margin carried over     |
| current   | Float8CurrentScaling  | HYBRID     | per-tensor scales from the tensor itself                     |
| rowwise   | (refused before sm100)| E4M3       | TE has no per-row recipe. On sm100+ it maps to MXFP8 (1x32   |
|           | MXFP8BlockScaling     |            | blocks, E8M0 scales: finer than per row, NOT exact); on      |
|           |                       |            | Hopper/Ada MXFP8 does not exist, so it is refused            |
| block     | Float8BlockScaling    | E4M3       | 1x128 activations/gradients, 128x128 weights (DeepSeek-V3)   |
| mxfp8     | MXFP8BlockScaling     | E4M3       | sm100+ only. TE rounds E8M0 scales up where the OCP spec     |
|           |                       |            | (and fp8train's emulation) rounds down: not bit exact        |

fp8_format is HYBRID when the forward formats are E4M3 and grad_output is E5M2, E4M3 when all three are E4M3.
TE has no per-role format choice beyond that, no FNUZ formats in these recipes, and no margin outside
DelayedScaling: such recipes raise a ValueError rather than silently running different numerics.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fp8train.nn.recipes import Fp8Recipe, ScalingKind

__all__ = ["te_recipe_kwargs", "make_te_recipe", "make_te_linear"]

_INSTALL_HINT = "Transformer Engine is not installed: pip install fp8train[te] (needs CUDA and an sm89+ GPU)"


def _fp8_format_name(recipe: Fp8Recipe) -> str:
    fmts = (recipe.input_format, recipe.weight_format, recipe.grad_output_format)
    if fmts == ("e4m3fn", "e4m3fn", "e5m2"):
        return "HYBRID"
    if fmts == ("e4m3fn", "e4m3fn", "e4m3fn"):
        return "E4M3"
    raise ValueError(f"the te backend supports formats e4m3fn/e4m3fn/e5m2 (HYBRID) or all e4m3fn (E4M3); "
                     f"recipe {recipe.name!r} has input/weight/grad_output = {'/'.join(fmts)}")


MXFP8_MIN_CAPABILITY = (10, 0)  # MXFP8 tensor cores: Blackwell (sm100) and newer


def te_recipe_kwargs(recipe: Fp8Recipe, capability: tuple[int, int] | None = None) -> dict:
    """The TE recipe for `recipe`, as plain data: {"recipe_class", "kwargs", "exact", "note"}.

    `capability` is the GPU's compute capability; None (unknown) refuses MXFP8 mappings, which need sm100+.

    `recipe_class` names a class of `transformer_engine.common.recipe`; `kwargs` are its constructor arguments
    with `fp8_format` given as the name of a `Format` member ("HYBRID" or "E4M3"); `exact` says whether TE runs
    the same scaling granularity as fp8train's emulated backend.
    """
    fp8_format = _fp8_format_name(recipe)
    if not recipe.is_delayed and recipe.margin != 0:
        raise ValueError(f"margin={recipe.margin}: TE supports a margin only for delayed scaling; set margin=0 "
                         f"or use backend='emulated'")
    if recipe.is_delayed:
        kwargs = dict(fp8_format=fp8_format, margin=recipe.margin, amax_history_len=recipe.amax_history_len,
                      amax_compute_algo=recipe.amax_compute_algo)
        return dict(recipe_class="DelayedScaling", kwargs=kwargs, exact=not recipe.pow2_scales,
                    note="TE's delayed scales are not rounded to powers of two" if recipe.pow2_scales else "")
    if recipe.scaling is ScalingKind.CURRENT:
        return dict(recipe_class="Float8CurrentScaling", kwargs=dict(fp8_format=fp8_format),
                    exact=not recipe.pow2_scales,
                    note="TE's current scales are not rounded to powers of two" if recipe.pow2_scales else "")
    if recipe.scaling in (ScalingKind.ROWWISE, ScalingKind.MXFP8):
        if capability is None or tuple(capability) < MXFP8_MIN_CAPABILITY:
            where = "an unknown GPU" if capability is None else f"sm{capability[0]}{capability[1]}"
            raise ValueError(f"recipe {recipe.name!r} with backend te needs TE's MXFP8BlockScaling, which needs an "
                             f"sm100+ (Blackwell) GPU; this is {where}. Use backend scaled_mm (all three GEMMs in "
                             f"FP8 on sm89+) or a TE recipe that exists here: delayed, current, block")
        if fp8_format != "E4M3":
            raise ValueError("the te backend's MXFP8BlockScaling needs all-e4m3fn formats")
        note = ("TE has no per-row recipe; MXFP8 uses 1x32 blocks with power-of-two (E8M0) scales"
                if recipe.scaling is ScalingKind.ROWWISE else "TE rounds E8M0 scales up; the OCP MX rule rounds down")
        return dict(recipe_class="MXFP8BlockScaling", kwargs=dict(fp8_format="E4M3"), exact=False, note=note)
    # block
    if fp8_format != "E4M3":
        raise ValueError("the te backend's Float8BlockScaling needs all-e4m3fn formats")
    if (recipe.input_block, recipe.weight_block, recipe.grad_output_block) != ((1, 128), (128, 128), (1, 128)):
        raise ValueError("Float8BlockScaling uses 1x128 input/grad_output tiles and 128x128 weight tiles; "
                         f"recipe {recipe.name!r} asks for {recipe.input_block}, {recipe.weight_block}, "
                         f"{recipe.grad_output_block}")
    return dict(recipe_class="Float8BlockScaling", kwargs=dict(fp8_format="E4M3"), exact=recipe.pow2_scales,
                note="" if recipe.pow2_scales else "TE's block recipe uses power-of-two scales by default")


def _import_te():
    try:
        import transformer_engine.common.recipe as te_recipe
        import transformer_engine.pytorch as te_pytorch
    except ImportError as exc:  # ImportError also covers a TE built without its CUDA library
        raise ImportError(_INSTALL_HINT) from exc
    return te_recipe, te_pytorch


def make_te_recipe(recipe: Fp8Recipe, capability: tuple[int, int] | None = None):
    """A `transformer_engine.common.recipe` object for `recipe` (imports TE)."""
    te_recipe, _ = _import_te()
    spec = te_recipe_kwargs(recipe, capability)
    kwargs = dict(spec["kwargs"])
    kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    cls = getattr(te_recipe, spec["recipe_class"], None)
    if cls is None:
        raise ImportError(f"this Transformer Engine has no recipe.{spec['recipe_class']}: upgrade it "
                          f"(pip install -U 'fp8train[te]')")
    return cls(**kwargs)


def make_te_linear(linear: nn.Linear, recipe: Fp8Recipe, capability: tuple[int, int] | None = None) -> nn.Module:
    """A `te.pytorch.Linear` with `linear`'s weights copied in (TE owns its parameters), on its device.

    TE layers compute in FP8 only inside `te.pytorch.autocast(enabled=True, recipe=make_te_recipe(recipe))`
    (`fp8_autocast` is TE's deprecated name for it); outside, they silently run in high precision.
    """
    te_recipe_kwargs(recipe, capability)  # fail on unsupported recipes before touching the GPU
    _, te_pytorch = _import_te()
    layer = te_pytorch.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              params_dtype=linear.weight.dtype, device=linear.weight.device)
    with torch.no_grad():
        layer.weight.copy_(linear.weight)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
    layer.fp8_recipe = make_te_recipe(recipe, capability)
    return layer


def te_config_refusal(recipe: Fp8Recipe) -> str:
    """Why `fp8.backend: te` cannot run `recipe` in `fp8train train` (checked at config time, before any run).

    The mapping and layer swap above are complete, but the training loop does not yet wrap its forward in
    `te.autocast(recipe=...)`, so TE layers would train in bf16 while the run claims FP8; refusing says so."""
    try:
        te_recipe_kwargs(recipe, MXFP8_MIN_CAPABILITY)  # the recipe's own limits first (formats, tiles, margin)
        reason = ""
    except ValueError as err:
        reason = f"{err}; and "
    return (f"fp8.backend=te is refused: {reason}fp8train's training loop does not run TE layers inside "
            f"te.autocast(recipe=...), without which they do no FP8 at all. Use fp8.backend=scaled_mm (CUDA sm89+: "
            f"every GEMM in FP8) or auto; fp8train.nn.te.make_te_linear/make_te_recipe serve your own TE loop")
