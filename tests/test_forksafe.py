"""A fork while a torch.distributed C++ thread holds CPython's thread-list lock (the DataLoader hang of CI run 38)."""
import subprocess
import sys

import pytest

from conftest import WORKERS


def _fork(mode: str) -> str:
    return subprocess.run([sys.executable, str(WORKERS / "fork_head_lock.py"), mode], capture_output=True,
                          text=True, timeout=60, check=True).stdout.strip()


def test_a_fork_waits_for_a_thread_inside_the_thread_list_lock():
    plain = _fork("plain")
    if plain == "unsupported" or plain.startswith("started"):
        pytest.skip(f"this interpreter does not show the hang (without the hook: {plain})")
    assert plain == "hung"
    fixed = _fork("install")
    assert fixed.startswith("started"), fixed
    assert float(fixed.split()[1]) >= 0.25, fixed  # it waited for the holder, it did not race past it


def test_the_hook_runs_no_finalizer_under_the_thread_list_lock():
    for mode in ("plain", "install"):
        try:
            out = subprocess.run([sys.executable, str(WORKERS / "fork_gc_finalizer.py"), mode], capture_output=True,
                                 text=True, timeout=30).stdout.strip()
        except subprocess.TimeoutExpired:
            out = "hung"
        assert out == "forked", mode
