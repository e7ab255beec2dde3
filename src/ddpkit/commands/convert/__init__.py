"""``ddpkit convert``: rewrite a single-device training script into a ddpkit one. The entry is ``command``;
its parts: ``scan`` (what the script holds), ``flow`` (where values go), ``sums``, ``plan`` and ``rules`` (the
edits), ``apply`` (the libcst rewrite)."""
