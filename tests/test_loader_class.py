"""``data_loader(..., loader_class=cls)``: a library's DataLoader subclass that brings only its own collate (PyG's
``torch_geometric.loader.DataLoader``, which takes ``follow_batch=`` and builds ``Collater`` itself) batches
ddpkit's sharded loader; ``ddpkit convert`` writes it for PyG's loader, which it had left unsharded with a line
that sent the user to ``--imports``."""
import pytest
import torch
from torch.utils.data import DataLoader

import ddpkit


class Graphs(DataLoader):
    """Built the way PyG's loader is: its own keyword, the script's collate_fn dropped, its own collate."""

    def __init__(self, dataset, batch_size=1, shuffle=False, follow=None, **kwargs):
        kwargs.pop("collate_fn", None)
        self.follow = follow
        super().__init__(dataset, batch_size, shuffle, collate_fn=self.collate, **kwargs)

    def collate(self, samples):
        return {"x": torch.cat([s["x"] for s in samples]), "sizes": [len(s["x"]) for s in samples],
                "follow": self.follow}


def test_a_library_loaders_collate_batches_the_sharded_loader_and_its_own_keywords_go_to_it_alone():
    ddpkit.init()
    graphs = [{"x": torch.full((1 + i % 3, 2), float(i))} for i in range(10)]
    loader = ddpkit.data_loader(graphs, batch_size=4, shuffle=False, loader_class=Graphs, follow=["x"])
    batches = list(loader)
    assert [b["sizes"] for b in batches] == [[1, 2, 3, 1], [2, 3, 1, 2], [3, 1]]
    assert all(b["follow"] == ["x"] for b in batches)
    assert loader.epoch == 1  # ddpkit's loader, not the class's


class Own(DataLoader):
    def __iter__(self):
        return iter([])


@pytest.mark.parametrize("cls, said", [
    (Own, "loader_class=Own: it iterates in its own way"),
    (Graphs([1]), "loader_class=<"),
    (dict, "loader_class=<class 'dict'>: expected a subclass of torch.utils.data.DataLoader"),
])
def test_a_loader_class_that_is_not_a_collate_carrier_is_one_line(cls, said):
    ddpkit.init()
    with pytest.raises(ValueError) as error:
        ddpkit.data_loader(list(range(8)), batch_size=2, loader_class=cls)
    assert str(error.value).startswith(said) and "\n" not in str(error.value)


def test_convert_makes_pygs_loader_a_ddpkit_loader_with_its_class():
    pytest.importorskip("libcst")
    from ddpkit.commands.convert.plan import plan

    source = "import torch\nfrom torch_geometric.loader import DataLoader\n\n" \
        "train_loader = DataLoader(graphs, batch_size=8, shuffle=True, follow_batch=['x'])\n" \
        "test_loader = DataLoader(graphs, batch_size=8)\nmodel = torch.nn.Linear(4, 2)\n" \
        "opt = torch.optim.Adam(model.parameters())\nfor data in train_loader:\n    loss = model(data.x).sum()\n" \
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\ncorrect = 0\nwith torch.no_grad():\n" \
        "    for data in test_loader:\n        correct += int((model(data.x).argmax(1) == data.y).sum())\n" \
        "print(correct / len(test_loader.dataset))\n"
    done = plan(source)
    assert "ddpkit.data_loader(graphs, global_batch_size=8, shuffle=True, follow_batch=['x'], " \
        "loader_class=DataLoader)" in done.text, done.text
    assert "ddpkit.data_loader(graphs, batch_size=8, train=False, loader_class=DataLoader)" in done.text
    assert not [x.what for x in done.left if "imported from modules" in x.what]
