"""Security (issue 45): several launchers on one machine as nodes (``--master-addr 127.0.0.1``) listen on loopback
only, launchers' stores and workers alike, read from the kernel's socket table (psutil); a real non-loopback
master address still has node 0 listen where the other nodes can reach it."""
import ipaddress
import os
import subprocess
import sys
import time

import pytest
from test_loopback import WAITER, tree
from test_multinode import free_port

from conftest import SCRATCH
from ddpkit.launcher import config

psutil = pytest.importorskip("psutil")


def loopback(ip):
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def listening(pids):
    """(address, port, pid) of every TCP socket listening in one of ``pids``."""
    found = []
    for pid in pids:
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.NoSuchProcess:
            continue
        found += [(c.laddr.ip, c.laddr.port, pid) for c in conns if c.status == psutil.CONN_LISTEN]
    return found


def two_nodes_listening(tmp_path, addr):
    """Start two launchers as nodes of a job at ``addr``; once its group is up, every socket they listen on."""
    script, flag, port = tmp_path / "wait.py", tmp_path / "ready", free_port()
    script.write_text(WAITER)
    nodes = [subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", str(rank),
                               "--nproc-per-node", "1", "--master-addr", addr, "--master-port", str(port),
                               "--log-dir", str(tmp_path / f"logs{rank}"), str(script), str(flag)],
                              cwd=SCRATCH, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not flag.exists() and all(n.poll() is None for n in nodes) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert flag.exists(), f"workers never came up: {[n.communicate(timeout=30) for n in nodes]}"
        trees = [tree(n.pid) for n in nodes]
        sockets = [listening(t) for t in trees]
        (tmp_path / "ready.go").write_text("")
        results = [n.communicate(timeout=90) for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, 9)
    for n, (_, err) in zip(nodes, results):
        assert n.returncode == 0, err
    assert all(len(t) >= 2 for t in trees)  # each launcher and its worker
    return port, [n.pid for n in nodes], sockets


def test_two_loopback_nodes_listen_on_loopback_only(tmp_path):
    port, launchers, (node0, node1) = two_nodes_listening(tmp_path, "127.0.0.1")
    # node 0's launcher serves the job's store on the master port, bound to the master address itself
    assert ("127.0.0.1", port, launchers[0]) in node0, node0
    exposed = [s for s in node0 + node1 if not loopback(s[0])]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert {pid for *_, pid in node0 + node1} - set(launchers), "the workers' own gloo listeners were not seen"


def _outside_address():
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family.name == "AF_INET" and not loopback(a.address):
                return a.address
    return None


@pytest.mark.skipif(_outside_address() is None, reason="needs a non-loopback IPv4 address on this machine")
def test_a_real_master_address_is_listened_on_where_the_other_nodes_reach_it(tmp_path):
    addr = _outside_address()
    port, launchers, (node0, _) = two_nodes_listening(tmp_path, addr)
    on_port = [ip for ip, p, pid in node0 if p == port and pid == launchers[0]]
    assert on_port and not any(loopback(ip) for ip in on_port), node0


def test_the_launch_argv_binds_loopback_nodes_and_leaves_real_ones_to_torch(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("")
    loop = config.LaunchConfig(script=str(script), nproc_per_node=1, max_nodes=2, node_rank=1,
                               master_addr="127.0.0.1", master_port=29555)
    argv = config.torchrun_argv(loop)
    assert loop.loopback_nodes and argv[argv.index("--rdzv-backend") + 1] == config.LOOPBACK_STATIC_BACKEND
    assert "rank=1" in argv and "127.0.0.1:29555" in argv
    real = config.LaunchConfig(script=str(script), nproc_per_node=1, max_nodes=2, master_addr="10.1.2.3")
    assert not real.loopback_nodes and "--rdzv-backend" not in config.torchrun_argv(real)
