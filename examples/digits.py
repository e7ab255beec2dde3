"""Train a small CNN with BatchNorm on scikit-learn's 8x8 digits; the last line printed is accuracy=<value>.

    python examples/digits.py                                   # one process
    ddpkit launch --nproc-per-node 2 examples/digits.py         # two DDP processes
"""
import argparse

import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def datasets(seed: int):
    """1797 images, a fixed 80/20 split (identical on every rank)."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    return TensorDataset(x[order[:cut]], y[order[:cut]]), TensorDataset(x[order[cut:]], y[order[cut:]])


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logdir", default="runs/digits")
    args = parser.parse_args()

    state = ddpkit.init(seed=args.seed)  # per-rank RNG streams; DDP copies rank 0's initial weights
    train_set, test_set = datasets(args.seed)
    model = ddpkit.prepare_model(make_model())
    loader = ddpkit.data_loader(train_set, batch_size=args.batch_size, seed=args.seed)
    test_loader = ddpkit.data_loader(test_set, batch_size=256, train=False)  # no padded duplicates
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    writer = ddpkit.summary_writer(args.logdir)
    loss_fn = nn.CrossEntropyLoss()

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in ddpkit.progress(loader, desc=f"epoch {epoch}", leave=False):
            x, y = x.to(state.device), y.to(state.device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            writer.add_scalar("train/loss", loss.item(), step)
            step += 1

    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in test_loader:
            correct += (model(x.to(state.device)).argmax(1).cpu() == y).sum().item()
    accuracy = ddpkit.reduce(correct) / len(test_set)  # every held-out sample counted exactly once
    writer.add_scalar("test/accuracy", accuracy, step)
    writer.close()
    ddpkit.print(f"accuracy={accuracy:.4f}")


if __name__ == "__main__":
    main()
