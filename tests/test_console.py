"""The launcher's console on real launches (gloo, CPU): who printed what, in print order, restarts and Ctrl-C
shown, and a summary that names the right rank and cause."""
import os
import signal
import subprocess
import sys
import time

from conftest import SCRATCH, WORKERS, launch, ok

CONSOLE = WORKERS / "console.py"


def test_every_ranks_output_is_prefixed_whole_and_in_blocks(tmp_path):
    """--console-ranks all: [rankN]: prefixes; a rank's multi-line print stays one block; a UTF-8 character
    split across two reads is whole; the last line without a newline is shown; N copies that never formed a
    group are warned about."""
    logs = tmp_path / "logs"
    # two earlier launches' folders (an older ddpkit's marks); "mine" is the user's, "best-run" one they renamed
    for n, name in enumerate(["20250101-000000-1", "20250101-000000-2"]):
        (logs / name).mkdir(parents=True)
        (logs / name / ".ddpkit-run").write_text(str(n))
    (logs / "mine").mkdir()
    (logs / "best-run").mkdir()
    (logs / "best-run" / ".ddpkit-run").write_text('{"name": "20240101-000000-9", "created_ns": 0}')
    r = ok(launch(CONSOLE, "chatter", tmp_path, launcher_args=["--console-ranks", "all", "--log-dir", logs,
                                                               "--keep-logs", "2"]))
    left = sorted(p.name for p in logs.iterdir() if not p.name.startswith("2026"))
    assert left == ["20250101-000000-2", "best-run", "mine"], left
    out = r.stdout.splitlines()
    for rank in (0, 1):
        p = f"[rank{rank}]: "
        block = [f"{p}summary of rank {rank}:", f"{p}  common line", f"{p}  value {rank}"]
        start = out.index(block[0])
        assert out[start:start + 3] == block, r.stdout
        assert f"[rank{rank}]: café from rank {rank}" in out, r.stdout
        assert f"[rank{rank}]: accuracy=0.9{rank}" in out, r.stdout
    assert "\ufffd" not in r.stdout
    assert "2 processes ran and exited 0, and none called ddpkit.init()" in r.stderr, r.stderr


def test_a_restart_shows_on_the_console_and_start_up_lines_precede_the_progress_bar(tmp_path):
    r = ok(launch(CONSOLE, "restart", tmp_path, launcher_args=["--max-restarts", "1", "--log-dir", tmp_path],
                  timeout=240))
    err = r.stderr  # text mode: the bar's \r reads as \n
    restart = err.find("ddpkit launch: rank 1 killed by SIGKILL; restarting: attempt 2 of 2")
    started = err.rfind("(rank 0 of 2)")
    assert 0 <= restart < started < err.find("step 1/3") < err.find("step 3/3"), err
    # once the run is over, the attempt's summary names the killed rank, not its peer's consequence
    assert "attempt 1 failed (rank 1 killed by SIGKILL; the logs: " in err, err  # counted as the notice counts
    assert "none called ddpkit.init()" not in err


def test_ctrl_c_prints_where_each_rank_was(tmp_path):
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
           str(CONSOLE), "ctrlc", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=SCRATCH, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        time.sleep(0.5)  # rank 0 is inside its barrier by then
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert "stopped by signal SIGINT" in err, err
    assert "rank 0 waits in a collective (barrier) at console.py" in err, err
    assert "rank 1 is at console.py" in err and "in slow_step" in err, err


def test_a_usage_error_is_said_as_such_and_names_the_rank_that_stopped_first(tmp_path):
    r = launch(CONSOLE, "usage", tmp_path, launcher_args=["--log-dir", tmp_path])
    assert r.returncode == 1, r.stderr
    assert "rank 1 exited with code 2 (a usage error: console.py: error: the following arguments are required: " \
           "--epochs)" in r.stderr, r.stderr
    assert "without a Python exception" not in r.stderr


def test_the_rank_that_failed_first_by_time_is_named_and_the_consequences_come_after(tmp_path):
    """Both ranks raised before ddpkit.init and torch lists both; rank 1's log was written first."""
    from test_launch import _failed_run

    tb = "Traceback (most recent call last):\n  File \"t.py\", line 3, in <module>\n    load()\nValueError: {}\n"
    logs = {0: tb.format("no data on rank 0"), 1: tb.format("no data on rank 1")}
    for rank, age in ((0, 1.0), (1, 2.0)):  # rank 1's last write is older
        folder = tmp_path / "logs" / "run" / "attempt_0" / str(rank)
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(logs[rank])
        stamp = time.time() - age
        os.utime(folder / "stderr.log", (stamp, stamp))
    code, text = _failed_run(tmp_path, {0: 1, 1: 1}, {}, reached_init=[])
    assert code == 1 and text.startswith("ddpkit: rank 1 failed first: ValueError: no data on rank 1"), text


def test_log_folders_beyond_the_newest_n_that_ddpkit_made_are_removed(tmp_path):
    from ddpkit.launcher.console import new_run_dir, release

    made = [new_run_dir(str(tmp_path), keep=3) for _ in range(5)]
    for path in made:  # those launches are over
        release(path)
    (tmp_path / "mine").mkdir()  # not made by ddpkit: never removed
    current = new_run_dir(str(tmp_path), keep=3)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["mine", *(os.path.basename(p) for p in made[-2:]), os.path.basename(current)]), left
    assert os.path.isdir(current)


def _tail(tmp_path, capsys, console, logs):
    from ddpkit.launcher.console import ConsoleTail

    for rank, text in logs.items():
        folder = tmp_path / "run" / "attempt_0" / str(rank)
        folder.mkdir(parents=True)
        (folder / "stdout.log").write_text(text)
    tail = ConsoleTail(str(tmp_path), console, 0, len(logs))
    tail._poll()
    tail._flush(force=True)
    return capsys.readouterr().out.splitlines()


def test_twins_are_joined_only_where_each_shown_ranks_lines_keep_their_order(tmp_path, capsys):
    assert _tail(tmp_path / "a", capsys, {0, 1}, {0: "S0\nC\nV0\n", 1: "S1\nC\nV1\n"}) == \
        ["[rank0]: S0", "[rank0]: C", "[rank0]: V0", "[rank1]: S1", "[rank1]: C", "[rank1]: V1"]
    assert _tail(tmp_path / "b", capsys, {0}, {0: "E0\nS\n", 1: "E1\nS\n"}) == ["E0", "S [x2 ranks]"]
    assert _tail(tmp_path / "c", capsys, {0, 1}, {0: "epoch 1\nx0\n", 1: "epoch 1\nx1\n"}) == \
        ["[rank0-1]: epoch 1", "[rank0]: x0", "[rank1]: x1"]


def test_a_log_folder_in_use_or_renamed_by_the_user_is_never_rotated_out(tmp_path):
    """Two launches into one log dir with --keep-logs 1: the running one's folder stays (its console reads
    it); a folder the user renamed is theirs, not ddpkit's."""
    from ddpkit.launcher.console import new_run_dir, release

    holder = subprocess.Popen([sys.executable, "-c", "import sys; from ddpkit.launcher.console import new_run_dir; "
                               f"print(new_run_dir({str(tmp_path)!r}, keep=1), flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        running = holder.stdout.readline().strip()  # launch A, still running
        assert os.path.isdir(running), running
        renamed = new_run_dir(str(tmp_path), keep=1)
        release(renamed)
        os.rename(renamed, tmp_path / "best-run")
        for _ in range(2):  # launch B, then C: each rotates with keep=1
            release(new_run_dir(str(tmp_path), keep=1))
        assert os.path.isdir(running) and (tmp_path / "best-run").is_dir()
        assert len(os.listdir(tmp_path)) == 3, os.listdir(tmp_path)  # A, best-run, C
    finally:
        holder.communicate("")
    release(new_run_dir(str(tmp_path), keep=1))  # A has ended: its folder may go now
    assert not os.path.exists(running) and (tmp_path / "best-run").is_dir() and len(os.listdir(tmp_path)) == 2


class _Console:
    """Both console streams into one buffer, as a terminal shows them."""

    def __init__(self, tmp_path, monkeypatch, world: int, console=frozenset({0})):
        import io

        from ddpkit.launcher.console import ConsoleTail

        self.buf, self.root = io.StringIO(), tmp_path
        monkeypatch.setattr(sys, "stdout", self.buf)
        monkeypatch.setattr(sys, "stderr", self.buf)
        self.tail = ConsoleTail(str(tmp_path), set(console), 0, world)
        for rank in range(world):
            (tmp_path / "run" / "attempt_0" / str(rank)).mkdir(parents=True)

    def write(self, rank: int, stream: str, text: str) -> None:
        with open(self.root / "run" / "attempt_0" / str(rank) / f"{stream}.log", "a") as f:
            f.write(text)
        self.tail._poll()


def test_the_console_keeps_print_order_across_streams_and_ranks(tmp_path, monkeypatch):
    c = _Console(tmp_path, monkeypatch, 2)
    c.write(0, "stderr", "ddpkit: started (rank 0 of 2)\n")  # one rank's line: waits for a twin
    for rank in (0, 1):
        c.write(rank, "stdout", "epoch 0\n")  # every rank's line, printed after it
    c.write(0, "stderr", "\rbar 1/2\rbar 2/2\n")  # a progress bar's last update ends with a newline
    for rank in (0, 1):
        c.write(rank, "stdout", "epoch 1\n")
    c.tail._flush(force=False)
    c.tail._flush(force=True)
    assert c.buf.getvalue() == "ddpkit: started (rank 0 of 2)\nepoch 0 [x2 ranks]\n\rbar 1/2\rbar 2/2\n" \
                               "epoch 1 [x2 ranks]\n", repr(c.buf.getvalue())


def test_a_progress_bar_update_shows_once_it_is_quiet_not_one_update_late(tmp_path, monkeypatch):
    from ddpkit.launcher.console import _BAR_QUIET_S

    c = _Console(tmp_path, monkeypatch, 1)
    c.write(0, "stderr", "\rbar 1/3")  # tqdm writes \r, then the text, and nothing until the next update
    time.sleep(_BAR_QUIET_S + 0.05)
    c.tail._poll()
    assert c.buf.getvalue() == "\rbar 1/3", repr(c.buf.getvalue())
    c.write(0, "stderr", "\rbar 2/3")
    time.sleep(_BAR_QUIET_S + 0.05)
    c.tail._poll()
    c.write(0, "stderr", "\rbar 3/3\n")
    c.tail._flush(force=True)
    assert c.buf.getvalue() == "\rbar 1/3\rbar 2/3\rbar 3/3\n", repr(c.buf.getvalue())


def _wait_until_torch_loads(pid, timeout=60.0):
    """Return once torch's shared libraries are mapped into pid (its import has begun)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/maps") as f:
            if "libtorch" in f.read():
                return
        time.sleep(0.005)
    raise AssertionError(f"torch never loaded in {pid} within {timeout} s")


def test_ctrl_c_while_the_launcher_starts_is_one_line_and_exit_130(tmp_path):
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", "--log-dir", str(tmp_path),
           str(CONSOLE), "chatter", str(tmp_path)]
    # SIGINT's default restored: a suite started in the background (`make test &`) hands its children SIGINT ignored
    proc = subprocess.Popen(cmd, cwd=SCRATCH, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_until_torch_loads(proc.pid)  # inside the launcher's try, and no worker yet (a fixed sleep raced load)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "ddpkit launch: stopped by signal SIGINT before any worker started", err
    assert "Traceback" not in err, err


def test_an_exception_without_a_message_is_named_without_a_dangling_colon(tmp_path):
    import json

    from ddpkit.launcher import diagnosis
    from ddpkit.launcher.supervise import restarted_attempts

    record = {"rank": 1, "local_rank": 1, "host": "vm", "pid": 1, "time": 2.0, "type": "KeyboardInterrupt",
              "message": "", "traceback": "Traceback ...\nKeyboardInterrupt\n"}
    (tmp_path / "attempt0").mkdir()
    (tmp_path / "attempt0" / "error-rank1.json").write_text(json.dumps(record))
    _, text = diagnosis.report(str(tmp_path / "attempt0"))
    assert text.splitlines()[0] == "ddpkit: rank 1 on vm failed first: KeyboardInterrupt", text
    for attempt in (0, 1):
        (tmp_path / "logs" / "run" / f"attempt_{attempt}" / "1").mkdir(parents=True)
    (line,) = restarted_attempts(str(tmp_path), str(tmp_path / "logs"))
    assert line.startswith("ddpkit launch: attempt 1 failed (rank 1 raised KeyboardInterrupt; its traceback"), line


def test_the_line_after_a_bar_that_erased_itself_is_a_line_again(tmp_path, capsys):
    """tqdm(leave=False) ends with blanks and '\\r': the next line was taken for a bar update (no [x2 ranks],
    torchrun's prefix kept)."""
    bar = "\r 50%|#    |\r100%|#####|\r          \r"
    assert _tail(tmp_path / "a", capsys, {0}, {0: bar + "epoch 0 done\n", 1: bar + "epoch 0 done\n"})[-1] \
        .endswith("epoch 0 done [x2 ranks]")
    assert _tail(tmp_path / "b", capsys, {0}, {0: "\rbar 1/2\r      \r[rank0]: hello\n"})[-1] == "hello"


def test_a_crafted_marker_is_skipped_and_a_forked_child_keeps_no_folder(tmp_path):
    """A marker with a time that is no int crashed the launch's set-up; a child forked by the launch (spawn's
    fork workers) held the folder's lock after the launch released it, so it was never rotated out."""
    import json

    from ddpkit.launcher import console as logs
    crafted = tmp_path / "20250101-000000-1"
    crafted.mkdir()
    (crafted / logs.RUN_MARKER).write_text(json.dumps({"name": crafted.name, "created_ns": "2025-01-01"}))
    mine = logs.new_run_dir(str(tmp_path), keep=1)  # would remove the crafted one if it were removable
    assert crafted.is_dir()
    child = os.fork()
    if child == 0:  # a worker forked while the launch runs, living on after it
        time.sleep(30)
        os._exit(0)
    try:
        remove = [sys.executable, "-c", f"from ddpkit.launcher import console; console._remove_unless_in_use({mine!r})"]
        subprocess.run(remove, check=True)
        assert os.path.isdir(mine)  # held by the running launch
        logs.release(mine)
        subprocess.run(remove, check=True)
        assert not os.path.exists(mine)  # released: the forked child holds nothing
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_a_twin_that_comes_late_is_still_merged_and_a_bar_after_the_line_waits_behind_it(tmp_path, monkeypatch):
    """Issue 48: rank 1's copy of a line came after the old 0.5 s hold, or after rank 0's progress bar (which
    forced the line out alone): the console showed the line twice in some runs, once with [x2 ranks] in others."""
    c = _Console(tmp_path, monkeypatch, 2)
    c.write(0, "stdout", "same on every rank\n")
    c.write(0, "stderr", "\rbar 1/2")  # rank 0 went on to its bar before rank 1 printed its copy
    c.write(0, "stderr", "\rbar 2/2\n")
    time.sleep(0.6)  # a loaded machine: rank 1 lags
    c.tail._flush(force=False)
    assert c.buf.getvalue() == "", repr(c.buf.getvalue())
    c.write(1, "stdout", "same on every rank\n")
    c.tail._flush(force=False)
    assert c.buf.getvalue() == "same on every rank [x2 ranks]\n\rbar 1/2\rbar 2/2\n", repr(c.buf.getvalue())
    c.write(0, "stdout", "rank 0 only\n")
    for rank in (0, 1):
        c.write(rank, "stdout", "shared later\n")  # rank 1 is past the one-rank line: no hold
    c.tail._flush(force=False)
    assert c.buf.getvalue().endswith("rank 0 only\nshared later [x2 ranks]\n"), repr(c.buf.getvalue())


def test_a_bar_does_not_wait_behind_another_ranks_line_and_a_node_waits_for_its_own_ranks_only(tmp_path,
                                                                                               monkeypatch):
    """Review of issue 48's fix: rank 1's own line (not on the console) held rank 0's bar for the hold; on node 1
    of two (ranks 2-3) a line both local ranks printed waited for ranks 0-1, which this console never sees."""
    c = _Console(tmp_path / "a", monkeypatch, 2)
    c.write(1, "stdout", "rank 1 only\n")
    c.write(0, "stderr", "\rbar 1/2")
    c.write(0, "stderr", "\rbar 2/2\r")
    assert c.buf.getvalue() == "\rbar 1/2\rbar 2/2\r", repr(c.buf.getvalue())
    from ddpkit.launcher.console import ConsoleTail

    node = tmp_path / "b"
    for local in (0, 1):
        (node / "run" / "attempt_0" / str(local)).mkdir(parents=True)
        (node / "run" / "attempt_0" / str(local) / "stdout.log").write_text("shared\n")
    c.tail = ConsoleTail(str(node), {2}, 2, 2)
    c.tail._poll()
    c.tail._flush(force=False)
    assert c.buf.getvalue().endswith("shared [x2 ranks]\n"), repr(c.buf.getvalue())
