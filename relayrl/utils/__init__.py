"""What every layer may use: checkpoint directories, logging (JSONL, TensorBoard, wandb, mlflow), timing,
seeding, paths, device and allocator set-up, plotting. Imports only `relayrl.config` and third-party packages."""
