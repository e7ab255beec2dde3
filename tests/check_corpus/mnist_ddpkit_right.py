# Style: PyTorch's MNIST example converted with ddpkit, done right: the test sums reduced before dividing,
# ddpkit.print (rank 0 by construction), the save on rank 0 only. Nothing to report.
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.tensorboard import SummaryWriter
from torchvision import datasets, transforms

import ddpkit
from ddpkit import print  # rank 0 only: a plain-looking print that is right by construction


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(784, 128), nn.Linear(128, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x.flatten(1)))), dim=1)


def train(model, device, train_loader, optimizer, epoch, writer):
    model.train()
    for batch_idx, (data, target) in enumerate(ddpkit.progress(train_loader)):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % 10 == 0:
            mean_loss = ddpkit.reduce(loss.item(), "mean")
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}]\tLoss: {mean_loss:.6f}")
            writer.add_scalar("loss", mean_loss)


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
    test_loss = ddpkit.reduce(test_loss)  # every rank's sum: the whole test set
    correct = ddpkit.reduce(correct)
    test_loss /= len(test_loader.dataset)
    ddpkit.print("\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\n".format(
        test_loss, correct, len(test_loader.dataset),
        100. * correct / len(test_loader.dataset)))
    return correct / len(test_loader.dataset)


def evaluate_on_every_rank(model, test_set):
    """An unsharded plain DataLoader: each rank sees the whole test set, so its own count is the truth."""
    loader = torch.utils.data.DataLoader(test_set, batch_size=1000)
    hits = 0
    for data, target in loader:
        hits += (model(data).argmax(1) == target).sum().item()
    return hits / len(loader.dataset)


def main():
    state = ddpkit.init()
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    with ddpkit.main_process_first():  # rank 0 downloads, the others read its copy
        train_set = datasets.MNIST("../data", train=True, download=True, transform=transform)
    test_set = datasets.MNIST("../data", train=False, transform=transform)
    train_loader = ddpkit.data_loader(train_set, batch_size=64)
    test_loader = ddpkit.data_loader(test_set, batch_size=1000, train=False)
    model = ddpkit.prepare_model(Net())
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    writer = ddpkit.summary_writer("runs/mnist")
    for epoch in range(1, 15):
        train(model, state.device, train_loader, optimizer, epoch, writer)
        accuracy = test(model, state.device, test_loader)
        print("accuracy", accuracy, evaluate_on_every_rank(model, test_set))
    if state.is_main:
        torch.save(model.state_dict(), "mnist_cnn.pt")
        SummaryWriter("runs/final").add_text("done", "yes")


if __name__ == "__main__":
    main()
