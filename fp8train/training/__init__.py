"""Layer 3, the training system: config schema, model, data, the accelerate loop, checkpoints, run-directory
I/O and telemetry collection. Imports only from `fp8train.numerics` and `fp8train.nn`."""
