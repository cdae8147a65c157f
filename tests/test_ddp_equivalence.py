"""Our DistributedDataParallel against torch DDP (the oracle) and one process, pattern by pattern.

One spawned job per world size runs every pattern of ddp_patterns.py with both wrappers (process
start-up dominates on a small machine); each pattern is then its own test over those results. A hang
fails: collectives time out after 60 s.
"""

from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
from ddp_patterns import PATTERNS, Plain, run_all
from helpers import run_ranks
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.parallel.ddp import DistributedDataParallel  # the core, as people copy it

pytestmark = pytest.mark.slow
WORLD_SIZES = [2, 3, 4]


def lone(wrapper):
    """``wrapper`` at a bucket cap of about a byte, whatever the pattern asks: every gradient a bucket of its own."""
    return lambda module, **kwargs: wrapper(module, **{**kwargs, "bucket_cap_mb": 1e-6})


WRAPPERS = {
    "ours": DistributedDataParallel,
    "torch": TorchDDP,
    "ours_as_views": partial(DistributedDataParallel, gradient_as_bucket_view=True),
    "ours_lone": lone(DistributedDataParallel),
    "torch_lone": lone(TorchDDP),
}
# Every pattern with our default wrapper against torch's on each world size; its variants (gradients as bucket
# views, a bucket per gradient) on an odd one: what they change does not depend on how many ranks there are.
VARIANTS_ON = 3


def job(rank, world_size):
    # run_ranks joined the default group (which both wrappers use) with gloo's 30-minute timeout.
    dist.distributed_c10d.set_timeout(timedelta(seconds=60))
    names = list(WRAPPERS) if world_size == VARIANTS_ON else ["ours", "torch"]
    return {name: run_all(rank, world_size, WRAPPERS[name]) for name in names}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=[f"{n}ranks" for n in WORLD_SIZES])
def ranks(request, tmp_path_factory):
    """(world size, every rank's results) for one spawned job."""
    world_size = request.param
    return world_size, run_ranks(job, world_size, tmp_path_factory.mktemp(f"equivalence{world_size}"))


def single(name):
    return PATTERNS[name](0, 1, Plain)


def assert_same(actual: dict, expected: dict, what: str, bitwise: bool = False) -> None:
    """Equal results; ``bitwise``: to the last bit (against torch DDP, which issues the same collectives on
    the same bucket layouts), else within float rounding (one process sums in another order)."""
    assert "error" not in actual, f"{what}: {actual['error']}"
    assert "error" not in expected, f"{what} (reference): {expected['error']}"
    assert actual.keys() == expected.keys(), what
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_same(actual[key], value, f"{what}/{key}", bitwise)
        elif isinstance(value, torch.Tensor):
            tolerance = {"rtol": 0, "atol": 0} if bitwise else {"rtol": 1e-5, "atol": 1e-7}
            torch.testing.assert_close(actual[key], value, **tolerance, msg=f"{what}/{key}")
        else:
            assert actual[key] == value, f"{what}/{key}"


AS_TORCH_AND_SINGLE = [
    "plain_steps",
    "tied_weights",
    "dtype_mix",
    "accumulation_without_no_sync",
    "frozen_at_wrap",
    "activation_checkpointing_reentrant",
    "unused_on_every_rank",
    "small_bucket_caps",
    "late_freezing_and_unfreezing",
    "non_contiguous_parameters",
]
# rank-dependent, or each rank's micro-batches: no one-process twin
AS_TORCH = ["arrival_order_differs_across_ranks", "unused_on_some_ranks"]
# Buffers follow rank 0's at torch DDP's moments: compared with torch DDP rank by rank.
AS_TORCH_BY_RANK = [
    "batchnorm_eval_between_steps",
    "batchnorm_no_sync_micro_batches",
    "batchnorm_without_broadcast_buffers",
    "batchnorm_buffer_rebound_after_wrapping",
]


@pytest.mark.parametrize("name", AS_TORCH_AND_SINGLE + AS_TORCH + AS_TORCH_BY_RANK)
def test_same_as_torch_ddp(ranks, name):
    world_size, results = ranks
    for wrapper in [w for w in results[0] if w.startswith("ours")]:
        reference = "torch_lone" if wrapper == "ours_lone" else "torch"  # the same buckets: torch's, at its cap
        for rank in range(world_size):
            what = f"{wrapper}, rank {rank}"
            assert_same(results[rank][wrapper][name], results[rank][reference][name], what, bitwise=True)
        if name in AS_TORCH_AND_SINGLE:
            reference = single(name)
            for rank in range(world_size):
                assert_same(results[rank][wrapper][name], reference, f"{wrapper}, rank {rank} vs one process")


@pytest.mark.parametrize("name", ["frozen_at_wrap_then_unfrozen", "retain_graph_second_backward"])
def test_where_torch_ddp_leaves_ranks_apart_ours_equals_one_process(ranks, name):
    world_size, results = ranks
    reference = single(name)
    for rank in range(world_size):
        assert_same(results[rank]["ours"][name], reference, f"rank {rank} vs one process")
    # The documented difference: torch DDP's ranks end up with other parameters.
    last = results[world_size - 1]["torch"][name]["params"]
    assert any(not torch.allclose(last[n], p) for n, p in results[0]["torch"][name]["params"].items())
