"""What the launcher's console shows: ``ddpkit launch --nproc-per-node 2 console.py CASE OUT``.

CASE: ``chatter`` (never calls ddpkit.init: multi-line prints per rank, a UTF-8 character split across two
writes, a last line without a newline), ``restart`` (rank 1 is SIGKILLed on attempt 0; attempt 1 prints
ddpkit's start-up line and then a progress bar), ``ctrlc`` (rank 0 waits in a barrier, rank 1 sleeps in
slow_step; OUT/ready appears once both are there), ``usage`` (argparse refuses the arguments: exit 2).
"""
import argparse
import os
import signal
import sys
import time

case, out_dir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])


def chatter() -> None:
    # one write each: a rank's block must come out as one block, not merged line by line with the other's
    sys.stdout.write(f"summary of rank {rank}:\n  common line\n  value {rank}\n")
    sys.stdout.flush()
    time.sleep(0.3)
    word = "café".encode()
    sys.stdout.buffer.write(word[:-1])  # the é is split: its first byte now, the second after the tail read
    sys.stdout.flush()
    time.sleep(0.4)
    sys.stdout.buffer.write(word[-1:] + f" from rank {rank}\n".encode())
    sys.stdout.flush()
    sys.stdout.write(f"accuracy=0.9{rank}")  # no newline: the last line must still be shown


def restart() -> None:
    import torch

    import ddpkit

    torch.set_num_threads(1)
    state = ddpkit.init(seed=0, timeout_s=60)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        if state.rank == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        torch.distributed.barrier()
        return
    if state.rank == 0:
        for step in range(1, 4):  # a progress bar right after init: ddpkit's start-up line must come first
            sys.stderr.write(f"\rstep {step}/3")
            sys.stderr.flush()
            time.sleep(0.05)
        sys.stderr.write("\n")
    torch.distributed.barrier()


def slow_step() -> None:
    open(os.path.join(out_dir, f"ready{rank}"), "w").close()
    time.sleep(120)


def ctrlc() -> None:
    import torch

    import ddpkit

    torch.set_num_threads(1)
    ddpkit.init(timeout_s=120)
    if rank == 0:
        open(os.path.join(out_dir, "ready0"), "w").close()
        torch.distributed.barrier()
    else:
        slow_step()


def usage() -> None:
    if rank == 0:
        time.sleep(1)  # rank 1 fails first
    parser = argparse.ArgumentParser(prog="console.py")
    parser.add_argument("case")
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, required=True)
    parser.parse_args()


{"chatter": chatter, "restart": restart, "ctrlc": ctrlc, "usage": usage}[case]()
