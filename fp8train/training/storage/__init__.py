"""Files and folders fp8train writes, guarded: atomic writes, strict JSON and torn-line-safe JSONL (`files`), a
run directory's layout, state and lock (`rundir`), and what a command may write or replace outside a run
directory (`outputs`). Imports only from `training.config` within training/."""
