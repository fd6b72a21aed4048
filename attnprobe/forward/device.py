"""Where the tensors a phase makes live: on the model's device, whatever it is."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ..model.anatomy import module_of


@contextmanager
def on_model_device(model):
    """Within the block, tensors made without a device are made on the model's (a GPU's, say), so the
    index and mask tensors the phases build meet the activations where they are; results leave
    for the CPU explicitly (`.cpu()`) where tables are written. A no-op for a model on the CPU."""
    module = module_of(model)
    device = next(module.parameters()).device
    if device.type == "cpu":
        yield
        return
    with torch.device(device):
        yield
