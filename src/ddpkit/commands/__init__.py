"""The ``ddpkit`` commands: the CLI (``cli``), the one-file commands (launch, doctor, consolidate) and
``logtail``, and one folder per command with parts (convert, check, verify, bench, plan: ``<folder>.command``)."""
