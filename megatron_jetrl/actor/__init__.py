"""The trainer half: the megatron-core policy model and its checkpoints. May import megatron.core."""
