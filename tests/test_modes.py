"""Pure logic: which mode and device a launch gets."""
import pytest
import torch

from ddpkit.environment import LaunchEnvError, ProcessEnv
from ddpkit.runtime import choose_device, choose_mode

TWO = ProcessEnv("torchrun", rank=1, local_rank=1, world_size=2, local_world_size=2)


@pytest.mark.parametrize("requested, env, gpus, mode", [
    ("auto", ProcessEnv(), 0, "single"),
    ("auto", ProcessEnv(), 1, "single"),
    ("auto", ProcessEnv(), 4, "dp"),
    ("auto", TWO, 0, "ddp"),
    ("auto", TWO, 8, "ddp"),
    ("ddp", ProcessEnv(), 0, "single"),
    ("dp", ProcessEnv(), 1, "single"),
    ("dp", ProcessEnv(), 2, "dp"),
    ("single", ProcessEnv(), 4, "single"),
])
def test_choose_mode(requested, env, gpus, mode):
    chosen, reason = choose_mode(requested, env, gpus)
    assert chosen == mode and reason


@pytest.mark.parametrize("requested", ["dp", "single"])
def test_one_process_modes_refuse_a_multi_process_launch(requested):
    with pytest.raises(LaunchEnvError, match="runs one process, but 2 processes"):
        choose_mode(requested, TWO, 2)


def test_unknown_mode():
    with pytest.raises(ValueError, match="'fsdp' is not one of"):
        choose_mode("fsdp", ProcessEnv(), 0)


def test_device_is_own_gpu_or_cpu():
    assert choose_device("ddp", TWO, 2, cpu=False) == torch.device("cuda", 1)
    assert choose_device("ddp", TWO, 2, cpu=True) == torch.device("cpu")
    assert choose_device("ddp", TWO, 0, cpu=False) == torch.device("cpu")
    assert choose_device("dp", ProcessEnv(), 4, cpu=False) == torch.device("cuda", 0)
    with pytest.raises(LaunchEnvError, match="local rank 1 has no GPU of its own: 1 visible"):
        choose_device("ddp", TWO, 1, cpu=False)
