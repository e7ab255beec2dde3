"""``ddpkit verify``: N-process training against one process on the global batch. The entry is ``command``;
its parts: ``hooks`` and ``recorder`` (inside each run), ``noise`` and ``causes`` (reading a FAIL)."""
