"""Rendezvous for torch's elastic agent whose stores listen on loopback only, where the job never leaves the machine.

torchrun's stores (``--standalone`` or static) listen on every interface, and c10d stores accept
unauthenticated connections (PyTorch's SECURITY.md), so a one-machine job would otherwise expose a port to
the whole network. ``TCPStore`` has no bind-address option, but it accepts ``master_listen_fd``: a socket
we bind to 127.0.0.1 ourselves. This handler is registered with torch's rendezvous registry under
:data:`BACKEND` by the launcher process only (never at import) and torch's agent drives it as usual.

Every rendezvous round (the first start and each ``--max-restarts`` restart) gets a *new* store on a new
port. The workers connect to the agent's store (``TORCHELASTIC_USE_AGENT_STORE``) without a per-attempt
prefix, so a store kept across restarts hands the restarted group the previous attempt's keys: that is
the "Connection refused" / hang family of pytorch#135712, which a fresh store avoids.

Several launchers on one machine as nodes (``--nnodes N --master-addr 127.0.0.1``) use :data:`STATIC_BACKEND`:
torch's static rendezvous (one store for the whole run, node ranks fixed), except that node 0's store is bound
to the loopback master address itself; the other nodes are the store's clients and listen on nothing.

Example (what ``ddpkit launch`` does for a single-node run)::

    register()
    torch.distributed.run.run(get_args_parser().parse_args(
        ["--rdzv-backend", BACKEND, "--rdzv-endpoint", "127.0.0.1:0", "--nproc-per-node", "2", "train.py"]))
"""

from __future__ import annotations

import datetime
import socket

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from ddpkit.launcher.config import LOOPBACK_BACKEND, LOOPBACK_ELASTIC_BACKEND, LOOPBACK_STATIC_BACKEND, is_loopback

BACKEND = LOOPBACK_BACKEND
STATIC_BACKEND = LOOPBACK_STATIC_BACKEND
ELASTIC_BACKEND = LOOPBACK_ELASTIC_BACKEND
LOOPBACK = "127.0.0.1"
STORE_TIMEOUT = datetime.timedelta(seconds=600)


def loopback_store(port: int = 0, host: str = LOOPBACK, world_size: int | None = None,
                   timeout: datetime.timedelta = STORE_TIMEOUT) -> TCPStore:
    """A server ``TCPStore`` that listens on the loopback address ``host`` only, on ``port`` (0: a free port the
    kernel picks); with ``world_size``, it waits for that many members (torch's static rendezvous does).

    >>> store = loopback_store(); store.set("k", "v"); store.get("k")
    b'v'
    """
    bind = LOOPBACK if host == "localhost" else host
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # a fixed port is bound again by a later round; the last round's connections linger in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    # The store owns the descriptor from here on (it closes it), so the Python object lets go of it.
    return TCPStore(bind, sock.getsockname()[1], world_size, True, timeout, wait_for_workers=world_size is not None,
                    multi_tenant=True, master_listen_fd=sock.detach())


class LoopbackRendezvous(RendezvousHandler):
    """One node, rank 0 of 1; the agent and its workers share a loopback store that is new every round."""

    def __init__(self, run_id: str, port: int = 0):
        self._run_id = run_id
        self._port = port
        self._store: TCPStore | None = None
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to our loopback store; none of them starts a server of its own

    def next_rendezvous(self) -> RendezvousInfo:
        first = self._store is None
        self._store = None  # the previous round's workers are gone: close its server before the next one
        try:
            self._store = loopback_store(self._port)
        except OSError:
            if first or not self._port:
                raise
            # --master-port P with --max-restarts: torch's agent still holds the previous round's store, which
            # listens on P until the agent takes the new one; the restarted workers are told whatever port
            # this round has, and nothing outside this machine connects to a loopback store
            self._store = loopback_store(0)
        return RendezvousInfo(self._store, 0, 1, RendezvousStoreInfo(LOOPBACK, self._store.port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # nobody else can join a loopback rendezvous

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._store = None
        return True


def create_handler(params: RendezvousParameters) -> LoopbackRendezvous:
    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous serves one node, got --nnodes "
                         f"{params.min_nodes}:{params.max_nodes}")
    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    return LoopbackRendezvous(params.run_id, port)


class StaticLoopbackRendezvous(StaticTCPRendezvous):
    """torch's static rendezvous whose node 0 binds its store to the loopback master address itself (torch's own
    TCPStore server listens on every interface, whatever address it is given)."""

    def get_backend(self) -> str:
        return STATIC_BACKEND  # torch's registry checks the handler answers to the name it was created for

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None and self.rank == 0:
            self._store = loopback_store(self.master_port, self.master_addr, self.world_size, self.timeout)
        return super().next_rendezvous()  # node 0 keeps that store; the others connect to it as clients


def create_static_handler(params: RendezvousParameters) -> StaticLoopbackRendezvous:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=-1)
    rank = params.get_as_int("rank")
    if not is_loopback(host) or port <= 0 or rank is None:
        raise ValueError(f"the {STATIC_BACKEND} rendezvous needs a loopback HOST:PORT and rank=N in --rdzv-conf, "
                         f"got {params.endpoint!r} and rank {rank}; use --master-addr 127.0.0.1 and --node-rank")
    timeout = params.get_as_int("timeout", int(STORE_TIMEOUT.total_seconds()))
    return StaticLoopbackRendezvous(host, port, rank, params.max_nodes, params.run_id, int(timeout or 0))


class ElasticLoopbackRendezvous(DynamicRendezvousHandler):
    """torch's c10d (elastic) rendezvous for nodes on one machine: the rendezvous store and the workers' store
    bind the loopback address (torch's listen on every interface), and the workers' store is new every round (a
    kept one hands a restarted group the keys of the round before: pytorch#135712)."""

    def get_backend(self) -> str:
        return ELASTIC_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers use the loopback store of rank 0's agent; none of them serves one of its own

    def next_rendezvous(self) -> RendezvousInfo:
        self._shared_tcp_store_server = None  # rank 0 makes a new one for this round (the others read its port)
        self._bootstrap_store_info = None
        return super().next_rendezvous()

    def _create_tcp_store_server(self, master_addr: str, master_port: int) -> TCPStore:
        return loopback_store(master_port)


def create_elastic_handler(params: RendezvousParameters) -> ElasticLoopbackRendezvous:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    if not is_loopback(host):
        raise ValueError(f"the {ELASTIC_BACKEND} rendezvous needs a loopback --rdzv-endpoint, got {params.endpoint!r}")
    read_timeout = datetime.timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    try:  # the first launcher on the machine serves the rendezvous store, the others are its clients
        store: TCPStore = loopback_store(port, host, timeout=read_timeout)
    except OSError:
        store = TCPStore(LOOPBACK if host == "localhost" else host, port, is_master=False, timeout=read_timeout,
                         multi_tenant=True)
    timeouts = [params.get_as_int(f"{kind}_timeout") for kind in ("join", "last_call", "close", "heartbeat")]
    return ElasticLoopbackRendezvous.from_backend(
        params.run_id, store, C10dRendezvousBackend(store, params.run_id), params.min_nodes, params.max_nodes,
        LOOPBACK, RendezvousTimeout(*(None if t is None else datetime.timedelta(seconds=t) for t in timeouts)),
        keep_alive_interval=params.get_as_int("keep_alive_interval", 5) or 5,
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3)


def register() -> None:
    """Make ddpkit's loopback rendezvous (:data:`BACKEND`, :data:`STATIC_BACKEND`, :data:`ELASTIC_BACKEND`) known to
    torch's launcher in this process (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, create_handler)
    rendezvous_handler_registry.register(STATIC_BACKEND, create_static_handler)
    rendezvous_handler_registry.register(ELASTIC_BACKEND, create_elastic_handler)
