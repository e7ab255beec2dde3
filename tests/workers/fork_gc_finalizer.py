"""A fork whose before-fork hook meets a cyclic GC run: the hook must not run finalizers under CPython's
thread-list lock (found by a review: sys._current_frames() allocates while holding it, and on 3.11.7 a GC run
there called a finalizer that joins a thread, which waits for that lock: gh-106883).

``fork_gc_finalizer.py plain|install``: prints "forked", or hangs (run it under a timeout).
"""
import gc
import os
import sys
import threading

from ddpkit.runtime import forksafe

stop = threading.Event()
waiter = threading.Thread(target=stop.wait, daemon=True)
waiter.start()


class Holder:
    """Cyclic garbage whose finalizer stops and joins a thread (as a DataLoader iterator's shutdown joins one)."""

    def __init__(self):
        self.me = self

    def __del__(self):
        stop.set()
        waiter.join()


if sys.argv[1] == "install":
    forksafe.install()
gc.disable()
Holder()  # garbage, in a cycle
gc.set_threshold(1)  # the next allocation runs the GC: stands for a generation at its threshold
gc.enable()
pid = os.fork()
if pid == 0:
    os._exit(0)
os.waitpid(pid, 0)
print("forked", flush=True)
