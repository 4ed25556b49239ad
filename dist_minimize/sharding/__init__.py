"""Optimizer state sharded across processes: the partition, the sharded state of a
stack, and its checkpoints."""
