"""Layer 3, the training system. Imports only from `fp8train.numerics` and `fp8train.nn`.

Inside, by concern, each sub-folder importing only from the ones before it (tests/test_layering.py):
config (the typed config) < storage (safe files, the run directory) < data (corpora) < parallel (ranks, FSDP2)
< models (decoder, Hugging Face models) < runs (claim, resume, fork, checkpoints, logs). The loop and its
helpers (loop, step, setup, step_guard, optim, evaluation, compile, shadow) are this folder's own modules and
may import any of them."""
