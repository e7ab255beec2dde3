"""GPU decisions tested on the CPU (issue 11): each test failed before its fix. What only a GPU can prove is
listed in docs/gpu.md and run by `make gpu-check`."""
import json
import os
import re
import stat
import sys
import threading
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import ROOT, ok, run_cmd
from ddpkit import strategy
from ddpkit.commands.bench.command import cap_counts
from ddpkit.commands.doctor import gpu_processes
from ddpkit.commands.launch import parse_args
from ddpkit.commands.verify.command import plan
from ddpkit.core.errors import HANG, SCRIPT_FAILED, UsageError
from ddpkit.data.settings import loader_defaults
from ddpkit.launcher import diagnosis
from ddpkit.launcher.config import LaunchError
from ddpkit.launcher.supervise import stderr_tails
from ddpkit.strategies.dp_wrapper import DP, balanced_split, in_caller_autocast

SCRIPT = str(ROOT / "examples" / "digits.py")


def _in_thread(fn):
    """Run fn in a fresh thread under autocast(enabled=True) only, as torch's parallel_apply does."""
    out = {}

    def work():
        with torch.autocast("cpu", enabled=True):
            out["dtype"] = fn(torch.randn(2, 4)).dtype

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return out["dtype"]


def test_1_replica_threads_keep_the_callers_autocast_dtype():
    layer = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.float16):  # the caller asked for one dtype ...
        plain = _in_thread(layer)
        [wrapped] = in_caller_autocast([layer], "cpu")
        kept = _in_thread(wrapped)
    assert plain == torch.bfloat16  # ... the thread took the device default (on CUDA: fp16 under bf16)
    assert kept == torch.float16
    assert in_caller_autocast([layer], "cpu") == [layer]  # outside autocast: untouched


def test_2_pinned_memory_only_for_samples_in_cpu_memory():
    on_device = TensorDataset(torch.zeros(4, 2, device="meta"))  # stands in for x.cuda(): not CPU memory
    assert "pin_memory" not in loader_defaults(on_device, "cuda", 8)
    assert loader_defaults(TensorDataset(torch.zeros(4, 2)), "cuda", 8)["pin_memory"] is True

    class DeviceSamples(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": torch.zeros(2, device="meta")}, i

    assert "pin_memory" not in loader_defaults(DeviceSamples(), "cuda", 1)


def test_4_device_flag_reaches_config_and_caps_counts():
    cfg = parse_args(["--device", "cpu", "--nproc-per-node", "auto", SCRIPT], gpus=4, cpus=3, environ={})
    assert (cfg.device, cfg.gpus, cfg.nproc_per_node) == ("cpu", 0, 3)
    with pytest.raises(LaunchError, match="no CUDA GPU is visible"):
        parse_args(["--device", "cuda", SCRIPT], gpus=0, environ={})
    with pytest.raises(LaunchError, match="--device 'tpu' is not one of auto, cpu, cuda"):
        parse_args(["--device", "tpu", SCRIPT], gpus=0, environ={})
    assert plan(None, None, 1) == (2, "cpu", "1 GPU(s) usable for 2 processes: both runs train on the CPU "
                                             "(--device cpu)")
    with pytest.raises(UsageError, match="needs 2 GPUs, 1 usable; pass --device cpu"):
        plan(2, "cuda", 1)
    assert cap_counts([1, 2], False, None, 1)[0] == [1]
    with pytest.raises(UsageError, match="--device cpu"):
        cap_counts([1, 2], True, None, 1)


def test_4_launch_device_cpu_trains_on_cpu_with_gloo(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import ddpkit\ns = ddpkit.init()\nprint('ON', s.device, s.backend, s.rank)\n")
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "launch", "--device", "cpu", "--nproc-per-node", "2",
                    "--console-ranks", "all", "--log-dir", str(tmp_path / "logs"), str(script)],
                   env={"DDPKIT_DEVICE": ""}, timeout=120))
    lines = [re.sub(r"^\[rank[\d,-]+\]: ", "", line) for line in r.stdout.splitlines()]  # --console-ranks all
    assert sorted(line for line in lines if line.startswith("ON")) == ["ON cpu gloo 0", "ON cpu gloo 1"]


def _hang_dir(tmp_path):
    report = tmp_path / "report"
    report.mkdir()
    for rank, (line, func) in enumerate([(41, "train_step"), (55, "evaluate")]):
        (report / f"stack-rank{rank}.txt").write_text(
            f'Current thread 0x0001 (most recent call first):\n  File "/x/train.py", line {line} in {func}\n')
    return report


def test_5_an_nccl_watchdog_abort_is_a_hang_report(tmp_path):
    report = _hang_dir(tmp_path)
    tails = {0: "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) "
                "ran for 600031 milliseconds before timing out.\n", 1: "some output\n"}
    code, text = diagnosis.report(str(report), {0: "killed by SIGABRT", 1: "killed by SIGTERM"}, tails)
    assert code == HANG and text.startswith("ddpkit: HANG")
    assert "rank 0 is at train.py:41 in train_step (waiting for the GPU" in text
    assert "first timeout on rank 0 (NCCL watchdog, killed by SIGABRT)" in text
    # without the watchdog's line a SIGABRT stays a crash
    code, text = diagnosis.report(str(report), {0: "killed by SIGABRT"}, {0: "free(): invalid pointer"})
    assert code == SCRIPT_FAILED and "killed by SIGABRT" in text


def test_5_stderr_tails_come_from_the_newest_attempt(tmp_path):
    for attempt, text in ((0, "old"), (1, "new")):
        folder = tmp_path / "run" / f"attempt_{attempt}" / "1"
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(text)
    assert stderr_tails(str(tmp_path), first_rank=4) == {5: "new"}


def test_6_dataparallel_checkpoints_keep_every_gpus_rng():
    assert strategy.get("dp").cuda_rng_devices(0, 8) == list(range(8))
    assert strategy.get("ddp").cuda_rng_devices(3, 8) == [3] and strategy.get("single").cuda_rng_devices(0, 1) == [0]


def test_7_balanced_splits_and_small_training_batches():
    assert balanced_split(29, 8) == [4, 4, 4, 4, 4, 3, 3, 3]  # torch's chunk: [4, 4, 4, 4, 4, 4, 4, 1]
    assert min(balanced_split(17, 8)) >= 2
    dp = DP(nn.BatchNorm1d(3))  # no GPU here: scatter is called as DataParallel.forward would
    dp.dim = 0  # what DataParallel.__init__ sets when GPUs exist
    with pytest.raises(ValueError, match="a training batch of 3 sample.* cannot be split over 4 GPUs"):
        dp.scatter((torch.zeros(3, 3),), {}, [0, 1, 2, 3])


def _fake_nvidia_smi(tmp_path, body):
    folder = tmp_path / "bin"
    folder.mkdir()
    tool = folder / "nvidia-smi"
    tool.write_text("#!/bin/sh\n" + body + "\n")
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return str(folder)


@pytest.mark.parametrize("body, verdict, fragment", [
    ("sleep 30", "warn", "did not answer within 1 s"),  # a child keeps the pipe open: the old wait hung 30 s
    ("echo 'Failed to initialize NVML: Driver/library version mismatch'; exit 18", "warn",
     "nvidia-smi failed (exit 18): Failed to initialize NVML: Driver/library version mismatch"),
    ("echo '4242, 1024 MiB'", "warn", "processes holding GPU memory: 4242, 1024 MiB"),
    ("true", "ok", "no process holds GPU memory"),
])
def test_8_doctor_reads_nvidia_smi_with_a_bound(tmp_path, monkeypatch, body, verdict, fragment):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, body) + os.pathsep + os.environ["PATH"])
    start = time.monotonic()
    [finding] = gpu_processes(timeout_s=1)
    assert time.monotonic() - start < 5
    assert finding.verdict == verdict and fragment in finding.detail, finding


def test_9_cpu_tests_pin_their_workers_to_the_cpu():
    from conftest import run_cmd as runner  # every subprocess of the CPU tiers gets DDPKIT_DEVICE=cpu

    r = runner([sys.executable, "-c", "import os; print(os.environ['DDPKIT_DEVICE'])"], timeout=30)
    assert r.stdout.strip() == "cpu"


def test_verify_runs_without_tf32_and_with_shared_initial_weights(tmp_path):
    seen = tmp_path / "seen.jsonl"
    script = tmp_path / "env.py"
    script.write_text("import json, os, ddpkit, torch\ns = ddpkit.init()\n"
                      "m = ddpkit.prepare_model(torch.nn.Linear(2, 2))\n"
                      f"open({str(seen)!r}, 'a').write(json.dumps([os.environ.get('NVIDIA_TF32_OVERRIDE'), "
                      "str(s.device)]) + '\\n')\n"
                      # something to compare: verify refuses a script that trains on no ddpkit loader
                      "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                      "g = torch.Generator().manual_seed(0)\n"
                      "data = torch.utils.data.TensorDataset(torch.randn(8, 2, generator=g))\n"
                      "for (x,) in ddpkit.data_loader(data, batch_size=2):\n"
                      "    opt.zero_grad(); m(x).pow(2).mean().backward(); opt.step()\n")
    r = run_cmd([sys.executable, "-m", "ddpkit", "verify", "--device", "cpu", "--json", str(script)], timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["passed"] is True, r.stderr
    assert [json.loads(line) for line in seen.read_text().splitlines()] == [["0", "cpu"]] * 3  # 1 + 2 processes


def test_gpu_check_skips_every_check_without_a_gpu():
    r = ok(run_cmd([sys.executable, str(ROOT / "gpu" / "check.py")], timeout=120))
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["gpus"] == 0 and {c["status"] for c in summary["checks"].values()} == {"skipped"}
    assert {"gpu_tests", "demo", "verify", "bf16", "fp16", "checkpoint", "doctor", "bench"} <= set(summary["checks"])


def _never():
    raise AssertionError("asked the CUDA runtime, which initialises the driver")


def test_gpus_are_counted_without_initialising_cuda_before_a_fork():
    from ddpkit.core.environment import count_gpus

    cpu_build = dict(compiled=False, initialized=False, nvml=_never, runtime=_never, probe=_never, nvidia=_never)
    assert count_gpus(**cpu_build) == 0 and count_gpus(**cpu_build, initialise=True) == 0
    gpu_host = dict(compiled=True, initialized=False, nvml=lambda: 2, runtime=_never, probe=_never, nvidia=_never)
    assert count_gpus(**gpu_host) == 2  # NVML: the driver stays untouched, so forked workers can still use CUDA
    # NVML cannot tell (MIG UUIDs in CUDA_VISIBLE_DEVICES): a child process asks the runtime instead of this one
    mig = dict(gpu_host, nvml=lambda: -1, probe=lambda: 1, nvidia=lambda: True)
    assert count_gpus(**mig) == 1
    assert count_gpus(**dict(mig, nvidia=lambda: False)) == 0  # a CUDA build on a host without NVIDIA's driver
    # the process that is about to use them asks the runtime: NVML lists GPUs a too-old driver cannot run
    assert count_gpus(**dict(gpu_host, runtime=lambda: 0), initialise=True) == 0
    assert count_gpus(**dict(gpu_host, initialized=True, runtime=lambda: 3)) == 3  # already up: nothing to spare


def test_cuda_driver_started_asks_the_mapped_driver_library():
    from ddpkit.core.environment import cuda_driver_started

    maps = "7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05\n"
    asked = []
    assert cuda_driver_started(maps, ask=lambda path: asked.append(path) or 0)
    assert asked == ["/usr/lib/x86_64-linux-gnu/libcuda.so.535.104.05"]
    assert not cuda_driver_started(maps, ask=lambda path: 3)  # mapped (torch 2.11 maps it at import), not started
    assert not cuda_driver_started("7f00-7f10 r-xp 0 08:01 1 /usr/lib/libnvidia-ml.so.1\n", ask=lambda path: 0)
    assert cuda_driver_started(maps, ask=lambda path: (_ for _ in ()).throw(OSError("no symbol")))
    # replaced under the process (a driver upgrade): not asked, started; a path with a space asked whole
    assert cuda_driver_started(maps.replace("\n", " (deleted)\n"), ask=lambda path: 3)
    spaced = "7f00-7f10 r-xp 0 08:01 1 /opt/nv drivers/lib/libcuda.so.1\n"
    assert not cuda_driver_started(spaced, ask=lambda path: asked.append(path) or 3)
    assert asked[-1] == "/opt/nv drivers/lib/libcuda.so.1"


FORK_SAFE = """
import json, os, torch, ddpkit
from ddpkit.core import environment
seen = [environment.cuda_driver_started()]
environment.visible_gpus()  # what ddpkit.spawn counts with before it forks
seen += [environment.cuda_driver_started(), torch.cuda.is_initialized()]
# a CUDA build on an NVIDIA host; is_available() calls cudaGetDeviceCount: cuInit, fork is unsafe now
if torch.cuda._is_compiled() and os.path.exists("/dev/nvidiactl") and torch.cuda.is_available():
    seen += [environment.cuda_driver_started(), torch.cuda.is_initialized()]
print("SEEN", json.dumps(seen))
"""


def test_importing_torch_and_counting_gpus_leave_a_notebook_fork_safe():
    """The fork refusal asks the driver whether it was started: `import torch` must not start it (torch 2.11's
    CUDA build maps libcuda at import, unstarted), nor may ddpkit's GPU count. On an NVIDIA host the check also
    sees what torch does not: is_available() started the driver."""
    r = ok(run_cmd([sys.executable, "-c", FORK_SAFE], timeout=120))
    seen = json.loads(r.stdout.split("SEEN ", 1)[1])
    assert seen[:3] == [False, False, False], seen
    assert seen[3:] in ([], [True, False]), seen  # started, yet torch.cuda.is_initialized() is False
