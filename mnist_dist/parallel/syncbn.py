"""BatchNorm over the global batch on any backend: gloo on CPU included, where torch's SyncBatchNorm raises. The
weight's and bias's gradients stay this rank's own, for the DDP wrapper to average (as torch's SyncBatchNorm). In
eval mode, or without a process group of more than one rank, a plain BatchNorm."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class SyncBatchNorm(nn.BatchNorm2d):
    """A drop-in for ``nn.BatchNorm1d/2d/3d`` (same parameters and buffers, so state dicts load both ways); a
    BatchNorm2d by class only because torch's common base of the three is private. Any input of 2 or more dims."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")
        momentum, running = 0.0, (self.running_mean, self.running_var)  # None without running statistics
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            # momentum=None: a cumulative average, as BatchNorm's
            momentum = self.momentum if self.momentum is not None else 1.0 / self.num_batches_tracked.item()
        if self.training and dist.is_initialized() and dist.get_world_size() > 1:
            return _GlobalBatchNorm.apply(input, self.weight, self.bias, *running, self.eps, momentum)
        # as BatchNorm's forward: batch statistics in training, or where there are no running ones
        return F.batch_norm(
            input, *running, self.weight, self.bias, self.training or running[0] is None, momentum, self.eps
        )


class _GlobalBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        dims = [d for d in range(x.dim()) if d != 1]  # all but the channels
        xf = x.float()
        count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float32, device=x.device)
        stats = torch.cat([xf.sum(dims), (xf * xf).sum(dims), count])
        dist.all_reduce(stats)
        channels, total = x.shape[1], stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_(min=0)  # biased, as normalised
        invstd = torch.rsqrt(var + eps)
        shape = [1, channels] + [1] * (x.dim() - 2)
        xhat = (xf - mean.view(shape)) * invstd.view(shape)
        y = xhat if weight is None else xhat * weight.view(shape) + bias.view(shape)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.lerp_(mean.to(running_mean.dtype), momentum)
                unbiased = var * total / (total - 1).clamp(min=1)
                running_var.lerp_(unbiased.to(running_var.dtype), momentum)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total = total
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        xhat, invstd, weight = ctx.saved_tensors
        dims = [d for d in range(xhat.dim()) if d != 1]
        shape = [1, xhat.shape[1]] + [1] * (xhat.dim() - 2)
        g = grad_y.float()
        local = torch.cat([g.sum(dims), (g * xhat).sum(dims)])  # this rank's: the parameters' gradients
        summed = local.clone()
        dist.all_reduce(summed)  # every rank's: the input's gradient goes through the global statistics
        channels = xhat.shape[1]
        mean_g, mean_g_xhat = (summed[:channels] / ctx.total), (summed[channels:] / ctx.total)
        scale = invstd if weight is None else invstd * weight.float()
        grad_x = (g - mean_g.view(shape) - xhat * mean_g_xhat.view(shape)) * scale.view(shape)
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight, grad_bias = local[channels:].to(weight.dtype), local[:channels].to(weight.dtype)
        return grad_x.to(grad_y.dtype), grad_weight, grad_bias, None, None, None, None


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """``module`` with every BatchNorm layer replaced by a ``SyncBatchNorm`` holding the same parameters and
    buffers (the counterpart of ``nn.SyncBatchNorm.convert_sync_batchnorm``, for any backend)."""
    if isinstance(module, BATCHNORMS) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
        )
        if module.affine:
            converted.weight, converted.bias = module.weight, module.bias
        converted.running_mean, converted.running_var = module.running_mean, module.running_var
        converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        return converted
    for name, child in module.named_children():
        setattr(module, name, convert_sync_batchnorm(child))
    return module
