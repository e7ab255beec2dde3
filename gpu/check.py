"""`make gpu-check`: what only a GPU can prove, in one command (at most ~8 minutes on one GPU).

Runs the `gpu` tests, the demo on the GPU, bf16 and fp16 (GradScaler) training, a checkpoint save/restore with
CUDA RNG and scaler state, `ddpkit doctor`, `ddpkit bench --nproc 1` on the GPU and on the CPU, and `ddpkit
verify` on the GPU. Each check is passed / failed / skipped (with why); what one GPU cannot run is "needs >= 2
GPUs", never passed. The last line printed is one JSON object; the exit code is 1 when a check failed, else 0
(so a CPU-only machine, where every check is skipped, exits 0).

    make gpu-check              # or: python gpu/check.py [--json-out docs/gpu-check.json]
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DIGITS = str(ROOT / "examples" / "digits.py")
CUDA = {"DDPKIT_DEVICE": "cuda", "OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}

TRAIN = """
import sys, torch, ddpkit
precision, out, resume_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
ddpkit.init(seed=0)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(512, 32, generator=g), torch.randn(512, 1, generator=g))
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Dropout(0.2), torch.nn.ReLU(), torch.nn.Linear(64, 1))
model = ddpkit.prepare_model(net)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
loader = ddpkit.data_loader(data, batch_size=32)
ckpt = ddpkit.Checkpointer(out + "/ckpt", resume=resume_at > 0)
step = ckpt.restore(model=model, optimizer=opt, scaler=scaler, loader=loader)
losses = []
for epoch in range(loader.epoch, 2):
    for x, y in loader:
        with ddpkit.autocast(precision):
            pred = model(x.cuda())
            assert precision == "fp32" or pred.dtype != torch.float32
            loss = torch.nn.functional.mse_loss(pred.float(), y.cuda())
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        step += 1
        if step == 10 and resume_at == 0:
            ckpt.save(step, model=model, optimizer=opt, scaler=scaler, loader=loader)
torch.save({k: v.cpu() for k, v in model.state_dict().items()}, out + f"/final{resume_at}.pt")
print("LOSS", losses[0], losses[-1])
"""


def run(cmd, env=None, timeout=240):
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **CUDA, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - start


def outcome(proc, detail=""):
    if proc.returncode == 0:
        return "passed", detail
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
    return "failed", f"exit {proc.returncode}: {' | '.join(tail)[:400]}"


def gpu_tests(gpus):
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        return "skipped", "pytest is not installed for this python"
    proc, _ = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"], timeout=360)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    return outcome(proc, summary + ("" if gpus >= 2 else " (the 2-GPU tests skip: needs >= 2 GPUs)"))


def demo(gpus):
    with tempfile.TemporaryDirectory() as tmp:
        proc, took = run([sys.executable, "-m", "ddpkit", "launch", "--nproc-per-node", "1", "--log-dir", tmp, DIGITS,
                          "--epochs", "3", "--logdir", tmp])
    found = re.findall(r"accuracy=([\d.]+)", proc.stdout)
    if proc.returncode == 0 and (not found or float(found[-1]) < 0.9):
        return "failed", f"accuracy {found[-1:] or 'missing'} < 0.9"
    return outcome(proc, f"accuracy={found[-1] if found else '?'} in {took:.1f} s")


def precision(name):
    def check(gpus):
        with tempfile.TemporaryDirectory() as tmp:
            proc, _ = run([sys.executable, "-c", TRAIN, name, tmp, "0"], env={"DDPKIT_MODE": "single"})
        losses = re.findall(r"LOSS ([\d.e-]+) ([\d.e-]+)", proc.stdout)
        if proc.returncode == 0 and not (losses and float(losses[0][1]) < float(losses[0][0])):
            return "failed", f"loss did not fall: {losses}"
        return outcome(proc, f"loss {losses[0][0][:6]} -> {losses[0][1][:6]}" if losses else "")
    return check


def checkpoint(gpus):
    """Train 2 epochs saving at step 10; restore step 10 in a new process and finish: bitwise equal weights."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        first, _ = run([sys.executable, "-c", TRAIN, "fp16", tmp, "0"], env={"DDPKIT_MODE": "single"})
        second, _ = run([sys.executable, "-c", TRAIN, "fp16", tmp, "10"], env={"DDPKIT_MODE": "single"})
        if first.returncode or second.returncode:
            return outcome(first if first.returncode else second)
        a, b = (torch.load(f"{tmp}/final{n}.pt") for n in (0, 10))
        same = all(torch.equal(a[k], b[k]) for k in a)
    return ("passed", "resumed weights bitwise equal (CUDA RNG, scaler)") if same else \
        ("failed", "resumed weights differ: CUDA RNG or scaler state not restored")


def doctor(gpus):
    proc, _ = run([sys.executable, "-m", "ddpkit", "doctor", "--json"])
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        return outcome(proc)
    verdicts = {f["name"]: f["verdict"] for f in report["findings"]}
    return ("passed" if report["ok"] else "failed"), json.dumps(verdicts)


def bench(results):
    def check(gpus):
        times = {}
        for device in ("cuda", "cpu"):
            with tempfile.TemporaryDirectory() as tmp:
                proc, _ = run([sys.executable, "-m", "ddpkit", "bench", "--nproc", "1", "--device", device, "--json",
                               "--steps", "30", "--plot", "", DIGITS, "--logdir", tmp], env={"DDPKIT_DEVICE": device})
            if proc.returncode:
                return outcome(proc)
            times[device] = json.loads(proc.stdout)["rows"][0]["step_ms"]
        results["gpu_step_ms"], results["cpu_step_ms"] = times["cuda"], times["cpu"]
        return "passed", f"step {times['cuda']:.2f} ms on the GPU, {times['cpu']:.2f} ms on the CPU"
    return check


def replica_checks(results):
    def check(gpus):
        """gpu/replicas_check.py: the fingerprints, their repair and the desync watch over NCCL; their cost."""
        proc, _ = run([sys.executable, str(ROOT / "gpu" / "replicas_check.py")])
        try:
            found = json.loads(proc.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return outcome(proc)
        results["replica_costs"] = found
        if found["failed"]:
            return "failed", "; ".join(found["failed"])
        return outcome(proc, f"{found['parameters_m']}M parameters: a check {found['check_ms']} ms, a step "
                             f"{found['step_ms']} ms, every {found['check_every_at_budget']} steps")
    return check


def verify(gpus):
    if gpus < 2:
        return "needs >= 2 GPUs", "verify compares 1 process with 2, one GPU each (NCCL allows no shared GPU)"
    proc, _ = run([sys.executable, "-m", "ddpkit", "verify", "--device", "cuda", DIGITS])
    return outcome(proc, proc.stdout.strip())


def main():
    results: dict = {}
    checks = {"gpu_tests": gpu_tests, "demo": demo, "bf16": precision("bf16"), "fp16": precision("fp16"),
              "checkpoint": checkpoint, "doctor": doctor, "bench": bench(results), "replicas": replica_checks(results),
              "verify": verify,
              "nccl_between_ranks": None, "dataparallel": None}
    try:
        from ddpkit.core.environment import visible_gpus

        gpus = visible_gpus(initialise=True)  # ddpkit's one GPU count (the checks run in child processes)
    except ImportError:
        gpus = 0
    for name, check in checks.items():
        if gpus == 0:
            results[name] = {"status": "skipped", "detail": "no CUDA GPU visible"}
        elif check is None:  # the 2-GPU tests of tests/test_gpu.py run these
            status = "needs >= 2 GPUs" if gpus < 2 else results["gpu_tests"]["status"]
            results[name] = {"status": status, "detail": "in gpu_tests" if gpus >= 2 else f"{gpus} GPU here"}
        else:
            try:
                status, detail = check(gpus)
            except subprocess.TimeoutExpired as exc:
                status, detail = "failed", f"timed out after {exc.timeout} s"
            results[name] = {"status": status, "detail": detail}
        print(f"{name:20} {results[name]['status']:16} {results[name]['detail']}", file=sys.stderr, flush=True)
    checks = {k: v for k, v in results.items() if isinstance(v, dict) and "status" in v}
    summary = {"gpus": gpus, "checks": checks, **{k: v for k, v in results.items() if k not in checks}}
    if "gpu_step_ms" in summary:
        summary["gpu_speedup_vs_cpu"] = round(summary["cpu_step_ms"] / summary["gpu_step_ms"], 2)
    if "--json-out" in sys.argv:
        Path(sys.argv[sys.argv.index("--json-out") + 1]).write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 1 if any(v["status"] == "failed" for v in summary["checks"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
