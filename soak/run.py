"""`make soak`: repeat faults on real 2-process gloo jobs and print one JSON line of what happened.

- kill: SIGKILL a random worker from outside at a random moment of a checkpointing run launched with
  ``--max-restarts``; the job must end with weights bitwise equal to an uninterrupted run (kill_exact).
- clean exit: a minimal ddpkit DDP script must exit 0 within 15 s of its last step (clean_exits).
- exception: one rank raises; worst time until the launcher has exited (exception_stop_s).
- hang: rank 0 calls an all_reduce that rank 1 skips; worst time from the hang to the report (hang_report_s).
- stragglers: the suite's straggler worker (tests/workers/phases_train.py) with one rank slow in data, compute or
  the optimizer, every step logged through an all-reduce and a SyncBatchNorm, at 3 ranks, the desync watch at
  0.2 s (15x more eager than its default); a desync reported there is a false alarm (desync_false_alarms).

Usage: python soak/run.py [--kills 20] [--exits 50] [--exceptions 5] [--hangs 3] [--hang-timeout 10]
       [--stragglers 30]
Bounded: about 12 minutes with the defaults on 2 cores. Results also go to soak/results/latest.json.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ddpkit.runtime.faults import children

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MINIMAL = """
import time, torch, ddpkit
torch.set_num_threads(1)
ddpkit.init()
model = ddpkit.prepare_model(torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(20):
    opt.zero_grad(); model(torch.randn(8, 10)).sum().backward(); opt.step()
print("LAST-STEP", time.time(), flush=True)
"""


def launch(*args, launcher=(), timeout=180):
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", *launcher, *map(str, args)]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def finish(proc, timeout=180):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err, time.time()


def weights(out):
    return torch.load(Path(out) / "final.pt")["weights"]


def kill_run(reference, train_args):
    with tempfile.TemporaryDirectory() as out:
        proc = launch(WORKERS / "resume.py", out, *train_args, launcher=["--max-restarts", "3"])
        ckpt = Path(out) / "ckpt"
        deadline = time.time() + 60
        while not (ckpt.exists() and any(ckpt.iterdir())) and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(random.uniform(0.0, 2.5))
        victims = children(proc.pid)  # the workers: torchrun's agent runs inside the launcher
        if victims:
            os.kill(random.choice(victims), signal.SIGKILL)
        code, _, err, _ = finish(proc)
        exact = code == 0 and all(torch.equal(a, b) for a, b in zip(reference.values(), weights(out).values()))
        return exact, len(victims) > 0, err


def clean_exit_run(script):
    code, out, err, end = finish(launch(script), timeout=60)
    last = re.search(r"LAST-STEP ([\d.]+)", out)
    clean = code == 0 and last is not None and end - float(last.group(1)) <= 15
    if not clean:  # keep the evidence: what exited how, and after how long
        waited = f"{end - float(last.group(1)):.1f} s after the last step" if last else "no last step"
        print(f"soak: unclean exit (code {code}, {waited}):\n{out[-1500:]}\n{err[-3000:]}", file=sys.stderr)
    return clean


def exception_run(tmp):
    code, _, err, end = finish(launch(WORKERS / "misc.py", "boom", tmp, launcher=["--console-ranks", "all"]),
                               timeout=120)
    raised = float(re.search(r"RAISED-AT ([\d.]+)", err).group(1)) if "RAISED-AT" in err else None
    return code == 1 and raised is not None, (end - raised) if raised else float("inf")


def hang_run(timeout_s):
    code, out, err, end = finish(launch(WORKERS / "hang.py", timeout_s), timeout=timeout_s * 6)
    start = re.search(r"HANG-START ([\d.]+)", out)
    return code == 3 and "HANG" in err, (end - float(start.group(1))) if start else float("inf")


def straggler_run(index):
    """One slow rank (in turn: data, compute, optimizer), 0.1-0.4 s a step: no desync may be reported."""
    kind = ("data", "compute", "optimizer")[index % 3]
    env = {**ENV, "PHASES_SLOW": f"{kind}:{index % 3}", "PHASES_SLEEP": str(0.025 * (1 + index % 4)),
           "PHASES_STEPS": "8", "PHASES_LOG": "1", "PHASES_BN": "1", "DDPKIT_DESYNC_AFTER": "0.2"}
    cmd = [sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "3", str(WORKERS / "phases_train.py")]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    code, _, err, _ = finish(proc, timeout=120)
    if code != 0 or "Desync" in err:
        print(f"soak: straggler run {index} ({kind}): code {code}\n{err[-2000:]}", file=sys.stderr)
    return code == 0, "Desync" in err


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--exits", type=int, default=50)
    p.add_argument("--exceptions", type=int, default=5)
    p.add_argument("--hangs", type=int, default=3)
    p.add_argument("--hang-timeout", type=float, default=10.0)
    p.add_argument("--stragglers", type=int, default=30)
    args = p.parse_args()
    random.seed(os.getpid())
    train_args = ["--epochs", "4", "--step-sleep", "0.08", "--save-every", "3"]
    result = {}
    kills = []
    if args.kills:
        with tempfile.TemporaryDirectory() as ref:
            code, _, err, _ = finish(launch(WORKERS / "resume.py", ref, *train_args))
            assert code == 0, err
            reference = weights(ref)
        kills = [kill_run(reference, train_args) for _ in range(args.kills)]
    result.update(kill_runs=len(kills), kill_exact=sum(exact for exact, _, _ in kills),
                  kills_delivered=sum(hit for _, hit, _ in kills))
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(MINIMAL)
    exits = [clean_exit_run(f.name) for _ in range(args.exits)]
    os.unlink(f.name)
    result.update(clean_exit_runs=len(exits), clean_exits=sum(exits))
    with tempfile.TemporaryDirectory() as tmp:
        stops = [exception_run(tmp) for _ in range(args.exceptions)]
    result.update(exception_runs=len(stops), exception_reported=sum(ok for ok, _ in stops),
                  exception_stop_s=round(max((s for _, s in stops), default=0.0), 2))
    hangs = [hang_run(args.hang_timeout) for _ in range(args.hangs)]
    result.update(hang_runs=len(hangs), hang_reported=sum(ok for ok, _ in hangs), hang_timeout_s=args.hang_timeout,
                  hang_report_s=round(max((s for _, s in hangs), default=0.0), 2))
    stragglers = [straggler_run(i) for i in range(args.stragglers)]
    result.update(straggler_runs=len(stragglers), straggler_clean=sum(ok for ok, _ in stragglers),
                  desync_false_alarms=sum(alarm for _, alarm in stragglers))
    (ROOT / "soak" / "results").mkdir(exist_ok=True)
    (ROOT / "soak" / "results" / "latest.json").write_text(json.dumps(result) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
