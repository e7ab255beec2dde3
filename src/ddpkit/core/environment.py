"""How was this process started, and with how many GPUs? Rank, world size, rendezvous address, GPU count.

Nothing here touches a network, and only :func:`visible_gpus` asks torch: :func:`detect` reads a mapping of
environment variables and an argument list, so every launcher can be tested by handing it the variables that
launcher sets; :func:`count_gpus` is the GPU count's decision, with torch's probes handed in.

Example::

    >>> env = detect({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
    ...               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29501"}, argv=[])
    >>> env.source, env.rank, env.world_size, env.node_rank
    ('torchrun', 1, 2, 0)
    >>> detect({}, argv=[]).source
    'single'
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal, get_args

# What started the process; ProcessEnv refuses anything else, so a new launcher cannot slip through unnoticed.
Source = Literal["single", "torchrun", "legacy-launch", "slurm", "mpi"]


class LaunchEnvError(RuntimeError):
    """The environment describes a distributed launch, but not a consistent one."""


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """Where this process sits in the job, in torch's vocabulary.

    ``source`` names what started the process: ``single`` (plain ``python train.py``), ``torchrun``
    (``ddpkit launch``, ``torchrun``, a Kubeflow PyTorchJob or anything that sets RANK/WORLD_SIZE),
    ``legacy-launch`` (``python -m torch.distributed.launch`` passing ``--local_rank``), ``slurm`` (``srun``)
    or ``mpi`` (``mpirun`` of Open MPI, MPICH or Intel MPI).
    """

    source: Source = "single"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    node: int | None = None  # this machine's index when the launcher says it (Slurm: nodes may differ in size)

    def __post_init__(self):
        if self.source not in get_args(Source):
            raise ValueError(f"source={self.source!r} is not one of {', '.join(get_args(Source))}")
        if not 0 <= self.rank < self.world_size:
            raise LaunchEnvError(
                f"rank {self.rank} is outside world size {self.world_size}: "
                "RANK must be in [0, WORLD_SIZE); check the launcher's settings")
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchEnvError(
                f"local rank {self.local_rank} is outside local world size {self.local_world_size}: "
                "check LOCAL_RANK / LOCAL_WORLD_SIZE")

    @property
    def node_rank(self) -> int:
        """Index of this machine: the launcher's word, else assuming the same number of processes on every
        node (as torchrun does)."""
        return self.node if self.node is not None else self.rank // self.local_world_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def agent_store(self) -> bool:
        """The launcher's agent already serves the rendezvous store (torchrun, ``ddpkit launch``,
        torch.distributed.launch): the group joins it with ``env://``. Otherwise (Slurm, MPI) rank 0 serves one
        at MASTER_ADDR:MASTER_PORT (``tcp://``)."""
        return self.source in ("torchrun", "legacy-launch")


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchEnvError(f"{name} is not set, expected an integer; the launcher should set it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvError(f"{name}={raw!r} is not an integer; the launcher should set a number") from None


def legacy_local_rank(argv: Sequence[str]) -> int | None:
    """The ``--local_rank`` / ``--local-rank`` value that ``torch.distributed.launch`` appends, if any.

    >>> legacy_local_rank(["train.py", "--local-rank=3"])
    3
    >>> legacy_local_rank(["train.py", "--local_rank", "1"]) , legacy_local_rank(["train.py"])
    (1, None)
    """
    for i, arg in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if arg.startswith(flag + "="):
                return _int({flag: arg.split("=", 1)[1]}, flag)
            if arg == flag and i + 1 < len(argv):
                return _int({flag: argv[i + 1]}, flag)
    return None


def _address(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    port = _int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else None
    if port is not None and not 0 < port < 65536:
        raise LaunchEnvError(f"MASTER_PORT={port} is not a port, expected 1..65535; export a free port of node 0")
    return environ.get("MASTER_ADDR") or None, port


def _from_torchrun(environ: Mapping[str, str], argv: Sequence[str]) -> ProcessEnv:
    world = _int(environ, "WORLD_SIZE")
    source: Source = "torchrun"
    if "LOCAL_RANK" in environ:
        local = _int(environ, "LOCAL_RANK")
    else:
        # torch.distributed.launch without --use-env passes the local rank as an argument.
        legacy = legacy_local_rank(argv)
        local, source = (legacy, "legacy-launch") if legacy is not None else (0, source)
    local_world = _int(environ, "LOCAL_WORLD_SIZE", default=max(local + 1, 1))
    if "LOCAL_WORLD_SIZE" not in environ and source == "legacy-launch":
        local_world = world  # legacy launch on one node: every process is local
    # No LOCAL_RANK at all (a Kubeflow PyTorchJob pod): one process per node, local rank 0.
    addr, port = _address(environ)
    return ProcessEnv(source, _int(environ, "RANK"), local, world, local_world, addr, port)


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compact host list, expanded (what ``scontrol show hostnames`` prints).

    >>> expand_hostlist("node[01-03,07],gpu5,rack[1-2]-n[1-2]")
    ['node01', 'node02', 'node03', 'node07', 'gpu5', 'rack1-n1', 'rack1-n2', 'rack2-n1', 'rack2-n2']
    """
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        expanded = [""]
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            choices = [text]
            if ranges:
                choices = [text + value for part in ranges.split(",") for value in _range(part)]
            expanded = [prefix + choice for prefix in expanded for choice in choices]
        hosts += [h for h in expanded if h]
    return hosts


def _range(part: str) -> list[str]:
    if "-" not in part:
        return [part]
    low, high = part.split("-", 1)
    return [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]


# Slurm ports: below Linux's ephemeral range (32768-60999), where outgoing connections take theirs
SLURM_PORTS = range(10000, 32768)


def slurm_port(job_id: int, step_id: int = 0) -> int:
    """The store's port for one srun step, the same in every task of the step: the job id hashed into
    :data:`SLURM_PORTS` (BLAKE2b: any two ids, also ids a round number apart, land like random pairs), plus
    the step id, so concurrent steps of one job never share a port. Two different jobs whose first nodes are the
    same machine pick the same port with probability 1 / 22768 (about 4e-5; k such jobs at once: about
    k^2 / 45536); export MASTER_PORT to choose one yourself.

    >>> slurm_port(123456, 1) - slurm_port(123456, 0)
    1
    """
    # not crc32 (zlib): it is affine in its input, and ids 10000 apart shared a port 11 times as often as chance
    digest = hashlib.blake2b(str(job_id).encode(), digest_size=8, person=b"ddpkit-port").digest()
    return SLURM_PORTS.start + (int.from_bytes(digest, "big") + step_id) % len(SLURM_PORTS)


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compact tasks-per-node list, expanded, one entry per node of the step, in node order.

    >>> tasks_per_node("2(x3),1")
    [2, 2, 2, 1]
    """
    counts: list[int] = []
    for part in spec.split(","):
        found = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if found is None:
            raise LaunchEnvError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not a list like '2(x3),1'; "
                                 "srun sets it: check that the job runs under srun")
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    return counts


def _slurm_local_world(environ: Mapping[str, str], world: int) -> tuple[int, int | None]:
    """Processes on this node and this node's index in the step. ``srun -N2 -n3`` puts 2 tasks on one node
    and 1 on the other: SLURM_STEP_TASKS_PER_NODE ("2,1") and SLURM_NODEID say which this is; without them
    every node is taken to hold the same number."""
    name = "SLURM_STEP_TASKS_PER_NODE" if environ.get("SLURM_STEP_TASKS_PER_NODE") else "SLURM_TASKS_PER_NODE"
    spec = environ.get(name)
    if spec and environ.get("SLURM_NODEID"):
        counts, node = tasks_per_node(spec), _int(environ, "SLURM_NODEID")
        if not 0 <= node < len(counts):
            raise LaunchEnvError(
                f"SLURM_NODEID={node} is not a node of {name}={spec!r} ({len(counts)} nodes, ids 0..{len(counts) - 1});"
                " srun sets both for the step: run the script under srun without overriding them")
        return counts[node], node
    nodes = _int(environ, "SLURM_STEP_NUM_NODES", default=_int(environ, "SLURM_NNODES", default=1))
    return max(world // max(nodes, 1), 1), None


def _from_slurm(environ: Mapping[str, str]) -> ProcessEnv:
    """One srun step: its tasks, and its store on the step's first node (not the job's: two steps running at
    once in one allocation must not meet in one store) at a port of the job and the step."""
    world = _slurm_tasks(environ)
    local_world, node = _slurm_local_world(environ, world)
    addr, port = _address(environ)
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if addr is None and nodelist:
        addr = expand_hostlist(nodelist)[0]
    if port is None and environ.get("SLURM_JOB_ID"):
        port = slurm_port(_int(environ, "SLURM_JOB_ID"), _int(environ, "SLURM_STEP_ID", default=0))
    return ProcessEnv("slurm", _int(environ, "SLURM_PROCID"), _int(environ, "SLURM_LOCALID"),
                      world, local_world, addr, port, node)


def _from_mpi(environ: Mapping[str, str]) -> ProcessEnv:
    """Open MPI (OMPI_COMM_WORLD_*) or MPICH / Intel MPI (PMI_*, MPI_LOCAL*); the address from MASTER_ADDR.

    Inside a Slurm allocation, ``mpirun`` starts its daemons with srun: the ranks inherit a daemon's SLURM_PROCID
    (a node index), so MPI's variables say what this process is. ``srun --mpi=pmi2`` starts the ranks itself
    and sets PMI_RANK / PMI_SIZE without local ranks: Slurm's variables then describe the same launch, nodes
    included, and are read instead."""
    if "OMPI_COMM_WORLD_RANK" in environ:
        rank, world = _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE")
        local = _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", default=0)
        local_world = _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", default=world)
    else:
        rank, world = _int(environ, "PMI_RANK"), _int(environ, "PMI_SIZE")
        if "MPI_LOCALRANKID" not in environ and _slurm_step(environ) and \
                (_int(environ, "SLURM_PROCID"), _slurm_tasks(environ)) == (rank, world):
            return _from_slurm(environ)
        local = _int(environ, "MPI_LOCALRANKID", default=0)
        local_world = _int(environ, "MPI_LOCALNRANKS", default=world)
    addr, port = _address(environ)
    return ProcessEnv("mpi", rank, local, world, local_world, addr, port)


def _slurm_tasks(environ: Mapping[str, str]) -> int:
    # the step's count: SLURM_NTASKS is the job's under `srun -E` (which keeps the caller's environment)
    return _int(environ, "SLURM_STEP_NUM_TASKS", default=_int(environ, "SLURM_NTASKS"))


def _slurm_step(environ: Mapping[str, str]) -> bool:
    # srun sets SLURM_STEP_ID for the tasks it starts: a bare sbatch script (one process) is not a launch
    return all(k in environ for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID"))


@dataclasses.dataclass(frozen=True)
class Detector:
    """One launcher: whether its variables are present, and how to read them."""

    source: Source
    present: Callable[[Mapping[str, str]], bool]
    read: Callable[[Mapping[str, str], Sequence[str]], ProcessEnv]


# Tried in this order; the first whose variables are present wins. torchrun-style variables come first: a
# torchrun inside a Slurm allocation sets them on top of Slurm's; MPI's next, for mpirun inside an allocation
# (see _from_mpi; Lightning met the same, its PR #11406).
DETECTORS = (
    Detector("torchrun", lambda e: "WORLD_SIZE" in e and "RANK" in e, _from_torchrun),
    Detector("mpi", lambda e: "OMPI_COMM_WORLD_RANK" in e or ("PMI_RANK" in e and "PMI_SIZE" in e),
             lambda e, argv: _from_mpi(e)),
    Detector("slurm", _slurm_step, lambda e, argv: _from_slurm(e)),
)


def detect(environ: Mapping[str, str], argv: Sequence[str]) -> ProcessEnv:
    """Read the variables of the first launcher in :data:`DETECTORS` whose variables are present, else one
    process (``python train.py``)."""
    found = next((d for d in DETECTORS if d.present(environ)), None)
    return found.read(environ, argv) if found else ProcessEnv()


def count_gpus(*, compiled: bool, initialized: bool, nvml: Callable[[], int], runtime: Callable[[], int],
               probe: Callable[[], int], nvidia: Callable[[], bool], initialise: bool = False) -> int:
    """How many GPUs torch would use, asked so that CUDA is not initialised here unless it is wanted.

    ``runtime`` asks the CUDA runtime (``torch.cuda.is_available()`` / ``device_count()``), which initialises the
    driver: after that a forked child cannot use CUDA ("CUDA initialization error"), and torch's own fork guard
    does not see it. So a process that forks workers (``ddpkit.spawn``, a launcher) counts with NVML (``nvml``:
    negative when NVML cannot tell, e.g. MIG UUIDs in CUDA_VISIBLE_DEVICES), and else in a child process
    (``probe``) when NVIDIA's driver is there (``nvidia``). ``initialise=True``: this process is about to use
    the GPUs; the runtime's answer is the one that counts (NVML also lists GPUs a too-old driver cannot run).

    >>> count_gpus(compiled=True, initialized=False, nvml=lambda: 2, runtime=None, probe=None, nvidia=None)
    2
    """
    if not compiled:
        return 0
    if initialized or initialise:
        return runtime()
    counted = nvml()
    if counted >= 0:
        return counted
    return probe() if nvidia() else 0


def visible_gpus(*, initialise: bool = False) -> int:
    """The CUDA (or ROCm) GPUs this process may use, counted without initialising CUDA (safe before a fork);
    ``initialise=True`` in a process that is about to use them (see :func:`count_gpus`).

    >>> visible_gpus() >= 0
    True
    """
    import torch

    cuda = torch.cuda

    def runtime() -> int:
        return cuda.device_count() if cuda.is_available() else 0

    nvml = cuda._device_count_amdsmi if torch.version.hip else cuda._device_count_nvml
    return count_gpus(compiled=cuda._is_compiled(), initialized=cuda.is_initialized(), nvml=nvml, runtime=runtime,
                      probe=_count_in_child, nvidia=_nvidia_driver, initialise=initialise)


def _nvidia_driver() -> bool:
    # /dev/nvidiactl on Linux hosts and containers given GPUs, /dev/dxg under WSL2; ROCm's /dev/kfd
    return any(os.path.exists(path) for path in ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd"))


def _count_in_child() -> int:
    """The CUDA runtime's count, asked by a child process so that this one's driver stays untouched (a few
    seconds: the child imports torch; only where NVML could not tell)."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
        return int(done.stdout.split()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0  # the runtime could not even count: no GPU torch can use


_NOT_INITIALIZED = 3  # CUDA_ERROR_NOT_INITIALIZED: what every driver call but cuInit answers before cuInit


def cuda_driver_started(maps: str | None = None, ask: Callable[[str], int] | None = None) -> bool:
    """True when CUDA's driver was started in this process (``cuInit``): something called into CUDA
    (``torch.cuda.is_available()`` does) even if torch's lazy init did not run, and a forked child can no longer
    use CUDA. False where the maps cannot be read (not Linux).

    A loaded ``libcuda.so`` is not enough: torch 2.11's CUDA build maps it at ``import torch`` (earlier builds
    opened it at the first CUDA call), and a forked child of such a process uses CUDA fine (seen on an H200,
    docs/gpu-check.json). So the library the maps list is asked ``cuDeviceGetCount``, which answers
    CUDA_ERROR_NOT_INITIALIZED, starting nothing, until ``cuInit`` ran (``ask``: that call, given the path).

    >>> cuda_driver_started("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcuda.so.1", ask=lambda path: 0)
    True
    >>> cuda_driver_started("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libcuda.so.1", ask=lambda path: 3)
    False
    """
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return False
    # a maps line: address, perms, offset, device, inode, then the path (which may hold spaces)
    paths = [fields[5] for line in maps.splitlines() if len(fields := line.split(None, 5)) == 6]
    found = next((p for p in paths if re.search(r"/libcuda\.so(\.[^/]*)?$", p)), None)
    if found is None:
        return False
    if found.endswith(" (deleted)"):  # replaced under this process (a driver upgrade): it cannot be asked
        return True
    try:
        return (ask or _device_count_status)(found) != _NOT_INITIALIZED
    except OSError:
        return True  # the library could not be asked: as before, loaded counts as started


def _device_count_status(path: str) -> int:
    """``cuDeviceGetCount``'s status from the already loaded driver library at ``path``."""
    import ctypes

    lib = ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)  # loads nothing new
    count = ctypes.c_int(0)
    return int(lib.cuDeviceGetCount(ctypes.byref(count)))


def usable_cores(mask: Collection[int] | None = None, cpu_count: int | None = None) -> int:
    """The cores this process may run on: its affinity mask (Slurm ``--cpus-per-task``, ``taskset``, a cgroup
    cpuset), not the machine's count; ``mask`` / ``cpu_count`` default to this process's.

    >>> usable_cores({0}, 2), usable_cores({0, 1, 2, 3}, 64)
    (1, 4)
    """
    if mask is None and hasattr(os, "sched_getaffinity"):
        mask = os.sched_getaffinity(0)
    return len(mask) if mask else max(1, cpu_count or os.cpu_count() or 1)
