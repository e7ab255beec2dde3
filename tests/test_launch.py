"""The launcher as pure steps, and its argument errors (exit 2, one line, nothing spawned)."""
import json
import re
import sys

import pytest

from conftest import ROOT, run_cmd
from ddpkit.launch import LaunchConfig, LaunchError, main, parse_args, resolve_nproc, torchrun_argv, worker_env

SCRIPT = str(ROOT / "examples" / "digits.py")


@pytest.mark.parametrize("argv, fragment", [
    (["--nproc-per-node", "0", SCRIPT], "--nproc-per-node must be >= 1, got 0"),
    (["--nproc-per-node", "abc", SCRIPT], "must be a positive integer or auto|gpu|cpu, got 'abc'"),
    (["--nproc-per-node", "2", "missing.py"], "script 'missing.py' not found"),
    (["--nnodes", "2", "--node-rank", "5", SCRIPT], "--node-rank must be in [0, 1] for --nnodes 2, got 5"),
    (["--nnodes", "2", SCRIPT], "needs --master-addr"),
    (["--mode", "nope", SCRIPT], "--mode 'nope' is not one of auto, ddp, dp, fsdp, single"),
    (["--mode", "dp", "--nproc-per-node", "2", SCRIPT], "--mode dp runs one process"),
    (["--master-port", "70000", SCRIPT], "--master-port must be in 1..65535"),
    (["--max-restarts", "-1", SCRIPT], "--max-restarts must be >= 0"),
    (["--nproc-per-node", "gpu", SCRIPT], "no CUDA GPU is visible"),
    (["--bogus", SCRIPT], "unrecognized arguments: --bogus"),
    ([], "the following arguments are required: script"),
])
def test_bad_arguments_exit_2_with_one_line(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err  # (argparse's own errors too: they used to escape as a traceback)
    assert err.count("\n") == 1 and err.startswith("ddpkit launch: error: "), err
    assert fragment in err


def test_argument_errors_from_the_command_line():
    for argv in (["--nproc-per-node", "0", "x.py"], ["--nproc-per-node", "abc", "x.py"], ["missing.py"],
                 ["--nnodes", "2", "--node-rank", "5", SCRIPT]):
        r = run_cmd([sys.executable, "-m", "ddpkit", "launch", *argv], timeout=60)
        assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r


def test_nproc_values():
    assert resolve_nproc("gpu", gpus=4, cpus=2) == 4
    assert resolve_nproc("cpu", gpus=4, cpus=2) == 2
    assert resolve_nproc("auto", gpus=0, cpus=3) == 3
    with pytest.raises(LaunchError):
        resolve_nproc("-1", gpus=0, cpus=2)


def test_single_node_uses_the_loopback_rendezvous_on_a_port_the_store_binds_itself():
    cfg = parse_args(["--nproc-per-node", "2", SCRIPT, "--epochs", "1"], gpus=0)
    argv = torchrun_argv(cfg)
    assert argv[argv.index("--rdzv-backend") + 1] == "ddpkit-loopback"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:0" and "--master-port" not in argv
    assert argv[-3:] == [SCRIPT, "--epochs", "1"]  # script arguments pass through untouched


def test_elastic_form_uses_torchs_c10d_rendezvous_with_the_join_timeout():
    cfg = parse_args(["--nnodes", "1:3", "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "job7",
                      "--join-timeout", "60", SCRIPT], gpus=0)
    argv = torchrun_argv(cfg)
    assert (cfg.min_nodes, cfg.max_nodes, cfg.world_size) == (1, 3, 3)
    assert argv[argv.index("--nnodes") + 1] == "1:3" and argv[argv.index("--rdzv-backend") + 1] == "c10d"
    assert argv[argv.index("--rdzv-id") + 1] == "job7" and argv[argv.index("--rdzv-conf") + 1] == "join_timeout=60"
    assert "--node-rank" not in argv and "--master-addr" not in argv


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "1:2", "--master-addr", "h", SCRIPT], "(a range) needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "h:1", SCRIPT], "needs 1 <= MIN <= MAX, got 3:2"),
    (["--nnodes", "2", "--rdzv-endpoint", "h", SCRIPT], "--rdzv-endpoint must be HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "1", SCRIPT], "assigns node ranks itself"),
    (["--nnodes", "a:2", SCRIPT], "--nnodes must be an integer, got 'a'"),
])
def test_bad_elastic_arguments_are_one_line_errors(argv, message):
    with pytest.raises(LaunchError, match=re.escape(message)):
        parse_args(argv, gpus=0)


def test_multi_node_passes_the_rendezvous_address():
    cfg = parse_args(["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29400",
                      SCRIPT], gpus=0)
    argv = torchrun_argv(cfg)
    assert argv[argv.index("--master-addr") + 1] == "10.0.0.1" and argv[argv.index("--node-rank") + 1] == "1"
    assert cfg.world_size == 2


def test_omp_threads_shared_between_local_processes_unless_set():
    cfg = LaunchConfig(script=SCRIPT, nproc_per_node=4)
    env, notes = worker_env(cfg, {}, cores=16)
    assert env["OMP_NUM_THREADS"] == "4" and "16 cores / 4" in notes[0]
    env, notes = worker_env(cfg, {"OMP_NUM_THREADS": "7"}, cores=16)
    assert "OMP_NUM_THREADS" not in env and not notes
    assert env["DDPKIT_MODE"] == "ddp"


def test_summary_prefers_the_crash_over_the_ranks_the_agent_terminated(tmp_path):
    from ddpkit.faults import report

    code, text = report(str(tmp_path), {0: "killed by SIGTERM", 1: "killed by SIGABRT"})
    assert code == 1 and text.startswith("ddpkit: rank 1 failed first: killed by SIGABRT")


def test_a_cut_short_error_report_is_skipped_not_a_launcher_crash(tmp_path):
    """A full disk can leave half a report (seen with rank 1's file size limit in test_sharded_checkpoint)."""
    from ddpkit.faults import report

    whole = {"rank": 0, "local_rank": 0, "host": "h", "pid": 1, "time": 1.0, "type": "OSError",
             "message": "disk full", "traceback": "Traceback ...\nOSError: disk full\n"}
    (tmp_path / "error-rank0.json").write_text(json.dumps(whole))
    (tmp_path / "error-rank1.json").write_text(json.dumps({**whole, "rank": 1})[:60])
    code, text = report(str(tmp_path))
    assert code == 1 and text.startswith("ddpkit: rank 0 on h failed first: OSError: disk full")


def test_a_taken_master_port_on_one_node_is_a_one_line_error_before_spawning():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = run_cmd([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--master-port", str(port),
                     SCRIPT], timeout=60)
    assert r.returncode == 2, r.stderr
    assert f"--master-port {port} is not free on 127.0.0.1" in r.stderr and "per-rank logs" not in r.stderr


@pytest.mark.parametrize("device, gpus, nproc, mode, refused", [
    (None, 1, 2, "ddp", True), ("cuda", 1, 2, "ddp", True), (None, 2, 4, "fsdp", True),
    ("cpu", 1, 2, "ddp", False), (None, 1, 1, "ddp", False), (None, 2, 2, "ddp", False), (None, 1, 1, "dp", False),
])
def test_one_gpu_shared_by_several_local_processes_is_refused_up_front(device, gpus, nproc, mode, refused):
    """Every rank would take cuda:0 and NCCL would fail at the first collective ("Duplicate GPU detected")."""
    make = lambda: LaunchConfig(script=SCRIPT, nproc_per_node=nproc, mode=mode, device=device, gpus=gpus)  # noqa: E731
    if not refused:
        make()
        return
    with pytest.raises(LaunchError) as err:
        make()
    assert str(err.value).count("\n") == 0
    assert f"{nproc} processes per node need {nproc} GPUs" in str(err.value) and f"{gpus} usable" in str(err.value)
    assert f"pass --nproc-per-node {gpus} or --device cpu" in str(err.value)


def test_multi_node_without_a_port_uses_torchruns_default_in_the_preflight_too():
    from ddpkit import preflight

    cfg = parse_args(["--nnodes", "2", "--master-addr", "10.0.0.1", SCRIPT], gpus=0)
    assert cfg.master_port is None and cfg.node0_port == 29500
    argv = torchrun_argv(cfg)
    assert argv[argv.index("--master-port") + 1] == "29500"
    # a second node only connects (nothing binds 29500 here): it used to be a TypeError traceback (port None)
    second = parse_args(["--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", SCRIPT], gpus=0)
    problem = preflight.check_nodes(second, join_timeout_s=0.5)
    assert problem and "127.0.0.1:29500" in problem, problem


def test_the_preflight_compares_device_and_backend():
    from ddpkit.preflight import disagreement, node_settings

    gpu = LaunchConfig(script=SCRIPT, max_nodes=2, master_addr="h", gpus=1)
    cpu = LaunchConfig(script=SCRIPT, max_nodes=2, master_addr="h", device="cpu", gpus=0)
    a, b = node_settings(gpu), node_settings(cpu)
    assert (a["device"], a["backend"], b["device"], b["backend"]) == ("cuda", "nccl", "cpu", "gloo")
    assert disagreement({0: a, 1: b}).startswith("nodes disagree on device: node 0 has cuda, node 1 has cpu")


def test_omp_threads_come_from_the_usable_cores_not_the_machines():
    from ddpkit.launch import usable_cores

    assert usable_cores({0}, cpu_count=2) == 1 and usable_cores({0, 1, 2, 3}, cpu_count=64) == 4
    assert usable_cores() == len(__import__("os").sched_getaffinity(0))
    env, notes = worker_env(LaunchConfig(script=SCRIPT), {}, cores=usable_cores({0}, cpu_count=2))
    assert env["OMP_NUM_THREADS"] == "1" and "1 cores / 1 local processes" in notes[0]


def test_an_elastic_nodes_failures_are_matched_with_their_own_stderr_logs(tmp_path):
    """On the second node of an elastic launch global rank 2 is local rank 0: its NCCL watchdog line is in
    .../attempt_0/0/stderr.log, and the report must read it (it said "killed by SIGABRT")."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpkit.supervise import failure_report, first_local_rank, stderr_tails

    folder = tmp_path / "logs" / "run" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    (folder / "stderr.log").write_text("[Rank 2] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3)\n")
    missing = str(tmp_path / "none.json")
    exc = ChildFailedError("train.py", {2: ProcessFailure(0, 11, -6, missing), 3: ProcessFailure(1, 12, -15, missing)})
    assert first_local_rank(exc, default=0) == 2
    (tmp_path / "report" / "attempt0").mkdir(parents=True)
    tails = stderr_tails(str(tmp_path / "logs"), first_local_rank(exc, 0))
    code, text = failure_report(exc, str(tmp_path / "report"), tails)
    assert code == 3 and "first timeout on rank 2 (NCCL watchdog, killed by SIGABRT)" in text, text


def test_a_users_timeout_is_not_a_collective_timeout():
    import subprocess

    import torch.distributed as dist

    from ddpkit.faults import collective_timeout

    assert not collective_timeout(TimeoutError, "read timed out fetching https://example.com/shard-3")
    assert not collective_timeout(subprocess.TimeoutExpired, "Command 'aws s3 cp' timed out after 30 seconds")
    assert not collective_timeout(RuntimeError, "HTTPSConnectionPool: Read timed out. (read timeout=10)")
    assert collective_timeout(dist.DistBackendError, "[c10d] wait timeout after 20000ms")
    assert collective_timeout(RuntimeError, "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                                            "waiting 6000ms for recv operation to complete")


def test_the_console_leaves_a_workers_traceback_block_to_its_log(tmp_path, capsys):
    from ddpkit.faults import TRACEBACK_BEGIN, TRACEBACK_END
    from ddpkit.logs import ConsoleTail

    folder = tmp_path / "run" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    (folder / "stderr.log").write_text(f"ddpkit: rank 0 raised ValueError: x\n{TRACEBACK_BEGIN}\nTraceback (most "
                                       f"recent call last):\nValueError: x\n{TRACEBACK_END}\nafter\n")
    tail = ConsoleTail(str(tmp_path), {0}, 0, 1)
    tail._poll()
    tail._flush(force=True)
    assert capsys.readouterr().err == "ddpkit: rank 0 raised ValueError: x\nafter\n"


def test_only_torchs_own_collective_timeouts_are_hangs():
    """A store connect timeout is a rendezvous/network failure; a user's RuntimeError naming NCCL is the user's;
    a monitored barrier that a rank failed to pass is a hang, although its message says no "timeout"."""
    import torch.distributed as dist

    from ddpkit.faults import collective_timeout

    assert not collective_timeout(dist.DistNetworkError, "The client socket has timed out after 60000ms while trying "
                                                         "to connect to (10.0.0.1, 29500).")
    assert not collective_timeout(RuntimeError, "HTTP read timed out (NCCL download mirror)")
    assert collective_timeout(RuntimeError, "Rank 1 failed to pass monitoredBarrier in 30000 ms")
    assert collective_timeout(dist.DistBackendError, "Rank 1 failed to pass monitoredBarrier in 30000 ms")
    assert collective_timeout(RuntimeError, "[Rank 0] Watchdog caught collective operation timeout: "
                                            "WorkNCCL(SeqNum=7, OpType=ALLREDUCE, Timeout(ms)=600000)")
    assert collective_timeout(dist.DistStoreError, "Socket Timeout")
