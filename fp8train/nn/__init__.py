"""Layer 2, FP8 modules: the recipe presets (the one list of recipe, role and backend names), GEMM backends,
`Fp8Linear` with its three GEMMs, the module swap and layer policy, and the TransformerEngine mapping.
Imports only from `fp8train.numerics`."""
