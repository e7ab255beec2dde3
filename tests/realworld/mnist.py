"""MNIST-classifier shape: conv net, dropout, log_softmax + nll_loss, Adadelta + StepLR, train() / test()
functions taking (args, model, device, loader, ...), test-set loss and accuracy over the whole test set.

Converted by following the README: init, prepare_model, data_loader (train=False for the test set), the test
sums reduced across ranks, ddpkit.print, the save guarded. Synthetic 8x8 "digits" stand in for MNIST.

    python tests/realworld/mnist.py --epochs 1
    ddpkit launch --nproc-per-node 2 tests/realworld/mnist.py --epochs 1
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import TensorDataset

import ddpkit


def synthetic_digits(n: int, seed: int) -> TensorDataset:
    """n 1x8x8 images of 10 classes: a class-specific pattern plus noise (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(10, 1, 8, 8, generator=torch.Generator().manual_seed(1234))
    y = torch.randint(0, 10, (n,), generator=g)
    x = patterns[y] + 0.8 * torch.randn(n, 1, 8, 8, generator=g)
    return TensorDataset(x, y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(16 * 2 * 2, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout1(torch.flatten(x, 1))
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            ddpkit.print(f"Train Epoch: {epoch} [{batch_idx}/{len(train_loader)}]\tLoss: {loss.item():.6f}")


def test(model, device, test_loader):
    model.eval()
    test_loss, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
            seen += len(target)
    # Each rank saw its own part of the test set (train=False: no padded duplicates); sum them.
    test_loss, correct, seen = ddpkit.reduce(test_loss), ddpkit.reduce(correct), ddpkit.reduce(seen)
    ddpkit.print(f"Test set: Average loss: {test_loss / seen:.6f}, "
                 f"Accuracy: {correct}/{seen} ({100.0 * correct / seen:.2f}%)")
    return correct, seen


def main():
    parser = argparse.ArgumentParser(description="MNIST-shaped example")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--test-batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1.0)
    parser.add_argument("--gamma", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--save-model", default=None, help="path to save the trained weights to")
    args = parser.parse_args()

    state = ddpkit.init(seed=args.seed)
    device = state.device
    train_loader = ddpkit.data_loader(synthetic_digits(320, seed=0), batch_size=args.batch_size, seed=args.seed)
    test_loader = ddpkit.data_loader(synthetic_digits(101, seed=1), batch_size=args.test_batch_size, train=False)

    model = ddpkit.prepare_model(Net())
    optimizer = torch.optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, epoch)
        test(model, device, test_loader)
        scheduler.step()

    if args.save_model and state.is_main:
        torch.save(model.state_dict(), args.save_model)


if __name__ == "__main__":
    main()
