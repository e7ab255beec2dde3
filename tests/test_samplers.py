"""``data_loader(sampler=...)``: a user's sampler (RandomSampler with replacement, WeightedRandomSampler) gives
one stream of indices, seeded per epoch from ``seed``; rank r takes positions r, r + W, ... of it (tests at 2
processes, gloo), and what cannot be split so gets one clear error."""
import itertools
import json
import random

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import ddpkit
from conftest import WORKERS, launch, ok
from ddpkit.data.samplers import SamplerShard

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


class GlobalRNG(Sampler):
    """The common hand-written sampler: draws from torch's global RNG (and python's), no generator."""

    def __init__(self, n, draw=lambda n: torch.randperm(n).tolist()):
        self.n, self.draw = n, draw

    def __iter__(self):
        return iter(self.draw(self.n))

    def __len__(self):
        return self.n


@pytest.mark.parametrize("draw", [lambda n: torch.randperm(n).tolist(), lambda n: random.sample(range(n), n)])
def test_a_global_rng_sampler_draws_the_same_order_whatever_the_rank_s_rng(draw):
    """Rank r's global RNGs are seeded seed + r: the order must not depend on them (it did: duplicated and
    skipped samples across ranks), and the script's global RNGs are left where they were."""
    ddpkit.init(cpu=True)
    loader = ddpkit.data_loader(DATA, batch_size=8, seed=4, sampler=GlobalRNG(50, draw))
    orders = []
    for rank_seed in (3, 4):  # what ddpkit.init(seed=3) gives rank 0 and rank 1
        loader.set_epoch(0)
        torch.manual_seed(rank_seed)
        random.seed(rank_seed)
        before = torch.get_rng_state(), random.getstate()
        orders.append([i for (ids,) in loader for i in ids.tolist()])
        assert torch.equal(before[0], torch.get_rng_state()) and before[1] == random.getstate()
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(50))
    loader.set_epoch(1)
    assert [i for (ids,) in loader for i in ids.tolist()] != orders[0]  # seeded seed + epoch: a new order


def test_a_read_only_generator_property_falls_back_to_seeding_the_global_rng():
    class Wrapped(Sampler):
        def __init__(self, inner):
            self.inner = inner

        @property
        def generator(self):
            return self.inner.generator

        def __iter__(self):
            return iter(self.inner)

        def __len__(self):
            return len(self.inner)

    ddpkit.init(cpu=True)
    loader = ddpkit.data_loader(DATA, batch_size=8, sampler=Wrapped(RandomSampler(DATA)))  # was AttributeError
    passes = []
    for rank_seed in (3, 4):
        loader.set_epoch(0)
        torch.manual_seed(rank_seed)
        passes.append([i for (ids,) in loader for i in ids.tolist()])
    assert passes[0] == passes[1] and sorted(passes[0]) == list(range(50))


class Overstated(Sampler):
    """len() says 40, __iter__ yields 37 (a lazily filtering sampler)."""

    def __iter__(self):
        return iter([i for i in range(40) if i not in (5, 6, 7)])

    def __len__(self):
        return 40


@pytest.mark.parametrize("uneven", ["pad", "drop", "join"])
def test_a_sampler_shorter_than_its_len_raises_the_same_error_at_the_same_step_on_every_rank(uneven):
    """Ranks got [10, 9, 9, 9] indices for len() 10 each: unequal steps, a DDP hang. Every rank reads the
    stream in blocks of rows of W, the same blocks on every rank, so each sees the shortfall at the same index
    count (before the short block), and says so in one line."""
    failures = []
    for rank in range(4):
        shard, taken = SamplerShard(Overstated(), rank, 4, seed=0, uneven=uneven), []
        with pytest.raises(ValueError, match=r"yielded 37 indices but len\(\) said 40.*__len__") as error:
            for index in shard:
                taken.append(index)
        assert "\n" not in str(error.value)
        failures.append((len(taken), str(error.value)))
    assert len(set(failures)) == 1  # the same count, so the same step, and the same error on every rank


def test_a_growing_pool_is_read_at_its_length_each_pass():
    """Active learning: the labeled pool a SubsetRandomSampler draws from grows between epochs; torch reads
    len() per pass, ddpkit kept the length of build time (5 of 20)."""
    ddpkit.init(cpu=True)
    pool = list(range(5))
    loader = ddpkit.data_loader(DATA, batch_size=4, sampler=SubsetRandomSampler(pool))
    assert sorted(i for (ids,) in loader for i in ids.tolist()) == pool and len(loader) == 2
    pool.extend(range(5, 20))
    assert len(loader) == 5
    assert sorted(i for (ids,) in loader for i in ids.tolist()) == list(range(20))


def test_an_empty_sampler_is_refused_in_one_line():
    ddpkit.init(cpu=True)
    with pytest.raises(ValueError, match=r"sampler=SubsetRandomSampler\(\.\.\.\) has 0 indices but the job has "
                                         r"1 process.*at least 1") as error:
        ddpkit.data_loader(DATA, batch_size=4, sampler=SubsetRandomSampler([]))
    assert "\n" not in str(error.value)


def test_a_weighted_sampler_too_large_to_draw_is_refused_up_front():
    """torch.multinomial draws a WeightedRandomSampler's whole stream at the first batch, then a list of it: at
    num_samples=10**12 that is terabytes, not an endless stream."""
    ddpkit.init(cpu=True)
    with pytest.raises(ValueError, match=r"WeightedRandomSampler\(num_samples=1000000000000\) draws its whole "
                                         r"stream.*num_samples=len\(dataset\)") as error:
        ddpkit.data_loader(DATA, batch_size=4, sampler=WeightedRandomSampler(WEIGHTS, 10**12))
    assert "\n" not in str(error.value)


def test_ranks_of_a_global_rng_sampler_and_a_too_short_sampler(ranks):
    """At 2 processes (init(seed=3): rank r's global RNG seeded 3 + r): each step's indices across the ranks
    are one permutation; a sampler of 1 index is refused on each rank."""
    union = [i for step in union_per_step(ranks, "global") for i in step]
    assert sorted(union) == list(range(50))
    for got in ranks:
        assert got["short"].startswith("ValueError: sampler=SubsetRandomSampler(...) has 1 indices but the job "
                                       "has 2 processes")
