"""Mixed precision on CPU: bf16 autocast works, fp16 is refused with a clear error (it needs CUDA)."""
import pytest
import torch

import ddpkit


def test_bf16_autocast_on_cpu_and_fp32_noop():
    ddpkit.init(cpu=True)
    layer = torch.nn.Linear(4, 2)
    with ddpkit.autocast("bf16"):
        assert layer(torch.randn(3, 4)).dtype == torch.bfloat16
    with ddpkit.autocast("fp32"):
        assert layer(torch.randn(3, 4)).dtype == torch.float32


def test_fp16_on_cpu_and_unknown_precision_are_clear_errors():
    ddpkit.init(cpu=True)
    with pytest.raises(ValueError, match="fp16 autocast needs a CUDA device, this process runs on cpu"):
        ddpkit.autocast("fp16")
    with pytest.raises(ValueError, match="'fp8' is not one of None, fp32, bf16, fp16"):
        ddpkit.autocast("fp8")
