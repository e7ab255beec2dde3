"""Streaming datasets (torch IterableDataset, gloo, real processes): each sample read by exactly one (rank,
worker), equal steps, a 3-vs-7-batch stream that ends at once, and a bitwise resume mid-stream."""
import json

import pytest
import torch

from conftest import WORKERS, launch, ok

N = 103


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("streams")
    found = {}
    for world in (2, 3):
        for workers in (0, 1, 2):
            ok(launch(WORKERS / "streams.py", out, workers, nproc=world, env={"HF_DATASETS_OFFLINE": "1"}))
            found[world, workers] = json.loads((out / f"streams{world}x{workers}.json").read_text())
    return found


CASES = [(w, k) for w in (2, 3) for k in (0, 1, 2)]


@pytest.mark.parametrize("world, workers", CASES)
@pytest.mark.parametrize("stream", ["generator", "files"])
def test_evaluation_reads_every_sample_exactly_once(results, world, workers, stream):
    assert results[world, workers][f"{stream}_eval"] == list(range(N))


@pytest.mark.parametrize("world, workers", CASES)
@pytest.mark.parametrize("stream", ["generator", "files"])
def test_training_takes_equal_steps_and_never_repeats_a_sample(results, world, workers, stream):
    first, second = results[world, workers][f"{stream}_train"]
    for epoch in (first, second):
        assert len(set(epoch["steps"])) == 1, epoch["steps"]  # every rank took the same number of steps
        assert len(epoch["ids"]) == len(set(epoch["ids"])) and set(epoch["ids"]) <= set(range(N))
        steps = epoch["steps"][0]
        assert 0 < len(epoch["ids"]) <= steps * 4 * world
        if stream == "generator":  # round robin: slots differ by a sample, so drop loses at most a batch per slot
            assert len(epoch["ids"]) >= N - world * max(1, workers) * 4 * 2
    assert first["ids"] != second["ids"]  # reshuffled per epoch


@pytest.mark.parametrize("world, workers", CASES)
def test_hugging_face_streaming_dataset_reads_every_sample_exactly_once(results, world, workers):
    """split_dataset_by_node splits by rank (whole files when 7 divides, else every world_size-th sample); the
    library splits its shards among the loader workers itself."""
    pytest.importorskip("datasets")
    assert results[world, workers]["hf_eval"] == list(range(N))
    assert len(set(results[world, workers]["hf_train_steps"])) == 1  # equal steps on every rank


def test_a_rank_with_3_batches_and_one_with_7_stop_together_at_once(results):
    uneven = results[2, 0]["uneven"]
    assert uneven["steps"] == [3, 3] and uneven["seconds"] < 5


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """final.pt of an uninterrupted run, per (workers, extra arguments), run once for the tests that need it."""
    runs = {}

    def run(workers, *extra, env=None):
        if (workers, extra) not in runs:
            out = tmp_path_factory.mktemp("reference")
            ok(launch(WORKERS / "stream_resume.py", out, "--workers", workers, *extra, env=env))
            runs[workers, extra] = torch.load(out / "final.pt")
        return runs[workers, extra]
    return run


def _same_weights(a, b):
    return a["step"] == b["step"] and all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


# 2 workers take turns: after an odd number of batches worker 1's batch is next, not worker 0's
@pytest.mark.parametrize("workers, die_at, saved_at", [(0, 7, 6), (2, 7, 6), (2, 4, 3)])
def test_sigkill_mid_stream_then_resume_is_bitwise(tmp_path, uninterrupted, workers, die_at, saved_at):
    reference = uninterrupted(workers)
    r = launch(WORKERS / "stream_resume.py", tmp_path, "--workers", workers, "--die-at", die_at)
    assert r.returncode == 1 and "killed by SIGKILL" in r.stderr, r.stderr[-2000:]
    r = ok(launch(WORKERS / "stream_resume.py", tmp_path, "--workers", workers, launcher_args=["--resume"]))
    assert f"ckpt-{saved_at:010d}" in r.stderr  # mid-epoch: 90 samples / (2 x 4) = 11 steps per epoch
    assert _same_weights(reference, torch.load(tmp_path / "final.pt"))


@pytest.mark.parametrize("workers", [2, 3])
def test_a_stream_position_taken_at_any_step_continues_with_the_same_batches(tmp_path, workers):
    """Every step k of an epoch, odd and even, for a round-robin stream and one whose worker 0 runs dry first:
    a loader restored from the position at k, and the same loader iterated again after a ``break`` at k, hand
    out the rest of the epoch's batches in the uninterrupted order."""
    ok(launch(WORKERS / "stream_turns.py", tmp_path, workers))
    for rank, result in enumerate(json.loads((tmp_path / f"turns{workers}.json").read_text())):
        for stream in ("generator", "uneven"):
            assert result[stream]["steps"] >= 5 and result[stream]["wrong"] == [], (rank, stream, result[stream])


@pytest.mark.parametrize("die_at, saved_at", [(7, 6), (4, 3)])
def test_a_hugging_face_stream_resumes_mid_epoch_bitwise(tmp_path_factory, uninterrupted, die_at, saved_at):
    """The same kill and resume through ``datasets``' own split (by rank, then its shards among 2 workers)."""
    data = tmp_path_factory.getbasetemp() / "hf-data"
    if not data.exists():
        data.mkdir()
        for part in range(4):  # 4 files: 2 per rank, one per worker
            rows = [{"x": torch.randn(6, generator=torch.Generator().manual_seed(i)).tolist()}
                    for i in range(part, 90, 4)]
            (data / f"part{part}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    killed = tmp_path_factory.mktemp("killed")
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HOME": str(killed / "hf")}
    hf = ["--workers", 2, "--hf", data]
    reference = uninterrupted(2, "--hf", str(data), env=env)
    r = launch(WORKERS / "stream_resume.py", killed, *hf, "--die-at", die_at, env=env)
    assert r.returncode == 1 and "killed by SIGKILL" in r.stderr, r.stderr[-2000:]
    r = ok(launch(WORKERS / "stream_resume.py", killed, *hf, launcher_args=["--resume"], env=env))
    assert f"ckpt-{saved_at:010d}" in r.stderr
    assert _same_weights(reference, torch.load(killed / "final.pt"))
