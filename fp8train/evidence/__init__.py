"""Layer 4, evidence: paired bf16-vs-FP8 runs, the verdict arithmetic, the report and its plots, and the FP8
health advisor. Imports only from the layers below (numerics, nn, training)."""
