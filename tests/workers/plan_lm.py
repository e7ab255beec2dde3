"""A small transformer language model for ``ddpkit plan``'s tests: ``plan_lm.py [--width W] [--steps K]``.

Unlike examples/big.py and examples/digits.py: embeddings, attention, LayerNorm, dropout, AdamW with weight
decay, gradient clipping, and a ``global_batch_size`` (each rank's activations shrink as processes are added).
The loss is printed after each step, as a script does (the planning run stops before the first print).
"""
import argparse

import torch
from torch import nn

import ddpkit

p = argparse.ArgumentParser()
p.add_argument("--width", type=int, default=128)
p.add_argument("--layers", type=int, default=3)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--global-batch", type=int, default=24)
args = p.parse_args()
torch.set_num_threads(1)
VOCAB, CONTEXT = 512, 64


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, args.width)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(args.width, 4, 4 * args.width, dropout=0.1,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.width)
        self.head = nn.Linear(args.width, VOCAB)

    def forward(self, tokens):
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


state = ddpkit.init(seed=0)
tokens = torch.randint(0, VOCAB, (240, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
model = ddpkit.prepare_model(LM(), shard=[nn.TransformerEncoderLayer])
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
loader = ddpkit.data_loader(torch.utils.data.TensorDataset(tokens), global_batch_size=args.global_batch, seed=0)
step = 0
while step < args.steps:
    for (batch,) in loader:
        batch = batch.to(state.device)
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        ddpkit.print(f"step {step} loss {loss.item():.3f}")
        step += 1
        if step == args.steps:
            break
