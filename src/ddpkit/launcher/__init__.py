"""The launcher process: its config, supervising torch's elastic agent, spawn, rendezvous, console, failure reports."""
