"""Issue 44's held-out run: ``if use_cuda: model = model.cuda()`` converted to a ``prepare_model`` under the same
``if``, and one optimizer over two models the converter did not follow, trained N unsynchronised copies on sharded
batches with no word. Now the first optimizer step of such a run stops every rank with one line; a model the
script wrapped in torch's own DDP is left alone."""
from conftest import WORKERS, launch, ok

WORKER = WORKERS / "unprepared.py"


def test_sharded_training_batches_without_a_prepared_model_stop_at_the_first_step(tmp_path):
    r = launch(WORKER, "cond", tmp_path, timeout=120)
    assert r.returncode == 1 and "trained" not in r.stdout, r.stdout + r.stderr[-3000:]
    assert "no model went through ddpkit.prepare_model() before the first optimizer.step()" in r.stderr, r.stderr
    assert "not only under `if use_cuda:`" in r.stderr


def test_a_model_the_script_wrapped_in_ddp_itself_trains(tmp_path):
    r = launch(WORKER, "handddp", tmp_path, timeout=120)
    ok(r)
    assert "trained 0" in r.stdout and "FutureWarning" not in r.stderr, r.stderr[-3000:]


def test_a_prepared_model_fed_by_a_plain_loader_is_said_once_and_trains():
    """The third held-out run: a script whose loaders live in a package it imports from elsewhere converted with
    exit 0 and no word, launched as "DistributedDataParallel on 2 processes", and every rank read every batch."""
    r = ok(launch(WORKERS / "unsharded.py", "plain", timeout=120))
    assert r.stderr.count("no training loader of ddpkit.data_loader was built before the first") == 1, r.stderr
    r = ok(launch(WORKERS / "unsharded.py", "own", timeout=120))
    assert "no training loader of ddpkit.data_loader" not in r.stderr, r.stderr
