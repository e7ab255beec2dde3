"""Several nodes on one machine: two launchers as two nodes over loopback (and over a veth pair between two
network namespaces where root can make them); mismatched settings and missing nodes fail fast and clearly."""
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

from conftest import ROOT, SCRATCH, ok

DIGITS = ROOT / "examples" / "digits.py"


def free_port() -> int:
    """A free port below the kernel's ephemeral range (32768 and up here): a port bind(0) handed out and freed
    returns to that range, where the next outgoing connection of any process may take it before the launcher binds
    it (a launcher that cannot bind the rendezvous port becomes a client of whatever holds it, and times out)."""
    for _ in range(200):
        port = random.randint(15000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 15000-32000 after 200 tries")


def start(node_rank, port, *extra, nproc=1, addr="127.0.0.1", prefix=(), env=None, args=()):
    cmd = [*prefix, sys.executable, "-m", "ddpkit", "launch", "--nnodes", "2", "--node-rank", str(node_rank),
           "--nproc-per-node", str(nproc), "--master-addr", addr, "--master-port", str(port), *extra,
           str(DIGITS), "--epochs", "2", *args]
    return subprocess.Popen(cmd, cwd=SCRATCH, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)


def wait_all(procs, timeout=120):
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, 9)
            outputs = [q.communicate() for q in procs]
            pytest.fail(f"a node did not finish in time: {[(o[-800:], e[-1500:]) for o, e in outputs]}")
        results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return results


def accuracy(result):
    return float(result.stdout.strip().splitlines()[-1].split("=")[1])


@pytest.fixture(scope="module")
def one_node_accuracy(tmp_path_factory):
    tb = tmp_path_factory.mktemp("one")
    from conftest import launch

    return accuracy(ok(launch(DIGITS, "--epochs", 2, "--logdir", tb)))


def test_two_launchers_as_two_nodes_train_like_one_node(tmp_path, one_node_accuracy):
    port = free_port()
    nodes = wait_all([start(r, port, "--log-dir", tmp_path / f"logs{r}", args=["--logdir", str(tmp_path / "tb")])
                      for r in (0, 1)])
    for node in nodes:
        ok(node)
    assert accuracy(nodes[0]) == one_node_accuracy  # same seed, same world size: the same training
    assert "accuracy=" not in nodes[1].stdout  # rank 1 lives on node 1 and prints nothing
    for node in nodes:  # one console: ddpkit's lines and the script's, nothing from torch's C++ or elastic logger
        lines = re.split(r"[\r\n]", node.stdout + node.stderr)
        foreign = [line for line in lines if line.strip() and not line.startswith(("ddpkit", "accuracy=", "epoch "))]
        assert foreign == [], foreign
        assert "TCPStore" not in node.stderr and "recvValue" not in node.stderr


def test_nodes_with_different_settings_fail_fast_naming_the_mismatch(tmp_path):
    port = free_port()
    start_time = time.monotonic()
    nodes = wait_all([start(0, port, "--log-dir", tmp_path, nproc=1), start(1, port, "--log-dir", tmp_path, nproc=2)],
                     timeout=60)
    assert time.monotonic() - start_time < 30
    for node in nodes:
        assert node.returncode == 2
        assert "nodes disagree on nproc_per_node: node 0 has 1, node 1 has 2" in node.stderr, node.stderr[-1500:]


def test_a_node_that_never_joins_is_named_after_the_join_timeout(tmp_path):
    start_time = time.monotonic()
    (node,) = wait_all([start(0, free_port(), "--join-timeout", "3", "--log-dir", tmp_path)], timeout=60)
    assert node.returncode == 2 and "expected 2 nodes, but only nodes [0] joined within 3 s" in node.stderr
    assert time.monotonic() - start_time < 20


def _netns_available():
    if os.geteuid() != 0 or not shutil.which("ip"):
        return False
    name = f"ddpkit-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return made


@pytest.fixture
def namespaces():
    """Two network namespaces joined by a veth pair, with their own addresses; removed afterwards."""
    if not _netns_available():
        pytest.skip("needs root and `ip netns`")
    tag = uuid.uuid4().hex[:6]
    ns, veth = [f"ddpk{tag}a", f"ddpk{tag}b"], [f"dka{tag}", f"dkb{tag}"]
    subnet = f"10.231.{int(tag[:2], 16)}"
    steps = [["ip", "netns", "add", ns[0]], ["ip", "netns", "add", ns[1]],
             ["ip", "link", "add", veth[0], "type", "veth", "peer", "name", veth[1]],
             ["ip", "link", "set", veth[0], "netns", ns[0]], ["ip", "link", "set", veth[1], "netns", ns[1]]]
    for i in (0, 1):
        steps += [["ip", "-n", ns[i], "addr", "add", f"{subnet}.{i + 1}/24", "dev", veth[i]],
                  ["ip", "-n", ns[i], "link", "set", veth[i], "up"], ["ip", "-n", ns[i], "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield ns, veth, subnet
    finally:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


def test_two_nodes_across_network_namespaces(tmp_path, namespaces, one_node_accuracy):
    ns, veth, subnet = namespaces
    port = free_port()  # inside private namespaces any port is free; picked the usual way all the same
    nodes = wait_all([start(r, port, "--log-dir", tmp_path / f"logs{r}", addr=f"{subnet}.1",
                            prefix=["ip", "netns", "exec", ns[r]], env={"GLOO_SOCKET_IFNAME": veth[r]},
                            args=["--logdir", str(tmp_path / "tb")]) for r in (0, 1)])
    for node in nodes:
        ok(node)
    assert accuracy(nodes[0]) == one_node_accuracy
