"""A hand-written DistributedDataParallel, small enough to read in one sitting and copy.

It is a modern version of NVIDIA apex's 2018 design, written with public PyTorch APIs but one: the
user writes the same lines as with torch DDP, and gradients are averaged when ``backward()`` returns::

    model = DistributedDataParallel(model.to(device))   # after init_process_group
    loss_fn(model(x), y).backward()                     # .grad now holds the average over the ranks
    optimizer.step()

**Same start.** At wrap time rank 0's parameters and buffers are broadcast, so every replica starts
identical; identical averaged gradients then keep them identical. Buffers (BatchNorm's running
statistics) are not gradients: each rank updates its own in forward, so rank 0's are broadcast again
at the moments torch DDP broadcasts them: at the start of a forward that follows a forward run with
grad enabled and outside ``no_sync()`` (the first forward after wrapping too), whether the module is
in train or eval mode.

**Buckets.** One all-reduce per gradient pays a message's latency per tensor; one all-reduce of
everything after backward cannot overlap with compute. So gradients are copied into flat buckets of
at most ``message_size`` elements (one dtype per bucket: a flat buffer has one dtype), and a bucket is
all-reduced as soon as its last gradient is ready, while autograd goes on with earlier layers.
Gradients are divided by the world size *before* the sum, as torch DDP does, so that low-precision
buckets do not overflow.

**Order.** Buckets overlap only if they fill in the order backward produces gradients, which
``parameters()`` does not tell in general. The first backward therefore records the order in which
``register_post_accumulate_grad_hook`` fires (after a parameter's ``.grad`` is final for this
backward) and all-reduces everything at its end. Rank 0's order is then broadcast so that every rank
builds the same buckets (``_buckets.py``: the plan, and how a bucket is filled, sent and written
back). The plan stays fixed until the set of parameters that require grad changes. Buckets are
launched strictly in plan order, so a rank whose hooks fire in a slightly different order still
issues the same sequence of collectives.

**End of backward.** No public API runs code when a backward pass ends, so, like torch DDP and FSDP,
the wrapper queues a callback on the autograd engine (``_queue_end_of_backward``, the one private
call). It launches what is left, waits, and writes the averaged gradients back into ``.grad``. What
follows ``backward()`` (clipping, ``GradScaler.unscale_``, the optimizer) therefore sees the averaged
gradients, exactly as with torch DDP. The wrapper times its backward itself (``timing.py``: the host's
clock on CPU, events on the compute stream on CUDA), which is the communication that backward did not
hide; the trainer reads it for ``time/comm_wait_ms``.

**As torch DDP.** What it does as torch DDP (``no_sync()``, several backward passes, frozen and
unused parameters, sparse gradients, ``join()`` in ``_join.py``) and where it differs on purpose are
listed in ``docs/ddp.md``, pattern by pattern as the equivalence tests compare the two wrappers.

On CPU, gloo runs ``all_reduce(async_op=True)`` on its own threads, which is the overlap. On CUDA, the
copy into a bucket and its all-reduce are issued on a side stream that first waits for the compute
stream (the gradient must be written before it is read); the end of backward makes the compute stream
wait for the side stream.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Join
from torch.profiler import record_function

from mnist_dist.parallel._buckets import Bucket, agreed_order, build_buckets, refuse_sparse_gradients
from mnist_dist.parallel._join import JoinableDDP, announce_backward_sync, sync_buffers
from mnist_dist.parallel.buffers import broadcast_from_rank0
from mnist_dist.parallel.timing import BackwardClock


class DistributedDataParallel(nn.Module, JoinableDDP):
    """Averages gradients across the default process group with bucketed, overlapped all-reduce.

    Args:
        module: the model, already on this rank's device.
        message_size: most elements per bucket (1,000,000 = 4 MB of fp32; a parameter larger than
            that gets a bucket of its own). Small buckets start communicating early in backward;
            large ones send fewer messages.
        overlap: all-reduce while backward runs. False waits for the end of backward (apex's
            ``delay_allreduce``), for comparison.
        find_unused_parameters: a parameter that requires grad but gets none counts as a zero
            gradient (one more small all-reduce per step finds those used on no rank). Off by
            default: it is usually a bug, reported by name.
        broadcast_buffers: give every rank rank 0's buffers at the start of forward, as torch DDP.
        gradient_as_bucket_view: after the first synchronised backward each ``.grad`` is a view of its
            bucket (as torch DDP's option): backward accumulates into the bucket and the average is
            written there, one copy and one gradient's memory fewer. ``zero_grad(set_to_none=True)``
            drops the views; the next backward copies in once and views again.
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
        gradient_as_bucket_view: bool = False,
    ) -> None:
        super().__init__()
        JoinableDDP.__init__(self)  # join(): uneven inputs (see _join.py)
        refuse_sparse_gradients(module)
        self.module = module
        self.message_size = message_size
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.compress_bf16 = compress_bf16
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.world_size = dist.get_world_size()
        named = list(module.named_parameters())
        self._names = [name for name, _ in named]
        self._params = [p for _, p in named]
        self._replicated_buffers = list(module.buffers())
        self._sync_enabled = True  # toggled by no_sync()
        self._sync_this_backward = True  # captured at forward, as torch DDP does
        self._sync_buffers_next_forward = True  # torch DDP's require_forward_param_sync
        self._divide_by_initial_world_size = True  # set by join()
        self._divide_by = float(self.world_size)  # in join(divide_by_initial_world_size=False): the ranks still in
        self._plan_key: tuple[bool, ...] | None = None  # requires_grad flags the plan was built for
        self._buckets: list[Bucket] = []
        self._bucket_of: dict[int, Bucket] = {}
        self._arrived: dict[int, None] = {}  # this backward's parameters, in hook order
        self._next_bucket = 0  # buckets before this one are launched in this backward
        self._end_queued = False
        self._hooked: set[int] = set()
        tensors = [*self._params, *self._replicated_buffers]
        device = tensors[0].device if tensors else torch.device("cpu")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._backward_clock = BackwardClock(device)
        broadcast_from_rank0(tensors)
        self._hook_trainable()

    def _hook_trainable(self) -> None:
        # A frozen parameter cannot take a hook; one unfrozen after wrapping gets it at its next forward.
        for index, param in enumerate(self._params):
            if param.requires_grad and index not in self._hooked:
                param.register_post_accumulate_grad_hook(self._make_hook(index))
                self._hooked.add(index)

    def forward(self, *args, **kwargs):
        key = tuple(p.requires_grad for p in self._params)
        if key != self._plan_key:  # first step, or layers were (un)frozen: record the order again
            self._hook_trainable()
            self._plan_key, self._buckets, self._bucket_of = key, [], {}
        ranks_in = Join.notify_join_context(self)  # None outside join()
        self._divide_by = float(self.world_size)
        if ranks_in is not None and not self._divide_by_initial_world_size:
            ranks_in.wait()
            self._divide_by = ranks_in.result()[0].item()
        if self._broadcasts_buffers_next_forward():
            sync_buffers(self, candidate=True)
        grad_enabled = torch.is_grad_enabled()
        if self._join_config.enable:  # tells the joined ranks whether to shadow this backward
            announce_backward_sync(self, float(grad_enabled and self._sync_enabled))
        self._sync_buffers_next_forward = grad_enabled and self._sync_enabled
        if grad_enabled:
            self._sync_this_backward = self._sync_enabled
        output = self.module(*args, **kwargs)
        if grad_enabled and self._sync_enabled:
            self._backward_clock.mark("compute_start")  # where torch DDP's reducer starts its backward's clock
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._on_output_grad)
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward and backward inside this block only accumulate local gradients (accumulation)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _get_ddp_logging_data(self) -> dict[str, int]:
        """torch DDP's backward counters under its names and units (ns): compute, communication and their
        overlap, averaged over every synchronised backward (timing.py)."""
        return self._backward_clock.averages_ns()

    def _broadcasts_buffers_next_forward(self) -> bool:
        return self.broadcast_buffers and self._sync_buffers_next_forward and bool(self._replicated_buffers)

    @property
    def bucket_plan(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order (empty until the first synchronised backward)."""
        return [[self._names[i] for i in bucket.indices] for bucket in self._buckets]

    @property
    def bucket_buffers(self) -> list[torch.Tensor]:
        """The flat buffers gradients are copied into and sent from (and compress_bf16's bf16 copies of
        every rank's): memory this wrapper holds besides ``.grad`` (empty until the first backward)."""
        return [t for bucket in self._buckets for t in (bucket.buffer, *bucket.wire)]

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._queue_end_of_backward()

    def _queue_end_of_backward(self) -> None:
        # No public API runs code when a backward pass ends. torch DDP (_DDPSink) and FSDP (its
        # pre-backward hook) queue a callback on the autograd engine, which runs it after the last
        # gradient of the current graph task; so does this. Queued when backward first reaches this
        # wrapper's outputs, the task is the backward the user called, not a nested one (re-entrant
        # activation checkpointing runs a backward inside it); a parameter's hook queues it for a
        # backward that did not start from the outputs.
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
            if bucket is None:  # no plan yet: this backward only records the order
                return
            bucket.pending -= 1
            if self.overlap:
                self._launch_ready_buckets()

        return hook

    def _launch_ready_buckets(self, everything: bool = False) -> None:
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if bucket.pending and not everything:
                return
            self._launch(bucket)
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        self._backward_clock.mark("comm_start")  # the first bucket's counts
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext(), torch.no_grad():
            bucket.send(self._params, self._divide_by)

    def _end_of_backward(self) -> None:
        self._end_queued = False
        if not self._arrived:  # e.g. autograd.grad() through the outputs: no .grad was written
            return
        self._backward_clock.mark("compute_end")
        try:
            if not self._buckets:
                self._build_plan()
            missing = [self._names[i] for i in self._bucket_of if i not in self._arrived]
            if missing and not self.find_unused_parameters:
                raise RuntimeError(
                    f"parameters that require grad got no gradient in this backward: {', '.join(missing)}. "
                    "Use them in forward, set requires_grad=False, or pass find_unused_parameters=True."
                )
            self._launch_ready_buckets(everything=True)
            used = self._used_anywhere() if self.find_unused_parameters else None
            with record_function("DistributedDataParallel.wait"):
                self._wait_and_write_back(used)
            self._backward_clock.mark("comm_end")
        finally:
            for bucket in self._buckets:
                bucket.pending, bucket.work = len(bucket.indices), None
            self._arrived, self._next_bucket = {}, 0

    def _used_anywhere(self) -> list[bool]:
        # After every bucket, so that all ranks issue their collectives in the same order.
        counts = torch.zeros(len(self._params), dtype=torch.int32, device=self._buckets[0].buffer.device)
        counts[list(self._arrived)] = 1
        dist.all_reduce(counts)
        return [bool(count) for count in counts.tolist()]

    @torch.no_grad()
    def _wait_and_write_back(self, used: list[bool] | None) -> None:
        for bucket in self._buckets:
            bucket.wait()
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        for bucket in self._buckets:
            bucket.write_back(self._params, used, self.gradient_as_bucket_view)

    def _build_plan(self) -> None:
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        order = agreed_order(list(self._arrived), trainable)
        self._buckets = build_buckets(order, self._params, self.message_size, self.compress_bf16, self.world_size)
        self._bucket_of = {i: bucket for bucket in self._buckets for i in bucket.indices}
        if dist.get_backend() == "gloo" and any(b.buffer.dtype == torch.float16 for b in self._buckets):
            warnings.warn(
                "fp16 gradients on gloo: gloo sums fp16 slowly and with fp16 rounding; "
                "prefer bf16 or fp32 gradients on CPU",
                stacklevel=2,
            )


def _tensors(output) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or lists, tuples and dicts of them)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for item in output for t in _tensors(item)]
    return []
