"""A run's life on disk: claiming its directory (`claim`), deciding to start or resume (`resume`), forking from
another run (`fork`), checkpoints (`checkpoint`, `sharded_checkpoint`), what it logs (`run_log`, `telemetry`,
`tracking`) and how it ends when told to (`lifetime`). Imports only from the sub-folders before it (config,
storage, data, parallel, models) within training/."""
