# Style: PyTorch's MNIST example converted by following ddpkit's quickstart, with the three classic slips of a
# first conversion: test-set sums never reduced, a plain print of per-rank values, a save on every rank.
import torch
import torch.nn.functional as F
from torch import nn
from torchvision import datasets, transforms

import ddpkit


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 128), nn.Linear(128, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


def train(model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(ddpkit.progress(train_loader)):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % 10 == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}]\tLoss: {loss.item():.6f}")  # expect: DDP017


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)  # expect: DDP018
    print("\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n".format(  # expect: DDP017
        test_loss, correct, len(test_loader.dataset),
        100. * correct / len(test_loader.dataset)))  # expect: DDP018


def main():
    state = ddpkit.init()
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_set = datasets.MNIST("../data", train=True, download=True, transform=transform)
    test_set = datasets.MNIST("../data", train=False, transform=transform)
    train_loader = ddpkit.data_loader(train_set, batch_size=64)
    test_loader = ddpkit.data_loader(test_set, batch_size=1000, train=False)
    model = ddpkit.prepare_model(Net())
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    for epoch in range(1, 15):
        train(model, state.device, train_loader, optimizer, epoch)
        test(model, state.device, test_loader)
    torch.save(model.state_dict(), "mnist_cnn.pt")  # expect: DDP007


if __name__ == "__main__":
    main()
