"""``ddpkit check``: static analysis of a training script for common DP/DDP mistakes. The entry is ``command``;
its parts: ``rules`` (what each finds), ``syntax`` (one walk of the tree), ``flow`` and ``metrics`` (the
evaluation rules)."""
