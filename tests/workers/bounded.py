"""Reads a crafted checkpoint under a clock and a memory cap, and prints what it cost as JSON (the last line).

    bounded.py restore RUN_DIR        # Checkpointer(RUN_DIR, resume=True).restore(model=Linear(3, 2), optimizer=Adam)
    bounded.py consolidate CKPT OUT   # ddpkit consolidate CKPT OUT, in this process

The address space is capped at 1 GiB over what the process has mapped, and SIGALRM stops it after 20 s, so a
resource bomb that is not refused fails the test instead of the machine. ``peak_mb``: the resident set's peak
over the read (the peak is reset first through /proc/self/clear_refs), ``seconds``: its wall time, ``stderr``: what
the read printed there."""
import contextlib
import io
import json
import resource
import signal
import sys
import time

import torch

import ddpkit
from ddpkit.commands import consolidate


def _status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024


def _expire(signum, frame):
    raise TimeoutError("still reading after 20 s")


def main(action, *args):
    ddpkit.init()
    model = ddpkit.prepare_model(torch.nn.Linear(3, 2))
    optimizer = torch.optim.Adam(model.parameters())
    resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize") + (1 << 30), resource.RLIM_INFINITY))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    signal.signal(signal.SIGALRM, _expire)
    signal.alarm(20)
    started = time.monotonic()
    error, code, said = None, None, io.StringIO()
    try:
        with contextlib.redirect_stderr(said):  # what consolidate prints, apart from ddpkit.init()'s line
            if action == "restore":
                ddpkit.Checkpointer(args[0], resume=True).restore(model=model, optimizer=optimizer)
            else:
                code = consolidate.main(list(args))
    except BaseException as exc:  # what the script would see: its type and its message
        error = f"{type(exc).__name__}: {exc}"
    signal.alarm(0)
    print(json.dumps({"seconds": time.monotonic() - started, "peak_mb": (_status("VmHWM") - base) / 2**20,
                      "error": error, "code": code, "stderr": said.getvalue()}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
