"""VAE shape: fc encoder to (mu, logvar), the reparameterisation trick with ``torch.randn_like``, a decoder
reached as ``model.decode(z)`` to draw samples from the prior after each epoch, a summed BCE + KL loss
(``reduction='sum'``), Adam, and "Average loss" lines divided by ``len(loader.dataset)``.

Converted by following the README; the sums are reduced across ranks before dividing. Synthetic 8x8 images
in [0, 1] stand in for MNIST; the prior samples are saved with ``torch.save`` by rank 0 (``--samples``).

    python tests/realworld/vae.py --epochs 1
    ddpkit launch --nproc-per-node 2 tests/realworld/vae.py --epochs 1
"""
import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def synthetic_images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    blobs = torch.rand(4, 64, generator=torch.Generator().manual_seed(99))
    which = torch.randint(0, 4, (n,), generator=g)
    x = (blobs[which] + 0.2 * torch.rand(n, 64, generator=g)).clamp(0, 1)
    return TensorDataset(x, which)


class VAE(nn.Module):
    def __init__(self, latent=4):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc21 = nn.Linear(32, latent)
        self.fc22 = nn.Linear(32, latent)
        self.fc3 = nn.Linear(latent, 32)
        self.fc4 = nn.Linear(32, 64)
        self.latent = latent

    def encode(self, x):
        h1 = F.relu(self.fc1(x))
        return self.fc21(h1), self.fc22(h1)

    def reparameterize(self, mu, logvar):
        if not self.training:  # evaluation uses the mean: a test loss that is a number, not a draw
            return mu
        std = torch.exp(0.5 * logvar)
        return mu + torch.randn_like(std) * std

    def decode(self, z):
        return torch.sigmoid(self.fc4(F.relu(self.fc3(z))))

    def forward(self, x):
        mu, logvar = self.encode(x.view(-1, 64))
        return self.decode(self.reparameterize(mu, logvar)), mu, logvar


def loss_function(recon_x, x, mu, logvar):
    bce = F.binary_cross_entropy(recon_x, x.view(-1, 64), reduction="sum")
    kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp())
    return bce + kld


def train(model, optimizer, loader, device, epoch):
    model.train()
    train_loss = 0.0
    for data, _ in loader:
        data = data.to(device)
        optimizer.zero_grad()
        recon, mu, logvar = model(data)
        loss = loss_function(recon, data, mu, logvar)
        loss.backward()
        train_loss += loss.item()
        optimizer.step()
    # the training sums of every rank over every sample seen (the padded tail counted as trained)
    ddpkit.print(f"====> Epoch: {epoch} Average loss: {ddpkit.reduce(train_loss) / len(loader.dataset):.4f}")


def test(model, loader, device, epoch):
    model.eval()
    test_loss = 0.0
    with torch.no_grad():
        for data, _ in loader:
            data = data.to(device)
            recon, mu, logvar = model(data)
            test_loss += loss_function(recon, data, mu, logvar).item()
    test_loss = ddpkit.reduce(test_loss) / len(loader.dataset)  # train=False: each sample on one rank
    ddpkit.print(f"====> Test set loss: {test_loss:.6f}")
    return test_loss


def main():
    parser = argparse.ArgumentParser(description="VAE-shaped example")
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--samples", default=None, help="file for rank 0's prior samples")
    args = parser.parse_args()

    state = ddpkit.init(seed=args.seed)
    train_loader = ddpkit.data_loader(synthetic_images(256, seed=0), batch_size=args.batch_size, seed=args.seed)
    test_loader = ddpkit.data_loader(synthetic_images(77, seed=1), batch_size=32, train=False)
    model = ddpkit.prepare_model(VAE())
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    for epoch in range(1, args.epochs + 1):
        train(model, optimizer, train_loader, state.device, epoch)
        test(model, test_loader, state.device, epoch)
        with torch.no_grad():
            sample = model.decode(torch.randn(16, model.latent, device=state.device)).cpu()
        if args.samples and state.is_main:
            torch.save(sample.view(16, 1, 8, 8), args.samples)


if __name__ == "__main__":
    main()
