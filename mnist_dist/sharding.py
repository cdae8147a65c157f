"""Which samples each rank sees: the same global batches in every mode, split across ranks.

A global batch is a slice of one seeded permutation per epoch; rank r takes the r-th of its
``world_size`` equal parts. So single mode and N ranks see identical global batches, and averaging
the ranks' gradients gives exactly the single-process gradient of that batch (the property the
equivalence tests check). The last incomplete global batch is dropped so that every rank and mode
takes the same number of equal steps.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The permutation of epoch ``epoch``: a function of (seed, epoch) alone, identical on every rank."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def steps_per_epoch(num_samples: int, global_batch: int) -> int:
    return num_samples // global_batch


def rank_batches(order: torch.Tensor, global_batch: int, rank: int, world_size: int) -> Iterator[torch.Tensor]:
    """This rank's indices for each global batch of ``order``, disjoint from every other rank's."""
    per_rank = global_batch // world_size
    for step in range(steps_per_epoch(len(order), global_batch)):
        start = step * global_batch + rank * per_rank
        yield order[start : start + per_rank]


def eval_shard(num_samples: int, rank: int, world_size: int) -> slice:
    """A contiguous share of the test set with no padding, so summed counts cover each sample once
    (DistributedSampler pads by repeating samples, which skews accuracy: pytorch/pytorch#25162)."""
    return slice(num_samples * rank // world_size, num_samples * (rank + 1) // world_size)
