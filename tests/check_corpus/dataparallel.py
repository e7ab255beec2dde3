# Style: one process, DataParallel when several GPUs are visible.
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda:0")  # expect: DDP004
model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))
if torch.cuda.device_count() > 1:
    model = nn.DataParallel(model)  # expect: DDP011
model = model.to(device)
loader = DataLoader(TensorDataset(torch.randn(512, 20), torch.randint(0, 2, (512,))), batch_size=64, shuffle=True)
opt = torch.optim.Adam(model.parameters())
for epoch in range(3):
    for x, y in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
torch.save(model.state_dict(), "dp.pt")
