"""What the thirteenth held-out set's scripts and their neighbours showed ``ddpkit convert`` owes public scripts
(docs/convert.md): each a case written in our own words after the pattern met."""
import pytest
from test_convert_twelfth import prints_as_one_process

pytest.importorskip("libcst")

from ddpkit.commands.convert.plan import plan  # noqa: E402

SAMPLER_LENS = '''import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset
from torch.utils.data.sampler import SubsetRandomSampler

train_on_gpu = torch.cuda.is_available()
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
train_data = TensorDataset(torch.randn(80, 6, generator=g), torch.randint(0, 3, (80,), generator=g))
test_data = TensorDataset(torch.randn(20, 6, generator=g), torch.randint(0, 3, (20,), generator=g))
num_train = len(train_data)
indices = list(range(num_train))
np.random.seed(0)
np.random.shuffle(indices)
split = int(np.floor(0.2 * num_train))
train_idx, valid_idx = indices[split:], indices[:split]
train_sampler = SubsetRandomSampler(train_idx)
valid_sampler = SubsetRandomSampler(valid_idx)
train_loader = torch.utils.data.DataLoader(train_data, batch_size=8, sampler=train_sampler)
valid_loader = torch.utils.data.DataLoader(train_data, batch_size=8, sampler=valid_sampler)
test_loader = torch.utils.data.DataLoader(test_data, batch_size=8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 3)
    def forward(self, x):
        return self.fc1(x)

model = Net()
if train_on_gpu:
    model.cuda()
criterion = nn.CrossEntropyLoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
valid_loss_min = np.inf
for epoch in range(1, 3):
    train_loss = 0.0
    valid_loss = 0.0
    model.train()
    for data, target in train_loader:
        if train_on_gpu:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        train_loss += loss.item()*data.size(0)
    model.eval()
    for data, target in valid_loader:
        if train_on_gpu:
            data, target = data.cuda(), target.cuda()
        output = model(data)
        loss = criterion(output, target)
        valid_loss += loss.item()*data.size(0)
    train_loss = train_loss/len(train_loader.sampler)
    valid_loss = valid_loss/len(valid_loader.sampler)
    print('Epoch: {} \tTraining Loss: {:.6f} \tValidation Loss: {:.6f}'.format(epoch, train_loss, valid_loss))
    if valid_loss <= valid_loss_min:
        print('Validation loss decreased ({:.6f} --> {:.6f}).  Saving model ...'.format(valid_loss_min, valid_loss))
        torch.save(model.state_dict(), 'model_cifar.pt')
        valid_loss_min = valid_loss
model.load_state_dict(torch.load('model_cifar.pt'))
test_loss = 0.0
class_correct = list(0. for i in range(3))
class_total = list(0. for i in range(3))
model.eval()
for data, target in test_loader:
    output = model(data)
    loss = criterion(output, target)
    test_loss += loss.item()*data.size(0)
    _, pred = torch.max(output, 1)
    correct = np.squeeze(pred.eq(target.data.view_as(pred)))
    for i in range(target.size(0)):
        label = target.data[i]
        class_correct[label] += correct[i].item()
        class_total[label] += 1
test_loss = test_loss/len(test_loader.dataset)
print('Test Loss: {:.6f}\\n'.format(test_loss))
right, seen = np.sum(class_correct), np.sum(class_total)
print('Test Accuracy (Overall): %2d%% (%2d/%2d)' % (100. * right / seen, right, seen))
'''


def test_sums_over_the_samplers_length_are_every_ranks_and_a_per_class_tally_keeps_its_loader_whole(tmp_path):
    """Udacity's lessons: ``train_loss / len(train_loader.sampler)`` over a ``SubsetRandomSampler``: once sharded,
    the sampler is this rank's (the validation loss printed 2x at 2 processes, the training loss rank 0's); the test
    loop's ``class_correct[label] += ...`` keeps the test loader whole, which is right: said as kept, exit 0."""
    p = plan(SAMPLER_LENS)
    assert not p.left, p.left
    assert "train_loss = train_loss/ddpkit.reduce(len(train_loader.sampler))" in p.text
    assert "valid_loss = valid_loss/ddpkit.reduce(len(valid_loader.sampler))" in p.text
    assert any("class_correct[label]" in k.what for k in p.kept), p.kept
    prints_as_one_process(tmp_path, SAMPLER_LENS, p.text)
