"""What every layer may use: `checkpoint` (checkpoint directories), `state_file` (state files that run no code
when read), `config_io` (loading a config file with overrides), `logger` (JSONL, TensorBoard, wandb, mlflow),
`timer`, `seeding`, `paths`, `device` (device and allocator set-up), `dir_lock` (one live process per directory),
`signals` (graceful stop), `plot`. Imports only `relayrl.config` and third-party packages."""
