"""Every rank shards the same training dataset (``ddpkit/data/same.py``): a dataset drawn at random with no seed,
an unseeded ``random_split`` (the held-out LSTM's ``train_test_split`` in torch's form), or one drawn after
``ddpkit.init(seed=...)`` gave each rank parts of different data, and the job trained on neither with no word.
Now every rank stops where the training loader is built, with one line; the same data on every rank trains."""
import pytest

from conftest import WORKERS, launch, ok

WORKER = WORKERS / "same_data.py"


@pytest.mark.parametrize("case, what", [("unseeded", "the samples it holds"), ("split", "its split's indices"),
                                        ("init_seed", "the samples it holds"), ("texts", "the samples it holds")])
def test_ranks_holding_different_training_data_stop_where_the_loader_is_built(case, what):
    r = launch(WORKER, case, timeout=120)
    assert r.returncode == 1 and "trained" not in r.stdout, r.stdout + r.stderr[-3000:]
    line = f"ddpkit.data_loader: the training dataset differs between ranks (rank 1's from rank 0's: {what})"
    assert line in r.stderr and "torch.manual_seed(0)" in r.stderr, r.stderr[-3000:]
    assert "unless PYTHONHASHSEED is one value" in r.stderr and "sorted(set(...))" in r.stderr  # a set's order


@pytest.mark.parametrize("case", ["seeded", "seeded_split", "concat", "texts_sorted"])
def test_the_same_data_on_every_rank_trains(case):
    ok(launch(WORKER, case, timeout=120))


def test_a_fingerprint_of_arrays_it_cannot_sum_compares_their_length_and_does_not_raise():
    """Review: a dataset whose ``.data`` is an array of file paths (or objects, or big-endian numbers) made the
    fingerprint raise, so ddpkit.data_loader(train=True) failed at 2 processes. Tensor indices of a Subset are read
    as a tensor (2M of them as a list took 5 s)."""
    import numpy as np
    import torch
    from torch.utils.data import Dataset, Subset, TensorDataset

    from ddpkit.data.same import fingerprint

    class Files(Dataset):
        def __init__(self, data):
            self.data, self.targets = data, np.array([0, 1])

        def __len__(self):
            return 2

    for data in (np.array(["a.png", "b.png"]), np.array([object(), object()]), np.array([1.0, 2.0], dtype=">f8")):
        assert fingerprint(Files(data)).tolist()[0] == 2.0
    listed = fingerprint(Subset(TensorDataset(torch.zeros(10)), list(range(10))))
    assert fingerprint(Subset(TensorDataset(torch.zeros(10)), torch.arange(10))).tolist() == listed.tolist()


def test_a_dataset_of_its_own_is_told_by_the_lists_and_tables_it_holds():
    """character-based-cnn: its Dataset holds lists of texts and labels, shuffled by an unseeded
    ``DataFrame.sample(frac=1)``; the fingerprint saw only their length, and each rank trained on parts of its own
    order (verify FAILed with no cause). A transform, a generator or a number held (a rank, an epoch) is not
    compared."""
    import torch
    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    class Held(Dataset):
        def __init__(self, **held):
            self.__dict__.update(held)

        def __len__(self):
            return 4

    pairs = [("a.png", 0), ("b.png", 1), ("c.png", 0), ("d.png", 1)]
    assert fingerprint(Held(samples=pairs)).tolist() != fingerprint(Held(samples=pairs[::-1])).tolist()
    texts = ["good", "bad", "fine", "poor"]
    assert fingerprint(Held(texts=texts)).tolist() != fingerprint(Held(texts=sorted(texts))).tolist()
    assert fingerprint(Held(texts=texts, rank=0, rng=torch.Generator(), transform=print)).tolist() == \
        fingerprint(Held(texts=list(texts), rank=1, rng=torch.Generator().manual_seed(3), transform=len)).tolist()
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"text": texts, "label": [0, 1, 0, 1]})
    assert fingerprint(Held(df=frame)).tolist() != fingerprint(Held(df=frame.iloc[::-1])).tolist()
    assert fingerprint(Held(df=frame)).tolist() == fingerprint(Held(df=frame.copy())).tolist()
    ragged = pd.DataFrame({"tokens": [[1, 2], [3], [4], [5]]})  # cells pandas cannot hash: the length still
    assert fingerprint(Held(df=ragged)).tolist()[0] == 4.0


def test_what_may_differ_between_processes_holding_the_same_data_is_not_compared():
    """Review: a cache each rank fills with what it reads (``[None] * n``, then tensors), the same files under
    each process's own scratch folder, a buffer from ``torch.empty``, a stored generator state, a DataFrame
    column of objects (hashed through their addresses) gave a false "differs between ranks"; a sparse tensor
    and an int beyond float64 made the fingerprint raise."""
    import torch
    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    class Held(Dataset):
        def __init__(self, **held):
            self.__dict__.update(held)

        def __len__(self):
            return 4

    def same(a, b):
        return fingerprint(Held(**a)).tolist() == fingerprint(Held(**b)).tolist()

    assert same({"cache": [None] * 4}, {"cache": [torch.ones(2), None, None, torch.zeros(3)]})
    assert same({"samples": [("/tmp/a1/x.npy", 0), ("/tmp/a1/y.npy", 1)]},
                {"samples": [("/tmp/b2/x.npy", 0), ("/tmp/b2/y.npy", 1)]})
    assert not same({"samples": [("/tmp/a1/x.npy", 0), ("/tmp/a1/y.npy", 1)]},
                    {"samples": [("/tmp/a1/y.npy", 1), ("/tmp/a1/x.npy", 0)]})
    assert same({"buffer": torch.zeros(3), "state": torch.get_rng_state()},
                {"buffer": torch.ones(3), "state": torch.Generator().manual_seed(5).get_state()})
    for odd in ({"data": torch.eye(3).to_sparse()}, {"ids": [2 ** 2000, 1]}, {"data": torch.empty(3, device="meta")}):
        fingerprint(Held(**odd))  # no raise
    pd = pytest.importorskip("pandas")
    objects = pd.DataFrame({"text": ["a", "b"], "obj": [object(), object()]})
    again = pd.DataFrame({"text": ["a", "b"], "obj": [object(), object()]})
    assert same({"df": objects}, {"df": again})
    assert not same({"df": objects}, {"df": objects.iloc[::-1]})


def test_a_tensor_of_one_row_per_sample_under_any_name_is_compared():
    """Second review: a Dataset holding ``self.x = torch.randn(n, 6)`` drawn with no seed was compared no more
    (tensors only of .data / .targets): each rank trained on other data. A tensor of one row per sample is the
    samples, whatever its name; a buffer of another size is not."""
    import torch
    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    class Held(Dataset):
        def __init__(self, **held):
            self.__dict__.update(held)

        def __len__(self):
            return 4

    assert fingerprint(Held(x=torch.zeros(4, 6))).tolist() != fingerprint(Held(x=torch.ones(4, 6))).tolist()
    assert fingerprint(Held(buf=torch.zeros(3))).tolist() == fingerprint(Held(buf=torch.ones(3))).tolist()


def test_a_list_of_one_tensor_per_sample_is_compared():
    """LSTM_pytorch's Dataset: ``self.x.append(torch.from_numpy(np.random.randn(5)))`` per sample, unseeded in
    ``__init__``: a list of tensors counted as a cache (0), so each rank trained on its own data with no word."""
    import torch
    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    class Held(Dataset):
        def __init__(self, **held):
            self.__dict__.update(held)

        def __len__(self):
            return 4

    rows = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    others = [torch.randn(5, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    assert fingerprint(Held(x=rows)).tolist() != fingerprint(Held(x=others)).tolist()
    assert fingerprint(Held(x=rows)).tolist() != fingerprint(Held(x=rows[::-1])).tolist()
    assert fingerprint(Held(x=rows)).tolist() == fingerprint(Held(x=[r.clone() for r in rows])).tolist()
    # review: a cache filled before the loader (a pass for the input mean) with each process's own jitter, and a
    # bank of noise tensors of another length, are no samples
    assert fingerprint(Held(cache=rows)).tolist() == fingerprint(Held(cache=others)).tolist()
    assert fingerprint(Held(bank=rows[:3])).tolist() == fingerprint(Held(bank=others[:3])).tolist()


def test_a_list_of_named_tuples_holding_tuples_is_compared_in_its_order():
    """dlwpt's LunaDataset: ``random.shuffle`` unseeded over candidates ``(is_nodule, diameter, uid, (x, y, z))``,
    a namedtuple holding a tuple: not plain, counted as nothing, so each rank sharded its own order."""
    from collections import namedtuple

    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    Candidate = namedtuple("Candidate", "nodule, diameter, uid, center")

    class Luna(Dataset):
        def __init__(self, candidates):
            self.candidates = candidates

        def __len__(self):
            return len(self.candidates)

        def __getitem__(self, i):
            return self.candidates[i]

    held = [Candidate(i % 3 == 0, 1.5 * i, f"1.3.6.{i}", (i, -i, 2.0 * i)) for i in range(9)]
    assert fingerprint(Luna(held)).tolist() != fingerprint(Luna(held[::-1])).tolist()
    assert fingerprint(Luna(held)).tolist() == fingerprint(Luna(list(held))).tolist()
    assert fingerprint(Luna(held)).tolist() != fingerprint(Luna([c._replace(center=(0, 0, 0)) for c in held])).tolist()


def test_an_attribute_only_the_length_reads_is_not_compared():
    """ECNU's graph Dataset keeps an id list shuffled by an unseeded ``random.shuffle`` for its length only and
    serves ``(index, labels[index])``: every rank serves the same samples, yet the check stopped the run. What
    ``__getitem__`` (or a method it calls) reads is compared; what only ``__init__`` and ``__len__`` read is not."""
    import torch
    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    class Ids(Dataset):
        def __init__(self, ids, labels):
            self.data, self.labels = ids, labels

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return i, self.labels[i]

    labels = torch.arange(4)
    assert fingerprint(Ids([3, 1, 2, 0], labels)).tolist() == fingerprint(Ids([0, 2, 1, 3], labels)).tolist()
    assert fingerprint(Ids([3, 1, 2, 0], labels)).tolist() != fingerprint(Ids([3, 1, 2, 0], labels.flip(0))).tolist()


def test_what_a_property_a_cached_helper_or_a_helper_function_reads_is_still_compared():
    """Review 35: the attributes were read only by ``__getitem__``'s own source, so samples kept under a mangled
    name, read through a property or an ``lru_cache`` method, or by a function handed ``self`` slipped through
    unseeded."""
    import functools

    import torch
    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    def row(ds, i):
        return ds.rows[i]

    class Mangled(Dataset):
        def __init__(self, x):
            self.__x = x

        def __len__(self):
            return len(self.__x)

        def __getitem__(self, i):
            return self.__x[i]

    class Cached(Dataset):
        def __init__(self, x):
            self.x = x

        def __len__(self):
            return 4

        @property
        def data(self):
            return self.x

        @functools.cache  # noqa: B019  (the pattern reviewed: a cached getter)
        def get(self, i):
            return self.data[i]

        def __getitem__(self, i):
            return self.get(i)

    class Handed(Dataset):
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return row(self, i)

    a, b = torch.zeros(4, 2), torch.ones(4, 2)
    for cls in (Mangled, Cached, Handed):
        assert fingerprint(cls(a)).tolist() != fingerprint(cls(b)).tolist(), cls.__name__


def test_a_cached_property_an_alias_of_self_or_self_in_a_tuple_is_compared_and_len_self_is_not_a_reader():
    """Review 36: ``functools.cached_property``, ``ds = self; ds.x[i]`` and ``load((self, i))`` let unseeded data
    through; ``len(self)`` in ``__getitem__`` made every attribute count (a per-rank id list stopped the run)."""
    import functools

    import torch
    from torch.utils.data import Dataset

    from ddpkit.data.same import fingerprint

    def load(pair):
        return pair[0].x[pair[1]]

    class Cached(Dataset):
        def __init__(self, x):
            self.x = x

        def __len__(self):
            return 4

        @functools.cached_property
        def rows(self):
            return self.x

        def __getitem__(self, i):
            return self.rows[i]

    class Alias(Cached):
        def __getitem__(self, i):
            ds = self
            return ds.x[i]

    class InTuple(Cached):
        def __getitem__(self, i):
            return load((self, i))

    class Ids(Dataset):
        def __init__(self, ids, labels):
            self.data, self.labels = ids, labels

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            return i % len(self), self.labels[i]

    a, b = torch.zeros(4, 2), torch.ones(4, 2)
    for cls in (Cached, Alias, InTuple):
        assert fingerprint(cls(a)).tolist() != fingerprint(cls(b)).tolist(), cls.__name__
    labels = torch.arange(4)
    assert fingerprint(Ids([3, 1, 2, 0], labels)).tolist() == fingerprint(Ids([0, 2, 1, 3], labels)).tolist()
