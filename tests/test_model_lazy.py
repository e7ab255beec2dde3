"""prepare_model refuses a model whose lazy layers are not sized yet, in one line, in every mode (DDP would stop
with torch's own error at 2 processes only; verify's one-process run could not read its weights)."""
import pytest
from torch import nn

import ddpkit
from ddpkit.model import lazy_refused


def test_a_lazy_layer_not_sized_is_refused_with_the_layer_and_the_way_out():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.Flatten(), nn.LazyLinear(3))
    with pytest.raises(ValueError) as caught:
        ddpkit.prepare_model(model)
    said = str(caught.value)
    assert "\n" not in said and "2.weight, 2.bias are lazy (nn.LazyLinear" in said, said
    assert "run one forward on a sample batch before prepare_model" in said and "nn.Linear" in said, said


def test_a_lazy_layer_sized_by_a_forward_is_prepared():
    import torch
    model = nn.Sequential(nn.Flatten(), nn.LazyLinear(3))
    model(torch.zeros(1, 5))
    lazy_refused(model)  # (sized: nothing to say)
    assert isinstance(ddpkit.prepare_model(model), nn.Module)
