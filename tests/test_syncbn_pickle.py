"""A whole model saved after ddpkit synchronised its BatchNorm layers (``torch.save(ddpkit.unwrap(model), p)``, the
line convert writes for ``torch.save(model, p)``): the file holds the BatchNorm classes the one-process run's file
holds and opens where ddpkit is not installed (set 28, measurer a, D2: it held ddpkit's SyncBatchNorm2d)."""

from __future__ import annotations

import copy
import subprocess
import sys

import torch
from torch import nn

from ddpkit.strategies.syncbn import SyncBatchNorm, convert_sync_batchnorm

READ = """import sys, torch
sys.modules["ddpkit"] = None  # (no ddpkit where the file is read)
model = torch.load(sys.argv[1], weights_only=False)
print(*[type(m).__module__ + "." + type(m).__name__ for m in model.modules()], sep=" ")
print(float(model[1].running_mean.sum()))
"""


def test_a_whole_model_pickles_its_batchnorms_as_the_plain_classes_and_opens_without_ddpkit(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.BatchNorm1d(144))
    synced = convert_sync_batchnorm(net, torch.device("cpu"))
    synced(torch.randn(8, 1, 8, 8))  # (one process: plain BatchNorm statistics, running stats moved)
    path = tmp_path / "whole.pt"
    torch.save(synced, path)
    read = subprocess.run([sys.executable, "-c", READ, str(path)], capture_output=True, text=True, timeout=120)
    assert read.returncode == 0, read.stderr[-1500:]
    kinds, mean = read.stdout.split("\n")[:2]
    assert "torch.nn.modules.batchnorm.BatchNorm2d" in kinds.split() and "ddpkit" not in kinds, kinds
    assert "torch.nn.modules.batchnorm.BatchNorm1d" in kinds.split()
    assert float(mean) == float(synced[1].running_mean.sum())


def test_a_deep_copy_of_a_synchronised_model_stays_synchronised():
    """(a moving-average copy, ``copy.deepcopy(model)`` after the wrap, keeps training over the global batch)"""
    synced = convert_sync_batchnorm(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), torch.device("cpu"))
    twin = copy.deepcopy(synced)
    assert isinstance(twin[1], SyncBatchNorm) and type(twin[1]) is type(synced[1])
    assert twin[1].running_var is not synced[1].running_var and torch.equal(twin[1].running_var,
                                                                            synced[1].running_var)
