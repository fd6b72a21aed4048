"""Where the tensors a phase makes live: on the model's device, whatever it is."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..model.anatomy import module_of

STAND_IN = None  # attnprobe.testing.stand_in's stand-in GPU while one is active (tests on a CPU)


@contextmanager
def on_model_device(model):
    """Within the block, tensors made without a device are made on the model's (a GPU's, say), so the
    index and mask tensors the phases build meet the activations where they are; results leave
    for the CPU explicitly (`.cpu()`) where tables are written. A no-op for a model on the CPU."""
    module = module_of(model)
    device = next(module.parameters()).device
    if STAND_IN is not None and device.type == "cpu":
        with STAND_IN.holding(module):
            yield
        return
    if device.type == "cpu":
        yield
        return
    with torch.device(device):
        yield


def on_host():
    """A block within which tensors made without a device are made on the CPU, inside an
    `on_model_device` block too: the host's bookkeeping (padding, index lists, label sets) is built
    there and reaches the device in one copy, not one small copy (and wait) per element."""
    return torch.device("cpu")
