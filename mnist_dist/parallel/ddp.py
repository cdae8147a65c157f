"""A hand-written DistributedDataParallel, small enough to read in one sitting and copy.

It is a modern version of NVIDIA apex's 2018 design, written only with public PyTorch APIs.

**Same start.** At wrap time rank 0's parameters and buffers are broadcast, so every replica starts
identical; identical averaged gradients then keep them identical. Buffers (BatchNorm's running
statistics) are not gradients: each rank updates its own in forward, so, as torch DDP does, rank 0's
are broadcast again before every synchronised forward.

**Buckets.** One all-reduce per gradient pays a message's latency per tensor; one all-reduce of
everything after backward cannot overlap with compute. So gradients are copied into flat buckets of
at most ``message_size`` elements (one dtype per bucket: a flat buffer has one dtype), and a bucket is
all-reduced as soon as its last gradient is ready, while autograd goes on with earlier layers.

**Order.** Buckets overlap only if they fill in the order backward produces gradients, which
``parameters()`` does not tell in general. The first backward therefore records the order in which
``register_post_accumulate_grad_hook`` fires (after a parameter's ``.grad`` is final for this
backward) and all-reduces everything at its end. Rank 0's order is then broadcast so that every rank
builds the same buckets: collectives must be issued in the same order and sizes on every rank, or they
deadlock or mix tensors up. The plan stays fixed until the set of parameters that require grad changes.
Buckets are launched strictly in plan order (a full bucket waits for the ones before it), so a rank
whose hooks fire in a slightly different order still issues the same sequence of collectives.

**Finish.** ``finish_gradient_sync()`` is called between ``backward()`` and ``optimizer.step()``. It
launches what is left, waits for every all-reduce and writes the averaged gradients back to ``.grad``.
It is explicit rather than hidden in an autograd callback: the training step shows where communication
is waited for, and that wait (the *exposed* communication) is easy to time.

On CPU, gloo runs ``all_reduce(async_op=True)`` on its own threads, which is the overlap. On CUDA, the
copy into a bucket and its all-reduce are issued on a side stream that first waits for the compute
stream (the gradient must be written before it is read); finishing makes the compute stream wait for
the side stream. Gradients are divided by the world size *before* the sum, as torch DDP does, so that
low-precision buckets do not overflow.

Usage::

    model = DistributedDataParallel(model.to(device))   # after init_process_group
    loss_fn(model(x), y).backward()
    model.finish_gradient_sync()
    optimizer.step()
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class _Bucket:
    indices: list[int]  # positions in the wrapper's parameter list, in plan order
    buffer: torch.Tensor  # flat, one dtype
    pending: int = 0  # gradients still to arrive in this backward
    work: dist.Work | None = None
    wire: list[torch.Tensor] = field(default_factory=list)  # compress_bf16: one bf16 copy per rank


@dataclass
class _Step:
    """What one synchronised backward has seen so far."""

    arrived: list[int] = field(default_factory=list)  # parameter indices, in hook order
    next_bucket: int = 0  # buckets before this one are launched


class DistributedDataParallel(nn.Module):
    """Averages gradients across the default process group with bucketed, overlapped all-reduce.

    Args:
        module: the model, already on this rank's device.
        message_size: most elements per bucket (1,000,000 = 4 MB of fp32; a parameter larger than
            that gets a bucket of its own). Small buckets start communicating early in backward;
            large ones send fewer messages.
        overlap: all-reduce while backward runs. False waits for the end of backward (apex's
            ``delay_allreduce``), for comparison.
        find_unused_parameters: a parameter that requires grad but gets none counts as a zero
            gradient. Off by default: it is usually a bug, reported by name.
        broadcast_buffers: give every rank rank 0's buffers before each synchronised forward.
        compress_bf16: send fp32 gradients as bf16 (half the bytes) and add them up in fp32: an
            all-gather of bf16 copies rather than an all-reduce, since an all-reduce would also
            accumulate in bf16. Worth it where the network, not compute, is the bottleneck.
    """

    def __init__(
        self,
        module: nn.Module,
        message_size: int = 1_000_000,
        overlap: bool = True,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        compress_bf16: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.message_size = message_size
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.compress_bf16 = compress_bf16
        self.world_size = dist.get_world_size()
        named = list(module.named_parameters())
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._sync_enabled = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured at forward, as torch DDP does
        self._plan_key: tuple[bool, ...] | None = None  # requires_grad flags the plan was built for
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        self._step = _Step()
        device = self._params[0].device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._replicated_buffers = list(module.buffers())
        self._broadcast_from_rank0([*self._params, *self._replicated_buffers])
        for index, param in enumerate(self._params):
            param.register_post_accumulate_grad_hook(self._make_hook(index))

    @torch.no_grad()
    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        # A few small tensors (parameters once per run, buffers per step): one collective each is
        # cheap enough and keeps this obvious.
        for tensor in tensors:
            dist.broadcast(tensor, src=0)

    def forward(self, *args, **kwargs):
        key = tuple(p.requires_grad for p in self._params)
        if key != self._plan_key:  # first step, or layers were (un)frozen: record the order again
            self._plan_key, self._buckets, self._bucket_of = key, [], {}
        self._sync_this_backward = self._sync_enabled
        if self.broadcast_buffers and self._sync_enabled and torch.is_grad_enabled():
            self._broadcast_from_rank0(self._replicated_buffers)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward inside this block only accumulate local gradients (accumulation)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @property
    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (empty until the first synchronised backward)."""
        return [[self._names[i] for i in bucket.indices] for bucket in self._buckets]

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self._sync_this_backward:
                return
            self._step.arrived.append(index)
            bucket = self._bucket_of.get(index)
            if bucket is None:  # no plan yet: this backward only records the order
                return
            bucket.pending -= 1
            if self.overlap:
                self._launch_ready_buckets()

        return hook

    def _launch_ready_buckets(self, everything: bool = False) -> None:
        while self._step.next_bucket < len(self._buckets):
            bucket = self._buckets[self._step.next_bucket]
            if bucket.pending and not everything:
                return
            self._launch(bucket)
            self._step.next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            grads = [self._params[i].grad for i in bucket.indices]
            torch.cat([g.reshape(-1) for g in grads], out=bucket.buffer)
            bucket.buffer.div_(self.world_size)
            if bucket.wire:
                bucket.wire[dist.get_rank()].copy_(bucket.buffer)
                bucket.work = dist.all_gather(bucket.wire, bucket.wire[dist.get_rank()], async_op=True)
            else:
                bucket.work = dist.all_reduce(bucket.buffer, async_op=True)

    def finish_gradient_sync(self) -> None:
        """Waits until every gradient is averaged across ranks; call before ``optimizer.step()``."""
        if not self._sync_this_backward:
            return
        if not self._buckets:
            self._build_plan()
        self._handle_unused()
        self._launch_ready_buckets(everything=True)
        for bucket in self._buckets:
            bucket.work.wait()
            if bucket.wire:  # the fp32 sum of every rank's bf16 share
                torch.sum(torch.stack(bucket.wire), dim=0, dtype=torch.float32, out=bucket.buffer)
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        with torch.no_grad():
            for bucket in self._buckets:
                offset = 0
                for i in bucket.indices:
                    grad = self._params[i].grad
                    grad.copy_(bucket.buffer[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
                bucket.pending, bucket.work = len(bucket.indices), None
        self._step = _Step()

    def _handle_unused(self) -> None:
        arrived = set(self._step.arrived)
        unused = [i for i in self._bucket_of if i not in arrived]
        if unused and not self.find_unused_parameters:
            names = ", ".join(self._names[i] for i in unused)
            raise RuntimeError(
                f"parameters that require grad got no gradient in this backward: {names}. "
                "Use them in forward, set requires_grad=False, or pass find_unused_parameters=True "
                "(mode.find_unused_parameters=true)."
            )
        for i in unused:  # other ranks may have used them: contribute zeros to the average
            param = self._params[i]
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            self._bucket_of[i].pending -= 1

    def _build_plan(self) -> None:
        recorded = self._step.arrived
        # Every rank must build the same buckets: take rank 0's arrival order.
        agreed = [recorded]
        dist.broadcast_object_list(agreed, src=0)
        order = list(dict.fromkeys(agreed[0]))
        # Parameters rank 0 never saw come last, in reverse registration order (roughly backward's).
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        seen = set(order)
        order += [i for i in reversed(trainable) if i not in seen]
        self._buckets = []
        open_buckets: dict[torch.dtype, tuple[list[int], int]] = {}  # dtype -> (indices, elements)
        for i in order:
            dtype, numel = self._params[i].dtype, self._params[i].numel()
            indices, size = open_buckets.get(dtype, ([], 0))
            if indices and size + numel > self.message_size:
                self._add_bucket(indices)
                indices, size = [], 0
            open_buckets[dtype] = (indices + [i], size + numel)
        for indices, _ in open_buckets.values():
            self._add_bucket(indices)
        if dist.get_backend() == "gloo" and torch.float16 in open_buckets:
            warnings.warn(
                "fp16 gradients on gloo: gloo sums fp16 slowly and with fp16 rounding; "
                "prefer bf16 or fp32 gradients on CPU",
                stacklevel=3,
            )
        # This backward's hooks fired before the plan existed: count them in now.
        for i in set(recorded):
            self._bucket_of[i].pending -= 1

    def _add_bucket(self, indices: list[int]) -> None:
        first = self._params[indices[0]]
        numel = sum(self._params[i].numel() for i in indices)
        bucket = _Bucket(indices, torch.empty(numel, dtype=first.dtype, device=first.device), len(indices))
        if self.compress_bf16 and first.dtype == torch.float32:
            bucket.wire = [
                torch.empty(numel, dtype=torch.bfloat16, device=first.device) for _ in range(self.world_size)
            ]
        self._buckets.append(bucket)
        self._bucket_of.update((i, bucket) for i in indices)
