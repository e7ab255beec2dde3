"""Before a multi-node launch: do all nodes agree, and are they all there?

Without this, nodes started with different settings just time out after minutes, and a node that never joins
keeps the others waiting for 600 s. Each launcher publishes its settings (JSON, never pickle) in a TCPStore
that node 0 hosts at ``--master-addr:--master-port``; when all have arrived every node compares them and fails
with the same message naming the difference, or moves on. Node 0 then closes the store and torchrun takes the
port over.

Example of what every node prints::

    ddpkit launch: error: nodes disagree on nproc_per_node: node 0 has 1, node 1 has 2; start every node
    with the same settings
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time

from ddpkit.core.errors import first_line
from ddpkit.core.version import __version__

_PREFIX = "ddpkit/preflight/"


def node_settings(cfg) -> dict:
    """What must be equal on every node (the launch config and the software)."""
    import torch

    script_hash = ""
    if not cfg.module:
        with open(cfg.script, "rb") as f:
            script_hash = hashlib.sha256(f.read()).hexdigest()[:16]
    # a CPU node among GPU nodes would join, and every node would then hang at the first collective
    backend = cfg.strategy.backend(torch.device(cfg.device_type))
    return {"nnodes": cfg.max_nodes, "nproc_per_node": cfg.nproc_per_node, "mode": cfg.mode,
            "device": cfg.device_type, "backend": backend, "max_restarts": cfg.max_restarts,
            "script_sha256": script_hash,
            "ddpkit": __version__, "torch": torch.__version__}


def disagreement(settings: dict[int, dict]) -> str | None:
    """The first setting on which nodes differ, as a sentence; None when all agree.

    >>> disagreement({0: {"nproc_per_node": 1}, 1: {"nproc_per_node": 2}})
    'nodes disagree on nproc_per_node: node 0 has 1, node 1 has 2; start every node with the same settings'
    """
    for key in settings[min(settings)]:
        values = {node: s.get(key) for node, s in sorted(settings.items())}
        if len({json.dumps(v) for v in values.values()}) > 1:
            listing = ", ".join(f"node {node} has {value}" for node, value in values.items())
            return f"nodes disagree on {key}: {listing}; start every node with the same settings"
    return None


def check_nodes(cfg, join_timeout_s: float) -> str | None:
    """Exchange settings with every node; returns an error sentence, or None when all agree."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=join_timeout_s)
    host = cfg.node_rank == 0
    try:
        if host and cfg.loopback_nodes:  # torch's server would listen on every interface: bind the address itself
            from ddpkit.launcher import rendezvous

            store = rendezvous.loopback_store(cfg.node0_port, cfg.master_addr, timeout=timeout)
        else:
            store = dist.TCPStore(cfg.master_addr, cfg.node0_port, is_master=host, wait_for_workers=False,
                                  timeout=timeout)
    except (RuntimeError, TimeoutError, OSError) as exc:
        if host:
            return (f"node 0 cannot listen on port {cfg.node0_port} ({first_line(exc, 120)}); "
                    "pick a free --master-port")
        return (f"node 0 was not reachable at {cfg.master_addr}:{cfg.node0_port} within {join_timeout_s:.0f} s; "
                "start node 0 first and check the address, the port and the firewall")
    store.set(f"{_PREFIX}node{cfg.node_rank}", json.dumps(node_settings(cfg)))
    keys = [f"{_PREFIX}node{i}" for i in range(cfg.max_nodes)]
    deadline = time.monotonic() + join_timeout_s
    problem, present = None, [cfg.node_rank]
    while time.monotonic() < deadline:
        present = [i for i, k in enumerate(keys) if store.check([k])]
        problem = disagreement({i: json.loads(store.get(keys[i])) for i in present})
        if problem or len(present) == cfg.max_nodes:  # a mismatch needs no wait for the others
            break
        time.sleep(0.1)
    else:
        problem = (f"expected {cfg.max_nodes} nodes, but only nodes {present} joined within {join_timeout_s:.0f} s; "
                   "start the missing nodes or raise --join-timeout")
    store.add(f"{_PREFIX}read", 1)
    if host:  # keep the store up until the nodes that came have read the others' settings
        until = time.monotonic() + 10
        while int(store.add(f"{_PREFIX}read", 0)) < len(present) and time.monotonic() < until:
            time.sleep(0.05)
    else:
        _wait_until_closed(store)
    del store
    return problem


def _wait_until_closed(store, limit_s: float = 30.0) -> None:
    """Other nodes wait until node 0 has closed this store: torchrun's agent then reuses the port, and a
    client that connected to the closing pre-flight store instead would fail its rendezvous."""
    until = time.monotonic() + limit_s
    while time.monotonic() < until:
        try:
            store.check([f"{_PREFIX}read"])
        except (RuntimeError, OSError):  # the server went away
            return
        time.sleep(0.05)
