"""Helpers of the minGPT-shaped project: a seed for every generator and a small config class."""

import random

import torch

# -----------------------------------------------------------------------------
# utils


def set_seed(seed):
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


class CN:
    """ a lightweight configuration class inspired by yacs """

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def __str__(self):
        return '\n'.join(f'{k}: {v}' for k, v in self.__dict__.items())


