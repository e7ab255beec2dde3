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
