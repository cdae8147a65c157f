"""The core DistributedDataParallel (ddp.py) with ``join()``, torch DDP's context for ranks with different numbers
of batches."""

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from mnist_dist.parallel import ddp
from mnist_dist.parallel.ddp import broadcast_from


class DistributedDataParallel(ddp.DistributedDataParallel, Joinable, JoinHook):
    def __init__(self, module, *args, **kwargs) -> None:
        super().__init__(module, *args, **kwargs)
        Joinable.__init__(self)
        self._divide_by_initial_world_size, self._joining = True, False

    def forward(self, *args, **kwargs):
        ranks_in = Join.notify_join_context(self)  # None outside an enabled join()
        self._joining = ranks_in is not None
        output = super().forward(*args, **kwargs)
        if ranks_in is not None and not self._divide_by_initial_world_size:
            ranks_in.wait()
            self._scale = 1.0 / ranks_in.result()[0].item()
        return output

    def _before_module(self, sync: bool) -> None:
        self._scale = 1.0 / self.world_size
        if not self._joining:
            return super()._before_module(sync)
        self._sync_buffers(candidate=True)
        self._all_reduce(float(sync))  # tells the joined ranks whether to shadow this backward

    def _sync_buffers(self, candidate: bool) -> None:
        # Under join() from the highest rank still in: rank 0 may have joined with stale buffers.
        buffers = list(self.module.buffers())
        if self.forward_sync_buffers and self._sync_buffers_next_forward and buffers:
            broadcast_from(buffers, self._highest_rank(candidate), self.process_group)

    def _highest_rank(self, candidate: bool) -> int:
        return int(self._all_reduce(dist.get_rank(self.process_group) if candidate else -1, dist.ReduceOp.MAX))

    def _all_reduce(self, value: float, op=dist.ReduceOp.SUM) -> float:
        """One number reduced over the ranks (a collective every rank calls)."""
        tensor = torch.tensor([float(value)], device=self._device)
        dist.all_reduce(tensor, op=op, group=self.process_group)
        return tensor.item()

    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """``with model.join():`` around a loop whose ranks run different numbers of steps, with torch DDP's
        ``join()`` semantics and arguments: a rank out of inputs shadows the collectives of each iteration the
        others still run (docs/ddp.md); ``divide_by_initial_world_size=False`` divides by the ranks still in."""
        self._divide_by_initial_world_size = divide_by_initial_world_size
        return Join([self], enable, throw_on_early_termination)

    def join_hook(self, **kwargs) -> JoinHook:
        return self  # main_hook and post_hook below

    join_device = property(lambda self: self._device)
    join_process_group = property(lambda self: self.process_group)

    def main_hook(self) -> None:
        """A joined rank's part in each iteration the others still run: their collectives, with zeros."""
        self._ensure_plan()
        self._sync_buffers(candidate=False)
        self._sync_buffers_next_forward = self._all_reduce(0.0) > 0
        if not self._sync_buffers_next_forward:
            return
        for bucket in self._buckets:
            bucket.buffer.zero_()
            dist.all_reduce(bucket.buffer, group=self.process_group)
        if self.find_unused_parameters:  # the others' count of the parameters used anywhere; none here
            dist.all_reduce(
                torch.zeros(len(self._params), dtype=torch.int32, device=self._device), group=self.process_group
            )
        if not self._rebuilt:
            self._rebuild()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Once all have joined: every rank takes the last joiner's parameters and buffers."""
        src = self._highest_rank(is_last_joiner)
        broadcast_from([*self._params, *self.module.buffers()], src, self.process_group)
