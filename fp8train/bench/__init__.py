"""Layer 6, benchmarks: paired timing harness and sections (quantize, Fp8Linear, train step, memory)."""
