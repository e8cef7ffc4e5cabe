"""Checkpoints: what one holds (`train_state`), the async save, collective commit and restore
(`checkpointer`), the checksums of every stored byte (`integrity`), what must match for a run to resume
one (`fingerprint`) and how often to save (`interval`)."""
