"""The script of the minGPT-shaped project: data, model and Trainer built here, trained in mingpt/trainer.py
(``ddpkit convert --imports chargpt.py`` converts the three files)."""
import argparse
import random

import torch
from mingpt.model import GPT
from mingpt.trainer import Trainer
from mingpt.utils import set_seed
from torch.utils.data import Dataset

# -----------------------------------------------------------------------------
# the data


def make_text(n_chars, seed):
    rng = random.Random(seed)
    subjects = ['the cat', 'a dog', 'my friend', 'the king', 'some bird']
    verbs = ['sat on', 'looked at', 'ran past', 'sang to', 'forgot']
    objects = ['the mat', 'a tree', 'the river', 'his crown', 'the moon']
    parts = []
    total = 0
    while total < n_chars:
        line = '%s %s %s.\n' % (rng.choice(subjects), rng.choice(verbs), rng.choice(objects))
        parts.append(line)
        total += len(line)
    return ''.join(parts)[:n_chars]


class CharDataset(Dataset):
    """
    Emits batches of characters
    """

    def __init__(self, block_size, data):
        chars = sorted(list(set(data)))
        data_size, vocab_size = len(data), len(chars)
        print('data has %d characters, %d unique.' % (data_size, vocab_size))

        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.itos = {i: ch for i, ch in enumerate(chars)}
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.data = data

    def get_vocab_size(self):
        return self.vocab_size

    def get_block_size(self):
        return self.block_size

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, idx):
        # grab a chunk of (block_size + 1) characters from the data
        chunk = self.data[idx:idx + self.block_size + 1]
        # encode every character to an integer
        dix = [self.stoi[s] for s in chunk]
        # return as tensors
        x = torch.tensor(dix[:-1], dtype=torch.long)
        y = torch.tensor(dix[1:], dtype=torch.long)
        return x, y


# -----------------------------------------------------------------------------

if __name__ == '__main__':

    parser = argparse.ArgumentParser(description='char-level GPT on a synthetic text')
    parser.add_argument('--max-iters', type=int, default=200)
    parser.add_argument('--batch-size', type=int, default=32)
    parser.add_argument('--block-size', type=int, default=16)
    parser.add_argument('--learning-rate', type=float, default=5e-4)
    parser.add_argument('--num-workers', type=int, default=0)
    parser.add_argument('--seed', type=int, default=3407)
    parser.add_argument('--log-interval', type=int, default=10)
    args = parser.parse_args()

    set_seed(args.seed)

    # construct the training dataset
    text = make_text(4000, seed=0)
    train_dataset = CharDataset(args.block_size, text)

    # construct the model
    model_config = GPT.get_default_config()
    model_config.vocab_size = train_dataset.get_vocab_size()
    model_config.block_size = train_dataset.get_block_size()
    model = GPT(model_config)

    # construct the trainer object
    train_config = Trainer.get_default_config()
    train_config.max_iters = args.max_iters
    train_config.batch_size = args.batch_size
    train_config.learning_rate = args.learning_rate
    train_config.num_workers = args.num_workers
    trainer = Trainer(train_config, model, train_dataset)

    # iteration callback
    def batch_end_callback(trainer):
        if trainer.iter_num % args.log_interval == 0:
            print(f"iter_dt {trainer.iter_dt * 1000:.2f}ms; "
                  f"iter {trainer.iter_num}: train loss {trainer.loss.item():.5f}")

    trainer.set_callback('on_batch_end', batch_end_callback)

    # run the optimization
    trainer.run()

    # sample from the model
    model.eval()
    with torch.no_grad():
        context = "the "
        x = torch.tensor([train_dataset.stoi[s] for s in context], dtype=torch.long)[None, ...].to(trainer.device)
        y = model.generate(x, 40, temperature=1.0, do_sample=True, top_k=10)[0]
        completion = ''.join([train_dataset.itos[int(i)] for i in y])
        print(completion)
