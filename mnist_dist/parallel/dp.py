"""The single-process multi-GPU family of PyTorch's multi-GPU tutorial, applied to a plain model:
``nn.DataParallel`` over the whole model or one sub-block of it, the same by hand (``replicate``, ``scatter``,
``parallel_apply``, ``gather``), and a model split across two devices. docs/modes.md says why DDP replaced them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.nn.parallel import gather, parallel_apply, replicate, scatter


def in_callers_autocast(replicas: list[nn.Module], device_type: str) -> list[Callable]:
    """``replicas`` as ``parallel_apply`` should call them: in the caller's autocast state in every thread.
    ``parallel_apply`` re-enters autocast in each thread without a dtype, which is thread-local: bf16 would be lost."""
    dtype, enabled = torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)

    def call(replica: nn.Module, *args, **kwargs):
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return replica(*args, **kwargs)

    return [partial(call, replica) for replica in replicas]


class DataParallel(nn.DataParallel):
    """``nn.DataParallel`` that keeps the caller's autocast dtype in every replica, and where ``device_ids=[]`` is a
    pass-through on the CPU: ``nn.DataParallel`` reads ``None`` as every visible GPU and cannot say none."""

    def __init__(self, module: nn.Module, device_ids: list[int]) -> None:
        if device_ids:
            super().__init__(module, device_ids=device_ids)
        else:  # what nn.DataParallel itself builds where no GPU is visible
            nn.Module.__init__(self)
            self.module, self.device_ids = module, []

    def parallel_apply(self, replicas: list[nn.Module], inputs: list[tuple], kwargs=None) -> list:
        """One thread per device, each in the caller's autocast state."""
        calls = in_callers_autocast(replicas, inputs[0][0].device.type)  # the device the batch was scattered to
        return parallel_apply(calls, inputs, kwargs, self.device_ids[: len(replicas)])


class FunctionalDataParallel(DataParallel):
    """What ``nn.DataParallel`` does on each forward, spelt out."""

    def forward(self, x):
        if not self.device_ids:
            return self.module(x)
        inputs = scatter(x, self.device_ids)  # a slice of the batch per device
        replicas = replicate(self.module, self.device_ids[: len(inputs)])  # the model, copied, every step
        outputs = self.parallel_apply(replicas, [(chunk,) for chunk in inputs])
        return gather(outputs, self.device_ids[0])  # everything back on the first device


def data_parallel(model: nn.Module, device_ids: list[int], block: str, functional: bool) -> nn.Module:
    """Wraps ``model`` (or only its submodule ``block``) for data parallelism over ``device_ids``
    (``[]``: a pass-through, on the CPU)."""
    wrap = FunctionalDataParallel if functional else DataParallel
    if not block:
        return wrap(model, device_ids)
    # The tutorial's block2 case: only this part is replicated; the rest runs on the first device.
    setattr(model, block, wrap(child(model, block), device_ids))
    return model


def split(model: nn.Module, split_at: str, first, second) -> nn.Module:
    """Puts the children of ``model`` before ``split_at`` on ``first`` and the rest on ``second``; forward
    pre-hooks move the input and, at the boundary, the activations. ``forward`` must use the children in order."""
    boundary = child(model, split_at)
    names = [name for name, _ in model.named_children()]
    for name, module in model.named_children():
        module.to(first if names.index(name) < names.index(split_at) else second)
    model.register_forward_pre_hook(lambda _, args: tuple(a.to(first) for a in args))
    boundary.register_forward_pre_hook(lambda _, args: tuple(a.to(second) for a in args))
    return model


def child(model: nn.Module, name: str) -> nn.Module:
    """The direct submodule ``name`` of ``model``, or a ValueError listing the ones it has."""
    children = dict(model.named_children())
    if name not in children:
        raise ValueError(f"{type(model).__name__} has no submodule {name!r}; its submodules: {', '.join(children)}")
    return children[name]
