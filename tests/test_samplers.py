"""``data_loader(sampler=...)``: a user's sampler (RandomSampler with replacement, WeightedRandomSampler) gives
one stream of indices, seeded per epoch from ``seed``; rank r takes positions r, r + W, ... of it (tests at 2
processes, gloo), and what cannot be split so gets one clear error."""
import itertools
import json

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import ddpkit
from conftest import WORKERS, launch, ok

DATA = TensorDataset(torch.arange(50))
WEIGHTS = torch.linspace(0.1, 1.0, 50)


def stream(sampler, seed, count):
    """One process's stream: the sampler as torch iterates it, its generator seeded ``seed`` (seed + epoch)."""
    sampler.generator = torch.Generator().manual_seed(seed)
    return list(itertools.islice(iter(sampler), count))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("samplers")
    ok(launch(WORKERS / "samplers.py", out))
    return [json.loads((out / f"samplers-{rank}.json").read_text()) for rank in (0, 1)]


def union_per_step(ranks, key):
    """Per step, positions r, r + 2, ... of rank r put back in stream order."""
    return [[i for pair in zip(*steps) for i in pair] for steps in zip(*(r[key] for r in ranks))]


def test_the_ranks_split_one_stream_of_an_infinite_sampler(ranks):
    expected = stream(RandomSampler(DATA, replacement=True, num_samples=10**10), 5, 6 * 8)
    assert union_per_step(ranks, "infinite") == [expected[i:i + 8] for i in range(0, 48, 8)]
    assert [r["infinite_epoch"] for r in ranks] == [1, 1]  # the loop's break ended the pass


def test_a_weighted_sampler_takes_equal_steps_and_a_new_order_each_epoch(ranks):
    for epoch in (0, 1):
        expected = stream(WeightedRandomSampler(WEIGHTS, 29), 5 + epoch, 29)
        expected += expected[:1]  # padded to 30: every rank takes the same count (4 steps, the last of 3)
        per_rank = [r["weighted"][epoch] for r in ranks]
        assert [len(steps) for steps in per_rank] == [4, 4]
        assert [i for r, steps in enumerate(per_rank) for i in sum(steps, [])] == expected[0::2] + expected[1::2]
    assert ranks[0]["weighted"][0] != ranks[0]["weighted"][1]


def test_a_restored_position_continues_the_stream(ranks):
    for got in ranks:
        assert got["resumed"] == got["weighted"][1][2:] and got["resumed_len"] == 2


def test_one_process_takes_the_whole_stream():
    ddpkit.init(cpu=True)
    loader = ddpkit.data_loader(DATA, batch_size=8, sampler=RandomSampler(DATA))  # was an internal TypeError
    for epoch in (0, 1):
        assert [i for (ids,) in loader for i in ids.tolist()] == stream(RandomSampler(DATA), epoch, 50)
    assert len(ddpkit.data_loader(DATA, batch_size=8, sampler=SequentialSampler(range(20)))) == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_sampler=BatchSampler(SequentialSampler(DATA), 4, False)),
     r"batch_sampler= is not supported.*pass sampler="),
    (dict(sampler=DistributedSampler(DATA, num_replicas=1, rank=0)), r"DistributedSampler.*drop sampler="),
    (dict(sampler=RandomSampler(DATA, generator=torch.Generator().manual_seed(1))),
     r"has its own generator.*seed="),
    (dict(sampler=RandomSampler(DATA), shuffle=True), r"sampler= decides the order.*drop shuffle="),
    (dict(sampler=iter(range(50))), r"sampler=range_iterator.*has no len"),
])
def test_what_cannot_be_split_is_refused_in_one_line(kwargs, message):
    ddpkit.init(cpu=True)
    with pytest.raises(ValueError, match=message) as error:
        ddpkit.data_loader(DATA, batch_size=4, **kwargs)
    assert "\n" not in str(error.value)



def test_a_sampler_ddpkit_has_seeded_can_build_another_loader():
    """After a pass its generator is ddpkit's, not the script's: a rebuilt loader (a notebook cell run again)
    must not be refused."""
    ddpkit.init(cpu=True)
    sampler = RandomSampler(DATA)
    first = [i for (ids,) in ddpkit.data_loader(DATA, batch_size=8, sampler=sampler) for i in ids.tolist()]
    again = [i for (ids,) in ddpkit.data_loader(DATA, batch_size=8, sampler=sampler) for i in ids.tolist()]
    assert first == again == stream(RandomSampler(DATA), 0, 50)
