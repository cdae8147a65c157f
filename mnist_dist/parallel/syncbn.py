"""BatchNorm over the global batch on any backend: gloo on CPU included, where torch's SyncBatchNorm raises. The
weight's and bias's gradients stay this rank's own, for the DDP wrapper to average (as torch's SyncBatchNorm). In
eval mode, or without a process group of more than one rank, a plain BatchNorm."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class SyncBatchNorm(nn.BatchNorm2d):
    """A drop-in for ``nn.BatchNorm1d/2d/3d`` (same parameters and buffers, so state dicts load both ways); a
    BatchNorm2d by class only because torch's common base of the three is private. Any input of 2 or more dims."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        momentum, running = 0.0, (self.running_mean, self.running_var)  # None without running statistics
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            # momentum=None: a cumulative average, as BatchNorm's
            momentum = self.momentum if self.momentum is not None else 1.0 / self.num_batches_tracked.item()
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            # as BatchNorm's forward: batch statistics in training, or where there are no running ones
            return F.batch_norm(
                input, *running, self.weight, self.bias, self.training or running[0] is None, momentum, self.eps
            )
        x, channels, dims = input.float(), input.shape[1], [d for d in range(input.dim()) if d != 1]
        count = torch.tensor([x.numel() // channels], dtype=x.dtype, device=x.device)
        # Sums over every rank's batch; backward sums the statistics' gradients over the ranks, so that the input's
        # gradient goes through the global batch as one process's would.
        stats = _AllReduce.apply(torch.cat([x.sum(dims), (x * x).sum(dims), count]))
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp(min=0)  # biased, as normalised
        if running[0] is not None:
            with torch.no_grad():
                running[0].lerp_(mean.to(running[0].dtype), momentum)
                running[1].lerp_((var * total / (total - 1).clamp(min=1)).to(running[1].dtype), momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(input.dtype)


class _AllReduce(torch.autograd.Function):
    """A sum over the ranks, in forward and in backward (torch.distributed.nn.functional's is deprecated, and
    refused under torch.compile)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor)
        return tensor

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _AllReduce.forward(ctx, grad)


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """``module`` with every BatchNorm layer replaced by a ``SyncBatchNorm`` holding the same parameters and
    buffers (the counterpart of ``nn.SyncBatchNorm.convert_sync_batchnorm``, for any backend)."""
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        converted.weight, converted.bias = module.weight, module.bias  # None without affine, as BatchNorm's
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        setattr(module, name, convert_sync_batchnorm(child))
    return module
