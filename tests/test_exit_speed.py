"""One rank's exit while its peer trains stops the job at once: the rank at exit learns that its peer is inside a
collective it never joins and waits in no final barrier, and torch's agent stops the peer as soon as its exit code is
in (real 2-rank jobs, gloo, CPU).

The bounds are generous (a loaded 2-core CI machine); the measured times are in docs/when-things-go-wrong.md.
"""
import re
import time

import pytest

from conftest import WORKERS, launch

LEAVE = WORKERS / "leave_fast.py"


def _stamp(name, text):
    found = re.search(rf"{name} ([\d.]+)", text)
    assert found, text[-3000:]
    return float(found.group(1))


@pytest.mark.parametrize("how, named", [("sys_exit", "rank 1 exited with code 3"),
                                        ("raise", "failed first: ValueError: bad batch on rank 1"),
                                        ("clean", "rank 1 exited with code 0 while rank 0 was still training")])
def test_a_rank_that_leaves_its_loop_waits_for_no_peer_and_the_job_stops(tmp_path, how, named):
    """Rank 0 trains forever; rank 1 leaves at step 20 (``sys.exit(3)``, an exception, a ``break`` to a normal
    end). Its at-exit shutdown took the 5 s exit wait before (its peer sat in DDP's all-reduce, never at its exit:
    nothing at exit tells a ``sys.exit(3)`` or a return from a rank that finished); now it sees the peer in a
    collective past its own and leaves (~0.15 s here)."""
    r = launch(LEAVE, how, tmp_path, timeout=120,
               launcher_args=["--console-ranks", "all", "--log-dir", tmp_path / "logs"])
    ended = time.time()
    assert r.returncode == 1 and named in r.stderr, r.stderr[-3000:]
    # the failing rank's teardown is spared (gc.freeze), but not what its files buffered
    assert (tmp_path / "rank1.log").read_text().splitlines()[-1] == "step 19", r.stderr[-3000:]
    left = _stamp("LEAVING-AT", r.stderr)
    assert _stamp("SHUTDOWN-DONE-AT", r.stderr) - left < 3.0  # the exit wait alone was 5 s
    assert ended - left < 20  # the peer would train until the collective timeout (60 s); ~1 s here


def test_sigkill_of_one_rank_stops_the_job(tmp_path):
    r = launch(LEAVE, "sigkill", timeout=120, launcher_args=["--console-ranks", "all", "--log-dir", tmp_path / "logs"])
    ended = time.time()
    assert r.returncode == 1 and "failed first: killed by SIGKILL" in r.stderr, r.stderr[-3000:]
    assert ended - _stamp("LEAVING-AT", r.stderr) < 20


def test_a_script_that_destroys_its_group_leaves_no_listener_behind(tmp_path):
    """Most scripts end with dist.destroy_process_group(): the exit listener, waiting on the store for a first
    count that then never comes, is woken and ends (it held the group and the store: a store served by rank 0's
    own process stayed listening)."""
    r = launch(WORKERS / "misc.py", "destroy_then_threads", tmp_path, timeout=120)
    assert r.returncode == 0 and "THREADS ['MainThread'" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "ddpkit-exit-listener" not in r.stdout and "ddpkit-desync" not in r.stdout, r.stdout
    # gone when shutdown() returns, not a moment later: a thread still dropping its store connection and group
    # while the interpreter finalized aborted 4 exits in 10 ("terminate called without an active exception")
    at_once = [line for line in r.stdout.splitlines() if line.startswith("AT-ONCE")]
    assert at_once and not [line for line in at_once if "listener" in line or "desync" in line], r.stdout
