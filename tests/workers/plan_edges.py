"""Scripts ``ddpkit plan`` first mis-planned (tests/test_plan.py): ``plan_edges.py accumulate|gan|wgan|probe``.

- ``accumulate``: a frozen backbone (``requires_grad=False``), the dataset made after ``prepare_model`` (every rank
  holds it whole), a ``global_batch_size``, four micro-steps of ``ddpkit.accumulate`` (four forwards per step).
- ``gan``: two models and two optimizers; the discriminator runs twice before its step, the generator's step
  (the bigger one) comes second.
- ``wgan``: the critic steps 3 times per generator step; a no_grad shape check runs before training, and the
  "real" data (32 MB, every rank holds it) is made after it.
- ``probe``: a linear probe whose backbone keeps ``requires_grad``: no optimizer zeroes its gradients, so each
  later backward makes them anew beside the old ones.
"""
import sys

import torch
from torch import nn

import ddpkit

torch.set_num_threads(1)
state = ddpkit.init(seed=0)
W = 256
if sys.argv[1] == "accumulate":
    model = nn.Sequential(*[nn.Sequential(nn.Linear(W, W), nn.ReLU()) for _ in range(6)], nn.Linear(W, 8))
    for p in model[:3].parameters():
        p.requires_grad_(False)
    model = ddpkit.prepare_model(model, shard=[nn.Linear])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(1)  # the same data on every rank (init(seed=0) seeds each rank apart)
    data = torch.utils.data.TensorDataset(torch.randn(4096, W, generator=g), torch.randint(0, 8, (4096,), generator=g))
    loader = ddpkit.data_loader(data, global_batch_size=384, seed=0)
    for i, (x, y) in enumerate(loader):
        for k, (xs, ys) in enumerate(zip(x.chunk(4), y.chunk(4))):
            with ddpkit.accumulate(model, k, 4):
                (nn.functional.cross_entropy(model(xs), ys) / 4).backward()
        opt.step()
        opt.zero_grad()
        ddpkit.print(f"step {i}")
        if i == 3:
            break
elif sys.argv[1] == "probe":
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(W, 4 * W), nn.ReLU(), nn.Linear(4 * W, W), nn.ReLU(),
                                               nn.Linear(W, 10)), shard=[nn.Linear])
    opt = torch.optim.Adam(ddpkit.unwrap(model)[4].parameters(), lr=1e-3)  # the head alone
    x, y = torch.randn(64, W), torch.randint(0, 10, (64,))
    for step in range(4):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ddpkit.print(f"step {step} {loss.item():.3f}")
elif sys.argv[1] == "wgan":
    gen = ddpkit.prepare_model(nn.Sequential(nn.Linear(32, 4 * W), nn.ReLU(), nn.Linear(4 * W, 4 * W), nn.ReLU(),
                                             nn.Linear(4 * W, W)), shard=[nn.Linear])
    critic = ddpkit.prepare_model(nn.Sequential(nn.Linear(W, 64), nn.ReLU(), nn.Linear(64, 1)), shard=[nn.Linear])
    with torch.no_grad():
        assert critic(gen(torch.randn(2, 32))).shape == (2, 1)
    real = torch.randn(32768, W)
    og, oc = torch.optim.Adam(gen.parameters(), lr=1e-4), torch.optim.Adam(critic.parameters(), lr=1e-4)
    for step in range(3):
        for _ in range(3):
            batch = real[torch.randint(0, len(real), (128,))]
            lc = critic(gen(torch.randn(128, 32)).detach()).mean() - critic(batch).mean()
            oc.zero_grad()
            lc.backward()
            oc.step()
        lg = -critic(gen(torch.randn(128, 32))).mean()
        og.zero_grad()
        lg.backward()
        og.step()
        ddpkit.print(f"step {step} {lc.item():.3f} {lg.item():.3f}")
else:
    gen = ddpkit.prepare_model(nn.Sequential(nn.Linear(32, W), nn.ReLU(), nn.Linear(W, 4 * W), nn.ReLU(),
                                             nn.Linear(4 * W, W)), shard=[nn.Linear])
    disc = ddpkit.prepare_model(nn.Sequential(nn.Linear(W, 64), nn.ReLU(), nn.Linear(64, 1)), shard=[nn.Linear])
    og, od = torch.optim.Adam(gen.parameters(), lr=1e-4), torch.optim.Adam(disc.parameters(), lr=1e-4)
    real = torch.randn(128, W)
    for step in range(4):
        fake = gen(torch.randn(128, 32))
        ld = nn.functional.softplus(disc(fake.detach())).mean() + nn.functional.softplus(-disc(real)).mean()
        od.zero_grad()
        ld.backward()
        od.step()
        lg = nn.functional.softplus(-disc(fake)).mean()
        og.zero_grad()
        lg.backward()
        og.step()
        ddpkit.print(f"step {step} {ld.item():.3f} {lg.item():.3f}")
