"""Layer 2, FP8 modules: the recipe presets (the one list of recipe, role and backend names), GEMM backends,
`Fp8Linear` with its three GEMMs and its per-role `OperandQuantizer`s, FP8 experts (grouped GEMMs with per-expert
scaling, and transformers' experts interface), the module swap and layer policy, and the TransformerEngine
mapping. Imports only from `fp8train.numerics`.

The layer's names are imported on first use (`fp8train.nn.Fp8Linear`), so importing a light module of this
folder (recipes.py, for a config) does not load the layer, its GEMMs and torch.distributed.
"""

_LAZY = {"Fp8Linear": "fp8train.nn.linear", "OperandQuantizer": "fp8train.nn.quantizer",
         "Fp8GroupedLinear": "fp8train.nn.experts", "GroupedLinear": "fp8train.nn.experts",
         "fp8_grouped_mm": "fp8train.nn.experts",
         "ExpertScaling": "fp8train.nn.experts_scaling"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fp8train.nn' has no attribute {name!r}")
