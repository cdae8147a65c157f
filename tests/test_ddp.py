"""Our DistributedDataParallel, on 2 gloo ranks, against plain single-process autograd."""

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_patterns import Heads
from helpers import Raised, run_batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.model import ConvNet
from mnist_dist.parallel import DistributedDataParallel
from mnist_dist.parallel import ddp as core

GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every check's rank functions in one 2-rank job (starting ranks costs seconds): ``ranks(key)``, by rank."""
    results = run_batch(
        {
            "grads": (ddp_step,),
            "unused": (unused_parameter,),
            "signature": (torch_signature,),
            "shapes differ": (shapes_differ,),
            "views": (gradients_as_bucket_views,),
            "shared": (shared_across_checkpoint,),
            "all checkpointed": (all_checkpointed,),
        },
        2,
        tmp_path_factory.mktemp("ddp"),
    )

    def get(key: str) -> list:
        assert not any(isinstance(r, Raised) for r in results[key]), results[key]
        return results[key]

    return get


def batch(seed: int = 0, n: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def model():
    torch.manual_seed(0)
    return ConvNet(dropout=False)


def single_step_grads():
    net = model()
    x, y = batch()
    F.cross_entropy(net(x), y).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def ddp_step(rank, world_size):
    torch.manual_seed(rank + 100)  # different init per rank: the wrapper must broadcast rank 0's
    net = ConvNet(dropout=False)
    if rank == 0:
        net.load_state_dict(model().state_dict())
    ddp = DistributedDataParallel(net, bucket_cap_mb=0.05)
    x, y = batch()
    for _ in range(2):  # step 1 records the order, step 2 runs on the fixed bucket plan
        net.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}, len(ddp._buckets)


def test_gradients_equal_single_process_on_global_batch(ranks):
    # the fast tier's one check of our DDP against one process; every pattern, bitwise: test_ddp_equivalence.py
    expected = single_step_grads()
    for grads, buckets in ranks("grads"):
        assert buckets >= 3
        for name, grad in grads.items():
            torch.testing.assert_close(grad, expected[name], rtol=1e-6, atol=1e-7, msg=name)


def unused_parameter(rank, world_size):
    ddp = DistributedDataParallel(Heads())
    x = torch.randn(4, 8)
    try:
        for _ in range(2):
            ddp.zero_grad()
            # Both ranks skip the spare head, so neither waits in a collective the other never joins.
            ddp(x, use_spare=False).sum().backward()
    except RuntimeError as error:
        return str(error)


def test_unused_parameter_is_named(ranks):
    # allowed (find_unused_parameters=True): test_ddp_equivalence.py's unused_on_some_ranks, against torch DDP
    for message in ranks("unused"):
        assert "spare.weight" in message and "spare.bias" in message
        assert "find_unused_parameters" in message
        assert "body.weight" not in message


def torch_signature(rank, world_size):
    """torch DDP's constructor: its positional order, its own refusals, and ours of what this one does not do."""
    calls = {
        "positional": lambda: core.DistributedDataParallel(Heads(), None, None, 0, False, True, dist.group.WORLD, 25),
        "device_ids on cpu": lambda: core.DistributedDataParallel(Heads(), [rank]),
        "static_graph": lambda: core.DistributedDataParallel(Heads(), static_graph=True),
        "mixed_precision": lambda: core.DistributedDataParallel(Heads(), mixed_precision=object()),
        "device_mesh": lambda: core.DistributedDataParallel(Heads(), device_mesh=object()),
        "parameterless": lambda: core.DistributedDataParallel(nn.BatchNorm1d(8, affine=False)),
        "parameterless, torch's": lambda: TorchDDP(nn.BatchNorm1d(8, affine=False)),
        "sparse": lambda: core.DistributedDataParallel(nn.Sequential(nn.Embedding(10, 2, sparse=True))),
    }
    said = {}
    for key, call in calls.items():
        try:
            model = call()
            said[key] = (model.forward_sync_buffers, model.process_group is dist.group.WORLD)
        except (ValueError, NotImplementedError, RuntimeError) as error:
            said[key] = f"{type(error).__name__}: {error}"
    return said


def test_torch_ddp_constructor_in_its_order_and_what_is_not_supported_refused_by_name(ranks):
    for said in ranks("signature"):
        assert said["positional"] == (False, True)  # broadcast_buffers=False, process_group: 5th and 7th
        assert said["device_ids on cpu"].startswith("ValueError: device_ids")  # as torch's, on a CPU module
        for name in ("static_graph", "mixed_precision", "device_mesh"):
            assert said[name].startswith(f"NotImplementedError: {name}: not supported")
        for key in ("parameterless", "parameterless, torch's"):
            assert "doesn't have any parameter that requires a gradient" in said[key]
        assert said["sparse"].startswith("ValueError: 0.weight gets sparse gradients")  # torch's takes them


def shapes_differ(rank, world_size):
    try:
        core.DistributedDataParallel(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2 + rank)))
    except RuntimeError as error:
        return str(error)


def test_parameters_whose_shapes_differ_across_ranks_are_refused_naming_one(ranks):
    for message in ranks("shapes differ"):
        assert "DDP expects same model across all ranks" in message and "1.weight" in message


class SharedAcrossCheckpoint(nn.Module):
    """One layer used outside and inside a re-entrant checkpoint: two gradients in one backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(8, 8)

    def forward(self, x):
        h = self.shared(x).tanh()
        return torch.utils.checkpoint.checkpoint(self.shared, h, use_reentrant=True)


def shared_across_checkpoint(rank, world_size):
    ddp = DistributedDataParallel(SharedAcrossCheckpoint(), bucket_cap_mb=1e-6)  # every gradient a bucket
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    try:
        for _ in range(2):  # the second backward runs on the bucket plan
            ddp.zero_grad()
            ddp(x).sum().backward()
    except RuntimeError as error:
        return str(error)
    return ddp.module.shared.weight.grad.clone()


def test_second_gradient_in_one_backward_after_its_bucket_was_sent_is_refused(ranks):
    for message in ranks("shared"):
        assert re.match(r"shared\.(weight|bias) got a second gradient.*use_reentrant=False", message)


def gradients_as_bucket_views(rank, world_size):
    ddp = DistributedDataParallel(Heads(), gradient_as_bucket_view=True)  # one bucket: a flat buffer
    x = torch.randn(4, 8) * (rank + 1)
    seen = []
    for set_to_none in (True, True, False, False):  # the first backward records the plan
        ddp.zero_grad(set_to_none=set_to_none)
        ddp(x, use_spare=True).sum().backward()
        buffers = [bucket.buffer for bucket in ddp._buckets]
        seen.append(
            [
                any(b.data_ptr() <= p.grad.data_ptr() < b.data_ptr() + b.numel() * b.element_size() for b in buffers)
                for p in ddp.parameters()
            ]
        )
    return seen, [p.grad.clone() for p in ddp.parameters()]


def test_gradients_become_views_of_their_buckets_and_stay_averaged(ranks):
    results = ranks("views")
    for seen, _ in results:
        assert seen[1:] == [[True] * 6] * 3  # from the second backward on, every .grad lives in a bucket
    (_, grads0), (_, grads1) = results
    for mine, other in zip(grads0, grads1):
        torch.testing.assert_close(mine, other)  # the average, the same on both ranks


class AllCheckpointed(nn.Linear):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=True)


def all_checkpointed(rank, world_size):
    ddp = DistributedDataParallel(AllCheckpointed(8, 8))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    try:
        for _ in range(2):  # the graph outside the checkpoint reaches no parameter
            ddp(x).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "averaged nothing, silently"


def test_a_backward_that_reaches_parameters_only_through_a_nested_one_is_refused_at_the_next_forward(ranks):
    for message in ranks("all checkpointed"):
        assert re.search(r"never averaged.*use_reentrant=False", message)
