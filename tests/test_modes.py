"""Pure logic: which mode and device a launch gets."""
import pytest
import torch

from ddpkit.core.environment import LaunchEnvError, ProcessEnv
from ddpkit.runtime.group import choose_device, choose_mode, usable_gpus

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
    with pytest.raises(ValueError, match="'zero' is not one of"):
        choose_mode("zero", ProcessEnv(), 0)


def test_device_is_own_gpu_or_cpu():
    assert choose_device("ddp", TWO, 2) == torch.device("cuda", 1)
    assert choose_device("ddp", TWO, usable_gpus("cpu", 2)) == torch.device("cpu")
    assert choose_device("ddp", TWO, 0) == torch.device("cpu")
    assert choose_device("dp", ProcessEnv(), 4) == torch.device("cuda", 0)
    four = ProcessEnv("torchrun", rank=3, local_rank=3, world_size=4, local_world_size=4)
    with pytest.raises(LaunchEnvError, match="local rank 3 has no GPU of its own: 2 visible"):
        choose_device("ddp", four, 2)


def test_one_gpu_per_task_uses_cuda_0():
    """Issue 11 #3: Slurm --gpus-per-task=1 / --gpu-bind give each process one GPU in CUDA_VISIBLE_DEVICES;
    local rank 1 used to raise 'has no GPU of its own'."""
    slurm_rank3 = ProcessEnv("slurm", rank=3, local_rank=1, world_size=4, local_world_size=2)
    assert choose_device("ddp", slurm_rank3, 1) == torch.device("cuda", 0)


def test_cpu_can_be_forced_whatever_gpus_exist():
    """Issue 11 #4: --device cpu / DDPKIT_DEVICE=cpu means no GPU for mode and device alike."""
    assert usable_gpus("cpu", 8) == 0 and usable_gpus("auto", 8) == 8 and usable_gpus("cuda", 1) == 1
    assert choose_mode("auto", ProcessEnv(), usable_gpus("cpu", 4))[0] == "single"  # not dp over 4 GPUs
    with pytest.raises(LaunchEnvError, match="device 'cuda' asked for .* no CUDA GPU"):
        usable_gpus("cuda", 0)
    with pytest.raises(ValueError, match="'tpu' is not one of auto, cpu, cuda"):
        usable_gpus("tpu", 0)
