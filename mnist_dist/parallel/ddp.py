"""A hand-written DistributedDataParallel in one file that imports only torch: copy it beside your script.

The user writes the same lines as with torch DDP, and gradients are averaged when ``backward()`` returns::

    model = DistributedDataParallel(model.to(device))   # after init_process_group
    loss_fn(model(x), y).backward()                     # .grad now holds the average over the ranks
    optimizer.step()

apex's 2018 design in public APIs, issuing the collectives torch's C++ reducer issues, on the same bucket
layouts, so that the two compute the same bits. Each gradient is multiplied by 1/world_size as it is copied
into its bucket, and a bucket is all-reduced once its last gradient is final
(``register_post_accumulate_grad_hook``), in bucket order, while autograd goes on; at the end of backward
(the autograd engine's callback queue, the one private call, which torch DDP and FSDP use too) the rest is
sent, waited for, and written into ``.grad``. On CUDA the copies and all-reduces run on a side stream of
the parameters' device. What each knob does: the class's docstring; the design and where it differs from
torch DDP on purpose: mnist_dist's docs/ddp.md. Timing is optional: ``model.clock``, an object with
``mark(name)``, is stamped at torch's four moments of a backward (compute_start, comm_start, compute_end,
comm_end); None (the default) stamps nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.profiler import record_function

MIB = 2**20
DEFAULT_CAP_MB, FIRST_CAP_MB = 25, 1  # torch DDP's bucket_cap_mb default, and its first bucket's cap then


@torch.no_grad()
def broadcast_from(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Every rank takes rank ``src``'s ``tensors`` (a collective: every rank calls, in the same order); one
    broadcast per device and dtype, flattened: a BatchNorm net's many small buffers cost one latency."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in group])
        dist.broadcast(flat, src=src)
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def _view(flat: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    # The parameter's own layout (channels_last stays channels_last), as torch's bucket views: a gradient
    # then lands where torch's would, and the sum of each element is the same sum.
    dense = any(param.is_contiguous(memory_format=f) for f in (torch.contiguous_format, torch.channels_last))
    if dense:
        return flat.as_strided(param.shape, param.stride(), offset)
    return flat[offset : offset + param.numel()].view(param.shape)


class Bucket:
    """Gradients that travel together: this rank's share of their average in, the sum over the ranks out."""

    def __init__(self, indices: list[int], params: list[torch.Tensor], compress_bf16: bool, world_size: int):
        self.indices, self.pending, self.work, self.sent = indices, len(indices), None, None
        first = params[indices[0]]
        self.numel = sum(params[i].numel() for i in indices)
        compress = compress_bf16 and first.dtype == torch.float32
        # A lone contiguous gradient is all-reduced in its .grad: no copy in, no copy out, no buffer.
        lone = len(indices) == 1 and not compress and first.is_contiguous()
        self.buffer = None if lone else first.new_empty(self.numel)
        self.wire = [first.new_empty(self.numel, dtype=torch.bfloat16) for _ in range(world_size)] if compress else []
        offsets = accumulate([params[i].numel() for i in indices], initial=0)
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

    def finish(self) -> None:
        if self.wire:
            torch.sum(torch.stack(self.wire), dim=0, dtype=torch.float32, out=self.buffer)

    def write_back(self, params: list[torch.Tensor], used: list[bool] | None, as_view: bool) -> None:
        for i, view in zip(self.indices, self.views):
            param, source = params[i], self.sent if view is None else view
            if used is not None and not used[i] or not param.requires_grad:  # .grad untouched, as torch DDP
                continue
            if param.grad is not None and param.grad.data_ptr() == source.data_ptr():
                continue  # reduced where it lies
            if param.grad is None or as_view and view is not None:
                param.grad = source if view is None or as_view else source.clone()
            else:
                param.grad.copy_(source)
        self.pending, self.work, self.sent = len(self.indices), None, None


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


class DistributedDataParallel(nn.Module, Joinable):
    """Averages gradients across the default process group with bucketed, overlapped all-reduce.

    Args:
        module: the model, already on this rank's device.
        bucket_cap_mb: MiB per bucket, as torch DDP's: None is its default, 25 with the first bucket capped at
            1 so that the first all-reduce starts early in backward; a number caps every bucket.
        overlap: all-reduce while backward runs. False waits for the end of backward (apex's
            ``delay_allreduce``), for comparison.
        find_unused_parameters: a parameter that requires grad but gets none counts as a zero gradient (one
            more small all-reduce per step finds those used on no rank). Off by default: it is usually a
            bug, reported by name.
        broadcast_buffers: give every rank rank 0's buffers at the start of forward, as torch DDP.
        gradient_as_bucket_view: each ``.grad`` becomes a view of its bucket after its first synchronised
            backward, as torch DDP's option: one copy and one gradient's memory fewer.
        compress_bf16: send fp32 gradients as bf16 (half the bytes) and add them up in fp32.
        peer_wait_s: on gloo, how long a backward waits for the other ranks' share before it raises, naming
            the likely cause: ranks that run different numbers of steps without ``join()`` would otherwise
            hang for gloo's half hour. Raise it if a rank is legitimately that much slower (evaluating alone).
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
        self.module = module
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.compress_bf16 = compress_bf16
        self.clock = None  # an object with mark(name) to time backward (see the module's docstring)
        self.world_size = dist.get_world_size()
        # NCCL's wait does not block the host (its own watchdog ends a hang); gloo's can end after a while.
        self._peer_wait = timedelta(seconds=peer_wait_s) if dist.get_backend() == "gloo" else None
        self._backwards = 0  # synchronised backward passes finished
        cap = int((DEFAULT_CAP_MB if bucket_cap_mb is None else bucket_cap_mb) * MIB)
        self._caps = [FIRST_CAP_MB * MIB, cap] if bucket_cap_mb is None else [cap]
        named = list(module.named_parameters())
        self._names, self._params = [n for n, _ in named], [p for _, p in named]
        self._replicated_buffers = list(module.buffers())
        tensors = [*self._params, *self._replicated_buffers]
        self._device = tensors[0].device if tensors else torch.device("cpu")
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._sync_enabled = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured at forward, as torch DDP does
        self._sync_buffers_next_forward = True  # torch DDP's require_forward_param_sync
        self._divide_by_initial_world_size = True  # set by join()
        self._scale = 1.0 / self.world_size
        self._planned = False
        self._rebuilt = False  # the plan follows the arrival order (after the plan's first backward)
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self._arrived: dict[int, None] = {}  # this backward's parameters, in hook order
        self._next_bucket = 0  # buckets before this one are launched in this backward
        self._end_queued = False
        self._hooked: set[int] = set()
        broadcast_from(tensors)

    def forward(self, *args, **kwargs):
        self._ensure_plan()
        ranks_in = Join.notify_join_context(self)  # None outside join()
        self._scale = 1.0 / self.world_size
        if ranks_in is not None and not self._divide_by_initial_world_size:
            ranks_in.wait()
            self._scale = 1.0 / ranks_in.result()[0].item()
        if self._broadcasts_buffers_next_forward():
            self._sync_buffers(candidate=True)
        grad_enabled = torch.is_grad_enabled()
        if self._join_config.enable:  # tells the joined ranks whether to shadow this backward
            self._announce_backward_sync(float(grad_enabled and self._sync_enabled))
        self._sync_buffers_next_forward = grad_enabled and self._sync_enabled
        if grad_enabled:
            self._sync_this_backward = self._sync_enabled
        output = self.module(*args, **kwargs)
        if grad_enabled and self._sync_enabled:
            self._mark("compute_start")  # where torch DDP's reducer starts its backward's clock
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad: self._queue_end_of_backward())
        return output

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
        """Parameter names per bucket, in launch order."""
        return [[self._names[i] for i in bucket.indices] for bucket in self._buckets]

    @property
    def bucket_buffers(self) -> list[torch.Tensor]:
        """The memory this wrapper holds besides ``.grad``: flat buffers (a lone gradient has none) and
        compress_bf16's bf16 copies."""
        return [t for b in self._buckets for t in ([b.buffer] if b.buffer is not None else []) + b.wire]

    def _mark(self, name: str) -> None:
        if self.clock is not None:
            self.clock.mark(name)

    def _ensure_plan(self) -> None:
        # The first layout for the parameters that require grad now: at the first step, or when one that
        # is in no bucket was unfrozen (torch DDP would never average it). One frozen later keeps its place
        # and sends zeros, as torch's unused ones do: the other gradients keep their place in the sum.
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        if self._planned and all(i in self._bucket_of for i in trainable):
            return
        self._planned = True
        for index, param in enumerate(self._params):  # a frozen parameter cannot take a hook
            if param.requires_grad and index not in self._hooked:
                param.register_post_accumulate_grad_hook(self._make_hook(index))
                self._hooked.add(index)
        # As torch DDP: without find_unused_parameters, one bucket per dtype until the order is known; with
        # it, the caps in parameters() order, kept for good. Buckets sorted by first parameter, reversed.
        caps = self._caps if self.find_unused_parameters else [2**62]
        self._plan(sorted(assign(trainable, self._params, caps), key=min, reverse=True) if trainable else [])
        self._rebuilt = self.find_unused_parameters
        if dist.get_backend() == "gloo" and any(self._params[i].dtype == torch.float16 for i in trainable):
            warnings.warn("fp16 gradients on gloo: slow and fp16-rounded sums; prefer bf16 or fp32", stacklevel=3)

    def _rebuild(self) -> None:
        # Every rank must build the same buckets (collectives in the same order and sizes, or they deadlock
        # or mix tensors up): rank 0's arrival order, then what it never saw in reverse registration order.
        agreed = [list(self._arrived)]
        dist.broadcast_object_list(agreed, src=0)
        order = list(dict.fromkeys(agreed[0]))
        order += [i for i, p in reversed(list(enumerate(self._params))) if p.requires_grad and i not in order]
        self._plan(assign(order, self._params, self._caps))
        self._rebuilt = True

    def _plan(self, groups: list[list[int]]) -> None:
        self._buckets = [Bucket(g, self._params, self.compress_bf16, self.world_size) for g in groups]
        self._bucket_of = {i: bucket for bucket in self._buckets for i in bucket.indices}

    def _queue_end_of_backward(self) -> None:
        # No public API runs code when a backward pass ends. torch DDP (_DDPSink) and FSDP queue a callback on
        # the autograd engine, which runs it after the last gradient of the current graph task; so does this.
        # Queued when backward first reaches this wrapper's outputs, the task is the backward the user called,
        # not a nested one (re-entrant activation checkpointing); a parameter's hook queues it for a backward
        # that did not start from the outputs.
        if not self._end_queued:
            self._end_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if not self._sync_this_backward:
                return
            self._queue_end_of_backward()
            bucket = self._bucket_of.get(index)
            if index in self._arrived:  # a second gradient in this backward (re-entrant checkpoint)
                if bucket is not None and bucket.work is not None:
                    raise RuntimeError(
                        f"{self._names[index]} got a second gradient in one backward after its bucket was "
                        "sent; pass overlap=False, or checkpoint with use_reentrant=False"
                    )
                return
            self._arrived[index] = None
            if bucket is not None:
                bucket.pending -= 1
                if self.overlap:
                    self._launch_ready_buckets()

        return hook

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
                    bucket.finish()
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
        if self._peer_wait is None:
            work.wait()
            return
        try:
            work.wait(self._peer_wait)
        except RuntimeError as error:
            if "timed out" not in str(error).lower():
                raise
            # Worded without "time out": a launcher must not take this rank for one that waited on a stuck peer.
            raise RuntimeError(
                f"rank {dist.get_rank()} waited {self._peer_wait.total_seconds():g} s for the other ranks in the "
                f"all-reduce of its backward pass {self._backwards + 1}, and they never joined it: the ranks ran "
                "different numbers of steps (a data set that does not split evenly?), or one is stuck. Give every "
                "rank the same number of batches, or train inside `with model.join():`"
            ) from None

    # join(): uneven inputs, with torch DDP's semantics. torch's Join runs the protocol: a rank out of inputs
    # leaves its loop and, in Join.__exit__, shadows each iteration the others still run (main_hook below)
    # until all have joined. Each iteration starts with notify_join_context (an all-reduce: how many ranks
    # are in), then: the buffer broadcast when that forward broadcasts, from the highest rank still in (rank
    # 0 may have joined with stale buffers); whether the backward synchronises (so no_sync() iterations are
    # shadowed too); the buckets (a joined rank sends zeros), the used-parameter all-reduce, the rebuild.
    def join(
        self, divide_by_initial_world_size: bool = True, enable: bool = True, throw_on_early_termination: bool = False
    ) -> Join:
        """Train on uneven inputs as with torch DDP's ``join()``: ``with model.join():`` around the loop.

        Args:
            divide_by_initial_world_size: divide by the world size at wrap time (a joined rank counts as a
                zero gradient); False divides by the number of ranks still training.
            enable: False makes the context manager do nothing (no per-iteration collectives).
            throw_on_early_termination: raise on every rank as soon as one runs out, instead.
        """
        self._divide_by_initial_world_size = divide_by_initial_world_size
        return Join([self], enable, throw_on_early_termination)

    def join_hook(self, **kwargs) -> JoinHook:
        return _ShadowBackward(self)

    @property
    def join_device(self) -> torch.device:
        return self._device

    @property
    def join_process_group(self):
        return dist.group.WORLD

    def _broadcasts_buffers_next_forward(self) -> bool:
        return self.broadcast_buffers and self._sync_buffers_next_forward and bool(self._replicated_buffers)

    def _sync_buffers(self, candidate: bool) -> None:
        broadcast_from(self._replicated_buffers, self._common_rank(candidate) if self._join_config.enable else 0)

    def _common_rank(self, candidate: bool) -> int:
        """The highest rank among the candidates (a MAX all-reduce every rank calls)."""
        rank = torch.tensor([dist.get_rank() if candidate else -1], device=self._device)
        dist.all_reduce(rank, op=dist.ReduceOp.MAX)
        return int(rank.item())

    def _announce_backward_sync(self, this_rank: float) -> float:
        """How many ranks synchronise this iteration's backward (an all-reduce every rank calls)."""
        flag = torch.tensor([this_rank], device=self._device)
        dist.all_reduce(flag)
        return flag.item()


class _ShadowBackward(JoinHook):
    """What a joined rank does for each iteration the others run, and once all have joined."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self.ddp = ddp

    def main_hook(self) -> None:
        ddp = self.ddp
        ddp._ensure_plan()
        if ddp._broadcasts_buffers_next_forward():
            ddp._sync_buffers(candidate=False)
        should_sync = ddp._announce_backward_sync(0.0) > 0
        ddp._sync_buffers_next_forward = should_sync
        if not should_sync:
            return
        for work in [bucket.send_zeros(ddp._params) for bucket in ddp._buckets]:
            work.wait()
        if ddp.find_unused_parameters:
            ddp._used_anywhere([])
        if not ddp._rebuilt:
            ddp._rebuild()

    def post_hook(self, is_last_joiner: bool) -> None:
        ddp = self.ddp
        broadcast_from([*ddp._params, *ddp._replicated_buffers], ddp._common_rank(candidate=is_last_joiner))


def _tensors(output) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []


def _refuse_sparse_gradients(module: nn.Module) -> None:
    """At wrap time, naming the parameter: a sparse gradient has no place in a flat buffer."""
    for name, child in module.named_modules():
        if isinstance(child, (nn.Embedding, nn.EmbeddingBag)) and child.sparse and child.weight.requires_grad:
            raise ValueError(
                f"{name + '.' if name else ''}weight gets sparse gradients, which this DistributedDataParallel "
                "does not average; construct it with sparse=False, or use torch's DistributedDataParallel"
            )
