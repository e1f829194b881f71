"""The processes a run trains in: the Accelerator, launcher checks and the shared FP8 state (`distributed`),
FSDP2 sharding (`fsdp2`), tensor and sequence parallelism on a (dp, tp) mesh (`tensor_parallel`), and work only
the main process does (`rank0`). Imports only from the sub-folders before it (config, storage, data) within
training/."""
