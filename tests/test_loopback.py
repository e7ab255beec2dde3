"""Security: a single-node run listens on loopback only (launcher store and workers), checked with `ss`."""
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import SCRATCH
from ddpkit.runtime.faults import children

WAITER = """
import os, sys, time, torch, ddpkit
ddpkit.init()
ddpkit.reduce(torch.ones(1))  # the group is up: every socket it needs is open
if torch.distributed.get_rank() == 0:
    open(sys.argv[1], "w").write("ready")
while not os.path.exists(sys.argv[1] + ".go"):
    time.sleep(0.1)
ddpkit.shutdown()
"""


def tree(pid):
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children(p)
    return found


def listening(pids):
    """(address, pid) of every TCP listening socket owned by one of ``pids``, from `ss -ltnp`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        local = line.split()[3]
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.append((local.rsplit(":", 1)[0], pid))
    return found


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2)")
@pytest.mark.parametrize("form", ["single", "elastic"])
def test_single_node_run_listens_on_loopback_only(tmp_path, form):
    """The elastic form with a loopback --rdzv-endpoint too (torch's c10d rendezvous: its rendezvous store and
    the workers' store listened on every interface)."""
    from test_multinode import free_port

    script, flag = tmp_path / "wait.py", tmp_path / "ready"
    script.write_text(WAITER)
    elastic = ["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf",
               "last_call_timeout=1"] if form == "elastic" else []
    launcher = subprocess.Popen([sys.executable, "-m", "ddpkit", "launch", *elastic, "--nproc-per-node", "2",
                                 "--log-dir", str(tmp_path / "logs"), str(script), str(flag)],
                                cwd=SCRATCH, env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not flag.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert flag.exists(), f"workers never came up: {launcher.communicate(timeout=30)}"
        pids = tree(launcher.pid)
        sockets = listening(pids)
        (tmp_path / "ready.go").write_text("")
        out, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, 9)
    assert launcher.returncode == 0, err
    assert len(pids) >= 3  # launcher + 2 workers
    # the launcher's store and each worker's gloo listener, all on loopback
    assert {pid for _, pid in sockets} >= {launcher.pid}, sockets
    assert len({pid for _, pid in sockets}) >= 3, sockets
    exposed = [(addr, pid) for addr, pid in sockets if addr not in ("127.0.0.1", "[::1]")]
    assert not exposed, f"listening beyond loopback: {exposed}"


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2)")
def test_doctor_all_reduce_listens_on_loopback_only():
    import threading

    from ddpkit.commands.doctor import smoke_test

    found = []
    thread = threading.Thread(target=lambda: found.append(smoke_test("gloo", timeout_s=90)))
    thread.start()
    sockets = set()
    while thread.is_alive():  # the store and both workers' gloo listeners, sampled while they exist
        sockets |= set(listening(tree(os.getpid())))
        time.sleep(0.02)
    thread.join()
    assert found and found[0].verdict == "ok", found
    assert {pid for _, pid in sockets} >= {os.getpid()}, sockets  # the store was seen
    assert len({pid for _, pid in sockets}) >= 2, sockets  # and at least one worker's listener
    exposed = [(addr, pid) for addr, pid in sockets if addr not in ("127.0.0.1", "[::1]")]
    assert not exposed, f"doctor listens beyond loopback: {exposed}"
