"""An object whose checkpoint write is slow (its pickling sleeps), for the background-checkpoint tests."""
import time
from collections import OrderedDict


class Slow:
    """Pickles slowly: the background write of a checkpoint holding it takes ``seconds`` longer."""

    def __init__(self, seconds):
        self.seconds = seconds

    def __reduce__(self):
        time.sleep(self.seconds)
        return (OrderedDict, ())  # an empty OrderedDict, which torch.load(weights_only=True) reads


class SlowState:
    def __init__(self, seconds=60):
        self.seconds = seconds

    def state_dict(self):
        return {"slow": Slow(self.seconds)}

    def load_state_dict(self, saved):
        pass


class Full:
    """Pickles as a full disk: the write of a checkpoint holding it fails with ENOSPC."""

    def __reduce__(self):
        raise OSError(28, "No space left on device")


class FullState:
    def state_dict(self):
        return {"full": Full()}

    def load_state_dict(self, saved):
        pass


def spawned(directory):
    """A ddpkit.spawn worker whose last background write fails (rank 0's disk is full)."""
    import torch

    import ddpkit

    ddpkit.init()
    ckpt = ddpkit.Checkpointer(directory, async_save=True)
    ckpt.save(1, model=ddpkit.prepare_model(torch.nn.Linear(2, 2)), full=FullState())
