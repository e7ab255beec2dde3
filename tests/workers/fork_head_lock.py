"""Fork while another thread holds CPython's thread-list lock without the GIL, as a torch.distributed C++ thread
inside ``PyGILState_Ensure`` does; print whether the child came up. ``python fork_head_lock.py install|plain``.

The holder is a C timer thread (glibc's SIGEV_THREAD) that releases the lock 0.3 s later, with no Python in it:
so a fork hook that waits for the lock is released by it, as it would be by the real thread.
Prints ``unsupported`` where the lock cannot be found this way (not glibc / another CPython layout).
"""
import ctypes
import os
import sys
import time

from ddpkit.runtime import forksafe


class SigEvent(ctypes.Structure):  # glibc's struct sigevent as SIGEV_THREAD reads it (64 bytes)
    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attributes", ctypes.c_void_p), ("pad", ctypes.c_char * 32)]


class TimeSpec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", TimeSpec), ("value", TimeSpec)]


SIGEV_THREAD, CLOCK_MONOTONIC = 2, 1
if sys.version_info[:2] != (3, 11) or not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_void_p) != 8:
    print("unsupported")
    sys.exit(0)
libc = ctypes.CDLL(None)  # calls through CDLL release the GIL
runtime = ctypes.addressof(ctypes.c_char.in_dll(ctypes.pythonapi, "_PyRuntime"))
mutex = ctypes.c_void_p.from_address(runtime + 32).value  # _PyRuntime.interpreters.mutex on 3.11 (64-bit)
acquire, release = libc.PyThread_acquire_lock, libc.PyThread_release_lock
acquire.argtypes = [ctypes.c_void_p, ctypes.c_int]
if sys.argv[1] == "install":
    forksafe.install()
    forksafe.install()  # twice: still one hook
event = SigEvent(value=mutex, notify=SIGEV_THREAD, function=ctypes.cast(release, ctypes.c_void_p).value)
timer = ctypes.c_void_p()
if libc.timer_create(CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
    print("unsupported")
    sys.exit(0)
acquire(mutex, 1)  # held by this thread now; the timer thread releases it in 0.3 s
libc.timer_settime(timer, 0, ctypes.byref(ITimerSpec(value=TimeSpec(0, 300_000_000))), None)
start = time.monotonic()
pid = os.fork()
if pid == 0:
    os._exit(0)
deadline, alive = time.monotonic() + 3, True
while alive and time.monotonic() < deadline:
    alive = os.waitpid(pid, os.WNOHANG) == (0, 0)
    time.sleep(0.01)
if alive:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
print("hung" if alive else f"started {time.monotonic() - start:.2f}")
