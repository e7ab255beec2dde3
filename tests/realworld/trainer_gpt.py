"""Character-level GPT shape with its own Trainer class: a char dataset of (context, next chars) windows, a
tiny causal Transformer whose ``configure_optimizers(config)`` splits parameters into weight-decay groups, and a
``Trainer.run()`` that draws from an endless ``RandomSampler(replacement=True, num_samples=10**10)`` with
``while True: try next(it) except StopIteration: it = iter(loader)``, stopping at ``max_iters``, with callbacks.

Converted by following the README: init, prepare_model, data_loader with the user's sampler (split across ranks
by position), ddpkit.print in the callback. Synthetic repeated text stands in for Shakespeare.

    python tests/realworld/trainer_gpt.py --max-iters 10
    ddpkit launch --nproc-per-node 2 tests/realworld/trainer_gpt.py --max-iters 10
"""
import argparse
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import Dataset, RandomSampler

import ddpkit


class CharDataset(Dataset):
    def __init__(self, text: str, block_size: int):
        chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size, self.block_size = len(chars), block_size
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.int64)

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, idx):
        chunk = self.data[idx:idx + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class TinyGPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_embd=16, n_head=2, dropout=0.1):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.block = nn.TransformerEncoderLayer(n_embd, n_head, 4 * n_embd, dropout=dropout, batch_first=True)
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.register_buffer("mask", torch.triu(torch.full((block_size, block_size), float("-inf")), 1))

    def forward(self, idx, targets=None):
        t = idx.size(1)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device)))
        logits = self.head(self.ln_f(self.block(x, src_mask=self.mask[:t, :t])))
        loss = None if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def configure_optimizers(self, config):
        """AdamW with weight decay on the Linear weights only (not biases, norms or embeddings)."""
        decay = {f"{mn}.{pn}".lstrip(".") for mn, m in self.named_modules()
                 for pn, _ in m.named_parameters(recurse=False)
                 if pn.endswith("weight") and isinstance(m, (nn.Linear, nn.MultiheadAttention))}
        params = dict(self.named_parameters())
        groups = [{"params": [params[n] for n in sorted(decay)], "weight_decay": config.weight_decay},
                  {"params": [params[n] for n in sorted(set(params) - decay)], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(0.9, 0.95))


class Trainer:
    def __init__(self, config, model, train_dataset):
        self.config, self.train_dataset = config, train_dataset
        self.state = ddpkit.init(seed=config.seed)
        self.model = ddpkit.prepare_model(model)
        self.callbacks: dict[str, list] = {}
        self.iter_num, self.loss = 0, None

    def add_callback(self, event, fn):
        self.callbacks.setdefault(event, []).append(fn)

    def trigger_callbacks(self, event):
        for fn in self.callbacks.get(event, []):
            fn(self)

    def run(self):
        model, config = self.model, self.config
        self.optimizer = model.configure_optimizers(config)
        sampler = RandomSampler(self.train_dataset, replacement=True, num_samples=10**10)
        train_loader = ddpkit.data_loader(self.train_dataset, batch_size=config.batch_size, sampler=sampler)
        model.train()
        data_iter = iter(train_loader)
        while True:
            try:
                x, y = next(data_iter)
            except StopIteration:
                data_iter = iter(train_loader)
                x, y = next(data_iter)
            x, y = x.to(self.state.device), y.to(self.state.device)
            _, self.loss = model(x, y)
            model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)
            self.optimizer.step()
            self.trigger_callbacks("on_batch_end")
            self.iter_num += 1
            if config.max_iters is not None and self.iter_num >= config.max_iters:
                break


def main():
    parser = argparse.ArgumentParser(description="char-GPT Trainer-shaped example")
    parser.add_argument("--max-iters", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--seed", type=int, default=3407)
    args = parser.parse_args()
    text = "to be or not to be, that is the question; whether tis nobler in the mind to suffer. " * 8
    dataset = CharDataset(text, block_size=16)
    config = SimpleNamespace(batch_size=args.batch_size, learning_rate=5e-3, weight_decay=0.1, grad_norm_clip=1.0,
                             max_iters=args.max_iters, seed=args.seed)
    trainer = Trainer(config, TinyGPT(dataset.vocab_size, dataset.block_size), dataset)

    def report(t):
        if t.iter_num % 10 == 0:
            ddpkit.print(f"iter {t.iter_num}: train loss {t.loss.item():.5f}")

    trainer.add_callback("on_batch_end", report)
    trainer.run()
    ddpkit.print(f"done: {trainer.iter_num} iterations")


if __name__ == "__main__":
    main()
