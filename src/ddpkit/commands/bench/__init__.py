"""``ddpkit bench``: throughput at 1..N processes and a measured recommendation. The entry is ``command``; its
parts: ``hooks`` (inside each timing run), ``stats`` (the decision rule), ``phases`` (the communication share)."""
