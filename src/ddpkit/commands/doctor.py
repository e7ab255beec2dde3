"""``ddpkit doctor``: what can this machine do for data-parallel training, and what is in the way?

Each finding has a verdict (ok, warn, fail, info), the measured detail and a hint. Exit 1 when a finding
fails (the machine cannot run a DDP job as it is), else 0. ``--json`` prints one JSON object.

Example::

    $ ddpkit doctor
    ok    torch             2.13.0+cpu (CUDA none, Python 3.11.7)
    ok    allreduce-gloo    2 processes: latency 0.22 ms, bus bandwidth 1.15 GB/s
    ...
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from ddpkit.commands.cli import OneLineParser, usage_error
from ddpkit.core import contract
from ddpkit.core.environment import visible_gpus
from ddpkit.core.errors import SCRIPT_FAILED, UsageError, first_line


@dataclasses.dataclass
class Diagnosis:
    name: str
    verdict: str  # ok | warn | fail | info
    detail: str
    hint: str = ""


def _versions() -> list[Diagnosis]:
    import torch

    cuda = torch.version.cuda or "none"
    nccl = ""
    if visible_gpus(initialise=True) and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ", NCCL " + ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # an NCCL-less build: reported by the backends finding
            nccl = ""
    return [Diagnosis("torch", "ok", f"{torch.__version__} (CUDA {cuda}{nccl}, Python {platform.python_version()})")]


def _gpus() -> list[Diagnosis]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = visible_gpus(initialise=True)  # the doctor forks nothing: the CUDA runtime's own answer
    if not count:
        return [Diagnosis("gpus", "info", f"no CUDA GPU visible (CUDA_VISIBLE_DEVICES={visible})",
                        "DDP runs on CPU with gloo: ddpkit launch --nproc-per-node N")]
    try:
        props = [torch.cuda.get_device_properties(i) for i in range(count)]
    except RuntimeError as exc:  # a GPU that is listed but cannot be queried (driver trouble, a lost GPU)
        return [Diagnosis("gpus", "fail", f"GPUs listed but not readable: {first_line(exc)}",
                        "check nvidia-smi and the driver; CUDA_VISIBLE_DEVICES may name a missing GPU")]
    listing = "; ".join(f"{i}: {p.name} {p.total_memory / 2**30:.0f} GiB" for i, p in enumerate(props))
    return [Diagnosis("gpus", "ok", f"{len(props)} visible ({listing}); CUDA_VISIBLE_DEVICES={visible}")]


def _backends() -> list[Diagnosis]:
    import torch.distributed as dist

    found = [Diagnosis("gloo", "ok" if dist.is_gloo_available() else "fail",
                     "available" if dist.is_gloo_available() else "missing",
                     "" if dist.is_gloo_available() else "this torch build has no gloo: install the official wheel")]
    if visible_gpus(initialise=True):
        good = dist.is_nccl_available()
        found.append(Diagnosis("nccl", "ok" if good else "fail", "available" if good else "missing",
                             "" if good else "GPUs without NCCL: install a CUDA build of torch"))
    return found


def _smoke_worker(rank: int, port: int, backend: str, ifname: str | None, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if ifname:  # this child's own gloo / NCCL listeners on loopback too, as ddpkit launch has them on one node
        os.environ.setdefault(contract.GLOO_IFNAME.name, ifname)
        os.environ.setdefault(contract.NCCL_IFNAME.name, ifname)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=30))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=2)
    small, big = torch.ones(1, device=device), torch.ones(8 * 2**20, device=device)  # 32 MiB of fp32
    times: dict[str, list[float]] = {"small": [], "big": []}
    for name, tensor, reps in (("small", small, 60), ("big", big, 5)):
        for i in range(reps + 2):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            if backend == "nccl":
                torch.cuda.synchronize()
            if i >= 2:  # warm-up discarded
                times[name].append(time.perf_counter() - start)
    ok = bool(small.item() == 2 ** (60 + 2))  # every all_reduce doubled the ones
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put({"ok": ok, "latency_ms": statistics.median(times["small"]) * 1e3,
                   "busbw_gbs": big.numel() * 4 / statistics.median(times["big"]) / 1e9})


def smoke_test(backend: str = "gloo", timeout_s: float = 60.0) -> Diagnosis:
    """A real 2-process all_reduce over loopback: correctness, latency and bus bandwidth (2(n-1)/n = 1)."""
    from ddpkit.launcher.config import LOOPBACK_IFNAME
    from ddpkit.launcher.rendezvous import loopback_store

    store = loopback_store()  # 127.0.0.1 only (a plain TCPStore server listens on every interface); port 0: no race
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_smoke_worker, args=(r, store.port, backend, LOOPBACK_IFNAME, queue), daemon=True)
             for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=timeout_s)
    except Exception:
        result = None
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    name = f"allreduce-{backend}"
    if not result or not result["ok"]:
        return Diagnosis(name, "fail", f"2-process all_reduce did not complete correctly within {timeout_s:.0f} s",
                       "check that loopback works and no firewall blocks local ports; "
                       "run with TORCH_DISTRIBUTED_DEBUG=DETAIL")
    return Diagnosis(name, "ok", f"2 processes: latency {result['latency_ms']:.2f} ms, "
                               f"bus bandwidth {result['busbw_gbs']:.2f} GB/s")


def _ports() -> list[Diagnosis]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with socket.socket() as s:
        taken = s.connect_ex(("127.0.0.1", 29500)) == 0
    found = [Diagnosis("free-port", "ok", f"binding port 0 gave {free}")]
    if taken:
        found.append(Diagnosis("port-29500", "warn", "port 29500 (torchrun's static default) is in use",
                             "ddpkit launch needs no port on one node; with torchrun pass --standalone"))
    return found


def run_bounded(cmd: list[str], timeout_s: float) -> tuple[int | None, str]:
    """(exit code, output) of ``cmd``, or (None, "") when it did not finish within ``timeout_s``.

    Bounded even when the process cannot be reaped: a wedged GPU driver leaves nvidia-smi in an
    uninterruptible state that ignores SIGKILL, and ``subprocess.run(timeout=)`` then waits for it (and for
    any child still holding its pipe) without end. We kill, wait briefly, and walk away.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, 9)
        except OSError:
            pass
        try:
            proc.communicate(timeout=1)
        except subprocess.TimeoutExpired:
            pass  # still not reaped: leave it to the kernel rather than hang doctor
        return None, ""


def gpu_processes(timeout_s: float = 20.0) -> list[Diagnosis]:
    """nvidia-smi's list of processes holding GPU memory, its own failure, or its silence."""
    if not shutil.which("nvidia-smi"):
        return []
    try:
        code, out = run_bounded(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                                timeout_s)
    except OSError as exc:
        return [Diagnosis("gpu-processes", "warn", f"nvidia-smi could not start ({exc.strerror})", "check the driver")]
    if code is None:
        return [Diagnosis("gpu-processes", "warn", f"nvidia-smi did not answer within {timeout_s:g} s",
                        "the driver may be wedged: check dmesg, or reset the GPU")]
    out = out.strip()
    if code != 0:
        first = (out.splitlines() or ["no output"])[0][:200]
        return [Diagnosis("gpu-processes", "warn", f"nvidia-smi failed (exit {code}): {first}",
                        "a driver/library version mismatch needs a reboot or a driver reload")]
    if not out:
        return [Diagnosis("gpu-processes", "ok", "no process holds GPU memory")]
    return [Diagnosis("gpu-processes", "warn", f"processes holding GPU memory: {out.replace(chr(10), '; ')}",
                    "leftovers of a killed job? stop them before launching (kill <pid>)")]


def _threads() -> list[Diagnosis]:
    import torch

    omp, cores = contract.OMP_THREADS.text(os.environ), os.cpu_count() or 1
    detail = f"{cores} cores, OMP_NUM_THREADS={omp}, torch threads {torch.get_num_threads()}"
    return [Diagnosis("threads", "info", detail,
                    "ddpkit launch sets OMP_NUM_THREADS = cores / local processes when it is unset")]


def collect(smoke: bool = True) -> list[Diagnosis]:

    findings = _versions() + _gpus() + _backends()
    if smoke:
        findings.append(smoke_test("gloo"))
        if visible_gpus(initialise=True) >= 2:
            findings.append(smoke_test("nccl"))
    return findings + _ports() + gpu_processes() + _threads()


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="ddpkit doctor", description="What this machine can do for data-parallel training.")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--no-smoke", action="store_true", help="skip the 2-process all-reduce test")
    try:
        ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except UsageError as exc:
        return usage_error("ddpkit doctor", exc)
    findings = collect(smoke=not ns.no_smoke)
    failed = any(f.verdict == "fail" for f in findings)
    if ns.json:
        print(json.dumps({"ok": not failed, "findings": [dataclasses.asdict(f) for f in findings]}))
    else:
        for f in findings:
            print(f"{f.verdict:5} {f.name:16} {f.detail}" + (f"\n      hint: {f.hint}" if f.hint else ""))
    return SCRIPT_FAILED if failed else 0
