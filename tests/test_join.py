"""join() on uneven inputs: our DistributedDataParallel against torch DDP's join(), on 3 ranks whose numbers of
batches differ (two join early, at different steps); with buffers, no_sync() and unused parameters; the replicas
end equal."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import run_batch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from mnist_dist.parallel import DistributedDataParallel

# spawned ranks: out of `-m "not slow"`, which keeps test_ddp.py's one job of our DDP against one process
pytestmark = pytest.mark.slow


class Net(nn.Module):
    """BatchNorm (buffers) and a branch used on some steps only (unused parameters)."""

    def __init__(self, extra: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU())
        self.head = nn.Linear(8, 3)
        self.extra = nn.Linear(8, 3) if extra else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + (self.extra(h) if use_extra else 0)


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(10 + rank)
    return [
        (torch.randn(5, 6, generator=generator), torch.randint(0, 3, (5,), generator=generator))
        for _ in range(3 + 2 * rank)  # rank 0: 3 batches, rank 1: 5, rank 2: 7
    ]


def train(rank: int, world_size: int, wrapper: str, pattern: str) -> dict:
    torch.manual_seed(0)
    unused = pattern == "unused"
    net = Net(extra=unused)
    model = {"ours": DistributedDataParallel, "torch": TorchDDP}[wrapper](net, find_unused_parameters=unused)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with model.join(divide_by_initial_world_size=pattern != "effective"):
        for step, (x, y) in enumerate(batches(rank)):
            accumulate = pattern == "no_sync" and step % 2 == 0
            if accumulate:
                with model.no_sync():
                    F.cross_entropy(model(x), y).backward()
                continue
            F.cross_entropy(model(x, use_extra=unused and step % 2 == 1), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    state = {name: tensor.detach().clone() for name, tensor in net.state_dict().items()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, state)
    return {"state": state, "replicas_equal": all(_equal(other, state) for other in everyone)}


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a[key], b[key]) for key in a)


PATTERNS = ["initial", "effective", "no_sync", "unused"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    calls = {(w, p): (train, w, p) for w in ("ours", "torch") for p in PATTERNS}
    return run_batch(calls, 3, tmp_path_factory.mktemp("join"))


@pytest.mark.parametrize("pattern", PATTERNS)
def test_join_equals_torch_ddps_join_and_the_replicas_end_equal(ranks, pattern):
    for ours, torchs in zip(ranks["ours", pattern], ranks["torch", pattern]):
        assert ours["replicas_equal"] and torchs["replicas_equal"]
        for key, value in torchs["state"].items():
            torch.testing.assert_close(ours["state"][key], value, rtol=0, atol=1e-5, msg=key)
