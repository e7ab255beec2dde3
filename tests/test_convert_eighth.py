"""What the eighth held-out set (docs/convert.md) found ``ddpkit convert`` owes public scripts' losses, each a case
that converted with nothing said before its fix: a mean over tokens (JointBERT's slot loss with an ``ignore_index``
read from its settings, GPT2-chitchat's labels padded with -100 handed to a Hugging Face model), and a summed loss
built as a criterion before the loop (vdsr's ``nn.MSELoss(size_average=False)`` under SGD)."""
import pytest

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

HEAD = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

dataset = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
loader = DataLoader(dataset, batch_size=8, shuffle=True)
model = nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""


def _listed(source: str, words: str) -> bool:
    return any(words in x.what for x in plan(source).left)


def test_a_mean_over_tokens_is_listed_with_count_and_a_literal_ignore_index_alone_is_not():
    slot = HEAD + "class Slots(nn.Module):\n    def __init__(self, args):\n        super().__init__()\n" \
        "        self.loss = nn.CrossEntropyLoss(ignore_index=args.ignore_index)\n" \
        "for x, y in loader:\n    loss = nn.functional.cross_entropy(model(x), y, ignore_index=args.pad_id)\n" \
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    assert _listed(slot, "a mean over the tokens it does not ignore")
    padded = HEAD + "labels = torch.full((8, 4), -100)\nfor x, y in loader:\n    out = model(x, labels=y)\n" \
        "    opt.zero_grad()\n    out.loss.backward()\n    opt.step()\n"
    assert _listed(padded, "a mean over the tokens it does not ignore")  # (no head named: what it counts unknown)
    mingpt = HEAD + "for x, y in loader:\n    loss = nn.functional.cross_entropy(model(x), y, ignore_index=-1)\n" \
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"  # (no label is ever -1 in chargpt)
    assert not _listed(mingpt, "a mean over the tokens")


def test_a_summed_criterion_built_before_the_loop_is_listed_under_sgd():
    vdsr = HEAD + "criterion = nn.MSELoss(size_average=False)\nfor x, y in loader:\n" \
        "    loss = criterion(model(x), nn.functional.one_hot(y, 2).float())\n" \
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    assert _listed(vdsr, "the training loss is a sum over the batch")
    assert _listed(vdsr.replace("size_average=False", "reduction='sum'"), "the training loss is a sum over the batch")
    assert not _listed(vdsr.replace("size_average=False", ""), "the training loss is a sum")


def test_a_contrastive_loss_gathers_its_negatives_with_lightly_and_is_listed_otherwise():
    """lightly's SimCLR example: NT-Xent over each rank's share trained another objective (a loss on another scale),
    with nothing said. lightly's losses gather the batch when told; another contrastive loss is listed; a model
    head named after the method (SimCLRProjectionHead, SimCLR) is no loss."""
    simclr = HEAD + "from lightly.loss import NTXentLoss\nfrom lightly.models.modules import SimCLRProjectionHead\n" \
        "head = SimCLRProjectionHead(8, 8, 4)\ncriterion = NTXentLoss(temperature=0.5)\nfor x, y in loader:\n" \
        "    loss = criterion(model(x), model(x + 0.1))\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    result = plan(simclr)
    assert "criterion = NTXentLoss(temperature=0.5, gather_distributed=True)" in result.text, result.text
    assert not result.left, result.left
    own = simclr.replace("from lightly.loss import NTXentLoss", "from losses import SupConLoss").replace(
        "NTXentLoss(temperature=0.5)", "SupConLoss(temperature=0.5)")
    assert _listed(own, "SupConLoss: a contrastive loss over the batch")


def test_two_loaders_a_builder_returns_as_a_tuple_are_each_their_own_line():
    """Eighth held-out set (UNET-ZOO): ``train_dl, val_dl = get_loaders(args)``, two DataLoader lines of the
    builder, and a validation function over ``val_dl``: refused as "the same DataLoader line as the training
    loader" (the tuple's element was not followed to its own line)."""
    source = HEAD.replace("loader = DataLoader(dataset, batch_size=8, shuffle=True)\n", "") + \
        "def get_loaders():\n    train_dl = DataLoader(dataset, batch_size=8)\n" \
        "    val_dl = DataLoader(dataset, batch_size=4)\n    return train_dl, val_dl\n\n\n" \
        "def validate(val_dl):\n    total = 0.0\n    with torch.no_grad():\n        for x, y in val_dl:\n" \
        "            total += (model(x).argmax(1) == y).float().sum().item()\n    return total / len(val_dl)\n\n\n" \
        "train_dl, val_dl = get_loaders()\nfor x, y in train_dl:\n" \
        "    loss = nn.functional.cross_entropy(model(x), y)\n    opt.zero_grad()\n    loss.backward()\n" \
        "    opt.step()\nprint(validate(val_dl))\n"
    result = plan(source)
    assert not result.refused, result.left
    assert "val_dl = ddpkit.data_loader(dataset, batch_size=4, train=False)" in result.text, result.text


def test_device_chains_of_the_eighth_set_convert():
    """pyg's ``if cuda: ... elif mps: torch.device('cpu') else: torch.device('cpu')`` and an experiment class's
    ``_acquire_device()`` (``torch.device("cuda:{}".format(args.gpu))`` / ``"cpu"``, returned into
    ``self.device``) were refused as "chosen over several lines"; its ``CUDA_VISIBLE_DEVICES`` goes, said."""
    body = "loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randn(64, 1)), batch_size=8, shuffle=True)\n"
    chain = "import torch\nfrom torch import nn\nfrom torch.utils.data import DataLoader, TensorDataset\n" \
        "if torch.cuda.is_available():\n    device = torch.device('cuda')\nelif torch.backends.mps.is_available():\n" \
        "    device = torch.device('cpu')\nelse:\n    device = torch.device('cpu')\n" + body + \
        "model = nn.Linear(8, 1).to(device)\nopt = torch.optim.Adam(model.parameters())\nfor x, y in loader:\n" \
        "    loss = (model(x.to(device)) - y.to(device)).pow(2).mean()\n    opt.zero_grad()\n    loss.backward()\n" \
        "    opt.step()\n"
    result = plan(chain)
    assert not result.refused and "state = ddpkit.init()\ndevice = state.device" in result.text, result.left
    exp = "import os\nimport torch\nfrom torch import nn\n" \
        "from torch.utils.data import DataLoader, TensorDataset\n\n\n" \
        "class Exp:\n    def __init__(self, args):\n        self.args = args\n" \
        "        self.device = self._acquire_device()\n\n    def _acquire_device(self):\n" \
        "        if self.args.use_gpu:\n            os.environ['CUDA_VISIBLE_DEVICES'] = str(self.args.gpu)\n" \
        "            device = torch.device('cuda:{}'.format(self.args.gpu))\n        else:\n" \
        "            device = torch.device('cpu')\n        return device\n\n    def train(self):\n        " + body + \
        "        model = nn.Linear(8, 1).to(self.device)\n        opt = torch.optim.Adam(model.parameters())\n" \
        "        for x, y in loader:\n            loss = (model(x) - y).pow(2).mean()\n            opt.zero_grad()\n" \
        "            loss.backward()\n            opt.step()\n"
    result = plan(exp)
    assert not result.refused and "state = ddpkit.init(cpu=not self.args.use_gpu)" in result.text, result.left
    # (removed since the eighteenth set, said: the launch chooses the GPUs, each rank its own)
    assert "CUDA_VISIBLE_DEVICES" not in result.text and not result.left, result.left
    assert [e.line for e in result.edits if "CUDA_VISIBLE_DEVICES" in e.what] == [14], result.edits


def test_a_model_saved_inside_a_dict_is_unwrapped_and_parameter_groups_from_its_methods_prepare_it():
    """vdsr saves ``{"epoch": e, "model": model}``: the pickled wrapper loaded only where a process group runs.
    deeplab's ``SGD([{"params": model.get_1x_lr_params()}, {"params": model.get_10x_lr_params(), ...}])``
    prepared no model, with nothing said (the launch stopped at the first step)."""
    saved = HEAD + "for x, y in loader:\n    loss = nn.functional.cross_entropy(model(x), y)\n    opt.zero_grad()\n" \
        "    loss.backward()\n    opt.step()\nstate = {'epoch': 1, 'model': model}\ntorch.save(state, 'ckpt.pth')\n"
    assert "state = {'epoch': 1, 'model': ddpkit.unwrap(model)}" in plan(saved).text
    groups = HEAD.replace("opt = torch.optim.SGD(model.parameters(), lr=0.1)",
                          "opt = torch.optim.SGD([{'params': model.get_1x_lr_params()}, "
                          "{'params': model.get_10x_lr_params(), 'lr': 1.0}], lr=0.1)") + \
        "for x, y in loader:\n    loss = nn.functional.cross_entropy(model(x), y)\n    opt.zero_grad()\n" \
        "    loss.backward()\n    opt.step()\n"
    assert "model = ddpkit.prepare_model(nn.Linear(8, 2))" in plan(groups).text


def test_a_sync_batchnorm_vendored_for_data_parallel_is_not_distribution_by_hand():
    """deeplab-xception ships a BatchNorm synchronised over nn.DataParallel's replicas (torch.nn.parallel's
    ``_functions.ReduceAddCoalesced``): refused as "already distributed by hand". One process runs them."""
    source = HEAD + "from torch.nn.parallel._functions import ReduceAddCoalesced, Broadcast\n\n\n" \
        "class DPSyncBN(nn.BatchNorm1d):\n    def _sum(self, tensors, devices):\n" \
        "        return Broadcast.apply(devices, *ReduceAddCoalesced.apply(devices[0], 2, *tensors))\n\n\n" \
        "for x, y in loader:\n    loss = nn.functional.cross_entropy(model(x), y)\n    opt.zero_grad()\n" \
        "    loss.backward()\n    opt.step()\n"
    result = plan(source)
    assert not result.refused and "model = ddpkit.prepare_model(nn.Linear(8, 2))" in result.text, result.left
    assert plan(source.replace("_functions import ReduceAddCoalesced, Broadcast",
                               "_functions import ReduceAddCoalesced, Broadcast\nimport torch.distributed as dist\n"
                               "dist.init_process_group('gloo')")).refused  # by hand, still


def test_an_evaluations_summed_loss_and_a_statistics_loader_are_not_a_training_matter():
    """davda54/sam (eighth set): ``mse_loss(..., reduction="sum")`` in the evaluation loop under no_grad, inside
    the epoch loop, was listed as a summed training loss; the data class's mean over ``[d[0] for d in
    DataLoader(raw)]`` was refused as "a DataLoader built inside an expression"."""
    source = HEAD + "mean = torch.cat([d[0] for d in DataLoader(dataset)]).mean(0)\nfor epoch in range(2):\n" \
        "    for x, y in loader:\n        loss = nn.functional.cross_entropy(model(x - mean), y)\n" \
        "        opt.zero_grad()\n        loss.backward()\n        opt.step()\n    total = 0.0\n" \
        "    with torch.no_grad():\n        for x, y in loader:\n" \
        "            total += nn.functional.cross_entropy(model(x), y, reduction='sum').item()\n    print(total)\n"
    result = plan(source)
    assert not result.refused and not any("a sum over the batch" in x.what for x in result.left), result.left
    assert "mean = torch.cat([d[0] for d in DataLoader(dataset)]).mean(0)" in result.text


def test_second_review_no_token_or_contrastive_listing_for_a_slice_or_a_margin_loss():
    """A ``losses[-100:]`` in a log line made a 2-class classifier's loss "a mean over tokens"; a Siamese network's
    ``ContrastiveLoss`` (a margin over given pairs) was listed as one that needs the batch gathered."""
    base = HEAD + "losses = []\nfor x, y in loader:\n    loss = criterion(model(x), y)\n    opt.zero_grad()\n" \
        "    loss.backward()\n    opt.step()\n    losses.append(loss.item())\nprint(sum(losses[-100:]))\n"
    assert not plan(base.replace("losses = []", "criterion = nn.CrossEntropyLoss()\nlosses = []")).left
    margin = base.replace("losses = []", "from siamese import ContrastiveLoss\ncriterion = ContrastiveLoss(2.0)\n"
                                         "losses = []")
    assert not any("contrastive" in x.what for x in plan(margin).left), plan(margin).left


RESUMED = '''
import argparse
import os
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--resume", default="")
opt = parser.parse_args()

def main():
    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16, shuffle=True)
    model = nn.Linear(4, 1)
    if opt.cuda:
        model = model.cuda()
    if opt.resume:
        weights = torch.load(opt.resume, weights_only=False)
        model.load_state_dict(weights["model"].state_dict())
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(1, 3):
        train(loader, sgd, model)
        save_checkpoint(model, epoch)

def train(loader, sgd, model):
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        sgd.zero_grad()
        loss.backward()
        sgd.step()

def save_checkpoint(model, epoch):
    state = {"epoch": epoch, "model": model}
    torch.save(state, "checkpoint/model_epoch_{}.pth".format(epoch))

if __name__ == "__main__":
    main()
'''


def test_a_resume_read_before_the_loop_is_no_race_and_a_dict_saved_by_a_helper_holds_the_plain_model():
    """vdsr after the eighth set's fixes: ``main()`` reads ``--resume`` once, then its loop calls
    ``save_checkpoint(model, epoch)``, which saves ``{"epoch", "model": model}``: the read was said to race the
    save, and the dict kept the wrapper (the parameter was not followed to its call site)."""
    done = plan(RESUMED)
    assert 'state = {"epoch": epoch, "model": ddpkit.unwrap(model)}' in done.text
    assert not [x.what for x in done.left if "is read at line" in x.what]
    again = plan(RESUMED.replace("    for epoch in range(1, 3):\n        train(",  # a read in the loop: said
                                 "    for epoch in range(1, 3):\n        torch.load('checkpoint/model_epoch_1.pth')\n"
                                 "        train("))
    # (main() runs under ``if __name__ == "__main__":``, which every rank passes: the save is waited for)
    assert not again.left and "        torch.save(state, \"checkpoint/model_epoch_{}.pth\".format(epoch))\n" \
        "    ddpkit.barrier()\n" in again.text, again.text


def test_a_pretrained_read_at_start_up_is_no_race_and_a_read_below_is_named():
    """GPT2-chitchat reads ``--pretrained_model`` in ``main()`` before it calls ``train()``, whose epochs
    ``save_pretrained``: no race. JointBERT's trainer reads its base model in ``__init__`` and the saved one in
    ``load_model``: the line said is ``load_model``'s."""
    chitchat = HEAD + "from transformers import GPT2LMHeadModel\n" \
        "def train(model):\n    for x, y in loader:\n        loss = model(x, labels=y).loss\n" \
        "        opt.zero_grad()\n        loss.backward()\n        opt.step()\n    model.save_pretrained('out')\n" \
        "def main():\n    if args.pretrained_model:\n" \
        "        model = GPT2LMHeadModel.from_pretrained(args.pretrained_model)\n" \
        "    train(model)\nmain()\n"
    assert not [x.what for x in plan(chitchat).left if "from_pretrained reads" in x.what]
    joint = HEAD + "from transformers import BertModel\nclass Trainer:\n    def __init__(self):\n" \
        "        self.model = BertModel.from_pretrained('bert-base')\n        self.opt = torch.optim.SGD(" \
        "self.model.parameters(), lr=0.1)\n    def train(self):\n        for epoch in range(2):\n" \
        "            for x, y in loader:\n                loss = self.model(x, labels=y).loss\n" \
        "                self.opt.zero_grad()\n                loss.backward()\n                self.opt.step()\n" \
        "            self.model.save_pretrained('out')\n    def load_model(self):\n" \
        "        self.model = BertModel.from_pretrained('out')\nt = Trainer()\nt.train()\nt.load_model()\n"
    said = [x.what for x in plan(joint).left if "from_pretrained reads" in x.what]
    assert said and "reads at line 24" in said[0], said


def test_a_token_mean_over_labels_the_loop_names_tells_the_loader_what_to_count():
    """GPT2-chitchat's ``for i, (input_ids, labels) in enumerate(loader)`` with ``model(input_ids, labels=labels)``,
    a Hugging Face loop's ``model(**batch)``, a label moved to the device in the loop, and ``cross_entropy`` with
    ``ignore_index=-100``: the training loader gets ``batch_count=`` and nothing is listed; the loss inside the
    model's module with an ``ignore_index`` from a setting stays listed, with the batch_count fix."""
    loop = "for i, (ids, labels) in enumerate(loader):\n    out = model.forward(ids, labels=labels)\n" \
        "    opt.zero_grad()\n    out.loss.backward()\n    opt.step()\nlabels[labels == 0] = -100\n"
    chitchat = plan(HEAD + "from transformers import GPT2LMHeadModel\n" + loop)  # (a causal LM drops 1 a sample)
    assert "shuffle=True, batch_count=lambda batch: (batch[1][..., 1:] != -100).sum())" in chitchat.text, \
        chitchat.text
    assert not [x for x in chitchat.left if "tokens" in x.what]
    hf = HEAD.replace("TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))", "[{'labels': -100}] * 8") + \
        "head = AutoModelForTokenClassification\n" + \
        "for batch in loader:\n    batch = {k: v.to('cpu') for k, v in batch.items()}\n    out = model(**batch)\n" \
        "    out.loss.backward()\n    opt.step()\n"
    assert 'batch_count=lambda batch: (batch["labels"] != -100).sum()' in plan(hf).text
    moved = HEAD + "for batch in loader:\n    y = batch[1].to('cpu')\n    logits = model(batch[0])\n" \
        "    loss = nn.functional.cross_entropy(logits.view(-1, 2), y.view(-1), ignore_index=-100)\n" \
        "    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    assert "batch_count=lambda batch: (batch[1] != -100).sum()" in plan(moved).text
    inside = HEAD + "class Slots(nn.Module):\n    def __init__(self, args):\n        super().__init__()\n" \
        "        self.loss = nn.CrossEntropyLoss(ignore_index=args.ignore_index)\n" \
        "for x, y in loader:\n    loss = model(x, y)\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    said = [x.fix for x in plan(inside).left if "a mean over the tokens" in x.what]
    assert said and "batch_count=lambda batch:" in said[0] and "batch_count" not in plan(inside).text


def test_review_token_counts_that_would_be_wrong_are_listed_not_written():
    """Review: labels masked in the loop were counted raw; a sample-mean loss added to the token mean was weighed
    by tokens; a batch rebound to a dict of another shape crashed the count; a second training loop was passed
    over; an evaluation's loss above the training loop was listed in its place."""
    def loop(body, head=HEAD):
        return head + "for ids, labels in loader:\n" + body + "    opt.zero_grad()\n    loss.backward()\n" \
            "    opt.step()\n"

    ce = "    loss = nn.functional.cross_entropy(model(ids), labels, ignore_index=-100)\n"
    masked = plan(loop("    labels = labels.clone()\n    labels[labels == 0] = -100\n" + ce))
    assert "batch_count" not in masked.text and [x for x in masked.left if "tokens" in x.what]
    mixed = plan(loop(ce.replace("loss =", "slot =") + "    loss = slot + nn.functional.mse_loss(model(ids), ids)\n"))
    assert "batch_count" not in mixed.text and [x for x in mixed.left if "tokens" in x.what]
    rebound = plan(HEAD + "head = AutoModelForCausalLM\nfor batch in loader:\n"
                   "    batch = dict(zip(['input_ids', 'labels'], batch))\n    loss = model(**batch).loss\n"
                   "    loss.backward()\n    opt.step()\nx = -100\n")
    assert "batch_count" not in rebound.text and [x for x in rebound.left if "tokens" in x.what]
    two = plan(loop(ce) + "loader2 = DataLoader(dataset, batch_size=8, shuffle=True)\nfor a, b in loader2:\n"
               "    loss = nn.functional.cross_entropy(model(a), b, ignore_index=-100)\n    loss.backward()\n"
               "    opt.step()\n")
    assert two.text.count("batch_count=lambda batch: (batch[1] != -100).sum()") == 2, two.text
    evaluated = HEAD + "def evaluate():\n    with torch.no_grad():\n        for a, b in loader:\n" \
        "            e = nn.functional.cross_entropy(model(a), b, ignore_index=-100)\n" + \
        loop(ce, head="").replace("for ids", "for ids", 1)
    done = plan(evaluated)
    assert "batch_count=lambda batch: (batch[1] != -100).sum()" in done.text and not done.left, done.left
