"""How a process starts (issue 19): the orphan guard under a PID-1 parent, bad launch variables, and what the
launcher says about modes. Real processes; the PID-1 case in a new PID namespace where root can make one."""
import os
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT, WORKERS, launch, ok, run_cmd
from ddpkit.commands.launch import parse_args
from ddpkit.core.environment import ProcessEnv
from ddpkit.launcher.config import LaunchError
from ddpkit.runtime.group import choose_mode

TRAIN = ("import ddpkit, torch; s = ddpkit.init(); m = ddpkit.prepare_model(torch.nn.Linear(2, 1)); "
         "m(torch.randn(4, 2)).sum().backward(); print('TRAINED', s.rank, flush=True)")
TORCHRUN_ONE = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}


def _namespaces() -> str | None:
    """Why a PID namespace cannot be made here, or None."""
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "needs root and unshare"
    probe = subprocess.run(["unshare", "-pf", "--mount-proc", "true"], capture_output=True)
    return None if probe.returncode == 0 else f"unshare failed: {probe.stderr.decode()[:100]}"


def _under_pid1(extra_env):
    # `; exit $?` keeps sh as PID 1 and python its child (a lone command would be exec'd by sh)
    env = " ".join(f"{k}={v}" for k, v in {**TORCHRUN_ONE, **extra_env}.items())
    return run_cmd(["unshare", "-pf", "--mount-proc", "sh", "-c", f"{env} {sys.executable} -c \"{TRAIN}\"; exit $?"],
                   timeout=120)


@pytest.mark.skipif(_namespaces() is not None, reason=str(_namespaces()))
@pytest.mark.parametrize("extra_env", [{}, {"TORCHELASTIC_RUN_ID": "x", "DDPKIT_LAUNCHER_PID": "1"}],
                         ids=["shell-as-pid1", "launcher-as-pid1"])
def test_a_pid1_parent_does_not_kill_the_worker(extra_env):
    r = _under_pid1(extra_env)
    assert r.returncode == 0 and "TRAINED 0" in r.stdout, (r.returncode, r.stderr[-1000:])


@pytest.mark.skipif(_namespaces() is not None, reason=str(_namespaces()))
def test_a_worker_whose_launcher_is_gone_still_dies():
    r = _under_pid1({"TORCHELASTIC_RUN_ID": "x", "DDPKIT_LAUNCHER_PID": "999999"})
    assert r.returncode == 128 + 9 and "TRAINED" not in r.stdout, (r.returncode, r.stdout)


@pytest.mark.parametrize("variable, value", [("MASTER_PORT", "abc"), ("LOCAL_RANK", "zz"), ("WORLD_SIZE", "two"),
                                             ("DDPKIT_DEVICE", "tpu"), ("MASTER_PORT", "70000")])
def test_malformed_launch_variables_are_one_line(variable, value):
    r = run_cmd([sys.executable, "-c", "import ddpkit; ddpkit.init()"],
                env={**TORCHRUN_ONE, "WORLD_SIZE": "2", variable: value}, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("ddpkit: error: ") and variable in r.stderr


def test_mode_from_the_environment_is_honoured_or_refused():
    script = str(ROOT / "examples" / "digits.py")
    assert parse_args([script], gpus=0, environ={"DDPKIT_MODE": "dp"}).mode == "dp"
    assert parse_args([script], gpus=0, environ={"DDPKIT_MODE": "auto"}).mode == "ddp"
    with pytest.raises(LaunchError, match="--mode ddp contradicts DDPKIT_MODE=dp"):
        parse_args(["--mode", "ddp", script], gpus=0, environ={"DDPKIT_MODE": "dp"})
    assert parse_args([script], gpus=0, environ={"DDPKIT_MODE": "single"}).mode == "single"
    with pytest.raises(LaunchError, match="--mode single runs one process on one node"):
        parse_args(["--nproc-per-node", "2", script], gpus=0, environ={"DDPKIT_MODE": "single"})


def test_dp_without_gpus_says_the_fallback_once_up_front(tmp_path):
    script = tmp_path / "mode.py"
    script.write_text("import ddpkit\nprint('MODE', ddpkit.init().mode)\n")
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "launch", "--mode", "dp", str(script)], timeout=60))
    assert "MODE single" in r.stdout
    assert r.stderr.count("needs >= 2 GPUs") == 1 and "DataParallel)" not in r.stderr, r.stderr
    assert "mode 'dp' asked for" not in r.stderr  # the worker does not say it again


def test_an_elastic_job_shrunk_to_one_process_is_not_told_to_use_ddpkit_launch():
    env = ProcessEnv("torchrun", rank=0, local_rank=0, world_size=1, local_world_size=1)
    mode, reason = choose_mode("ddp", env, 0)
    assert mode == "single" and "ddpkit launch" not in reason and "world size 1" in reason


def test_one_rank_sys_exit_ends_the_job_in_seconds_with_its_code(tmp_path):
    # SystemExit reaches no excepthook: the exiting rank must not wait at exit for a peer that waits for it
    r = launch(WORKERS / "early_exit.py", tmp_path, timeout=150)
    took = time.time() - float((tmp_path / "leaving").read_text())
    assert took < 30, f"{took:.0f} s from rank 1's sys.exit(3) to the launcher's exit: it waited for the timeout"
    assert r.returncode != 0 and "rank 1 exited with code 3" in r.stderr, (r.returncode, r.stderr[-2000:])
    assert "rank 0 finished its backward" not in r.stdout
