"""The rollout side without JAX: the rollout worker's loop (`worker`), its pacing (`pacing`), what a rollout call
returns (`rollout_batch`), what a worker records (`worker_records`) and the sample completions it logs
(`samples`)."""
