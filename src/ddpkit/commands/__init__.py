"""The ``ddpkit`` commands: the CLI and one module per command (launch, verify, bench, check, doctor, consolidate)."""
