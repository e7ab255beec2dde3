"""Checkpoints: the Checkpointer, the on-disk layout and its checks, sharded (DCP) I/O and the safe unpickler."""
