"""Word-level language model shape: a corpus tokenised into one long id tensor, ``batchify`` into columns,
truncated BPTT with ``get_batch(source, i)``, an LSTM (with dropout) whose hidden state is carried from batch to
batch through ``model.init_hidden(bsz)`` and ``repackage_hidden``, a hand-written SGD update after gradient
clipping, and a validation loss weighted by each chunk's length.

No DataLoader, so no ``ddpkit.data_loader``: each rank takes its own slice of the batchified columns
(``--batch-size`` is the global number of columns). Synthetic text stands in for Wikitext-2.

    python tests/realworld/word_lm.py --epochs 1
    ddpkit launch --nproc-per-node 2 tests/realworld/word_lm.py --epochs 1
"""
import argparse
import math

import torch
from torch import nn

import ddpkit


def synthetic_corpus(n_words: int, seed: int) -> list[str]:
    """Words from a small vocabulary with a fixed bigram habit, so there is something to learn."""
    g = torch.Generator().manual_seed(seed)
    vocab = [f"w{i}" for i in range(40)]
    words, w = [], 0
    for _ in range(n_words):
        habit = torch.rand(1, generator=g).item() < 0.7
        w = (w * 7 + 3) % 40 if habit else int(torch.randint(0, 40, (1,), generator=g))
        words.append(vocab[w])
    return words


class Corpus:
    def __init__(self):
        self.word2idx: dict[str, int] = {}
        self.train = self.tokenize(synthetic_corpus(2000, seed=0))
        self.valid = self.tokenize(synthetic_corpus(400, seed=1))

    def tokenize(self, words):
        ids = [self.word2idx.setdefault(w, len(self.word2idx)) for w in words + ["<eos>"]]
        return torch.tensor(ids, dtype=torch.int64)


def batchify(data, bsz, state):
    """Columns of the whole text, then this rank's share of them: rank r holds columns r*k .. r*k + k - 1."""
    if bsz % state.world_size:
        raise SystemExit(f"--batch-size {bsz} is the global number of columns; it must divide by the "
                         f"{state.world_size} processes: pass a multiple of {state.world_size}")
    nbatch = data.size(0) // bsz
    columns = data[: nbatch * bsz].view(bsz, -1).t().contiguous()
    per_rank = bsz // state.world_size
    return columns[:, state.rank * per_rank:(state.rank + 1) * per_rank].contiguous().to(state.device)


class RNNModel(nn.Module):
    def __init__(self, ntoken, ninp, nhid, nlayers, dropout):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid, self.nlayers = nhid, nlayers

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(input)), hidden)
        return self.decoder(self.drop(output)).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    return source[i:i + seq_len], source[i + 1:i + 1 + seq_len].reshape(-1)


def evaluate(model, data_source, args):
    model.eval()
    total_loss, tokens = 0.0, 0
    hidden = model.init_hidden(data_source.size(1))
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i, args.bptt)
            output, hidden = model(data, hidden)
            total_loss += nn.functional.cross_entropy(output, targets, reduction="sum").item()
            tokens += targets.numel()
    # sum of token losses over every rank's columns / every token: the one-process value
    return ddpkit.reduce(total_loss, "mean", count=tokens)


def train_epoch(model, train_data, args, lr, epoch):
    model.train()
    hidden = model.init_hidden(train_data.size(1))
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i, args.bptt)
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = nn.functional.cross_entropy(output, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        if batch % args.log_interval == 0:
            ddpkit.print(f"| epoch {epoch} | batch {batch} | loss {loss.item():.4f}")


def main():
    parser = argparse.ArgumentParser(description="word-LM-shaped example")
    parser.add_argument("--lr", type=float, default=5.0)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global number of columns")
    parser.add_argument("--eval-batch-size", type=int, default=4, help="global number of columns")
    parser.add_argument("--bptt", type=int, default=12)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1111)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    state = ddpkit.init(seed=args.seed)
    corpus = Corpus()
    train_data = batchify(corpus.train, args.batch_size, state)
    val_data = batchify(corpus.valid, args.eval_batch_size, state)
    model = ddpkit.prepare_model(RNNModel(len(corpus.word2idx), 16, 16, 2, args.dropout))

    lr = args.lr
    for epoch in range(1, args.epochs + 1):
        train_epoch(model, train_data, args, lr, epoch)
        val_loss = evaluate(model, val_data, args)
        ddpkit.print(f"| end of epoch {epoch} | valid loss {val_loss:.6f} | valid ppl {math.exp(val_loss):.4f}")
        lr /= 1.5
    if args.save and state.is_main:
        torch.save(ddpkit.unwrap(model).state_dict(), args.save)


if __name__ == "__main__":
    main()
