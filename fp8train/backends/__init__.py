"""Optional third-party GEMM backends. Each submodule imports its dependency lazily, so importing fp8train never
needs them; `te` maps fp8train recipes onto NVIDIA Transformer Engine."""
