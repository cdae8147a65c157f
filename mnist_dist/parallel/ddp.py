"""A hand-written DistributedDataParallel in one file that imports only torch: copy it beside your script.

    model = DistributedDataParallel(model.to(device))   # after init_process_group; torch DDP's arguments
    loss_fn(model(x), y).backward()                     # .grad now holds the average over the ranks

It issues torch's C++ reducer's collectives on the same buckets: the same bits. Where it differs from torch DDP:
docs/ddp.md in mnist_dist; ddp_extras.py adds join() and more.
"""

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from itertools import accumulate

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.profiler import record_function


@torch.no_grad()
def broadcast_from(tensors: list[torch.Tensor], src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Rank ``src``'s ``tensors`` to all (a collective), one broadcast per device and dtype: one latency for many."""
    for key in dict.fromkeys((tensor.device, tensor.dtype) for tensor in tensors):  # in order: the same on all ranks
        same = [tensor for tensor in tensors if (tensor.device, tensor.dtype) == key]
        flat = torch.cat([tensor.reshape(-1) for tensor in same])
        dist.broadcast(flat, group=group, group_src=src)
        for tensor, part in zip(same, flat.split([tensor.numel() for tensor in same])):
            tensor.copy_(part.view_as(tensor))


def _view(flat: torch.Tensor, param: torch.Tensor, offset: int) -> torch.Tensor:
    # As torch's bucket views, the parameter's own layout where dense: gloo then adds each element in torch's order
    dims = sorted((stride, size) for size, stride in zip(param.shape, param.stride()) if size != 1)
    if all(stride == math.prod(size for _, size in dims[:k]) for k, (stride, _) in enumerate(dims)):
        return flat.as_strided(param.shape, param.stride(), offset)
    return flat[offset : offset + param.numel()].view(param.shape)


class Bucket:
    """Gradients that travel together: this rank's share of their average in, the sum over the ranks out."""

    def __init__(self, indices: list[int], params: list[torch.Tensor]) -> None:
        self.indices, self.pending, self.work = indices, len(indices), None
        sizes = [params[i].numel() for i in indices]
        self.buffer = params[indices[0]].new_empty(sum(sizes))
        self.views = [_view(self.buffer, params[i], o) for i, o in zip(indices, accumulate(sizes, initial=0))]

    def send(self, params: list[torch.Tensor], scale: float, group: dist.ProcessGroup) -> None:
        for i, view in zip(self.indices, self.views):
            grad = params[i].grad
            if grad is None:  # unused here, or left undefined by autograd: contribute zeros
                view.zero_()
            elif grad.data_ptr() == view.data_ptr():  # already there (gradient_as_bucket_view)
                view.mul_(scale)
            else:  # the copy and the scaling in one pass, as torch's reducer (mul_out)
                torch.mul(grad, scale, out=view)
        self.work = dist.all_reduce(self.buffer, group=group, async_op=True)

    def write_back(self, params: list[torch.Tensor], used: list[bool] | None, as_view: bool) -> None:
        for i, view in zip(self.indices, self.views):
            if used is not None and not used[i] or not params[i].requires_grad:  # .grad untouched, as torch DDP
                continue
            if params[i].grad is None or as_view:
                params[i].grad = view if as_view else view.clone()
            elif params[i].grad.data_ptr() != view.data_ptr():  # else it was reduced where it lies
                params[i].grad.copy_(view)


def assign(order: list[int], params: list[torch.Tensor], caps: list[int]) -> list[list[int]]:
    """torch's compute_bucket_assignment_by_size: per dtype and device, ``order`` fills buckets to ``caps`` in turn."""
    buckets, open_ = [], {}  # open_: (dtype, device) -> (indices, bytes, which cap)
    for i in order:
        key = (params[i].dtype, params[i].device)
        indices, size, cap = open_.get(key, ([], 0, 0))
        indices, size = [*indices, i], size + params[i].numel() * params[i].element_size()
        if size >= caps[cap]:
            buckets.append(indices)
            indices, size, cap = [], 0, min(cap + 1, len(caps) - 1)
        open_[key] = (indices, size, cap)
    return buckets + [indices for indices, _, _ in open_.values() if indices]


UNSUPPORTED = ["static_graph", "delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision"]
UNSUPPORTED += ["device_mesh", "skip_all_reduce_unused_params", "bucket_cap_mb_list", "batched_grad_copy"]


class DistributedDataParallel(nn.Module):
    """Averages gradients over ``process_group`` by bucketed all-reduce overlapped with backward; torch DDP's
    arguments in its order, those in UNSUPPORTED refused when given (not None or False)."""

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim=0, broadcast_buffers=None,
                 init_sync=True, process_group=None, bucket_cap_mb=None, find_unused_parameters=False,
                 check_reduction=False, gradient_as_bucket_view=False, static_graph=False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                 device_mesh=None, skip_all_reduce_unused_params=False, bucket_cap_mb_list=None,
                 batched_grad_copy=False, forward_sync_buffers=None) -> None:  # fmt: skip
        super().__init__()
        arguments = locals()
        if refused := [name for name in UNSUPPORTED if arguments[name] not in (None, False)]:
            raise NotImplementedError(f"{', '.join(refused)}: not supported here; use torch's DistributedDataParallel")
        if sparse := [n for n, m in module.named_modules() if getattr(m, "sparse", False) and m.weight.requires_grad]:
            raise ValueError(f"{sparse[0]}.weight".lstrip(".") + " gets sparse gradients, which this DDP does not "
                             "average; use sparse=False, or torch's DistributedDataParallel")  # fmt: skip
        devices = {p.device for p in module.parameters()}
        on_one_gpu = len(devices) == 1 and next(iter(devices)).type != "cpu" and len(device_ids or []) <= 1
        if (device_ids or output_device is not None) and not on_one_gpu:
            raise ValueError(f"device_ids (one at most) and output_device are for a module on one GPU, not {devices}")
        self.device_ids = [torch.device("cuda", d).index for d in device_ids] if device_ids else None
        self.module, self.find_unused_parameters = module, find_unused_parameters
        self.process_group = process_group or dist.group.WORLD
        sync_buffers = broadcast_buffers if forward_sync_buffers is None else forward_sync_buffers
        self.forward_sync_buffers = sync_buffers is not False  # None: torch's default, True
        self.gradient_as_bucket_view, self.world_size = gradient_as_bucket_view, dist.get_world_size(process_group)
        self._caps = [2**20, 25 * 2**20] if bucket_cap_mb is None else [int(bucket_cap_mb * 2**20)]  # torch's default
        self._names, self._params = [list(column) for column in zip(*module.named_parameters())] or ([], [])
        if not any(p.requires_grad for p in self._params):  # as torch's: nothing to average
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any parameter "
                               "that requires a gradient")  # fmt: skip
        # no_sync()'s switch; as torch DDP, forward decides if its backward syncs and the next forward syncs buffers
        self._sync_enabled = self._sync_this_backward = self._sync_buffers_next_forward = True
        self._scale, self._rebuilt, self._device = 1.0 / self.world_size, find_unused_parameters, self._params[0].device
        self._buckets, self._bucket_of, self._hooked = [], {}, set()
        # This backward: arrivals in order, next bucket, awaited, nested ones running; used since the last sync
        self._arrived, self._next_bucket, self._expected, self._nested, self._used = {}, 0, set(), [], set()
        if init_sync:  # as torch's: parameters whose shapes differ across ranks would average the wrong elements
            shapes = [(n, tuple(p.shape)) for n, p in zip(self._names, self._params)]
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, shapes, group=self.process_group)
            for rank, theirs in enumerate(everyone):
                if diff := next(((a, b) for a, b in zip([*theirs, None], [*everyone[0], None]) if a != b), None):
                    raise RuntimeError(f"DDP expects same model across all ranks; rank {rank}: {diff[0]}, 0: {diff[1]}")
            init_buffers = forward_sync_buffers is not None or broadcast_buffers is not False  # torch's rule
            broadcast_from([*self._params, *(module.buffers() if init_buffers else [])], 0, process_group)

    def __getstate__(self) -> dict:  # as torch DDP's: a process group does not pickle (torch.save, deepcopy)
        return {key: value for key, value in self.__dict__.items() if key != "process_group"}

    def __setstate__(self, state: dict) -> None:  # a copy's parameters have no hooks yet: planned afresh
        super().__setstate__(state)
        self.process_group, self._buckets, self._bucket_of, self._hooked = dist.group.WORLD, [], {}, set()

    def forward(self, *args, **kwargs):
        if self._arrived:  # its parameters were reached only inside a nested backward: no end was seen
            raise RuntimeError("the last backward's gradients were never averaged: its graph reaches parameters only "
                               "through a re-entrant checkpoint; checkpoint with use_reentrant=False")  # fmt: skip
        self._ensure_plan()
        grad_enabled = torch.is_grad_enabled()
        sync = grad_enabled and self._sync_enabled
        self._before_module(sync)
        self._sync_buffers_next_forward = sync
        self._sync_this_backward = self._sync_enabled if grad_enabled else self._sync_this_backward
        if self.device_ids:  # as torch's: tensor inputs go to the module's GPU
            args = [a.to(self._device) if isinstance(a, torch.Tensor) else a for a in args]
            kwargs = {k: v.to(self._device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        output = self.module(*args, **kwargs)
        for tensor in _tensors(output) if sync else []:  # a backward from there awaits what its graph reaches
            tensor.register_hook(lambda _, node=tensor.grad_fn: self._expect(node))
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def _ensure_plan(self) -> None:
        # At the first forward, and when one in no bucket was unfrozen; one frozen later keeps its place (zeros)
        trainable = [i for i, p in enumerate(self._params) if p.requires_grad]
        if all(i in self._bucket_of for i in trainable):
            return
        for i in set(trainable) - self._hooked:  # not at wrap time: a frozen one takes no hook
            self._params[i].register_post_accumulate_grad_hook(partial(self._on_gradient, i))
        self._hooked.update(trainable)
        # torch's first layout, buckets by first parameter reversed: one per dtype (find_unused_parameters: capped)
        caps = self._caps if self.find_unused_parameters else [2**62]
        self._plan(sorted(assign(trainable, self._params, caps), key=min, reverse=True))
        self._rebuilt = self.find_unused_parameters

    def _rebuild(self) -> None:
        # The same buckets on every rank (or collectives mix tensors up): rank 0's arrival order, then the rest reversed
        agreed = [list(self._arrived)]
        dist.broadcast_object_list(agreed, group=self.process_group, group_src=0)
        rest = [i for i, p in reversed(list(enumerate(self._params))) if p.requires_grad and i not in agreed[0]]
        self._plan(assign(agreed[0] + rest, self._params, self._caps))
        self._rebuilt = True

    def _plan(self, groups: list[list[int]]) -> None:
        self._buckets = [Bucket(g, self._params) for g in groups]
        self._bucket_of = {i: bucket for bucket in self._buckets for i in bucket.indices}

    def _expect(self, node) -> None:
        # No public hook runs when a backward ends. It has ended for us when every parameter its graph reaches has
        # arrived, but for arrivals inside a Python Function's backward: a re-entrant checkpoint's nested backward.
        index, seen, todo = {id(p): i for i, p in enumerate(self._params)}, {node}, [node]
        while todo:
            node = todo.pop()
            if (i := index.get(id(getattr(node, "variable", None)))) is not None and self._params[i].requires_grad:
                self._expected.add(i)
            if isinstance(node, BackwardCFunction):
                node.register_prehook(lambda _: self._nested.append(1))  # balanced: they go with the graph
                node.register_hook(lambda *_: self._nested.remove(1))
            todo += [next_node for next_node, _ in node.next_functions if next_node not in seen and next_node]
            seen.update(todo)

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        self._used.add(index)
        if not self._sync_this_backward:
            return
        bucket = self._bucket_of.get(index)
        if index not in self._arrived:
            self._arrived[index] = None
            if bucket is not None:
                bucket.pending -= 1
                self._launch_ready_buckets()
        elif bucket is not None and bucket.work is not None:  # a second gradient (re-entrant checkpoint), too late
            raise RuntimeError(
                f"{self._names[index]} got a second gradient in one backward after its bucket was sent; "
                "checkpoint with use_reentrant=False"
            )
        if not self._nested and index in self._expected:
            self._expected.remove(index)
            if not self._expected:
                self._end_of_backward()

    def _launch_ready_buckets(self, everything: bool = False) -> None:
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if bucket.pending and not everything:
                return
            with torch.no_grad():
                bucket.send(self._params, self._scale, self.process_group)
            self._next_bucket += 1

    def _end_of_backward(self) -> None:
        try:
            trained = [i for i in self._bucket_of if self._params[i].requires_grad]
            missing = [self._names[i] for i in trained if i not in self._arrived]
            if missing and not self.find_unused_parameters:
                raise RuntimeError(
                    f"parameters that require grad got no gradient in this backward: {', '.join(missing)}. "
                    "Use them in forward, set requires_grad=False, or pass find_unused_parameters=True."
                )
            self._launch_ready_buckets(everything=True)
            used = None
            if self.find_unused_parameters:  # after every bucket, so that all ranks issue collectives in one order
                counts = torch.zeros(len(self._params), dtype=torch.int32, device=self._device)
                counts[list(self._used)] = 1
                self._wait(dist.all_reduce(counts, group=self.process_group, async_op=True))
                used = [bool(count) for count in counts.tolist()]
            with record_function("DistributedDataParallel.wait"), torch.no_grad():
                for bucket in self._buckets:
                    self._wait(bucket.work)
                for bucket in self._buckets:
                    bucket.write_back(self._params, used, self.gradient_as_bucket_view)
            if not self._rebuilt:
                self._rebuild()
        finally:
            for bucket in self._buckets:
                bucket.pending, bucket.work = len(bucket.indices), None
            self._arrived, self._next_bucket, self._expected, self._nested, self._used = {}, 0, set(), [], set()

    def _wait(self, work: dist.Work) -> None:
        work.wait()

    def _before_module(self, sync: bool) -> None:
        # Rank 0's buffers to all; as torch DDP looked up again, so that one rebound after wrapping is the one synced.
        if self.forward_sync_buffers and self._sync_buffers_next_forward and (buffers := list(self.module.buffers())):
            broadcast_from(buffers, 0, self.process_group)


def _tensors(output) -> list[torch.Tensor]:  # those in an autograd graph
    if isinstance(output, torch.Tensor):
        return [output] if output.grad_fn else []
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else []
    return [t for item in items for t in _tensors(item)]
