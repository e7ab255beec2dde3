"""What the third review of ``ddpkit convert`` found in the fixes of the first two, each a case that converted
silently wrong (or hung) before its fix; in process, on small scripts in the shapes the reviewer used."""
import pytest

pytest.importorskip("libcst")

from test_convert_rules import TRAIN_EVAL, convert, lines  # noqa: E402

EVAL_EPOCHS = """
model = nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train_ds = make(64)
train_loader = DataLoader(train_ds, batch_size=8, shuffle=True)
val_loader = DataLoader(make(17), batch_size=8)
val_loss = 0.0
for epoch in range(2):
    total = 0.0
    for x, y in train_loader:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        total += loss.item() * len(x)
    print(total / len(train_ds))
    with torch.no_grad():
        for x, y in val_loader:
            val_loss += ((model(x) - y) ** 2).sum().item()
    print(val_loss / 17)
    val_loss = 0.0
"""


def test_a_sum_restarted_at_the_end_of_each_epoch_is_reduced_after_the_inner_loop():
    text = convert(EVAL_EPOCHS).text
    at = text.index("val_loss = ddpkit.reduce(val_loss)")
    assert text.index("val_loss += ") < at < text.index("print(val_loss / 17)")


def test_a_training_sum_over_the_loaders_own_dataset_is_reduced():
    assert "    total = ddpkit.reduce(total)" in convert(EVAL_EPOCHS).text


@pytest.mark.parametrize("change", [
    ("            val_loss += ", "            if i >= 2:\n                break\n            val_loss += "),
    ("    print(val_loss / 17)", "    n_batches = i + 1\n    print(val_loss / n_batches)"),
])
def test_an_evaluation_that_stops_early_or_divides_by_its_own_count_stays_plain(change):
    source = EVAL_EPOCHS.replace("        for x, y in val_loader:", "        for i, (x, y) in enumerate(val_loader):")
    result = convert(source.replace(*change))
    assert "val_loader = DataLoader(make(17), batch_size=8)" in lines(result) and not result.refused


def test_a_barrier_is_not_put_in_a_save_helper_called_from_a_branch():
    result = convert("def save(m):\n    torch.save(m.state_dict(), 'c.pt')\n" + TRAIN_EVAL +
                     "if best:\n    save(model)\nmodel.load_state_dict(torch.load('c.pt'))\n")
    # (not in the helper, which runs under the if: before the read, which every rank reaches, set 25's c/s06)
    assert "    ddpkit.barrier()" not in result.text and not result.left, result.left
    assert "save(model)\nddpkit.barrier()\nmodel.load_state_dict(" in result.text, result.text


def test_an_evaluation_that_needs_gradients_is_not_put_under_no_grad():
    source = TRAIN_EVAL.replace("    with torch.no_grad():\n        for x, y in loader:\n",
                                "    if True:\n        for x, y in loader:\n            x.requires_grad_()\n")
    result = convert(source)
    assert "torch.no_grad():\n            for x, y in loader" not in result.text
    assert "val_loader = DataLoader(val_set, batch_size=8)" in lines(result)


def test_a_cpu_device_for_outputs_is_no_device_setup():
    result = convert(TRAIN_EVAL + "cpu_device = torch.device('cpu')\n")
    assert "cpu_device = torch.device('cpu')" in lines(result) and "ddpkit.init(cpu=True)" not in result.text


def test_a_three_way_device_with_cpu_first_and_an_unread_device_the_model_moves_to():
    text = lines(convert("device = 'cpu' if args.cpu else 'cuda' if torch.cuda.is_available() else 'mps'\n"
                         + TRAIN_EVAL.replace("model = nn.Linear(4, 2)", "model = nn.Linear(4, 2).to(device)")))
    assert "state = ddpkit.init(cpu=args.cpu)" in text
    result = convert("device = pick_device()\n" + TRAIN_EVAL.replace("model = nn.Linear(4, 2)",
                                                                     "model = nn.Linear(4, 2).to(device)"))
    assert result.refused and any("form convert does not read" in x.what for x in result.left)


def test_an_explicit_none_sampler_keeps_torchs_order():
    text = lines(convert(TRAIN_EVAL.replace("DataLoader(train_set, batch_size=8, shuffle=True)",
                                            "DataLoader(train_set, 8, None, None, None, 0)")))
    assert "train_loader = ddpkit.data_loader(train_set, global_batch_size=8, shuffle=False, sampler=None, " \
           "batch_sampler=None, num_workers=0)" in text
    text = lines(convert(TRAIN_EVAL.replace("shuffle=True)", "sampler=None)", 1)))
    assert "train_loader = ddpkit.data_loader(train_set, global_batch_size=8, sampler=None, shuffle=False)" in text


def test_a_peek_at_the_first_batch_neither_blocks_the_sums_nor_gets_no_grad():
    source = TRAIN_EVAL.replace("for epoch in range(3):", "for x, y in val_loader:\n    print(x.shape)\n    break\n"
                                "for epoch in range(3):")
    result = convert(source)
    assert "correct = ddpkit.reduce(correct)" in result.text and "for x, y in val_loader:\n    ddpkit.print" in \
        result.text
