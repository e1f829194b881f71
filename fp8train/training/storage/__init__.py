"""Files and folders a run writes, guarded: the run directory's layout, atomic writes, strict JSON, the directory
lock (`rundir`), and what a command may write or replace outside a run directory (`outputs`). Imports only from
`training.config` within training/."""
