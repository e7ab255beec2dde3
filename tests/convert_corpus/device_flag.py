#!/usr/bin/env python
"""Fit a small MLP regressor to a tabular dataset.

usage: python device_flag.py --device cpu --epochs 20 --out regressor.pt
"""
import argparse
import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

logger = logging.getLogger(__name__)


class TabularDataset(Dataset):
    """Synthetic tabular data: 12 numeric features, a non-linear target with noise."""

    def __init__(self, n_rows, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n_rows, 12, generator=g)
        w = torch.linspace(-1.0, 1.0, 12)
        signal = self.x @ w + 0.5 * torch.sin(3 * self.x[:, 0]) * self.x[:, 1]
        self.y = (signal + 0.1 * torch.randn(n_rows, generator=g)).unsqueeze(1)

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, idx):
        return self.x[idx], self.y[idx]


class Regressor(nn.Module):
    def __init__(self, in_features, hidden=64, dropout=0.1):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 1),
        )

    def forward(self, x):
        return self.net(x)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--device', default='cpu', help='torch device, e.g. cpu, cuda, cuda:1')
    parser.add_argument('--epochs', type=int, default=20)
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--lr', type=float, default=1e-3)
    parser.add_argument('--seed', type=int, default=42)
    parser.add_argument('--out', default='regressor.pt', help='where to save the trained weights')
    return parser.parse_args()


def evaluate(model, loader, device):
    model.eval()
    se_sum = 0.0
    n = 0
    with torch.no_grad():
        for x, y in loader:
            x = x.to(device)
            y = y.to(device)
            pred = model(x)
            se_sum += ((pred - y) ** 2).sum().item()
            n += y.numel()
    return se_sum / n


def main():
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(levelname)s %(name)s: %(message)s')

    torch.manual_seed(args.seed)
    device = torch.device(args.device)

    train_ds = TabularDataset(800, seed=0)
    val_ds = TabularDataset(200, seed=1)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True)
    val_loader = DataLoader(val_ds, batch_size=128, shuffle=False)

    model = Regressor(in_features=12)
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.MSELoss()

    logger.info('training on %s: %d train rows, %d val rows', device, len(train_ds), len(val_ds))
    for epoch in range(args.epochs):
        model.train()
        epoch_loss = 0.0
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.item() * x.size(0)
        train_mse = epoch_loss / len(train_loader.dataset)
        val_mse = evaluate(model, val_loader, device)
        logger.info('epoch %d: train mse %.4f, val mse %.4f', epoch + 1, train_mse, val_mse)

    torch.save(model.state_dict(), args.out)
    logger.info('saved model to %s', args.out)


if __name__ == '__main__':
    main()
