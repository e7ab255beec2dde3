"""A checkpoint write that fails on one rank fails every rank alike, at once, with one error naming the rank and
its error; nothing of it is left, the previous checkpoint stays the newest, and the ranks can carry on."""
import json

import pytest

from conftest import WORKERS, launch, ok

FIRST = "ckpt-0000000001"


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_write_failing_on_one_rank_fails_every_rank_alike_and_they_carry_on(tmp_path, mode):
    ok(launch(WORKERS / "ckpt_fail.py", tmp_path, launcher_args=("--mode", mode), timeout=150))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    step2, step3, bug = ranks[0]["errors"]
    assert ranks[1]["errors"] == [step2, step3, bug]  # every rank raised the same error
    assert step2.startswith("checkpoint step 2 was not saved: writing failed on rank 0 (OSError: [Errno 27] File "
                            "too large); every rank raised this, nothing of it was left and the newest checkpoint "
                            f"is still {tmp_path / 'ckpt' / FIRST}"), step2
    if mode == "fsdp":  # rank 1's own shard could not be written
        assert step3.startswith("checkpoint step 3 was not saved: writing the shards failed on rank 1 (OSError: "
                                "[Errno 27] File too large)"), step3
    else:  # rank 1's notes.state_dict() raised
        assert step3.startswith("checkpoint step 3 was not saved: collecting the state failed on rank 1 "
                                "(FileNotFoundError: [Errno 2] No such file or directory: "), step3
    # a KeyError from a state_dict is no disk problem (`except OSError` would swallow it); the stream loader's
    # gather ran on every rank before it, so the ranks agreed on it and carried on
    assert bug.startswith("RuntimeError: checkpoint step 3 was not saved: collecting the state failed on rank 1 "
                          "(KeyError: \"'<pad>'\"); every rank raised this"), bug
    assert "free space" not in bug and "fix the error on rank 1" in bug, bug
    for r in ranks:
        assert r["after"][:2] == [{"listing": [FIRST], "latest": FIRST}] * 2  # nothing partial, ckpt-1 the newest
        assert r["after"][2] == {"listing": [FIRST, "ckpt-0000000004"], "latest": "ckpt-0000000004"}
