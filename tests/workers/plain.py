"""A one-process script without torch, for launcher tests: ``plain.py OUT [sleep]``.

Writes OUT/pid (its PID as the launcher's side sees it: the first NSpid entry, also inside a PID namespace) and
OUT/omp (the OMP_NUM_THREADS it got); with ``sleep`` it then waits.
"""
import os
import sys
import time

out = sys.argv[1]
with open("/proc/self/status") as f:
    outer_pid = next(line.split()[1] for line in f if line.startswith("NSpid:"))
with open(os.path.join(out, "omp"), "w") as f:
    f.write(os.environ.get("OMP_NUM_THREADS", ""))
with open(os.path.join(out, "pid.tmp"), "w") as f:
    f.write(outer_pid)
os.replace(os.path.join(out, "pid.tmp"), os.path.join(out, "pid"))
if sys.argv[2:] == ["sleep"]:
    time.sleep(120)
