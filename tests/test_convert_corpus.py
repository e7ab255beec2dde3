"""The proof of ``ddpkit convert`` on its corpus (tests/convert_corpus): each converted script runs under ``ddpkit
launch --nproc-per-node 2`` to its end, ``ddpkit convert --verify`` gives verify's verdict and check's silence,
and the converted MNIST's test metrics at 2 processes are the one-process ones (``--lr 0``: the same weights,
so the reduced sums must be equal).

Every subprocess starts at once in a module fixture (one at a time per two cores, each worker one thread);
the file costs its runs.
"""
import os
import re
import sys
import zipfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import ROOT, launch, ok, run_cmd

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

CORPUS = ROOT / "tests" / "convert_corpus"
pytestmark = pytest.mark.timeout(1200)
SHORT = {"mnist_cnn": ["--epochs", "1"], "vae": ["--epochs", "1"], "device_flag": ["--epochs", "1"],
         "amp_scheduler": ["--epochs", "1"], "char_transformer": ["--max-iters", "20"],
         "cifar_dataparallel": ["--epochs", "2"], "dcgan_accel": ["--niter", "1", "--accel"],
         "quickstart_notebook": ["--epochs", "1"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("converted")
    for name in SHORT:
        (out / f"{name}.py").write_text(plan((CORPUS / f"{name}.py").read_text()).text)
    files = {"device_flag": ["--out", str(out / "r.pt")], "amp_scheduler": ["--log-dir", str(out / "tb"),
                                                                            "--checkpoint", str(out / "c.pth")],
             "dcgan_accel": ["--outf", str(out / "dcgan")], "quickstart_notebook": ["--out", str(out / "q.pth")]}
    jobs = {}
    for name, args in SHORT.items():  # (cifar_dataparallel.py makes ./checkpoint: each run in its own folder)
        jobs[f"launch:{name}"] = lambda n=name, a=args: launch(out / f"{n}.py", *a, *files.get(n, []), timeout=600,
                                                               cwd=out)
        if name in ONLY_LAUNCHED:
            continue
        jobs[f"verify:{name}"] = lambda n=name, a=args: run_cmd(
            [sys.executable, "-m", "ddpkit", "convert", "-o", str(out / f"{n}.verified.py"), "--verify",
             str(CORPUS / f"{n}.py"), *a, *files.get(n, [])], timeout=600)
    jobs["verify:amp_scheduler:fp32"] = lambda: run_cmd(
        [sys.executable, "-m", "ddpkit", "convert", "--verify", str(CORPUS / "amp_scheduler.py"), "--epochs", "1",
         "--no-amp", *files["amp_scheduler"]], timeout=600)
    exact = ["--epochs", "1", "--lr", "0"]
    jobs["mnist:1"] = lambda: run_cmd([sys.executable, str(out / "mnist_cnn.py"), *exact])
    jobs["mnist:2"] = lambda: launch(out / "mnist_cnn.py", *exact)
    width = max(1, len(os.sched_getaffinity(0)) // 2)
    with ThreadPoolExecutor(width) as pool:
        futures = {key: pool.submit(job) for key, job in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


ONLY_LAUNCHED = ("cifar_dataparallel", "dcgan_accel", "quickstart_notebook")  # issue 44's idioms: launched


# the script's last report: printed (or logged) once, by rank 0, after the whole run
LAST = {"mnist_cnn": "Test set: Average loss", "vae": "sample mean:", "device_flag": "saved model to",
        "amp_scheduler": "best val acc:", "char_transformer": "number of parameters:",
        "cifar_dataparallel": "best acc:", "dcgan_accel": "finished 1 epochs", "quickstart_notebook": "Predicted:"}


@pytest.mark.parametrize("name", SHORT)
def test_each_converted_script_runs_to_its_end_at_2_processes(runs, name):
    r = ok(runs[f"launch:{name}"])
    assert (r.stdout + r.stderr).count(LAST[name]) == 1, f"not once:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"


@pytest.mark.parametrize("name", ["mnist_cnn", "device_flag", "char_transformer"])
def test_convert_verify_passes_and_check_finds_nothing(runs, name):
    r = ok(runs[f"verify:{name}"])
    assert "verify: PASS: 2 processes match 1 process" in r.stderr, r.stderr[-3000:]
    assert "check: nothing found" in r.stderr, r.stderr[-3000:]


def test_the_vae_passes_with_its_sampling_noise_matched(runs):
    """Its FAIL was its sampling noise alone (then "cannot compare exactly", issue 44): with its torch draws matched
    between one process and two (verify/matched.py) the runs agree. Its noise, drawn in ``reparameterize`` from the
    generator the script seeds alike on every rank, is listed (set 27's after-fix re-run): exit 1."""
    r = runs["verify:vae"]
    assert r.returncode == 1 and "VAE.reparameterize() draws from torch's generator" in r.stderr, r.stderr[-3000:]
    assert "verify: PASS: 2 processes match 1 process" in r.stderr and "random draws matched" in r.stderr, \
        r.stderr[-3000:]
    assert "check: nothing found" in r.stderr


def test_bfloat16_autocast_is_named_and_full_precision_passes(runs):
    r = runs["verify:amp_scheduler"]
    assert r.returncode == 4 and "autocast in bfloat16" in r.stderr, r.stderr[-3000:]
    assert "verify: PASS" in ok(runs["verify:amp_scheduler:fp32"]).stderr


def test_the_converted_mnist_reduces_its_test_metrics_to_the_one_process_ones(runs):
    pattern = r"Average loss: ([0-9.]+), Accuracy: (\d+)/(\d+)"
    one = re.findall(pattern, ok(runs["mnist:1"]).stdout)
    two = re.findall(pattern, ok(runs["mnist:2"]).stdout)
    assert len(one) == len(two) == 1, (one, two)
    assert one[0][1:] == two[0][1:] and abs(float(one[0][0]) - float(two[0][0])) < 1e-3, (one, two)


def test_the_whole_model_the_notebook_saves_is_the_plain_module(runs, tmp_path_factory):
    ok(runs["launch:quickstart_notebook"])
    saved = next(p for p in tmp_path_factory.getbasetemp().glob("converted*/q.pth"))
    with zipfile.ZipFile(saved) as archive:  # the pickle names the classes it needs: a wrapper needs a process group
        pickled = b"".join(archive.read(n) for n in archive.namelist() if n.endswith(".pkl"))
    assert b"NeuralNetwork" in pickled and b"DistributedDataParallel" not in pickled


def test_the_data_parallel_scripts_checkpoint_folder_is_made_once(runs):
    r = ok(runs["launch:cifar_dataparallel"])
    assert "FileExistsError" not in r.stderr and (r.stdout + r.stderr).count("Saving..") >= 1
