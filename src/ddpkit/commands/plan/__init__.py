"""``ddpkit plan``: per-rank peak memory of each mode and process count, before launch. The entry is ``command``;
its parts: ``hooks`` (the one fake step under torch's MemTracker), ``memory`` (each mode's per-rank peak)."""
