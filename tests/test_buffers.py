"""Rank 0's buffers reach every rank in as few collectives as their dtypes allow, each back in its place."""

import torch
import torch.distributed as dist

from mnist_dist.model import FastNet
from mnist_dist.parallel.ddp import broadcast_from


def test_buffers_travel_in_one_broadcast_per_dtype(one_rank, monkeypatch):
    calls = []
    real = dist.broadcast
    monkeypatch.setattr(dist, "broadcast", lambda tensor, **kw: calls.append(tensor.dtype) or real(tensor, **kw))
    buffers = list(FastNet().buffers())  # 3 BatchNorms: running mean and var (float32), batches seen (int64)
    for i, buffer in enumerate(buffers):
        buffer.fill_(i)
    broadcast_from(buffers)
    assert sorted(calls, key=str) == [torch.float32, torch.int64]
    assert [buffer.flatten()[0].item() for buffer in buffers] == list(range(9))  # each back in its place
