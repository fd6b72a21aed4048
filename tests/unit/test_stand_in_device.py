"""attnprobe.testing.stand_in: a CPU standing in for a GPU refuses what CUDA refuses (the edit's
`.numpy()` of a tensor left on the device passed every CPU test and failed on an H100)."""

import numpy as np
import pytest
import torch

from attnprobe.forward.device import on_model_device
from attnprobe.testing.stand_in import on_device, stand_in_device


def test_tensors_on_the_stand_in_device_must_come_back_before_numpy():
    model = torch.nn.Linear(3, 2)
    with stand_in_device(), on_model_device(model):
        made = torch.zeros(4)  # no device given: made on the model's
        out = model(torch.ones(1, 3))  # the parameters are on the device, so is what reads them
        here = torch.zeros(2, device="cpu")  # asked for on the CPU
        assert on_device(made) and on_device(out) and on_device(made * 2) and not on_device(here)
        for tensor in (made, out):
            with pytest.raises(TypeError, match="use Tensor.cpu"):
                tensor.numpy()
            with pytest.raises(TypeError, match="use Tensor.cpu"):
                np.asarray(tensor.detach())
        assert made.cpu().numpy().shape == (4,) and out.detach().to("cpu").numpy().shape == (1, 2)
        assert not on_device(out.detach().to(torch.device("cpu"))) and on_device(out.to(torch.float64))
        with pytest.raises(RuntimeError, match="generator"):
            torch.randperm(5, generator=torch.Generator().manual_seed(0))
        assert torch.randperm(5, generator=torch.Generator().manual_seed(0), device="cpu").numpy().size == 5
    with stand_in_device():
        assert not on_device(torch.zeros(2))  # outside a phase's block, the CPU as ever
    assert not on_device(torch.zeros(2)) and torch.zeros(2).numpy().size == 2
