"""The single-process multi-GPU family of PyTorch's multi-GPU tutorial, applied to a plain model.

- ``nn.DataParallel`` over the whole model, or over one sub-block of it (the tutorial's ``block2``);
- the same by hand: ``replicate``, ``scatter``, ``parallel_apply``, ``gather`` (the tutorial's
  ``data_parallel`` function), to show what DataParallel does on every step;
- a model split across two devices, with the activations moved between them in forward.

Why DDP exists: DataParallel is one Python process driving every GPU, so the GIL serialises the
replicas' Python work, and it copies the whole model to every GPU on every step (``replicate``),
then gathers outputs on the first GPU, which is left with more memory and work than the others.
DDP runs one process per GPU, replicates once, and only exchanges gradients.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import gather, parallel_apply, replicate, scatter


class FunctionalDataParallel(nn.Module):
    """What ``nn.DataParallel`` does on each forward, spelt out. Without devices it is a pass-through."""

    def __init__(self, module: nn.Module, device_ids: list[int]) -> None:
        super().__init__()
        self.module = module
        self.device_ids = device_ids

    def forward(self, x):
        if not self.device_ids:
            return self.module(x)
        inputs = scatter(x, self.device_ids)  # a slice of the batch per device
        replicas = replicate(self.module, self.device_ids[: len(inputs)])  # the model, copied, every step
        outputs = parallel_apply(replicas, [(chunk,) for chunk in inputs])  # one thread per device
        return gather(outputs, self.device_ids[0])  # everything back on the first device


def data_parallel(model: nn.Module, device_ids: list[int], block: str, functional: bool) -> nn.Module:
    """Wraps ``model`` (or only its submodule ``block``) for data parallelism over ``device_ids``."""
    wrap = (
        (lambda m: FunctionalDataParallel(m, device_ids))
        if functional
        else (lambda m: nn.DataParallel(m, device_ids=device_ids or None))
    )
    if not block:
        return wrap(model)
    # The tutorial's block2 case: only this part is replicated; the rest runs on the first device.
    setattr(model, block, wrap(child(model, block)))
    return model


def split(model: nn.Module, split_at: str, first, second) -> nn.Module:
    """Puts the children of ``model`` before ``split_at`` on ``first`` and the rest on ``second``.

    The model's own forward runs unchanged; two forward pre-hooks move the input to ``first`` and,
    at the boundary, the activations to ``second``. So ``forward`` must use the children in their
    registration order, as ``ConvNet`` (features, then classifier) does.
    """
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
