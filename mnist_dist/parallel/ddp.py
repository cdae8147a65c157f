"""A hand-written DistributedDataParallel in one file that imports only torch: copy it beside your script.

    model = DistributedDataParallel(model.to(device))   # after init_process_group
    loss_fn(model(x), y).backward()                     # .grad now holds the average over the ranks
    optimizer.step()

It issues the collectives of torch's C++ reducer on the same buckets, so the two compute the same bits. The
design, and where it differs from torch DDP on purpose: docs/ddp.md in mnist_dist.
"""

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.profiler import record_function


@torch.no_grad()
def broadcast_from(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Every rank takes rank ``src``'s ``tensors`` (a collective: every rank calls, in the same order); one
    broadcast per device and dtype, flattened: a BatchNorm net's many small buffers cost one latency."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in group])
        dist.broadcast(flat, src=src)
        for tensor, part in zip(group, flat.split([tensor.numel() for tensor in group])):
            tensor.copy_(part.view_as(tensor))


def _view(flat: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    # The parameter's own layout (channels_last stays channels_last), as torch's bucket views: a gradient
    # then lands where torch's would, and the sum of each element is the same sum.
    if param.is_contiguous() or param.is_contiguous(memory_format=torch.channels_last):
        return flat.as_strided(param.shape, param.stride(), offset)
    return flat[offset : offset + param.numel()].view(param.shape)


class Bucket:
    """Gradients that travel together: this rank's share of their average in, the sum over the ranks out."""

    def __init__(self, indices: list[int], params: list[torch.Tensor], compress_bf16: bool, world_size: int):
        self.indices, self.pending, self.work, self.sent = indices, len(indices), None, None
        first, sizes = params[indices[0]], [params[i].numel() for i in indices]
        self.numel = sum(sizes)
        compress = compress_bf16 and first.dtype == torch.float32
        # A lone contiguous gradient is all-reduced in its .grad: no copy in, no copy out, no buffer.
        lone = len(indices) == 1 and not compress and first.is_contiguous()
        self.buffer = None if lone else first.new_empty(self.numel)
        self.wire = [first.new_empty(self.numel, dtype=torch.bfloat16) for _ in range(world_size)] if compress else []
        offsets = accumulate(sizes, initial=0)
        self.views = [None if lone else _view(self.buffer, params[i], o) for i, o in zip(indices, offsets)]

    def send(self, params: list[torch.Tensor], scale: float) -> None:
        """This rank's gradients times ``scale`` into the bucket, and the sum over the ranks started."""
        for i, view in zip(self.indices, self.views):
            grad = params[i].grad
            if view is None:  # lone: in place, unless unused here (zeros) or of another layout
                self.sent = torch.zeros_like(params[i]) if grad is None else grad
                self.sent = self.sent.mul_(scale) if self.sent.is_contiguous() else (grad * scale).contiguous()
            elif grad is None:  # unused here (find_unused_parameters): contribute zeros
                view.zero_()
            elif grad.data_ptr() == view.data_ptr():  # already there (gradient_as_bucket_view)
                view.mul_(scale)
            else:  # the copy and the scaling in one pass, as torch's reducer (mul_out)
                torch.mul(grad, scale, out=view)
        self.work = self._start(self.sent if self.buffer is None else self.buffer)

    def _start(self, tensor: torch.Tensor) -> dist.Work:
        if not self.wire:
            return dist.all_reduce(tensor, async_op=True)
        # compress_bf16: every rank's bf16 copy gathered and added up in fp32 (an all-reduce would add in bf16)
        self.wire[dist.get_rank()].copy_(tensor)
        return dist.all_gather(self.wire, self.wire[dist.get_rank()], async_op=True)

    def send_zeros(self, params: list[torch.Tensor]) -> dist.Work:
        """A joined rank's share (zeros), in the collective the ranks still training launch."""
        zeros = self.buffer if self.buffer is not None else params[self.indices[0]].new_empty(self.numel)
        return self._start(zeros.zero_())

    def write_back(self, params: list[torch.Tensor], used: list[bool] | None, as_view: bool) -> None:
        if self.wire:
            torch.sum(torch.stack(self.wire), dim=0, dtype=torch.float32, out=self.buffer)
        for i, view in zip(self.indices, self.views):
            param, source = params[i], self.sent if view is None else view
            if used is not None and not used[i] or not param.requires_grad:  # .grad untouched, as torch DDP
                continue
            if param.grad is None or as_view and view is not None:
                param.grad = source if view is None or as_view else source.clone()
            elif param.grad.data_ptr() != source.data_ptr():  # else it was reduced where it lies
                param.grad.copy_(source)


def assign(order: list[int], params: list[torch.Tensor], caps: list[int]) -> list[list[int]]:
    """torch's compute_bucket_assignment_by_size: per dtype and device, parameters in ``order`` fill a bucket
    until it holds at least its cap in bytes (``caps`` in turn, the last repeating); buckets in closing order."""
    buckets: list[list[int]] = []
    open_: dict[tuple, tuple[list[int], int, int]] = {}  # key -> (indices, bytes, which cap)
    for i in order:
        key = (params[i].dtype, params[i].device)
        indices, size, cap = open_.get(key, ([], 0, 0))
        indices, size = [*indices, i], size + params[i].numel() * params[i].element_size()
        if size >= caps[cap]:
            buckets.append(indices)
            indices, size, cap = [], 0, min(cap + 1, len(caps) - 1)
        open_[key] = (indices, size, cap)
    return buckets + [indices for indices, _, _ in open_.values() if indices]


class DistributedDataParallel(nn.Module, Joinable, JoinHook):
    """Averages gradients across the default process group with bucketed all-reduce, overlapped with backward.

    Args (as torch DDP's where it has them; docs/ddp.md says more):
        bucket_cap_mb: MiB per bucket; None is torch's 25, with the first bucket capped at 1.
        overlap: all-reduce while backward runs; False waits for its end (apex's delay_allreduce).
        find_unused_parameters: a parameter that gets no gradient sends zeros; off, it is an error naming it.
        broadcast_buffers: rank 0's buffers to every rank at the start of forward.
        gradient_as_bucket_view: each ``.grad`` becomes a view of its bucket (one copy and one gradient fewer).
        compress_bf16: fp32 gradients travel as bf16 (half the bytes) and are added up in fp32.
        peer_wait_s: on gloo, a backward that waits this long for the other ranks raises, naming the likely
            cause (uneven steps without ``join()``), where gloo would hang for half an hour.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float | None = None,
        overlap: bool = True,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        gradient_as_bucket_view: bool = False,
        compress_bf16: bool = False,
        peer_wait_s: float = 60.0,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        _refuse_sparse_gradients(module)
        self.module, self.overlap, self.find_unused_parameters = module, overlap, find_unused_parameters
        self.broadcast_buffers, self.gradient_as_bucket_view = broadcast_buffers, gradient_as_bucket_view
        self.compress_bf16, self.world_size = compress_bf16, dist.get_world_size()
        self.clock = None  # optional: its mark(name) is called at torch's four moments of a backward
        # NCCL's wait does not block the host (its own watchdog ends a hang); gloo's can end after a while.
        self._peer_wait = timedelta(seconds=peer_wait_s if dist.get_backend() == "gloo" else 0)
        cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 2**20)  # torch's default: 25 MiB, the first 1
        self._caps = [2**20, cap] if bucket_cap_mb is None else [cap]
        named = list(module.named_parameters())
        self._names, self._params = [n for n, _ in named], [p for _, p in named]
        self._replicated_buffers = list(module.buffers())
        tensors = [*self._params, *self._replicated_buffers]
        self._device = tensors[0].device if tensors else torch.device("cpu")
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        # no_sync()'s switch; as torch DDP, forward decides whether its backward syncs and the next forward
        # broadcasts buffers (its require_forward_param_sync)
        self._sync_enabled = self._sync_this_backward = self._sync_buffers_next_forward = True
        self._divide_by_initial_world_size, self._scale = True, 1.0 / self.world_size  # join() sets the first
        self._rebuilt = find_unused_parameters  # buckets cut from rank 0's arrival order (torch keeps the first)
        self._buckets, self._bucket_of, self._hooked = [], {}, set()
        # This backward: its parameters in hook order, the first bucket not launched, its end queued.
        self._arrived, self._next_bucket, self._end_queued = {}, 0, False
        self._backwards = 0  # synchronised backward passes finished, for the peer-wait message
        broadcast_from(tensors)

    def forward(self, *args, **kwargs):
        self._ensure_plan()
        ranks_in = Join.notify_join_context(self)  # None outside join()
        self._scale = 1.0 / self.world_size
        if ranks_in is not None and not self._divide_by_initial_world_size:
            ranks_in.wait()
            self._scale = 1.0 / ranks_in.result()[0].item()
        self._sync_buffers(candidate=True)
        grad_enabled = torch.is_grad_enabled()
        sync = grad_enabled and self._sync_enabled
        if self._join_config.enable:  # tells the joined ranks whether to shadow this backward
            self._all_reduce(float(sync))
        self._sync_buffers_next_forward = sync
        if grad_enabled:
            self._sync_this_backward = self._sync_enabled
        output = self.module(*args, **kwargs)
        if sync:
            self._mark("compute_start")  # where torch DDP's reducer starts its backward's clock
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad: self._queue_end_of_backward())
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward inside this block only accumulate local gradients."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @property
    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[self._names[i] for i in bucket.indices] for bucket in self._buckets]

    @property
    def bucket_buffers(self) -> list[torch.Tensor]:
        """The memory this wrapper holds besides ``.grad`` (a lone gradient has no buffer)."""
        return [t for b in self._buckets for t in [b.buffer, *b.wire] if t is not None]

    def _mark(self, name: str) -> None:
        if self.clock is not None:
            self.clock.mark(name)

    def _ensure_plan(self) -> None:
        # At the first forward, and again when a parameter in no bucket was unfrozen (torch DDP would never
        # average it); one frozen later keeps its place and sends zeros, as torch's unused ones do.
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        if all(i in self._bucket_of for i in trainable):
            return
        for i in set(trainable) - self._hooked:  # not at wrap time: a frozen one takes no hook
            self._params[i].register_post_accumulate_grad_hook(partial(self._on_gradient, i))
        self._hooked.update(trainable)
        # torch's first layout: one bucket per dtype until the order is known; with find_unused_parameters the
        # caps, kept for good. Buckets sorted by first parameter, reversed.
        caps = self._caps if self.find_unused_parameters else [2**62]
        self._plan(sorted(assign(trainable, self._params, caps), key=min, reverse=True))
        self._rebuilt = self.find_unused_parameters
        if dist.get_backend() == "gloo" and any(self._params[i].dtype == torch.float16 for i in trainable):
            warnings.warn("fp16 gradients on gloo: slow and fp16-rounded sums; prefer bf16 or fp32", stacklevel=3)

    def _rebuild(self) -> None:
        # The same buckets on every rank, or collectives deadlock or mix tensors up: rank 0's arrival order,
        # then what it never saw in reverse registration order.
        agreed = [list(self._arrived)]
        dist.broadcast_object_list(agreed, src=0)
        order = agreed[0]
        order += [i for i, p in reversed(list(enumerate(self._params))) if p.requires_grad and i not in order]
        self._plan(assign(order, self._params, self._caps))
        self._rebuilt = True

    def _plan(self, groups: list[list[int]]) -> None:
        self._buckets = [Bucket(g, self._params, self.compress_bf16, self.world_size) for g in groups]
        self._bucket_of = {i: bucket for bucket in self._buckets for i in bucket.indices}

    def _queue_end_of_backward(self) -> None:
        # No public API runs code when a backward ends: as torch DDP and FSDP, a callback on the autograd
        # engine, run after the current graph task's last gradient (docs/ddp.md: why from the outputs).
        if not self._end_queued:
            self._end_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        if not self._sync_this_backward:
            return
        self._queue_end_of_backward()
        bucket = self._bucket_of.get(index)
        if index not in self._arrived:
            self._arrived[index] = None
            if bucket is not None:
                bucket.pending -= 1
                if self.overlap:
                    self._launch_ready_buckets()
        elif bucket is not None and bucket.work is not None:  # a second gradient (re-entrant checkpoint), too late
            raise RuntimeError(
                f"{self._names[index]} got a second gradient in one backward after its bucket was sent; "
                "pass overlap=False, or checkpoint with use_reentrant=False"
            )

    def _launch_ready_buckets(self, everything: bool = False) -> None:
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if bucket.pending and not everything:
                return
            self._mark("comm_start")  # the first bucket's counts
            if self._stream is not None:  # the gradient must be written before the side stream reads it
                self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext(), torch.no_grad():
                bucket.send(self._params, self._scale)
            self._next_bucket += 1

    def _end_of_backward(self) -> None:
        self._end_queued = False
        if not self._arrived:  # e.g. autograd.grad() through the outputs: no .grad was written
            return
        self._mark("compute_end")
        try:
            missing = [
                self._names[i] for i in self._bucket_of if i not in self._arrived and self._params[i].requires_grad
            ]
            if missing and not self.find_unused_parameters:
                raise RuntimeError(
                    f"parameters that require grad got no gradient in this backward: {', '.join(missing)}. "
                    "Use them in forward, set requires_grad=False, or pass find_unused_parameters=True."
                )
            self._launch_ready_buckets(everything=True)
            used = self._used_anywhere(list(self._arrived)) if self.find_unused_parameters else None
            with record_function("DistributedDataParallel.wait"), torch.no_grad():
                for bucket in self._buckets:
                    self._wait(bucket.work)
                if self._stream is not None:
                    torch.cuda.current_stream(self._device).wait_stream(self._stream)
                for bucket in self._buckets:
                    bucket.write_back(self._params, used, self.gradient_as_bucket_view)
            self._mark("comm_end")
            self._backwards += 1
            if not self._rebuilt:
                self._rebuild()
        finally:
            for bucket in self._buckets:
                bucket.pending, bucket.work, bucket.sent = len(bucket.indices), None, None
            self._arrived, self._next_bucket = {}, 0

    def _used_anywhere(self, arrived: list[int]) -> list[bool]:
        # After every bucket, so that all ranks issue their collectives in the same order.
        counts = torch.zeros(len(self._params), dtype=torch.int32, device=self._device)
        counts[arrived] = 1
        self._wait(dist.all_reduce(counts, async_op=True))
        return [bool(count) for count in counts.tolist()]

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait(self._peer_wait)  # timedelta(0) off gloo: no limit
        except RuntimeError as error:
            if not self._peer_wait or "timed out" not in str(error).lower():
                raise
            # Worded without "time out": a launcher must not take this rank for one that waited on a stuck peer.
            raise RuntimeError(
                f"rank {dist.get_rank()} waited {self._peer_wait.total_seconds():g} s for the other ranks in the "
                f"all-reduce of its backward pass {self._backwards + 1}, and they never joined it: the ranks ran "
                "different numbers of steps (a data set that does not split evenly?), or one is stuck. Give every "
                "rank the same number of batches, or train inside `with model.join():`"
            ) from None

    def _sync_buffers(self, candidate: bool) -> None:
        # Under join() from the highest rank still in: rank 0 may have joined with stale buffers.
        if self.broadcast_buffers and self._sync_buffers_next_forward and self._replicated_buffers:
            broadcast_from(self._replicated_buffers, self._highest_rank(candidate) if self._join_config.enable else 0)

    def _highest_rank(self, candidate: bool) -> int:
        return int(self._all_reduce(dist.get_rank() if candidate else -1, dist.ReduceOp.MAX))

    def _all_reduce(self, value: float, op=dist.ReduceOp.SUM) -> float:
        """One number reduced over the ranks (a collective every rank calls)."""
        tensor = torch.tensor([float(value)], device=self._device)
        dist.all_reduce(tensor, op=op)
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
    join_process_group = property(lambda self: dist.group.WORLD)

    def main_hook(self) -> None:
        """A joined rank's part in each iteration the others still run: their collectives, with zeros."""
        self._ensure_plan()
        self._sync_buffers(candidate=False)
        self._sync_buffers_next_forward = self._all_reduce(0.0) > 0
        if not self._sync_buffers_next_forward:
            return
        for work in [bucket.send_zeros(self._params) for bucket in self._buckets]:
            work.wait()
        if self.find_unused_parameters:
            self._used_anywhere([])
        if not self._rebuilt:
            self._rebuild()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Once all have joined: every rank takes the last joiner's parameters and buffers."""
        broadcast_from([*self._params, *self._replicated_buffers], self._highest_rank(is_last_joiner))


def _tensors(output) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else []
    return [t for item in items for t in _tensors(item)]


def _refuse_sparse_gradients(module: nn.Module) -> None:
    """At wrap time, naming the parameter: a sparse gradient has no place in a flat buffer."""
    for name, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse and child.weight.requires_grad:
            raise ValueError(
                f"{name + '.' if name else ''}weight gets sparse gradients, which this DistributedDataParallel "
                "does not average; construct it with sparse=False, or use torch's DistributedDataParallel"
            )
