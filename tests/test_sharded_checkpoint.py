"""Sharded checkpoints (fsdp, gloo, real processes): bitwise resume after SIGKILL, a flipped bit in one shard,
2 -> 3 -> 1 processes, `ddpkit consolidate`, and DCP metadata read without arbitrary unpickling."""
import pickle
import sys

import pytest
import torch
from torch import nn

from conftest import WORKERS, launch, ok, run_cmd
from ddpkit.checkpoint import safeload

RESUME = WORKERS / "resume.py"
FSDP = ("--mode", "fsdp")


def _final(out):
    return torch.load(out / "final.pt")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp-uninterrupted")
    ok(launch(RESUME, out, "--save-every", 7, launcher_args=FSDP))  # 14 steps: ckpt-7, ckpt-14 = the final weights
    return out


def test_sigkill_then_resume_skips_a_flipped_bit_and_is_bitwise_equal(tmp_path, uninterrupted):
    r = launch(RESUME, tmp_path, "--die-at", 8, "--die-how", "kill", launcher_args=FSDP)
    assert r.returncode == 1 and "killed by SIGKILL" in r.stderr, r.stderr[-2000:]
    newest = tmp_path / "ckpt" / "ckpt-0000000006"
    shard = newest / "shards" / "__1_0.distcp"  # rank 1's shard
    assert sorted(p.name for p in (newest / "shards").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    r = ok(launch(RESUME, tmp_path, launcher_args=(*FSDP, "--resume")))
    assert "skipping checkpoint" in r.stderr and "shards/__1_0.distcp does not match its sha256" in r.stderr
    assert "resumed from" in r.stderr and "ckpt-0000000003" in r.stderr
    a, b = _final(uninterrupted), _final(tmp_path)
    assert a["step"] == b["step"] == 14
    assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])


def test_a_shard_that_cannot_be_written_fails_every_rank_with_one_line_and_leaves_nothing(tmp_path):
    """Rank 1's writes fail past 200 bytes (RLIMIT_FSIZE): every rank raises the same OSError (no rank waits
    in a collective for the others), the launcher names it once, and no checkpoint or temporary dir remains."""
    r = launch(RESUME, tmp_path, "--save-every", 3, "--rank1-file-limit", 200, launcher_args=FSDP, timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    assert "failed first: OSError: checkpoint step 3 was not saved: writing the shards failed on rank 1 (OSError: " \
        "[Errno 27] File too large); every rank raised this, nothing of it was left and there is no earlier " \
        "checkpoint" in r.stderr, r.stderr[-2000:]
    assert "HANG" not in r.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == []


def test_resume_at_2_then_3_then_1_processes(tmp_path, tmp_path_factory):
    common = ("--plain", "--samples", 48, "--global-batch", 12, "--save-every", 2)  # 4 steps/epoch, 8 in all
    reference = tmp_path_factory.mktemp("fsdp-plain")
    ok(launch(RESUME, reference, *common, launcher_args=FSDP))
    assert launch(RESUME, tmp_path, *common, "--die-at", 3, launcher_args=FSDP).returncode == 1  # ckpt-2, mid-epoch
    r = ok(launch(RESUME, tmp_path, *common, "--stop-at", 5, nproc=3, launcher_args=(*FSDP, "--resume")))
    assert "ckpt-0000000002" in r.stderr  # resharded 2 -> 3; saves ckpt-4 from 3 processes
    r = ok(run_cmd([sys.executable, str(RESUME), str(tmp_path), *map(str, common)], env={"DDPKIT_RESUME": "1"}))
    assert "ckpt-0000000004" in r.stderr  # one process, no process group: DCP assembles the shards
    a, b = _final(reference)["weights"], _final(tmp_path)["weights"]
    assert _final(tmp_path)["step"] == 8
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_consolidate_writes_a_plain_state_dict(tmp_path, uninterrupted):
    out = tmp_path / "model.pt"
    r = ok(run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(uninterrupted / "ckpt"), str(out)]))
    assert "ckpt-0000000014" in r.stderr
    state = torch.load(out, weights_only=True)
    final = _final(uninterrupted)["weights"]
    assert sorted(state) == sorted(final) and all(torch.equal(state[k], final[k]) for k in final)
    plain = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.ReLU(), nn.Linear(16, 1))
    plain.load_state_dict(state)  # strict: no module. prefix, no DTensor
    r = run_cmd([sys.executable, "-m", "ddpkit", "consolidate", str(uninterrupted / "ckpt"), str(out), "--name", "x"])
    assert r.returncode == 2 and "has no 'x'" in r.stderr and r.stderr.count("\n") == 1


def test_metadata_that_names_other_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("ran",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(safeload.UnsafeCheckpoint, match="builtins.print, which ddpkit does not load"):
        safeload.reader(str(tmp_path)).read_metadata()
