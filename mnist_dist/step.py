"""One step as plain functions of modules and tensors: the optimizer step on a rank's share of the global
batch (with gradient accumulation), exact sharded evaluation, the divergence check, and amp."""

from __future__ import annotations

from contextlib import nullcontext
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from mnist_dist.data import eval_shard
from mnist_dist.metrics import all_gather
from mnist_dist.parallel import unwrap
from mnist_dist.parallel.ddp import broadcast_from


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: Precision,
    accumulate: int = 1,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """One optimizer step on this rank's share of the global batch; returns its loss. The same lines in every
    mode: a DDP averages the gradients inside ``backward()``. The named ranges are what ``profile=true`` shows."""
    optimizer.zero_grad(set_to_none=True)
    loss = compute_gradients(model, x, y, precision, accumulate, label_smoothing)
    with record_function("optimizer"):
        precision.scaler.step(optimizer)
        precision.scaler.update()
    return loss


def compute_gradients(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    precision: Precision,
    parts: int = 1,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Gradients of the mean loss over (x, y) in ``parts`` micro-batches, added to ``.grad``; returns that loss.
    A DDP all-reduces only in the last backward: ``no_sync`` holds the forward too, where both DDPs decide."""
    losses = []
    for i, (xs, ys) in enumerate(zip(x.chunk(parts), y.chunk(parts))):
        last = i == parts - 1
        with model.no_sync() if not last and hasattr(model, "no_sync") else nullcontext():
            with record_function("forward"), precision.autocast():
                logits = model(xs)
                # split mode ends on another device
                loss = F.cross_entropy(logits, ys.to(logits.device), label_smoothing=label_smoothing) / parts
            with record_function("backward"):
                precision.scaler.scale(loss).backward()
        losses.append(loss.detach())
    return torch.stack(losses).sum()


@torch.no_grad()
def evaluate_as_saved(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, world_size: int
) -> tuple[float, float]:
    """Exact loss and accuracy over the whole test set of the model a checkpoint saves (a collective): every rank
    takes rank 0's BatchNorm statistics, the ones saved, so the reported accuracy is model.pt's; then each rank
    scores a disjoint share."""
    if dist.is_initialized():
        broadcast_from(list(model.buffers()))
    model = unwrap(model)
    model.eval()
    share = eval_shard(len(x), rank, world_size)
    loss_sum, correct = 0.0, 0
    # As many forwards on every rank, the last ones empty where a share is shorter: fsdp gathers
    # parameters in each, and a rank that stopped early would leave the others waiting.
    for start in range(share.start, share.start + -(-len(x) // world_size), batch_size):
        stop = min(start + batch_size, share.stop)
        logits = model(x[start:stop])
        labels = y[start:stop].to(logits.device)
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        correct += (logits.argmax(1) == labels).sum().item()
    loss_sum, correct = (sum(column) for column in zip(*all_gather([loss_sum, correct])))
    return loss_sum / len(x), correct / len(x)


class TrainingDiverged(RuntimeError):
    """The loss, the test loss or the weights became nan or inf; the message names the step."""


ADVICE = "lower optim.lr or check the data"  # what every TrainingDiverged ends with


def check_finite(window: list[torch.Tensor], step: int, rank: int) -> torch.Tensor | None:
    """The losses of ``window``, the steps up to ``step``, stacked (None if it is empty), or TrainingDiverged naming the
    first that is not finite."""
    if not window:
        return None
    losses = torch.stack(window)
    bad = (~torch.isfinite(losses)).nonzero()  # one device sync
    if len(bad):
        first = bad[0].item()
        raise TrainingDiverged(
            f"the training loss is {losses[first].item()} at step {step - len(losses) + 1 + first} (rank {rank}); "
            f"{ADVICE}"
        )
    return losses


def first_non_finite(tensors: dict) -> str | None:
    """The name of the first floating-point tensor in ``tensors`` (a state_dict) holding a nan or an inf."""
    for name, tensor in tensors.items():
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not tensor.isfinite().all():
            return name
    return None


class Precision:
    """``amp=off|bf16|fp16`` on ``device``. bf16 keeps fp32's exponent range, so it needs no loss
    scaling; fp16 does, or small gradients underflow to zero."""

    def __init__(self, amp: str, device: torch.device) -> None:
        dtype = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[amp]
        self.autocast = partial(torch.autocast, device.type, dtype=dtype, enabled=dtype is not None)
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
