"""GPU tier: NCCL, DataParallel and fsdp. Skipped cleanly where CUDA (or a second GPU) is missing."""
import sys

import pytest
import torch

from conftest import GPU_ENV, ROOT, WORKERS, launch, ok, run_cmd

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")


@needs_gpu
def test_nccl_ddp_on_own_gpu(tmp_path):
    nproc = min(GPUS, 2)
    ok(launch(WORKERS / "skeleton.py", tmp_path, nproc=nproc, env=GPU_ENV))
    states = [torch.load(tmp_path / f"rank{r}.pt")["state"] for r in range(nproc)]
    assert [s["device"] for s in states] == [f"cuda:{r}" for r in range(nproc)]
    expected_mode, expected_backend = ("ddp", "nccl") if nproc > 1 else ("single", None)
    assert {(s["mode"], s["backend"]) for s in states} == {(expected_mode, expected_backend)}


@needs_two
def test_dataparallel_mode_runs_the_demo(tmp_path):
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "launch", "--mode", "dp", str(ROOT / "examples" / "digits.py"),
                    "--epochs", "3", "--logdir", str(tmp_path)], env=GPU_ENV))
    assert "DataParallel" in r.stderr and float(r.stdout.strip().splitlines()[-1].split("=")[1]) >= 0.9


@needs_gpu
def test_demo_on_gpu(tmp_path):
    r = ok(launch(ROOT / "examples" / "digits.py", "--logdir", tmp_path, nproc=min(GPUS, 2), env=GPU_ENV))
    assert float(r.stdout.strip().splitlines()[-1].split("=")[1]) >= 0.95


@needs_two
def test_dp_mode_matches_single_mode(tmp_path):
    """The same script under DataParallel equals one GPU (BatchNorm excepted: replicas keep local stats)."""
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **GPU_ENV}
    results = {}
    for mode in ("single", "dp"):
        out = tmp_path / mode
        out.mkdir()
        ok(run_cmd([sys.executable, str(WORKERS / "equivalence.py"), str(out)], env={**env, "DDPKIT_MODE": mode}))
        results[mode] = torch.load(out / "world1.pt")
    for case in ("plain", "accum", "uneven"):
        for name, ref in results["single"][case].items():
            assert torch.allclose(ref.double(), results["dp"][case][name].double(), atol=1e-5), (case, name)


FP16 = """
import torch, ddpkit
ddpkit.init()
model = ddpkit.prepare_model(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda")
x, y = torch.randn(64, 8, device="cuda"), torch.randn(64, 1, device="cuda")
losses = []
for _ in range(20):
    with ddpkit.autocast("fp16"):
        out = model(x)
        assert out.dtype == torch.float16
        loss = torch.nn.functional.mse_loss(out.float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    losses.append(loss.item())
assert losses[-1] < losses[0], losses
print("FP16 OK")
"""


@needs_gpu
def test_fp16_autocast_with_grad_scaler_trains():
    """In its own process: an in-process init() would read the CPU state an earlier test cached."""
    assert "FP16 OK" in ok(run_cmd([sys.executable, "-c", FP16], env=GPU_ENV)).stdout


BF16_DP = """
import torch, ddpkit
ddpkit.init(mode="dp")
seen = []
class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        y = self.lin(x)
        seen.append(y.dtype)
        return y
model = ddpkit.prepare_model(Probe())
with ddpkit.autocast("bf16"):
    model(torch.randn(16, 4, device="cuda"))
assert set(seen) == {torch.bfloat16}, seen
print("BF16 DP OK", len(seen))
"""


@needs_two
def test_bf16_under_dataparallel_stays_bf16():
    assert "BF16 DP OK" in ok(run_cmd([sys.executable, "-c", BF16_DP], env=GPU_ENV)).stdout


PIN = """
import torch, ddpkit
from torch.utils.data import TensorDataset
ddpkit.init()
data = TensorDataset(torch.randn(64, 4).cuda(), torch.randn(64, 1).cuda())
batches = sum(1 for _ in ddpkit.data_loader(data, batch_size=8))
print("PIN OK", batches)
"""


@needs_gpu
def test_gpu_resident_dataset_is_not_pinned():
    assert "PIN OK 8" in ok(run_cmd([sys.executable, "-c", PIN], env={**GPU_ENV, "DDPKIT_MODE": "single"})).stdout


@needs_gpu
def test_init_empty_on_the_gpu_gives_the_weights_of_a_cpu_build(tmp_path):
    """One process on the GPU (single mode): each module is initialised on the CPU, as a normal build is, then
    moved; the same seed gives the same weights bitwise."""
    ok(run_cmd([sys.executable, str(WORKERS / "sharded.py"), str(tmp_path)], env=GPU_ENV))
    for case, (normal, empty) in torch.load(tmp_path / "sharded1.pt")["empty"].items():
        assert all(torch.equal(normal[k].cpu(), empty[k].cpu()) for k in normal), case


@needs_two
def test_fsdp_over_nccl_equals_one_gpu(tmp_path):
    env = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", **GPU_ENV}
    ok(run_cmd([sys.executable, str(WORKERS / "equivalence.py"), str(tmp_path)], env=env))
    ok(launch(WORKERS / "equivalence.py", tmp_path, nproc=2, launcher_args=("--mode", "fsdp"), env=env))
    one, two = torch.load(tmp_path / "world1.pt"), torch.load(tmp_path / "world2-fsdp.pt")
    for case in ("plain", "bn", "accum", "uneven"):
        for name, ref in one[case].items():
            assert torch.allclose(ref.double(), two[case][name].double(), atol=1e-5), (case, name)


FSDP_BF16 = """
import torch, ddpkit
from torch.distributed.fsdp import MixedPrecisionPolicy
state = ddpkit.init(seed=0)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
model = ddpkit.prepare_model(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)),
                             shard=[torch.nn.Linear], mp_policy=policy)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
x, y = torch.randn(256, 64, device=state.device), torch.randn(256, 1, device=state.device)
losses = []
for _ in range(30):
    out = model(x)
    loss = torch.nn.functional.mse_loss(out.float(), y)
    opt.zero_grad(); loss.backward(); opt.step()
    losses.append(loss.item())
assert out.dtype == torch.bfloat16, out.dtype                       # computed in bf16
assert all(p.dtype == torch.float32 for p in model.parameters())   # sharded master weights stay fp32
assert losses[-1] < 0.5 * losses[0], losses
ddpkit.print("FSDP BF16 OK")
"""


@needs_two
def test_fsdp_bf16_mixed_precision_policy_trains(tmp_path):
    script = tmp_path / "bf16.py"
    script.write_text(FSDP_BF16)
    assert "FSDP BF16 OK" in ok(launch(script, nproc=2, launcher_args=("--mode", "fsdp"), env=GPU_ENV)).stdout


FORK_FROM_A_KERNEL = """
import torch, ddpkit
from ddpkit.core.environment import visible_gpus

def work():
    x = torch.ones(4, device=ddpkit.init().device)  # the worker's first CUDA call: fails if the parent started CUDA
    return [x.device.type, float(x.sum())]

print("GPUS", visible_gpus())  # the kernel counts GPUs, as ddpkit.spawn does, without starting the driver
print("GOT", ddpkit.spawn(work, nproc_per_node=1))
"""


@needs_gpu
def test_a_kernel_that_counted_gpus_still_forks_working_cuda_workers():
    out = ok(run_cmd([sys.executable, "-c", FORK_FROM_A_KERNEL], env=GPU_ENV, timeout=240)).stdout
    assert "GOT ['cuda', 4.0]" in out, out


STREAM_ON_NCCL = """
import sys, torch, ddpkit
from torch.utils.data import IterableDataset

class Stream(IterableDataset):
    def __iter__(self):
        return iter([(torch.full((3,), float(i)), i) for i in range(41)])

state = ddpkit.init()
loader = ddpkit.data_loader(Stream(), batch_size=4, num_workers=2)
steps = 0
for x, y in loader:
    steps += 1
    if steps == 3:
        saved = loader.state_dict()  # a collective over NCCL: its tensors must be on the GPU
total = ddpkit.reduce(steps)
if state.rank == 0:
    print("STREAM NCCL OK", state.backend, total, sorted(saved))
"""


@needs_two
def test_a_stream_loader_steps_and_saves_over_nccl(tmp_path):
    script = tmp_path / "stream_nccl.py"
    script.write_text(STREAM_ON_NCCL)
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "2", str(script)], env=GPU_ENV))
    assert "STREAM NCCL OK nccl" in r.stdout, r.stdout + r.stderr[-3000:]


@needs_gpu
def test_phase_stamps_on_a_gpu_are_the_devices_time_with_one_synchronize():
    import time

    from ddpkit.runtime.stamps import Timeline

    x = torch.randn(2048, 2048, device="cuda")
    work = lambda: [torch.tanh(x @ x) for _ in range(30)]  # noqa: E731
    work()
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    synced = time.perf_counter() - start
    line = Timeline(phases=2, cuda=True)
    line.close(0)
    start = time.perf_counter()
    work()  # queued: the CPU returns long before the device is done
    line.close(1)
    queued = time.perf_counter() - start
    sums = line.resolve()
    assert sums[1] >= 0.5 * synced > queued, (sums, synced, queued)
    assert len(line.free) >= 1  # resolved events are reused


@needs_gpu
def test_phase_report_on_a_gpu(tmp_path):
    res = ok(launch(WORKERS / "phases_train.py", nproc=1, env={**GPU_ENV, "PHASES_STEPS": "30"},
                    launcher_args=["--phase-window", "10", "--log-dir", tmp_path]))
    assert "where each rank's time went" in res.stderr and "no straggler" in res.stderr
    assert len(list(tmp_path.glob("*/phases.json"))) == 1
