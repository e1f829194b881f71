"""Layer 1, the numerics core: FP8 formats derived from their bit layouts; amax, scales, quantize/dequantize at
any granularity; error statistics; OCP <-> FNUZ dialect conversion. Depends on torch only."""
