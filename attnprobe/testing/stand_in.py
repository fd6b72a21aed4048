"""A stand-in GPU on a machine without one: the device mistakes a CPU forgives, refused on the CPU.

On a CPU, a tensor made "on the model's device" is an ordinary CPU tensor, so code that forgets to
bring a result back (`.numpy()` without `.cpu()`) or draws with a CPU generator where the phases make
tensors on the GPU passes every CPU test and fails on the first GPU (2026-11-27: `attnprobe edit
--device cuda:0` on an H100). Within `stand_in_device()` tensors on the device carry a mark:

- the model's parameters and buffers are marked once `on_model_device` sees the model, and inside
  that block a constructor given no device makes a marked tensor (as `torch.device(cuda)` makes GPU
  tensors there);
- every result of an operation that reads a marked tensor is marked; `.cpu()` and `.to("cpu")` give
  an unmarked alias;
- `.numpy()` (and numpy's `__array__`) of a marked tensor raises TypeError, and a constructor that
  would make a marked tensor with a CPU generator raises RuntimeError, as CUDA does.

    with stand_in_device():
        CliRunner().invoke(main, ["edit", RUN, "--paths"])   # fails where a GPU would

What it does not see: tensors made with an explicit CPU device and mixed with the device's (a GPU
refuses most such mixtures; the stand-in computes them).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._device import _device_constructors

from ..forward import device as model_device

MARK = "_attnprobe_on_stand_in_device"
CONSTRUCTORS = _device_constructors()


def on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and getattr(x, MARK, False)


def _mark(out):
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            setattr(leaf, MARK, True)
    return out


def _names_cpu(args, kwargs) -> bool:
    """Whether a `.to(...)` call names the CPU as its device."""
    for value in (*args[1:], kwargs.get("device")):
        if isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu":
            return True
    return False


# What makes the host wait for a GPU: a value read back from a tensor on the device
WAITS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.cpu,
    torch.Tensor.nonzero,
    torch.nonzero,
}
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}  # a constructor copying host data


class StandInDevice(TorchFunctionMode):
    """The mode behind stand_in_device(); `depth` counts the on_model_device blocks entered. It counts
    what costs a GPU host time: `waits` (values read back from the device, each a synchronisation) and
    `copies` (tensors made on the device from host data, each a small transfer)."""

    depth = 0

    def __init__(self):
        super().__init__()
        self.waits, self.copies = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in WAITS and args and on_device(args[0]):
            self.waits += 1
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and on_device(args[0]):
            raise TypeError(
                "can't convert the stand-in device's tensor to numpy (as CUDA: use Tensor.cpu() first)"
            )
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _names_cpu(args, kwargs)):
            out = func(*args, **kwargs)
            return out.view_as(out)  # an alias without the mark: the copy a GPU would give
        if func in CONSTRUCTORS and kwargs.get("device") is None and self.depth:
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type == "cpu":
                raise RuntimeError("Expected a 'cuda' device type for generator (the stand-in device)")
            self.copies += func in FROM_DATA
            return _mark(func(*args, **kwargs))
        out = func(*args, **kwargs)
        if any(on_device(x) for x in pytree.tree_leaves((args, kwargs))):
            _mark(out)
        return out

    @contextmanager
    def holding(self, module):
        """on_model_device's block: the module's tensors on the device, new tensors made there."""
        for tensor in (*module.parameters(), *module.buffers()):
            setattr(tensor, MARK, True)
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


@contextmanager
def stand_in_device():
    """Within the block, attnprobe's phases run as on a GPU (see the module's docstring)."""
    mode = StandInDevice()
    previous, model_device.STAND_IN = model_device.STAND_IN, mode
    try:
        with mode:
            yield mode
    finally:
        model_device.STAND_IN = previous
