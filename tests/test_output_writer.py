"""``ddpkit.summary_writer()`` on the ranks other than 0 answers ``log_dir`` / ``get_logdir()`` with rank 0's folder
(the fourth held-out set: SimCLR's ``os.path.join(writer.log_dir, "training.log")`` raised TypeError on rank 1,
its ``log_dir`` a function of the stand-in writer). Real processes over gloo."""
import pytest

from conftest import WORKERS, launch, ok


def test_every_rank_reads_rank_0s_log_dir(tmp_path):
    pytest.importorskip("tensorboard")
    ok(launch(WORKERS / "writer_dir.py", tmp_path, timeout=120))
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name.endswith("_exp")]
    assert len(runs) == 1, runs  # one folder: rank 0's (beside its _debug one)
    written = {p.name: p.read_text() for p in runs[0].glob("rank*.txt")}
    assert set(written) == {"rank0.txt", "rank1.txt"} and len(set(written.values())) == 1, written
    assert written["rank1.txt"].endswith("_exp given"), written  # a log_dir given is its own on every rank
    assert (tmp_path / "rank1_given" / "config.yml").exists()  # made on rank 1 too (eighth held-out set)


def test_the_rank_0_logger_takes_the_loggers_own_configuration():
    """moemen95's template configures the logger convert made ``ddpkit.get_logger(...)``: ``addHandler`` raised
    AttributeError on the adapter (the fifth held-out set). The logger's own methods answer through it."""
    import logging

    import ddpkit

    log = ddpkit.get_logger("ddpkit-test-config")
    handler = logging.NullHandler()
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    assert handler in logging.getLogger("ddpkit-test-config").handlers and log.handlers == [handler]
    log.removeHandler(handler)
    assert not logging.getLogger("ddpkit-test-config").handlers


def test_a_disabled_bars_write_prints_nothing_on_the_other_ranks(tmp_path):
    """hkproj/pytorch-transformer validates with ``print_msg = lambda m: batch_iterator.write(m)``: tqdm's write
    prints whether the bar is disabled or not, so every line came once per rank."""
    (tmp_path / "train.py").write_text(
        "import ddpkit\nddpkit.init()\nbar = ddpkit.progress(range(3))\nfor i in bar:\n    pass\n"
        "bar.write('validated once')\n")
    r = ok(launch(tmp_path / "train.py", timeout=120, cwd=tmp_path))
    said = [line for line in (r.stdout + r.stderr).splitlines() if "validated once" in line]
    assert said == ["validated once"], said
