"""CPU SyncBatchNorm against BatchNorm on the global batch; seeds; clear failures (gloo, 2 processes)."""
import pytest
import torch
from torch import nn

from conftest import WORKERS, launch, ok

ATOL = 1e-6


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("syncbn")
    ok(launch(WORKERS / "misc.py", "syncbn_seeds", out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _reference(r0):
    """BatchNorm1d on the concatenated batch, with the loss the ranks summed."""
    bn = nn.BatchNorm1d(4, momentum=0.3)
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2, 4))
        bn.bias.copy_(torch.linspace(-1, 1, 4))
    x = r0["full"].clone().requires_grad_(True)
    y = bn(x)
    (y * r0["upstream"]).sum().backward()
    bn.eval()
    return {"y": y.detach(), "dx": x.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var, "eval_y": bn(r0["full"]).detach()}


def test_cpu_syncbn_equals_batchnorm_on_the_global_batch_with_unequal_sizes(ranks):
    ref = _reference(ranks[0])
    assert ranks[0]["sizes"] == [3, 5]
    for key in ("y", "dx", "eval_y"):  # per-sample outputs: concatenate the ranks' slices
        got = torch.cat([r[key] for r in ranks])
        assert torch.allclose(got, ref[key], rtol=0, atol=ATOL), key
    for key in ("dw", "db", "running_mean", "running_var"):
        for r in ranks:
            assert torch.allclose(r[key], ref[key], rtol=0, atol=ATOL), key


def test_a_batch_the_same_on_every_rank_updates_the_running_variance_as_one_process_does(ranks):
    """A sample grid drawn from one fixed noise in train mode (a GAN's G(fixed_noise)): every rank normalises the
    same batch; its running variance takes that batch's n/(n-1), not that of N copies (verify: 'cannot compare')."""
    bn = nn.BatchNorm1d(4, momentum=0.3)
    bn(ranks[0]["full"])
    for r in ranks:
        assert torch.allclose(r["replicated_running_var"], bn.running_var, rtol=0, atol=ATOL)
    # other samples with the very same statistics (a binary feature): still the global batch (review 29)
    binary = nn.BatchNorm1d(1, momentum=0.3)
    binary(torch.tensor([[0.0], [1.0], [0.0], [1.0], [1.0], [0.0], [1.0], [0.0]]))
    for r in ranks:
        assert torch.allclose(r["binary_running_var"], binary.running_var, rtol=0, atol=ATOL)


def test_per_rank_streams_differ_and_repeat(ranks, tmp_path):
    assert not torch.equal(ranks[0]["rng"], ranks[1]["rng"]) and ranks[0]["py_rng"] != ranks[1]["py_rng"]
    assert ranks[0]["workers"] != ranks[1]["workers"]  # DataLoader workers seeded per rank
    ok(launch(WORKERS / "misc.py", "syncbn_seeds", tmp_path))
    again = torch.load(tmp_path / "rank1.pt")
    assert torch.equal(again["rng"], ranks[1]["rng"]) and again["workers"] == ranks[1]["workers"]


def test_rank0_stream_equals_a_one_process_run(ranks):
    torch.manual_seed(42)  # what init(seed=42) gives a one-process run
    assert torch.equal(ranks[0]["rng"], torch.rand(3))


@pytest.mark.parametrize("case, message", [
    ("unused", "2 parameter(s) got no gradient in the first backward: spare.weight, spare.bias"),
    # set 25's DCGAN project: DDP's own error gave parameter indices only
    ("unused_later", "2 parameter(s) got no gradient in the step before this forward: extra.weight, extra.bias"),
    ("desync", "replicas out of sync at step 1 (equal at step 0): rank 1 differs from rank 0 (no majority: which "
               "is right cannot be told) in 'spare.bias'"),
    ("desync_nan", "replicas out of sync at step 1 (equal at step 0): rank 1 differs from rank 0"),
    ("diverged", "training diverged: 'used.weight' holds NaN or inf on every rank"),
    ("tiny", "dataset has 1 samples but the job has 2 processes"),
    ("init_after_wrap", "ranks start different: '0.weight' differs between rank 0 and rank 1 at the first training "
                        "step"),
    ("init_in_join", "ranks start different: '0.weight' differs between rank 0 and rank 1"),
])
def test_mistakes_fail_clearly(case, message, tmp_path):
    r = launch(WORKERS / "misc.py", case, tmp_path, timeout=90)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-3000:]
    if case == "init_in_join":  # checked as the join starts: every rank enters it
        assert "STEP 0 backward done" not in r.stdout
    if case == "init_after_wrap":  # issue 44: caught at the first training forward, on every rank, with the cause
        assert "EVAL done" in r.stdout and "STEP 0 backward done" not in r.stdout
        assert "initialised after prepare_model" in r.stderr, r.stderr[-3000:]
        # both ranks raised it: whichever failed first, the other failed after it (CI saw rank 1 first once)
        assert "ranks [1] failed after it" in r.stderr or "ranks [0] failed after it" in r.stderr, r.stderr[-3000:]
    if case == "unused":  # named during the first backward, before any optimizer step
        assert "STEP 0 backward done" not in r.stdout
    if case.startswith("desync"):  # caught at the forward right after the rank-dependent change
        assert r.stdout.count("STEP 1 backward done") == 0
    if case == "desync_nan":  # NaN on one rank only is still a desync, and the message shows it
        assert "NaN or inf on this rank only" in r.stderr and "diverged" not in r.stderr
    if case == "diverged":  # issue 24.12: NaN on every rank is the loss blowing up, not ranks disagreeing
        assert "out of sync" not in r.stderr and "learning rate" in r.stderr


def test_ranks_that_start_alike_pass_the_first_step_check(tmp_path):
    """Issue 44's review: a float sum of the same weights differs with the thread count, a parameter DDP ignores
    is per-rank by design, a frozen -inf mask is no divergence before anything trained."""
    r = launch(WORKERS / "misc.py", "start_alike", tmp_path, timeout=90)
    assert r.returncode == 0 and r.stdout.count("START-ALIKE OK") == 1, r.stderr[-3000:]


def _sums(*ranks):
    """Checksums as check_in_sync gathers them: (ranks, tensors, [sum, sum of squares])."""
    return torch.tensor([[[s, s * s] for s in rank] for rank in ranks], dtype=torch.float64)


def test_sync_problem_tells_a_divergence_from_a_desync():
    from ddpkit.strategies.consistency import sync_problem

    nan, inf = float("nan"), float("inf")
    names = ["a", "b"]
    assert sync_problem(names, _sums([1.0, 2.0], [1.0, 2.0])) is None
    assert sync_problem(names, _sums([1.0, 2.0], [1.0, 3.0])).startswith(
        "ranks out of sync: 'b' differs between rank 0 and rank 1 (sum 2 vs 3)")
    assert sync_problem(names, _sums([1.0, nan], [1.0, nan], [1.0, nan])).startswith(
        "training diverged: 'b' holds NaN or inf on every rank")
    assert sync_problem(names, _sums([inf, 2.0], [inf, 2.0])).startswith("training diverged: 'a'")
    assert sync_problem(names, _sums([1.0, 2.0], [1.0, nan])).startswith(  # one rank only: a desync
        "ranks out of sync: 'b' differs between rank 0 and rank 1 (sum 2 vs nan)")
    assert sync_problem(names, _sums([1.0, nan], [1.0, 2.0])).startswith(
        "ranks out of sync: 'b' differs between rank 0 and rank 1 (sum nan vs 2)")
    assert sync_problem(names, _sums([1.0, 2.0], [0.0, nan])).startswith("ranks out of sync: 'a'")  # first wins
    assert sync_problem(names, _sums([1.0, nan], [1.0, nan], [1.0, 2.0])).startswith(  # the odd rank is named
        "ranks out of sync: 'b' differs between rank 0 and rank 2")


def test_unsynced_batchnorm_is_not_reported_as_a_desync(tmp_path):
    """Issue 11: check_sync_every with sync_batchnorm=False compared BN running statistics, which differ
    between ranks until DDP's next broadcast, and stopped a correct run."""
    r = ok(launch(WORKERS / "misc.py", "bn_local", tmp_path, timeout=90))
    assert "BN-LOCAL OK" in r.stdout


def test_torch_compile_meets_no_graph_break_or_recompile_from_ddpkit(tmp_path):
    """Issue 16 (part): ddpkit's DDP.forward (sync check, heartbeat) runs outside dynamo's trace. Before, its
    time.monotonic() broke the graph at every step and its call counter recompiled every step (12 compiles in
    8 steps; now 3)."""
    import json

    r = ok(launch(WORKERS / "misc.py", "compiled", tmp_path, timeout=180))
    found = json.loads(r.stdout.split("COMPILED ", 1)[1].splitlines()[0])
    assert not [b for b in found["breaks"] if "ddpkit" in b or "monotonic" in b], found["breaks"]
    assert found["compiles"] <= 4, found


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_compile_option_and_a_model_compiled_before_prepare_model(tmp_path, mode):
    """Issue 16: compile inside the wrapper (fsdp: per block), equal to eager, plain state-dict names."""
    import json

    r = ok(launch(WORKERS / "misc.py", "compile_option", tmp_path, launcher_args=("--mode", mode), timeout=180))
    found = json.loads(r.stdout.split("COMPILE ", 1)[1].splitlines()[0])
    assert found["max_diff"] <= 1e-5 and found["keys"], found
    assert found["compiled_inside"] == [True, True] and found["wrapper"] in ("DDP", "FSDP"), found
    assert not [b for b in found["breaks"] if "ddpkit" in b], found["breaks"]
