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
