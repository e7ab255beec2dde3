"""The suite's warm interpreters (tests/warm.py) run a command as a fresh interpreter would: same output, exit
codes, signals, argv, sys.path, environment and working directory; fresh random seeds; a timeout takes the
whole session; a nested interpreter is forked too, a worker under torch's agent is a real child of its parent."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import warm

from conftest import alive

SCRIPT = textwrap.dedent("""
    import os, sys, random
    import numpy, torch
    import sibling
    print("argv", sys.argv[1:], "cwd", os.getcwd() == sys.argv[1], "var", os.environ.get("WARM_VAR"))
    print("seeds", torch.initial_seed(), numpy.random.randint(1 << 30), random.random())
    print("to stderr", file=sys.stderr)
    print("file", __file__ == os.path.abspath(__file__), "lines a\\rb\\r\\nc")
    how = sys.argv[2]
    if how == "raise":
        raise ValueError("boom")
    if how == "kill":
        os.kill(os.getpid(), 9)
    if how == "interrupt":
        raise KeyboardInterrupt
    sys.exit(int(how))
""")


def _both(cmd, env, cwd):
    """The command forked from the warm server, then as a plain subprocess."""
    forked = warm.run(cmd, env, cwd, timeout=120)
    assert forked is not None, "a plain python command must be warmable"
    cold = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return forked, cold


@pytest.mark.parametrize("how, code", [("0", 0), ("3", 3), ("raise", 1), ("kill", -9), ("interrupt", -2)])
def test_a_forked_command_ends_and_prints_as_an_exec_does(tmp_path, how, code):
    (tmp_path / "sibling.py").write_text("")
    (tmp_path / "s.py").write_text(SCRIPT)
    env = {**os.environ, "WARM_VAR": "x", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    forked, cold = _both([sys.executable, "s.py", str(tmp_path), how], env, tmp_path)  # relative, as a user runs it
    assert forked.returncode == cold.returncode == code, (forked, cold)
    strip = [line for line in forked.stdout.splitlines() if not line.startswith("seeds")]
    assert strip == [line for line in cold.stdout.splitlines() if not line.startswith("seeds")]
    assert strip[0] == f"argv ['{tmp_path}', '{how}'] cwd True var x"
    assert forked.stderr.startswith("to stderr\n") and forked.stderr == cold.stderr, (forked.stderr, cold.stderr)


def test_each_forked_command_draws_fresh_seeds_as_a_new_interpreter(tmp_path):
    (tmp_path / "sibling.py").write_text("")
    (tmp_path / "s.py").write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    seeds = [next(line for line in warm.run([sys.executable, str(tmp_path / "s.py"), str(tmp_path), "0"], env,
                                             tmp_path, timeout=120).stdout.splitlines() if line.startswith("seeds"))
             for _ in range(2)]
    assert all(a != b for a, b in zip(seeds[0].split()[1:], seeds[1].split()[1:])), seeds


def test_a_timeout_kills_the_command_and_what_it_started(tmp_path):
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); print(p.pid, flush=True); time.sleep(60)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        warm.run([sys.executable, "-c", code], env, tmp_path, timeout=8)
    grandchild = int(stopped.value.output.split()[0])
    for _ in range(50):  # SIGKILLed with its session; reaped by the server (not this process's child)
        if not alive(grandchild):
            break
        time.sleep(0.1)
    assert not alive(grandchild)


def test_a_nested_interpreter_is_forked_and_a_torch_agents_worker_is_its_parents_child(tmp_path):
    code = textwrap.dedent("""
        import os, subprocess, sys
        ask = [sys.executable, "-c", "import os, sys; print(os.getppid(), sys.executable)"]
        print("me", os.getpid())
        print("nested", subprocess.run(ask, capture_output=True, text=True).stdout.strip())
        worker = subprocess.run(ask, capture_output=True, text=True, env={**os.environ, "TORCHELASTIC_RUN_ID": "x"})
        print("worker", worker.stdout.strip())
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out = dict(line.split(" ", 1) for line in warm.run([sys.executable, "-c", code], env, tmp_path,
                                                        timeout=120).stdout.splitlines())
    me = out["me"]
    nested_parent, _ = out["nested"].split()
    worker_parent, worker_python = out["worker"].split()
    assert nested_parent != me  # forked from the server
    assert worker_parent == me and worker_python == sys.executable  # an exec: the agent's own child


@pytest.mark.parametrize("error, code", [("ValueError('boom')", 1), ("KeyboardInterrupt()", -2)])
def test_atexit_code_sees_the_failure_of_a_script_as_after_an_exec(tmp_path, error, code):
    """ddpkit's shutdown at exit skips the peers' barrier after an uncaught exception, which it reads from
    sys.last_value: a forked command that did not set it made a failed rank wait 10 s for its peers. After a
    KeyboardInterrupt the interpreter runs atexit before it ends itself with SIGINT."""
    (tmp_path / "s.py").write_text("import atexit, sys\n"
                                   "atexit.register(lambda: print('failed', repr(getattr(sys, 'last_value', None))))\n"
                                   f"raise {error}\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    forked, cold = _both([sys.executable, "s.py"], env, tmp_path)
    assert forked.returncode == cold.returncode == code
    assert forked.stdout == cold.stdout == f"failed {error}\n", (forked.stdout, cold.stdout)


RANK = textwrap.dedent("""
    import os, random, sys
    preloaded = "torch" in sys.modules
    import numpy, torch
    print("rank", os.environ["RANK"], os.getppid(), preloaded, torch.initial_seed(), random.random(),
          numpy.random.randint(1 << 30), sys.executable, flush=True)
""")


@pytest.mark.parametrize("warm_ranks", ["1", "0"])
def test_ranks_under_a_launcher_are_its_children_forked_warm_with_seeds_of_their_own(tmp_path, warm_ranks):
    """tests/zygote.py: a rank torch's agent starts is forked from a clean interpreter but is the launcher's
    child (ddpkit's worker dies with that parent); DDPKIT_TEST_WARM=0 execs it as ever."""
    (tmp_path / "r.py").write_text(RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "DDPKIT_TEST_WARM": warm_ranks}
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "3", "--console-ranks", "all", "r.py"]
    done = warm.run(cmd, env, tmp_path, timeout=120) or subprocess.run(cmd, env=env, cwd=tmp_path, text=True,
                                                                        capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    launcher = done.stderr.split("per-rank logs in ", 1)[1].split()[0].rsplit("-", 1)[1]  # <time>-<pid>
    ranks = [line.split("rank ", 1)[1].split() for line in done.stdout.splitlines() if "]: rank " in line]
    assert sorted(r[0] for r in ranks) == ["0", "1", "2"], done.stdout
    assert {r[1] for r in ranks} == {launcher}, (launcher, ranks)
    assert {r[2] for r in ranks} == {"True" if warm_ranks == "1" else "False"}, ranks
    for column in (3, 4, 5):  # torch's, random's and numpy's seeds: each rank draws its own
        assert len({r[column] for r in ranks}) == 3, ranks
    assert {r[6] for r in ranks} == {sys.executable}, ranks  # the interpreter, as an exec'd rank has it


def test_what_a_fork_could_change_runs_cold():
    base = {"OMP_NUM_THREADS": "1"}
    assert warm.warmable([sys.executable, "-u", "-m", "ddpkit", "launch"], base, base)
    assert not warm.warmable([sys.executable, "-X", "faulthandler", "t.py"], base, base)
    assert not warm.warmable([sys.executable, "t.py"], {**base, "PYTHONPATH": "/x"}, base)
    assert not warm.warmable([sys.executable, "t.py"], {**base, "DDPKIT_TEST_WARM": "0"}, base)
    assert not warm.warmable(["/usr/bin/python3", "t.py"], base, base)


def test_a_script_named_relatively_spawns_children_that_find_it(tmp_path):
    """multiprocessing's spawn (ddpkit.spawn's) re-runs the main script by the path it was started with."""
    (tmp_path / "sp.py").write_text(textwrap.dedent("""
        import multiprocessing as mp
        def hello():
            print("child ran", flush=True)
        if __name__ == "__main__":
            p = mp.get_context("spawn").Process(target=hello)
            p.start()
            p.join()
            raise SystemExit(p.exitcode)
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = warm.run([sys.executable, "sp.py"], env, tmp_path, timeout=120)
    assert done.returncode == 0 and done.stdout == "child ran\n", done


def test_a_client_that_goes_away_before_its_request_leaves_the_server_serving(tmp_path):
    import socket

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    assert warm.run([sys.executable, "-c", "pass"], env, tmp_path, timeout=120).returncode == 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as half:
        half.connect(warm._server["sock"])  # and closes without a word
    assert warm.run([sys.executable, "-c", "print(7)"], env, tmp_path, timeout=120).stdout == "7\n"
