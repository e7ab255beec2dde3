"""Loaders that shard a dataset or a stream across ranks, reshuffle every epoch and resume mid-epoch."""
