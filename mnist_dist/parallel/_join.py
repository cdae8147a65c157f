"""``DistributedDataParallel.join()``: training on uneven inputs, with torch DDP's semantics.

torch's generic join context manager (``torch.distributed.algorithms.join.Join``) runs the protocol: a
rank that has run out of inputs leaves its loop and, in ``Join.__exit__``, shadows every iteration the
others still run, until all have joined. Each iteration of a rank still training starts with
``Join.notify_join_context`` (an all-reduce of ones: how many ranks are still in), then, in this order:

1. the buffer broadcast, when that forward broadcasts: from the highest rank still in (rank 0 may have
   joined with stale buffers), agreed by a MAX all-reduce;
2. whether this iteration's backward synchronises (an all-reduce: 1 from every rank still in that does,
   so ``no_sync()`` iterations are shadowed too);
3. the backward's bucket all-reduces, in plan order (a joined rank contributes zeros), and the
   all-reduce of used parameters under ``find_unused_parameters``.

Gradients are divided by the initial world size (``divide_by_initial_world_size=True``, the default), so a
joined rank counts as a zero gradient; or by the number of ranks still in. When all have joined, the last
rank to join broadcasts its parameters and buffers, so every replica ends the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from mnist_dist.parallel.buffers import broadcast_from, broadcast_from_rank0

if TYPE_CHECKING:
    from mnist_dist.parallel.ddp import DistributedDataParallel


class JoinableDDP(Joinable):
    """DistributedDataParallel's ``join()``, and what torch's protocol asks of a Joinable: its hook, device
    and process group."""

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Train on uneven inputs, as torch DDP's ``join()``: wrap the loop in ``with model.join():``; a rank
        that runs out of inputs shadows the others' collectives until every rank is done, contributing
        zero gradients, and the last rank to join gives every rank its parameters and buffers.

        Args:
            divide_by_initial_world_size: divide gradients by the world size at wrap time (a joined rank
                counts as a zero gradient); False divides by the number of ranks still training.
            enable: False makes the context manager do nothing (no per-iteration collectives).
            throw_on_early_termination: raise on every rank as soon as one runs out, instead.
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs) -> DDPJoinHook:
        return DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    @property
    def join_process_group(self):
        return dist.group.WORLD


class DDPJoinHook(JoinHook):
    """What a joined rank does for each iteration the others run, and once all have joined."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if ddp._broadcasts_buffers_next_forward():
            sync_buffers(ddp, candidate=False)
        should_sync = announce_backward_sync(ddp, 0.0) > 0
        ddp._sync_buffers_next_forward = should_sync
        if not should_sync:
            return
        if not ddp._buckets:  # joined before the first synchronised backward: agree on the plan with the rest
            ddp._build_plan()
        works = [bucket.send_zeros() for bucket in ddp._buckets]
        for work in works:
            work.wait()
        if ddp.find_unused_parameters:
            dist.all_reduce(torch.zeros(len(ddp._params), dtype=torch.int32, device=ddp.join_device))

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        broadcast_from([*ddp._params, *ddp._replicated_buffers], common_rank(ddp, candidate=is_last_joiner))


def common_rank(ddp: DistributedDataParallel, candidate: bool) -> int:
    """The highest rank among the candidates (a MAX all-reduce every rank calls)."""
    rank = torch.tensor([dist.get_rank() if candidate else -1], device=ddp.join_device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX)
    return int(rank.item())


def sync_buffers(ddp: DistributedDataParallel, candidate: bool) -> None:
    """The buffer broadcast of one iteration: from rank 0 outside join(), else from the highest rank still in."""
    if not ddp._join_config.enable:
        broadcast_from_rank0(ddp._replicated_buffers)
        return
    broadcast_from(ddp._replicated_buffers, common_rank(ddp, candidate))


def announce_backward_sync(ddp: DistributedDataParallel, this_rank: float) -> float:
    """How many ranks synchronise this iteration's backward (an all-reduce every rank calls)."""
    flag = torch.tensor([this_rank], device=ddp.join_device)
    dist.all_reduce(flag)
    return flag.item()
